"""The hook's connection to our API (``tokenbudget_litellm.transport.AsyncApi``) against real sockets on
loopback: the connection is kept alive across calls, a request is on the wire before ``request`` returns
when a connection is idle, a closed or closing connection is not used again, and one deadline bounds a
call to a hung server, its retries included."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from tokenbudget_gateway.errors import ApiUnavailable, StaleFence
from tokenbudget_gateway.transport import RetryPolicy
from tokenbudget_litellm.transport import AsyncApi


class _Answering(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive: answers ``{"path": …}``, or 409 STALE_FENCE for ``/stale``; for a path
    with ``close-after`` it closes the connection after answering (without saying so), for ``chunked`` it
    answers in chunks with ``Connection: close``, for ``slow`` it answers after 0.2 s. ``arrived`` is set
    once a request's body is read (kept in ``bodies``)."""

    protocol_version = "HTTP/1.1"
    connections: set[tuple[str, int]] = set()
    bodies: list[bytes] = []
    arrived = threading.Event()

    def do_POST(self) -> None:
        type(self).connections.add(self.client_address)
        type(self).bodies.append(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        type(self).arrived.set()
        if "slow" in self.path:
            time.sleep(0.2)
        stale = self.path.endswith("/stale")
        body = json.dumps({"code": "STALE_FENCE"} if stale else {"path": self.path}).encode()
        self.send_response(409 if stale else 200)
        self.send_header("Content-Type", "application/json")
        if "chunked" in self.path:
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            half = len(body) // 2
            for part in (body[:half], body[half:], b""):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            return
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if "close-after" in self.path:
            self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""


@pytest.fixture
def answering() -> Iterator[str]:
    _Answering.connections = set()
    _Answering.bodies = []
    _Answering.arrived.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answering)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def hung() -> Iterator[tuple[str, list[socket.socket]]]:
    """Accepts connections and reads, never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
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
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    stop.set()
    thread.join(2)
    for conn in accepted:
        conn.close()
    listener.close()


def once(api: AsyncApi, path: str) -> object:
    """One call on a loop of its own, its session closed after it."""

    async def call() -> object:
        try:
            return await api.request("POST", path, {})
        finally:
            await api.aclose()

    return asyncio.run(call())


def test_calls_reuse_one_kept_alive_connection(answering: str) -> None:
    api = AsyncApi(answering, "token", deadline_s=5)

    async def twenty() -> list[object]:
        try:
            return [(await api.request("POST", f"/api/v1/x/{n}", {"n": n})).body for n in range(20)]
        finally:
            await api.aclose()

    bodies = asyncio.run(twenty())

    assert bodies == [{"path": f"/api/v1/x/{n}"} for n in range(20)]
    assert len(_Answering.connections) == 1, "every call opened a new connection"


def test_a_stale_fence_is_raised_as_such(answering: str) -> None:
    api = AsyncApi(answering, "token", deadline_s=5)

    with pytest.raises(StaleFence):
        once(api, "/api/v1/reservations/r/stale")


def test_a_hung_api_is_given_up_at_the_one_deadline_not_after_every_retry(
    hung: tuple[str, list[socket.socket]],
) -> None:
    url, accepted = hung
    api = AsyncApi(url, "token", deadline_s=1.0, retry=RetryPolicy(attempts=4, base_delay_s=0.1))
    started = time.monotonic()

    with pytest.raises(ApiUnavailable) as unavailable:
        once(api, "/api/v1/admissions")

    elapsed = time.monotonic() - started
    # Four attempts of a 1 s timeout would take over 4 s: one deadline covers them all.
    assert 0.9 <= elapsed < 2.0, elapsed
    assert "deadline" in str(unavailable.value)
    assert unavailable.value.reached, "the request may have been applied: it is withdrawn"
    assert len(accepted) == 1


def test_a_refused_connection_is_retried_within_the_deadline() -> None:
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    api = AsyncApi(f"http://127.0.0.1:{port}", "token", deadline_s=3.0, retry=RetryPolicy(attempts=3))
    started = time.monotonic()

    with pytest.raises(ApiUnavailable) as unavailable:
        once(api, "/api/v1/admissions")

    assert time.monotonic() - started < 3.0
    assert "ConnectionRefusedError" in str(unavailable.value)
    assert not unavailable.value.reached, "no connection was made: nothing reached our API"


def test_a_request_is_on_the_wire_before_request_returns_when_a_connection_is_idle(answering: str) -> None:
    api = AsyncApi(answering, "token", deadline_s=5)

    async def send() -> tuple[bool, object]:
        try:
            await api.request("POST", "/api/v1/warm-up", {})  # leaves one kept-alive connection idle
            _Answering.arrived.clear()
            answer = api.request("POST", "/api/v1/admissions", {"marker": "on-the-wire"})
            # The loop is blocked here on purpose: no turn of it can have written the request.
            arrived = _Answering.arrived.wait(2.0)
            return arrived, (await answer).body
        finally:
            await api.aclose()

    arrived, body = asyncio.run(send())

    assert arrived, "the request left only once the loop turned: the hook could not go on meanwhile"
    assert _Answering.bodies[-1] == b'{"marker":"on-the-wire"}'
    assert body == {"path": "/api/v1/admissions"}


def test_without_an_idle_connection_the_request_is_sent_when_awaited(answering: str) -> None:
    """The negative control of the test above: a new client has no connection to write to at once."""
    api = AsyncApi(answering, "token", deadline_s=5)

    async def send() -> tuple[bool, object]:
        try:
            _Answering.arrived.clear()
            answer = api.request("POST", "/api/v1/admissions", {"marker": "later"})
            arrived = _Answering.arrived.wait(0.5)
            return arrived, (await answer).body
        finally:
            await api.aclose()

    arrived, body = asyncio.run(send())

    assert not arrived
    assert body == {"path": "/api/v1/admissions"}


def test_a_connection_the_server_closed_while_idle_is_not_used_again(answering: str) -> None:
    api = AsyncApi(answering, "token", deadline_s=5, retry=RetryPolicy(attempts=1))

    async def twice() -> list[object]:
        try:
            first = (await api.request("POST", "/api/v1/x/close-after", {})).body
            await asyncio.sleep(0.2)  # the server's close reaches the client
            return [first, (await api.request("POST", "/api/v1/x/again", {})).body]
        finally:
            await api.aclose()

    bodies = asyncio.run(twice())

    # One attempt only: the second call did not fail on the closed connection and get retried.
    assert bodies == [{"path": "/api/v1/x/close-after"}, {"path": "/api/v1/x/again"}]
    assert len(_Answering.connections) == 2


def test_a_chunked_answer_and_connection_close_are_understood(answering: str) -> None:
    api = AsyncApi(answering, "token", deadline_s=5)

    async def twice() -> list[object]:
        try:
            return [(await api.request("POST", f"/api/v1/x/chunked-{n}", {})).body for n in range(2)]
        finally:
            await api.aclose()

    bodies = asyncio.run(twice())

    assert bodies == [{"path": "/api/v1/x/chunked-0"}, {"path": "/api/v1/x/chunked-1"}]
    assert len(_Answering.connections) == 2, "an answer with Connection: close ends its connection"


def test_at_most_max_connections_are_open_and_the_rest_wait(answering: str) -> None:
    api = AsyncApi(answering, "token", deadline_s=5, max_connections=2)

    async def many() -> list[object]:
        try:
            calls = [api.request("POST", f"/api/v1/x/slow-{n}", {}) for n in range(6)]
            return [answer.body for answer in await asyncio.gather(*calls)]
        finally:
            await api.aclose()

    bodies = asyncio.run(many())

    assert bodies == [{"path": f"/api/v1/x/slow-{n}"} for n in range(6)]
    assert len(_Answering.connections) == 2
