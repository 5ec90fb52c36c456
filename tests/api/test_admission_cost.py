"""The admission path's database cost, counted (deterministic proxies of its latency): one transaction and one
commit per admission, at most 6 statements for a warm admission; a lifecycle call is at most two statements
of its own, each committing itself (the unlocked read and the write conditional on the row version read; the
lease renewal one UPDATE). The calls that read the reservation first check the catalog version with that
read, the others with the authentication's version read before it. An outcome report is one transaction
under the row's lock."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from budgeting.admission.models import Answer, Manifest
from budgeting.catalog.changes import Actor
from budgeting.catalog.models import ApiToken, ServiceClient, hash_token
from budgeting.catalog.snapshot import Caller
from budgeting.catalog.tokens import issue_token, revoke_token
from ledger.models import CapacityAccount, LedgerEntry, Outcome, Reservation, State
from ledger.selectors import audit
from tests.api.test_admissions import TOKEN, request_body
from tests.api.test_hotpath import support_request
from tests.dbwork import DbWork, count_db_work, second_connection

pytestmark = pytest.mark.django_db(transaction=True)

ACTOR = Actor(None, "test")

MAX_ADMISSION_STATEMENTS = 6
# The version read, then the read and the one write (the answer is built from the row written).
MAX_LIFECYCLE_STATEMENTS = 3
# The calls whose write is one statement on the row read without a lock (``lifecycle._written``).
UNLOCKED = {"lease", "dispatch", "top-up", "usage", "cancel", "fail"}
# The calls whose read of the reservation checks the catalog version too (``LifecycleCall.checks_catalog``):
# two statements, the read and the write, once this process has read the catalog.
CHECKS_CATALOG = {"dispatch", "top-up", "usage", "cancel", "fail"}


def admit(demo_api, n: int) -> tuple[dict, DbWork]:
    body = request_body(requestId=f"cost-{n}")
    with count_db_work() as work:
        res = demo_api.post("/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY=f"cost-{n}")
    assert res.status_code == 201, res.content[:300]
    return res.json(), work


def test_a_warm_admission_is_one_transaction_one_commit_and_few_statements(demo_api):
    admit(demo_api, 0)  # warms the process: catalog snapshot, accounts, count cache
    body, work = admit(demo_api, 1)
    assert len(work.statements) <= MAX_ADMISSION_STATEMENTS, work.summary()
    # Through the hot path, ONE: the reserving statement, which checks the catalog version itself.
    assert len(work.statements) == 1 and GUARD in work.statements[0], work.summary()
    assert work.commits == 1, work.summary()
    assert work.transactions <= 2, work.summary()
    # The one commit is the reserving statement's own: no BEGIN and COMMIT round trips around it.
    assert work.explicit_commits == 0 and work.autocommit_writes == 1, work.summary()
    reservation = Reservation.objects.get(pk=body["reservationId"])
    assert reservation.state == State.RESERVED
    assert reservation.manifest_id == body["manifestId"]
    # The manifest is written by the reserving statement itself, with the answer the caller got.
    assert Manifest.objects.get(pk=body["manifestId"]).answer == Answer.RESERVED


def one_write_transaction(work: DbWork) -> bool:
    """Every write of a lifecycle call in one transaction; the authentication's version check before it is a
    single statement of its own."""
    return work.explicit_commits == 1 and work.rollbacks == 0 and work.autocommit_writes == 0


def one_statement_write(work: DbWork) -> bool:
    """The call's one write is a statement that commits itself: no BEGIN and COMMIT round trips."""
    return work.explicit_commits == 0 and work.rollbacks == 0 and work.autocommit_writes == 1


def reads_no_stored_document(work: DbWork) -> bool:
    """Neither the stored first answer nor a queued request is read or written back by the call (they are
    what makes a large admission's row large)."""
    return not any("response_body" in sql or "request_body" in sql for sql in work.statements)


def lifecycle_work(demo_api, path: str, payload: dict) -> DbWork:
    with count_db_work() as work:
        res = demo_api.post(path, payload, format="json")
    assert res.status_code == 200, res.content[:300]
    return work


def test_each_lifecycle_call_is_one_transaction_and_few_statements(demo_api):
    admit(demo_api, 0)
    body, _ = admit(demo_api, 1)
    rid, base = body["reservationId"], f"/api/v1/reservations/{body['reservationId']}"
    calls = [
        ("lease", {"fence": 1}),
        ("dispatch", {"fence": 1, "providerRequestId": f"p-{rid}", "admittedDigest": body["admittedDigest"]}),
        ("top-up", {"fence": 1, "topUpId": "t1", "outputTokens": 10}),
        ("usage", {"fence": 1, "usageEventId": "u1", "outputTokens": 5, "final": False}),
        # The provider's input count is ours (exact counting): no correction (a downward one is the same one
        # statement: test_cancel_fail_and_a_final_usage_below_the_admitted_input_are_one_statement_write).
        (
            "usage",
            {
                "fence": 1,
                "usageEventId": "u2",
                "outputTokens": 5,
                "inputTokens": body["tokens"]["input"],
                "final": True,
            },
        ),
        ("outcome", {"taskSuccess": True, "citedEvidenceIds": ["e1"]}),
    ]
    for action, payload in calls:
        work = lifecycle_work(demo_api, f"{base}/{action}", payload)
        if action == "lease":
            # Where one statement suffices: the fence and state are the UPDATE's conditions.
            assert len(work.statements) <= 2, work.summary()
        else:
            assert len(work.statements) <= MAX_LIFECYCLE_STATEMENTS, f"{action}: {work.summary()}"
        if action in CHECKS_CATALOG:
            assert len(work.statements) == 2, f"{action}: {work.summary()}"
            assert "catalog_version" in work.statements[0], f"{action}: {work.summary()}"
        if action in UNLOCKED:
            assert one_statement_write(work), f"{action}: {work.summary()}"
        else:
            assert one_write_transaction(work), f"{action}: {work.summary()}"
        assert reads_no_stored_document(work), f"{action}: {work.summary()}"
    assert Reservation.objects.get(pk=rid).state == State.SETTLED
    assert LedgerEntry.objects.filter(reservation_id=rid).exists()


FAILED = {"fence": 1, "reason": "connection refused", "requestSent": False}


@pytest.mark.parametrize(
    ("dispatch", "action", "payload"),
    [
        (None, "cancel", {"fence": 1}),
        (None, "fail", FAILED),
        # Proof of non-processing after the dispatch call (the lifecycle bench's fail), and after an admission
        # that recorded the dispatch (what the LiteLLM hook sends when the provider refused the connection):
        # the input refund, capped per account at what the reservation posted in its period, in the statement.
        ("call", "fail", FAILED),
        ("admission", "fail", FAILED),
        ("call", "fail", {"fence": 1, "reason": "reset", "requestSent": "unknown"}),
        # With the usage a stream delivered: no look-up of its event id first (its unique index answers).
        (
            "call",
            "fail",
            {
                "fence": 1,
                "reason": "500",
                "requestSent": True,
                "usage": {"usageEventId": "u", "outputTokens": 7},
            },
        ),
        # The provider counted less input than was admitted: the downward correction is capped the same way.
        (
            "call",
            "usage",
            {"fence": 1, "usageEventId": "f", "outputTokens": 5, "inputTokens": -10, "final": True},
        ),
    ],
    ids=[
        "cancel",
        "fail-reserved",
        "fail-unsent",
        "fail-unsent-hook",
        "fail-unknown",
        "fail-usage",
        "final-below",
    ],
)
def test_cancel_fail_and_a_final_usage_below_the_admitted_input_are_one_statement_write(
    demo_api, dispatch, action, payload
):
    admit(demo_api, 0)
    extra = {"dispatch": {"providerRequestId": "p-at-admission"}} if dispatch == "admission" else {}
    res = demo_api.post(
        "/api/v1/admissions",
        request_body(requestId="cost-1", **extra),
        format="json",
        HTTP_IDEMPOTENCY_KEY="c1",
    )
    assert res.status_code == 201, res.content[:300]
    body = res.json()
    base = f"/api/v1/reservations/{body['reservationId']}"
    if dispatch == "call":
        sent = {"fence": 1, "providerRequestId": "p-1", "admittedDigest": body["admittedDigest"]}
        lifecycle_work(demo_api, f"{base}/dispatch", sent)
    if "inputTokens" in payload:
        payload = {**payload, "inputTokens": body["tokens"]["input"] + payload["inputTokens"]}
    work = lifecycle_work(demo_api, f"{base}/{action}", payload)
    assert len(work.statements) <= MAX_LIFECYCLE_STATEMENTS, f"{action}: {work.summary()}"
    assert one_statement_write(work), f"{action}: {work.summary()}"
    assert reads_no_stored_document(work), f"{action}: {work.summary()}"
    reservation = Reservation.objects.get(pk=body["reservationId"])
    assert reservation.state in {State.SETTLED, State.PARTIALLY_SETTLED}
    assert audit(reservation_ids=[reservation.pk]).ok


def test_the_prepared_reserving_statement_survives_a_failed_execution(demo_api):
    """The reserving statement is prepared once per connection; an execution that fails (an Idempotency-Key
    already used: the unique index refuses the INSERT and the transaction rolls back) must leave it usable, on
    a fresh connection too."""
    first, _ = admit(demo_api, 0)
    connection.close()  # the next statement prepares anew, and its first execution fails
    again = demo_api.post(
        "/api/v1/admissions", request_body(requestId="cost-0"), format="json", HTTP_IDEMPOTENCY_KEY="cost-0"
    )
    assert again.status_code == 200 and again["Idempotent-Replayed"] == "true"
    assert again.json()["reservationId"] == first["reservationId"]
    assert again.json()["manifestId"] == first["manifestId"]
    second, work = admit(demo_api, 1)
    assert second["reservationId"] != first["reservationId"]
    assert work.commits == 1, work.summary()


def start_request_as_the_server_does() -> None:
    """What Django runs when a request starts (the test client leaves it out): a connection kept from an
    earlier request is due for its health check."""
    connection.close_if_unusable_or_obsolete()


def test_the_connection_health_check_costs_no_statement_of_its_own(demo_api):
    """Django would send SELECT 1 before a request's first statement on a kept connection; the statement
    every API request sends first anyway (the catalog version read, or the admission's reserving statement
    that checks the version itself) is the check."""
    admit(demo_api, 0)
    start_request_as_the_server_does()
    _, work = admit(demo_api, 1)
    assert len(work.sent) == len(work.statements) == 1, (work.sent, work.summary())
    assert "SELECT 1" not in work.sent
    # Negative control: the recorder sees Django's own check when something else is the first statement.
    start_request_as_the_server_does()
    with count_db_work() as other:
        Reservation.objects.count()
    assert other.sent == ["SELECT 1", *other.statements]


def kill_this_connection() -> None:
    pid = connection.connection.info.backend_pid
    with second_connection(autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])


def test_a_kept_connection_that_died_is_replaced_before_the_request_uses_it(demo_api):
    admit(demo_api, 0)
    kill_this_connection()  # as a database restart between two requests does
    start_request_as_the_server_does()
    body, _ = admit(demo_api, 1)
    assert Reservation.objects.get(pk=body["reservationId"]).state == State.RESERVED
    # Negative control: a connection that dies after the request's check is not silently retried.
    kill_this_connection()
    res = demo_api.post(
        "/api/v1/admissions", request_body(requestId="cost-2"), format="json", HTTP_IDEMPOTENCY_KEY="cost-2"
    )
    assert res.status_code == 503 and res.json()["code"] == "SERVICE_UNAVAILABLE"
    connection.close()  # as Django does at the end of a request that left the connection broken
    assert not Reservation.objects.filter(request_id="cost-2").exists()


def test_the_reserving_statement_is_prepared_once_per_connection(demo_api):
    """Django turns prepared statements off unless asked (settings: prepare_threshold); the reserving
    statement asks, so PostgreSQL plans it once per connection, not once per admission. (Two texts: the
    process's first admission reads the catalog and sends it without the version check, the next two with
    it.)"""
    for n in range(3):
        admit(demo_api, n)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT generic_plans + custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE 'WITH record AS (INSERT INTO \"budgeting_manifest\"%%'"
        )
        rows = cursor.fetchall()
    assert sorted(rows) == [(1,), (2,)]


def psycopg_cursors_of_statements():
    """Which psycopg cursor ran each statement, recorded at the driver."""
    ran: dict[str, psycopg.Cursor] = {}
    real_execute = psycopg.Cursor.execute

    def execute(cursor: psycopg.Cursor, query, *args, **kwargs):
        if str(query).startswith("SELECT set_config"):  # Django's set-up of a new connection
            return real_execute(cursor, query, *args, **kwargs)
        ran.setdefault(str(query)[:40], cursor)
        assert ran[str(query)[:40]] is cursor, "a statement moved to another cursor"
        return real_execute(cursor, query, *args, **kwargs)

    return ran, execute


def test_each_hot_statement_runs_on_one_cursor_kept_for_it_on_its_connection(demo_api, monkeypatch):
    """psycopg keeps a cursor's adapters while it runs the same statement again: each hot statement (the
    version read, a lifecycle call's read, the reserving statement) keeps its own cursor for as long as the
    connection lives."""
    body, _ = admit(demo_api, 0)  # warms the process: the catalog's reads are over
    ran, execute = psycopg_cursors_of_statements()
    monkeypatch.setattr(psycopg.Cursor, "execute", execute)
    for n in range(1, 4):
        admit(demo_api, n)
    cancel(demo_api, body)
    assert len(ran) == 3, list(ran)  # the reserving statement, the reservation's read, the cancel's write
    # The cursors themselves are kept (not their ids: a freed cursor's id may be a new one's).
    kept = list(ran.values())
    assert len({id(cursor) for cursor in kept}) == 3 and not any(cursor.closed for cursor in kept)
    connection.close()  # a new connection: new cursors, none of the old connection's
    ran.clear()
    admit(demo_api, 4)
    assert len(ran) == 1 and not any(cursor is old for cursor in ran.values() for old in kept)
    assert all(cursor.connection is connection.connection for cursor in ran.values())


def test_an_admission_short_of_capacity_reads_the_short_account_once(demo_api):
    """An admission short of capacity (queued here; refused where the task class does not queue) is a call
    the gateway pays for too, and a burst at a limit is mostly those: its reason is built from one read of
    the short account with its tenant, task class and pool, not one query each (fails on the code before)."""
    admit(demo_api, 0)  # warms the process
    CapacityAccount.objects.filter(scope="TENANT_TASK").update(input_limit=1)
    body = request_body(requestId="cost-refused")
    with count_db_work() as work:
        res = demo_api.post("/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY="cost-refused")
    assert res.status_code == 202, res.content[:300]
    assert "input needs" in res.json()["reason"], res.json()
    account_reads = [
        sql for sql in work.statements if "ledger_capacityaccount" in sql and "SELECT" in sql[:10]
    ]
    assert len(account_reads) == 1, work.summary()
    assert not any(
        sql.startswith(('SELECT "budgeting_tenant"', 'SELECT "budgeting_taskclass"'))
        for sql in work.statements
    ), work.summary()


def cancel(api_client: APIClient, body: dict) -> tuple[Any, DbWork]:
    with count_db_work() as work:
        res = api_client.post(
            f"/api/v1/reservations/{body['reservationId']}/cancel", {"fence": 1}, format="json"
        )
    return res, work


GUARD = "ledger_require_catalog_version"


def version_reads(work: DbWork) -> int:
    return sum(
        "FROM budgeting_catalogversion WHERE id = 1), clock_timestamp()" in sql for sql in work.statements
    )


def test_a_catalog_change_since_the_process_read_it_makes_the_call_again_after_the_catalog_read(demo_api):
    first, _ = admit(demo_api, 0)  # the process reads the catalog
    second, _ = admit(demo_api, 1)
    # A real change through its write path: another token for the gateway's client (the catalog version
    # moves).
    issue_token(
        client_id=ServiceClient.objects.get(name="gateway-eu").pk,
        reason="rotation",
        actor=ACTOR,
        now=timezone.now(),
    )
    res, work = cancel(demo_api, first)
    assert res.status_code == 200, res.content[:300]
    # The read found another version before writing anything; then the catalog read (and the snapshot's
    # reload), the read again and the write.
    first_read, read, write = work.statements[0], work.statements[-2], work.statements[-1]
    assert "catalog_version" in first_read and "catalog_version" in read, work.summary()
    assert version_reads(work) == 1 and work.autocommit_writes == 1, work.summary()
    assert write.startswith("WITH"), work.summary()
    assert Reservation.objects.get(pk=first["reservationId"]).outcome == Outcome.RELEASED
    # The process's snapshot is current again: the next call reads no version of its own.
    res, work = cancel(demo_api, second)
    assert res.status_code == 200 and len(work.statements) == 2 and version_reads(work) == 0, work.summary()


def test_a_token_revoked_since_the_process_read_the_catalog_is_refused_before_anything_is_written(
    demo_api, monkeypatch
):
    first, _ = admit(demo_api, 0)
    second, _ = admit(demo_api, 1)
    entries = LedgerEntry.objects.count()
    token = ApiToken.objects.get(token_hash=hash_token(TOKEN))
    assert revoke_token(token_id=token.pk, reason="leaked", actor=ACTOR, now=timezone.now())
    # Negative control: without the read's comparison, the snapshot this process read before the revocation
    # would let the revoked token cancel a reservation.
    with monkeypatch.context() as patched:
        patched.setattr(Caller, "checked_version", property(lambda caller: None))
        res, _ = cancel(demo_api, first)
    assert res.status_code == 200, res.content[:300]
    assert Reservation.objects.get(pk=first["reservationId"]).outcome == Outcome.RELEASED
    entries = LedgerEntry.objects.count()
    res, work = cancel(demo_api, second)
    assert res.status_code == 401, res.content[:300]
    assert work.autocommit_writes == work.explicit_commits == 0, work.summary()
    assert Reservation.objects.get(pk=second["reservationId"]).state == State.RESERVED
    assert LedgerEntry.objects.count() == entries


def test_an_admission_after_a_catalog_change_is_made_again_after_the_catalog_read(demo_api):
    admit(demo_api, 0)  # the process reads the catalog
    issue_token(
        client_id=ServiceClient.objects.get(name="gateway-eu").pk,
        reason="rotation",
        actor=ACTOR,
        now=timezone.now(),
    )
    body, work = admit(demo_api, 1)
    # The reserving statement found another version and wrote nothing (it failed: the recorder counts it as
    # sent); then the catalog read (and the snapshot's reload) and the reserving statement again, unguarded.
    assert GUARD in work.statements[0] and GUARD not in work.statements[-1], work.summary()
    assert work.statements[-1].startswith("WITH record AS"), work.summary()
    assert version_reads(work) == 1 and work.autocommit_writes == 2, work.summary()
    assert Manifest.objects.filter(request_id="cost-1").count() == 1
    assert Reservation.objects.get(pk=body["reservationId"]).state == State.RESERVED
    # Current again: the next admission is one statement.
    _, work = admit(demo_api, 2)
    assert len(work.statements) == 1 and GUARD in work.statements[0], work.summary()


def test_a_token_revoked_since_the_process_read_the_catalog_is_not_admitted(demo_api, monkeypatch):
    admit(demo_api, 0)
    token = ApiToken.objects.get(token_hash=hash_token(TOKEN))
    assert revoke_token(token_id=token.pk, reason="leaked", actor=ACTOR, now=timezone.now())
    # Negative control: without the reserving statement's check, the snapshot this process read before the
    # revocation would admit the revoked token.
    with monkeypatch.context() as patched:
        patched.setattr(Caller, "checked_version", property(lambda caller: None))
        control = demo_api.post(
            "/api/v1/admissions",
            request_body(requestId="cost-control"),
            format="json",
            HTTP_IDEMPOTENCY_KEY="cost-control",
        )
    assert control.status_code == 201, control.content[:300]
    written = (Reservation.objects.count(), Manifest.objects.count(), LedgerEntry.objects.count())
    body = request_body(requestId="cost-revoked")
    with count_db_work() as work:
        res = demo_api.post("/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY="cost-revoked")
    assert res.status_code == 401, res.content[:300]
    # The one write sent is the reserving statement, which found another catalog version and failed; then the
    # catalog read, which knows the token no more (and the view's own, which refuses it).
    assert GUARD in work.statements[0] and version_reads(work) >= 1, work.summary()
    assert work.autocommit_writes == 1 and work.explicit_commits == 0, work.summary()
    assert (Reservation.objects.count(), Manifest.objects.count(), LedgerEntry.objects.count()) == written


def test_an_admission_replayed_or_refused_is_answered_after_the_catalog_read(demo_api):
    """Only a new reservation is answered without the catalog read: a replay and a refusal are made again
    with it (nothing written the first time), and the refusal's manifest is recorded once."""
    first, _ = admit(demo_api, 0)
    reservations = Reservation.objects.count()
    body = request_body(requestId="cost-0")
    with count_db_work() as work:
        res = demo_api.post("/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY="cost-0")
    assert res.status_code == 200 and res["Idempotent-Replayed"] == "true", res.content[:300]
    assert res.json()["reservationId"] == first["reservationId"]
    # The key's unique index refused the guarded statement (so its version check passed or not: unknown);
    # the catalog read, the statement again, refused again, and the replay read.
    assert GUARD in work.statements[0] and version_reads(work) == 1, work.summary()
    assert Reservation.objects.count() == reservations
    # A question no rung can fit: refused, its manifest recorded once, after the catalog read.
    too_big = request_body(requestId="cost-big")
    too_big["components"]["question"] = {"text": "Is this clause enforceable? " * 16000}
    with count_db_work() as work:
        res = demo_api.post("/api/v1/admissions", too_big, format="json", HTTP_IDEMPOTENCY_KEY="cost-big")
    assert res.status_code == 422 and res.json()["code"] == "CONTEXT_BUDGET_EXCEEDED", res.content[:300]
    assert version_reads(work) == 1, work.summary()
    assert Manifest.objects.filter(request_id="cost-big").count() == 1
    # An unknown tenant (the snapshot's answer, which may be out of date): again after the catalog read.
    unknown = request_body(requestId="cost-nobody", tenantId="t-nobody")
    with count_db_work() as work:
        res = demo_api.post("/api/v1/admissions", unknown, format="json", HTTP_IDEMPOTENCY_KEY="cost-nobody")
    assert res.status_code == 404 and res.json()["code"] == "TENANT_NOT_FOUND", res.content[:300]
    assert version_reads(work) == 1 and work.autocommit_writes == 0, work.summary()


def test_an_admission_that_creates_its_account_confirms_the_catalog_first_and_is_admitted_once(demo_api):
    """t-internal × support-chat has no account until its first admission creates it from the task class's
    defaults, which moves the catalog version: the catalog is read before that write, and the reserving
    statement, the caller confirmed, does not check the version its own admission moved."""
    admit(demo_api, 0)  # the process reads the catalog (t-19 × contract-review)
    assert not CapacityAccount.objects.filter(
        tenant__slug="t-internal", task_class__slug="support-chat"
    ).exists()
    body = support_request("cost-new-account")
    with count_db_work() as work:
        res = demo_api.post(
            "/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY="cost-new-account"
        )
    assert res.status_code == 201, res.content[:300]
    assert version_reads(work) == 1, work.summary()
    reserving = [sql for sql in work.statements if sql.startswith("WITH record AS")]
    assert len(reserving) == 1 and GUARD not in reserving[0], work.summary()
    assert CapacityAccount.objects.filter(tenant__slug="t-internal", task_class__slug="support-chat").exists()
    assert Reservation.objects.get(pk=res.json()["reservationId"]).state == State.RESERVED


def test_an_unknown_reservation_is_answered_after_the_catalog_read(demo_api):
    admit(demo_api, 0)
    res, work = cancel(demo_api, {"reservationId": str(uuid.uuid4())})
    # Nothing found to compare the catalog version with (the caller's tenants may have changed): the catalog
    # read, then the answer the read gives with it.
    assert res.status_code == 404 and res.json()["code"] == "NOT_FOUND", res.content[:300]
    assert version_reads(work) == 1 and work.autocommit_writes == 0, work.summary()


@pytest.mark.parametrize(("expires_in", "statements"), [(timedelta(seconds=30), 3), (timedelta(hours=1), 2)])
def test_a_token_about_to_expire_is_checked_with_the_catalog_read(demo_api, expires_in, statements):
    """The database clock a call without the catalog read estimates from the last one is not trusted with a
    token that expires within a minute."""
    issued = issue_token(
        client_id=ServiceClient.objects.get(name="gateway-eu").pk,
        reason="short-lived",
        actor=ACTOR,
        now=timezone.now(),
        expires_at=timezone.now() + expires_in,
    )
    body, _ = admit(demo_api, 0)
    short_lived = APIClient()
    short_lived.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.raw}")
    res, work = cancel(short_lived, body)
    assert res.status_code == 200, res.content[:300]
    assert len(work.statements) == statements, work.summary()
    assert version_reads(work) == statements - 2, work.summary()


def test_a_lifecycle_call_on_a_kept_connection_that_died_reconnects(demo_api):
    body, _ = admit(demo_api, 0)
    kill_this_connection()  # as a database restart between two requests does
    start_request_as_the_server_does()
    res, _ = cancel(demo_api, body)
    assert res.status_code == 200, res.content[:300]
    assert Reservation.objects.get(pk=body["reservationId"]).outcome == Outcome.RELEASED
