"""What the hot path (budgeting/api/hotpath.py) saves, against our API without it, side by side in one run.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/tokenbudget REDIS_URL=redis://127.0.0.1:6379/0 \
        .venv/bin/python bench/hotpath_bench.py [--rounds 3] [--seconds 6] [--calls 300]

It provisions its own database (``<name>_bench``, the demo configuration) and serves our API twice on it,
each with gunicorn as ``./platform run`` starts it (sync workers): ``hot``, the platform as it is, and
``views``, without the hot path (``bench/views_settings.py``: every request through Django's whole middleware
stack and DRF's views). In alternated rounds it measures, for each:
  - one client's sequential calls as the LiteLLM hook makes them (aiohttp, one kept-alive connection, to a
    gthread server: an admission with its dispatch, then its final usage): the p50 of each;
  - admit + release (cancel) pairs/s from 8 clients (``lifecycle_bench.http_pairs``: http.client, a
    connection a call, as the gateway client does): the API's capacity per core.
It prints each figure both ways and the ratio hot ÷ views (the p50s: below 1 is faster; the pairs/s: above 1
is more), each a median over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from admission_bench import TOKEN, hot_shape, prepared_django  # noqa: E402
from gateway_bench import MAX_TOKENS, admission_body, serve_api  # noqa: E402
from lifecycle_bench import http_pairs  # noqa: E402

WAYS = {"hot": "budgeting.settings", "views": "views_settings"}


def admission(request_id: str) -> dict[str, Any]:
    """The body the LiteLLM hook sends for gateway_bench.py's chat request, its dispatch included."""
    return {**admission_body(request_id), "dispatch": {"providerRequestId": f"bench-{request_id}"}}


async def sequential(base: str, calls: int) -> tuple[list[float], list[float]]:
    """``calls`` admissions, each followed by its final usage, one at a time: each call's milliseconds."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/json"}
    sent = {"Content-Type": "application/json"}
    admit_ms: list[float] = []
    usage_ms: list[float] = []
    async with aiohttp.ClientSession(base, headers=headers) as session:
        for n in range(calls + 20):
            key = f"hotpath-{uuid.uuid4()}"
            started = time.perf_counter()
            body = json.dumps(admission(key)).encode()
            async with session.post(
                "/api/v1/admissions", data=body, headers={**sent, "Idempotency-Key": key}
            ) as r:
                grant = await r.json()
                assert r.status == 201, grant
            admitted = time.perf_counter()
            usage = {"fence": grant["lease"]["fence"], "usageEventId": f"u-{key}", "final": True}
            usage |= {"inputTokens": grant["tokens"]["input"], "outputTokens": MAX_TOKENS}
            path = f"/api/v1/reservations/{grant['reservationId']}/usage"
            async with session.post(path, data=json.dumps(usage).encode(), headers=sent) as r:
                assert r.status == 200, await r.text()
                await r.read()
            if n >= 20:  # the first 20 warm the connection and the workers
                admit_ms.append((admitted - started) * 1000)
                usage_ms.append((time.perf_counter() - admitted) * 1000)
    return admit_ms, usage_ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0, help="of each throughput measurement")
    parser.add_argument("--calls", type=int, default=300, help="sequential calls per round and way")
    args = parser.parse_args()

    url = prepared_django()
    hot_shape()  # the hot tenant's limits lifted: throughput is measured, not refusals
    servers = {
        (way, model): serve_api(url, model, settings)
        for way, settings in WAYS.items()
        for model in ("gthread", "sync")
    }
    figures: dict[str, dict[str, list[float]]] = {
        way: {"admit": [], "usage": [], "pairs": []} for way in WAYS
    }
    try:
        for _ in range(args.rounds):
            for way in WAYS:
                admit_ms, usage_ms = asyncio.run(sequential(servers[way, "gthread"][1], args.calls))
                figures[way]["admit"].append(statistics.median(admit_ms))
                figures[way]["usage"].append(statistics.median(usage_ms))
                figures[way]["pairs"].append(http_pairs(servers[way, "sync"][1], args.seconds))
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(20)

    print(
        f"our API, the demo; {args.rounds} alternated rounds; sequential: {args.calls} calls, aiohttp kept "
        f"alive, gunicorn gthread (2 workers × 4 threads); pairs: 8 clients, http.client, gunicorn sync"
    )
    results: dict[str, Any] = {}
    for figure, label in (
        ("admit", "admission (with dispatch) p50 ms"),
        ("usage", "final usage p50 ms"),
        ("pairs", "admit + release pairs/s"),
    ):
        hot, views = (statistics.median(figures[way][figure]) for way in WAYS)
        rounds = " ".join(
            f"{a:.2f}/{b:.2f}" for a, b in zip(figures["hot"][figure], figures["views"][figure], strict=True)
        )
        print(
            f"{label:<36} hot {hot:8.2f}  views {views:8.2f}  hot ÷ views {hot / views:.3f}"
            f"  (rounds {rounds})"
        )
        results[figure] = {"hot": round(hot, 3), "views": round(views, 3), "ratio": round(hot / views, 3)}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
