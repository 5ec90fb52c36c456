"""Provider counting benchmark: the latency a provider counting API adds to the admission decision, against
the provider simulator's Anthropic ``count_tokens`` over real HTTP (the official SDK), with a realistic
injected delay on every count (``--delay-ms``, 150 by default: a count_tokens round trip from a gateway's
region).

The request is ``ladder_bench``'s (~40k tokens, 60 evidence items and copies, 40 turns, 16 tools). Timed, each
the median of its rounds, each beside the same decision counted locally (the baseline, same round):

- FULL fits, cold: one count of the FULL payload;
- FULL fits, warm: the payload's count is cached (no call);
- degraded (DEDUP, COMPACT, NARROW, TRIM), cold: the FULL payload and the walk's end are counted (two calls),
  every rung in between is recounted locally, calibrated on the FULL count;
- the same, warm.

It also prints how many local recounts the degraded walk made: a design asking the provider once per
recount would wait that many round trips in sequence; that figure is computed (recounts × the measured cold
FULL round trip), not run.

    REDIS_URL=redis://127.0.0.1:6379/6 .venv/bin/python bench/provider_count_bench.py [--delay-ms 150]

(The pure ladder and the adapter need neither the database nor Redis: the count caches are in memory.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "budgeting.settings")

import ladder_bench  # noqa: E402

from budgeting.admission.counters.apis import AnthropicCountTokens  # noqa: E402
from ladder import walk  # noqa: E402
from ladder.components import Limits  # noqa: E402
from ladder.counting import MemoryCountCache, TokenizerCounter  # noqa: E402
from ladder.decide import decide  # noqa: E402
from ladder.decision import Decision  # noqa: E402
from ladder.parser import parse_components  # noqa: E402
from ladder.policy import TaskPolicy  # noqa: E402
from ladder.rungs import ModelSpec  # noqa: E402
from simulation.provider import Simulator  # noqa: E402

ROUNDS = 7


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=150.0, help="injected delay of each count")
    args = parser.parse_args()

    tokenizer_dir = Path(os.environ.get("TOKENIZER_DIR", ROOT / "var" / "tokenizers"))
    counter = TokenizerCounter.from_file(tokenizer_dir / "deepseek_v3.json")
    local = ModelSpec(
        id="bench@1",
        context_window=1_000_000,
        max_output=4096,
        template_family="deepseek",
        image_formula="tiles512",
        capabilities=frozenset({"tools", "json_schema", "vision"}),
        data_residency="eu",
        safety_tier=2,
        tokenizer_digest=counter.digest,
    )
    remote = replace(local, provider_counter="anthropic")
    components = parse_components(ladder_bench.request(), limits=Limits())

    with Simulator() as sim:
        sim.script_count("delay", count=1_000_000, delay_s=args.delay_ms / 1000)
        api = AnthropicCountTokens(sim.base_url, api_key="bench", timeout=10.0)
        provider_cache: dict[str, int] = {}
        calls = [0]

        def provider_count(spec: ModelSpec, payload: Mapping[str, object], digest: str) -> int:
            found = provider_cache.get(digest)
            if found is None:
                calls[0] += 1
                found = provider_cache[digest] = api.count("claude-sonnet-4-5", payload)
            return found

        segment_cache = MemoryCountCache()

        def run(model: ModelSpec, task_policy: TaskPolicy) -> Decision:
            return decide(
                components,
                request_id=ladder_bench.REQUEST_ID,
                model=model,
                requested_max_output=1600,
                task_policy=task_policy,
                global_cap=10_000_000,
                fallback_models=[],
                counter_for=lambda spec: counter,
                cache=segment_cache,
                provider_count=provider_count,
            )

        api.count("claude-sonnet-4-5", {"messages": []})  # the SDK's connection, opened once as in a worker
        full_policy = ladder_bench.policy(1_000_000)
        full = run(remote, full_policy)
        assert full.admitted and full.rung == "FULL" and full.count_method == "PROVIDER_COUNT"
        assert full.count is not None
        # A cap at 60 % of the provider's FULL count: the walk needs every rung up to TRIM_EVIDENCE.
        tight_policy = ladder_bench.policy(full.count.total * 6 // 10)
        provider_cache.clear()
        calls[0] = 0
        recounts = [0]
        original = walk.Target.count

        def counting(self: walk.Target, state: object) -> object:
            recounts[0] += 1
            return original(self, state)  # type: ignore[arg-type]

        walk.Target.count = counting  # type: ignore[assignment,method-assign]
        degraded = run(remote, tight_policy)
        walk.Target.count = original  # type: ignore[method-assign]
        degraded_calls = calls[0]
        assert degraded.admitted and degraded.count_method == "PROVIDER_COUNT", degraded.detail
        assert degraded.rung == "TRIM_EVIDENCE", degraded.rung
        assert degraded.count is not None and degraded.count.total <= degraded.budget
        baseline_degraded = run(local, ladder_bench.policy(degraded.budget))
        assert baseline_degraded.admitted

        def timed(fn: Callable[[], object], before: Callable[[], None] | None = None) -> float:
            if before is not None:
                before()
            started = time.perf_counter()
            fn()
            return time.perf_counter() - started

        samples: dict[str, list[float]] = {
            name: []
            for name in (
                "local FULL",
                "provider FULL cold",
                "provider FULL warm",
                "local degraded",
                "provider degraded cold",
                "provider degraded warm",
            )
        }
        for _ in range(ROUNDS):
            samples["local FULL"].append(timed(lambda: run(local, full_policy)))
            samples["provider FULL cold"].append(
                timed(lambda: run(remote, full_policy), provider_cache.clear)
            )
            samples["provider FULL warm"].append(timed(lambda: run(remote, full_policy)))
            samples["local degraded"].append(timed(lambda: run(local, ladder_bench.policy(degraded.budget))))
            samples["provider degraded cold"].append(
                timed(lambda: run(remote, tight_policy), provider_cache.clear)
            )
            samples["provider degraded warm"].append(timed(lambda: run(remote, tight_policy)))

    figures = {name: median_ms(values) for name, values in samples.items()}
    round_trip = figures["provider FULL cold"] - figures["provider FULL warm"]
    result = {
        "injected_delay_ms": args.delay_ms,
        "median_ms": figures,
        "added_ms": {
            "FULL cold": round(figures["provider FULL cold"] - figures["local FULL"], 1),
            "FULL warm": round(figures["provider FULL warm"] - figures["local FULL"], 1),
            "degraded cold": round(figures["provider degraded cold"] - figures["local degraded"], 1),
            "degraded warm": round(figures["provider degraded warm"] - figures["local degraded"], 1),
        },
        "added_in_round_trips": {
            "FULL cold": round((figures["provider FULL cold"] - figures["local FULL"]) / round_trip, 2),
            "degraded cold": round(
                (figures["provider degraded cold"] - figures["local degraded"]) / round_trip, 2
            ),
        },
        "degraded_walk": {
            "rung": degraded.rung,
            "provider_calls": degraded_calls,
            "local_recounts": recounts[0],
            "one_call_per_recount_would_add_ms (computed)": round(recounts[0] * round_trip, 1),
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
