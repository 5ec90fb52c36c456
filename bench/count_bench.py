"""Counting benchmark, per tokenizer family (foundation issue §7, issue 20).

Counts a ~100k-token request of ~200 components (English, CJK, code; tool schemas for the families whose
rendering of them is exact) and prints, per family and in one run, the median over interleaved rounds (each
round measures all four on the same machine moment, so a load spike hits them alike):

- ``raw``: that family's own encoder over the distinct texts of a new request's rendering, nothing of ours
  around it (the ``tokenizers`` batch encode, tiktoken's ``encode_ordinary`` per text, Meta's cutting then
  tiktoken, or ``MistralTokenizer.encode_chat_completion`` of the request), plus the template's specials;
- ``cold``: our count of a new request's rendering with nothing known: this process's ``TextCounts`` empty and
  none of its keys in Redis, so every segment is hashed into its key, asked of Redis (one MGET), encoded,
  and kept in ``TextCounts`` and for Redis. The write to Redis (one script call, its reply skipped) is sent
  after the timing, as the API sends it once its answer is out (``RedisCountCache.flush``);
- ``warm``: our count of a new request of the same content (parsed and rendered again: new strings, whose
  hashes are computed as a real request's are), every segment already in this process's ``TextCounts`` —
  a worker's steady state: no key is built and Redis is not asked;
- ``warm from Redis`` (shown, no target): the same with this process's ``TextCounts`` empty and every
  segment in Redis (another worker counted them): every key built, one MGET.

The caches are the production classes (``RedisCountCache`` under a ``bench:`` prefix, ``TextCounts``); only
``count_stream`` is timed, never the parsing or rendering. Targets: cold ≤ 1.1 × raw, raw ≥ 50 × warm, each
ratio the median over the rounds of that round's own ratio (a round's measures are a few milliseconds apart,
so a slow spell of the machine weighs on both sides of it). The machines here are shared and noisy: compare
the ratios, not the milliseconds.

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

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from budgeting.admission.count_cache import RedisCountCache  # noqa: E402
from ladder.components import Limits  # noqa: E402
from ladder.counting import SegmentCounter, TextCounts, TokenizerCounter, count_stream  # noqa: E402
from ladder.encoders import TiktokenCounter  # noqa: E402
from ladder.families import load_counter  # noqa: E402
from ladder.mistral import MistralCounter  # noqa: E402
from ladder.parser import parse_components  # noqa: E402
from ladder.templates import ChatTemplate, Piece, Special, Text, get_template  # noqa: E402

# (family, file, template, tools rendered exactly): OpenAI does not publish its framing of tools, and
# DeepSeek-V3's published template renders none (both an upper bound, not a count), so their requests here
# have none.
FAMILIES = (
    ("byte-level-bpe", "deepseek_v3.json", "deepseek", False),
    ("o200k_base", "o200k_base.tiktoken", "openai", False),
    ("cl100k_base", "cl100k_base.tiktoken", "openai", False),
    ("llama3", "llama3.tokenizer.model", "llama3", True),
    ("mistral-tekken", "tekken_240718.json", "mistral", True),
    ("mistral-sentencepiece", "mistral_instruct_tokenizer_241114.model.v7", "mistral", True),
)

ROUNDS = 15
# As production's local layer would hold them: every segment of the request fits.
TEXT_CHARS = 20_000_000
PREFIX = "bench:"
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
    """Production's ``RedisCountCache`` (MGET; writes held, then one script call, its reply skipped), every
    key under ``bench:``."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.redis = RedisCountCache(client, ttl_seconds=600)

    def get_many(self, keys: Sequence[str]) -> list[int | None]:
        return self.redis.get_many([PREFIX + k for k in keys])

    def set_many(self, mapping: Mapping[str, int]) -> None:
        self.redis.set_many({PREFIX + k: v for k, v in mapping.items()})

    def flush(self) -> None:
        self.redis.flush()

    def clear(self) -> None:
        self.redis.discard_held()
        self.redis.clear_prefix(PREFIX)


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


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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


def rendering(template: ChatTemplate, data: dict[str, object]) -> tuple[Piece, ...]:
    """A new request's rendering: parsed and rendered from the JSON shape, so its strings are new objects."""
    return template.render(parse_components(json.loads(json.dumps(data)), limits=Limits()))


def bench(family: str, file: str, template_family: str, tools: bool, cache: BenchCache) -> dict[str, object]:
    tokenizer_dir = Path(os.environ.get("TOKENIZER_DIR", ROOT / "var" / "tokenizers"))
    counter = load_counter(family, tokenizer_dir / file)
    template = get_template(template_family)
    data = request(1)
    if not tools:
        data.pop("tools")
    pieces = rendering(template, data)
    every_text = [p.text for p in pieces if isinstance(p, Text)]
    specials = sum(1 for p in pieces if isinstance(p, Special))

    def raw(stream: tuple[Piece, ...]) -> Callable[[], int]:
        """The raw encoder over the distinct texts of ``stream`` (a new rendering each round: a string
        converted to UTF-8 once keeps that copy, and a new request's strings have none yet)."""
        encode = raw_encoder(counter, list(dict.fromkeys(p.text for p in stream if isinstance(p, Text))))
        return lambda: encode() + specials

    def ours(stream: tuple[Piece, ...], known: TextCounts) -> int:
        return count_stream(
            stream, counter, cache, template_revision=template.revision, image_formula="tiles512", known=known
        ).total

    total_raw = raw_encoder(counter, every_text)() + specials
    cache.clear()
    counted = ours(pieces, TextCounts(TEXT_CHARS))
    assert counted == total_raw, f"{family}: our count must equal the raw encoder's"
    samples: dict[str, list[float]] = {"raw": [], "cold": [], "warm": [], "redis": []}
    for _ in range(ROUNDS):
        samples["raw"].append(timed(raw(rendering(template, data))))
        cache.clear()
        known = TextCounts(TEXT_CHARS)
        stream = rendering(template, data)
        samples["cold"].append(timed(lambda: ours(stream, known)))  # noqa: B023 (called at once)
        cache.flush()
        stream = rendering(template, data)
        samples["warm"].append(timed(lambda: ours(stream, known)))  # noqa: B023
        stream = rendering(template, data)
        samples["redis"].append(timed(lambda: ours(stream, TextCounts(TEXT_CHARS))))  # noqa: B023
    cache.clear()
    raw_s, cold_s, warm_s, redis_s = (statistics.median(samples[k]) for k in ("raw", "cold", "warm", "redis"))

    def paired(over: str, under: str) -> float:
        return statistics.median(a / b for a, b in zip(samples[over], samples[under], strict=True))

    return {
        "family": family,
        "segments": len(set(every_text)),
        "tokens": total_raw,
        "raw_encode_ms": round(raw_s * 1000, 2),
        "cold_count_ms": round(cold_s * 1000, 2),
        "warm_count_ms": round(warm_s * 1000, 3),
        "warm_from_redis_ms": round(redis_s * 1000, 3),
        "cold_over_raw": round(paired("cold", "raw"), 3),
        "raw_over_warm": round(paired("raw", "warm"), 1),
        "raw_over_warm_from_redis": round(paired("raw", "redis"), 1),
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
