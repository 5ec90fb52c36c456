"""The pieces of the end-to-end fault tests: our real API (pytest-django's live server on the test database),
the provider simulator, the gateway client, a proxy that loses answers, and real Celery workers."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from django.db import connection
from django.utils import timezone
from tokenbudget_gateway.client import GatewayClient
from tokenbudget_gateway.provider import ChatProvider
from tokenbudget_gateway.transport import ApiClient, ApiResponse, RetryPolicy

from budgeting.catalog.models import ModelPool
from ledger.models import CapacityAccount, Reservation, State
from ledger.selectors import audit
from simulation.billing import BillingComparison
from simulation.provider import Simulator

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "budgeting" / "demo" / "demo.yaml"
TOKEN = "tb_demo_gateway_eu_0000000000000000"
PROVIDER_KEY = "sk-e2e"
# Answer headers the proxy sets itself rather than copying.
HOP_HEADERS = frozenset({"connection", "transfer-encoding", "content-length", "server", "date"})
FAST_RETRY = RetryPolicy(attempts=4, base_delay_s=0.05, max_delay_s=0.2, jitter=0.0)


def admission(request_id: str, *, max_output: int = 40, tenant: str = "t-19") -> dict[str, Any]:
    """A small contract-review request of the demo configuration (fits at FULL)."""
    return {
        "requestId": request_id,
        "tenantId": tenant,
        "taskClass": "contract-review",
        "modelPool": "eu-large",
        "modelRevision": "model@2026-07-01",
        "maxOutput": max_output,
        "components": {
            "immutableRules": ["Cite the evidence ids you use."],
            "authorizationScope": {"permissions": ["contracts:read"]},
            "outputSafety": ["No legal advice beyond the documents."],
            "question": {"text": f"Does clause 7 allow termination? ({request_id})"},
            "evidence": [
                {
                    "id": "e1",
                    "sourceId": "doc-1",
                    "text": "Clause 7: either party may terminate with 30 days notice.",
                    "score": 0.9,
                    "permissions": ["contracts:read"],
                    "minimumRetention": True,
                }
            ],
        },
    }


@dataclass
class Platform:
    """Our API at ``api_url`` (live server, real PostgreSQL, Redis) with the demo pools pointed at ``sim``."""

    api_url: str
    sim: Simulator
    requests: int = 0

    def api(self, base_url: str | None = None) -> ApiClient:
        return ApiClient(base_url or self.api_url, TOKEN, timeout_s=10, retry=FAST_RETRY)

    def gateway(
        self,
        *,
        api_url: str | None = None,
        provider_url: str | None = None,
        usage_every_chunks: int = 2,
        dispatch_at_admission: bool = True,
    ) -> GatewayClient:
        """The gateway client; ``dispatch_at_admission=False`` records the dispatch in a call of its own, as a
        gateway that dies between the two leaves a reservation never dispatched."""
        return GatewayClient(
            self.api(api_url),
            ChatProvider((provider_url or self.sim.base_url) + "/v1", PROVIDER_KEY, timeout_s=10),
            usage_every_chunks=usage_every_chunks,
            dispatch_at_admission=dispatch_at_admission,
        )

    def next_request(self, **kwargs: Any) -> tuple[dict[str, Any], str]:
        """A fresh admission body and its idempotency key."""
        self.requests += 1
        request_id = f"e2e-{self.requests}-{uuid.uuid4().hex[:8]}"
        return admission(request_id, **kwargs), f"idem-{request_id}"

    def get(self, reservation_id: str) -> dict[str, Any]:
        body = self.api().request("GET", f"/api/v1/reservations/{quote(reservation_id)}").body
        assert isinstance(body, dict)
        return body

    def post(self, reservation_id: str, action: str, body: dict[str, Any]) -> ApiResponse:
        return self.api().request("POST", f"/api/v1/reservations/{quote(reservation_id)}/{action}", body)


def reservation(reservation_id: str) -> Reservation:
    return Reservation.objects.get(pk=reservation_id)


def expire(*reservation_ids: str) -> None:
    """End leases now, as time would: the reclaimer compares with the database clock."""
    Reservation.objects.filter(pk__in=reservation_ids).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )


def expire_all() -> None:
    Reservation.objects.exclude(state__in=[State.SETTLED, State.REJECTED]).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )


def held(reservation_id: str) -> dict[str, int]:
    """What the reservation's accounts hold in total (the demo request holds on three accounts)."""
    accounts = CapacityAccount.objects.filter(holds__reservation_id=reservation_id)
    totals = {"input_reserved": 0, "output_reserved": 0, "input_consumed": 0, "in_flight": 0}
    for account in accounts:
        for name in totals:
            totals[name] += getattr(account, name)
    return totals


def settled_usage() -> dict[str, tuple[int, int]]:
    """``{provider request id: (input consumed, output captured + overrun)}`` of every settled dispatch."""
    return {
        provider_request_id: (input_consumed, captured + overrun)
        for provider_request_id, input_consumed, captured, overrun in Reservation.objects.filter(
            state=State.SETTLED
        )
        .exclude(provider_request_id="")
        .values_list("provider_request_id", "input_consumed", "captured", "overrun")
    }


def assert_clean(sim: Simulator) -> BillingComparison:
    """The issue's "after each": the audit finds nothing and what we settled is what the provider billed.

    Also: nothing is left open (every reservation reached a terminal state) and nothing billed is unsettled.
    """
    report = audit(timezone.now())
    assert report.violations == [] and report.leaks == [], (report.violations, report.leaks)
    open_states = list(
        Reservation.objects.exclude(state__in=[State.SETTLED, State.REJECTED]).values_list("pk", "state")
    )
    assert open_states == []
    comparison = sim.compare(settled_usage())
    assert comparison.mismatches == () and comparison.unsettled == (), comparison
    return comparison


def point_pools_at(base_url: str) -> None:
    ModelPool.objects.update(provider_base_url=base_url)


def run_in_threads(count: int, work: Callable[[int], Any], timeout: float = 60) -> list[Any]:
    """Run ``work(i)`` in ``count`` threads released together by a barrier; re-raise the first error."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait(timeout)
            results[index] = work(index)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish in time"
    if errors:
        raise errors[0]
    return results


def wait_for(condition: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


# -- a proxy that loses answers ----------------------------------------------------------------------------


@dataclass
class Forwarded:
    method: str
    path: str
    body: Any
    dropped: bool


@dataclass
class LossyProxy:
    """An HTTP proxy in front of our API. Every request is forwarded and answered, except that the answer
    to the first ``drops`` requests matching ``drop`` is lost: the request was applied upstream and the
    caller's connection is closed without a byte, exactly like a gateway losing a response."""

    upstream: str
    drop: Callable[[str, Any], bool]
    drops: int = 1
    seen: list[Forwarded] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _forward(
        self, method: str, path: str, headers: dict[str, str], data: bytes
    ) -> tuple[int, Any, bytes]:
        parts = urlsplit(self.upstream)
        upstream = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
        try:
            upstream.request(method, path, body=data or None, headers=headers)
            response = upstream.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            upstream.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._relay()

            def do_POST(self) -> None:
                self._relay()

            def _relay(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(data) if data else None
                keep = ("Authorization", "Content-Type", "Accept", "Idempotency-Key")
                headers = {name: self.headers[name] for name in keep if self.headers.get(name)}
                status, answer_headers, answer = proxy._forward(self.command, self.path, headers, data)
                with proxy._lock:
                    lose = proxy.drops > 0 and proxy.drop(self.path, body)
                    if lose:
                        proxy.drops -= 1
                    proxy.seen.append(Forwarded(self.command, self.path, body, lose))
                if lose:
                    self.close_connection = True
                    return
                self.send_response(status)
                for name, value in answer_headers:
                    if name.lower() not in HOP_HEADERS:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


# -- real Celery workers -----------------------------------------------------------------------------------


def database_url_for_subprocesses() -> str:
    """The URL of the database the tests run on (pytest-django's ``test_<name>``), for subprocesses."""
    settings = connection.settings_dict
    password = f":{quote(settings['PASSWORD'], safe='')}" if settings["PASSWORD"] else ""
    user = quote(settings["USER"], safe="")
    port = f":{settings['PORT']}" if settings["PORT"] else ""
    return f"postgres://{user}{password}@{settings['HOST']}{port}/{quote(settings['NAME'], safe='')}"


@dataclass
class CeleryWorker:
    """``celery -A budgeting worker --pool=solo`` consuming only ``queue``, on the test database and the
    real Redis broker. Its log goes to a file so that a full pipe can never block it."""

    queue: str
    name: str
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {
            **os.environ,
            "DATABASE_URL": database_url_for_subprocesses(),
            "DB_CONN_MAX_AGE": "0",
            **self.env,
        }
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable, "-m", "celery", "-A", "budgeting", "worker", "--pool=solo",
                    "-Q", self.queue, "-n", f"{self.name}@%h", "--loglevel=INFO",
                    "--without-gossip", "--without-mingle", "--without-heartbeat",
                ],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"celery worker exited with {self.process.returncode}:\n{self.text()}")
        return " ready." in self.text()

    def stop(self) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL of its session if it does not stop within 10 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)


@contextlib.contextmanager
def celery_workers(
    count: int, log_dir: Path, *, queue: str | None = None, env: dict[str, str] | None = None
) -> Iterator[tuple[str, list[CeleryWorker]]]:
    """Start ``count`` workers on ``queue`` (default: one of their own); yield (queue, workers) once all
    are ready. ``env`` adds to the workers' environment."""
    queue = queue or f"e2e-{uuid.uuid4().hex[:10]}"
    name = f"e2e-{uuid.uuid4().hex[:10]}"
    workers = [
        CeleryWorker(queue, f"{name}-{i}", log_dir / f"worker-{i}.log", dict(env or {})) for i in range(count)
    ]
    try:
        for worker in workers:
            worker.start()
        wait_for(lambda: all(w.ready() for w in workers), timeout=60, what="celery workers to be ready")
        yield queue, workers
    finally:
        for worker in workers:
            worker.stop()
