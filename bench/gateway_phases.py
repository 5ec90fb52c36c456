"""Where a call's time goes through the LiteLLM proxy, with the hook and without, phase by phase.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/tokenbudget REDIS_URL=redis://127.0.0.1:6379/0 \\
        .venv/bin/python bench/gateway_phases.py [--calls 200] [--rounds 4]

``gateway_bench.py`` gives what the hook adds to a call; this splits it. It starts what that bench starts
(our API under gunicorn gthread on its own database, the provider simulator, real LiteLLM 1.110.2 proxies)
for three arms: ``bare`` (no hook), ``hook`` (``tokenbudget_litellm`` of this checkout) and ``stub`` (the
same hook, whose API is ``gateway_bench.InstantApi``, answering every call at once: in each phase, ``stub`` −
``bare`` is the hook's own cost and ``hook`` − ``stub`` our API's). In all three, the
stamping callbacks of ``bench/phase_stamps.py`` are loaded first and last, around the hook: the moments
LiteLLM calls the pre-call hooks and the deployment hooks (right before the provider call), stamped on the
machine's monotonic clock, as is the client's sending and receiving of each call. One client sends the same
non-streaming chat completion to each arm in turn (``--calls`` per arm, ``--rounds`` rounds). It prints the
median of each phase in each arm:
  - before the pre-call hooks: LiteLLM's own work on the request (with the hook, the previous call's
    settlement shares the proxy's loop);
  - the hook's pre-call hook (``pre-first`` to ``pre-last``): mapping the request and sending its admission
    (or adopting the one sent as the request arrived, ``admitOnArrival``: that one is on its way during
    the phase before);
  - routing (``pre-last`` to ``deploy-first``): LiteLLM's, while the admission is in flight;
  - the hook's deployment hook (``deploy-first`` to ``deploy-last``): waiting for the admission, then
    applying it;
  - the provider call and the answer (``deploy-last`` to the client's receipt).
"""

from __future__ import annotations

import argparse
import bisect
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx2

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from admission_bench import free_port, prepared_django  # noqa: E402
from gateway_bench import REQUEST, InstantApi, real_grant, serve_api, start_proxy  # noqa: E402

from tests.integrations.litellm_proxy import ensure_venv  # noqa: E402

PHASES = (
    ("before the pre-call hooks", "sent", "pre-first"),
    ("the hook's pre-call hook", "pre-first", "pre-last"),
    ("routing", "pre-last", "deploy-first"),
    ("the hook's deployment hook", "deploy-first", "deploy-last"),
    ("provider call and answer", "deploy-last", "received"),
    ("the whole call", "sent", "received"),
)


def phases(stamps: Path, calls: dict[str, list[tuple[int, int]]]) -> dict[str, dict[str, list[float]]]:
    """Each arm's phase durations (ms), the proxy's stamps matched to the client's calls by time (the
    client sends one call at a time)."""
    by_call: dict[str, dict[str, int]] = defaultdict(dict)
    for line in stamps.read_text().splitlines():
        number, phase, ns = line.split()
        by_call[number][phase] = int(ns)
    starts = sorted((marks["pre-first"], marks) for marks in by_call.values() if "pre-first" in marks)
    keys = [start for start, _ in starts]
    found: dict[str, dict[str, list[float]]] = {}
    for arm, spans in calls.items():
        durations: dict[str, list[float]] = defaultdict(list)
        for sent, received in spans:
            at = bisect.bisect_left(keys, sent)
            if at == len(keys) or keys[at] > received:
                continue
            marks = {**starts[at][1], "sent": sent, "received": received}
            for name, start, end in PHASES:
                if start in marks and end in marks:
                    durations[name].append((marks[end] - marks[start]) / 1e6)
        found[arm] = durations
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200, help="calls per arm per round")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    url = prepared_django()
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    from simulation.provider import Simulator

    venv, _ = ensure_venv()
    api_process, api = serve_api(url, "gthread")
    instant = InstantApi(real_grant(api))
    stub_api = instant.start()
    simulator = Simulator(seed=3)
    sim = simulator.start(port=free_port()) + "/v1"
    arms = ("bare", "hook", "stub")
    calls: dict[str, list[tuple[int, int]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="gateway-phases-") as tmp:
        stamps = Path(tmp) / "stamps.txt"
        stamps.touch()
        env = {
            "PYTHONPATH": os.pathsep.join([str(ROOT / "gateway"), str(ROOT / "bench")]),
            "PHASE_STAMPS": str(stamps),
        }
        around = ("phase_stamps.first", "phase_stamps.last")
        proxies = {
            "bare": start_proxy(venv, Path(tmp) / "bare", sim, api, None, around=around, extra_env=env),
            "hook": start_proxy(
                venv, Path(tmp) / "hook", sim, api, ROOT / "gateway", around=around, extra_env=env
            ),
            "stub": start_proxy(
                venv, Path(tmp) / "stub", sim, stub_api, ROOT / "gateway", around=around, extra_env=env
            ),
        }
        clients: dict[str, httpx2.Client] = {}
        try:
            for arm, proxy in proxies.items():
                clients[arm] = httpx2.Client(
                    base_url=proxy.url, headers={"Authorization": f"Bearer {proxy.master_key}"}, timeout=60
                )
                for _ in range(20):  # warm-up, not counted
                    clients[arm].post("/v1/chat/completions", json=REQUEST)
            for round_ in range(args.rounds):
                for arm in arms[round_ % len(arms) :] + arms[: round_ % len(arms)]:
                    for _ in range(args.calls):
                        sent = time.perf_counter_ns()
                        answer = clients[arm].post("/v1/chat/completions", json=REQUEST)
                        received = time.perf_counter_ns()
                        if answer.status_code != 200:
                            raise SystemExit(f"{arm}: HTTP {answer.status_code}: {answer.text[:500]}")
                        calls[arm].append((sent, received))
            found = phases(stamps, calls)
        finally:
            for client in clients.values():
                client.close()
            for proxy in proxies.values():
                proxy.stop()
            simulator.stop()
            instant.stop()
            api_process.terminate()
            api_process.wait(20)

    print(
        f"LiteLLM 1.110.2 proxy, 1 worker; our API: gunicorn gthread, 2 workers; one client, {args.rounds} "
        f"rounds × {args.calls} non-streaming calls per arm, alternated; medians, ms"
    )
    columns = ("bare", "hook", "stub", "hook-bare", "stub-bare", "hook-stub")
    print(f"{'phase':<30} " + " ".join(f"{column:>10}" for column in columns))
    for name, _, _ in PHASES:
        bare, hook, stub = (_median(found[arm].get(name)) for arm in arms)
        print(
            f"{name:<30} {bare:10.2f} {hook:10.2f} {stub:10.2f} {hook - bare:+10.2f} {stub - bare:+10.2f} "
            f"{hook - stub:+10.2f}"
        )
    matched = {arm: len(found[arm].get("the whole call", [])) for arm in found}
    print(f"calls matched to the proxy's stamps: {matched} of {args.rounds * args.calls} each")


def _median(durations: list[float] | None) -> float:
    return statistics.median(durations) if durations else 0.0


if __name__ == "__main__":
    main()
