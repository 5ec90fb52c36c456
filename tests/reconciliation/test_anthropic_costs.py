"""Anthropic's cost report (issue 19 §1: reconcile our settled cost with the provider's billed cost): its
documented pages parsed (amounts are decimal strings in cents), fetched page by page through the adapter with
the pool's admin key, imported from a file finance saves, answered by the simulator in the same shape, and
compared per model with what the ledger posted at the prices frozen on the reservations (a COST_DRIFT finding
and the drift gauges). A file that is not such a report is refused and stores nothing."""

from __future__ import annotations

import copy
import dataclasses
import json
import urllib.request
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from io import StringIO
from typing import Any

import httpx2
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from budgeting.catalog.models import Price
from budgeting.catalog.prices import FrozenPrice, from_micro
from budgeting.observability.scrape import registry as scrape_registry
from ledger.models import Reservation
from ledger.services import lifecycle
from reconciliation import billing
from reconciliation.billing import ExportRefused, import_export
from reconciliation.models import BilledCost, BillingImport, CostDimension, CostDrift, FindingKind
from reconciliation.providers.anthropic_api import COST_REPORT_PATH, AnthropicMessagesAdapter
from reconciliation.providers.exports import scan_billing_export
from reconciliation.providers.records import CostRecord
from simulation.provider import Simulator
from tests.ledger.helpers import Catalog, admit, catalog, now, spec, tenant_account
from tests.reconciliation import provider_fixtures as fx

MODEL = "claude-sonnet-4-20250514"
WORKSPACE = "wrkspc_01JwQvzr7rXLA5AGx3HKfFUJ"


def paged(seen: list[httpx2.Request]) -> httpx2.Client:
    """The cost report's two pages: the second only for the first page's cursor."""

    def route(request: httpx2.Request) -> httpx2.Response:
        page = request.url.params.get("page")
        return httpx2.Response(
            200, json=fx.ANTHROPIC_COST_PAGES[1 if page == fx.ANTHROPIC_COST_CURSOR else 0]
        )

    return fx.mock_client({COST_REPORT_PATH: route}, seen)


def costs(pages: Any) -> list[CostRecord]:
    scan = scan_billing_export(json.dumps(pages), "anthropic-costs")
    assert scan.problems == ()
    return sorted(
        (r for r in scan.records if isinstance(r, CostRecord)), key=lambda r: (r.bucket_start, r.line_item)
    )


# -- the documented shape, through the SDK ------------------------------------------------------------------


def test_the_cost_report_comes_page_by_page_through_the_admin_api_and_amounts_are_cents():
    seen: list[httpx2.Request] = []
    adapter = AnthropicMessagesAdapter(
        "https://api.anthropic.com", api_key="k", admin_key="sk-ant-admin", http_client=paged(seen)
    )
    pages = adapter.cost_pages(datetime(2025, 8, 1, tzinfo=UTC), datetime(2025, 8, 3, tzinfo=UTC))
    assert pages == fx.ANTHROPIC_COST_PAGES
    assert len(seen) == 2 and seen[0].headers["authorization"] == "Bearer sk-ant-admin"
    first, second = (request.url.params for request in seen)
    assert (first["starting_at"], first["ending_at"], first["bucket_width"]) == (
        "2025-08-01T00:00:00Z",
        "2025-08-03T00:00:00Z",
        "1d",
    )
    assert "workspace_id" in str(seen[0].url) and "description" in str(seen[0].url)
    assert "page" not in first and second["page"] == fx.ANTHROPIC_COST_CURSOR

    day1, day2 = datetime(2025, 8, 1, tzinfo=UTC), datetime(2025, 8, 2, tzinfo=UTC)
    assert [
        (r.bucket_start, r.line_item, r.model, r.amount, r.currency, r.project_id) for r in costs(pages)
    ] == [
        (day1, f"{MODEL}, uncached_input_tokens", MODEL, Decimal("1.2378912"), "USD", WORKSPACE),
        # Web search names no model: it is kept, and compared with nothing.
        (day2, "Web Search Usage", None, Decimal("10"), "USD", WORKSPACE),
        # Two service tiers of one model's output are one cost line: 250 + 125.5 cents.
        (day2, f"{MODEL}, output_tokens", MODEL, Decimal("3.755"), "USD", WORKSPACE),
    ]


def test_bad_rows_are_problems_with_their_reason():
    page = copy.deepcopy(fx.ANTHROPIC_COST_PAGES[0])
    good = page["data"][0]["results"][0]
    page["data"][0]["results"] = [
        good,
        {**good, "amount": 1.5, "token_type": "output_tokens"},
        {**good, "amount": "lots", "token_type": "cache_read_input_tokens"},
        {**good, "amount": "NaN", "token_type": "cache_creation.ephemeral_5m_input_tokens"},
        {**good, "currency": "EUR", "token_type": "cache_creation.ephemeral_1h_input_tokens"},
    ]
    scan = scan_billing_export(json.dumps(page), "anthropic-costs")
    assert len(scan.records) == 1
    assert [p.reason for p in scan.problems] == [
        "amount is not a decimal string: 1.5",
        "amount is not a number: 'lots'",
        "amount is not a number: 'NaN'",
        "amount in EUR: the report's lowest units are documented for USD only",
    ]


# -- imports ------------------------------------------------------------------------------------------------


def priced(cat: Catalog, input_price: str, output_price: str) -> FrozenPrice:
    return FrozenPrice.of(
        Price.objects.create(
            model_revision=cat.model,
            effective_from=datetime(2026, 1, 1, tzinfo=UTC),
            currency="USD",
            input_per_million=Decimal(input_price),
            output_per_million=Decimal(output_price),
        )
    )


def settled(cat: Catalog, price: FrozenPrice, provider_id: str, input_tokens: int, output_tokens: int) -> int:
    """A call admitted at ``price``, dispatched as ``provider_id`` and settled at these tokens: its cost in
    micro-dollars as the ledger posted it."""
    admitted = spec(cat, input_tokens=input_tokens, output_tokens=200)
    r = admit(dataclasses.replace(admitted, price=price)).reservation
    lifecycle.dispatch(
        reservation_id=r.pk,
        tenant_ids=[cat.tenant.pk],
        fence=1,
        provider_request_id=provider_id,
        admitted_digest=r.admitted_digest,
        now=now(),
    )
    lifecycle.record_usage(
        reservation_id=r.pk,
        tenant_ids=[cat.tenant.pk],
        fence=1,
        usage=lifecycle.Usage("final", output_tokens, input_tokens, True, None),
        now=now(),
    )
    r = Reservation.objects.get(pk=r.pk)
    return r.spend_captured + r.spend_overrun


def report_of_today(model: str, cents: Decimal) -> dict[str, Any]:
    page: dict[str, Any] = copy.deepcopy(fx.ANTHROPIC_COST_PAGES[0])
    day = now().replace(hour=0, minute=0, second=0, microsecond=0)
    bucket = page["data"][0]
    bucket["starting_at"] = day.isoformat().replace("+00:00", "Z")
    bucket["ending_at"] = (day + timedelta(days=1)).isoformat().replace("+00:00", "Z")
    bucket["results"][0].update(model=model, amount=f"{cents:f}")
    return {**page, "has_more": False, "next_page": None}


@pytest.mark.django_db(transaction=True)
def test_a_saved_cost_report_is_compared_per_model_with_our_settled_cost(tmp_path):
    cat = catalog()
    tenant_account(cat)
    ours = settled(cat, priced(cat, "3", "15"), "msg-1", 1000, 120)
    assert ours == 3_000 + 1_800
    # The provider billed half a cent more than we posted: 0.48 + 0.5 cents.
    path = tmp_path / "cost_report.json"
    path.write_text(json.dumps(report_of_today(cat.model.name, Decimal(ours) / 10_000 + Decimal("0.5"))))
    out = StringIO()
    call_command("import_billing", str(path), "--format", "anthropic-costs", stdout=out)
    assert out.getvalue().startswith("imported:")
    imported = BillingImport.objects.get()
    assert imported.fmt == "anthropic-costs"
    line = BilledCost.objects.get()
    assert (line.line_item, line.amount) == (f"{cat.model.name}, uncached_input_tokens", Decimal("0.0098"))
    drift = CostDrift.objects.get(billing_import=imported)
    assert (drift.dimension, drift.key, drift.currency, drift.requests) == (
        CostDimension.MODEL,
        cat.model.name,
        "USD",
        1,
    )
    assert (drift.billed, drift.settled, drift.drift) == (
        Decimal("0.0098"),
        from_micro(ours),
        Decimal("0.005"),
    )
    [finding] = imported.findings.filter(kind=FindingKind.COST_DRIFT)
    assert f"model revision {cat.model.name}" in finding.detail and "drift +0.005" in finding.detail
    scraped = {
        (s.name, s.labels.get("dimension"), s.labels.get("key")): s.value
        for family in scrape_registry().collect()
        for s in family.samples
    }
    assert scraped[("tokenbudget_billed_cost_drift", "model", cat.model.name)] == pytest.approx(0.005)
    # The same file again is no news.
    call_command("import_billing", str(path), "--format", "anthropic-costs", stdout=out)
    assert BillingImport.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (json.dumps(fx.COSTS_PAGE), "line 1: currency is not a currency code: None"),
        (json.dumps(fx.ANTHROPIC_USAGE_PAGE), "line 1: currency is not a currency code: None"),
        ("request_id,model,input_tokens\nr1,m,3\n", "line 1: not JSON"),
    ],
)
def test_a_file_that_is_not_a_cost_report_is_refused_and_stores_nothing(tmp_path, text, reason):
    with pytest.raises(ExportRefused) as refused:
        import_export(text=text, fmt="anthropic-costs", source="saved.json", now=now())
    assert (
        "saved.json is not a Anthropic cost report (JSON) export: no line could be read"
        in refused.value.detail
    )
    assert reason in refused.value.detail
    assert not BillingImport.objects.exists() and not BilledCost.objects.exists()
    path = tmp_path / "saved.json"
    path.write_text(text)
    with pytest.raises(CommandError, match="no line could be read"):
        call_command("import_billing", str(path), "--format", "anthropic-costs", stdout=StringIO())
    assert not BillingImport.objects.exists()


# -- the simulator answers in the documented shape; the beat fetches it through the adapter ------------------


def call(sim: Simulator, provider_id: str, model: str) -> None:
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 9}
    ).encode()
    request = urllib.request.Request(
        f"{sim.base_url}/v1/chat/completions",
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "X-Request-Id": provider_id,
            "Authorization": "Bearer k",
        },
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        response.read()


@pytest.mark.django_db(transaction=True)
def test_the_beat_fetches_the_simulators_cost_report_and_it_reconciles_with_the_ledger(monkeypatch):
    cat = catalog()
    tenant_account(cat)
    # The simulator bills $1 input and $4 output per million tokens; we price the model the same.
    price = priced(cat, "1", "4")
    with Simulator(seed=9) as sim:
        cat.pool.provider, cat.pool.adapter = "anthropic", "anthropic-messages"
        cat.pool.provider_base_url, cat.pool.admin_key_env = sim.base_url, "TB_TEST_ANTHROPIC_ADMIN_KEY"
        cat.pool.save()
        monkeypatch.setenv("TB_TEST_ANTHROPIC_ADMIN_KEY", "sk-ant-admin-test")
        call(sim, "msg-sim-1", cat.model.name)
        billed = sim.entry("msg-sim-1")
        ours = settled(cat, price, "msg-sim-1", billed.prompt_tokens, billed.completion_tokens)
        assert billing.fetch_and_import(now=now()) == {"imports": 2, "unchanged": 0, "failed": 0}
        report = BillingImport.objects.get(fmt="anthropic-costs")
        lines = {c.line_item: c.amount for c in BilledCost.objects.filter(billing_import=report)}
        assert lines == {
            f"{cat.model.name}, uncached_input_tokens": Decimal(billed.prompt_tokens) / 1_000_000,
            f"{cat.model.name}, output_tokens": Decimal(billed.completion_tokens * 4) / 1_000_000,
        }
        drift = CostDrift.objects.get(billing_import=report)
        assert (drift.key, drift.requests, drift.billed, drift.settled, drift.drift) == (
            cat.model.name,
            1,
            from_micro(ours),
            from_micro(ours),
            0,
        )
        assert not report.findings.filter(kind=FindingKind.COST_DRIFT).exists()
        assert billing.fetch_and_import(now=now())["unchanged"] == 2, "the same reports again are no news"
