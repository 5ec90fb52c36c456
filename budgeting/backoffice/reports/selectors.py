"""The reads behind the report's figures: requests and decisions, input deviation, quality, leaks, context
overflows, the RECONCILING backlog, and how far settlement was from what was billed."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection
from django.db.models import Count, Max, Min, OuterRef, QuerySet, Subquery, Sum
from django.db.models.functions import TruncDate, TruncDay, TruncHour

from budgeting.admission.models import Manifest
from budgeting.backoffice.reports.query import ReportQuery
from budgeting.catalog.models import ModelPool, TaskClass, Tenant
from ledger.models import EntryKind, Hold, LedgerEntry, Reservation, State
from ledger.selectors import CONTEXT_OVERFLOW_PATTERN, leak_filter

# Gateways report a provider's context-window refusal through POST .../fail with a reason; these are the
# spellings providers use (OpenAI "context_length_exceeded", Anthropic "prompt is too long", generic ones).
# Input deviation: (provider-reported − our count) / our count, in percent, bucketed for the chart.
DEVIATION_EDGES = (-10.0, -5.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 5.0, 10.0)

# Requests spanning at most this long are charted per hour; longer spans per day.
CHART_HOURLY_SPAN = timedelta(hours=48)

BACKLOG_AGE_EDGES = (
    ("< 5 min", 300),
    ("5–30 min", 1800),
    ("30 min–2 h", 7200),
    ("2–24 h", 86400),
    ("> 24 h", None),
)


def manifests(q: ReportQuery) -> QuerySet[Manifest]:
    return Manifest.objects.filter(created_at__gte=q.start, created_at__lt=q.end).filter(q.scope())


def reservations(q: ReportQuery) -> QuerySet[Reservation]:
    return Reservation.objects.filter(created_at__gte=q.start, created_at__lt=q.end).filter(q.scope())


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


def requests_over_time(q: ReportQuery) -> tuple[str, list[dict[str, Any]]]:
    """Requests per rung in time buckets that fit the data: hours when the period's requests span at most
    CHART_HOURLY_SPAN, days otherwise. Returns the unit ("hour" or "day") and rows of bucket start (ISO, UTC),
    rung and requests, oldest first; only buckets that have requests."""
    qs = manifests(q)
    span = qs.aggregate(first=Min("created_at"), last=Max("created_at"))
    if span["first"] is None:
        return "day", []
    unit = "hour" if span["last"] - span["first"] <= CHART_HOURLY_SPAN else "day"
    bucket = TruncHour("created_at", tzinfo=UTC) if unit == "hour" else TruncDay("created_at", tzinfo=UTC)
    rows = qs.annotate(at=bucket).values("at", "rung").annotate(requests=Count("pk")).order_by("at", "rung")
    return unit, [{"at": r["at"].isoformat(), "rung": r["rung"], "requests": r["requests"]} for r in rows]


# --- raw SQL: deviation and quality -------------------------------------------------------------------------


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


def _fetch(sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def _round(value: Any) -> float | None:
    return None if value is None else round(float(value), 3)


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
        for name, n, mean, pcts, p99_abs in _fetch(sql, params)
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
    counts = dict(_fetch(sql, params))
    # width_bucket(x, edges) is 0 below the first edge, i when edges[i-1] <= x < edges[i].
    buckets = []
    for i in range(len(DEVIATION_EDGES) + 1):
        low = DEVIATION_EDGES[i - 1] if i > 0 else None
        high = DEVIATION_EDGES[i] if i < len(DEVIATION_EDGES) else None
        buckets.append({"from": low, "to": high, "count": counts.get(i, 0)})
    return buckets


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
    return [
        {
            "rung": rung,
            "outcomes": outcomes,
            "successRate": _round(success),
            "citationRequests": cited,
            "citationCompleteness": _round(completeness),
        }
        for rung, outcomes, success, cited, completeness in _fetch(sql, params)
        if outcomes or cited
    ]


# --- leaks, overflows, backlog, drift -----------------------------------------------------------------------


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
        qs = qs.filter(q.scope())
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
