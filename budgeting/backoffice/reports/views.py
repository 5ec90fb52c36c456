"""The analysts' report pages: ``GET /api/v1/reports`` (JSON, CSV, FOCUS CSV), the admin report page and a
tenant's spend page.

The API is for people signed in to the admin (a staff session with a role that may read reports), not for
gateways: bearer tokens are not accepted here.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Iterator, Sequence
from decimal import Decimal
from typing import Any
from urllib.parse import urlencode

from django.contrib.auth.models import AbstractBaseUser, AbstractUser, AnonymousUser
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.template.response import TemplateResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from budgeting.api.problems import PROBLEM_CONTENT_TYPE, Problem, problem_body, status_of
from budgeting.backoffice.formats import money_places
from budgeting.backoffice.reports import selectors, spend
from budgeting.backoffice.reports.charts import backlog_chart, deviation_chart, rung_chart
from budgeting.backoffice.reports.document import report
from budgeting.backoffice.reports.focus import FOCUS_COLUMNS, focus_records
from budgeting.backoffice.reports.pricing import USAGE_COLUMNS, usage_record, usage_rows
from budgeting.backoffice.reports.query import ReportQueryInvalid, parse_query
from budgeting.backoffice.roles import REPORT_PERMISSION
from budgeting.catalog.errors import DomainError
from budgeting.catalog.models import ModelPool, TaskClass, Tenant

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


def _problem(error: DomainError) -> JsonResponse:
    return JsonResponse(problem_body(error), status=status_of(error), content_type=PROBLEM_CONTENT_TYPE)


class _Echo:
    """A file-like object whose write returns the line, so csv.writer can feed a streaming response."""

    def write(self, value: str) -> str:
        return value


def _csv_lines(columns: Sequence[str], records: Iterable[dict[str, Any]]) -> Iterator[str]:
    writer = csv.writer(_Echo())
    yield writer.writerow(columns)
    for record in records:
        yield writer.writerow(["" if record[c] is None else record[c] for c in columns])


# It only reads, and answers any other method 405 itself: a POST refused by the CSRF check first was a 403.
@csrf_exempt
def reports_api(request: HttpRequest) -> HttpResponseBase:
    """GET /api/v1/reports?from=&to=&tenant=&taskClass=&pool=&format=json|csv|focus.

    json: the whole report (totals, per-rung series, deviation, quality, leaks, drift, backlog, usage rows);
    csv: the usage rows with cost; focus: the same usage with FOCUS column names. CSV is streamed.
    Answers problem+json 401 (not signed in), 403 (no report role), 400 (bad parameter), 405.
    """
    if request.method != "GET":
        refused = _problem(Problem("only GET", status=405, code="METHOD_NOT_ALLOWED"))
        refused["Allow"] = "GET"
        return refused
    if not request.user.is_authenticated:
        return _problem(NotSignedIn("sign in to the admin; gateway tokens cannot read reports"))
    if not may_read_reports(request.user):
        return _problem(NotAllowed("reports need the analyst, finance or platform role"))
    fmt = request.GET.get("format", "json")
    if fmt not in FORMATS:
        return _problem(ReportQueryInvalid(f"format must be one of {', '.join(FORMATS)}", field="format"))
    now = timezone.now()
    try:
        query = parse_query(request.GET, today=now.date())
    except ReportQueryInvalid as exc:
        return _problem(exc)
    if fmt == "json":
        return JsonResponse(report(query, now=now))
    params = query.as_params()
    if fmt == "csv":
        records: Iterable[dict[str, Any]] = map(usage_record, usage_rows(query))
        columns: Sequence[str] = USAGE_COLUMNS
        name = f"usage-{params['from']}-{params['to']}.csv"
    else:
        records = focus_records(usage_rows(query))
        columns = FOCUS_COLUMNS
        name = f"usage-focus-{params['from']}-{params['to']}.csv"
    response = StreamingHttpResponse(_csv_lines(columns, records), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response


def report_page(request: HttpRequest, context: dict[str, Any]) -> TemplateResponse:
    """The admin report page (the caller, UsageReportAdmin, has checked the permission)."""
    now = timezone.now()
    errors: dict[str, str] = {}
    try:
        query = parse_query(request.GET, today=now.date())
    except ReportQueryInvalid as exc:
        errors[str(exc.extra.get("field", "from"))] = exc.detail
        query = parse_query({}, today=now.date())
    data = report(query, now=now)
    cost = {currency: Decimal(amount) for currency, amount in data["totals"]["cost"].items()}
    # One number of decimals per currency for the whole column and its total, so that the rows add up.
    column = [
        {r["currency"]: Decimal(r["cost"])} for r in data["usage"] if r.get("cost") and r.get("currency")
    ]
    return TemplateResponse(
        request,
        "admin/budgeting/report.html",
        {
            **context,
            "title": "Usage report",
            "query": query,
            "params": query.as_params(),
            "errors": errors,
            "report": data,
            "generated_at": now,
            "cost": cost,
            "money_places": money_places(column, cost),
            "usage_preview": data["usage"][:100],
            "rung_chart": rung_chart(*selectors.requests_over_time(query)),
            "deviation_chart": deviation_chart(data["deviationHistogram"]),
            "backlog_chart": backlog_chart(data["reconcilingBacklog"]),
            "tenants": Tenant.objects.values_list("slug", flat=True),
            "task_classes": TaskClass.objects.values_list("slug", flat=True),
            "pools": ModelPool.objects.values_list("slug", flat=True),
            "export_query": urlencode(query.as_params()),
        },
    )


def tenant_spend_page(request: HttpRequest, context: dict[str, Any], tenant: Tenant) -> TemplateResponse:
    """A tenant's spend this month: to date, projected to the month's end, by model revision and task class
    (the caller, UsageReportAdmin, has checked the permission)."""
    now = timezone.now()
    to_date = spend.spend(now=now, tenant=tenant.slug)
    rows = spend.tenant_breakdown(tenant.slug, now)
    return TemplateResponse(
        request,
        "admin/budgeting/tenant_spend.html",
        {
            **context,
            "title": f"Spend of {tenant.slug}",
            "tenant": tenant,
            "now": now,
            "spend": to_date,
            "rows": rows,
            "money_places": money_places([r.totals.cost for r in rows], to_date.to_date),
            "run_rate_days": spend.RUN_RATE_DAYS,
        },
    )
