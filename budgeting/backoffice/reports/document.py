"""The whole report of a query as one JSON document: what the report page shows and format=json answers."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from budgeting.backoffice.reports import selectors
from budgeting.backoffice.reports.pricing import Totals, usage_record, usage_rows
from budgeting.backoffice.reports.query import ReportQuery


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
        "decisions": selectors.decision_totals(q),
        "requestsPerRung": selectors.requests_per_rung(q),
        "deviationByModel": selectors.deviation_by_model(q),
        "deviationHistogram": selectors.deviation_histogram(q),
        "qualityByRung": selectors.quality_by_rung(q),
        "leaks": selectors.leaks(q, now),
        "contextOverflows": selectors.context_overflows(q),
        "settledVsBilled": selectors.settled_vs_billed(q),
        "reconcilingBacklog": selectors.reconciling_backlog(now, q),
        "usage": usage,
    }
