"""Usage and cost of a report's period: tokens per day and scope, priced at the price in effect.

Tokens: input consumed is ``Reservation.input_consumed``; output consumed is ``captured + overrun`` (what was
posted to the accounts, overruns included). Cost is tokens × the model revision's price in effect when the
request was admitted (``Price``), per million tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date
from decimal import Decimal
from typing import Any

from django.db.models import Count, F, OuterRef, Subquery, Sum
from django.db.models.functions import TruncDate

from budgeting.backoffice.reports.query import ReportQuery
from budgeting.backoffice.reports.selectors import reservations
from budgeting.catalog.models import Price
from ledger.models import State

MILLION = Decimal(1_000_000)
COST_QUANTUM = Decimal("0.000001")


@dataclass(frozen=True)
class UsageRow:
    """Usage of one UTC day × tenant × task class × pool × model revision × rung × price in effect."""

    day: date
    tenant: str
    tenant_name: str
    task_class: str
    pool: str
    region: str
    model_revision: str
    rung: str
    requests: int
    input_tokens: int
    output_tokens: int
    price_id: int | None
    currency: str | None
    input_price: Decimal | None
    output_price: Decimal | None

    @property
    def input_cost(self) -> Decimal | None:
        return None if self.input_price is None else _cost(self.input_tokens, self.input_price)

    @property
    def output_cost(self) -> Decimal | None:
        return None if self.output_price is None else _cost(self.output_tokens, self.output_price)

    @property
    def cost(self) -> Decimal | None:
        if self.input_cost is None or self.output_cost is None:
            return None
        return self.input_cost + self.output_cost


def _cost(tokens: int, per_million: Decimal) -> Decimal:
    return (Decimal(tokens) * per_million / MILLION).quantize(COST_QUANTUM)


def usage_rows(q: ReportQuery) -> Iterator[UsageRow]:
    """Usage and cost rows of the period, ordered by day then scope; streamed from the database."""
    price_in_effect = (
        Price.objects.filter(
            model_revision=OuterRef("model_revision"), effective_from__lte=OuterRef("created_at")
        )
        .order_by("-effective_from")
        .values("pk")[:1]
    )
    grouped = (
        reservations(q)
        .exclude(state__in=[State.PROPOSED, State.REJECTED])
        .annotate(day=TruncDate("created_at", tzinfo=UTC), price_id=Subquery(price_in_effect))
        .values(
            "day",
            "price_id",
            tenant_slug=F("tenant__slug"),
            tenant_name=F("tenant__name"),
            task_slug=F("task_class__slug"),
            pool_slug=F("model_pool__slug"),
            region=F("model_pool__region"),
            model=F("model_revision__name"),
            rung_name=F("rung"),
        )
        .annotate(
            requests=Count("pk"),
            input_tokens=Sum("input_consumed"),
            output_tokens=Sum(F("captured") + F("overrun")),
        )
        .order_by("day", "tenant_slug", "task_slug", "pool_slug", "model", "rung_name", "price_id")
    )
    prices: dict[int, Price] = {}
    for row in grouped.iterator(chunk_size=2000):
        price = None
        if row["price_id"] is not None:
            price = prices.get(row["price_id"]) or prices.setdefault(
                row["price_id"], Price.objects.get(pk=row["price_id"])
            )
        yield UsageRow(
            day=row["day"],
            tenant=row["tenant_slug"],
            tenant_name=row["tenant_name"],
            task_class=row["task_slug"],
            pool=row["pool_slug"],
            region=row["region"],
            model_revision=row["model"],
            rung=row["rung_name"],
            requests=row["requests"],
            input_tokens=row["input_tokens"] or 0,
            output_tokens=row["output_tokens"] or 0,
            price_id=row["price_id"],
            currency=price.currency if price else None,
            input_price=price.input_per_million if price else None,
            output_price=price.output_per_million if price else None,
        )


@dataclass
class Totals:
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    unpriced_requests: int = 0
    cost: dict[str, Decimal] = field(default_factory=dict)

    def add(self, row: UsageRow) -> None:
        self.requests += row.requests
        self.input_tokens += row.input_tokens
        self.output_tokens += row.output_tokens
        if row.cost is None or row.currency is None:
            self.unpriced_requests += row.requests
        else:
            self.cost[row.currency] = self.cost.get(row.currency, Decimal(0)) + row.cost

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "inputTokens": self.input_tokens,
            "outputTokens": self.output_tokens,
            "cost": {currency: str(amount) for currency, amount in sorted(self.cost.items())},
            "unpricedRequests": self.unpriced_requests,
        }


USAGE_COLUMNS = (
    "day",
    "tenant",
    "taskClass",
    "pool",
    "modelRevision",
    "rung",
    "requests",
    "inputTokens",
    "outputTokens",
    "currency",
    "inputPricePerMillion",
    "outputPricePerMillion",
    "inputCost",
    "outputCost",
    "cost",
)


def usage_record(row: UsageRow) -> dict[str, Any]:
    """One usage row as the JSON/CSV record (USAGE_COLUMNS); money as strings so no float touches it."""

    def text(value: Decimal | None) -> str | None:
        return None if value is None else str(value)

    return {
        "day": row.day.isoformat(),
        "tenant": row.tenant,
        "taskClass": row.task_class,
        "pool": row.pool,
        "modelRevision": row.model_revision,
        "rung": row.rung,
        "requests": row.requests,
        "inputTokens": row.input_tokens,
        "outputTokens": row.output_tokens,
        "currency": row.currency,
        "inputPricePerMillion": text(row.input_price),
        "outputPricePerMillion": text(row.output_price),
        "inputCost": text(row.input_cost),
        "outputCost": text(row.output_cost),
        "cost": text(row.cost),
    }
