"""Capacity accounts, reservations (a django-fsm lifecycle), usage events and the append-only ledger.

Integrity lives in the database: non-negative balances, the output conservation equation
``captured + remaining + released = output_reserved + top_ups``, unique idempotency keys and usage-event ids.
Ledger rows cannot be updated or deleted (a trigger refuses it; see migration 0002).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from django.db import models
from django.db.models import F, Q
from django_fsm import FSMField, FSMModelMixin, transition

from budgeting.catalog.models import ModelPool, ModelRevision, RolloutMode, TaskClass, Tenant
from budgeting.catalog.prices import cost
from ledger.jsonfields import PackedJSONField


class Scope(models.TextChoices):
    TENANT = "TENANT", "Tenant"
    TENANT_TASK = "TENANT_TASK", "Tenant × task class"
    POOL = "POOL", "Model pool (all tenants)"


class Period(models.TextChoices):
    MONTH = "MONTH", "Calendar month (UTC)"
    DAY = "DAY", "Day (UTC)"
    NONE = "NONE", "No period"


class CapacityAccount(models.Model):
    """A budget at one scope. Balances change only through ``ledger.services`` and always with an entry."""

    scope = models.CharField(max_length=12, choices=Scope.choices)
    tenant = models.ForeignKey(
        Tenant, on_delete=models.PROTECT, null=True, blank=True, related_name="accounts"
    )
    task_class = models.ForeignKey(
        TaskClass, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    pool = models.ForeignKey(
        ModelPool, on_delete=models.PROTECT, null=True, blank=True, related_name="accounts"
    )
    period = models.CharField(max_length=5, choices=Period.choices, default=Period.MONTH)
    period_start = models.DateTimeField(help_text="Start of the current period (UTC).")
    input_limit = models.BigIntegerField(null=True, blank=True, help_text="Empty means unlimited.")
    output_limit = models.BigIntegerField(null=True, blank=True, help_text="Empty means unlimited.")
    concurrency_limit = models.IntegerField(null=True, blank=True, help_text="Empty means unlimited.")
    currency = models.CharField(
        max_length=3, default="USD", help_text="ISO 4217 code of the spend limit and spend balances."
    )
    spend_limit = models.BigIntegerField(
        null=True, blank=True, help_text="Micro-units of the currency per period; empty means unlimited."
    )
    input_reserved = models.BigIntegerField(default=0)
    output_reserved = models.BigIntegerField(default=0)
    input_consumed = models.BigIntegerField(default=0)
    output_consumed = models.BigIntegerField(default=0)
    in_flight = models.IntegerField(default=0)
    spend_reserved = models.BigIntegerField(default=0, help_text="Micro-units held.")
    spend_consumed = models.BigIntegerField(default=0, help_text="Micro-units posted this period.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant"], condition=Q(scope="TENANT"), name="account_unique_tenant_scope"
            ),
            models.UniqueConstraint(
                fields=["tenant", "task_class"],
                condition=Q(scope="TENANT_TASK"),
                name="account_unique_tenant_task",
            ),
            models.UniqueConstraint(
                fields=["pool"], condition=Q(scope="POOL"), name="account_unique_pool_scope"
            ),
            models.CheckConstraint(
                condition=(
                    Q(scope="TENANT", tenant__isnull=False, task_class__isnull=True, pool__isnull=True)
                    | Q(
                        scope="TENANT_TASK", tenant__isnull=False, task_class__isnull=False, pool__isnull=True
                    )
                    | Q(scope="POOL", tenant__isnull=True, task_class__isnull=True, pool__isnull=False)
                ),
                name="account_scope_keys",
            ),
            models.CheckConstraint(
                condition=Q(input_reserved__gte=0)
                & Q(output_reserved__gte=0)
                & Q(input_consumed__gte=0)
                & Q(output_consumed__gte=0)
                & Q(in_flight__gte=0),
                name="account_balances_non_negative",
            ),
            models.CheckConstraint(
                condition=Q(spend_reserved__gte=0) & Q(spend_consumed__gte=0),
                name="account_spend_non_negative",
            ),
            models.CheckConstraint(
                condition=(Q(input_limit__isnull=True) | Q(input_limit__gte=0))
                & (Q(output_limit__isnull=True) | Q(output_limit__gte=0))
                & (Q(concurrency_limit__isnull=True) | Q(concurrency_limit__gte=0)),
                name="account_limits_non_negative",
            ),
            models.CheckConstraint(
                condition=Q(spend_limit__isnull=True) | Q(spend_limit__gte=0),
                name="account_spend_limit_non_negative",
            ),
            models.CheckConstraint(condition=Q(currency__regex=r"^[A-Z]{3}$"), name="account_currency_iso"),
        ]

    def __str__(self) -> str:
        return account_label(
            self.scope,
            self.tenant.slug if self.tenant else None,
            self.task_class.slug if self.task_class else None,
            self.pool.slug if self.pool else None,
        )

    @property
    def label(self) -> str:
        return str(self)


# The balance columns of an account, in the order every statement and entry lists them.
BALANCES = (
    "input_reserved",
    "output_reserved",
    "input_consumed",
    "output_consumed",
    "in_flight",
    "spend_reserved",
    "spend_consumed",
)
MONEY_BALANCES = ("spend_reserved", "spend_consumed")
"""Balances in the account's currency: a reservation moves them only on the accounts kept in its own
currency (``ledger/statements.py``); an unpriced reservation moves none."""
CONSUMED_BALANCES = ("input_consumed", "output_consumed", "spend_consumed")
"""Balances of the account's quota period: a roll-over takes them back to zero, so a decrease of one (a
refund, a downward correction) takes from an account no more than the reservation posted into its current
period (``ledger/statements.py``)."""


@dataclass(frozen=True)
class Limit:
    """One dimension an account limits: its ``limit`` column (NULL: unlimited) bounds the sum of its ``used``
    balance columns. ``ledger/statements.py`` writes the SQL predicate of every limit from this table, and
    ``refuses`` is the same predicate in Python (explaining a refusal after the statement refused it)."""

    dimension: str
    limit: str
    used: tuple[str, ...]

    def refuses(self, account: CapacityAccount, added: Mapping[str, int]) -> bool:
        """Whether adding ``added`` (balance column -> amount) to ``account`` breaks this limit. An addition
        that does not increase the used sum never does (a release is never refused)."""
        limit = getattr(account, self.limit)
        requested = self.requested(added)
        return limit is not None and requested > 0 and self.usage(account) + requested > limit

    def usage(self, account: CapacityAccount) -> int:
        return sum(getattr(account, column) for column in self.used)

    def requested(self, added: Mapping[str, int]) -> int:
        return sum(added.get(column, 0) for column in self.used)


LIMITS = (
    Limit("input", "input_limit", ("input_reserved", "input_consumed")),
    Limit("output", "output_limit", ("output_reserved", "output_consumed")),
    Limit("concurrency", "concurrency_limit", ("in_flight",)),
    Limit("spend", "spend_limit", MONEY_BALANCES),
)


def account_label(scope: str, tenant: str | None, task_class: str | None, pool: str | None) -> str:
    """How a person reads an account: "tenant t-19", "tenant t-19 × summarize", "pool eu-large"."""
    if scope == Scope.TENANT:
        return f"tenant {tenant}"
    if scope == Scope.TENANT_TASK:
        return f"tenant {tenant} × {task_class}"
    return f"pool {pool}"


class State(models.TextChoices):
    PROPOSED = "PROPOSED"
    RESERVED = "RESERVED"
    DISPATCHED = "DISPATCHED"
    RUNNING = "RUNNING"
    PARTIALLY_SETTLED = "PARTIALLY_SETTLED"
    SETTLED = "SETTLED"
    REJECTED = "REJECTED"
    RECONCILING = "RECONCILING"


class Outcome(models.TextChoices):
    COMPLETED = "COMPLETED"
    RELEASED = "RELEASED"
    RECONCILED = "RECONCILED"


IN_CALL = [State.DISPATCHED, State.RUNNING]
AFTER_DISPATCH = [State.DISPATCHED, State.RUNNING, State.PARTIALLY_SETTLED]


def new_reservation_id() -> uuid.UUID:
    """A new reservation's id: a UUID whose first 48 bits are the Unix time in milliseconds, then 74 random
    bits (RFC 9562's version 7).

    The reservation's id leads the keys of the indexes an admission writes (the reservation's primary key,
    its holds' and entries', later its usage events' and top-ups'). Random ids (version 4) put each
    admission's entries on leaf pages of their own, all over indexes that grow with the ledger: on a large
    one these pages were seldom in shared buffers, so an admission read about five (evicting as many, each
    written out first when dirty) and wrote each one whole to the WAL after a checkpoint (bench/README.md).
    Ids that grow with time are written next to the last ones, on pages already in memory. The random bits
    keep ids unguessable (a reservation is found only within its caller's tenants in any case); an
    application server's clock going back costs only that locality."""
    millis = time.time_ns() // 1_000_000
    bits = int.from_bytes(os.urandom(10), "big")
    rand_a, rand_b = (bits >> 62) & 0xFFF, bits & ((1 << 62) - 1)
    return uuid.UUID(int=(millis & ((1 << 48) - 1)) << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b)


class Reservation(FSMModelMixin, models.Model):
    """One admitted (or queued, or rejected) request and its holds. Transitions only set fields."""

    id = models.UUIDField(primary_key=True, default=new_reservation_id, editable=False)
    # No index of its own: the idempotency key's unique constraint (tenant, idempotency_key) leads with it.
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="reservations", db_index=False)
    task_class = models.ForeignKey(TaskClass, on_delete=models.PROTECT, related_name="+")
    model_pool = models.ForeignKey(ModelPool, on_delete=models.PROTECT, related_name="+")
    # No index of its own: the billing buckets' index (model_revision, dispatched_at) leads with it.
    model_revision = models.ForeignKey(
        ModelRevision, on_delete=models.PROTECT, related_name="+", db_index=False
    )
    request_id = models.CharField(max_length=128)
    idempotency_key = models.CharField(max_length=200)
    rendered_digest = models.CharField(max_length=71)
    admitted_digest = models.CharField(max_length=71)
    manifest = models.ForeignKey(
        "budgeting.Manifest", on_delete=models.PROTECT, null=True, blank=True, related_name="reservations"
    )
    policy_revision = models.PositiveIntegerField(null=True, blank=True)
    rung = models.CharField(max_length=32, default="FULL")
    mode = models.CharField(max_length=8, choices=RolloutMode.choices, default=RolloutMode.ENFORCE)

    state = FSMField(default=State.PROPOSED, choices=State.choices, protected=True)
    outcome = models.CharField(max_length=10, choices=Outcome.choices, blank=True)

    input_reserved = models.BigIntegerField(default=0)
    input_consumed = models.BigIntegerField(default=0)
    input_reported = models.BigIntegerField(
        null=True, blank=True, help_text="Input tokens the provider reported."
    )
    output_reserved = models.BigIntegerField(default=0)
    top_ups = models.BigIntegerField(default=0)
    captured = models.BigIntegerField(default=0)
    remaining = models.BigIntegerField(default=0)
    released = models.BigIntegerField(default=0)
    overrun = models.BigIntegerField(default=0)
    concurrency_held = models.BooleanField(default=False)

    # Money, frozen at admission: the price version used and its figures in micro-units per million tokens;
    # the amounts in micro-units of ``currency``. Empty currency: no price, no money moves.
    price = models.ForeignKey(
        "budgeting.Price", on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    currency = models.CharField(max_length=3, blank=True)
    input_price = models.BigIntegerField(default=0)
    cached_input_price = models.BigIntegerField(default=0)
    output_price = models.BigIntegerField(default=0)
    input_cached = models.BigIntegerField(
        default=0, help_text="Input tokens the provider reported as cached."
    )
    spend_reserved = models.BigIntegerField(default=0, help_text="Held at admission and by top-ups.")
    spend_captured = models.BigIntegerField(default=0, help_text="Posted out of the hold.")
    spend_remaining = models.BigIntegerField(default=0, help_text="Still held.")
    spend_released = models.BigIntegerField(default=0, help_text="Given back (released or refunded).")
    spend_overrun = models.BigIntegerField(default=0, help_text="Posted beyond the hold.")

    provider_request_id = models.CharField(max_length=200, blank=True)
    provider_adapter = models.CharField(
        max_length=24, blank=True, help_text="The adapter the pool named when the call was dispatched."
    )
    provider_endpoint = models.CharField(
        max_length=300,
        blank=True,
        help_text="The provider endpoint the pool named at dispatch: only a lookup there can vouch.",
    )
    request_sent = models.CharField(
        max_length=7, blank=True, help_text="What the gateway reported in /fail: yes, no or unknown."
    )
    needs_person = models.CharField(
        max_length=300,
        blank=True,
        help_text="Why no evidence can settle it (evidence contradicts our record); the reconciler stops "
        "looking it up and a person resolves it.",
    )
    needs_person_since = models.DateTimeField(null=True, blank=True)
    fence = models.BigIntegerField(default=1)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    failure_reason = models.CharField(max_length=300, blank=True)
    queue_deadline = models.DateTimeField(null=True, blank=True)
    request_body = PackedJSONField(null=True, blank=True, help_text="Kept while queued, to admit later.")
    response_body = PackedJSONField(
        null=True, blank=True, help_text="The first answer, for idempotent replays."
    )

    task_success = models.BooleanField(null=True, blank=True)
    cited_evidence_ids = models.JSONField(null=True, blank=True)
    minimum_evidence_ids = models.JSONField(default=list, blank=True)

    created_at = models.DateTimeField(auto_now_add=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    settled_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "idempotency_key"], name="reservation_unique_idempotency_key"
            ),
            models.CheckConstraint(
                condition=Q(captured__gte=0)
                & Q(remaining__gte=0)
                & Q(released__gte=0)
                & Q(overrun__gte=0)
                & Q(top_ups__gte=0)
                & Q(output_reserved__gte=0)
                & Q(input_reserved__gte=0)
                & Q(input_consumed__gte=0),
                name="reservation_amounts_non_negative",
            ),
            models.CheckConstraint(
                condition=Q(
                    captured=F("output_reserved") + F("top_ups") - F("remaining") - F("released"),
                ),
                name="reservation_output_conservation",
            ),
            models.CheckConstraint(
                condition=Q(spend_reserved__gte=0)
                & Q(spend_captured__gte=0)
                & Q(spend_remaining__gte=0)
                & Q(spend_released__gte=0)
                & Q(spend_overrun__gte=0)
                & Q(input_cached__gte=0),
                name="reservation_spend_non_negative",
            ),
            models.CheckConstraint(
                condition=Q(spend_reserved=F("spend_captured") + F("spend_remaining") + F("spend_released")),
                name="reservation_spend_conservation",
            ),
            models.CheckConstraint(condition=Q(fence__gte=1), name="reservation_fence_positive"),
            # Per tenant, not per pool: pools do not map one-to-one to provider accounts (two pools may bill
            # to one), whose exports name a call only by this id. Across tenants it is not unique, so that
            # nothing about another tenant's ids is observable; billing and lookups handle a shared id.
            models.UniqueConstraint(
                fields=["tenant", "provider_request_id"],
                condition=~Q(provider_request_id=""),
                name="reservation_unique_provider_request_id_per_tenant",
            ),
        ]
        indexes = [
            # Billing imports and lookups find calls by the provider's id alone.
            models.Index(fields=["provider_request_id"], name="reservation_provider_id"),
            models.Index(fields=["state", "lease_expires_at"]),
            models.Index(fields=["state", "created_at"]),
            # Billing buckets compare billed usage with what was dispatched per model and hour.
            models.Index(fields=["model_revision", "dispatched_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} [{self.state}]"

    @property
    def in_flight(self) -> bool:
        return self.state in {
            State.RESERVED,
            State.DISPATCHED,
            State.RUNNING,
            State.PARTIALLY_SETTLED,
            State.RECONCILING,
        }

    # Transitions only set fields; services lock the row, call them and save.

    @transition(field=state, source=State.PROPOSED, target=State.RESERVED)
    def admit_from_queue(self) -> None:
        self.request_body = None

    @transition(field=state, source=State.PROPOSED, target=State.REJECTED)
    def reject_queued(self, reason: str) -> None:
        """A queued request never held anything: its output goes to ``released``, as a settled one's does."""
        self.failure_reason = reason
        self.request_body = None
        self._release_rest()

    @transition(field=state, source=State.RESERVED, target=State.DISPATCHED)
    def dispatch(self, provider_request_id: str) -> None:
        self.provider_request_id = provider_request_id
        self.input_consumed = self.input_reserved

    @transition(field=state, source=State.DISPATCHED, target=State.RUNNING)
    def start_running(self) -> None:
        """The first non-final usage event arrived."""

    @transition(field=state, source=State.RESERVED, target=State.SETTLED)
    def release_undispatched(self) -> None:
        self.outcome = Outcome.RELEASED
        self._release_rest()

    @transition(field=state, source=State.DISPATCHED, target=State.SETTLED)
    def release_unprocessed(self) -> None:
        """The provider provably never processed the request: input is refunded too."""
        self.outcome = Outcome.RELEASED
        self.input_consumed = 0
        self._release_rest()

    @transition(field=state, source=[*IN_CALL, State.PARTIALLY_SETTLED], target=State.SETTLED)
    def complete(self) -> None:
        self.outcome = Outcome.COMPLETED
        self._release_rest()

    @transition(field=state, source=IN_CALL, target=State.PARTIALLY_SETTLED)
    def settle_partially(self, reason: str) -> None:
        self.failure_reason = reason

    @transition(field=state, source=AFTER_DISPATCH, target=State.RECONCILING)
    def freeze_unknown(self) -> None:
        """Outcome unknown after the lease expired: nothing is released."""

    @transition(field=state, source=[State.RECONCILING, *AFTER_DISPATCH], target=State.SETTLED)
    def reconcile(self) -> None:
        self.outcome = Outcome.RECONCILED
        self._release_rest()

    @transition(field=state, source=State.RECONCILING, target=State.SETTLED)
    def reconcile_unprocessed(self) -> None:
        self.outcome = Outcome.RELEASED
        self.input_consumed = 0
        self._release_rest()

    def consumed_cost(self) -> int:
        """What the consumed tokens cost at the prices frozen on the reservation, in micro-units: uncached
        input, cached input (as far as the provider reported it) and output with overrun, each rounded up."""
        if not self.currency:
            return 0
        cached = min(self.input_cached, self.input_consumed)
        return (
            cost(self.input_consumed - cached, self.input_price)
            + cost(cached, self.cached_input_price)
            + cost(self.captured + self.overrun, self.output_price)
        )

    def _release_rest(self) -> None:
        self.released += self.remaining
        self.remaining = 0
        self.spend_released += self.spend_remaining
        self.spend_remaining = 0


class Hold(models.Model):
    """Which accounts a reservation holds capacity on (the amounts are the reservation's)."""

    # No index of its own: hold_unique (reservation, account) leads with it.
    reservation = models.ForeignKey(
        Reservation, on_delete=models.PROTECT, related_name="holds", db_index=False
    )
    account = models.ForeignKey(CapacityAccount, on_delete=models.PROTECT, related_name="holds")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["reservation", "account"], name="hold_unique")]

    def __str__(self) -> str:
        return f"hold {self.reservation_id} on {self.account_id}"


class EntryKind(models.TextChoices):
    HOLD = "HOLD", "Hold (reserve)"
    POST = "POST", "Post (consume)"
    RELEASE = "RELEASE", "Release"
    TOP_UP = "TOP_UP", "Top-up hold"
    CORRECTION = "CORRECTION", "Correction"
    ROLLOVER = "ROLLOVER", "Period roll-over"
    SLOT_FREE = "SLOT_FREE", "Concurrency slot freed"


class LedgerEntry(models.Model):
    """An append-only change to one account's balances; balances equal the sum of their entries."""

    # No index of its own: the (account, id) index leads with it.
    account = models.ForeignKey(
        CapacityAccount, on_delete=models.PROTECT, related_name="entries", db_index=False
    )
    reservation = models.ForeignKey(
        Reservation, on_delete=models.PROTECT, null=True, blank=True, related_name="entries"
    )
    kind = models.CharField(max_length=10, choices=EntryKind.choices)
    input_reserved = models.BigIntegerField(default=0)
    output_reserved = models.BigIntegerField(default=0)
    input_consumed = models.BigIntegerField(default=0)
    output_consumed = models.BigIntegerField(default=0)
    in_flight = models.IntegerField(default=0)
    spend_reserved = models.BigIntegerField(default=0)
    spend_consumed = models.BigIntegerField(default=0)
    period_start = models.DateTimeField()
    reason = models.CharField(max_length=300, blank=True)
    created_by = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        verbose_name_plural = "ledger entries"
        indexes = [models.Index(fields=["account", "id"]), models.Index(fields=["created_at"])]

    def __str__(self) -> str:
        return f"{self.kind} #{self.pk} on {self.account_id}"


class UsageEvent(models.Model):
    # No index of its own: usage_event_unique_id (reservation, usage_event_id) leads with it.
    reservation = models.ForeignKey(
        Reservation, on_delete=models.PROTECT, related_name="usage_events", db_index=False
    )
    usage_event_id = models.CharField(max_length=200)
    input_tokens = models.BigIntegerField(null=True, blank=True)
    output_tokens = models.BigIntegerField()
    final = models.BooleanField(default=False)
    captured = models.BigIntegerField(
        default=0, help_text="Part of output_tokens taken from the reservation."
    )
    overrun = models.BigIntegerField(default=0, help_text="Part of output_tokens beyond the reservation.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(fields=["reservation", "usage_event_id"], name="usage_event_unique_id"),
            models.CheckConstraint(
                condition=Q(output_tokens__gte=0) & (Q(input_tokens__isnull=True) | Q(input_tokens__gte=0)),
                name="usage_event_non_negative",
            ),
        ]

    def __str__(self) -> str:
        return f"usage {self.usage_event_id}: {self.output_tokens}"


class TopUp(models.Model):
    # No index of its own: top_up_unique_id (reservation, top_up_id) leads with it.
    reservation = models.ForeignKey(
        Reservation, on_delete=models.PROTECT, related_name="top_up_records", db_index=False
    )
    top_up_id = models.CharField(max_length=200)
    output_tokens = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["reservation", "top_up_id"], name="top_up_unique_id"),
            models.CheckConstraint(condition=Q(output_tokens__gt=0), name="top_up_positive"),
        ]

    def __str__(self) -> str:
        return f"top-up {self.top_up_id}: {self.output_tokens}"
