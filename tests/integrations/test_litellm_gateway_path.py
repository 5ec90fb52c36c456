"""The gateway path through a real LiteLLM proxy (issue 22 §1): the official ``openai`` SDK calls the proxy,
which loads our hook and routes to the provider simulator; our API runs under gunicorn on the test database
with a 3 s lease (``LEASE_SECONDS``), so a call of a few seconds outlives several leases.

What each test proves is in its name.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from budgeting.catalog.models import ModelRevision
from budgeting.provisioning.apply import apply_config
from budgeting.provisioning.source import load_file
from ledger.models import CapacityAccount, EntryKind, LedgerEntry, Reservation
from ledger.models import State as ReservationState
from reconciliation import tasks
from simulation.billing import BillingStatus
from simulation.provider import Simulator
from tests.e2e_faults.harness import DEMO, assert_clean, point_pools_at, wait_for
from tests.integrations.conftest import HOOK_DEADLINE_S, Gunicorn, Ports, RecordingCounter
from tests.integrations.litellm_proxy import LiteLLMProxy
from tests.integrations.test_litellm_proxy import CLAUSE, RULES, client, evidence, settled
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

LEASE_S = 3
PRIMARY, FALLBACK = "model@2026-07-01", "small@2026-05-12"


@pytest.fixture
def api_env() -> dict[str, str]:
    return {"LEASE_SECONDS": str(LEASE_S)}


def reservation_of(response: Any) -> Reservation:
    """The reservation a response names in its ``x-tokenbudget-reservation-id`` header."""
    return Reservation.objects.get(pk=response.headers["x-tokenbudget-reservation-id"])


def in_flight() -> dict[int, int]:
    return dict(CapacityAccount.objects.values_list("pk", "in_flight"))


def logged_since(proxy: LiteLLMProxy, before: str) -> list[str]:
    """The proxy's log lines after ``before``, less uvicorn's access lines (one per request, not a log of
    the refusal)."""
    time.sleep(1)
    lines = proxy.log.read_text(errors="replace")[len(before) :].strip().splitlines()
    return [line for line in lines if ' HTTP/1.1" ' not in line]


def test_a_call_admitted_on_the_fallback_model_is_sent_to_that_model(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter]
) -> None:
    simulator, counter = sim
    # The primary's window is too small for the minimum evidence, the fallback's is not (as the provider says
    # too: a request sent to the primary would be refused for its context length).
    ModelRevision.objects.filter(name=PRIMARY).update(context_window=12000)
    simulator.context_windows.update({PRIMARY: 12000, FALLBACK: 65536})
    long_clause = " ".join(f"Clause {n}: the supplier shall deliver within {n} days." for n in range(1000))

    raw = client(proxy).chat.completions.with_raw_response.create(
        model="contract-review",
        messages=[
            {"role": "system", "content": RULES},
            {"role": "user", "content": "Summarise the clauses."},
        ],
        max_tokens=40,
        extra_body={"metadata": {"tokenbudget": {"evidence": [evidence("e1", long_clause)]}}},
    )
    answer = raw.parse()

    row = settled(str(reservation_of(raw).pk))
    assert (row.rung, row.model_revision.name) == ("SMALLER_MODEL", FALLBACK)
    assert raw.headers["x-tokenbudget-model-revision"] == FALLBACK
    billed = simulator.entry(answer.id)
    assert billed is not None and billed.model == FALLBACK, "the provider must receive the admitted model"
    assert (row.input_consumed, row.captured + row.overrun) == (
        billed.prompt_tokens,
        billed.completion_tokens,
    )
    assert len(counter.seen) == 1
    assert_clean(simulator)


class Reclaimer:
    """The real reclaimer's beat task, run every 0.3 s while a call runs; records each lease expiry seen."""

    def __init__(self) -> None:
        self.reports: list[dict[str, int]] = []
        self.expiries: dict[Any, set[Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            self.reports.append(tasks.reclaim_expired_leases())
            for pk, expiry in Reservation.objects.exclude(lease_expires_at=None).values_list(
                "pk", "lease_expires_at"
            ):
                self.expiries.setdefault(pk, set()).add(expiry)

    def __enter__(self) -> Reclaimer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_call_lasting_three_leases_keeps_its_lease_and_settles_at_the_billed_usage(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter], stream: bool
) -> None:
    simulator, _ = sim
    point_pools_at(simulator.base_url)
    request: dict[str, Any] = {
        "model": "support",
        "messages": [{"role": "user", "content": "Where is my order?"}],
        "max_tokens": 24,
    }
    # A fresh API's first admission loads its caches; the call measured must not start with that.
    client(proxy).chat.completions.create(**request)
    if stream:
        simulator.script(completion_tokens=24, chunk_delay_s=1.2)
    else:
        simulator.script(completion_tokens=24, delay_s=3 * LEASE_S + 0.5)
    started = time.monotonic()

    with Reclaimer() as reclaimer:
        if stream:
            raw = client(proxy).chat.completions.with_raw_response.create(**request, stream=True)
            completion_id = ""
            for chunk in raw.parse():
                completion_id = chunk.id
        else:
            raw = client(proxy).chat.completions.with_raw_response.create(**request)
            completion_id = raw.parse().id
        row = settled(str(reservation_of(raw).pk))

    assert time.monotonic() - started >= 3 * LEASE_S
    assert sum(report["settled"] + report["frozen"] + report["released"] for report in reclaimer.reports) == 0
    assert len(reclaimer.expiries[row.pk]) >= 3, "the lease was not renewed while the call ran"
    assert (row.state, row.outcome, row.fence) == (ReservationState.SETTLED, "COMPLETED", 1)
    billed = simulator.entry(completion_id)
    assert billed is not None
    assert (row.input_consumed, row.captured + row.overrun) == (
        billed.prompt_tokens,
        billed.completion_tokens,
    )
    assert_clean(simulator)


def test_a_stream_the_client_did_not_ask_usage_of_is_still_settled_at_the_providers_usage(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter]
) -> None:
    simulator, _ = sim
    raw = client(proxy).chat.completions.with_raw_response.create(
        model="support",
        messages=[{"role": "user", "content": "Where is my order?"}],
        max_tokens=30,
        stream=True,
    )
    chunks = list(raw.parse())

    assert all(chunk.usage is None for chunk in chunks), "the usage chunk reached a client that did not ask"
    row = settled(str(reservation_of(raw).pk))
    billed = simulator.entry(chunks[-1].id)
    assert billed is not None
    assert (row.input_consumed, row.captured + row.overrun) == (
        billed.prompt_tokens,
        billed.completion_tokens,
    )
    assert_clean(simulator)


def test_an_abandoned_stream_frees_its_slot_at_once_and_holds_only_the_unknown_output(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter]
) -> None:
    simulator, _ = sim
    point_pools_at(simulator.base_url)
    simulator.script(completion_tokens=60, chunk_delay_s=0.3)
    before = in_flight()
    raw = client(proxy).chat.completions.with_raw_response.create(
        model="contract-review",
        messages=[{"role": "user", "content": "Summarise clause 7."}],
        max_tokens=60,
        stream=True,
        extra_body={"metadata": {"tokenbudget": {"evidence": [evidence("e1", CLAUSE)]}}},
    )
    reservation_id = raw.headers["x-tokenbudget-reservation-id"]
    stream = raw.parse()
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 2:
            break
    stream.close()

    wait_for(
        lambda: Reservation.objects.get(pk=reservation_id).state == ReservationState.PARTIALLY_SETTLED,
        timeout=20,
        what="the cancel",
    )
    row = Reservation.objects.get(pk=reservation_id)
    assert not row.concurrency_held and in_flight() == before, "the slot stays held after the provider closed"
    assert row.captured >= 2 and row.remaining > 0, "what the provider produced past the chunks stays held"
    freed = LedgerEntry.objects.filter(reservation_id=reservation_id, kind=EntryKind.SLOT_FREE)
    assert freed.count() == row.holds.count() and all(entry.in_flight == -1 for entry in freed)
    assert "closed the call" in freed.first().reason  # type: ignore[union-attr]
    wait_for(
        lambda: (
            (entry := simulator.entry(chunk.id)) is not None and entry.status is not BillingStatus.RUNNING
        ),
        timeout=30,
        what="the provider to stop generating",
    )
    # The rest waits for evidence: at the lease's end the reclaimer's provider lookup settles it.
    wait_for(
        lambda: tasks.reclaim_expired_leases()["settled"] == 1,
        timeout=10 * LEASE_S,
        what="the lease to expire and the reclaimer to settle the call",
    )
    row.refresh_from_db()
    assert (row.state, row.outcome) == (ReservationState.SETTLED, "RECONCILED")
    assert_clean(simulator)


@pytest.fixture
def hung_api(ports: Ports) -> Iterator[list[socket.socket]]:
    """Our API's port answered by a server that accepts connections and never answers."""
    listener = socket.create_server(("127.0.0.1", ports.api))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield accepted
    stop.set()
    thread.join(5)
    for conn in accepted:
        conn.close()
    listener.close()


def test_a_hung_api_is_refused_503_within_the_one_deadline(
    proxy: LiteLLMProxy, hung_api: list[socket.socket], sim: tuple[Simulator, RecordingCounter]
) -> None:
    simulator, counter = sim
    log_before = proxy.log.read_text(errors="replace")
    started = time.monotonic()

    with pytest.raises(openai.InternalServerError) as refused:
        client(proxy).chat.completions.create(
            model="support", messages=[{"role": "user", "content": "Where is my order?"}], max_tokens=20
        )

    elapsed = time.monotonic() - started
    assert HOOK_DEADLINE_S - 0.5 <= elapsed < HOOK_DEADLINE_S + 3, elapsed
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == "5"
    assert refused.value.body["provider_specific_fields"]["code"] == "ADMISSION_UNAVAILABLE"  # type: ignore[index]
    assert hung_api, "the hook never reached the hung server"
    assert counter.seen == [] and simulator.entries() == []
    # The hook then tries to withdraw what our API may have granted; it cannot reach it either, says so
    # in one more line, and leaves the lease to expire.
    wait_for(
        lambda: "not withdrawn" in proxy.log.read_text(errors="replace")[len(log_before) :],
        timeout=HOOK_DEADLINE_S + 5,
        what="the withdrawal to give up",
    )
    logged = logged_since(proxy, log_before)
    assert len(logged) == 2 and "refused 503" in logged[0] and "not withdrawn" in logged[1], logged


def test_with_our_api_down_the_refusal_is_one_log_line_and_nothing_is_withdrawn(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter]
) -> None:
    simulator, _ = sim
    log_before = proxy.log.read_text(errors="replace")
    api.stop()

    with pytest.raises(openai.InternalServerError) as refused:
        client(proxy).chat.completions.create(
            model="support", messages=[{"role": "user", "content": "Where is my order?"}], max_tokens=20
        )

    assert refused.value.status_code == 503
    # No attempt got a connection, so our API granted nothing: there is nothing to withdraw. (A withdrawal
    # would be tried at once and, refused too, logged "not withdrawn" within a second.)
    time.sleep(2)
    logged = logged_since(proxy, log_before)
    assert len(logged) == 1 and "refused 503" in logged[0], logged
    assert simulator.entries() == []


class SlowFront:
    """Our API's port, forwarded to gunicorn; the first connection reaches gunicorn only ``delay_s`` after
    it was opened (its request held until then), so the hook gives up on an admission our API then grants
    all the same."""

    def __init__(self, port: int, backend: int, delay_s: float) -> None:
        self.listener = socket.create_server(("127.0.0.1", port))
        self.listener.settimeout(0.1)
        self.backend, self.delay_s = backend, delay_s
        self.connections = 0
        # Set when our API answered the held (late) request: by then it has been admitted or replayed.
        self.late_answered = threading.Event()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                downstream = self.listener.accept()[0]
            except TimeoutError:
                continue
            delay = self.delay_s if self.connections == 0 else 0.0
            self.connections += 1
            self._start(self._forward, downstream, delay)

    def _start(self, *args: Any) -> None:
        thread = threading.Thread(target=args[0], args=args[1:], daemon=True)
        thread.start()
        self.threads.append(thread)

    def _forward(self, downstream: socket.socket, delay: float) -> None:
        held = b""
        downstream.settimeout(0.1)
        until = time.monotonic() + delay
        with contextlib.suppress(OSError):
            # The request waits here (the client may give up meanwhile: it still reaches our API, late).
            while time.monotonic() < until and not self.stop.is_set():
                try:
                    data = downstream.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    time.sleep(max(0.0, until - time.monotonic()))
                    break
                held += data
            upstream = socket.create_connection(("127.0.0.1", self.backend))
            upstream.settimeout(0.1)
            upstream.sendall(held)
            self._start(self._pump, upstream, downstream, self.late_answered if delay else None)
            self._pump(downstream, upstream)

    def _pump(
        self, source: socket.socket, sink: socket.socket, answered: threading.Event | None = None
    ) -> None:
        with contextlib.suppress(OSError):
            while not self.stop.is_set():
                try:
                    data = source.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                if answered is not None:
                    answered.set()
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(5)
        self.listener.close()


@contextlib.contextmanager
def behind_slow_front(
    ports: Ports, tmp_path: Path, api_env: dict[str, str], delay_s: float
) -> Iterator[SlowFront]:
    """The ``api`` fixture's gunicorn on a port of its own, behind a front on our API's port that holds
    the first connection ``delay_s``."""
    apply_config(load_file(DEMO))
    server = Gunicorn(free_port(), tmp_path / "gunicorn.log", env=api_env)
    front = None
    try:
        server.start()
        front = SlowFront(ports.api, server.port, delay_s)
        yield front
    finally:
        if front is not None:
            front.close()
        server.stop()


@pytest.fixture
def slow_api(
    transactional_db: None, redis_db: Any, ports: Ports, tmp_path: Path, api_env: dict[str, str]
) -> Iterator[SlowFront]:
    """Our API holding the first connection a second past the hook's deadline."""
    with behind_slow_front(ports, tmp_path, api_env, HOOK_DEADLINE_S + 1) as front:
        yield front


@pytest.fixture
def late_api(
    transactional_db: None, redis_db: Any, ports: Ports, tmp_path: Path, api_env: dict[str, str]
) -> Iterator[SlowFront]:
    """Our API holding the first connection 3 s: within the hook's deadline, past the client's."""
    with behind_slow_front(ports, tmp_path, api_env, 3.0) as front:
        yield front


def test_an_admission_the_hook_gave_up_on_is_withdrawn_not_left_held(
    proxy: LiteLLMProxy, slow_api: SlowFront, sim: tuple[Simulator, RecordingCounter]
) -> None:
    simulator, counter = sim
    log_before = proxy.log.read_text(errors="replace")

    with pytest.raises(openai.InternalServerError) as refused:
        client(proxy).chat.completions.create(
            model="support", messages=[{"role": "user", "content": "Where is my order?"}], max_tokens=20
        )

    assert refused.value.status_code == 503
    # The hook asked again with the same key (the first answer stands) and released what it held in full;
    # the delayed first request, arriving after, is a replay and holds nothing more.
    wait_for(
        lambda: Reservation.objects.filter(state=ReservationState.SETTLED).count() == 1,
        timeout=2 * HOOK_DEADLINE_S,
        what="the withdrawal",
    )
    assert slow_api.late_answered.wait(2 * HOOK_DEADLINE_S), "the late first request reached our API"
    [row] = Reservation.objects.all()
    assert (row.outcome, row.input_consumed, row.concurrency_held) == ("RELEASED", 0, False)
    assert row.failure_reason.startswith("never processed: admission given up by the gateway")
    assert not any(in_flight().values())
    assert all(
        account.input_reserved == account.output_reserved == 0 for account in CapacityAccount.objects.all()
    )
    assert slow_api.connections >= 2, "the withdrawal is a second call"
    logged = logged_since(proxy, log_before)
    assert len(logged) == 2 and "refused 503" in logged[0] and f"withdrew reservation {row.pk}" in logged[1]
    assert counter.seen == [] and simulator.entries() == []


def test_an_unknown_tenant_is_a_bad_request_in_one_log_line(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter]
) -> None:
    simulator, _ = sim
    log_before = proxy.log.read_text(errors="replace")

    with pytest.raises(openai.BadRequestError) as refused:
        client(proxy).chat.completions.create(
            model="support",
            messages=[{"role": "user", "content": "Where is my order?"}],
            extra_body={"metadata": {"tokenbudget": {"tenant": "t-nobody"}}},
        )

    assert refused.value.status_code == 400
    assert refused.value.body["provider_specific_fields"]["code"] == "TENANT_NOT_FOUND"  # type: ignore[index]
    logged = logged_since(proxy, log_before)
    assert len(logged) == 1 and "TENANT_NOT_FOUND" in logged[0], logged
    assert simulator.entries() == []


@pytest.mark.parametrize("group", ["support", "contract-review"])
def test_a_call_refused_after_its_admission_was_sent_is_released_in_full(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter], group: str
) -> None:
    """Another callback of the proxy (``refuser``) refuses the call after our hook sent its admission: for
    ``support`` while the admission is still in flight (the group routes while it is decided), for
    ``contract-review`` once admitted (the group has deployments: it is admitted before routing)."""
    simulator, counter = sim
    metadata: dict[str, Any] = {"refuseAfterAdmission": True}
    if group == "contract-review":
        metadata["tokenbudget"] = {"evidence": [evidence("e1")]}

    with pytest.raises(openai.PermissionDeniedError) as refused:
        client(proxy).chat.completions.create(
            model=group,
            messages=[{"role": "user", "content": "Where is my order?"}],
            max_tokens=20,
            extra_body={"metadata": metadata},
        )

    assert refused.value.status_code == 403
    wait_for(
        lambda: Reservation.objects.filter(state=ReservationState.SETTLED).count() == 1,
        timeout=HOOK_DEADLINE_S,
        what="the release",
    )
    [row] = Reservation.objects.all()
    assert (row.outcome, row.input_consumed, row.captured, row.remaining, row.concurrency_held) == (
        "RELEASED",
        0,
        0,
        0,
        False,
    )
    assert row.failure_reason.startswith("never processed"), row.failure_reason
    assert not any(in_flight().values())
    assert all(
        account.input_reserved == account.output_reserved == 0 for account in CapacityAccount.objects.all()
    )
    assert counter.seen == [] and simulator.entries() == []


def test_a_client_gone_while_its_admission_is_in_flight_leaves_nothing_held(
    proxy: LiteLLMProxy, late_api: SlowFront, sim: tuple[Simulator, RecordingCounter]
) -> None:
    """The client gives up after 1 s; our API answers the admission at 3 s. Whether the proxy then drops the
    call (the admission is released when it arrives) or still makes it (it is settled at the billed usage),
    nothing stays held."""
    simulator, counter = sim
    impatient = openai.OpenAI(
        base_url=f"{proxy.url}/v1", api_key=proxy.master_key, max_retries=0, timeout=1.0
    )

    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(
            model="support", messages=[{"role": "user", "content": "Where is my order?"}], max_tokens=20
        )

    assert late_api.late_answered.wait(10), "the held admission reached our API"
    wait_for(
        lambda: Reservation.objects.filter(state=ReservationState.SETTLED).count() == 1,
        timeout=HOOK_DEADLINE_S,
        what="the settlement",
    )
    [row] = Reservation.objects.all()
    if counter.seen:
        assert row.outcome == "COMPLETED", (row.outcome, row.failure_reason)
    else:
        assert (row.outcome, row.input_consumed, row.captured) == ("RELEASED", 0, 0), row.failure_reason
    assert not any(in_flight().values())
    assert all(
        account.input_reserved == account.output_reserved == 0 for account in CapacityAccount.objects.all()
    )
    assert_clean(simulator)
