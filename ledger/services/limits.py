"""People's changes to capacity accounts: limits (compare-and-swap on what was shown), temporary increases and
compensating corrections, each in the change log.

Limits are those of ``ledger.models.LIMITS``: input, output and concurrency counts, and spend in integer
micro-units of the account's currency (the admin reads and shows it as a decimal amount; nothing here is a
float).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.db.models import F, Sum

from budgeting.catalog.changes import SYSTEM, Actor, record_change, require_reason, snapshot
from budgeting.catalog.errors import InvalidChange, NotFound
from budgeting.catalog.models import TemporaryIncrease
from ledger import locks
from ledger.errors import LimitsChanged
from ledger.models import LIMITS, CapacityAccount, EntryKind, LedgerEntry
from ledger.services.postings import post_to_account

DIMENSIONS = tuple(limit.dimension for limit in LIMITS)
LIMIT_FIELDS = tuple(limit.limit for limit in LIMITS)
"""The limit columns, in the order of ``LIMITS`` (input, output, concurrency, spend): the order of every
``expected`` tuple below."""
# What a temporary increase adds to each dimension's limit: its amount column.
INCREASE_AMOUNTS = {
    "input": "input_tokens",
    "output": "output_tokens",
    "concurrency": "concurrency",
    "spend": "spend",
}
BALANCE_FIELDS = ("input_reserved", "output_reserved", "input_consumed", "output_consumed", "in_flight")


Limits = tuple[int | None, ...]
"""Limits in ``LIMIT_FIELDS`` order (None: unlimited)."""


@dataclass(frozen=True)
class DimensionPreview:
    """One limit dimension before and after an edit (spend in micro-units). ``None`` limits are unlimited."""

    name: str
    used: int
    old_limit: int | None
    new_limit: int | None
    # What active temporary increases add on top of the permanent limit (in both limits above).
    increase: int = 0

    @property
    def old_permanent(self) -> int | None:
        return None if self.old_limit is None else self.old_limit - self.increase

    @property
    def new_permanent(self) -> int | None:
        return None if self.new_limit is None else self.new_limit - self.increase

    @property
    def changed(self) -> bool:
        return self.old_limit != self.new_limit

    @property
    def old_available(self) -> int | None:
        return None if self.old_limit is None else self.old_limit - self.used

    @property
    def new_available(self) -> int | None:
        return None if self.new_limit is None else self.new_limit - self.used

    @property
    def below_use(self) -> bool:
        """The new limit is under what is already reserved and consumed: new requests will be refused."""
        return self.new_limit is not None and self.new_limit < self.used


def used(account: CapacityAccount) -> dict[str, int]:
    """Reserved plus consumed (in flight for concurrency) per dimension in the current period."""
    return {limit.dimension: limit.usage(account) for limit in LIMITS}


def active_increases(account: CapacityAccount) -> dict[str, int]:
    """What the account's temporary increases that have not ended add to each limit, per dimension."""
    totals = TemporaryIncrease.objects.filter(account=account, ended_at__isnull=True).aggregate(
        **{name: Sum(amount) for name, amount in INCREASE_AMOUNTS.items()}
    )
    return {name: int(totals.get(name) or 0) for name in DIMENSIONS}


def preview_permanent_limits(
    account: CapacityAccount,
    *,
    input_limit: int | None,
    output_limit: int | None,
    concurrency_limit: int | None,
    spend_limit: int | None,
    increases: dict[str, int] | None = None,
) -> list[DimensionPreview]:
    """What an edit of the permanent limits would do, per dimension: active temporary increases stay on top
    of the new permanent limits (and come off again when they end). Nothing is written."""
    extra = active_increases(account) if increases is None else increases
    in_use = used(account)
    wanted = {
        "input": input_limit,
        "output": output_limit,
        "concurrency": concurrency_limit,
        "spend": spend_limit,
    }
    previews = []
    for name in DIMENSIONS:
        old: int | None = getattr(account, f"{name}_limit")
        # An unlimited dimension carries no increase (a grant refuses one), whatever rows say.
        increase = 0 if old is None else extra.get(name, 0)
        new = wanted[name]
        previews.append(
            DimensionPreview(name, in_use[name], old, None if new is None else new + increase, increase)
        )
    return previews


def preview_limits(
    account: CapacityAccount,
    *,
    input_limit: int | None,
    output_limit: int | None,
    concurrency_limit: int | None,
    spend_limit: int | None,
) -> list[DimensionPreview]:
    """What an edit of the limits would do to availability, per dimension (nothing is written)."""
    in_use = used(account)
    return [
        DimensionPreview("input", in_use["input"], account.input_limit, input_limit),
        DimensionPreview("output", in_use["output"], account.output_limit, output_limit),
        DimensionPreview("concurrency", in_use["concurrency"], account.concurrency_limit, concurrency_limit),
        DimensionPreview("spend", in_use["spend"], account.spend_limit, spend_limit),
    ]


def set_account_limits(
    *,
    account_id: int,
    input_limit: int | None,
    output_limit: int | None,
    concurrency_limit: int | None,
    spend_limit: int | None,
    expected: Limits,
    reason: str,
    actor: Actor,
) -> list[DimensionPreview]:
    """Set an account's limits (lowering below current use is allowed: new holds are then refused); the
    spend limit is in micro-units of the account's currency.

    ``expected`` are the limits the person saw when confirming, in ``LIMIT_FIELDS`` order; if they changed
    meanwhile (another admin, a temporary increase expiring) nothing is written. Raises LimitsChanged,
    InvalidChange, NotFound.
    """
    reason = require_reason(reason)
    _require_non_negative(input_limit, output_limit, concurrency_limit, spend_limit)
    with transaction.atomic(durable=True):
        account = _lock_as_seen(account_id, expected)
        preview = preview_limits(
            account,
            input_limit=input_limit,
            output_limit=output_limit,
            concurrency_limit=concurrency_limit,
            spend_limit=spend_limit,
        )
        if not any(p.changed for p in preview):
            return preview
        before = snapshot(account, LIMIT_FIELDS)
        CapacityAccount.objects.filter(pk=account.pk).update(
            input_limit=input_limit,
            output_limit=output_limit,
            concurrency_limit=concurrency_limit,
            spend_limit=spend_limit,
        )
        account.refresh_from_db()
        record_change(
            actor=actor,
            action="account.limits",
            target=account,
            before=before,
            after=snapshot(account, LIMIT_FIELDS),
            reason=reason,
        )
        return preview


def set_permanent_limits(
    *,
    account_id: int,
    input_limit: int | None,
    output_limit: int | None,
    concurrency_limit: int | None,
    spend_limit: int | None,
    expected: Limits,
    reason: str,
    actor: Actor,
) -> list[DimensionPreview]:
    """Set an account's permanent limits: the limits it keeps once its temporary increases end (the spend
    limit in micro-units of the account's currency). Active increases stay on top (the stored limit is
    permanent + increase, as admission reads it), so an edit made during an increase is not cut by the
    increase when it expires.

    ``expected`` are the limits in force (increases included) that the person saw, in ``LIMIT_FIELDS``
    order; if they changed meanwhile nothing is written. Raises LimitsChanged, InvalidChange, NotFound.
    """
    reason = require_reason(reason)
    _require_non_negative(input_limit, output_limit, concurrency_limit, spend_limit)
    with transaction.atomic(durable=True):
        account = _lock_as_seen(account_id, expected)
        # Read under the account's lock: a grant or an end of an increase locks the account first.
        increases = active_increases(account)
        preview = preview_permanent_limits(
            account,
            input_limit=input_limit,
            output_limit=output_limit,
            concurrency_limit=concurrency_limit,
            spend_limit=spend_limit,
            increases=increases,
        )
        if not any(p.changed for p in preview):
            return preview
        before = {**snapshot(account, LIMIT_FIELDS), "permanent": _permanent(preview, new=False)}
        new = {f"{p.name}_limit": p.new_limit for p in preview}
        CapacityAccount.objects.filter(pk=account.pk).update(**new)
        account.refresh_from_db()
        record_change(
            actor=actor,
            action="account.limits",
            target=account,
            before=before,
            after={
                **snapshot(account, LIMIT_FIELDS),
                "permanent": _permanent(preview, new=True),
                "temporaryIncreases": {k: v for k, v in increases.items() if v},
            },
            reason=reason,
        )
        return preview


def _permanent(preview: list[DimensionPreview], *, new: bool) -> dict[str, int | None]:
    return {f"{p.name}_limit": p.new_permanent if new else p.old_permanent for p in preview}


def _require_non_negative(*limits: int | None) -> None:
    if any(v is not None and v < 0 for v in limits):
        raise InvalidChange("limits cannot be negative")


def limits_in_force(account: CapacityAccount) -> Limits:
    """The account's limits as admission reads them (increases included), in ``LIMIT_FIELDS`` order: what
    an edit's ``expected`` compares with."""
    return tuple(getattr(account, field) for field in LIMIT_FIELDS)


def _lock_as_seen(account_id: int, expected: Limits) -> CapacityAccount:
    """The account, locked, if its limits in force are still those the person saw; else LimitsChanged."""
    account = _lock(account_id)
    current = limits_in_force(account)
    if current != tuple(expected):
        raise LimitsChanged(
            "the limits changed since you looked at them; review the new values and confirm again",
            current=list(current),
        )
    return account


def _lock(account_id: int) -> CapacityAccount:
    try:
        return locks.lock_account(account_id)
    except CapacityAccount.DoesNotExist:
        raise NotFound("no such capacity account") from None


def grant_temporary_increase(
    *,
    account_id: int,
    input_tokens: int,
    output_tokens: int,
    concurrency: int,
    expires_at: datetime,
    reason: str,
    actor: Actor,
    now: datetime,
    spend: int = 0,
) -> TemporaryIncrease:
    """Raise an account's limits by these amounts until ``expires_at`` (``spend`` in micro-units of the
    account's currency).

    Raises InvalidChange for an empty or negative increase, an expiry in the past, or an increase of an
    unlimited dimension (there is nothing to raise); NotFound.
    """
    reason = require_reason(reason)
    amounts = {"input": input_tokens, "output": output_tokens, "concurrency": concurrency, "spend": spend}
    if any(v < 0 for v in amounts.values()) or not any(amounts.values()):
        raise InvalidChange(
            "an increase needs a positive amount on at least one dimension, and no negative one"
        )
    if expires_at <= now:
        raise InvalidChange("the expiry must be in the future")
    with transaction.atomic(durable=True):
        account = _lock(account_id)
        limits = dict(zip(DIMENSIONS, limits_in_force(account), strict=True))
        unlimited = [name for name, extra in amounts.items() if extra and limits[name] is None]
        if unlimited:
            raise InvalidChange(f"{', '.join(unlimited)} is unlimited on this account; nothing to increase")
        before = snapshot(account, LIMIT_FIELDS)
        CapacityAccount.objects.filter(pk=account.pk).update(
            input_limit=F("input_limit") + input_tokens,
            output_limit=F("output_limit") + output_tokens,
            concurrency_limit=F("concurrency_limit") + concurrency,
            spend_limit=F("spend_limit") + spend,
        )
        increase = TemporaryIncrease.objects.create(
            account=account,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            concurrency=concurrency,
            spend=spend,
            starts_at=now,
            expires_at=expires_at,
            reason=reason,
            created_by=actor.username,
        )
        account.refresh_from_db()
        record_change(
            actor=actor,
            action="account.temporary_increase",
            target=account,
            before=before,
            after={
                **snapshot(account, LIMIT_FIELDS),
                "temporaryIncrease": increase.pk,
                "expiresAt": expires_at.isoformat(),
            },
            reason=reason,
        )
        return increase


def end_temporary_increase(*, increase_id: int, reason: str, actor: Actor, now: datetime) -> bool:
    """Take a temporary increase back off its account's limits (expiry or early revocation).

    Returns False when it had already ended (safe to call twice, or from two workers at once). A limit edited
    below the increase meanwhile goes to zero rather than negative.
    """
    reason = require_reason(reason)
    account_id = TemporaryIncrease.objects.filter(pk=increase_id).values_list("account_id", flat=True).first()
    if account_id is None:
        raise NotFound("no such temporary increase")
    with transaction.atomic(durable=True):
        # Lock order: the account, then the increase row (by a conditional UPDATE), as in the grant.
        account = _lock(account_id)
        ended = TemporaryIncrease.objects.filter(pk=increase_id, ended_at__isnull=True).update(
            ended_at=now, end_reason=reason[:300]
        )
        if not ended:
            return False
        increase = TemporaryIncrease.objects.get(pk=increase_id)
        before = snapshot(account, LIMIT_FIELDS)

        def lowered(limit: int | None, extra: int) -> int | None:
            return None if limit is None else max(limit - extra, 0)

        CapacityAccount.objects.filter(pk=account.pk).update(
            input_limit=lowered(account.input_limit, increase.input_tokens),
            output_limit=lowered(account.output_limit, increase.output_tokens),
            concurrency_limit=lowered(account.concurrency_limit, increase.concurrency),
            spend_limit=lowered(account.spend_limit, increase.spend),
        )
        account.refresh_from_db()
        record_change(
            actor=actor,
            action="account.temporary_increase_end",
            target=account,
            before=before,
            after={**snapshot(account, LIMIT_FIELDS), "temporaryIncrease": increase.pk},
            reason=reason,
        )
        return True


def expire_temporary_increases(*, now: datetime) -> int:
    """End every temporary increase whose expiry has passed; returns how many this call ended.

    Meant for a Celery beat task: idempotent and safe to run twice at once (the conditional UPDATE in
    ``end_temporary_increase`` lets exactly one caller end each increase).
    """
    due = TemporaryIncrease.objects.filter(ended_at__isnull=True, expires_at__lte=now).values_list(
        "pk", flat=True
    )
    return sum(
        end_temporary_increase(increase_id=pk, reason="expired", actor=SYSTEM, now=now) for pk in list(due)
    )


def post_correction(
    *, account_id: int, input_consumed: int, output_consumed: int, reason: str, actor: Actor
) -> LedgerEntry:
    """Post a compensating correction of consumed tokens on an account: a new CORRECTION entry, and the
    balance moved by the same amounts (balances stay the sum of their entries).

    Only consumed balances can be corrected: reserved balances and in-flight counts belong to live
    reservations and are settled through their lifecycle. Raises InvalidChange (nothing to post, no reason,
    a balance would go negative), NotFound.
    """
    reason = require_reason(reason)
    if not input_consumed and not output_consumed:
        raise InvalidChange("a correction must change input or output consumed")
    with transaction.atomic(durable=True):
        account = _lock(account_id)
        if account.input_consumed + input_consumed < 0 or account.output_consumed + output_consumed < 0:
            raise InvalidChange(
                f"the correction would make a consumed balance negative (input {account.input_consumed}, "
                f"output {account.output_consumed})"
            )
        before = snapshot(account, BALANCE_FIELDS)
        entry = post_to_account(
            account,
            EntryKind.CORRECTION,
            period_start=account.period_start,
            reason=reason,
            created_by=actor.username,
            input_consumed=input_consumed,
            output_consumed=output_consumed,
        )
        account.refresh_from_db()
        record_change(
            actor=actor,
            action="ledger.correction",
            target=account,
            before=before,
            after={**snapshot(account, BALANCE_FIELDS), "ledgerEntry": entry.pk},
            reason=reason,
        )
        return entry
