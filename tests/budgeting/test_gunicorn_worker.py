"""gunicorn's worker class for our API (budgeting/gunicorn_worker.py), served by a real gunicorn beside its
sync worker as the reference: the application sees the environ gunicorn's own worker gives it, answers
stream, what the worker refuses itself is problem+json, one application thread serves every request, and
clients sending slowly cost no worker (the negative control: the sync worker they stall)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.ports import free_port
from tests.slow_clients import SlowClients

ROOT = Path(__file__).resolve().parents[2]
OURS = "budgeting.gunicorn_worker.ApiWorker"
LIMIT = 4096  # MAX_REQUEST_BYTES of the servers here
UP = b"GET /up HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


@dataclass
class Server:
    port: int
    process: subprocess.Popen[bytes]
    closed: Path


@contextlib.contextmanager
def served(worker_class: str, tmp: Path, *options: str) -> Iterator[Server]:
    """tests/budgeting/echo_wsgi.py under gunicorn, one worker of ``worker_class``, with these ``options``."""
    port = free_port()
    closed = tmp / f"closed-{port}"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "budgeting.settings",
        "MAX_REQUEST_BYTES": str(LIMIT),
        "ECHO_CLOSED": str(closed),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "tests.budgeting.echo_wsgi:application", "--worker-class",
         worker_class, "--bind", f"127.0.0.1:{port}", "--workers", "1", "--graceful-timeout", "2",
         "--log-level", "warning", *options],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, _, _ = exchange(port, UP)
                assert status == 201
                break
            except OSError:
                assert time.monotonic() < deadline, f"{worker_class} did not start"
                time.sleep(0.1)
        yield Server(port, process, closed)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    tmp = tmp_path_factory.mktemp("workers")
    with served(OURS, tmp) as ours, served("sync", tmp) as sync:
        yield {"ours": ours, "sync": sync}


def exchange(port: int, request: bytes) -> tuple[int, dict[str, list[str]], bytes]:
    """One request sent raw, its status, headers (by lower-case name) and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        response = http.client.HTTPResponse(sock)
        response.begin()
        headers: dict[str, list[str]] = {}
        for name, value in response.getheaders():
            headers.setdefault(name.lower(), []).append(value)
        return response.status, headers, response.read()


def echoed(port: int, request: bytes) -> dict[str, Any]:
    status, headers, body = exchange(port, request)
    assert status == 201, body[:300]
    answer: dict[str, Any] = json.loads(body)
    answer["set_cookie"] = headers.get("set-cookie")
    return answer


REQUEST = (
    b"POST /a%20b/%C3%A9/%2F?x=1&y=%20&z=%C3%A9 HTTP/1.1\r\nHost: example.test:81\r\n"
    b"X-Dup: 1\r\nX-Dup: 2\r\nX_Real_IP: 6.6.6.6\r\nX-Real-IP: 10.0.0.1\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 5\r\nConnection: close\r\n\r\nhello"
)
COMPARED = (
    "REQUEST_METHOD", "SCRIPT_NAME", "PATH_INFO", "QUERY_STRING", "RAW_URI", "SERVER_PROTOCOL",
    "REMOTE_ADDR", "CONTENT_TYPE", "CONTENT_LENGTH", "HTTP_HOST", "HTTP_X_DUP", "HTTP_X_REAL_IP",
    "HTTP_CONNECTION", "wsgi.url_scheme",
)  # fmt: skip


def test_the_application_sees_the_environ_gunicorns_own_worker_gives(servers: dict[str, Server]) -> None:
    ours, sync = (echoed(servers[name].port, REQUEST) for name in ("ours", "sync"))
    assert {key: ours["environ"].get(key) for key in COMPARED} == {
        key: sync["environ"].get(key) for key in COMPARED
    }
    assert ours["environ"]["PATH_INFO"] == "/a b/\u00c3\u00a9//"  # percent-decoded bytes, as latin-1
    assert ours["environ"]["HTTP_X_DUP"] == "1,2"
    assert ours["environ"]["HTTP_X_REAL_IP"] == "10.0.0.1"  # X_Real_IP dropped, not taken for it
    assert ours["body"] == sync["body"] == "hello"
    assert ours["set_cookie"] == sync["set_cookie"] == ["a=1", "b=2"]


def test_a_chunked_body_arrives_whole_with_its_length(servers: dict[str, Server]) -> None:
    answer = echoed(
        servers["ours"].port,
        b"POST /chunked HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    )
    assert answer["body"] == "hello world"
    assert answer["environ"]["CONTENT_LENGTH"] == "11"
    assert "HTTP_TRANSFER_ENCODING" not in answer["environ"]


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        pytest.param(
            f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {LIMIT + 1}\r\n\r\n{{".encode(),
            413, "BODY_TOO_LARGE", id="declared-body-over-the-limit",
        ),
        pytest.param(
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"400\r\n" + b"a" * 1024 + b"\r\n" for _ in range(5)) + b"0\r\n\r\n",
            413, "BODY_TOO_LARGE", id="chunked-body-over-the-limit",
        ),
        pytest.param(
            f"GET /{'a' * 5000} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), 414, "URI_TOO_LONG", id="request-line"
        ),
        pytest.param(
            f"GET / HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 9000}\r\n\r\n".encode(),
            431, "HEADERS_TOO_LARGE", id="a-header",
        ),
        pytest.param(
            b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % n for n in range(120)) + b"\r\n",
            431, "HEADERS_TOO_LARGE", id="too-many-headers",
        ),
        pytest.param(b"GARBAGE\r\n\r\n", 400, "BAD_REQUEST", id="not-http"),
        pytest.param(b"GET /fail HTTP/1.1\r\nHost: x\r\n\r\n", 500, "INTERNAL_ERROR", id="application-error"),
    ],
)  # fmt: skip
def test_what_the_worker_refuses_is_problem_json(
    servers: dict[str, Server], request_bytes: bytes, status: int, code: str
) -> None:
    answered, headers, body = exchange(servers["ours"].port, request_bytes)
    problem = json.loads(body)
    assert (answered, headers["content-type"], problem["code"], problem["status"]) == (
        status, ["application/problem+json"], code, status,
    )  # fmt: skip
    assert problem["type"] == f"/problems/{code.lower().replace('_', '-')}" and problem["detail"]


def test_a_streamed_answer_comes_chunk_by_chunk_on_the_application_thread_and_is_closed(
    servers: dict[str, Server],
) -> None:
    server = servers["ours"]
    server.closed.unlink(missing_ok=True)
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.request("GET", "/stream")
    response = connection.getresponse()
    arrived = []
    while line := response.readline():
        arrived.append((time.monotonic(), line.decode()))
    connection.close()
    assert [text.split(" on ")[0] for _, text in arrived] == ["chunk 0", "chunk 1", "chunk 2"]
    assert arrived[-1][0] - arrived[0][0] > 0.4  # each sent when made, not gathered first
    threads = {text.split(" on ")[1] for _, text in arrived}
    assert len(threads) == 1
    deadline = time.monotonic() + 5
    while not server.closed.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.closed.read_text() == "closed\n"


def test_one_application_thread_serves_every_request_and_connections_stay_open(
    servers: dict[str, Server],
) -> None:
    port = servers["ours"].port
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    seen, sockets = [], set()
    for _ in range(3):  # one connection, kept open
        connection.request("GET", "/kept")
        response = connection.getresponse()
        seen.append(json.loads(response.read())["thread"])
        sockets.add(connection.sock.getsockname() if connection.sock else None)
    connection.close()
    assert len(sockets) == 1 and None not in sockets, sockets
    seen += [
        echoed(port, b"GET /other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")["thread"] for _ in "ab"
    ]
    assert len(set(seen)) == 1, seen


def _calls_during_slow_clients(port: int, seconds: float) -> list[float | None]:
    """Plain GETs one after the other while 20 clients send bodies a byte every half second: each one's
    seconds, None when unanswered within a second and a half."""

    def head(n: int) -> bytes:
        return f"POST /slow-{n} HTTP/1.1\r\nHost: x\r\nContent-Length: 200\r\n\r\n".encode()

    latencies: list[float | None] = []
    with SlowClients(port, 20, head, b"a" * 200, pause=0.5):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            start = time.perf_counter()
            try:
                exchange_with_timeout(port, 1.5)
                latencies.append(time.perf_counter() - start)
            except TimeoutError:
                latencies.append(None)
    return latencies


def exchange_with_timeout(port: int, timeout: float) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", "/fast")
        assert connection.getresponse().status == 201
    finally:
        connection.close()


def test_clients_sending_slowly_cost_no_worker(servers: dict[str, Server]) -> None:
    latencies = _calls_during_slow_clients(servers["ours"].port, 3.0)
    assert len(latencies) >= 10 and all(x is not None and x < 1.0 for x in latencies), latencies


def test_negative_control_the_sync_worker_is_stalled_by_them(servers: dict[str, Server]) -> None:
    latencies = _calls_during_slow_clients(servers["sync"].port, 3.0)
    assert any(x is None or x > 1.0 for x in latencies), latencies


@pytest.mark.parametrize("worker_class", [OURS, "sync"])
def test_a_worker_stuck_in_a_request_is_replaced_after_the_timeout(worker_class: str, tmp_path: Path) -> None:
    """As gunicorn replaces a sync worker stuck in a request (the second case, the reference), ours stops its
    heartbeat when its application thread is stuck: the loop alone would keep it looking alive."""
    with served(worker_class, tmp_path, "--timeout", "2") as server:
        before = echoed(server.port, UP)["pid"]
        started = time.monotonic()
        try:  # the sync worker answers 500 as it dies; ours closes the connection
            status, _, _ = exchange(server.port, b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status == 500
        except (http.client.HTTPException, ConnectionError):
            pass
        assert time.monotonic() - started < 10
        deadline = time.monotonic() + 20
        while True:
            try:
                after = echoed(server.port, UP)["pid"]
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert after != before
