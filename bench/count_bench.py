"""Counting benchmark, per tokenizer family (foundation issue §7, issue 20).

Counts a ~100k-token request of ~200 components (English, CJK, code; tool schemas for the families whose
rendering of them is exact) and prints, per family and in one run: that family's raw encoder on the same
text (the baseline: ``tokenizers`` batch encode, tiktoken's ``encode_ordinary`` per segment, Meta's cutting
then tiktoken, or ``MistralTokenizer.encode_chat_completion`` of the request), our cold count (empty Redis
cache), our warm count (every segment cached), and the ratios. Machines here are shared and noisy, so each
figure is the median of several rounds and only the ratios are compared with the targets.

    REDIS_URL=redis://127.0.0.1:6379/0 .venv/bin/python bench/count_bench.py
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import cast

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ladder.components import Limits  # noqa: E402
from ladder.counting import SegmentCounter, TokenizerCounter, count_stream  # noqa: E402
from ladder.encoders import TiktokenCounter  # noqa: E402
from ladder.families import load_counter  # noqa: E402
from ladder.mistral import MistralCounter  # noqa: E402
from ladder.parser import parse_components  # noqa: E402
from ladder.templates import Special, Text, get_template  # noqa: E402

# (family, file, template, tools rendered exactly): OpenAI's framing of tools is not published (an upper
# bound, not a count), so its request here has none.
FAMILIES = (
    ("byte-level-bpe", "deepseek_v3.json", "deepseek", True),
    ("o200k_base", "o200k_base.tiktoken", "openai", False),
    ("cl100k_base", "cl100k_base.tiktoken", "openai", False),
    ("llama3", "llama3.tokenizer.model", "llama3", True),
    ("mistral-tekken", "tekken_240718.json", "mistral", True),
    ("mistral-sentencepiece", "mistral_instruct_tokenizer_241114.model.v7", "mistral", True),
)

ROUNDS = 7
ENGLISH = (
    "The supplier shall indemnify the customer against all losses arising from a breach of clause {n}, "
    "provided that notice is given within thirty days and the liability cap in schedule {m} applies. "
)
CJK = "本合同第{n}条规定，任何一方均可在提前三十天书面通知后终止本协议，但须支付已发生的费用。"
CODE = (
    "def settle_{n}(ledger, amount: int) -> int:\n    if amount < 0:\n        raise ValueError('negative')\n"
    "    return ledger.post({m}, amount)\n\n"
)


class BenchCache:
    """The production cache shape (MGET / pipelined SET) against the real Redis, under a bench prefix."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def get_many(self, keys: Sequence[str]) -> list[int | None]:
        values = cast(list[bytes | None], self.client.mget(["bench:" + k for k in keys]))
        return [None if v is None else int(v) for v in values]

    def set_many(self, mapping: Mapping[str, int]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, value in mapping.items():
            pipe.set("bench:" + key, value, ex=600)
        pipe.execute()

    def clear(self) -> None:
        keys = list(self.client.scan_iter(match="bench:*", count=1000))
        if keys:
            self.client.delete(*keys)


def request(seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    evidence = []
    for i in range(150):
        kind = i % 3
        template = (ENGLISH, CJK, CODE)[kind]
        repeats = rng.randint(10, 22)
        text = "".join(template.format(n=rng.randint(1, 999), m=rng.randint(1, 99)) for _ in range(repeats))
        evidence.append(
            {
                "id": f"e{i}",
                "sourceId": f"doc-{i % 40}",
                "text": text,
                "score": rng.random(),
                "permissions": ["contracts:read"],
            }
        )
    turns = []
    for t in range(30):
        role = "user" if t % 2 == 0 else "assistant"
        turns.append({"turn": t, "role": role, "text": ENGLISH.format(n=t, m=t) * rng.randint(2, 6)})
    tools = []
    for k in range(16):
        props = {
            f"field_{j}": {"type": "string", "description": f"Field {j} of the clause search, " * 3}
            for j in range(rng.randint(10, 30))
        }
        tools.append(
            {
                "name": f"tool_{k}",
                "description": "Search clauses by structured filters.",
                "parameters": {"type": "object", "properties": props},
                "essential": k < 2,
            }
        )
    return {
        "immutableRules": ["Never reveal another tenant's documents.", "Cite evidence ids."],
        "authorizationScope": {"permissions": ["contracts:read"]},
        "outputSafety": ["No legal advice beyond the documents."],
        "question": {"text": "Which clauses allow termination without cause?"},
        "evidence": evidence,
        "recentTurns": turns,
        "tools": tools,
    }


def median_seconds(fn: Callable[[], object], rounds: int = ROUNDS) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def raw_encoder(counter: SegmentCounter, texts: list[str]) -> Callable[[], int]:
    """The family's own encoder over the same texts, with nothing of ours around it."""
    if isinstance(counter, TokenizerCounter):
        tokenizer = counter.tokenizer
        return lambda: sum(len(e.ids) for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False))
    if isinstance(counter, TiktokenCounter):
        encoding, chunks = counter.encoding, counter.chunks
        if chunks is None:
            return lambda: sum(len(encoding.encode_ordinary(text)) for text in texts)
        return lambda: sum(len(encoding.encode_ordinary(chunk)) for text in texts for chunk in chunks(text))
    assert isinstance(counter, MistralCounter)
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    (request,) = (json.loads(text) for text in texts)
    tokenizer = counter.tokenizer
    return lambda: len(
        tokenizer.encode_chat_completion(
            ChatCompletionRequest.from_openai(messages=request["messages"], tools=request.get("tools"))
        ).tokens
    )


def bench(family: str, file: str, template_family: str, tools: bool, cache: BenchCache) -> dict[str, object]:
    tokenizer_dir = Path(os.environ.get("TOKENIZER_DIR", ROOT / "var" / "tokenizers"))
    counter = load_counter(family, tokenizer_dir / file)
    template = get_template(template_family)
    data = request(1)
    if not tools:
        data.pop("tools")
    components = parse_components(data, limits=Limits())
    pieces = template.render(components)
    texts = [p.text for p in pieces if isinstance(p, Text)]
    specials = sum(1 for p in pieces if isinstance(p, Special))
    encode = raw_encoder(counter, texts)

    def raw() -> int:
        return encode() + specials

    def ours() -> int:
        return count_stream(
            pieces, counter, cache, template_revision=template.revision, image_formula="tiles512"
        ).total

    total_raw = raw()
    cache.clear()
    assert ours() == total_raw, f"{family}: our count must equal the raw encoder's"
    raw_s = median_seconds(raw)
    cold_samples = []
    for _ in range(ROUNDS):
        cache.clear()
        start = time.perf_counter()
        ours()
        cold_samples.append(time.perf_counter() - start)
    cold_s = statistics.median(cold_samples)
    ours()
    warm_s = median_seconds(ours, rounds=ROUNDS * 3)
    cache.clear()
    return {
        "family": family,
        "segments": len(texts),
        "tokens": total_raw,
        "raw_encode_ms": round(raw_s * 1000, 2),
        "cold_count_ms": round(cold_s * 1000, 2),
        "warm_count_ms": round(warm_s * 1000, 3),
        "cold_over_raw": round(cold_s / raw_s, 3),
        "raw_over_warm": round(raw_s / warm_s, 1),
    }


def main() -> None:
    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    cache = BenchCache(client)
    results = [bench(*family, cache) for family in FAMILIES]
    print(
        json.dumps(
            {"families": results, "targets": {"cold_over_raw": "<= 1.1", "raw_over_warm": ">= 50"}}, indent=2
        )
    )


if __name__ == "__main__":
    main()
