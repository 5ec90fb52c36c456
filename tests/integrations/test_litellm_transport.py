"""The hook's connection to our API (``tokenbudget_litellm.transport.AsyncApi``) against real sockets on
loopback: the connection is kept alive across calls, and one deadline bounds a call to a hung server, its
retries included."""

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
    """HTTP/1.1 with keep-alive: answers ``{"path": …}``, or 409 STALE_FENCE for ``/stale``."""

    protocol_version = "HTTP/1.1"
    connections: set[tuple[str, int]] = set()

    def do_POST(self) -> None:
        type(self).connections.add(self.client_address)
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        stale = self.path.endswith("/stale")
        body = json.dumps({"code": "STALE_FENCE"} if stale else {"path": self.path}).encode()
        self.send_response(409 if stale else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""


@pytest.fixture
def answering() -> Iterator[str]:
    _Answering.connections = set()
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
    assert "ClientConnectorError" in str(unavailable.value)
    assert not unavailable.value.reached, "no connection was made: nothing reached our API"


def test_sent_is_set_once_the_body_is_on_the_wire_before_the_answer(
    hung: tuple[str, list[socket.socket]],
) -> None:
    url, accepted = hung
    api = AsyncApi(url, "token", deadline_s=3.0)

    async def send() -> bool:
        sent = asyncio.Event()
        call = asyncio.get_running_loop().create_task(
            api.request("POST", "/api/v1/admissions", {"marker": "on-the-wire"}, sent=sent)
        )
        try:
            await asyncio.wait_for(sent.wait(), 1.0)
            return call.done()
        finally:
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            await api.aclose()

    answered = asyncio.run(send())

    assert not answered, "sent only once the call was over: the caller could not go on meanwhile"
    for _ in range(50):  # the fixture's thread accepts what the kernel already took
        if accepted:
            break
        time.sleep(0.05)
    accepted[0].settimeout(1.0)
    assert b'"marker":"on-the-wire"' in accepted[0].recv(65536)


def test_sent_is_set_when_the_call_fails_without_a_connection() -> None:
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    api = AsyncApi(f"http://127.0.0.1:{port}", "token", deadline_s=1.0, retry=RetryPolicy(attempts=1))
    sent = asyncio.Event()

    async def call() -> None:
        try:
            await api.request("POST", "/api/v1/admissions", {}, sent=sent)
        finally:
            await api.aclose()

    with pytest.raises(ApiUnavailable):
        asyncio.run(call())

    assert sent.is_set(), "a caller waiting for the send would wait forever"
