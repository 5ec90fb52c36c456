"""What every call of the protocol costs, not only the admission (issue 22 §2), each figure with its baseline.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/tokenbudget REDIS_URL=redis://127.0.0.1:6379/0 \
        .venv/bin/python bench/lifecycle_bench.py [--cycles 60] [--seconds 6] [--reuse-large] [--blocks 30]

Two databases, each created, migrated and provisioned with the demo here: ``<name>_bench`` with 10,000
settled reservations and 50,000 ledger entries on the hot tenant, and ``<name>_bench_large`` with 1,000,000
and 5,000,000 (written by ``generate_series`` in a few statements, then analysed; ``--reuse-large`` keeps a
large database an earlier run built). One gunicorn serves each, as ``./platform run`` starts it. In one run:
  - one client, over HTTP (``http.client``, one connection a call, as the gateway client does): the p50 of
    every lifecycle call — lease, top-up, dispatch, usage, final usage, cancel, fail — against the p50 of the
    small admission measured in the same cycles (a cycle admits, then makes each call once, on the small and
    then the large database, so a machine whose speed drifts moves every figure alike);
  - the same p50s with the large database against the small one (flat in data: ≤ 1.2);
  - admit + release (cancel) pairs/s over HTTP with 8 clients against the raw psycopg transactions of the
    same shape (the reservation with its holds and entries, then the release of it), in two alternated rounds;
  - EXPLAIN (ANALYZE, BUFFERS) of every statement a lifecycle call and the admission run, on both databases
    (in-process, ``--explain`` cycles, each statement's copy rolled back just before it runs): its median
    execution time, small and large, and its scans (a sequential scan of a table that grows with traffic is
    reported);
  - the pages each call touches and reads outside shared buffers, on both databases (in-process, ``--blocks``
    cycles, from PostgreSQL's statistics of the database's own tables and indexes): a count that a shared,
    loaded machine does not blur as it blurs a 1.2x in time. A read is a page the call found in no buffer —
    a system call, and the eviction of another page (written out first when dirty).
The audit of the small database must be clean at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

import admission_bench
from admission_bench import CLIENTS, HOT_BODY, RAW_INSERT, RAW_UPDATE, TOKEN, prepare, run_clients
from path_bench import serve

ROOT = Path(__file__).resolve().parent.parent
SMALL, LARGE = (10_000, 50_000), (1_000_000, 5_000_000)
CALLS = ("admit", "lease", "top-up", "dispatch", "usage", "usage-final", "cancel", "fail")
# Tables whose size grows with traffic: a sequential scan of one is a plan that is not flat in data.
GROWING = ("ledger_reservation", "ledger_ledgerentry", "ledger_hold", "ledger_usageevent", "ledger_topup")


def database(suffix: str) -> str:
    parsed = urlparse(admission_bench.bench_database_url())
    return urlunparse(parsed._replace(path=parsed.path + suffix))


def exists(url: str, size: int) -> bool:
    import psycopg

    try:
        with psycopg.connect(url) as conn:
            row = conn.execute("SELECT count(*) FROM ledger_reservation").fetchone()
            return row is not None and int(row[0]) >= size
    except psycopg.OperationalError:
        return False


def fill(url: str, reservations: int, entries: int) -> float:
    """Settled reservations of the hot tenant, ``entries / reservations`` zero-amount entries each (balances
    stay the sums of their entries) spread over its accounts; then VACUUM ANALYZE. Returns the seconds."""
    import psycopg

    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        ids = conn.execute(
            """SELECT t.id, k.id, p.id, m.id
                 FROM budgeting_tenant t, budgeting_taskclass k, budgeting_modelpool p,
                      budgeting_modelrevision m
                WHERE t.slug = 't-internal' AND k.slug = 'support-chat' AND p.slug = 'eu-large'
                  AND m.name = 'model@2026-07-01'"""
        ).fetchone()
        assert ids is not None, "the demo's hot tenant, task class, pool and model"
        tenant, task, pool, model = ids
        accounts = [
            row[0]
            for row in conn.execute(
                "SELECT id FROM ledger_capacityaccount WHERE tenant_id = %s OR tenant_id IS NULL ORDER BY id",
                (tenant,),
            )
        ]
        conn.execute("SET synchronous_commit = off")
        conn.execute(
            """
            INSERT INTO ledger_reservation (
                id, tenant_id, task_class_id, model_pool_id, model_revision_id, request_id, idempotency_key,
                rendered_digest, admitted_digest, rung, mode, state, outcome, input_reserved, input_consumed,
                output_reserved, top_ups, captured, remaining, released, overrun, concurrency_held,
                provider_request_id, fence, failure_reason, minimum_evidence_ids, needs_person,
                provider_adapter, provider_endpoint, request_sent, created_at, updated_at, dispatched_at,
                settled_at, lease_expires_at, currency, input_price, cached_input_price, output_price,
                input_cached, spend_reserved, spend_captured, spend_remaining, spend_released, spend_overrun)
            SELECT gen_random_uuid(), %s, %s, %s, %s, 'bulk-' || g, 'bulk-' || g, 'd', 'd', 'FULL', 'ENFORCE',
                   'SETTLED', 'COMPLETED', 10, 10, 10, 0, 10, 0, 0, 0, false, 'bulk-prov-' || g, 1, '', '[]',
                   '', 'simulator', '', '', at, at, at, at, at, '', 0, 0, 0, 0, 0, 0, 0, 0, 0
              FROM generate_series(1, %s) AS g, LATERAL (SELECT now() - g * interval '1 second' AS at) AS t
            """,
            (tenant, task, pool, model, reservations),
        )
        conn.execute(
            """
            INSERT INTO ledger_ledgerentry (account_id, reservation_id, kind, input_reserved, output_reserved,
                input_consumed, output_consumed, in_flight, spend_reserved, spend_consumed, period_start,
                reason, created_by, created_at)
            SELECT a.id, r.id, (ARRAY['HOLD', 'POST', 'POST', 'RELEASE', 'CORRECTION'])[1 + k %% 5],
                   0, 0, 0, 0, 0, 0, 0, a.period_start, 'bulk', '', r.created_at
              FROM (SELECT id, created_at, row_number() OVER () AS n FROM ledger_reservation
                     WHERE request_id LIKE 'bulk-%%') AS r,
                   generate_series(0, %s - 1) AS k,
                   LATERAL (SELECT id, period_start FROM ledger_capacityaccount
                             WHERE id = (%s::bigint[])[1 + (r.n + k) %% %s]) AS a
            """,
            (entries // reservations, accounts, len(accounts)),
        )
        conn.execute(HOLDS, (accounts[:3],))
        conn.execute("VACUUM ANALYZE")
    return time.perf_counter() - started


# A reservation keeps its holds (one per account it held on, three here) after it settles: the bulk ones too,
# so that the look-up of a reservation's holds is planned on a table of the large database's size.
HOLDS = """
INSERT INTO ledger_hold (reservation_id, account_id)
SELECT r.id, a FROM ledger_reservation r, unnest(%s::bigint[]) AS a WHERE r.request_id LIKE 'bulk-%%'
"""


class Client:
    """HTTP calls against one server, one connection a call."""

    def __init__(self, base: str) -> None:
        server = urlparse(base)
        self.host, self.port = server.hostname or "127.0.0.1", server.port

    def post(self, path: str, body: bytes, key: str | None = None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        if key:
            headers["Idempotency-Key"] = key
        connection = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            connection.request("POST", path, body=body, headers=headers)
            response = connection.getresponse()
            answer = response.read()
        finally:
            connection.close()
        if response.status >= 300:
            raise RuntimeError(f"POST {path}: {response.status} {answer[:300]!r}")
        return dict(json.loads(answer))


def cycle(client: Client, tag: str, times: dict[str, list[float]]) -> None:
    """One admission and each lifecycle call once, each timed (its body encoded before the clock)."""

    def timed(name: str, path: str, body: dict[str, Any], key: str | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode()
        start = time.perf_counter()
        answer = client.post(path, data, key)
        times[name].append(time.perf_counter() - start)
        return answer

    def admit(suffix: str) -> tuple[str, dict[str, Any]]:
        key = f"{tag}-{suffix}"
        answer = timed("admit", "/api/v1/admissions", {**HOT_BODY, "requestId": key}, key)
        return f"/api/v1/reservations/{answer['reservationId']}", answer

    base, admitted = admit("a")
    timed("lease", f"{base}/lease", {"fence": 1})
    timed("top-up", f"{base}/top-up", {"fence": 1, "topUpId": "t1", "outputTokens": 10})
    dispatch = {"fence": 1, "providerRequestId": f"p-{tag}", "admittedDigest": admitted["admittedDigest"]}
    timed("dispatch", f"{base}/dispatch", dispatch)
    timed("usage", f"{base}/usage", {"fence": 1, "usageEventId": "u1", "outputTokens": 5, "final": False})
    final = {"fence": 1, "usageEventId": "u2", "outputTokens": 5, "final": True}
    timed("usage-final", f"{base}/usage", final)
    base, _ = admit("c")
    timed("cancel", f"{base}/cancel", {"fence": 1})
    base, admitted = admit("f")
    dispatch = {"fence": 1, "providerRequestId": f"pf-{tag}", "admittedDigest": admitted["admittedDigest"]}
    client.post(f"{base}/dispatch", json.dumps(dispatch).encode())
    timed("fail", f"{base}/fail", {"fence": 1, "reason": "connection refused", "requestSent": False})


RAW_LOCK = "SELECT fence, state FROM ledger_reservation WHERE id = %s FOR UPDATE"
RAW_RELEASE = """
UPDATE ledger_capacityaccount
   SET input_reserved = input_reserved - 10, output_reserved = output_reserved - 10,
       in_flight = in_flight - 1, spend_reserved = spend_reserved - 20
 WHERE id = %s
"""
RAW_SETTLE = """
UPDATE ledger_reservation SET state = 'SETTLED', outcome = 'RELEASED', remaining = 0, released = 10,
       spend_remaining = 0, spend_released = 20, concurrency_held = false, settled_at = now(),
       updated_at = now()
 WHERE id = %s
"""
RAW_ENTRY = """
INSERT INTO ledger_ledgerentry (account_id, reservation_id, kind, input_reserved, output_reserved,
    input_consumed, output_consumed, in_flight, spend_reserved, spend_consumed, period_start, reason,
    created_by, created_at)
VALUES (%s, %s, %s, %s, %s, 0, 0, %s, %s, 0, now(), '', '', now())
"""


def raw_pairs(url: str, seconds: float, account_ids: list[int], tenant: int, refs: dict[str, int]) -> float:
    """Admit + release as hand-written psycopg transactions: the reservation, its accounts and entries; then
    the locked row, the accounts' release, its entries and the settled row. Returns pairs/s."""
    import psycopg

    conns = [psycopg.connect(url) for _ in range(CLIENTS)]

    def call(i: int, n: int) -> bool:
        conn = conns[i]
        rid = uuid.uuid4()
        key = f"rawpair-{i}-{n}-{time.monotonic_ns()}"
        with conn.transaction():
            conn.execute(RAW_INSERT, (rid, tenant, refs["task"], refs["pool"], refs["model"], key, key))
            for account in account_ids:
                if conn.execute(RAW_UPDATE, (account,)).rowcount != 1:
                    raise RuntimeError("baseline ran out of capacity")
            for account in account_ids:
                conn.execute(RAW_ENTRY, (account, rid, "HOLD", 10, 10, 1, 20))
        with conn.transaction():
            conn.execute(RAW_LOCK, (rid,)).fetchone()
            for account in account_ids:
                conn.execute(RAW_RELEASE, (account,))
            for account in account_ids:
                conn.execute(RAW_ENTRY, (account, rid, "RELEASE", -10, -10, -1, -20))
            conn.execute(RAW_SETTLE, (rid,))
        return True

    try:
        return run_clients(seconds, call)["admissions_per_s"]
    finally:
        for conn in conns:
            conn.close()


def http_pairs(base: str, seconds: float) -> float:
    """``POST /admissions`` then ``POST …/cancel`` from CLIENTS threads. Returns pairs/s."""
    client = Client(base)

    def call(i: int, n: int) -> bool:
        key = f"pair-{i}-{n}-{time.monotonic_ns()}"
        body = json.dumps({**HOT_BODY, "requestId": key}).encode()
        admitted = client.post("/api/v1/admissions", body, key)
        cancel = json.dumps({"fence": admitted["lease"]["fence"]}).encode()
        return (
            client.post(f"/api/v1/reservations/{admitted['reservationId']}/cancel", cancel)["state"]
            == "SETTLED"
        )

    call(0, -1)
    return run_clients(seconds, call)["admissions_per_s"]


def child(url: str, *args: str) -> list[str]:
    """Run this file with ``args`` in a child process on ``url`` (in-process Django); returns its lines."""
    result = subprocess.run(
        [sys.executable, __file__, *args],
        env={**os.environ, "DATABASE_URL": url},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return result.stdout.splitlines()


def explain(url: str, cycles: int) -> dict[str, list[Any]]:
    """Per statement of an admission and of each lifecycle call on ``url``: its plan's scans and its median
    execution time in ms (``explain_here``)."""
    return dict(json.loads(child(url, "--explain-only", str(cycles))[-1]))


def blocks(url: str, cycles: int) -> dict[str, list[float]]:
    """Per call, the mean pages touched and read outside shared buffers on ``url`` (``blocks_here``)."""
    return dict(json.loads(child(url, "--blocks-only", str(cycles))[-1]))


Post = Callable[..., dict[str, Any]]


def in_process() -> tuple[Any, Post, list[str]]:
    """Django set up on DATABASE_URL in this process: its connection, a ``post(name, path, body, key)``
    through Django's test client, and the name of the call being made (``current[0]``)."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "budgeting.settings")
    sys.path.insert(0, str(ROOT))
    django.setup()
    from django.db import connection
    from django.test import Client as DjangoClient

    client = DjangoClient(HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    current = ["?"]

    def post(name: str, path: str, body: dict[str, Any], key: str | None = None) -> dict[str, Any]:
        current[0] = name
        if key:
            res = client.post(path, body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key)
        else:
            res = client.post(path, body, content_type="application/json")
        assert res.status_code in (200, 201), res.content[:300]
        return dict(res.json())

    return connection, post, current


def in_process_cycle(post: Post, tag: str) -> None:
    """An admission and each lifecycle call once, then a second admission, cancelled, and a third, dispatched
    and failed."""
    admitted = post("admit", "/api/v1/admissions", {**HOT_BODY, "requestId": tag}, tag)
    base = f"/api/v1/reservations/{admitted['reservationId']}"
    post("lease", f"{base}/lease", {"fence": 1})
    post("top-up", f"{base}/top-up", {"fence": 1, "topUpId": "t1", "outputTokens": 10})
    dispatch = {"fence": 1, "providerRequestId": f"p-{tag}", "admittedDigest": admitted["admittedDigest"]}
    post("dispatch", f"{base}/dispatch", dispatch)
    post("usage", f"{base}/usage", {"fence": 1, "usageEventId": "u1", "outputTokens": 5, "final": False})
    post("usage-final", f"{base}/usage", {"fence": 1, "usageEventId": "u2", "outputTokens": 5, "final": True})
    other = post("admit", "/api/v1/admissions", {**HOT_BODY, "requestId": tag + "c"}, tag + "c")
    post("cancel", f"/api/v1/reservations/{other['reservationId']}/cancel", {"fence": 1})
    # The refund's statement reads what the reservation posted into each account's period.
    failed = post("admit", "/api/v1/admissions", {**HOT_BODY, "requestId": tag + "f"}, tag + "f")
    base = f"/api/v1/reservations/{failed['reservationId']}"
    dispatch = {"fence": 1, "providerRequestId": f"pf-{tag}", "admittedDigest": failed["admittedDigest"]}
    post("dispatch", f"{base}/dispatch", dispatch)
    post("fail", f"{base}/fail", {"fence": 1, "reason": "connection refused", "requestSent": False})


def explain_here(cycles: int) -> None:
    """In this process (Django set up on DATABASE_URL): run ``cycles`` cycles through Django's test client,
    and before every statement runs, EXPLAIN (ANALYZE, BUFFERS) it in a transaction (or savepoint) rolled
    back. Prints one JSON object: per statement (its call and first words), its plan's scans and the median
    of its execution times."""
    import psycopg

    connection, post, current = in_process()
    # After Django's setup (in_process): the ledger's statements import its models.
    from ledger.statements import CATALOG_MOVED_SQLSTATE, CHANGED_SQLSTATE, REFUSED_SQLSTATE

    refusals = {CATALOG_MOVED_SQLSTATE, CHANGED_SQLSTATE, REFUSED_SQLSTATE}
    scans: dict[str, list[str]] = {}
    times: dict[str, list[float]] = {}

    def keep(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        if not many and sql.lstrip().upper().startswith(("SELECT", "UPDATE", "INSERT", "WITH", "DELETE")):
            raw = connection.connection
            try:
                with raw.transaction(force_rollback=True):
                    plan = [row[0] for row in raw.execute(f"EXPLAIN (ANALYZE, BUFFERS) {sql}", params)]
            except psycopg.DatabaseError as error:
                # The statement refuses by its own check (a catalog version it compares has moved: the call
                # reads the version and makes it again): nothing to explain of this run of it; it runs as it
                # would. Any other error is the bench's.
                if error.sqlstate not in refusals:
                    raise
                return execute(sql, params, many, context)
            key = f"{current[0]:12} {' '.join(sql.split()[:3])[:40]:40}"
            nodes = {re.sub(r"^\s*(->\s*)?", "", line).split("  (")[0] for line in plan if "Scan " in line}
            scans.setdefault(key, sorted(nodes))
            elapsed = next(line for line in plan if line.startswith("Execution Time"))
            times.setdefault(key, []).append(float(elapsed.split()[2]))
        return execute(sql, params, many, context)

    warm = f"explain-warm-{time.time_ns()}"
    post("admit", "/api/v1/admissions", {**HOT_BODY, "requestId": warm}, warm)
    with connection.execute_wrapper(keep):
        for n in range(cycles):
            in_process_cycle(post, f"explain-{time.time_ns()}-{n}")
    print(json.dumps({key: [scans[key], statistics.median(times[key])] for key in scans}))


# The pages of this database's tables and indexes a call found in shared buffers (hit) and had to read
# (read: from the OS, evicting another page, written out first when dirty), as PostgreSQL counts them.
BLOCKS = """
SELECT sum(heap_blks_hit + idx_blks_hit + coalesce(toast_blks_hit, 0) + coalesce(tidx_blks_hit, 0)),
       sum(heap_blks_read + idx_blks_read + coalesce(toast_blks_read, 0) + coalesce(tidx_blks_read, 0))
  FROM pg_statio_user_tables
"""


def blocks_here(cycles: int) -> None:
    """In this process: ``cycles`` in-process cycles after five to warm up; prints, as one JSON object, the
    mean pages each call touched and read outside shared buffers (its backend's statistics flushed after
    each call)."""
    connection, post, _ = in_process()

    def counted() -> tuple[int, int]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_force_next_flush()")  # flushed once this statement's xact ends
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(BLOCKS)
            hit, read = cursor.fetchone()
        return int(hit), int(read)

    touched: dict[str, list[int]] = {}
    read: dict[str, list[int]] = {}

    def measured(name: str, path: str, body: dict[str, Any], key: str | None = None) -> dict[str, Any]:
        before = counted()
        answer = post(name, path, body, key)
        after = counted()
        touched.setdefault(name, []).append(after[0] + after[1] - before[0] - before[1])
        read.setdefault(name, []).append(after[1] - before[1])
        return answer

    run = time.time_ns()
    for n in range(5):
        in_process_cycle(post, f"blocks-warm-{run}-{n}")
    for n in range(cycles):
        in_process_cycle(measured, f"blocks-{run}-{n}")
    mean = statistics.mean
    print(json.dumps({name: [mean(touched[name]), mean(read[name])] for name in touched}))


# As ``admission_bench.hot_shape`` lifts them on the small database: a failed call keeps its slot held.
LIFT_LIMITS = (
    "UPDATE ledger_capacityaccount SET concurrency_limit = NULL, input_limit = 10000000000000,"
    " output_limit = 1000000000000"
)


def p50(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=60)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--reuse-large", action="store_true")
    parser.add_argument("--scale", type=float, default=1.0, help="of the large database (a quick look: 0.05)")
    parser.add_argument("--blocks", type=int, default=30, help="in-process cycles counting pages")
    parser.add_argument("--explain", type=int, default=10, help="in-process cycles explained (ANALYZE)")
    parser.add_argument("--explain-only", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--blocks-only", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.explain_only:
        explain_here(args.explain_only)
        return
    if args.blocks_only:
        blocks_here(args.blocks_only)
        return
    small_url, large_url = database(""), database("_large")
    large = (int(LARGE[0] * args.scale), int(LARGE[1] * args.scale))
    prepare(small_url)
    filled = {"small": fill(small_url, *SMALL)}
    if not (args.reuse_large and exists(large_url, large[0])):
        prepare(large_url)
        filled["large"] = fill(large_url, *large)
    else:
        # A large database an earlier run built: brought to this code's migrations.
        manage = [sys.executable, str(ROOT / "manage.py"), "migrate", "-v0"]
        subprocess.run(manage, check=True, env={**os.environ, "DATABASE_URL": large_url}, cwd=ROOT)
    os.environ["DATABASE_URL"] = small_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "budgeting.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    import psycopg

    from ledger.selectors import audit

    account_ids, tenant_id, refs = admission_bench.hot_shape()  # limits lifted: throughput is measured
    with psycopg.connect(large_url, autocommit=True) as conn:
        conn.execute(LIFT_LIMITS)
    plans = {name: explain(url, args.explain) for name, url in (("small", small_url), ("large", large_url))}
    pages = {name: blocks(url, args.blocks) for name, url in (("small", small_url), ("large", large_url))}
    # Again after the EXPLAIN run, which made the accounts that did not exist yet (made on first use).
    with psycopg.connect(large_url, autocommit=True) as conn:
        conn.execute(LIFT_LIMITS)

    servers = {name: serve(url, "sync") for name, url in (("small", small_url), ("large", large_url))}
    times: dict[str, dict[str, list[float]]] = {name: {call: [] for call in CALLS} for name in servers}
    pairs: dict[str, list[float]] = {"raw": [], "http": []}
    try:
        clients = {name: Client(base) for name, (_, base) in servers.items()}
        run = time.time_ns()
        for n in range(-10, args.cycles):
            for name, client in clients.items():
                into = times[name] if n >= 0 else {call: [] for call in CALLS}  # ten warm-up cycles
                cycle(client, f"{name}-{run}-{n}", into)
        for _ in range(2):
            pairs["raw"].append(raw_pairs(small_url, args.seconds / 2, account_ids, tenant_id, refs))
            pairs["http"].append(http_pairs(servers["small"][1], args.seconds / 2))
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=30)
    report = audit()

    ms = "{:6.2f} ms".format
    print(
        f"databases: small {SMALL[0]:,} reservations / {SMALL[1]:,} entries, large {large[0]:,} / "
        f"{large[1]:,} (filled in {', '.join(f'{k} {v:.0f} s' for k, v in filled.items()) or 'reused'}); "
        f"{args.cycles} cycles; gunicorn sync workers; one connection a call"
    )
    small_admit = p50(times["small"]["admit"])
    print(
        f"{'call':12} {'p50 small':>10} {'÷ admit':>8} {'p50 large':>10} {'large÷small':>12}"
        "  goals ≤ 1.0, ≤ 1.2"
    )
    for call in CALLS:
        s, big = p50(times["small"][call]), p50(times["large"][call])
        print(f"{call:12} {ms(s * 1000):>10} {s / small_admit:8.2f} {ms(big * 1000):>10} {big / s:12.2f}")
    raw, http = statistics.mean(pairs["raw"]), statistics.mean(pairs["http"])
    print(
        f"admit + release, {CLIENTS} clients: HTTP {http:.1f} pairs/s ÷ raw psycopg {raw:.1f} pairs/s = "
        f"{http / raw:.2f}  goal ≥ 0.5"
    )
    print(
        f"EXPLAIN (ANALYZE, BUFFERS) of every statement, in-process, each rolled back just before it ran: "
        f"median execution ms of {args.explain} cycles, small and large, and the scans on the large database"
    )
    for key, (scans, large_ms) in plans["large"].items():
        small_ms = plans["small"].get(key, [[], math.nan])[1]
        seq = [s for s in scans if s.startswith("Seq Scan") and any(f" {t} " in f"{s} " for t in GROWING)]
        print(
            f"  {key} {small_ms:7.3f} {large_ms:7.3f} {large_ms / small_ms:5.2f}  "
            f"{'SEQ SCAN OF A GROWING TABLE ' if seq else ''}{'; '.join(scans)}"
        )
    print(
        f"pages per call, in-process (mean of {args.blocks} cycles): touched and read outside shared buffers"
        " (PostgreSQL's statistics of each database's tables and indexes)"
    )
    print(f"{'call':12} {'touched small':>14} {'large':>8} {'read small':>11} {'large':>8}")
    for call, (touched, read) in pages["small"].items():
        big_touched, big_read = pages["large"][call]
        print(f"{call:12} {touched:14.1f} {big_touched:8.1f} {read:11.2f} {big_read:8.2f}")
    audited = "clean" if report.ok else report.violations + report.leaks
    print(f"audit of the small database after the run: {audited}")


if __name__ == "__main__":
    main()
