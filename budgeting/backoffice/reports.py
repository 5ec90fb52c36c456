"""Reads for the analysts' reports: usage and cost, requests per rung, deviation, quality, leaks, drift.

Every figure is a query over the manifests, reservations and ledger entries of a period and scope, so a report
and an export of the same query agree with each other and with the database. Requests are dated by when
they were admitted (``created_at``, UTC days).

Tokens: input consumed is ``Reservation.input_consumed``; output consumed is ``captured + overrun`` (what was
posted to the accounts, overruns included). Cost is tokens × the model revision's price in effect when the
request was admitted (``Price``), per million tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

from django.db import connection
from django.db.models import Count, F, Min, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.functions import TruncDate

from budgeting.admission.models import Manifest
from budgeting.api.problems import InvalidInput
from budgeting.catalog.models import ModelPool, Price, TaskClass, Tenant
from ledger.models import EntryKind, Hold, LedgerEntry, Reservation, State

MILLION = Decimal(1_000_000)
COST_QUANTUM = Decimal("0.000001")
DEFAULT_DAYS = 30
MAX_DAYS = 400

# Gateways report a provider's context-window refusal through POST .../fail with a reason; these are the
# spellings providers use (OpenAI "context_length_exceeded", Anthropic "prompt is too long", generic ones).
CONTEXT_OVERFLOW_PATTERN = r"context[ _-]?(length|window|overflow)|prompt is too long|CONTEXT_OVERFLOW"

# Input deviation: (provider-reported − our count) / our count, in percent, bucketed for the chart.
DEVIATION_EDGES = (-10.0, -5.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 5.0, 10.0)

BACKLOG_AGE_EDGES = (
    ("< 5 min", 300),
    ("5–30 min", 1800),
    ("30 min–2 h", 7200),
    ("2–24 h", 86400),
    ("> 24 h", None),
)


class ReportQueryInvalid(InvalidInput):
    code = "INVALID_REPORT_QUERY"
    title = "The report query is not valid"


@dataclass(frozen=True)
class ReportQuery:
    """A period [start, end) in UTC and an optional scope (slugs)."""

    start: datetime
    end: datetime
    tenant: str | None = None
    task_class: str | None = None
    pool: str | None = None

    @property
    def days(self) -> list[date]:
        first = self.start.date()
        count = (self.end - self.start + timedelta(seconds=86399)).days
        return [first + timedelta(days=i) for i in range(count)]

    def as_params(self) -> dict[str, str]:
        """The query as the API's parameters (``to`` is the last day included)."""
        params = {
            "from": self.start.date().isoformat(),
            "to": (self.end - timedelta(seconds=1)).date().isoformat(),
        }
        for name, value in (("tenant", self.tenant), ("taskClass", self.task_class), ("pool", self.pool)):
            if value:
                params[name] = value
        return params


def _day(raw: str, name: str) -> date:
    try:
        return date.fromisoformat(raw)
    except ValueError:
        raise ReportQueryInvalid(f"{name} must be a date (YYYY-MM-DD)", field=name) from None


def parse_query(params: Mapping[str, str], *, today: date) -> ReportQuery:
    """Read ``from``/``to`` (inclusive UTC days; default the last 30 days) and the
    ``tenant``/``taskClass``/``pool`` slugs. Raises ReportQueryInvalid naming the parameter (bad date,
    reversed or too long period, unknown slug)."""
    last = _day(params["to"], "to") if params.get("to") else today
    first = _day(params["from"], "from") if params.get("from") else last - timedelta(days=DEFAULT_DAYS - 1)
    if first > last:
        raise ReportQueryInvalid("from is after to", field="from")
    if (last - first).days + 1 > MAX_DAYS:
        raise ReportQueryInvalid(f"a report covers at most {MAX_DAYS} days", field="from")
    scope: dict[str, str | None] = {}
    for name, model in (("tenant", Tenant), ("taskClass", TaskClass), ("pool", ModelPool)):
        slug = (params.get(name) or "").strip() or None
        if slug is not None and not model.objects.filter(slug=slug).exists():
            raise ReportQueryInvalid(f"unknown {name} {slug!r}", field=name)
        scope[name] = slug
    return ReportQuery(
        start=datetime.combine(first, time.min, tzinfo=UTC),
        end=datetime.combine(last + timedelta(days=1), time.min, tzinfo=UTC),
        tenant=scope["tenant"],
        task_class=scope["taskClass"],
        pool=scope["pool"],
    )


def manifests(q: ReportQuery) -> QuerySet[Manifest]:
    qs = Manifest.objects.filter(created_at__gte=q.start, created_at__lt=q.end)
    if q.tenant:
        qs = qs.filter(tenant__slug=q.tenant)
    if q.task_class:
        qs = qs.filter(task_class__slug=q.task_class)
    if q.pool:
        qs = qs.filter(model_pool__slug=q.pool)
    return qs


def reservations(q: ReportQuery) -> QuerySet[Reservation]:
    qs = Reservation.objects.filter(created_at__gte=q.start, created_at__lt=q.end)
    if q.tenant:
        qs = qs.filter(tenant__slug=q.tenant)
    if q.task_class:
        qs = qs.filter(task_class__slug=q.task_class)
    if q.pool:
        qs = qs.filter(model_pool__slug=q.pool)
    return qs


# --- requests and decisions ---------------------------------------------------------------------------------


def decision_totals(q: ReportQuery) -> dict[str, Any]:
    """Requests (manifests) by decision and by mode."""
    qs = manifests(q)
    by_decision = dict(qs.values_list("decision").annotate(n=Count("pk")).order_by())
    by_mode = dict(qs.values_list("mode").annotate(n=Count("pk")).order_by())
    return {"requests": sum(by_decision.values()), "byDecision": by_decision, "byMode": by_mode}


def requests_per_rung(q: ReportQuery) -> list[dict[str, Any]]:
    """Requests per UTC day and rung (every decision, shadow included), oldest first."""
    rows = (
        manifests(q)
        .annotate(day=TruncDate("created_at", tzinfo=UTC))
        .values("day", "rung")
        .annotate(requests=Count("pk"))
        .order_by("day", "rung")
    )
    return [{"day": r["day"].isoformat(), "rung": r["rung"], "requests": r["requests"]} for r in rows]


# --- deviation ----------------------------------------------------------------------------------------------


def _where(q: ReportQuery, alias: str) -> tuple[str, list[Any]]:
    """SQL filter for reservations (table alias ``alias``) matching the query."""
    clauses = [f"{alias}.created_at >= %s", f"{alias}.created_at < %s"]
    params: list[Any] = [q.start, q.end]
    for column, model, slug in (
        ("tenant_id", Tenant, q.tenant),
        ("task_class_id", TaskClass, q.task_class),
        ("model_pool_id", ModelPool, q.pool),
    ):
        if slug:
            clauses.append(f"{alias}.{column} = (SELECT id FROM {model._meta.db_table} WHERE slug = %s)")
            params.append(slug)
    return " AND ".join(clauses), params


def deviation_by_model(q: ReportQuery) -> list[dict[str, Any]]:
    """Per model revision: how far the provider-reported input was from our count, in percent
    (n, mean, p50, p90, p99 of the signed deviation, and p99 of its absolute value)."""
    where, params = _where(q, "r")
    sql = f"""
        SELECT m.name, count(*),
               avg(d.dev),
               percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY d.dev),
               percentile_cont(0.99) WITHIN GROUP (ORDER BY abs(d.dev))
          FROM ledger_reservation r
          JOIN budgeting_modelrevision m ON m.id = r.model_revision_id
          CROSS JOIN LATERAL (
              SELECT 100.0 * (r.input_reported - r.input_reserved) / r.input_reserved AS dev
          ) d
         WHERE {where} AND r.input_reported IS NOT NULL AND r.input_reserved > 0
         GROUP BY m.name
         ORDER BY m.name
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    return [
        {
            "modelRevision": name,
            "n": n,
            "meanPercent": _round(mean),
            "p50Percent": _round(pcts[0]),
            "p90Percent": _round(pcts[1]),
            "p99Percent": _round(pcts[2]),
            "p99AbsPercent": _round(p99_abs),
        }
        for name, n, mean, pcts, p99_abs in rows
    ]


def deviation_histogram(q: ReportQuery) -> list[dict[str, Any]]:
    """Reservations per deviation bucket (percent; bucket ``le`` is its upper edge, None for the last)."""
    where, params = _where(q, "r")
    edges = ", ".join(str(e) for e in DEVIATION_EDGES)
    sql = f"""
        SELECT width_bucket(100.0 * (r.input_reported - r.input_reserved) / r.input_reserved,
                            ARRAY[{edges}]::numeric[]) AS b, count(*)
          FROM ledger_reservation r
         WHERE {where} AND r.input_reported IS NOT NULL AND r.input_reserved > 0
         GROUP BY b
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        counts = dict(cursor.fetchall())
    # width_bucket(x, edges) is 0 below the first edge, i when edges[i-1] <= x < edges[i].
    buckets = []
    for i in range(len(DEVIATION_EDGES) + 1):
        low = DEVIATION_EDGES[i - 1] if i > 0 else None
        high = DEVIATION_EDGES[i] if i < len(DEVIATION_EDGES) else None
        buckets.append({"from": low, "to": high, "count": counts.get(i, 0)})
    return buckets


def _round(value: Any) -> float | None:
    return None if value is None else round(float(value), 3)


# --- quality ------------------------------------------------------------------------------------------------


def quality_by_rung(q: ReportQuery) -> list[dict[str, Any]]:
    """Per rung, from the outcome endpoint: reports received, task success rate, and citation completeness
    (the share of a request's minimum-retention evidence ids its answer cited, averaged over requests that
    had a minimum set)."""
    where, params = _where(q, "r")
    sql = f"""
        SELECT r.rung,
               count(*) FILTER (WHERE r.task_success IS NOT NULL),
               avg(CASE WHEN r.task_success THEN 1.0 ELSE 0.0 END) FILTER (WHERE r.task_success IS NOT NULL),
               count(*) FILTER (WHERE r.cited_evidence_ids IS NOT NULL
                                  AND jsonb_array_length(r.minimum_evidence_ids) > 0),
               avg((SELECT count(*) FROM jsonb_array_elements_text(r.minimum_evidence_ids) m(id)
                     WHERE r.cited_evidence_ids ? m.id)::numeric
                   / jsonb_array_length(r.minimum_evidence_ids))
                   FILTER (WHERE r.cited_evidence_ids IS NOT NULL
                             AND jsonb_array_length(r.minimum_evidence_ids) > 0)
          FROM ledger_reservation r
         WHERE {where}
         GROUP BY r.rung
         ORDER BY r.rung
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    return [
        {
            "rung": rung,
            "outcomes": outcomes,
            "successRate": _round(success),
            "citationRequests": cited,
            "citationCompleteness": _round(completeness),
        }
        for rung, outcomes, success, cited, completeness in rows
        if outcomes or cited
    ]


# --- leaks, overflows, backlog, drift -----------------------------------------------------------------------


def leak_filter(now: datetime) -> Q:
    """Reservations holding capacity they should not: the leak definition of ``ledger.selectors.audit``
    (a terminal reservation still holding output or concurrency; a dispatched call whose lease expired and
    that is not RECONCILING), as one query."""
    terminal = Q(state__in=[State.SETTLED, State.REJECTED]) & (Q(concurrency_held=True) | Q(remaining__gt=0))
    expired = Q(
        state__in=[State.DISPATCHED, State.RUNNING, State.PARTIALLY_SETTLED], lease_expires_at__lt=now
    )
    return terminal | expired


def leaks(q: ReportQuery, now: datetime) -> dict[str, Any]:
    leaked = reservations(q).filter(leak_filter(now))
    return {
        "count": leaked.count(),
        "reservationIds": [str(pk) for pk in leaked.values_list("pk", flat=True)[:20]],
    }


def context_overflows(q: ReportQuery) -> int:
    """Provider context-window refusals reported by gateways (see CONTEXT_OVERFLOW_PATTERN)."""
    return reservations(q).filter(failure_reason__iregex=CONTEXT_OVERFLOW_PATTERN).count()


def reconciling_backlog(now: datetime, q: ReportQuery | None = None) -> dict[str, Any]:
    """RECONCILING reservations now (whatever their admission date, within the scope): count, oldest age, and
    counts per age bucket. Age runs from the dispatch (when the outcome became uncertain)."""
    qs = Reservation.objects.filter(state=State.RECONCILING)
    if q is not None:
        if q.tenant:
            qs = qs.filter(tenant__slug=q.tenant)
        if q.task_class:
            qs = qs.filter(task_class__slug=q.task_class)
        if q.pool:
            qs = qs.filter(model_pool__slug=q.pool)
    ages = [
        (now - (dispatched or created)).total_seconds()
        for dispatched, created in qs.values_list("dispatched_at", "created_at")
    ]
    buckets = []
    low = 0
    for label, high in BACKLOG_AGE_EDGES:
        buckets.append(
            {"label": label, "count": sum(1 for a in ages if a >= low and (high is None or a < high))}
        )
        low = high or 0
    return {"count": len(ages), "oldestAgeSeconds": int(max(ages)) if ages else None, "byAge": buckets}


def _correction_source(reason: str) -> str:
    """The kind of evidence a correction came from ("billing import 12: billed …" → "billing import")."""
    if reason.startswith("provider counted"):
        return "provider usage report"
    head, sep, _ = reason.partition(":")
    return re.sub(r"\s+\d+$", "", head) if sep else reason


def settled_vs_billed(q: ReportQuery) -> list[dict[str, Any]]:
    """Corrections posted on reservations of the period, by source (provider lookups, billing imports, the
    providers' own input counts): how far settlement was from what was billed, in tokens.

    A correction is written once per held account; counting the entry on each reservation's lowest account
    counts every correction once.
    """
    first_account = (
        Hold.objects.filter(reservation=OuterRef("reservation"))
        .values("reservation")
        .annotate(a=Min("account_id"))
        .values("a")
    )
    rows = (
        LedgerEntry.objects.filter(
            kind=EntryKind.CORRECTION, reservation__in=reservations(q), account_id=Subquery(first_account)
        )
        .values("reason")
        .annotate(entries=Count("pk"), input=Sum("input_consumed"), output=Sum("output_consumed"))
        .order_by()
    )
    sources: dict[str, dict[str, Any]] = {}
    for row in rows:
        source = sources.setdefault(
            _correction_source(row["reason"]),
            {"corrections": 0, "inputTokens": 0, "outputTokens": 0},
        )
        source["corrections"] += row["entries"]
        source["inputTokens"] += row["input"] or 0
        source["outputTokens"] += row["output"] or 0
    return [{"source": name, **values} for name, values in sorted(sources.items())]


# --- usage and cost -----------------------------------------------------------------------------------------


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


# --- FOCUS --------------------------------------------------------------------------------------------------

# FOCUS 1.0 column names (FinOps Open Cost and Usage Specification); custom columns carry the x_ prefix the
# specification reserves for them. One row per usage row and token direction (input and output are priced as
# separate SKUs). Costs are list prices with no discounts, so Billed, Effective, List and Contracted agree.
FOCUS_COLUMNS = (
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodStart",
    "BillingPeriodEnd",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargeFrequency",
    "ChargePeriodStart",
    "ChargePeriodEnd",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "ContractedUnitPrice",
    "EffectiveCost",
    "InvoiceIssuerName",
    "ListCost",
    "ListUnitPrice",
    "PricingCategory",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "RegionId",
    "RegionName",
    "ResourceId",
    "ResourceName",
    "ResourceType",
    "ServiceCategory",
    "ServiceName",
    "SkuId",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
    "Tags",
    "x_TaskClass",
    "x_ModelPool",
    "x_Rung",
    "x_TokenDirection",
    "x_Requests",
    "x_PriceMissing",
)

PLATFORM_NAME = "Token budget admission platform"


def _month_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime(day.year, day.month, 1, tzinfo=UTC)
    end = datetime(day.year + (day.month == 12), day.month % 12 + 1, 1, tzinfo=UTC)
    return start, end


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def focus_records(rows: Iterator[UsageRow]) -> Iterator[dict[str, Any]]:
    """The usage rows as FOCUS records (two per row: input tokens and output tokens)."""
    for row in rows:
        billing_start, billing_end = _month_bounds(row.day)
        charge_start = datetime.combine(row.day, time.min, tzinfo=UTC)
        for direction, tokens, unit_price, cost in (
            ("input", row.input_tokens, row.input_price, row.input_cost),
            ("output", row.output_tokens, row.output_price, row.output_cost),
        ):
            amount = str(cost if cost is not None else Decimal("0.000000"))
            price = None if unit_price is None else str(unit_price)
            yield {
                "BilledCost": amount,
                "BillingAccountId": row.tenant,
                "BillingAccountName": row.tenant_name,
                "BillingCurrency": row.currency or "",
                "BillingPeriodStart": _iso(billing_start),
                "BillingPeriodEnd": _iso(billing_end),
                "ChargeCategory": "Usage",
                "ChargeClass": "",
                "ChargeDescription": f"{direction.capitalize()} tokens of {row.model_revision} "
                f"({row.task_class}, rung {row.rung})",
                "ChargeFrequency": "Usage-Based",
                "ChargePeriodStart": _iso(charge_start),
                "ChargePeriodEnd": _iso(charge_start + timedelta(days=1)),
                "ConsumedQuantity": tokens,
                "ConsumedUnit": "Tokens",
                "ContractedCost": amount,
                "ContractedUnitPrice": price or "",
                "EffectiveCost": amount,
                "InvoiceIssuerName": PLATFORM_NAME,
                "ListCost": amount,
                "ListUnitPrice": price or "",
                "PricingCategory": "Standard",
                "PricingQuantity": str(Decimal(tokens) / MILLION),
                "PricingUnit": "1M Tokens",
                "ProviderName": PLATFORM_NAME,
                "PublisherName": PLATFORM_NAME,
                "RegionId": row.region,
                "RegionName": row.region,
                "ResourceId": row.model_revision,
                "ResourceName": row.model_revision,
                "ResourceType": "Model revision",
                "ServiceCategory": "AI and Machine Learning",
                "ServiceName": "LLM inference",
                "SkuId": f"{row.model_revision}:{direction}",
                "SkuPriceId": "" if row.price_id is None else f"price-{row.price_id}:{direction}",
                "SubAccountId": f"{row.tenant}/{row.task_class}",
                "SubAccountName": f"{row.tenant_name} — {row.task_class}",
                "Tags": json.dumps({"taskClass": row.task_class, "modelPool": row.pool, "rung": row.rung}),
                "x_TaskClass": row.task_class,
                "x_ModelPool": row.pool,
                "x_Rung": row.rung,
                "x_TokenDirection": direction,
                "x_Requests": row.requests,
                "x_PriceMissing": "true" if unit_price is None else "false",
            }


# --- the whole report ---------------------------------------------------------------------------------------


def report(q: ReportQuery, *, now: datetime) -> dict[str, Any]:
    """Everything the report page shows and ``format=json`` answers."""
    totals = Totals()
    usage = []
    for row in usage_rows(q):
        totals.add(row)
        usage.append(usage_record(row))
    return {
        "query": q.as_params(),
        "generatedAt": now.isoformat(),
        "totals": totals.to_json(),
        "decisions": decision_totals(q),
        "requestsPerRung": requests_per_rung(q),
        "deviationByModel": deviation_by_model(q),
        "deviationHistogram": deviation_histogram(q),
        "qualityByRung": quality_by_rung(q),
        "leaks": leaks(q, now),
        "contextOverflows": context_overflows(q),
        "settledVsBilled": settled_vs_billed(q),
        "reconcilingBacklog": reconciling_backlog(now, q),
        "usage": usage,
    }
