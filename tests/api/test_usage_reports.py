"""``POST /api/v1/reservations:usage``: several usage reports in one request, each applied as its own usage
call would apply it, each answered with its own status; a body that does not match the schema writes
nothing."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from budgeting.catalog.changes import Actor
from budgeting.catalog.models import ApiToken, ServiceClient, hash_token
from budgeting.catalog.snapshot import Caller
from budgeting.catalog.tokens import issue_token, revoke_token
from ledger.models import LedgerEntry, Reservation, State, UsageEvent
from ledger.selectors import audit
from ledger.services import lifecycle
from tests.api.test_admission_cost import version_reads
from tests.api.test_admissions import TOKEN, request_body
from tests.dbwork import count_db_work, second_connection

pytestmark = pytest.mark.django_db(transaction=True)

PATH = "/api/v1/reservations:usage"


def dispatched(client: APIClient, n: int, **overrides: Any) -> dict[str, Any]:
    """An admitted reservation, its dispatch recorded."""
    body = request_body(requestId=f"reports-{n}", **overrides)
    res = client.post("/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY=f"reports-{n}")
    assert res.status_code == 201, res.content[:300]
    grant = res.json()
    res = client.post(
        f"/api/v1/reservations/{grant['reservationId']}/dispatch",
        {"fence": 1, "providerRequestId": f"p-reports-{n}", "admittedDigest": grant["admittedDigest"]},
        format="json",
    )
    assert res.status_code == 200, res.content[:300]
    return grant


def final(grant: dict[str, Any], event: str = "final", **overrides: Any) -> dict[str, Any]:
    return {
        "reservationId": grant["reservationId"],
        "fence": 1,
        "usageEventId": event,
        "inputTokens": grant["tokens"]["input"],
        "outputTokens": 40,
        "final": True,
        **overrides,
    }


def test_each_report_is_applied_and_answered_with_its_own_status(demo_api):
    first, second, third = (dispatched(demo_api, n) for n in range(3))
    unknown = str(uuid.uuid4())
    reports = [
        {**final(first), "final": False, "usageEventId": "partial", "outputTokens": 10},
        final(first),
        final(second),
        final(unknown_grant := {**third, "reservationId": unknown}),
        final(third, fence=7),
        final({**third, "reservationId": "not-a-uuid"}),
    ]
    res = demo_api.post(PATH, {"usage": reports}, format="json")
    assert res.status_code == 200, res.content[:500]
    results = res.json()["results"]
    assert [r["reservationId"] for r in results] == [r["reservationId"] for r in reports]
    assert [r["status"] for r in results] == [200, 200, 200, 404, 409, 404]
    assert [r.get("state") for r in results[:3]] == [State.RUNNING, State.SETTLED, State.SETTLED]
    assert all(r["applied"] for r in results[:3])
    assert results[3]["problem"]["code"] == "NOT_FOUND" and unknown_grant["reservationId"] == unknown
    assert results[4]["problem"]["code"] == "STALE_FENCE"
    # Each report did what its own usage call does: the partial report then the final one on the first.
    assert UsageEvent.objects.filter(reservation_id=first["reservationId"]).count() == 2
    assert Reservation.objects.get(pk=second["reservationId"]).state == State.SETTLED
    # The refused report changed nothing.
    assert Reservation.objects.get(pk=third["reservationId"]).state == State.DISPATCHED
    assert audit().ok


def test_the_same_reports_sent_again_are_answered_without_applying_them_twice(demo_api):
    grants = [dispatched(demo_api, n) for n in range(2)]
    body = {"usage": [final(grant) for grant in grants]}
    assert demo_api.post(PATH, body, format="json").status_code == 200
    entries = LedgerEntry.objects.count()
    res = demo_api.post(PATH, body, format="json")
    assert res.status_code == 200, res.content[:300]
    assert [(r["status"], r["applied"]) for r in res.json()["results"]] == [(200, False), (200, False)]
    assert LedgerEntry.objects.count() == entries
    assert audit().ok


@pytest.mark.parametrize(
    "broken",
    [
        {"outputTokens": None},
        {"final": "yes"},
        {"fence": 0},
        {"unknownField": 1},
    ],
    ids=["null-output", "string-final", "fence-zero", "unknown-field"],
)
def test_a_report_that_does_not_match_the_schema_refuses_the_whole_body_and_writes_nothing(demo_api, broken):
    first, second = dispatched(demo_api, 0), dispatched(demo_api, 1)
    entries, events = LedgerEntry.objects.count(), UsageEvent.objects.count()
    res = demo_api.post(PATH, {"usage": [final(first), {**final(second), **broken}]}, format="json")
    assert res.status_code == 400, res.content[:300]
    assert res["Content-Type"].startswith("application/problem+json")
    assert res.json()["code"] == "INVALID_INPUT", res.json()
    assert (LedgerEntry.objects.count(), UsageEvent.objects.count()) == (entries, events)
    assert Reservation.objects.get(pk=first["reservationId"]).state == State.DISPATCHED


@pytest.mark.parametrize("usage", [[], "reports", None], ids=["empty", "string", "null"])
def test_a_body_without_a_list_of_reports_is_400(demo_api, usage):
    res = demo_api.post(PATH, {"usage": usage}, format="json")
    assert res.status_code == 400, res.content[:300]
    assert res["Content-Type"].startswith("application/problem+json")


def test_more_reports_than_the_limit_are_400(demo_api):
    grant = dispatched(demo_api, 0)
    reports = [final(grant, event=f"e{n}", final=False, outputTokens=1) for n in range(101)]
    res = demo_api.post(PATH, {"usage": reports}, format="json")
    assert res.status_code == 400, res.content[:300]
    assert not UsageEvent.objects.filter(reservation_id=grant["reservationId"]).exists()


def test_a_reservation_of_a_tenant_the_client_may_not_act_for_is_404(demo_api):
    """gateway-us acts for t-20 only: gateway-eu's t-19 reservation is unknown to it, as on the usage call."""
    grant = dispatched(demo_api, 0)
    issued = issue_token(
        client_id=ServiceClient.objects.get(name="gateway-us").pk,
        reason="test",
        actor=Actor(None, "test"),
        now=timezone.now(),
    )
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.raw}")
    res = other.post(PATH, {"usage": [final(grant)]}, format="json")
    assert res.status_code == 200, res.content[:300]
    assert res.json()["results"][0]["status"] == 404
    assert Reservation.objects.get(pk=grant["reservationId"]).state == State.DISPATCHED


def test_a_request_without_a_token_is_401_and_writes_nothing(demo_api):
    grant = dispatched(demo_api, 0)
    res = APIClient().post(PATH, {"usage": [final(grant)]}, format="json")
    assert res.status_code == 401, res.content[:300]
    assert Reservation.objects.get(pk=grant["reservationId"]).state == State.DISPATCHED


def test_n_reports_cost_one_read_of_their_reservations_and_a_write_each(demo_api):
    """The cost that makes the reports worth sending together: one request, one read of every report's
    reservation (which checks the catalog version too), then each report's one write."""
    grants = [dispatched(demo_api, n) for n in range(4)]
    with count_db_work() as work:
        res = demo_api.post(PATH, {"usage": [final(grant) for grant in grants]}, format="json")
    assert res.status_code == 200, res.content[:300]
    assert [r["status"] for r in res.json()["results"]] == [200] * 4
    assert len(work.statements) == 1 + len(grants), work.summary()
    assert "= ANY(" in work.statements[0] and "catalog_version" in work.statements[0], work.summary()
    assert version_reads(work) == 0, work.summary()
    assert work.autocommit_writes == len(grants) and work.explicit_commits == 0, work.summary()
    assert audit().ok


def test_a_second_report_of_a_reservation_reads_it_again(demo_api):
    grant = dispatched(demo_api, 0)
    reports = [{**final(grant), "final": False, "usageEventId": "partial", "outputTokens": 10}, final(grant)]
    with count_db_work() as work:
        res = demo_api.post(PATH, {"usage": reports}, format="json")
    assert [(r["status"], r["applied"]) for r in res.json()["results"]] == [(200, True), (200, True)]
    # The read of both, the partial report's write, the final report's own read and its write.
    assert len(work.statements) == 4 and work.autocommit_writes == 2, work.summary()
    assert Reservation.objects.get(pk=grant["reservationId"]).state == State.SETTLED
    assert UsageEvent.objects.filter(reservation_id=grant["reservationId"]).count() == 2
    assert audit().ok


def test_a_report_whose_reservation_changed_after_the_read_is_written_under_the_lock(demo_api, monkeypatch):
    """Each write applies only to the row version read for it: a reservation another connection changed
    between the batch's read and the report's write is read again under its lock, and the report applied
    once."""
    first, second = dispatched(demo_api, 0), dispatched(demo_api, 1)
    read_together = lifecycle.read_together

    def read_then_changed(*args: Any, **kwargs: Any) -> dict[uuid.UUID, lifecycle.Read]:
        reads = read_together(*args, **kwargs)
        with second_connection(autocommit=True) as other:
            other.execute(
                "UPDATE ledger_reservation SET updated_at = now() WHERE id = %s", [first["reservationId"]]
            )
        return reads

    monkeypatch.setattr(lifecycle, "read_together", read_then_changed)
    with count_db_work() as work:
        res = demo_api.post(PATH, {"usage": [final(first), final(second)]}, format="json")
    assert [(r["status"], r["applied"]) for r in res.json()["results"]] == [(200, True), (200, True)]
    # The first report's write matched nothing (undone whole), then its transaction under the row's lock.
    assert work.explicit_commits == 1, work.summary()
    assert UsageEvent.objects.filter(reservation_id=first["reservationId"]).count() == 1
    for grant in (first, second):
        assert Reservation.objects.get(pk=grant["reservationId"]).state == State.SETTLED
    assert audit().ok


def test_reports_after_a_catalog_change_are_each_applied_once_after_the_catalog_read(demo_api):
    first, second = dispatched(demo_api, 0), dispatched(demo_api, 1)
    issue_token(
        client_id=ServiceClient.objects.get(name="gateway-eu").pk,
        reason="rotation",
        actor=Actor(None, "test"),
        now=timezone.now(),
    )
    with count_db_work() as work:
        res = demo_api.post(PATH, {"usage": [final(first), final(second)]}, format="json")
    # The read found another version and nothing was written; then the catalog read, the read again and the
    # two writes: each report is applied (not answered as a replay of itself).
    assert [(r["status"], r["applied"]) for r in res.json()["results"]] == [(200, True), (200, True)]
    assert version_reads(work) == 1 and work.autocommit_writes == 2, work.summary()
    assert UsageEvent.objects.filter(usage_event_id="final").count() == 2
    assert audit().ok


def test_reports_of_a_token_revoked_since_the_process_read_the_catalog_are_refused_with_nothing_written(
    demo_api, monkeypatch
):
    first, second = dispatched(demo_api, 0), dispatched(demo_api, 1)
    token = ApiToken.objects.get(token_hash=hash_token(TOKEN))
    assert revoke_token(token_id=token.pk, reason="leaked", actor=Actor(None, "test"), now=timezone.now())
    # Negative control: without the read's comparison, the snapshot this process read before the revocation
    # would let the revoked token settle a reservation.
    with monkeypatch.context() as patched:
        patched.setattr(Caller, "checked_version", property(lambda caller: None))
        control = demo_api.post(PATH, {"usage": [final(first)]}, format="json")
    assert control.status_code == 200 and control.json()["results"][0]["applied"], control.content[:300]
    entries, events = LedgerEntry.objects.count(), UsageEvent.objects.count()
    with count_db_work() as work:
        res = demo_api.post(PATH, {"usage": [final(second)]}, format="json")
    assert res.status_code == 401, res.content[:300]
    assert work.autocommit_writes == work.explicit_commits == 0, work.summary()
    assert (LedgerEntry.objects.count(), UsageEvent.objects.count()) == (entries, events)
    assert Reservation.objects.get(pk=second["reservationId"]).state == State.DISPATCHED


def test_reports_of_unknown_reservations_are_answered_after_the_catalog_read(demo_api):
    grant = dispatched(demo_api, 0)
    unknown = {**grant, "reservationId": str(uuid.uuid4())}
    with count_db_work() as work:
        res = demo_api.post(PATH, {"usage": [final(unknown)]}, format="json")
    assert res.status_code == 200 and res.json()["results"][0]["status"] == 404, res.content[:300]
    assert version_reads(work) == 1 and work.autocommit_writes == 0, work.summary()
