"""The analysts' reports: the exports parse, their totals match the database, costs are what the ledger
posted at the prices frozen on each reservation (a later price correction changes no past figure), FOCUS
columns are there, and only staff sessions with a report role may read them."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.contrib.staticfiles import finders
from django.db import DatabaseError, transaction
from django.db.models import F, Sum
from django.test import Client
from django.utils import timezone

from budgeting.admission.models import Manifest
from budgeting.backoffice.reports.pricing import USAGE_COLUMNS
from budgeting.backoffice.reports.query import parse_query
from budgeting.backoffice.reports.selectors import requests_over_time
from budgeting.catalog.changes import SYSTEM
from budgeting.catalog.errors import InvalidChange
from budgeting.catalog.models import Price
from budgeting.catalog.prices import add_price
from ledger.models import Reservation, State
from tests.admin.conftest import login
from tests.admin.scenario import _admit, _dispatch, _usage
from tests.factories import ServiceClientFactory, issue_token

pytestmark = pytest.mark.django_db
URL = "/api/v1/reports"


def today() -> str:
    return timezone.now().date().isoformat()


def rows(response) -> list[dict[str, str]]:
    assert response["Content-Type"].startswith("text/csv")
    assert response.streaming
    text = b"".join(response.streaming_content).decode()
    return list(csv.DictReader(io.StringIO(text)))


def db_totals() -> dict[str, int]:
    settled = Reservation.objects.exclude(state__in=[State.PROPOSED, State.REJECTED])
    sums = settled.aggregate(i=Sum("input_consumed"), o=Sum(F("captured") + F("overrun")))
    return {"requests": settled.count(), "input": sums["i"], "output": sums["o"]}


def test_csv_parses_and_its_totals_match_the_database(users, scenario):
    got = rows(login("analyst").get(URL, {"format": "csv", "from": today(), "to": today()}))
    expected = db_totals()
    assert expected["requests"] == 5 and expected["input"] > 0 and expected["output"] > 0
    assert sum(int(r["requests"]) for r in got) == expected["requests"]
    assert sum(int(r["inputTokens"]) for r in got) == expected["input"]
    assert sum(int(r["outputTokens"]) for r in got) == expected["output"]
    assert list(got[0]) == list(USAGE_COLUMNS)
    for r in got:
        input_cost = Decimal(r["inputTokens"]) * Decimal("3") / 1_000_000
        output_cost = Decimal(r["outputTokens"]) * Decimal("15") / 1_000_000
        assert Decimal(r["inputCost"]) == input_cost.quantize(Decimal("0.000001"))
        assert Decimal(r["cost"]) == Decimal(r["inputCost"]) + Decimal(r["outputCost"])
        assert r["currency"] == "USD"
        assert output_cost.quantize(Decimal("0.000001")) == Decimal(r["outputCost"])


def test_json_report_agrees_with_the_csv_and_the_manifests(users, scenario):
    analyst = login("analyst")
    body = analyst.get(URL, {"from": today(), "to": today()}).json()
    got = rows(analyst.get(URL, {"format": "csv", "from": today(), "to": today()}))
    totals = body["totals"]
    assert totals["requests"] == db_totals()["requests"]
    assert totals["inputTokens"] == db_totals()["input"]
    assert Decimal(totals["cost"]["USD"]) == sum(Decimal(r["cost"]) for r in got)
    assert totals["unpricedRequests"] == 0
    per_rung = {row["rung"]: row["requests"] for row in body["requestsPerRung"]}
    assert sum(per_rung.values()) == Manifest.objects.count() == 7
    assert per_rung["FULL"] == 4 and per_rung["QUEUE_OR_REJECT"] == 1
    assert body["decisions"]["byMode"] == {"ENFORCE": 6, "SHADOW": 1}
    quality = {row["rung"]: row for row in body["qualityByRung"]}
    assert quality["FULL"]["successRate"] == 1.0 and quality["DEDUP_EVIDENCE"]["successRate"] == 0.0
    assert quality["DEDUP_EVIDENCE"]["citationCompleteness"] == 0.5
    [deviation] = body["deviationByModel"]
    assert deviation["n"] == 3  # full (-1 %), dedup (0 %), overrun (+4 %)
    assert deviation["p50Percent"] == 0.0 and deviation["meanPercent"] == 1.0
    assert sum(b["count"] for b in body["deviationHistogram"]) == 3
    assert body["contextOverflows"] == 1
    assert body["reconcilingBacklog"]["count"] == 1
    sources = {s["source"]: s for s in body["settledVsBilled"]}
    assert sources["provider usage report"]["inputTokens"] == (990 - 1000) + (520 - 500)


def test_focus_export_uses_focus_columns_and_adds_up(users, scenario):
    got = rows(login("finance").get(URL, {"format": "focus", "from": today(), "to": today()}))
    for column in ("BilledCost", "EffectiveCost", "ChargePeriodStart", "ChargePeriodEnd", "ServiceName"):
        assert column in got[0]
    assert {r["ConsumedUnit"] for r in got} == {"Tokens"}
    assert {r["x_TokenDirection"] for r in got} == {"input", "output"}
    assert sum(int(r["ConsumedQuantity"]) for r in got) == db_totals()["input"] + db_totals()["output"]
    json_cost = Decimal(
        login("finance").get(URL, {"from": today(), "to": today()}).json()["totals"]["cost"]["USD"]
    )
    assert sum(Decimal(r["BilledCost"]) for r in got) == json_cost
    for r in got:
        # ListCost is ListUnitPrice × PricingQuantity, rounded to the cost quantum (1e-6).
        exact = Decimal(r["ListUnitPrice"]) * Decimal(r["PricingQuantity"])
        assert abs(exact - Decimal(r["ListCost"])) <= Decimal("0.0000005")
        assert r["ChargePeriodStart"].endswith("T00:00:00Z")


def test_a_price_correction_changes_no_past_report_and_prices_the_next_admissions(users, scenario):
    analyst = login("analyst")
    before_csv = rows(analyst.get(URL, {"format": "csv", "from": today(), "to": today()}))
    before = analyst.get(URL, {"from": today(), "to": today()}).json()
    at = timezone.now()
    add_price(
        model_revision=scenario.model,
        currency="USD",
        input_per_million=Decimal("6"),
        output_per_million=Decimal("30"),
        cached_input_per_million=None,
        effective_from=at,
        note="corrected list price",
        actor=SYSTEM,
        reason="the provider's list price doubled",
        now=at,
    )
    after_csv = rows(analyst.get(URL, {"format": "csv", "from": today(), "to": today()}))
    assert after_csv == before_csv
    assert analyst.get(URL, {"from": today(), "to": today()}).json()["totals"] == before["totals"]
    # Report time's prices are not the frozen ones any more: the figures above are the frozen ones.
    assert {r["inputPricePerMillion"] for r in after_csv} == {"3.000000"}

    late = _admit(scenario, "after-correction", rung="FULL", input_tokens=1000, output_tokens=10)
    _usage(scenario, _dispatch(scenario, late), "u1", 10, final=True, input_tokens=1000)
    got = rows(analyst.get(URL, {"format": "csv", "from": today(), "to": today()}))
    by_price: dict[str, int] = {}
    for r in got:
        by_price[r["inputPricePerMillion"]] = by_price.get(r["inputPricePerMillion"], 0) + int(r["requests"])
    assert by_price == {"3.000000": 5, "6.000000": 1}
    corrected = next(r for r in got if r["inputPricePerMillion"] == "6.000000")
    assert Decimal(corrected["cost"]) == Decimal("0.006300")  # 1,000 × $6 + 10 × $30 per million


def test_a_used_price_cannot_be_rewritten_or_back_dated(users, scenario):
    price = Price.objects.get(model_revision=scenario.model)
    with pytest.raises(DatabaseError, match="used by an admission"), transaction.atomic():
        Price.objects.filter(pk=price.pk).update(input_per_million=Decimal("1"))
    with pytest.raises(DatabaseError, match="cannot start in the past"), transaction.atomic():
        Price.objects.create(
            model_revision=scenario.model,
            effective_from=timezone.now() - timedelta(days=1),
            input_per_million=Decimal("1"),
            output_per_million=Decimal("1"),
        )
    with pytest.raises(InvalidChange):
        add_price(
            model_revision=scenario.model,
            currency="USD",
            input_per_million=Decimal("1"),
            output_per_million=Decimal("1"),
            cached_input_per_million=None,
            effective_from=timezone.now() - timedelta(days=1),
            note="",
            actor=SYSTEM,
            reason="back-dating",
            now=timezone.now(),
        )
    assert Price.objects.get(pk=price.pk).input_per_million == Decimal("3")


def test_requests_without_a_price_are_reported_not_costed(users, scenario):
    Reservation.objects.update(price=None, currency="", input_price=0, output_price=0, cached_input_price=0)
    body = login("analyst").get(URL, {"from": today(), "to": today()}).json()
    assert body["totals"]["cost"] == {}
    assert body["totals"]["unpricedRequests"] == 5
    assert all(row["cost"] is None for row in body["usage"])


def test_scope_filters_narrow_the_report(users, scenario):
    other = login("analyst").get(URL, {"from": today(), "to": today(), "pool": scenario.pool.slug}).json()
    assert other["totals"]["requests"] == 5
    outside = login("analyst").get(URL, {"from": "2020-01-01", "to": "2020-01-31"}).json()
    assert outside["totals"]["requests"] == 0 and outside["usage"] == []


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"from": "2026-02-01", "to": "2026-01-01"}, "from"),
        ({"from": "yesterday"}, "from"),
        ({"tenant": "no-such-tenant"}, "tenant"),
        # PostgreSQL refuses a NUL byte in text: it was a 500 when it reached the query.
        ({"tenant": "\x00"}, "tenant"),
        ({"taskClass": "a\x00b"}, "taskClass"),
        ({"pool": "p" * 5000}, "pool"),
        ({"format": "xml"}, "format"),
        ({"from": "2020-01-01", "to": "2026-01-01"}, "from"),
    ],
)
def test_bad_parameters_answer_400_naming_the_parameter(users, params, field):
    response = login("analyst").get(URL, params)
    assert response.status_code == 400
    assert response["Content-Type"] == "application/problem+json"
    assert response.json()["field"] == field


def test_only_staff_sessions_with_a_report_role_may_read(users, cat):
    assert Client().get(URL).status_code == 401
    gateway = ServiceClientFactory(tenants=[cat.tenant])
    token = issue_token(gateway, "tb_report_probe_aaaaaaaaaaaaaaaa")
    assert Client().get(URL, HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 401
    assert login("nobody").get(URL).status_code == 403
    for role in ("analyst", "finance", "platform"):
        assert login(role).get(URL).status_code == 200
    assert login("analyst").post(URL).status_code == 405


def chart_spec(html: str, element_id: str) -> dict:
    start = html.index(f'<script id="{element_id}" type="application/json">') + len(
        f'<script id="{element_id}" type="application/json">'
    )
    return json.loads(html[start : html.index("</script>", start)])


def test_the_report_page_draws_its_charts_with_the_vendored_library(users, scenario):
    html = login("analyst").get("/admin/budgeting/usagereport/").content.decode()
    assert "<svg class" not in html and html.count("<canvas data-tb-chart=") == 3
    for script in (
        "tokenbudget/vendor/chart.js-4.6.1/chart.umd.min.js",
        "tokenbudget/vendor/chartjs-adapter-date-fns-3.0.0/chartjs-adapter-date-fns.bundle.min.js",
        "tokenbudget/vendor/chartjs-plugin-datalabels-2.2.0/chartjs-plugin-datalabels.min.js",
        "tokenbudget/charts.js",
    ):
        assert f'src="/static/{script}"' in html
        assert finders.find(script), script
    # No CDN: every script and stylesheet is ours.
    assert "http://" not in html.split("</head>")[0] and "https://" not in html.split("</head>")[0]
    rungs = chart_spec(html, "tb-chart-rungs")
    assert rungs["timeUnit"] == "hour"  # the scenario's requests span minutes: hourly bars, not a month axis
    assert len(rungs["labels"]) == 1
    assert {s["label"]: sum(s["values"]) for s in rungs["series"]} == {
        "FULL": 4,
        "DEDUP_EVIDENCE": 1,
        "TRIM_EVIDENCE": 1,
        "QUEUE_OR_REJECT": 1,
    }
    assert "bytes / 4" in html  # the deviation histogram says what dominates it
    assert "format=csv" in html and "format=focus" in html


def test_the_rung_chart_switches_to_days_when_the_requests_span_more_than_two_days(users, scenario):
    old = scenario.manifests["shadow"]
    Manifest.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=5))
    unit, series = requests_over_time(parse_query({}, today=timezone.now().date()))
    assert unit == "day"
    assert len({row["at"] for row in series}) == 2  # only the days that have requests


def test_the_report_page_writes_counts_and_money_for_people(users, scenario):
    html = login("analyst").get("/admin/budgeting/usagereport/").content.decode()
    assert "5,010" in html  # input tokens consumed
    # The cost at the decimals that make the rows add up (issue 19: not "$0.00" rows under "$0.02"); the
    # exports keep the 6 decimals.
    assert "$0.0197<" in html and "0.019680" not in html
    assert "$3.00" in html and "per 1M tokens" in html


def test_a_tenant_page_shows_spend_by_model_and_task_class(users, scenario):
    url = f"/admin/budgeting/usagereport/tenant/{scenario.tenant.slug}/"
    html = login("finance").get(url).content.decode()
    assert "cost this month to date" in html and "projected for" in html
    table = html[html.index('id="tb-spend-rows"') :]
    assert scenario.model.name in table and scenario.task_class.slug in table
    assert "5,010" in table and "$0.02" in table
    assert login("finance").get("/admin/budgeting/usagereport/tenant/t-nobody/").status_code == 404
    assert login("nobody").get(url).status_code == 403
    tenant_page = login("finance").get(f"/admin/budgeting/tenant/{scenario.tenant.pk}/change/")
    assert url in tenant_page.content.decode()


def test_report_days_are_utc_calendar_days(users, scenario):
    query = parse_query({"from": "2026-03-01", "to": "2026-03-02"}, today=datetime(2026, 3, 5).date())
    assert query.start == datetime(2026, 3, 1, tzinfo=UTC)
    assert query.end == datetime(2026, 3, 3, tzinfo=UTC)
    assert [d.isoformat() for d in query.days] == ["2026-03-01", "2026-03-02"]
