"""No client can starve the API (issue 22 §3): against the real launcher, whose nginx front reads every
request whole before gunicorn sees it, 50 clients sending their bodies a byte a second cost the gateway
nothing (its p99 stays under a second); the same clients sent straight to gunicorn stall it (the negative
control). The front also bounds what a request may be: a body over MAX_REQUEST_BYTES is 413 and oversized
headers 431, problem+json both."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from budgeting.launcher import front
from tests.launcher.harness import DEMO_TOKEN, Launcher, running_launcher

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        front.nginx_binary() is None,
        reason="nginx is not installed (apt-get install nginx; .ci/run installs it): the front is what this "
        "proves, and without it ./platform run serves gunicorn alone",
    ),
]

SLOW_CLIENTS = 50
GATEWAY_SECONDS = 10.0
BODY = json.dumps(
    {
        "requestId": "slow",
        "tenantId": "t-internal",
        "taskClass": "support-chat",
        "modelPool": "eu-large",
        "modelRevision": "model@2026-07-01",
        "maxOutput": 100,
        "components": {
            "immutableRules": ["Be brief."],
            "authorizationScope": {"permissions": ["kb:read"]},
            "question": {"text": "How do I reset my password?"},
            "evidence": [
                {
                    "id": "kb1",
                    "sourceId": "kb",
                    "text": "Use the reset link on the login page.",
                    "score": 1.0,
                    "permissions": ["kb:read"],
                }
            ],
        },
    }
).encode()


@pytest.fixture(scope="module")
def launcher() -> Iterator[Launcher]:
    with running_launcher(WEB_CONCURRENCY="2") as launcher:
        yield launcher


class SlowClients:
    """``SLOW_CLIENTS`` connections, each sending a whole request's headers and then its body a byte a second
    (the body is long enough to outlast the measurement)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.connected = threading.Semaphore(0)
        self.threads = [
            threading.Thread(target=self.run, args=(n,), daemon=True) for n in range(SLOW_CLIENTS)
        ]

    def run(self, n: int) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as sock:
            head = (
                "POST /api/v1/admissions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {DEMO_TOKEN}\r\nContent-Type: application/json\r\n"
                f"Idempotency-Key: slow-{n}-{time.time_ns()}\r\n"
                f"Content-Length: {len(BODY)}\r\n\r\n"
            )
            sock.sendall(head.encode())
            self.connected.release()
            for byte in BODY:
                if self.stop.wait(1.0):
                    return
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    return

    def __enter__(self) -> SlowClients:
        for thread in self.threads:
            thread.start()
        for _ in self.threads:
            assert self.connected.acquire(timeout=30), "a slow client could not connect"
        time.sleep(2)  # every slow client has begun its body
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)


def gateway_calls(port: int, seconds: float, timeout: float) -> list[float | None]:
    """A gateway admitting and releasing (cancel) one call after the other for ``seconds``: each call's
    seconds, None when it got no answer within ``timeout``."""
    latencies: list[float | None] = []
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        n += 1
        key = f"gateway-{n}-{time.time_ns()}"
        admitted = timed_post(
            port, "/api/v1/admissions", {**json.loads(BODY), "requestId": key}, timeout, key
        )
        latencies.append(None if admitted is None else admitted[0])
        if admitted is None:
            continue
        answer: dict[str, Any] = admitted[1]
        path = f"/api/v1/reservations/{answer['reservationId']}/cancel"
        cancelled = timed_post(port, path, {"fence": answer["lease"]["fence"]}, timeout)
        latencies.append(None if cancelled is None else cancelled[0])
    return latencies


def timed_post(
    port: int, path: str, body: dict[str, Any], timeout: float, key: str | None = None
) -> tuple[float, dict[str, Any]] | None:
    """(seconds, answer) of one POST, None without an answer within ``timeout``; any refusal fails."""
    headers = {"Authorization": f"Bearer {DEMO_TOKEN}", "Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.perf_counter()
    try:
        connection.request("POST", path, body=json.dumps(body).encode(), headers=headers)
        response = connection.getresponse()
        answer = response.read()
        assert response.status in (200, 201), (response.status, answer[:300])
        return time.perf_counter() - start, json.loads(answer)
    except TimeoutError:
        return None
    finally:
        connection.close()


def upstream_port(launcher: Launcher) -> int:
    found = re.search(r"before gunicorn on 127\.0\.0\.1:(\d+)", launcher.output())
    assert found, launcher.output()[-3000:]
    return int(found.group(1))


def test_fifty_slow_clients_leave_the_gateways_p99_under_a_second(launcher: Launcher) -> None:
    gateway_calls(launcher.port, 1.0, timeout=10)  # every worker warm
    with SlowClients(launcher.port):
        latencies = gateway_calls(launcher.port, GATEWAY_SECONDS, timeout=10)
    answered = sorted(x for x in latencies if x is not None)
    assert len(answered) == len(latencies) >= 20, latencies
    p50, p99 = answered[len(answered) // 2], answered[max(0, int(len(answered) * 0.99) - 1)]
    print(
        f"\n{SLOW_CLIENTS} slow clients through the front: {len(answered)} calls (admit, cancel), "
        f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max {answered[-1] * 1000:.0f} ms"
    )
    assert p99 < 1.0, answered[-5:]


def test_without_the_front_the_same_clients_stall_gunicorn(launcher: Launcher) -> None:
    """The negative control: straight to gunicorn's own port, its two sync workers read the slow bodies."""
    port = upstream_port(launcher)
    with SlowClients(port):
        latencies = gateway_calls(port, 6.0, timeout=3)
    slow = [x for x in latencies if x is None or x > 1.0]
    print(f"\nstraight to gunicorn: {len(latencies)} calls, {len(slow)} over a second or unanswered in 3 s")
    assert slow, latencies


def raw_answer(port: int, request: bytes) -> tuple[int, str, dict[str, object]]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers.get("Content-Type", ""), json.loads(body)


def test_a_body_over_the_limit_is_413_oversized_headers_431_and_a_long_line_414(launcher: Launcher) -> None:
    too_long = front.DEFAULT_MAX_REQUEST_BYTES + 1
    status, content_type, body = raw_answer(
        launcher.port,
        f"POST /api/v1/admissions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {too_long}\r\nConnection: close\r\n\r\n".encode(),
    )
    assert (status, content_type, body["code"]) == (413, "application/problem+json", "BODY_TOO_LARGE"), body
    status, content_type, body = raw_answer(
        launcher.port,
        f"GET /api/v1/ HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 40_000}\r\nConnection: close\r\n\r\n".encode(),
    )
    expected = (431, "application/problem+json", "HEADERS_TOO_LARGE")
    assert (status, content_type, body["code"]) == expected, body
    # Within the front's limits but over gunicorn's own (4 KiB a request line, 8 KiB a header): answered as
    # the front's problem.
    status, content_type, body = raw_answer(
        launcher.port,
        f"GET /api/v1/{'a' * 10_000} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode(),
    )
    assert (status, content_type, body["code"]) == (414, "application/problem+json", "URI_TOO_LONG"), body
    status, content_type, body = raw_answer(
        launcher.port,
        f"GET /api/v1/ HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 10_000}\r\nConnection: close\r\n\r\n".encode(),
    )
    assert (status, content_type, body["code"]) == expected, body
    # Over the front's own line buffer (16 KiB).
    status, content_type, body = raw_answer(
        launcher.port,
        f"GET /api/v1/{'a' * 20_000} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode(),
    )
    assert (status, content_type, body["code"]) == (414, "application/problem+json", "URI_TOO_LONG"), body


def test_gunicorn_alone_answers_what_it_refuses_in_problem_json_whose_type_resolves(
    launcher: Launcher,
) -> None:
    """Without the front (nginx not installed), gunicorn's own refusals are problems too, not its HTML."""
    port = upstream_port(launcher)
    for request, status, code in (
        (f"GET /api/v1/{'a' * 10_000} HTTP/1.1\r\nHost: x\r\n\r\n", 414, "URI_TOO_LONG"),
        (f"GET /api/v1/ HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 10_000}\r\n\r\n", 431, "HEADERS_TOO_LARGE"),
        ("GET /api/v1/ HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n", 400, "BAD_REQUEST"),
    ):
        answered, content_type, body = raw_answer(port, request.encode())
        assert (answered, content_type, body["code"], body["status"]) == (
            status,
            "application/problem+json",
            code,
            status,
        ), body
        page = urllib.request.urlopen(f"http://127.0.0.1:{launcher.port}{body['type']}", timeout=10)
        assert page.status == 200 and code in page.read().decode()
