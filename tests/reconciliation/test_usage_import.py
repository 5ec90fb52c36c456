"""Usage and cost reports of real providers, imported from files and fetched through the real adapters from
the simulator answering in the providers' shapes; and the OpenAI adapter's lookups end to end."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import call_command

from ledger.models import Outcome, Reservation, State
from ledger.services import lifecycle
from reconciliation import billing, reclaim
from reconciliation.billing import import_export
from reconciliation.models import BilledCost, BillingImport, BucketDrift, FindingKind
from simulation.provider import Simulator
from tests.ledger.helpers import catalog, now, tenant_account
from tests.reconciliation import provider_fixtures as fx
from tests.reconciliation.helpers import call_provider, dispatched, expire

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def sim():
    with Simulator(seed=8) as simulator:
        yield simulator


@pytest.fixture
def cat():
    c = catalog()
    tenant_account(c, input_limit=10**6, output_limit=10**6)
    return c


def as_openai(cat, sim, *, admin: bool, monkeypatch) -> None:
    cat.pool.provider, cat.pool.adapter = "openai", "openai"
    cat.pool.provider_base_url = f"{sim.base_url}/v1"
    cat.pool.api_key_env = "TB_TEST_OPENAI_KEY"
    monkeypatch.setenv("TB_TEST_OPENAI_KEY", "sk-test")
    if admin:
        cat.pool.admin_key_env = "TB_TEST_OPENAI_ADMIN_KEY"
        monkeypatch.setenv("TB_TEST_OPENAI_ADMIN_KEY", "sk-admin-test")
    cat.pool.save()


def test_an_openai_usage_file_is_compared_bucket_by_bucket(cat, tmp_path):
    path = tmp_path / "usage.json"
    path.write_text(json.dumps([fx.USAGE_PAGE_1, fx.USAGE_PAGE_2]))
    out = StringIO()
    call_command("import_billing", str(path), "--format", "openai-usage", stdout=out)
    assert out.getvalue().startswith("imported:")
    drifts = list(BucketDrift.objects.order_by("bucket_start"))
    assert [(d.billed_input, d.billed_output, d.captured_input) for d in drifts] == [
        (1000, 500, 0),
        (20, 10, 0),
    ]
    assert BillingImport.objects.get().fmt == "openai-usage"
    call_command("import_billing", str(path), "--format", "openai-usage", stdout=out)
    assert BillingImport.objects.count() == 1


def test_cost_pages_keep_the_latest_amount_per_line():
    first = import_export(text=json.dumps(fx.COSTS_PAGE), fmt="openai-costs", source="costs", now=now())
    assert [(c.line_item, c.amount) for c in BilledCost.objects.order_by("line_item")] == [
        ("gpt-4o-mini-2024-07-18, input", Decimal("0.06")),
        ("gpt-4o-mini-2024-07-18, output", Decimal("0.12")),
    ]
    grown = json.loads(json.dumps(fx.COSTS_PAGE))
    grown["data"][0]["results"][1]["amount"]["value"] = 0.5
    import_export(text=json.dumps(grown), fmt="openai-costs", source="costs later", now=now())
    assert BilledCost.objects.count() == 2
    assert BilledCost.objects.get(line_item__endswith="output").amount == Decimal("0.5")
    assert first.billing_import.records == 2


def test_an_anthropic_usage_report_is_compared_by_model_workspace_and_key():
    result = import_export(
        text=json.dumps(fx.ANTHROPIC_USAGE_PAGE), fmt="anthropic-usage", source="report.json", now=now()
    )
    drift = BucketDrift.objects.get(billing_import=result.billing_import)
    assert (drift.model, drift.billed_input, drift.billed_output) == ("claude-sonnet-4-20250514", 3300, 550)
    assert {f.kind for f in result.billing_import.findings.all()} == {FindingKind.BUCKET_DRIFT}


def test_the_beat_fetches_openai_usage_and_costs_through_the_sdk_from_the_simulator(cat, sim, monkeypatch):
    as_openai(cat, sim, admin=False, monkeypatch=monkeypatch)
    r = dispatched(cat)
    call_provider(sim, r.provider_request_id, max_tokens=12)
    assert billing.fetch_and_import(now=now()) == {"imports": 0, "unchanged": 0, "failed": 0}
    assert not BillingImport.objects.exists(), "no admin key: the usage import is off"
    as_openai(cat, sim, admin=True, monkeypatch=monkeypatch)
    billed = sim.entry(r.provider_request_id)
    totals = billing.fetch_and_import(now=now())
    assert totals == {"imports": 2, "unchanged": 0, "failed": 0}
    drift = BucketDrift.objects.get()
    assert (drift.model, drift.billed_input, drift.billed_output) == (
        billed.model,
        billed.prompt_tokens,
        billed.completion_tokens,
    )
    assert BilledCost.objects.count() == 2
    assert billing.fetch_and_import(now=now())["unchanged"] == 2, "the same report again is no news"


def test_the_beat_fetches_the_anthropic_usage_report_from_the_simulator(cat, sim, monkeypatch):
    cat.pool.provider, cat.pool.adapter = "anthropic", "anthropic-messages"
    cat.pool.provider_base_url, cat.pool.admin_key_env = sim.base_url, "TB_TEST_ANTHROPIC_ADMIN_KEY"
    cat.pool.save()
    monkeypatch.setenv("TB_TEST_ANTHROPIC_ADMIN_KEY", "sk-ant-admin-test")
    call_provider(sim, "prov-anthropic", max_tokens=9)
    billed = sim.entry("prov-anthropic")
    # The usage report and the cost report (tests/reconciliation/test_anthropic_costs.py).
    assert billing.fetch_and_import(now=now())["imports"] == 2
    drift = BucketDrift.objects.get()
    assert (drift.billed_input, drift.billed_output) == (billed.prompt_tokens, billed.completion_tokens)


def test_the_openai_adapter_settles_a_stored_completion_and_cannot_vouch_for_the_rest(cat, sim, monkeypatch):
    as_openai(cat, sim, admin=False, monkeypatch=monkeypatch)
    done, never = dispatched(cat), dispatched(cat)
    call_provider(sim, done.provider_request_id, max_tokens=14)
    billed = sim.entry(done.provider_request_id)
    for r in (done, never):
        expire(r)
    report = reclaim.reclaim_expired_leases(now=now())
    assert (report.settled, report.refunded, report.needs_person) == (1, 0, 1)
    done.refresh_from_db()
    assert (done.outcome, done.input_consumed, done.captured + done.overrun) == (
        Outcome.RECONCILED,
        billed.prompt_tokens,
        billed.completion_tokens,
    )
    never.refresh_from_db()
    assert (never.state, never.provider_adapter, never.input_consumed) == (State.RECONCILING, "openai", 100)
    assert "compare with its usage report" in never.needs_person, "nothing automatic will ever settle it"


def test_openai_not_found_neither_refunds_nor_releases_a_call_with_usage(cat, sim, monkeypatch):
    as_openai(cat, sim, admin=False, monkeypatch=monkeypatch)
    r = dispatched(cat)
    usage = lifecycle.Usage("u", 5, None, False)
    lifecycle.record_usage(reservation_id=r.pk, tenant_ids=[cat.tenant.pk], fence=1, usage=usage, now=now())
    Reservation.objects.filter(pk=r.pk).update(lease_expires_at=now() - timedelta(seconds=1))
    reclaim.reclaim_expired_leases(now=now())
    r.refresh_from_db()
    assert (r.state, r.captured, r.input_consumed, r.remaining) == (State.RECONCILING, 5, 100, 45)
    assert r.needs_person
