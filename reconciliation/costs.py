"""Billed cost against our settled cost: drift per model revision and per capacity account.

Our cost is what the ledger posted for a reservation (``spend_captured + spend_overrun``, micro-units at the
prices frozen on it at admission), never a price looked up now. Two sources bill cost:

- a per-request export with ``cost`` and ``currency`` columns (the simulator's export writes them): each
  billed request is matched to our reservation by its provider id, so the drift is exact per model revision
  and per account the reservation held on;
- a cost report by UTC bucket (OpenAI's Costs API pages, Anthropic's cost report, and the simulator's in both
  shapes), whose line items name the model (``"<model>, input"``; ``CostRecord.model``): compared per model
  revision and bucket with the reservations dispatched in it. A bucket's cost cannot be told apart per
  account (the reports know workspaces and projects, not our accounts), so its drift is per model only.

Each comparison is a ``CostDrift`` row of the import; a difference is also a ``COST_DRIFT`` finding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from django.db.models import Count, F, Sum

from budgeting.catalog.prices import from_micro
from ledger.models import Hold, Reservation, account_label
from reconciliation.models import (
    BilledCost,
    BillingFinding,
    BillingImport,
    CostDimension,
    CostDrift,
    FindingKind,
)
from reconciliation.providers.records import CostRecord, RequestBillingRecord


@dataclass
class _Tally:
    account_id: int | None = None
    requests: int = 0
    billed: Decimal = Decimal(0)
    settled_micro: int = 0


def compare_request_costs(
    billing_import: BillingImport, records: Sequence[RequestBillingRecord]
) -> list[BillingFinding]:
    """Drift of the import's per-request billed costs, per model revision and per account; returns the
    findings of the non-zero ones (the caller stores them). A billed id that names calls of several tenants is
    left out (the import reports it as ambiguous), and so is a reservation admitted without a price in the
    billed currency (it has no settled cost; reports count it as unpriced)."""
    billed = [r for r in records if r.cost is not None and r.currency]
    by_id: dict[str, list[Reservation]] = {}
    for reservation in Reservation.objects.filter(
        provider_request_id__in=[r.request_id for r in billed]
    ).select_related("model_revision"):
        by_id.setdefault(reservation.provider_request_id, []).append(reservation)
    held: dict[object, list[tuple[int, str]]] = {}
    for hold in Hold.objects.filter(
        reservation__provider_request_id__in=list(by_id)
    ).values_list("reservation_id", "account_id", "account__scope", "account__tenant__slug",
                  "account__task_class__slug", "account__pool__slug"):  # fmt: skip
        reservation_id, account_id, scope, tenant, task, pool = hold
        held.setdefault(reservation_id, []).append((account_id, account_label(scope, tenant, task, pool)))
    tallies: dict[tuple[str, str, str], _Tally] = {}
    for record in billed:
        matches = by_id.get(record.request_id, [])
        if len(matches) != 1:
            continue
        (reservation,) = matches
        assert record.cost is not None and record.currency is not None
        if reservation.currency != record.currency:
            continue  # admitted without a price in the billed currency: it has no settled cost to compare
        keys: list[tuple[str, str, int | None]] = [
            (CostDimension.MODEL, reservation.model_revision.name, None)
        ]
        keys += [
            (CostDimension.ACCOUNT, label, account_id) for account_id, label in held.get(reservation.pk, [])
        ]
        for dimension, key, owner in keys:
            tally = tallies.setdefault((dimension, key, record.currency), _Tally(owner))
            tally.requests += 1
            tally.billed += record.cost
            tally.settled_micro += reservation.spend_captured + reservation.spend_overrun
    rows = [
        CostDrift(
            billing_import=billing_import,
            dimension=dimension,
            key=key,
            account_id=tally.account_id,
            currency=currency,
            bucket_start=billing_import.period_start,
            bucket_end=billing_import.period_end,
            requests=tally.requests,
            billed=tally.billed,
            settled=from_micro(tally.settled_micro),
        )
        for (dimension, key, currency), tally in sorted(tallies.items())
    ]
    CostDrift.objects.bulk_create(rows)
    return _findings(billing_import, rows)


def compare_bucket_costs(
    billing_import: BillingImport, records: Sequence[CostRecord]
) -> list[BillingFinding]:
    """Drift of the model revisions a cost report's line items name, per UTC bucket: the bucket's billed
    lines of that model (as last reported) against our cost of its reservations dispatched in the bucket."""
    wanted = sorted(
        {
            (model, r.currency.upper(), r.bucket_start, r.bucket_end)
            for r in records
            if (model := r.model) is not None
        }
    )
    rows = []
    for model, currency, start, end in wanted:
        lines = BilledCost.objects.filter(
            currency__iexact=currency, bucket_start=start, bucket_end=end, line_item__startswith=f"{model},"
        )
        ours = Reservation.objects.filter(
            model_revision__name=model, currency=currency, dispatched_at__gte=start, dispatched_at__lt=end
        ).aggregate(n=Count("pk"), micro=Sum(F("spend_captured") + F("spend_overrun")))
        rows.append(
            CostDrift(
                billing_import=billing_import,
                dimension=CostDimension.MODEL,
                key=model,
                currency=currency,
                bucket_start=start,
                bucket_end=end,
                requests=ours["n"] or 0,
                billed=sum((line.amount for line in lines), Decimal(0)),
                settled=from_micro(ours["micro"] or 0),
            )
        )
    CostDrift.objects.bulk_create(rows)
    return _findings(billing_import, rows)


def _findings(billing_import: BillingImport, rows: Iterable[CostDrift]) -> list[BillingFinding]:
    return [
        BillingFinding(
            billing_import=billing_import,
            kind=FindingKind.COST_DRIFT,
            detail=(
                f"{row.get_dimension_display().lower()} {row.key}{_bucket(row.bucket_start)}: billed "
                f"{row.billed.normalize():f} {row.currency}, settled {row.settled.normalize():f} "
                f"(drift {row.drift.normalize():+f}, {row.requests} requests)"
            )[:500],
        )
        for row in rows
        if row.drift
    ]


def _bucket(start: datetime | None) -> str:
    return "" if start is None else f" from {start:%Y-%m-%d %H:%M}"
