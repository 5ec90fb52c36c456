"""Money limits end to end, through the real API: provision a spend limit → admit (the hold priced at
the price in force) → 429 QUOTA_EXCEEDED in money → settle (the money posted at the frozen prices, the rest
released) → the report reads the posted figures → a billing import with the provider's billed cost
reconciles it (drift per model and per account, a finding, the metrics). And 422 PRICE_UNAVAILABLE when the
limit's currency has no price.

The demo prices model@2026-07-01 at $0.27 input and $1.10 output per million tokens.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.utils import timezone

from budgeting.admission.models import Manifest
from budgeting.backoffice.reports.pricing import usage_rows
from budgeting.backoffice.reports.query import ReportQuery
from budgeting.catalog.prices import cost, from_micro
from budgeting.observability.scrape import registry
from budgeting.provisioning.apply import apply_config
from budgeting.provisioning.source import load_file
from ledger.models import CapacityAccount, Reservation, Scope
from ledger.selectors import audit
from reconciliation.billing import import_export
from reconciliation.models import CostDimension, CostDrift, FindingKind
from tests.api.test_admissions import request_body
from tests.demo import DEMO

pytestmark = pytest.mark.django_db(transaction=True)

IN_PRICE, OUT_PRICE = 270_000, 1_100_000  # micro-dollars per million tokens


def provision_spend_limit(limit: str, currency: str = "USD") -> None:
    """The demo file with t-19's tenant account given a monthly spend limit (the write path of any file)."""
    doc: dict[str, Any] = copy.deepcopy(load_file(DEMO))
    for account in doc["accounts"]:
        if account["scope"] == Scope.TENANT and account.get("tenant") == "t-19":
            account.update(spendLimit=limit, currency=currency)
    applied = apply_config(doc)
    assert not applied.conflicts


def admit(api, key: str) -> Any:
    # support-chat does not queue: a request short of capacity is refused at once.
    body = request_body(requestId=key, taskClass="support-chat")
    body["dispatch"] = {"providerRequestId": f"prov-{key}"}
    return api.post("/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY=key)


def tenant_account() -> CapacityAccount:
    return CapacityAccount.objects.get(scope=Scope.TENANT, tenant__slug="t-19")


def test_provision_admit_refuse_in_money_settle_report_and_reconcile(demo_api):
    provision_spend_limit("1")
    first = admit(demo_api, "money-1")
    assert first.status_code == 201, first.content[:300]
    n, max_output = first.json()["tokens"]["input"], first.json()["tokens"]["maxOutput"]
    hold = cost(n, IN_PRICE) + cost(max_output, OUT_PRICE)
    rid = first.json()["reservationId"]
    detail = demo_api.get(f"/api/v1/reservations/{rid}").json()
    spend = detail["spend"]
    assert spend["currency"] == "USD" and spend["pricePerMillion"] == {
        "input": "0.270000",
        "cachedInput": "0.270000",
        "output": "1.100000",
    }
    assert Decimal(spend["reserved"]) == from_micro(hold)
    # Dispatched at admission: the input's money is posted with the input, the output's stays held.
    assert Decimal(spend["captured"]) == from_micro(cost(n, IN_PRICE))
    assert tenant_account().spend_reserved + tenant_account().spend_consumed == hold
    limit = hold + hold // 2  # room for one hold, not two
    provision_spend_limit(str(from_micro(limit)))

    refused = admit(demo_api, "money-2")
    assert refused.status_code == 429, refused.content[:300]
    problem = refused.json()
    assert refused["Content-Type"].startswith("application/problem+json")
    assert (problem["code"], problem["dimension"]) == ("QUOTA_EXCEEDED", "spend")
    assert (problem["requested"], problem["available"]) == (hold, limit - hold)
    assert problem["currency"] == "USD" and problem["account"]["id"] == tenant_account().pk
    assert Reservation.objects.count() == 1

    usage = {"fence": 1, "usageEventId": "u1", "inputTokens": n, "outputTokens": 100, "final": True}
    assert demo_api.post(f"/api/v1/reservations/{rid}/usage", usage, format="json").status_code == 200
    settled = cost(n, IN_PRICE) + cost(100, OUT_PRICE)
    spend = demo_api.get(f"/api/v1/reservations/{rid}").json()["spend"]
    assert (Decimal(spend["cost"]), Decimal(spend["released"])) == (
        from_micro(settled),
        from_micro(hold - settled),
    )
    account = tenant_account()
    assert (account.spend_reserved, account.spend_consumed) == (0, settled)
    # The released money is available again: the same request now fits.
    assert admit(demo_api, "money-3").status_code == 201

    today = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
    rows = [r for r in usage_rows(ReportQuery(today, today + timedelta(days=1))) if r.requests]
    assert sum((r.cost or Decimal(0)) for r in rows) == from_micro(
        settled + cost(n, IN_PRICE)  # the third admission's input, posted at its dispatch
    )

    billed = from_micro(settled) + Decimal("0.000050")  # the provider billed 50 micro-dollars more
    export = (
        "request_id,model,input_tokens,output_tokens,start_time,cost,currency\n"
        f"prov-money-1,model@2026-07-01,{n},100,{timezone.now().isoformat()},{billed},USD\n"
    )
    result = import_export(text=export, fmt="csv", source="e2e", now=timezone.now())
    drifts = {(d.dimension, d.key): d for d in CostDrift.objects.filter(billing_import=result.billing_import)}
    by_model = drifts[(CostDimension.MODEL, "model@2026-07-01")]
    by_account = drifts[(CostDimension.ACCOUNT, "tenant t-19")]
    for drift in (by_model, by_account):
        assert (drift.billed, drift.settled, drift.drift) == (
            billed,
            from_micro(settled),
            Decimal("0.000050"),
        )
    assert by_account.account_id == tenant_account().pk
    assert result.billing_import.findings.filter(kind=FindingKind.COST_DRIFT).count() == len(drifts)
    scraped = {
        (s.name, s.labels.get("dimension"), s.labels.get("key")): s.value
        for family in registry().collect()
        for s in family.samples
    }
    assert scraped[("tokenbudget_billed_cost_drift", "account", "tenant t-19")] == pytest.approx(0.00005)
    assert audit().ok


def test_a_money_limit_in_a_currency_without_a_price_is_price_unavailable(demo_api):
    provision_spend_limit("100", currency="EUR")
    res = admit(demo_api, "eur-1")
    assert res.status_code == 422, res.content[:300]
    assert res.json()["code"] == "PRICE_UNAVAILABLE" and res.json()["currency"] == "EUR"
    assert Reservation.objects.count() == 0
    # A rejected admission is a decision too (SPEC §7): its manifest says why.
    manifest = Manifest.objects.get(request_id="eur-1")
    assert (manifest.decision, manifest.answer) == ("ADMITTED", "PRICE_UNAVAILABLE")
