"""The simulator adapter's lookups against the provider simulator. No database."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from reconciliation.providers.base import LookupResult, LookupStatus
from reconciliation.providers.simulator import SimulatorLookup
from simulation.faults import Fault, LookupFault
from simulation.provider import Simulator

MESSAGES = [{"role": "user", "content": "How long is the notice period?"}]


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(seed=11)
    simulator.start()
    yield simulator
    simulator.stop()


def call(sim: Simulator, request_id: str, **body: object) -> None:
    parts = urlsplit(sim.base_url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=5)
    payload = {"model": "sim-large", "messages": MESSAGES, "max_tokens": 8, **body}
    connection.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(payload).encode(),
        headers={
            "Authorization": "Bearer sk-t",
            "Content-Type": "application/json",
            "X-Request-Id": request_id,
        },
    )
    try:
        connection.getresponse().read()
    except (ConnectionError, http.client.HTTPException):
        pass  # some tests provoke faults; the ledger is what they check
    finally:
        connection.close()


# -- LookupResult ------------------------------------------------------------------------------------------


def test_lookup_result_refuses_fabricated_evidence() -> None:
    for status in (
        LookupStatus.UNKNOWN,
        LookupStatus.RUNNING,
        LookupStatus.NOT_PROCESSED,
        LookupStatus.NOT_FOUND,
    ):
        with pytest.raises(ValueError):
            LookupResult(status, input_tokens=3)
    with pytest.raises(ValueError):
        LookupResult(LookupStatus.COMPLETED, input_tokens=-1)
    assert LookupResult.unknown("x") == LookupResult(LookupStatus.UNKNOWN, detail="x")


def test_the_simulator_adapter_declares_what_it_can_prove(sim: Simulator) -> None:
    adapter = SimulatorLookup(sim.base_url + "/")
    assert adapter.endpoint == sim.base_url
    assert adapter.capabilities.lookup and adapter.capabilities.vouches_not_found
    assert adapter.capabilities.retention is None and adapter.capabilities.billing == "request"
    assert (
        adapter.knows("prq-1")
        and not adapter.knows("")
        and not adapter.knows("a b")
        and not adapter.knows("x" * 257)
    )


# -- SimulatorLookup against the simulator -----------------------------------------------------------------


def test_completed_request_has_the_billed_usage(sim: Simulator) -> None:
    call(sim, "prq-1")
    entry = sim.entry("prq-1")
    result = SimulatorLookup(sim.base_url).lookup("prq-1")
    assert entry is not None
    assert result == LookupResult(
        LookupStatus.COMPLETED,
        input_tokens=entry.prompt_tokens,
        output_tokens=entry.completion_tokens,
        detail="completed",
    )


def test_cut_request_is_completed_with_what_was_billed(sim: Simulator) -> None:
    sim.script(Fault.RESET_AFTER_READ)
    call(sim, "prq-cut")
    result = SimulatorLookup(sim.base_url).lookup("prq-cut")
    assert result.status is LookupStatus.COMPLETED
    assert result.input_tokens > 0 and result.output_tokens == 0 and result.detail == "cut"


def test_unknown_id_and_unprocessed_request_are_not_found(sim: Simulator) -> None:
    sim.script(Fault.RESET_BEFORE_READ)
    call(sim, "prq-never")
    lookup = SimulatorLookup(sim.base_url)
    for request_id in ("prq-never", "prq-no-such-id"):
        result = lookup.lookup(request_id)
        assert result == LookupResult(LookupStatus.NOT_FOUND, detail="not_found")


def test_running_request_is_running(sim: Simulator) -> None:
    sim.script(completion_tokens=30, chunk_delay_s=0.03)
    worker = threading.Thread(target=call, args=(sim, "prq-run"), kwargs={"stream": True})
    worker.start()
    try:
        while sim.entry("prq-run") is None:
            time.sleep(0.005)
        result = SimulatorLookup(sim.base_url).lookup("prq-run")
        assert result == LookupResult(LookupStatus.RUNNING, detail="running")
    finally:
        worker.join()


def test_stopped_simulator_is_unknown_never_not_processed() -> None:
    simulator = Simulator()
    base_url = simulator.start()
    simulator.stop()
    result = SimulatorLookup(base_url, timeout=1.0).lookup("prq-1")
    assert result.status is LookupStatus.UNKNOWN


@pytest.mark.parametrize("fault", [LookupFault.HTTP_500, LookupFault.RESET, LookupFault.UNKNOWN])
def test_lookup_faults_are_unknown(sim: Simulator, fault: LookupFault) -> None:
    sim.script_lookup(fault)
    result = SimulatorLookup(sim.base_url).lookup("prq-no-such-id")
    assert result.status is LookupStatus.UNKNOWN
    # The fault applied once; the next lookup gets the real answer.
    assert SimulatorLookup(sim.base_url).lookup("prq-no-such-id").status is LookupStatus.NOT_FOUND


def test_lookup_timeout_is_unknown(sim: Simulator) -> None:
    sim.script_lookup(LookupFault.DELAY, delay_s=0.5)
    result = SimulatorLookup(sim.base_url, timeout=0.1).lookup("prq-no-such-id")
    assert result.status is LookupStatus.UNKNOWN


def test_wrong_base_url_404_is_unknown(sim: Simulator) -> None:
    # A route that does not exist answers 404 — that says nothing about the request.
    result = SimulatorLookup(sim.base_url + "/wrong-prefix").lookup("prq-no-such-id")
    assert result.status is LookupStatus.UNKNOWN


def test_request_ids_are_quoted_in_the_url(sim: Simulator) -> None:
    call(sim, "tbr-a/b?c")
    assert SimulatorLookup(sim.base_url).lookup("tbr-a/b?c").status is LookupStatus.COMPLETED


class _Canned(BaseHTTPRequestHandler):
    """Answers every GET with the class's canned status and body."""

    status = 200
    body = b"{}"

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (200, b"not json"),
        (200, b"[]"),
        (200, json.dumps({"id": "someone-else", "status": "not_found"}).encode()),
        (200, json.dumps({"id": "prq-x", "status": "completed"}).encode()),
        (200, json.dumps({"id": "prq-x", "status": "completed", "usage": {"prompt_tokens": 1}}).encode()),
        (
            200,
            json.dumps(
                {
                    "id": "prq-x",
                    "status": "completed",
                    "usage": {"prompt_tokens": 1, "completion_tokens": True},
                }
            ).encode(),
        ),
        (200, json.dumps({"id": "prq-x", "status": "gone"}).encode()),
        (404, json.dumps({"id": "prq-x", "status": "not_found"}).encode()),
        (503, b""),
    ],
)
def test_malformed_or_non_200_answers_are_unknown(status: int, body: bytes) -> None:
    handler = type("Canned", (_Canned,), {"status": status, "body": body})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        result = SimulatorLookup(f"http://{host!s}:{port}").lookup("prq-x")
    finally:
        server.shutdown()
        server.server_close()
    assert result.status is LookupStatus.UNKNOWN


def test_a_server_that_accepts_and_never_answers_is_unknown() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        port = listener.getsockname()[1]
        result = SimulatorLookup(f"http://127.0.0.1:{port}", timeout=0.2).lookup("prq-x")
    finally:
        listener.close()
    assert result.status is LookupStatus.UNKNOWN
