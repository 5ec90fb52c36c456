"""Ladder benchmark: the admission decision (``ladder.decide``) for a request that needs three rungs
(DEDUP_EVIDENCE, COMPACT_HISTORY, NARROW_WORKFLOW) next to the same request decided at FULL (with a budget it
fits), cold (empty count cache) and warm (every segment cached), with the count cache in the real Redis.

Each rung re-renders the request and recounts it; the target is warm three-rung / warm FULL <= 1.5. Machines
here are shared and noisy, so the two decisions are timed alternately, each figure is the median of its
rounds, the ratios are the medians of the per-round ratios, and only the ratio is compared with the target.

    REDIS_URL=redis://127.0.0.1:6379/0 .venv/bin/python bench/ladder_bench.py [--profile]

(The pure ladder needs no database; DATABASE_URL is not read.)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ladder.components import Components, Limits  # noqa: E402
from ladder.counting import TokenizerCounter  # noqa: E402
from ladder.decide import decide  # noqa: E402
from ladder.decision import Decision  # noqa: E402
from ladder.parser import parse_components  # noqa: E402
from ladder.policy import TaskPolicy, parse_policy  # noqa: E402
from ladder.rungs import ModelSpec  # noqa: E402

COLD_ROUNDS = 9
WARM_ROUNDS = 41
REQUEST_ID = "req-bench"
# The budget the three-rung request gets: over it after DEDUP_EVIDENCE and COMPACT_HISTORY, under it after
# NARROW_WORKFLOW (checked below, so a change of sizes cannot silently bench another path).
THREE_RUNG_BUDGET = 30_000
ENGLISH = (
    "The supplier shall indemnify the customer against all losses arising from a breach of clause {n}, "
    "provided that notice is given within thirty days and the liability cap in schedule {m} applies. "
)
CJK = "本合同第{n}条规定，任何一方均可在提前三十天书面通知后终止本协议，但须支付已发生的费用。"


class BenchCache:
    """The production cache shape (MGET / pipelined SET) against the real Redis, under a bench prefix."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def get_many(self, keys: Sequence[str]) -> list[int | None]:
        values = self.client.mget(["ladderbench:" + k for k in keys])
        return [None if v is None else int(v) for v in values]  # type: ignore[union-attr]

    def set_many(self, mapping: Mapping[str, int]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, value in mapping.items():
            pipe.set("ladderbench:" + key, value, ex=600)
        pipe.execute()

    def clear(self) -> None:
        keys = list(self.client.scan_iter(match="ladderbench:*", count=1000))
        if keys:
            self.client.delete(*keys)


def text(rng: random.Random, repeats: int) -> str:
    template = rng.choice((ENGLISH, CJK))
    return "".join(template.format(n=rng.randint(1, 999), m=rng.randint(1, 99)) for _ in range(repeats))


def request(seed: int = 1) -> dict[str, Any]:
    """~40k tokens: 60 evidence items and 20 copies of them, 40 turns (32 replaced by two compactions),
    16 tool definitions of which 2 are essential."""
    rng = random.Random(seed)
    evidence: list[dict[str, Any]] = [
        {
            "id": f"e{i}",
            "sourceId": f"doc-{i}",
            "text": text(rng, rng.randint(5, 9)),
            "score": round(rng.random(), 4),
            "permissions": ["contracts:read"],
            "minimumRetention": i == 0,
        }
        for i in range(60)
    ]
    evidence += [
        {
            **evidence[i],
            "id": f"copy{i}",
            "score": round(evidence[i]["score"] / 2, 4),
            "minimumRetention": False,
        }
        for i in range(1, 21)
    ]
    turns = [
        {"turn": t, "role": "user" if t % 2 else "assistant", "text": text(rng, rng.randint(4, 7))}
        for t in range(1, 41)
    ]
    compactions = [
        {
            "id": f"cmp-{k}",
            "replacesTurns": list(range(1 + 16 * k, 17 + 16 * k)),
            "text": f"Summary of turns {1 + 16 * k}-{16 + 16 * k}: " + text(rng, 2),
            "gateId": "gate-fidelity-v2",
            "fidelityScore": 0.95,
            "requestId": REQUEST_ID,
        }
        for k in range(2)
    ]
    tools = [
        {
            "name": f"tool_{k}",
            "description": "Search clauses by structured filters.",
            "parameters": {
                "type": "object",
                "properties": {
                    f"field_{j}": {"type": "string", "description": f"Field {j} of the clause search, " * 3}
                    for j in range(rng.randint(20, 30))
                },
            },
            "essential": k < 2,
        }
        for k in range(16)
    ]
    return {
        "immutableRules": ["Never reveal another tenant's documents.", "Cite evidence ids."],
        "authorizationScope": {"permissions": ["contracts:read"]},
        "outputSafety": ["No legal advice beyond the documents."],
        "question": {"text": "Which clauses allow termination without cause?"},
        "trustedState": [{"id": "s1", "text": "Customer tier: gold", "provenance": "crm"}],
        "evidence": evidence,
        "recentTurns": turns,
        "compactions": compactions,
        "tools": tools,
    }


def policy(input_cap: int) -> TaskPolicy:
    document = {
        "revision": 1,
        "globalMaxInputTokens": 10_000_000,
        "taskClasses": {
            "contract-review": {
                "inputCap": input_cap,
                "outputCap": 1600,
                "ladder": [
                    "FULL",
                    "DEDUP_EVIDENCE",
                    "COMPACT_HISTORY",
                    "NARROW_WORKFLOW",
                    "TRIM_EVIDENCE",
                    "QUEUE_OR_REJECT",
                ],
                "minimumEvidence": {"minItems": 1, "requireMarked": True},
                "compaction": {"fidelityThreshold": 0.9, "approvedGates": ["gate-fidelity-v2"]},
                "essentialTools": [],
                "clarificationWorkflow": None,
                "countingUnavailable": "REJECT",
                "queue": {"allowed": True, "deadlineSeconds": 60},
                "rampPercent": 100,
            }
        },
    }
    return parse_policy(document).task_classes["contract-review"]


def paired_ms(
    first: Callable[[], object],
    second: Callable[[], object],
    rounds: int,
    before: Callable[[], object] | None,
) -> tuple[float, float, float]:
    """Time ``first`` and ``second`` alternately (the machine's noise then hits both alike); return their
    median times in ms and the median of the per-round ratios second / first."""
    a_samples, b_samples, ratios = [], [], []
    for _ in range(rounds):
        times = []
        for fn in (first, second):
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        a_samples.append(times[0])
        b_samples.append(times[1])
        ratios.append(times[1] / times[0])
    return (
        round(statistics.median(a_samples) * 1000, 2),
        round(statistics.median(b_samples) * 1000, 2),
        round(statistics.median(ratios), 3),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="store_true", help="profile the warm three-rung decision")
    args = parser.parse_args()

    tokenizer_dir = Path(os.environ.get("TOKENIZER_DIR", ROOT / "var" / "tokenizers"))
    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    cache = BenchCache(client)
    counter = TokenizerCounter.from_file(tokenizer_dir / "deepseek_v3.json")
    model = ModelSpec(
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
    components = parse_components(request(), limits=Limits())
    three_rungs, full_only = policy(THREE_RUNG_BUDGET), policy(1_000_000)

    def run(task_policy: TaskPolicy, data: Components = components) -> Decision:
        return decide(
            data,
            request_id=REQUEST_ID,
            model=model,
            requested_max_output=1600,
            task_policy=task_policy,
            global_cap=10_000_000,
            fallback_models=[],
            counter_for=lambda spec: counter,
            cache=cache,
        )

    cache.clear()
    degraded, full = run(three_rungs), run(full_only)
    assert full.admitted and full.rung == "FULL" and full.count is not None
    assert degraded.admitted and degraded.rung == "NARROW_WORKFLOW" and degraded.count is not None
    assert [step.rung for step in degraded.steps] == ["DEDUP_EVIDENCE", "COMPACT_HISTORY", "NARROW_WORKFLOW"]
    assert all(step.tokens_after < step.tokens_before for step in degraded.steps), "each rung must remove"
    assert degraded.steps[1].tokens_after > THREE_RUNG_BUDGET, "NARROW_WORKFLOW must be needed"

    if args.profile:
        run(three_rungs)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(10):
            run(three_rungs)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
        return

    cold_full, cold_three, cold_ratio = paired_ms(
        lambda: run(full_only), lambda: run(three_rungs), COLD_ROUNDS, before=cache.clear
    )
    run(full_only)
    run(three_rungs)
    warm_full, warm_three, warm_ratio = paired_ms(
        lambda: run(full_only), lambda: run(three_rungs), WARM_ROUNDS, before=None
    )
    cache.clear()

    print(
        json.dumps(
            {
                "request": {
                    "components": len(components.evidence)
                    + len(components.recent_turns)
                    + len(components.compactions)
                    + len(components.tools)
                    + 5,
                    "fullTokens": full.count.total,
                    "threeRungTokens": degraded.count.total,
                    "threeRungBudget": THREE_RUNG_BUDGET,
                    "steps": [
                        f"{step.rung}: {step.tokens_before} -> {step.tokens_after}" for step in degraded.steps
                    ],
                },
                "cold_full_ms": cold_full,
                "cold_three_rung_ms": cold_three,
                "warm_full_ms": warm_full,
                "warm_three_rung_ms": warm_three,
                "cold_three_over_full": cold_ratio,
                "warm_three_over_full": warm_ratio,
                "target": {"warm_three_over_full": "<= 1.5"},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
