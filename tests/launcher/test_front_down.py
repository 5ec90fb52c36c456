"""While gunicorn is down or restarting, the nginx front answers what the API itself would while a
dependency is down: 503 problem+json with Retry-After — never nginx's own 502 (an ``error_page`` into a named
location keeps the upstream's status unless it says ``=503``; the chaos run caught a 502)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from budgeting.launcher import front
from tests.launcher.test_slow_clients import raw_answer
from tests.ports import free_port

pytestmark = pytest.mark.skipif(
    front.nginx_binary() is None,
    reason="nginx is not installed (apt-get install nginx; .ci/run installs it): the front is what it proves",
)


@pytest.fixture
def front_without_upstream(tmp_path: Path) -> Iterator[int]:
    """A real nginx front whose gunicorn port has nothing listening (a worker killed, a restart under way)."""
    port, upstream = free_port(), free_port()
    binary = front.nginx_binary()
    assert binary is not None
    process = subprocess.Popen(front.argv(binary, front.prepare(tmp_path / "front", port, upstream)))
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None, "nginx did not start"
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_front_whose_gunicorn_is_down_answers_503_problem_json_with_retry_after(
    front_without_upstream: int,
) -> None:
    with socket.create_connection(("127.0.0.1", front_without_upstream), timeout=10) as sock:
        sock.sendall(b"GET /api/v1/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head = sock.recv(65536).partition(b"\r\n\r\n")[0].decode().lower()
    assert "retry-after: 1" in head.split("\r\n"), head
    status, content_type, body = raw_answer(
        front_without_upstream, b"GET /api/v1/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert (status, content_type, body["code"]) == (503, "application/problem+json", "SERVICE_UNAVAILABLE")
