"""POST /admissions with ``dispatch``: admit and record the dispatch in one call, with SPEC §5's guarantees (a
reservation that may have been sent is never released in full without proof)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models import Sum
from django.utils import timezone

from budgeting.admission.models import Manifest
from ledger import selectors
from ledger.models import CapacityAccount, Hold, LedgerEntry, Outcome, Reservation, State
from ledger.services import settlement
from tests.api.test_admissions import request_body
from tests.dbwork import count_db_work

pytestmark = pytest.mark.django_db(transaction=True)


def admit(demo_api, key: str, provider_request_id: str | None, **overrides):
    body = request_body(requestId=key, **overrides)
    if provider_request_id is not None:
        body["dispatch"] = {"providerRequestId": provider_request_id}
    return demo_api.post("/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY=key)


def balances(reservation_id) -> dict[str, int]:
    accounts = CapacityAccount.objects.filter(
        pk__in=Hold.objects.filter(reservation_id=reservation_id).values("account_id")
    )
    return accounts.aggregate(ir=Sum("input_reserved"), ic=Sum("input_consumed"), fl=Sum("in_flight"))


def test_an_admission_with_dispatch_answers_dispatched_with_its_input_posted(demo_api):
    res = admit(demo_api, "ad-1", "prov-ad-1")
    assert res.status_code == 201, res.content[:300]
    body = res.json()
    assert body["state"] == State.DISPATCHED and body["providerRequestId"] == "prov-ad-1"
    reservation = Reservation.objects.get(pk=body["reservationId"])
    assert reservation.state == State.DISPATCHED
    assert reservation.provider_request_id == "prov-ad-1"
    assert reservation.dispatched_at is not None
    # Recorded as a dispatch records them: only a lookup there can vouch for the call later.
    assert reservation.provider_adapter == reservation.model_pool.adapter
    assert reservation.provider_endpoint == reservation.model_pool.provider_base_url
    n = body["tokens"]["input"]
    assert (reservation.input_reserved, reservation.input_consumed) == (n, n)
    holds = Hold.objects.filter(reservation=reservation).count()
    assert balances(reservation.pk) == {"ir": 0, "ic": n * holds, "fl": holds}
    entries = LedgerEntry.objects.filter(reservation=reservation)
    assert {(e.kind, e.input_reserved, e.input_consumed, e.reason) for e in entries} == {
        ("HOLD", 0, n, "dispatched at admission")
    }
    assert selectors.audit(reservation_ids=[reservation.pk]).ok


def test_it_costs_what_an_admission_costs(demo_api):
    assert admit(demo_api, "ad-warm", "prov-warm").status_code == 201
    with count_db_work() as work:
        res = admit(demo_api, "ad-2", "prov-ad-2")
    assert res.status_code == 201
    # The dispatch is in the reserving statement: still one commit and no BEGIN/COMMIT round trips.
    assert work.commits == 1 and work.explicit_commits == 0 and work.autocommit_writes == 1, work.summary()
    assert len(work.statements) <= 6, work.summary()


def test_a_retry_replays_and_another_id_under_the_same_key_conflicts(demo_api):
    first = admit(demo_api, "ad-3", "prov-ad-3")
    again = admit(demo_api, "ad-3", "prov-ad-3")
    assert again.status_code == 200 and again["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    other = admit(demo_api, "ad-3", "prov-ad-3-bis")
    assert other.status_code == 409 and other.json()["code"] == "IDEMPOTENCY_CONFLICT"
    assert Reservation.objects.filter(idempotency_key="ad-3").count() == 1


def test_a_provider_request_id_the_tenant_used_is_refused_with_nothing_written(demo_api):
    assert admit(demo_api, "ad-4", "prov-shared").status_code == 201
    reservations, entries, manifests = (
        Reservation.objects.count(),
        LedgerEntry.objects.count(),
        Manifest.objects.count(),
    )
    res = admit(demo_api, "ad-5", "prov-shared")
    assert res.status_code == 409 and res.json()["code"] == "PROVIDER_REQUEST_ID_IN_USE"
    assert (Reservation.objects.count(), LedgerEntry.objects.count(), Manifest.objects.count()) == (
        reservations,
        entries,
        manifests,
    )


def test_a_malformed_dispatch_is_400_with_nothing_written(demo_api):
    before = Reservation.objects.count()
    for dispatch in ({"providerRequestId": ""}, {"providerRequestId": 7}, {"other": "x"}, "p-1"):
        body = {**request_body(requestId="ad-bad"), "dispatch": dispatch}
        res = demo_api.post("/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY="ad-bad")
        assert res.status_code == 400, (dispatch, res.content[:200])
        assert res["Content-Type"].startswith("application/problem+json")
    assert Reservation.objects.count() == before


def test_the_call_then_settles_as_after_a_dispatch_call(demo_api):
    body = admit(demo_api, "ad-6", "prov-ad-6").json()
    base = f"/api/v1/reservations/{body['reservationId']}"
    # A gateway that still records the dispatch itself repeats it: a no-op.
    repeat = {"fence": 1, "providerRequestId": "prov-ad-6", "admittedDigest": body["admittedDigest"]}
    assert demo_api.post(f"{base}/dispatch", repeat, format="json").status_code == 200
    final = {"fence": 1, "usageEventId": "u1", "outputTokens": 7, "final": True}
    res = demo_api.post(f"{base}/usage", final, format="json")
    assert res.status_code == 200 and res.json()["state"] == State.SETTLED
    reservation = Reservation.objects.get(pk=body["reservationId"])
    assert reservation.outcome == Outcome.COMPLETED and not reservation.concurrency_held
    assert selectors.audit(reservation_ids=[reservation.pk]).ok


def test_never_sent_is_released_in_full_only_with_the_gateways_proof(demo_api):
    body = admit(demo_api, "ad-7", "prov-ad-7").json()
    fail = {"fence": 1, "reason": "connection refused", "requestSent": False}
    res = demo_api.post(f"/api/v1/reservations/{body['reservationId']}/fail", fail, format="json")
    assert res.status_code == 200 and res.json()["state"] == State.SETTLED
    reservation = Reservation.objects.get(pk=body["reservationId"])
    assert reservation.outcome == Outcome.RELEASED and reservation.input_consumed == 0
    assert balances(reservation.pk) == {"ir": 0, "ic": 0, "fl": 0}
    assert selectors.audit(reservation_ids=[reservation.pk]).ok


def test_a_silent_gateway_leaves_it_held_for_evidence_not_released(demo_api):
    """The gateway may have sent it: an expired lease freezes it RECONCILING with nothing released (a plain
    admission without a dispatch record would be released in full)."""
    dispatched = admit(demo_api, "ad-8", "prov-ad-8").json()
    undispatched = admit(demo_api, "ad-9", None).json()
    Reservation.objects.filter(pk__in=[dispatched["reservationId"], undispatched["reservationId"]]).update(
        lease_expires_at=timezone.now() - timedelta(minutes=1)
    )
    released, claims = settlement.claim_expired_leases(now=timezone.now())
    assert [str(r) for r in released] == [undispatched["reservationId"]]
    assert [str(c.reservation_id) for c in claims] == [dispatched["reservationId"]]
    frozen = Reservation.objects.get(pk=dispatched["reservationId"])
    assert frozen.state == State.RECONCILING and frozen.remaining == frozen.output_reserved
    assert frozen.released == 0 and frozen.input_consumed == dispatched["tokens"]["input"]
