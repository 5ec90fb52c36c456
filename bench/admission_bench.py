"""Admission throughput on one hot tenant (ledger issue §5).

In one run, on the same PostgreSQL, with 8 concurrent clients:
  1. raw psycopg baseline: the same hot-row transaction shape as a reservation (insert the reservation row,
     conditional UPDATE of each of the three accounts, insert three ledger entries), hand-written SQL;
  2. the service layer: ``ledger.services.admission.reserve`` (Django ORM, retries, holds, entries);
  3. HTTP: ``POST /api/v1/admissions`` through gunicorn (render, count with a warm cache, ladder, manifest,
     reserve) with the demo configuration.
It prints admissions/s, p50/p99 latency and the ratios to the baseline, and checks there is no overspend.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/tokenbudget REDIS_URL=redis://127.0.0.1:6379/0 \
        .venv/bin/python bench/admission_bench.py [--seconds 8]

It works in its own database (``<name>_bench``), created and migrated here.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse, urlunparse

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = 8
TOKEN = "tb_demo_gateway_eu_0000000000000000"


def bench_database_url() -> str:
    base = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/tokenbudget")
    parsed = urlparse(base)
    return urlunparse(parsed._replace(path=parsed.path.rstrip("/") + "_bench"))


def prepared_django() -> str:
    """A fresh bench database with the demo configuration, and Django set up on it in this process; returns
    the database's URL."""
    url = bench_database_url()
    prepare(url)
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "budgeting.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    return url


def prepare(url: str) -> None:
    import psycopg

    parsed = urlparse(url)
    admin = urlunparse(parsed._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{parsed.path.lstrip("/")}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{parsed.path.lstrip("/")}"')
    env = {**os.environ, "DATABASE_URL": url}
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "-v0"], check=True, env=env, cwd=ROOT)
    subprocess.run(
        [*manage, "provision", "budgeting/demo/demo.yaml", "--yes"],
        check=True,
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )


def run_clients(seconds: float, call: Callable[[int, int], bool]) -> dict[str, float]:
    """Run ``call(client, n)`` from CLIENTS threads for ``seconds``; returns rate and latency percentiles."""
    latencies: list[list[float]] = [[] for _ in range(CLIENTS)]
    admitted = [0] * CLIENTS
    barrier = threading.Barrier(CLIENTS + 1)
    stop = threading.Event()

    def worker(i: int) -> None:
        barrier.wait()
        n = 0
        while not stop.is_set():
            start = time.perf_counter()
            ok = call(i, n)
            latencies[i].append(time.perf_counter() - start)
            admitted[i] += int(ok)
            n += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    barrier.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    flat = sorted(x for per in latencies for x in per)
    return {
        "admissions_per_s": round(sum(admitted) / elapsed, 1),
        "calls": len(flat),
        "p50_ms": round(statistics.median(flat) * 1000, 2),
        "p99_ms": round(flat[int(len(flat) * 0.99) - 1] * 1000, 2),
    }


RAW_INSERT = """
INSERT INTO ledger_reservation (
    id, tenant_id, task_class_id, model_pool_id, model_revision_id, request_id, idempotency_key,
    rendered_digest, admitted_digest, rung, mode, state, outcome, input_reserved, input_consumed,
    output_reserved, top_ups, captured, remaining, released, overrun, concurrency_held, provider_request_id,
    fence, failure_reason, minimum_evidence_ids, needs_person, provider_adapter, provider_endpoint,
    request_sent, input_cached, currency, input_price, cached_input_price, output_price, spend_reserved,
    spend_captured, spend_remaining, spend_released, spend_overrun, created_at, updated_at)
VALUES (%s, %s, %s, %s, %s, %s, %s, 'd', 'd', 'FULL', 'ENFORCE', 'RESERVED', '', 10, 0, 10, 0, 0, 10, 0, 0,
        true, '', 1, '', '[]', '', '', '', '', 0, 'USD', 1, 1, 1, 20, 0, 20, 0, 0, now(), now())
"""
RAW_UPDATE = """
UPDATE ledger_capacityaccount
   SET input_reserved = input_reserved + 10, output_reserved = output_reserved + 10,
       in_flight = in_flight + 1, spend_reserved = spend_reserved + 20
 WHERE id = %s AND (input_limit IS NULL OR input_reserved + input_consumed + 10 <= input_limit)
   AND (spend_limit IS NULL OR spend_reserved + spend_consumed + 20 <= spend_limit)
"""


def raw_baseline(
    url: str, seconds: float, account_ids: list[int], tenant: int, refs: dict[str, int]
) -> dict[str, float]:
    import psycopg

    conns = [psycopg.connect(url) for _ in range(CLIENTS)]

    def call(i: int, n: int) -> bool:
        conn = conns[i]
        with conn.transaction():
            rid = uuid.uuid4()
            key = f"raw-{i}-{n}-{time.monotonic_ns()}"  # unique across runs in one database
            conn.execute(RAW_INSERT, (rid, tenant, refs["task"], refs["pool"], refs["model"], key, key))
            for account in account_ids:
                cur = conn.execute(RAW_UPDATE, (account,))
                if cur.rowcount != 1:
                    raise RuntimeError("baseline ran out of capacity")
            for account in account_ids:
                conn.execute(
                    "INSERT INTO ledger_ledgerentry (account_id, reservation_id, kind, input_reserved,"
                    " output_reserved, input_consumed, output_consumed, in_flight, spend_reserved,"
                    " spend_consumed, period_start, reason, created_by, created_at)"
                    " VALUES (%s,%s,'HOLD',10,10,0,0,1,20,0,now(),'','',now())",
                    (account, rid),
                )
        return True

    try:
        return run_clients(seconds, call)
    finally:
        for conn in conns:
            conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


HOT_BODY = {
    "requestId": "",
    "tenantId": "t-internal",
    "taskClass": "support-chat",
    "modelPool": "eu-large",
    "modelRevision": "model@2026-07-01",
    "maxOutput": 200,
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


def http_throughput(base: str, seconds: float) -> dict[str, float]:
    """``POST /api/v1/admissions`` from CLIENTS threads against a running server at ``base``."""

    server = urlparse(base)
    host, port = server.hostname, server.port
    assert host is not None and port is not None

    def call(i: int, n: int) -> bool:
        # As the gateway client does (tokenbudget_gateway.transport): http.client, one connection a request.
        # urllib's openers and handlers cost this process, on the same two cores, ~1 ms of CPU a request.
        payload = dict(HOT_BODY, requestId=f"http-{i}-{n}-{time.monotonic_ns()}")
        connection = http.client.HTTPConnection(host, port, timeout=30)
        try:
            connection.request(
                "POST",
                "/api/v1/admissions",
                body=json.dumps(payload).encode(),
                headers={
                    "Authorization": f"Bearer {TOKEN}",
                    "Content-Type": "application/json",
                    "Idempotency-Key": str(payload["requestId"]),
                },
            )
            response = connection.getresponse()
            response.read()
            return response.status == 201
        finally:
            connection.close()

    call(0, -1)
    return run_clients(seconds, call)


def http_run(url: str, seconds: float) -> dict[str, float]:
    port = free_port()
    env = {**os.environ, "DATABASE_URL": url}
    server = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "gunicorn"),
            "budgeting.wsgi:application",
            "-b",
            f"127.0.0.1:{port}",
            "-w",
            os.environ.get("WEB_CONCURRENCY", str(min(8, 2 * (os.cpu_count() or 1)))),
            "--log-level",
            "warning",
        ],
        env=env,
        cwd=ROOT,
    )
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/", timeout=2).read()
                break
            except OSError:
                time.sleep(0.1)
        return http_throughput(f"http://127.0.0.1:{port}", seconds)
    finally:
        server.terminate()
        server.wait(timeout=10)


def hot_shape() -> tuple[list[int], int, dict[str, int]]:
    """The hot tenant's accounts (lock order), tenant id and catalog ids of the throughput runs; limits lifted
    (throughput, not admission control, is measured)."""
    from django.utils import timezone

    from budgeting.catalog.models import ModelPool, ModelRevision, TaskClass, Tenant
    from ledger.models import CapacityAccount
    from ledger.services import accounts as ledger_accounts

    tenant = Tenant.objects.get(slug="t-internal")
    task = TaskClass.objects.get(slug="support-chat")
    pool = ModelPool.objects.get(slug="eu-large")
    model = ModelRevision.objects.get(name="model@2026-07-01")
    accounts = ledger_accounts.applicable_accounts(
        tenant=tenant, task_class=task, pool=pool, now=timezone.now()
    )
    CapacityAccount.objects.update(concurrency_limit=None, input_limit=10**13, output_limit=10**12)
    return [a.pk for a in accounts], tenant.pk, {"task": task.pk, "pool": pool.pk, "model": model.pk}


def service_throughput(seconds: float) -> dict[str, float]:
    """``ledger.services.admission.reserve`` from CLIENTS threads, the hot shape."""
    from django.utils import timezone

    from budgeting.catalog.models import ModelPool, ModelRevision, TaskClass, Tenant
    from budgeting.catalog.prices import price_at
    from ledger.services import admission as ledger_admission

    tenant = Tenant.objects.get(slug="t-internal")
    task = TaskClass.objects.get(slug="support-chat")
    pool = ModelPool.objects.get(slug="eu-large")
    model = ModelRevision.objects.get(name="model@2026-07-01")
    # The demo's t-internal has a spend limit: the hold is priced at the price in force, as the orchestrator
    # prices it.
    price = price_at(model, timezone.now())

    def service_call(i: int, n: int) -> bool:
        key = f"svc-{i}-{n}-{time.monotonic_ns()}"
        spec = ledger_admission.AdmissionSpec(
            tenant=tenant,
            task_class=task,
            pool=pool,
            model_revision=model,
            request_id=key,
            idempotency_key=key,
            rendered_digest="sha256:" + "a" * 64,
            admitted_digest="sha256:" + "a" * 64,
            input_tokens=10,
            output_tokens=10,
            policy_revision=18,
            rung="FULL",
            manifest_id=None,
            price=price,
        )
        return not ledger_admission.reserve(spec=spec, build_body=lambda r: {}, now=timezone.now()).replayed

    return run_clients(seconds, service_call)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    url = prepared_django()
    from budgeting.catalog.models import Tenant
    from ledger.models import CapacityAccount, Reservation
    from ledger.selectors import audit

    account_ids, tenant_id, refs = hot_shape()
    raw = raw_baseline(url, args.seconds, account_ids, tenant_id, refs)
    service = service_throughput(args.seconds)
    http = http_run(url, args.seconds)

    tenant = Tenant.objects.get(pk=tenant_id)
    report = audit(account_ids=account_ids)
    tenant_account = CapacityAccount.objects.get(scope="TENANT", tenant=tenant)
    overspent = tenant_account.input_limit is not None and (
        tenant_account.input_reserved + tenant_account.input_consumed > tenant_account.input_limit
    )
    print(
        json.dumps(
            {
                "clients": CLIENTS,
                "raw_psycopg": raw,
                "service_layer": service,
                "http_gunicorn": http,
                "service_over_raw": round(service["admissions_per_s"] / raw["admissions_per_s"], 3),
                "http_over_raw": round(http["admissions_per_s"] / raw["admissions_per_s"], 3),
                "target": "service_over_raw >= 0.5",
                "reservations": Reservation.objects.count(),
                "audit_ok": report.ok,
                "overspend": overspent,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
