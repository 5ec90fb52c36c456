"""What finance reads in money: the cost of an account's or a tenant's requests this calendar month (UTC) to
date at the prices in effect, a month-end projection from the recent run rate, and a tenant's spend by model
revision and task class. Every figure comes from ``pricing.usage_rows``, as the report's do."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from budgeting.backoffice.reports.pricing import COST_QUANTUM, Totals, usage_rows
from budgeting.backoffice.reports.query import ReportQuery
from ledger.models import CapacityAccount, Scope

# The projection extends the spend of this many days before now to the end of the month.
RUN_RATE_DAYS = 7


@dataclass(frozen=True)
class Spend:
    """Cost per currency this month to date and projected to the month's end; requests without a price
    are counted apart (they cost nothing here, so the figures are a floor)."""

    month_start: datetime
    month_end: datetime
    to_date: dict[str, Decimal]
    projected: dict[str, Decimal]
    requests: int
    unpriced_requests: int


@dataclass
class SpendRow:
    """A tenant's usage and cost of one model revision and task class this month."""

    model_revision: str
    task_class: str
    totals: Totals = field(default_factory=Totals)


def month_bounds(now: datetime) -> tuple[datetime, datetime]:
    """The calendar month (UTC) holding ``now``: its first instant and the next month's."""
    now = now.astimezone(UTC)
    start = datetime(now.year, now.month, 1, tzinfo=UTC)
    end = datetime(now.year + (now.month == 12), now.month % 12 + 1, 1, tzinfo=UTC)
    return start, end


def _totals(query: ReportQuery) -> Totals:
    totals = Totals()
    for row in usage_rows(query):
        totals.add(row)
    return totals


def spend(
    *, now: datetime, tenant: str | None = None, task_class: str | None = None, pool: str | None = None
) -> Spend:
    """The spend of a scope (slugs; none is everything) this month, and its month-end projection: the cost
    so far plus the last RUN_RATE_DAYS' cost per second times the seconds left in the month."""
    start, end = month_bounds(now)
    scope = {"tenant": tenant, "task_class": task_class, "pool": pool}
    so_far = _totals(ReportQuery(start=start, end=now, **scope))
    window = timedelta(days=RUN_RATE_DAYS)
    recent = _totals(ReportQuery(start=now - window, end=now, **scope))
    left = Decimal((end - now).total_seconds()) / Decimal(window.total_seconds())
    projected = {
        currency: (
            so_far.cost.get(currency, Decimal(0)) + recent.cost.get(currency, Decimal(0)) * left
        ).quantize(COST_QUANTUM)
        for currency in so_far.cost.keys() | recent.cost.keys()
    }
    return Spend(
        month_start=start,
        month_end=end,
        to_date=dict(so_far.cost),
        projected=projected,
        requests=so_far.requests,
        unpriced_requests=so_far.unpriced_requests,
    )


def account_spend(account: CapacityAccount, now: datetime) -> Spend:
    """The spend of the requests an account holds capacity for: its tenant's (and task class's) or its
    pool's, whatever the account's own period."""
    if account.scope == Scope.POOL:
        return spend(now=now, pool=account.pool.slug if account.pool else None)
    return spend(
        now=now,
        tenant=account.tenant.slug if account.tenant else None,
        task_class=account.task_class.slug
        if account.scope == Scope.TENANT_TASK and account.task_class
        else None,
    )


def tenant_breakdown(tenant: str, now: datetime) -> list[SpendRow]:
    """A tenant's usage and cost this month by model revision and task class, costliest first."""
    start, _ = month_bounds(now)
    rows: dict[tuple[str, str], SpendRow] = {}
    for usage in usage_rows(ReportQuery(start=start, end=now, tenant=tenant)):
        key = (usage.model_revision, usage.task_class)
        rows.setdefault(key, SpendRow(*key)).totals.add(usage)
    return sorted(
        rows.values(),
        key=lambda r: (-sum(r.totals.cost.values(), Decimal(0)), r.model_revision, r.task_class),
    )
