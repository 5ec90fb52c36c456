"""Reads of the ledger: reservation detail, balances, the audit."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.contrib.postgres.expressions import ArraySubquery
from django.db import connection, transaction
from django.db.models import OuterRef, Q, Sum
from django.db.models.functions import JSONObject

from budgeting.catalog.prices import from_micro
from ledger.models import (
    CapacityAccount,
    Hold,
    LedgerEntry,
    Reservation,
    State,
    UsageEvent,
    account_label,
)


def reservation_for(reservation_id: uuid.UUID, tenant_ids: Iterable[int]) -> Reservation | None:
    """The reservation with everything its detail shows, in one statement: its usage events, ledger entries
    and holds come with it as JSON arrays."""
    events = UsageEvent.objects.filter(reservation=OuterRef("pk")).order_by("id")
    entries = LedgerEntry.objects.filter(reservation=OuterRef("pk")).order_by("id")
    holds = Hold.objects.filter(reservation=OuterRef("pk")).order_by("id")
    return (
        Reservation.objects.select_related("tenant", "task_class", "model_pool", "model_revision", "manifest")
        .filter(pk=reservation_id, tenant_id__in=list(tenant_ids))
        .annotate(
            usage_json=ArraySubquery(
                events.values(
                    json=JSONObject(
                        usageEventId="usage_event_id",
                        inputTokens="input_tokens",
                        outputTokens="output_tokens",
                        final="final",
                        captured="captured",
                        overrun="overrun",
                        at="created_at",
                    )
                )
            ),
            entries_json=ArraySubquery(
                entries.values(
                    json=JSONObject(
                        id="id",
                        account="account_id",
                        kind="kind",
                        inputReserved="input_reserved",
                        outputReserved="output_reserved",
                        inputConsumed="input_consumed",
                        outputConsumed="output_consumed",
                        inFlight="in_flight",
                        reason="reason",
                        at="created_at",
                    )
                )
            ),
            holds_json=ArraySubquery(
                holds.values(
                    json=JSONObject(
                        account="account_id",
                        scope="account__scope",
                        tenant="account__tenant__slug",
                        task="account__task_class__slug",
                        pool="account__pool__slug",
                    )
                )
            ),
        )
        .first()
    )


def _at(row: dict[str, Any]) -> dict[str, Any]:
    """A row from the database's JSON with its time as Python writes it everywhere else in the API."""
    return {**row, "at": datetime.fromisoformat(row["at"]).isoformat()}


def spend_detail(reservation: Reservation) -> dict[str, Any] | None:
    """The money of a reservation: the prices frozen on it (per million tokens) and its amounts, as decimal
    text in its currency (exact; no float touches money); None when it was admitted without a price."""
    r = reservation
    if not r.currency:
        return None
    return {
        "currency": r.currency,
        "priceId": r.price_id,
        "pricePerMillion": {
            "input": str(from_micro(r.input_price)),
            "cachedInput": str(from_micro(r.cached_input_price)),
            "output": str(from_micro(r.output_price)),
        },
        "cachedInputTokens": r.input_cached,
        "reserved": str(from_micro(r.spend_reserved)),
        "captured": str(from_micro(r.spend_captured)),
        "remaining": str(from_micro(r.spend_remaining)),
        "released": str(from_micro(r.spend_released)),
        "overrun": str(from_micro(r.spend_overrun)),
        "cost": str(from_micro(r.spend_captured + r.spend_overrun)),
    }


def reservation_detail(reservation: Reservation) -> dict[str, Any]:
    """The GET /reservations/{id} body (SPEC §8), camelCase, of a reservation read by ``reservation_for``."""
    return {
        "reservationId": str(reservation.pk),
        "requestId": reservation.request_id,
        "tenantId": reservation.tenant.slug,
        "taskClass": reservation.task_class.slug,
        "modelPool": reservation.model_pool.slug,
        "modelRevision": reservation.model_revision.name,
        "state": reservation.state,
        "outcome": reservation.outcome or None,
        "mode": reservation.mode,
        "rung": reservation.rung,
        "policyRevision": reservation.policy_revision,
        **_token_amounts(reservation),
        "concurrencyHeld": reservation.concurrency_held,
        "spend": spend_detail(reservation),
        "providerRequestId": reservation.provider_request_id or None,
        "admittedDigest": reservation.admitted_digest,
        "lease": {
            "fence": reservation.fence,
            "expiresAt": reservation.lease_expires_at.isoformat() if reservation.lease_expires_at else None,
        },
        "failureReason": reservation.failure_reason or None,
        "usageEvents": [_at(event) for event in reservation.usage_json],  # type: ignore[attr-defined]
        "ledgerEntries": [_at(entry) for entry in reservation.entries_json],  # type: ignore[attr-defined]
        "holds": [
            {
                "account": hold["account"],
                "scope": hold["scope"],
                "label": account_label(hold["scope"], hold["tenant"], hold["task"], hold["pool"]),
            }
            for hold in reservation.holds_json  # type: ignore[attr-defined]
        ],
        "manifestId": reservation.manifest_id,
        "manifest": None
        if reservation.manifest is None
        else {
            "id": reservation.manifest_id,
            "decision": reservation.manifest.decision,
            "rung": reservation.manifest.rung,
            "policyRevision": reservation.manifest.policy_revision,
            "countMethod": reservation.manifest.count_method,
            "inputTokens": reservation.manifest.input_tokens,
        },
        "createdAt": reservation.created_at.isoformat(),
        "dispatchedAt": reservation.dispatched_at.isoformat() if reservation.dispatched_at else None,
        "settledAt": reservation.settled_at.isoformat() if reservation.settled_at else None,
        "updatedAt": reservation.updated_at.isoformat(),
    }


def _token_amounts(reservation: Reservation) -> dict[str, dict[str, int | None]]:
    """The reservation's input and output figures, as the detail and every lifecycle answer show them."""
    return {
        "input": {
            "reserved": reservation.input_reserved,
            "consumed": reservation.input_consumed,
            "reported": reservation.input_reported,
        },
        "output": {
            "reserved": reservation.output_reserved,
            "topUps": reservation.top_ups,
            "captured": reservation.captured,
            "remaining": reservation.remaining,
            "released": reservation.released,
            "overrun": reservation.overrun,
        },
    }


def lifecycle_answer(reservation: Reservation) -> dict[str, Any]:
    """The answer of a lifecycle call (dispatch, usage, top-up, cancel, fail, lease, outcome): the state, the
    amounts and the lease, from the row the call locked and wrote — no statement of its own. The gateway
    reads the state and the lease from it; the whole detail (events, entries, holds, manifest) is at
    ``GET /reservations/{id}`` (``reservation_detail``)."""
    expires_at = reservation.lease_expires_at
    return {
        "reservationId": str(reservation.pk),
        "state": reservation.state,
        "outcome": reservation.outcome or None,
        **_token_amounts(reservation),
        "concurrencyHeld": reservation.concurrency_held,
        "providerRequestId": reservation.provider_request_id or None,
        "lease": {"fence": reservation.fence, "expiresAt": expires_at.isoformat() if expires_at else None},
        "failureReason": reservation.failure_reason or None,
    }


# Failure reasons in which gateways report a provider's context-window refusal.
CONTEXT_OVERFLOW_PATTERN = r"context[ _-]?(length|window|overflow)|prompt is too long|CONTEXT_OVERFLOW"


def leak_filter(now: datetime) -> Q:
    """Reservations holding capacity they should not: the leak definition of ``ledger.selectors.audit``
    (a terminal reservation still holding output or concurrency; a dispatched call whose lease expired and
    that is not RECONCILING), as one query."""
    terminal = Q(state__in=[State.SETTLED, State.REJECTED]) & (
        Q(concurrency_held=True) | Q(remaining__gt=0) | Q(spend_remaining__gt=0)
    )
    expired = Q(
        state__in=[State.DISPATCHED, State.RUNNING, State.PARTIALLY_SETTLED], lease_expires_at__lt=now
    )
    return terminal | expired


BALANCE_FIELDS = (
    "input_reserved",
    "output_reserved",
    "input_consumed",
    "output_consumed",
    "in_flight",
    "spend_reserved",
    "spend_consumed",
)
TERMINAL = {State.SETTLED, State.REJECTED}


@dataclass
class AuditReport:
    accounts_checked: int = 0
    reservations_checked: int = 0
    violations: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.leaks


def audit(
    now: Any = None,
    *,
    account_ids: list[int] | None = None,
    reservation_ids: list[Any] | None = None,
    lease_grace_seconds: int = 30,
) -> AuditReport:
    """Check the ledger's invariants: balances equal the sum of their entries, the output conservation
    equation, and leaked holds (a terminal reservation that still holds capacity, or a dispatched call whose
    lease expired more than ``lease_grace_seconds`` ago — one reclaim interval — and is not RECONCILING).

    Reads one snapshot (REPEATABLE READ) when it owns the transaction, so a commit between reading the entry
    sums and the balances cannot look like a violation while traffic runs.
    """
    if connection.in_atomic_block:
        return _audit(now, account_ids, reservation_ids, lease_grace_seconds)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        return _audit(now, account_ids, reservation_ids, lease_grace_seconds)


def _audit(
    now: Any, account_ids: list[int] | None, reservation_ids: list[Any] | None, lease_grace_seconds: int
) -> AuditReport:
    report = AuditReport()
    entries = LedgerEntry.objects.all()
    accounts = CapacityAccount.objects.all()
    reservations = Reservation.objects.exclude(state__in=[State.PROPOSED])
    if account_ids is not None:
        entries = entries.filter(account_id__in=account_ids)
        accounts = accounts.filter(pk__in=account_ids)
    if reservation_ids is not None:
        reservations = reservations.filter(pk__in=reservation_ids)
    sums = {
        row["account_id"]: row
        for row in entries.values("account_id").annotate(**{f: Sum(f) for f in BALANCE_FIELDS})
    }
    for account in accounts:
        report.accounts_checked += 1
        totals: dict[str, Any] = dict(sums.get(account.pk) or {})
        for name in BALANCE_FIELDS:
            expected = totals.get(name) or 0
            if getattr(account, name) != expected:
                report.violations.append(
                    f"account {account.pk} ({account.label}): {name}={getattr(account, name)} "
                    f"but entries sum to {expected}"
                )
    for reservation in reservations.iterator():
        report.reservations_checked += 1
        r = reservation
        if r.captured + r.remaining + r.released != r.output_reserved + r.top_ups:
            report.violations.append(f"reservation {r.pk}: output conservation broken")
        if r.spend_captured + r.spend_remaining + r.spend_released != r.spend_reserved:
            report.violations.append(f"reservation {r.pk}: money conservation broken")
        if r.spend_captured + r.spend_overrun != r.consumed_cost():
            report.violations.append(
                f"reservation {r.pk}: posted {r.spend_captured + r.spend_overrun} micro-{r.currency} but its "
                f"tokens cost {r.consumed_cost()} at its frozen prices"
            )
        if r.state in TERMINAL and (r.concurrency_held or r.remaining or r.spend_remaining):
            report.leaks.append(f"reservation {r.pk}: {r.state} still holds capacity")
        if (
            now is not None
            and r.state in {State.DISPATCHED, State.RUNNING, State.PARTIALLY_SETTLED}
            and r.lease_expires_at is not None
            and r.lease_expires_at < now - timedelta(seconds=lease_grace_seconds)
        ):
            report.leaks.append(f"reservation {r.pk}: lease expired in {r.state}, not RECONCILING")
    return report
