"""The analysts' reports: ``GET /api/v1/reports`` (JSON, CSV, FOCUS CSV) and the admin report page with its
charts, drawn as inline SVG on the server (no script, no external service).

The API is for people signed in to the admin (a staff session with a role that may read reports), not for
gateways: bearer tokens are not accepted here.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from django.contrib.auth.models import AbstractBaseUser, AbstractUser, AnonymousUser
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.template.response import TemplateResponse
from django.utils import timezone

from budgeting.api.problems import PROBLEM_CONTENT_TYPE, Problem
from budgeting.backoffice import reports
from budgeting.backoffice.roles import REPORT_PERMISSION
from budgeting.catalog.models import ModelPool, TaskClass, Tenant
from ladder.policy import RUNGS

FORMATS = ("json", "csv", "focus")


class NotSignedIn(Problem):
    status = 401
    code = "UNAUTHENTICATED"
    title = "Sign in to the admin to read reports"


class NotAllowed(Problem):
    status = 403
    code = "FORBIDDEN"
    title = "Your role may not read reports"


def may_read_reports(user: AbstractBaseUser | AnonymousUser) -> bool:
    """A signed-in, active staff user whose role may read reports."""
    return (
        isinstance(user, AbstractUser)
        and user.is_active
        and user.is_staff
        and user.has_perm(REPORT_PERMISSION)
    )


def _problem(problem: Problem) -> JsonResponse:
    return JsonResponse(problem.body(), status=problem.status, content_type=PROBLEM_CONTENT_TYPE)


class _Echo:
    """A file-like object whose write returns the line, so csv.writer can feed a streaming response."""

    def write(self, value: str) -> str:
        return value


def _csv_lines(columns: Sequence[str], records: Iterable[dict[str, Any]]) -> Iterator[str]:
    writer = csv.writer(_Echo())
    yield writer.writerow(columns)
    for record in records:
        yield writer.writerow(["" if record[c] is None else record[c] for c in columns])


def reports_api(request: HttpRequest) -> HttpResponseBase:
    """GET /api/v1/reports?from=&to=&tenant=&taskClass=&pool=&format=json|csv|focus.

    json: the whole report (totals, per-rung series, deviation, quality, leaks, drift, backlog, usage rows);
    csv: the usage rows with cost; focus: the same usage with FOCUS column names. CSV is streamed.
    Answers problem+json 401 (not signed in), 403 (no report role), 400 (bad parameter), 405.
    """
    if request.method != "GET":
        return _problem(Problem("only GET", status=405, code="METHOD_NOT_ALLOWED"))
    if not request.user.is_authenticated:
        return _problem(NotSignedIn("sign in to the admin; gateway tokens cannot read reports"))
    if not may_read_reports(request.user):
        return _problem(NotAllowed("reports need the analyst, finance or platform role"))
    fmt = request.GET.get("format", "json")
    if fmt not in FORMATS:
        return _problem(
            reports.ReportQueryInvalid(f"format must be one of {', '.join(FORMATS)}", field="format")
        )
    now = timezone.now()
    try:
        query = reports.parse_query(request.GET, today=now.date())
    except reports.ReportQueryInvalid as exc:
        return _problem(exc)
    if fmt == "json":
        return JsonResponse(reports.report(query, now=now))
    params = query.as_params()
    if fmt == "csv":
        records: Iterable[dict[str, Any]] = map(reports.usage_record, reports.usage_rows(query))
        columns: Sequence[str] = reports.USAGE_COLUMNS
        name = f"usage-{params['from']}-{params['to']}.csv"
    else:
        records = reports.focus_records(reports.usage_rows(query))
        columns = reports.FOCUS_COLUMNS
        name = f"usage-focus-{params['from']}-{params['to']}.csv"
    response = StreamingHttpResponse(_csv_lines(columns, records), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response


# --- charts -------------------------------------------------------------------------------------------------

RUNG_COLORS = {
    "FULL": "#2e7d32",
    "DEDUP_EVIDENCE": "#1565c0",
    "COMPACT_HISTORY": "#6a1b9a",
    "NARROW_WORKFLOW": "#ef6c00",
    "TRIM_EVIDENCE": "#c62828",
    "SMALLER_MODEL": "#00838f",
    "QUEUE_OR_REJECT": "#616161",
}
OTHER_COLOR = "#9e9e9e"


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    color: str
    title: str


@dataclass(frozen=True)
class Tick:
    position: float
    label: str


@dataclass(frozen=True)
class Chart:
    """Geometry of a bar chart; ``templates/admin/budgeting/_bar_chart.html`` draws it."""

    title: str
    width: int
    height: int
    left: int
    top: int
    right: int
    bottom: int
    bars: list[Bar]
    x_ticks: list[Tick]
    y_ticks: list[Tick]
    legend: list[tuple[str, str]]
    x_label: str
    y_label: str

    @property
    def empty(self) -> bool:
        return not self.bars


def _nice_step(maximum: float, ticks: int = 4) -> float:
    raw = maximum / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def bar_chart(
    title: str,
    categories: Sequence[str],
    series: Sequence[tuple[str, str, Sequence[int]]],
    *,
    x_label: str,
    y_label: str,
    width: int = 760,
    height: int = 240,
    max_x_labels: int = 12,
) -> Chart:
    """Stacked bars: one bar per category, one segment per series (name, color, values per category)."""
    left, right, top, bottom = 56, 12, 12, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    totals = [sum(values[i] for _, _, values in series) for i in range(len(categories))]
    peak = max(totals, default=0)
    bars: list[Bar] = []
    y_ticks: list[Tick] = []
    if peak:
        step = max(_nice_step(peak), 1.0)  # counts: no half-request gridlines
        top_value = math.ceil(peak / step) * step
        scale = plot_h / top_value
        y_ticks = [
            Tick(top + plot_h - v * scale, f"{v:g}")
            for v in (step * i for i in range(int(top_value / step) + 1))
        ]
        slot = plot_w / max(len(categories), 1)
        bar_w = max(slot * 0.7, 1.0)
        for i, category in enumerate(categories):
            base = float(top + plot_h)
            for name, color, values in series:
                if values[i]:
                    h = values[i] * scale
                    base -= h
                    bars.append(
                        Bar(
                            left + i * slot + (slot - bar_w) / 2,
                            base,
                            bar_w,
                            h,
                            color,
                            f"{category} · {name}: {values[i]}",
                        )
                    )
    every = max(1, math.ceil(len(categories) / max_x_labels))
    slot = plot_w / max(len(categories), 1)
    x_ticks = [Tick(left + i * slot + slot / 2, c) for i, c in enumerate(categories) if i % every == 0]
    legend = [(name, color) for name, color, values in series if any(values)] if len(series) > 1 else []
    return Chart(
        title, width, height, left, top, right, bottom, bars, x_ticks, y_ticks, legend, x_label, y_label
    )


def rung_chart(query: reports.ReportQuery, per_rung: list[dict[str, Any]]) -> Chart:
    days = [d.isoformat() for d in query.days]
    index = {day: i for i, day in enumerate(days)}
    rungs = [r for r in RUNGS if any(row["rung"] == r for row in per_rung)]
    rungs += sorted({row["rung"] for row in per_rung} - set(rungs))
    series = []
    for rung in rungs:
        values = [0] * len(days)
        for row in per_rung:
            if row["rung"] == rung and row["day"] in index:
                values[index[row["day"]]] += row["requests"]
        series.append((rung, RUNG_COLORS.get(rung, OTHER_COLOR), values))
    labels = [d[5:] for d in days]
    return bar_chart("Requests per rung", labels, series, x_label="day (UTC)", y_label="requests")


def deviation_chart(histogram: list[dict[str, Any]]) -> Chart:
    labels = []
    for bucket in histogram:
        if bucket["from"] is None:
            labels.append(f"<{bucket['to']:g}")
        elif bucket["to"] is None:
            labels.append(f"≥{bucket['from']:g}")
        else:
            labels.append(f"{bucket['from']:g}")
    values = [b["count"] for b in histogram]
    return bar_chart(
        "Input deviation (provider-reported vs our count)",
        labels,
        [("reservations", "#1565c0", values)],
        x_label="deviation, % (each bar from its label to the next)",
        y_label="reservations",
        width=460,
        max_x_labels=len(labels),
    )


def backlog_chart(backlog: dict[str, Any]) -> Chart:
    labels = [b["label"] for b in backlog["byAge"]]
    values = [b["count"] for b in backlog["byAge"]]
    return bar_chart(
        "Reconciling backlog by age",
        labels,
        [("reservations", "#ef6c00", values)],
        x_label="age since dispatch",
        y_label="reservations",
        width=460,
        max_x_labels=len(labels),
    )


def thousands(value: Any) -> Any:
    """The report with its integers written with thousands separators, for reading on the page."""
    if isinstance(value, bool) or not isinstance(value, int | dict | list):
        return value
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        return {k: thousands(v) for k, v in value.items()}
    return [thousands(v) for v in value]


def report_page(request: HttpRequest, context: dict[str, Any]) -> TemplateResponse:
    """The admin report page (the caller, UsageReportAdmin, has checked the permission)."""
    now = timezone.now()
    errors: dict[str, str] = {}
    try:
        query = reports.parse_query(request.GET, today=now.date())
    except reports.ReportQueryInvalid as exc:
        errors[str(exc.extra.get("field", "from"))] = exc.detail
        query = reports.parse_query({}, today=now.date())
    data = reports.report(query, now=now)
    params = query.as_params()
    return TemplateResponse(
        request,
        "admin/budgeting/report.html",
        {
            **context,
            "title": "Usage report",
            "query": query,
            "params": params,
            "errors": errors,
            "report": thousands(data),
            "usage_preview": thousands(data["usage"][:100]),
            "rung_chart": rung_chart(query, data["requestsPerRung"]),
            "deviation_chart": deviation_chart(data["deviationHistogram"]),
            "backlog_chart": backlog_chart(data["reconcilingBacklog"]),
            "tenants": Tenant.objects.values_list("slug", flat=True),
            "task_classes": TaskClass.objects.values_list("slug", flat=True),
            "pools": ModelPool.objects.values_list("slug", flat=True),
            "export_query": urlencode(params),
        },
    )
