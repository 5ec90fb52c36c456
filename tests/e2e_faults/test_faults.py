"""Fault tests of the whole platform (issue 5 §5): the gateway client drives our real HTTP API (live server on
real PostgreSQL and Redis) and the provider simulator; faults are injected at the provider, in the client and
on the wire; the beat's task functions (and, in one test, real Celery workers) reconcile.

After each test: the ledger audit finds zero violations and zero leaks, nothing is left open, and what we
settled for every provider request equals what the simulator billed (``assert_clean``). Leases are expired
by moving ``lease_expires_at`` into the past in the database, never by sleeping.
"""

from __future__ import annotations

import ast
import re
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from tokenbudget_gateway.client import DiePoint, PausePoint
from tokenbudget_gateway.errors import ApiError, ClientDied, StaleFence
from tokenbudget_gateway.protocol import provider_request_id_for, provider_request_id_of_key

from budgeting.admission import tasks as admission_tasks
from budgeting.catalog.models import ModelPool
from budgeting.celery import app as celery_app
from ledger import tasks as ledger_tasks
from ledger.models import EntryKind, Hold, LedgerEntry, Outcome, Reservation, State, UsageEvent
from reconciliation import tasks
from reconciliation.models import BillingImport
from simulation.billing import BillingStatus
from simulation.faults import Fault
from simulation.provider import Simulator
from tests.e2e_faults.harness import (
    LossyProxy,
    Platform,
    assert_clean,
    celery_workers,
    expire,
    expire_all,
    held,
    reservation,
    run_in_threads,
    wait_for,
)

pytestmark = pytest.mark.django_db(transaction=True)


# -- the baseline ------------------------------------------------------------------------------------------


def test_a_clean_call_completes_at_exactly_the_billed_usage(platform: Platform, sim: Simulator) -> None:
    body, key = platform.next_request()
    result = platform.gateway().run(body, idempotency_key=key)
    r = reservation(result.reservation_id)
    entry = sim.entry(result.provider_request_id)
    assert result.outcome == "completed" and entry is not None and entry.status is BillingStatus.COMPLETED
    assert (r.state, r.outcome) == (State.SETTLED, Outcome.COMPLETED)
    assert (r.input_consumed, r.captured) == (entry.prompt_tokens, entry.completion_tokens)
    assert r.captured + r.released == r.output_reserved and r.overrun == 0
    assert held(result.reservation_id)["in_flight"] == 0
    assert assert_clean(sim).compared == 1


def test_the_admission_records_the_dispatch_so_one_call_precedes_the_provider_call(
    platform: Platform, sim: Simulator
) -> None:
    proxy = LossyProxy(platform.api_url, lambda path, body: False)
    try:
        body, key = platform.next_request()
        result = platform.gateway(api_url=proxy.url).run(body, idempotency_key=key)
    finally:
        proxy.stop()
    paths = [seen.path.rsplit("/", 1)[-1] for seen in proxy.seen]
    assert paths[0] == "admissions" and "dispatch" not in paths, paths
    assert result.outcome == "completed"
    assert (
        result.provider_request_id
        == provider_request_id_of_key(key)
        != provider_request_id_for(result.reservation_id)
    )
    entry = sim.entry(result.provider_request_id)
    assert entry is not None and entry.status is BillingStatus.COMPLETED
    r = reservation(result.reservation_id)
    assert (r.state, r.provider_request_id) == (State.SETTLED, result.provider_request_id)
    assert LedgerEntry.objects.filter(reservation=r, reason="dispatched at admission").count() == (
        Hold.objects.filter(reservation=r).count()
    )
    assert assert_clean(sim).compared == 1


def test_a_call_cancelled_before_it_is_sent_is_released_in_full_when_the_admission_dispatched_it(
    platform: Platform, sim: Simulator
) -> None:
    cancel = threading.Event()
    cancel.set()
    body, key = platform.next_request()
    result = platform.gateway().run(body, idempotency_key=key, cancel=cancel)
    assert result.outcome == "cancelled" and sim.entry(result.provider_request_id) is None
    r = reservation(result.reservation_id)
    assert (r.state, r.outcome, r.input_consumed, r.captured) == (State.SETTLED, Outcome.RELEASED, 0, 0)
    assert held(result.reservation_id) == {
        "input_reserved": 0, "output_reserved": 0, "input_consumed": 0, "in_flight": 0,
    }  # fmt: skip
    assert_clean(sim)


# -- clients that die --------------------------------------------------------------------------------------


def test_client_dies_after_recording_dispatch_then_never_processed_releases_it(
    platform: Platform, sim: Simulator
) -> None:
    body, key = platform.next_request()
    with pytest.raises(ClientDied):
        platform.gateway().run(body, idempotency_key=key, die_after="dispatch")
    [r] = Reservation.objects.all()
    assert r.state == State.DISPATCHED and r.provider_request_id and sim.entry(r.provider_request_id) is None
    before = held(str(r.pk))
    assert before["in_flight"] == 3 and before["input_consumed"] == 3 * r.input_reserved

    # The first lookup proves nothing (the provider's lookup is down): frozen, nothing released.
    sim.script_lookup("http_500")
    expire(str(r.pk))
    assert tasks.reclaim_expired_leases() == {
        "released": 0, "frozen": 1, "settled": 0, "refunded": 0, "stillUnknown": 1, "slotsFreed": 0,
    }  # fmt: skip
    r.refresh_from_db()
    assert (r.state, r.fence) == (State.RECONCILING, 2)
    assert held(str(r.pk)) == before, "an unknown outcome releases nothing"

    # The next lookup answers: never processed. Released in full, input refunded.
    expire(str(r.pk))
    assert tasks.lookup_unknown_outcomes() == {"settled": 0, "refunded": 1, "stillUnknown": 0}
    r.refresh_from_db()
    assert (r.state, r.outcome, r.input_consumed, r.captured) == (State.SETTLED, Outcome.RELEASED, 0, 0)
    assert held(str(r.pk)) == {"input_reserved": 0, "output_reserved": 0, "input_consumed": 0, "in_flight": 0}
    assert_clean(sim)


def test_client_dies_before_recording_dispatch_is_released_in_full_after_the_lease(
    platform: Platform, sim: Simulator
) -> None:
    body, key = platform.next_request()
    with pytest.raises(ClientDied):
        platform.gateway(dispatch_at_admission=False).run(
            body, idempotency_key=key, die_after="before_dispatch"
        )
    [r] = Reservation.objects.all()
    assert r.state == State.RESERVED and held(str(r.pk))["in_flight"] == 3
    assert tasks.reclaim_expired_leases()["released"] == 0, "the lease has not expired yet"
    expire(str(r.pk))
    assert tasks.reclaim_expired_leases()["released"] == 1
    r.refresh_from_db()
    assert (r.state, r.outcome, r.fence, r.provider_request_id) == (State.SETTLED, Outcome.RELEASED, 2, "")
    assert held(str(r.pk)) == {"input_reserved": 0, "output_reserved": 0, "input_consumed": 0, "in_flight": 0}
    assert sim.entries() == [], "nothing ever reached the provider"
    assert_clean(sim)


# -- the provider stream misbehaves -----------------------------------------------------------------------


def test_stream_cut_after_k_chunks_settles_partial_usage_holds_the_rest_then_billing_resolves_it(
    platform: Platform, sim: Simulator
) -> None:
    sim.script(Fault.CUT_AFTER_CHUNKS, after_chunks=6, completion_tokens=36)
    body, key = platform.next_request()
    result = platform.gateway(usage_every_chunks=2).run(body, idempotency_key=key)
    assert (result.outcome, result.request_sent) == ("failed", True)
    r = reservation(result.reservation_id)
    entry = sim.entry(result.provider_request_id)
    assert entry is not None and entry.status is BillingStatus.CUT
    # Partial usage settled (a lower bound: one token per content chunk seen), the rest still held.
    assert r.state == State.PARTIALLY_SETTLED and r.captured == 6 <= entry.completion_tokens
    assert held(result.reservation_id)["output_reserved"] == 3 * (r.output_reserved - 6)
    assert held(result.reservation_id)["in_flight"] == 0, "the cut stream ended: its slot goes (SPEC §5)"

    # The lease runs out while the provider's lookup is down: frozen, nothing released.
    sim.script_lookup("unknown")
    expire(result.reservation_id)
    assert tasks.reclaim_expired_leases()["stillUnknown"] == 1
    assert reservation(result.reservation_id).state == State.RECONCILING

    # The billing export settles it at the billed usage; importing the same exports again changes nothing.
    # (Every simulator pool of the demo points at the one simulator; each fetches a per-request and an
    # hourly-bucket export, so only the first pool's two are new.)
    exports = 2 * ModelPool.objects.filter(adapter="simulator").exclude(provider_base_url="").count()
    assert exports >= 4, "the demo has at least two simulator pools"
    assert tasks.import_provider_billing() == {"imports": 2, "unchanged": exports - 2, "failed": 0}
    r.refresh_from_db()
    assert (r.state, r.outcome) == (State.SETTLED, Outcome.RECONCILED)
    assert (r.input_consumed, r.captured + r.overrun) == (entry.prompt_tokens, entry.completion_tokens)
    assert tasks.import_provider_billing() == {"imports": 0, "unchanged": exports, "failed": 0}
    assert BillingImport.objects.count() == 2
    assert_clean(sim)


def test_missing_final_usage_chunk_is_reconciled_from_the_lookup(platform: Platform, sim: Simulator) -> None:
    sim.script(Fault.OMIT_USAGE, completion_tokens=30)
    body, key = platform.next_request()
    result = platform.gateway().run(body, idempotency_key=key)
    assert result.outcome == "usage_unknown"
    r = reservation(result.reservation_id)
    assert r.state == State.PARTIALLY_SETTLED and 0 < r.captured <= 30
    assert r.input_consumed == r.input_reserved, "no usage chunk: the provider's input count is unknown"
    expire(result.reservation_id)
    assert tasks.reclaim_expired_leases()["settled"] == 1
    r.refresh_from_db()
    entry = sim.entry(result.provider_request_id)
    assert entry is not None and (r.state, r.outcome) == (State.SETTLED, Outcome.RECONCILED)
    assert (r.input_consumed, r.captured + r.overrun) == (entry.prompt_tokens, 30)
    assert_clean(sim)


@pytest.mark.parametrize("fault", [Fault.DUPLICATE_USAGE, Fault.REORDER_USAGE])
def test_duplicated_and_reordered_usage_events_are_counted_once(
    platform: Platform, sim: Simulator, fault: Fault
) -> None:
    sim.script(fault, completion_tokens=24)
    body, key = platform.next_request()
    result = platform.gateway(usage_every_chunks=1).run(body, idempotency_key=key)
    assert result.outcome == "completed"
    r = reservation(result.reservation_id)
    assert (r.state, r.captured) == (State.SETTLED, 24)
    entries = LedgerEntry.objects.count()

    # Every usage event delivered again, newest first: each is an exact replay and a no-op.
    events = platform.get(result.reservation_id)["usageEvents"]
    assert len(events) == result.usage_events >= 2
    for event in reversed(events):
        replay = {"fence": 1, "usageEventId": event["usageEventId"], "outputTokens": event["outputTokens"]}
        replay["final"] = event["final"]
        if event["inputTokens"] is not None:
            replay["inputTokens"] = event["inputTokens"]
        assert platform.post(result.reservation_id, "usage", replay).body["applied"] is False
    # The same id with another amount is a conflict and is not applied.
    first = events[0]
    with pytest.raises(ApiError) as conflict:
        platform.post(
            result.reservation_id,
            "usage",
            {"fence": 1, "usageEventId": first["usageEventId"], "outputTokens": 99, "final": False},
        )
    assert (conflict.value.status, conflict.value.code) == (409, "USAGE_EVENT_CONFLICT")
    assert LedgerEntry.objects.count() == entries
    assert reservation(result.reservation_id).captured == 24
    assert_clean(sim)


@pytest.mark.parametrize(
    "fault",
    [Fault.RESET_BEFORE_READ, Fault.RESET_AFTER_READ, Fault.HTTP_5XX_AFTER_READ, Fault.BILL_WITHOUT_ANSWER],
)
def test_an_unknown_provider_outcome_is_never_released_as_zero(
    platform: Platform, sim: Simulator, fault: Fault
) -> None:
    sim.script(fault, completion_tokens=20)
    body, key = platform.next_request()
    result = platform.gateway().run(body, idempotency_key=key)
    assert result.outcome == "failed" and result.request_sent in (True, "unknown")
    r = reservation(result.reservation_id)
    assert r.state == State.PARTIALLY_SETTLED
    assert held(result.reservation_id)["output_reserved"] > 0, "no token is released on an unknown outcome"
    # A call the provider answered has ended and frees its slot; one that may not have reached it may run.
    assert held(result.reservation_id)["in_flight"] == (0 if result.request_sent is True else 3)
    expire(result.reservation_id)
    tasks.reclaim_expired_leases()
    r.refresh_from_db()
    entry = sim.entry(result.provider_request_id)
    assert entry is not None and r.state == State.SETTLED
    expected = Outcome.RELEASED if fault is Fault.RESET_BEFORE_READ else Outcome.RECONCILED
    assert r.outcome == expected
    assert_clean(sim)


@pytest.mark.parametrize("refusal", ["context_length_exceeded", "rate_limited", "connection_refused"])
def test_a_provider_refusal_that_documents_non_processing_releases_in_full(
    platform: Platform, sim: Simulator, refusal: str
) -> None:
    provider_url = None
    if refusal == "context_length_exceeded":
        sim.context_windows["model@2026-07-01"] = 10
    elif refusal == "rate_limited":
        sim.script(Fault.RATE_LIMITED)
    else:
        closed = Simulator()
        provider_url = closed.start()
        closed.stop()
    body, key = platform.next_request()
    result = platform.gateway(provider_url=provider_url).run(body, idempotency_key=key)
    assert (result.outcome, result.request_sent) == ("failed", False)
    r = reservation(result.reservation_id)
    assert (r.state, r.outcome, r.input_consumed) == (State.SETTLED, Outcome.RELEASED, 0)
    assert r.failure_reason.startswith("never processed")
    assert held(result.reservation_id) == {
        "input_reserved": 0, "output_reserved": 0, "input_consumed": 0, "in_flight": 0,
    }  # fmt: skip
    assert_clean(sim)


# -- lost answers, frozen holders --------------------------------------------------------------------------


def _is_final_usage(path: str, body: Any) -> bool:
    return path.endswith("/usage") and isinstance(body, dict) and body.get("final") is True


@pytest.mark.parametrize(
    ("lost", "drop", "fault"),
    [
        ("dispatch", lambda path, body: path.endswith("/dispatch"), None),
        ("final usage", _is_final_usage, None),
        ("fail", lambda path, body: path.endswith("/fail"), Fault.OMIT_USAGE),
    ],
)
def test_a_lost_settlement_response_is_retried_and_the_retry_is_a_no_op(
    platform: Platform, sim: Simulator, lost: str, drop: Any, fault: Fault | None
) -> None:
    if fault is not None:
        sim.script(fault)
    proxy = LossyProxy(platform.api_url, drop)
    # A lost dispatch answer needs a dispatch call of its own; otherwise the admission records it.
    own_dispatch = lost == "dispatch"
    try:
        body, key = platform.next_request()
        gateway = platform.gateway(api_url=proxy.url, dispatch_at_admission=not own_dispatch)
        result = gateway.run(body, idempotency_key=key)
    finally:
        proxy.stop()
    matching = [seen for seen in proxy.seen if drop(seen.path, seen.body)]
    assert [seen.dropped for seen in matching] == [True, False], "applied, answer lost, retried once"
    assert matching[0].body == matching[1].body, "the retry is the identical request"
    r = reservation(result.reservation_id)
    accounts = Hold.objects.filter(reservation=r).count()
    if lost == "fail":
        assert result.outcome == "usage_unknown" and r.state == State.PARTIALLY_SETTLED
        expire(result.reservation_id)
        tasks.reclaim_expired_leases()
        r.refresh_from_db()
    else:
        assert result.outcome == "completed" and (r.state, r.outcome) == (State.SETTLED, Outcome.COMPLETED)
        assert UsageEvent.objects.filter(reservation=r, final=True).count() == 1
    if own_dispatch:
        dispatched = LedgerEntry.objects.filter(reservation=r, kind=EntryKind.POST, reason="dispatched")
    else:
        dispatched = LedgerEntry.objects.filter(reservation=r, reason="dispatched at admission")
    assert dispatched.count() == accounts, "dispatch applied once"
    assert_released_once(r, accounts)
    assert_clean(sim)


def test_a_frozen_lease_holder_resuming_after_takeover_is_refused_on_every_write(
    platform: Platform, sim: Simulator
) -> None:
    frozen, resume = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def pause_at(point: PausePoint) -> None:
        if point == "before_final_usage":
            frozen.set()
            resume.wait(30)

    body, key = platform.next_request()
    gateway = platform.gateway()
    grant = gateway.admit(body, key)

    def holder() -> None:
        try:
            outcome["result"] = gateway.call(grant, pause_at=pause_at)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert frozen.wait(30), "the holder never reached its final usage"
        # Frozen after the whole answer was streamed and billed, before reporting the final usage.
        assert reservation(grant.reservation_id).state == State.RUNNING
        expire(grant.reservation_id)
        assert tasks.reclaim_expired_leases()["settled"] == 1
    finally:
        resume.set()
        thread.join(30)
    r = reservation(grant.reservation_id)
    assert (r.state, r.outcome, r.fence) == (State.SETTLED, Outcome.RECONCILED, 2)
    assert isinstance(outcome.get("error"), StaleFence), outcome

    pid = provider_request_id_for(grant.reservation_id)
    late_writes: list[tuple[str, dict[str, Any]]] = [
        ("usage", {"usageEventId": f"{pid}:99", "outputTokens": 5, "final": True}),
        ("usage", {"usageEventId": f"{pid}:1", "outputTokens": 2, "final": False}),
        ("lease", {}),
        ("cancel", {}),
        ("fail", {"reason": "late", "requestSent": False}),
        ("top-up", {"topUpId": "late", "outputTokens": 10}),
        ("dispatch", {"providerRequestId": pid, "admittedDigest": grant.admitted_digest}),
    ]
    for action, extra in late_writes:
        with pytest.raises(StaleFence):
            platform.post(grant.reservation_id, action, {"fence": grant.fence, **extra})
    after = reservation(grant.reservation_id)
    assert (after.state, after.captured, after.input_consumed) == (r.state, r.captured, r.input_consumed)
    assert_clean(sim)


# -- reconcilers racing ------------------------------------------------------------------------------------


DIE_AT: dict[str, DiePoint] = {
    "reserved": "before_dispatch",
    "dispatched": "dispatch",
    "died_mid_stream": "after_k_chunks",
}


def leave_a_mess(platform: Platform, sim: Simulator, each: int) -> dict[str, list[str]]:
    """Reservations left by crashed or unlucky gateways, ``each`` of every kind, all leases expired."""
    kinds: dict[str, list[str]] = {
        "reserved": [],
        "dispatched": [],
        "no_final_usage": [],
        "died_mid_stream": [],
    }
    # Dispatch in a call of its own: a gateway that dies before it leaves a reservation never dispatched.
    gateway = platform.gateway(dispatch_at_admission=False)
    for _ in range(each):
        for kind in kinds:
            body, key = platform.next_request()
            grant = gateway.admit(body, key)
            kinds[kind].append(grant.reservation_id)
            if kind == "no_final_usage":
                sim.script(Fault.OMIT_USAGE, request_id=provider_request_id_for(grant.reservation_id))
                assert gateway.call(grant).outcome == "usage_unknown"
                continue
            with pytest.raises(ClientDied):
                gateway.call(grant, die_after=DIE_AT[kind], die_after_chunks=2)
    for _ in range(2):
        body, key = platform.next_request()
        assert gateway.run(body, idempotency_key=key).outcome == "completed"
    # A client that dies mid-stream closes its connection; the provider bills what it produced by then.
    wait_for(
        lambda: all(entry.status is not BillingStatus.RUNNING for entry in sim.entries()),
        timeout=10,
        what="the provider to finish the abandoned streams",
    )
    expire_all()
    return kinds


def assert_each_settled_once(ids: list[str]) -> None:
    for reservation_id in ids:
        r = reservation(reservation_id)
        accounts = Hold.objects.filter(reservation=r).count()
        assert r.state == State.SETTLED and r.fence == 2, (r.state, r.fence)
        assert_released_once(r, accounts)


def assert_released_once(r: Reservation, accounts: int) -> None:
    """One RELEASE entry per account held, but for a call whose slot went with its failure (SLOT_FREE) and
    whose provider billed all the output it held: it has nothing left to release, and a move of nothing is
    never written."""
    releases = LedgerEntry.objects.filter(reservation=r, kind=EntryKind.RELEASE).count()
    freed = LedgerEntry.objects.filter(reservation=r, kind=EntryKind.SLOT_FREE).count()
    assert releases == (0 if freed == accounts and r.released == 0 else accounts), (releases, freed)


def test_two_reclaimers_at_once_take_each_lease_once(platform: Platform, sim: Simulator) -> None:
    mess = leave_a_mess(platform, sim, each=3)
    reports = run_in_threads(4, lambda _: tasks.reclaim_expired_leases())
    totals = {name: sum(report[name] for report in reports) for name in reports[0]}
    assert totals == {
        "released": 3, "frozen": 9, "settled": 6, "refunded": 3, "stillUnknown": 0, "slotsFreed": 0,
    }  # fmt: skip
    assert_each_settled_once([rid for ids in mess.values() for rid in ids])
    for rid in mess["reserved"] + mess["dispatched"]:
        assert reservation(rid).outcome == Outcome.RELEASED
    for rid in mess["no_final_usage"] + mess["died_mid_stream"]:
        assert reservation(rid).outcome == Outcome.RECONCILED
    assert_clean(sim)


def test_two_beats_running_every_task_at_once(platform: Platform, sim: Simulator) -> None:
    mess = leave_a_mess(platform, sim, each=2)
    beat = [
        tasks.reclaim_expired_leases,
        tasks.lookup_unknown_outcomes,
        tasks.import_provider_billing,
        admission_tasks.admit_queued,
        ledger_tasks.audit_ledger,
        ledger_tasks.roll_periods,
    ]
    reports = run_in_threads(2, lambda _: [task() for task in beat])
    reclaimed = [report[0] for report in reports]
    assert sum(report["released"] for report in reclaimed) == 2
    assert sum(report["frozen"] for report in reclaimed) == 6
    assert_each_settled_once([rid for ids in mess.values() for rid in ids])
    # One import per export kind (per request, per hour bucket), however often and concurrently it is fetched.
    assert BillingImport.objects.count() == 2, "the same export is one import however often it is fetched"
    # The audit tasks ran beside the other beat's writes, so what they saw may predate its reclaim; the
    # audit that counts is the one of the settled ledger.
    assert_clean(sim)


def test_a_task_delivered_twice_to_real_celery_workers_applies_once(
    platform: Platform, sim: Simulator, tmp_path: Path
) -> None:
    mess = leave_a_mess(platform, sim, each=2)
    task_id = f"reclaim-{uuid.uuid4()}"
    with celery_workers(2, tmp_path) as (queue, workers):
        # The same message twice, as the broker redelivers it (at least once): one per worker.
        for _ in range(2):
            tasks.reclaim_expired_leases.apply_async(queue=queue, task_id=task_id)
        done = f"Task reconciliation.reclaim_expired_leases[{task_id}] succeeded"
        wait_for(
            lambda: sum(worker.text().count(done) for worker in workers) == 2,
            timeout=60,
            what="both deliveries to run",
        )
    assert_each_settled_once([rid for ids in mess.values() for rid in ids])
    logs = "".join(worker.text() for worker in workers)
    reports = [ast.literal_eval(match) for match in re.findall(r"\{'released': [^}]*\}", logs)]
    assert len(reports) == 2, logs
    # The two deliveries may split the rows between them (SKIP LOCKED) or one may find nothing left, but
    # together they take each expired lease exactly once.
    assert sum(r["released"] for r in reports) == len(mess["reserved"])
    dispatched_kinds = ("dispatched", "no_final_usage", "died_mid_stream")
    assert sum(r["frozen"] for r in reports) == sum(len(mess[kind]) for kind in dispatched_kinds)
    assert_clean(sim)
    assert celery_app.conf.task_acks_late and tasks.reclaim_expired_leases.acks_late
