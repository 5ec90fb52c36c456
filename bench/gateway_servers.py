"""What the hook would add through a real LiteLLM proxy with our API served another way: the lead for the
gateway goal (the hook-added p50 ≤ 0.5× LiteLLM's own overhead), measured side by side in one run.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/tokenbudget REDIS_URL=redis://127.0.0.1:6379/0 \
        .venv/bin/python bench/gateway_servers.py [--calls 150] [--rounds 6]

The arms, interleaved as in ``bench/gateway_bench.py`` (whose proxies, simulator and figures it reuses), each
the same non-streaming call through a proxy of its own:
  - ``bare`` and ``bare-2``: no callbacks, their calls pooled: the baseline (their difference: the control);
  - ``hook``: our hook calling our API as the bench serves it (gunicorn gthread, Django's handler and its
    middleware before the hot path);
  - ``lean``: our hook calling our hot path (``HotPathMiddleware``, the same operations and statements)
    served by aiohttp in one process, each request handled to the end in the loop, in ONE context (Django's
    connections belong to a context, and aiohttp gives each request its own: without it every request opens a
    connection), with no gunicorn, no Django request handler and no other middleware. A prototype, not a
    server to ship: it answers only what the hot path answers (anything else gets 599), and a request blocks
    the process while it runs, as a sync worker's does;
  - ``floor``: our hook calling an aiohttp process that does only a transaction of the ledger's shape
    (``bench/admission_bench.py``'s raw SQL: the reservation, the three accounts' conditional updates, three
    entries, pipelined in one round trip and a commit; a final usage, the reservation and the accounts
    updated): what is left with no rendering, counting, ladder or manifest and a lean server.
The database is the bench's own (``<name>_bench``, created anew) with the accounts' limits lifted; the floor's
rows do not balance, so no audit is made.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import io
import logging
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from admission_bench import RAW_INSERT, RAW_UPDATE, free_port, hot_shape, prepared_django  # noqa: E402
from gateway_bench import (  # noqa: E402
    CPU_GROUPS,
    Arm,
    close_arms,
    fresh_lease,
    percentile,
    real_grant,
    run_interleaved,
    serve_api,
    spawn_server,
    start_proxy,
)

from tests.integrations.litellm_proxy import ensure_venv  # noqa: E402

ENTRY = (
    "INSERT INTO ledger_ledgerentry (account_id, reservation_id, kind, input_reserved, output_reserved,"
    " input_consumed, output_consumed, in_flight, spend_reserved, spend_consumed, period_start, reason,"
    " created_by, created_at) VALUES (%s,%s,'HOLD',10,10,0,0,1,20,0,now(),'','',now())"
)
SETTLE_RESERVATION = (
    "UPDATE ledger_reservation SET state = 'SETTLED', outcome = 'COMPLETED', remaining = 0, released = 10"
    " WHERE id = %s"
)
SETTLE_ACCOUNT = (
    "UPDATE ledger_capacityaccount SET output_reserved = output_reserved - 10, in_flight = in_flight - 1"
    " WHERE id = %s"
)


def _serve_lean(port: int, url: str) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "budgeting.settings")
    os.environ.setdefault("TOKENIZER_DIR", str(ROOT / "var" / "tokenizers"))
    # Each request runs to its end in the loop, one at a time: no connection is shared between coroutines.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    import django

    django.setup()
    from django.core.handlers.wsgi import WSGIRequest
    from django.http import HttpResponse

    from budgeting.api.hotpath import HotPathMiddleware
    from budgeting.catalog import snapshot

    snapshot.current()[0].load_tokenizers()
    hot = HotPathMiddleware(lambda request: HttpResponse(b'{"code":"NOT_ON_THE_HOT_PATH"}', status=599))
    context = contextvars.copy_context()

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        environ: dict[str, Any] = {
            "REQUEST_METHOD": request.method,
            "PATH_INFO": request.path,
            "QUERY_STRING": request.query_string,
            "SERVER_NAME": "127.0.0.1",
            "SERVER_PORT": "8000",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "REMOTE_ADDR": "127.0.0.1",
            "CONTENT_LENGTH": str(len(body)),
            "CONTENT_TYPE": request.headers.get("Content-Type", ""),
            "wsgi.input": io.BytesIO(body),
            "wsgi.url_scheme": "http",
            "wsgi.errors": sys.stderr,
        }
        for name, value in request.headers.items():
            key = "HTTP_" + name.upper().replace("-", "_")
            if key not in ("HTTP_CONTENT_TYPE", "HTTP_CONTENT_LENGTH"):
                environ[key] = value
        answer = context.run(hot, WSGIRequest(environ))
        headers = {name: value for name, value in answer.items() if name.lower() != "content-length"}
        return web.Response(body=answer.content, status=answer.status_code, headers=headers)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def _serve_floor(
    port: int, grant: dict[str, Any], url: str, accounts: list[int], tenant: int, refs: dict[str, int]
) -> None:
    import psycopg

    async def serve() -> None:
        conn = await psycopg.AsyncConnection.connect(url)
        lock = asyncio.Lock()

        async def admit(request: web.Request) -> web.Response:
            body = await request.json()
            reservation, key = uuid.uuid4(), body["requestId"]
            async with lock, conn.transaction(), conn.pipeline():
                await conn.execute(
                    RAW_INSERT, (reservation, tenant, refs["task"], refs["pool"], refs["model"], key, key)
                )
                for account in accounts:
                    await conn.execute(RAW_UPDATE, (account,))
                for account in accounts:
                    await conn.execute(ENTRY, (account, reservation))
            answer = {
                **grant,
                "requestId": key,
                "reservationId": str(reservation),
                "state": "DISPATCHED",
                "providerRequestId": body["dispatch"]["providerRequestId"],
                "lease": fresh_lease(),
            }
            return web.json_response(answer, status=201)

        async def reports(request: web.Request) -> web.Response:
            usage = (await request.json())["usage"]
            async with lock, conn.transaction(), conn.pipeline():
                for report in usage:
                    await conn.execute(SETTLE_RESERVATION, (report["reservationId"],))
                    for account in accounts:
                        await conn.execute(SETTLE_ACCOUNT, (account,))
            results = [
                {"reservationId": r["reservationId"], "status": 200, "applied": True, "state": "SETTLED"}
                for r in usage
            ]
            return web.json_response({"results": results})

        app = web.Application()
        app.router.add_post("/api/v1/admissions", admit)
        app.router.add_post("/api/v1/reservations:usage", reports)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(serve())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=150, help="calls per arm per round")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    url = prepared_django()
    # The project's logging prints every HTTP request the bench's client makes; only the figures matter here.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    from simulation.provider import Simulator

    accounts, tenant, refs = hot_shape()
    venv, _ = ensure_venv()
    api_process, api = serve_api(url, "gthread")
    simulator = Simulator(seed=3)
    sim = simulator.start(port=free_port()) + "/v1"
    lean, lean_url = spawn_server(_serve_lean, url)
    floor, floor_url = spawn_server(_serve_floor, real_grant(api), url, accounts, tenant, refs)
    arms: list[Arm] = []
    with tempfile.TemporaryDirectory(prefix="gateway-servers-") as tmp:
        try:
            hooked = {
                "hook": (api, api_process.pid),
                "lean": (lean_url, lean.pid),
                "floor": (floor_url, floor.pid),
            }
            arms.append(Arm("bare", start_proxy(venv, Path(tmp) / "bare", sim, api, None)))
            for name, (target, pid) in hooked.items():
                arms.append(
                    Arm(name, start_proxy(venv, Path(tmp) / name, sim, target, ROOT / "gateway"), pid)
                )
            arms.append(Arm("bare-2", start_proxy(venv, Path(tmp) / "bare-2", sim, api, None)))
            run_interleaved(arms, args.calls, args.rounds)
        finally:
            close_arms(arms)
            simulator.stop()
            for process in (lean, floor):
                process.terminate()
                process.join(10)
            api_process.terminate()
            api_process.wait(20)
    report(arms, args)


def report(arms: list[Arm], args: argparse.Namespace) -> None:
    by_name = {arm.name: arm for arm in arms}
    bare, control = by_name["bare"], by_name["bare-2"]
    base = percentile(bare.latencies_ms + control.latencies_ms, 0.5)
    own = percentile(bare.overhead_ms + control.overhead_ms, 0.5)
    difference = percentile(control.latencies_ms, 0.5) - percentile(bare.latencies_ms, 0.5)
    print(
        f"LiteLLM 1.110.2 proxy, 1 worker; one client, {args.rounds} rounds × {args.calls} non-streaming "
        f"calls per arm, interleaved; baseline (bare and bare-2 pooled) p50 {base:.1f} ms, LiteLLM's own "
        f"overhead p50 {own:.1f} ms; the control (bare-2 − bare) {difference:+.1f} ms"
    )
    print(f"{'arm':<6} {'p50 ms':>7} {'added':>7} {'ratio':>6}  CPU per call, ms: " + ", ".join(CPU_GROUPS))
    for name in ("hook", "lean", "floor"):
        arm = by_name[name]
        p50 = percentile(arm.latencies_ms, 0.5)
        cpu = ", ".join(f"{arm.cpu_ms[group] / len(arm.latencies_ms):.2f}" for group in CPU_GROUPS)
        print(f"{name:<6} {p50:7.1f} {p50 - base:+7.1f} {(p50 - base) / own:6.2f}  {cpu}")


if __name__ == "__main__":
    main()
