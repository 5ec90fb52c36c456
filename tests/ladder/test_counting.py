"""Counting: cache keys, batching, tokenizer hot swap, failure modes, the upper bound and performance."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ladder.counting import (
    CountingUnavailable,
    CountMethod,
    MemoryCountCache,
    TokenizerCounter,
    UpperBoundCounter,
    cache_key,
    count_stream,
    file_digest,
    rendered_digest,
    upper_bound_rule,
)
from ladder.templates import Piece, Special, Text

from .conftest import DEEPSEEK_FILE, LEGACY_FILE, deepseek_counter, legacy_counter
from .fixtures import Gen
from .strategies import FRAGMENTS


class SpyCounter:
    """Wraps a counter and records every batch it is asked to count."""

    def __init__(self, inner: TokenizerCounter | UpperBoundCounter) -> None:
        self.inner = inner
        self.calls: list[list[str]] = []

    @property
    def digest(self) -> str:
        return self.inner.digest

    @property
    def method(self) -> CountMethod:
        return self.inner.method

    def count_many(self, texts: Sequence[str]) -> list[int]:
        self.calls.append(list(texts))
        return self.inner.count_many(texts)


def stream(texts: Sequence[str]) -> list[Piece]:
    pieces: list[Piece] = [Special("<SOS>")]
    for index, text in enumerate(texts):
        pieces.append(Text("evidence", f"evidence:{index}", text))
        pieces.append(Special("<EOT>"))
    return pieces


def count(pieces: Sequence[Piece], counter: object, cache: MemoryCountCache, revision: str = "meta/1") -> int:
    return count_stream(pieces, counter, cache, template_revision=revision, image_formula="tiles512").total  # type: ignore[arg-type]


def test_misses_are_batched_into_one_call_and_then_served_from_cache() -> None:
    spy = SpyCounter(legacy_counter())
    cache = MemoryCountCache()
    pieces = stream(["alpha beta", "gamma", "alpha beta", "合同条款", "ﬁ ①"])
    first = count(pieces, spy, cache)
    assert spy.calls == [["alpha beta", "gamma", "合同条款", "ﬁ ①"]]
    assert count(pieces, spy, cache) == first
    assert len(spy.calls) == 1
    extended = stream(["alpha beta", "new text"])
    count(extended, spy, cache)
    assert spy.calls[-1] == ["new text"]


def test_cache_key_includes_tokenizer_template_and_content() -> None:
    key = cache_key("sha256:abc", "meta/1", "hello")
    assert key.startswith("tc:sha256:abc:meta/1:")
    assert key != cache_key("sha256:abd", "meta/1", "hello")
    assert key != cache_key("sha256:abc", "meta/2", "hello")
    assert key != cache_key("sha256:abc", "meta/1", "hello!")


def test_template_revision_separates_cache_entries() -> None:
    spy = SpyCounter(legacy_counter())
    cache = MemoryCountCache()
    count(stream(["same text"]), spy, cache, "meta/1")
    count(stream(["same text"]), spy, cache, "meta/2")
    assert len(spy.calls) == 2


def _modified_copy(source: Path, target: Path, drop_merges: int) -> Path:
    """A tokenizer file with its last merges removed: same format, different counts."""
    document = json.loads(source.read_text(encoding="utf-8"))
    document["model"]["merges"] = document["model"]["merges"][:-drop_merges]
    target.write_text(json.dumps(document), encoding="utf-8")
    return target


def test_hot_swap_gets_a_new_digest_and_never_reuses_old_counts(tmp_path: Path) -> None:
    old = legacy_counter()
    new = TokenizerCounter.from_file(_modified_copy(LEGACY_FILE, tmp_path / "swapped.json", 20_000))
    assert new.digest != old.digest
    assert new.digest == file_digest((tmp_path / "swapped.json").read_bytes())

    texts = [Gen(seed).prose(60) for seed in range(5)]
    pieces = stream(texts)
    cache = MemoryCountCache()
    count(pieces, old, cache)
    # Poison every entry of the old tokenizer: a reuse under the new one would show.
    for key in cache.data:
        cache.data[key] = 10**9
    spy = SpyCounter(new)
    total = count(pieces, spy, cache)
    assert spy.calls == [texts]
    assert total == sum(new.count_many(texts)) + len(texts) + 1
    assert new.count_many(texts) != old.count_many(texts)
    assert all(
        key.startswith(f"tc:{new.digest}:") or key.startswith(f"tc:{old.digest}:") for key in cache.data
    )


def test_hot_swap_in_place_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(LEGACY_FILE.read_bytes())
    before = TokenizerCounter.from_file(path)
    assert before.digest == legacy_counter().digest
    _modified_copy(LEGACY_FILE, path, 1000)
    after = TokenizerCounter.from_file(path)
    assert after.digest != before.digest


def test_a_symlink_pointed_at_another_file_is_detected(tmp_path: Path) -> None:
    """The stat key is the link's target (stat follows it), not the link's path."""
    link = tmp_path / "current.json"
    link.symlink_to(LEGACY_FILE)
    before = TokenizerCounter.from_file(link)
    assert before.digest == legacy_counter().digest
    link.unlink()
    link.symlink_to(_modified_copy(LEGACY_FILE, tmp_path / "next.json", 1000))
    after = TokenizerCounter.from_file(link)
    assert after.digest == file_digest((tmp_path / "next.json").read_bytes()) != before.digest


def test_a_file_is_loaded_once_per_process() -> None:
    assert TokenizerCounter.from_file(DEEPSEEK_FILE).tokenizer is deepseek_counter().tokenizer
    assert TokenizerCounter.from_file(str(DEEPSEEK_FILE)).tokenizer is deepseek_counter().tokenizer


def test_missing_corrupt_or_unexpected_files_make_counting_unavailable(tmp_path: Path) -> None:
    with pytest.raises(CountingUnavailable):
        TokenizerCounter.from_file(tmp_path / "missing.json")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"model": ', encoding="utf-8")
    with pytest.raises(CountingUnavailable):
        TokenizerCounter.from_file(corrupt)
    with pytest.raises(CountingUnavailable):
        TokenizerCounter.from_file(LEGACY_FILE, expected_digest=deepseek_counter().digest)
    assert TokenizerCounter.from_file(LEGACY_FILE, expected_digest=legacy_counter().digest).method == "EXACT"


def test_a_malformed_counter_answer_is_refused() -> None:
    class Broken:
        digest = "sha256:broken"
        method: CountMethod = "EXACT"

        def count_many(self, texts: Sequence[str]) -> list[int]:
            return [1]

    with pytest.raises(ValueError):
        count(stream(["a", "b"]), Broken(), MemoryCountCache())


def test_the_approved_bounds_of_the_real_files() -> None:
    assert upper_bound_rule(json.loads(DEEPSEEK_FILE.read_text(encoding="utf-8"))) == "UTF8_BYTES"
    assert upper_bound_rule(json.loads(LEGACY_FILE.read_text(encoding="utf-8"))) == "NFKC_UTF8_BYTES"
    assert upper_bound_rule({"model": {"type": "WordPiece"}, "pre_tokenizer": {"type": "ByteLevel"}}) is None
    assert upper_bound_rule({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Whitespace"}}) is None
    assert (
        upper_bound_rule(
            {
                "model": {"type": "BPE"},
                "pre_tokenizer": {"type": "ByteLevel"},
                "normalizer": {"type": "Lowercase"},
            }
        )
        is None
    )


def test_upper_bound_counter_is_a_distinct_cache_identity() -> None:
    bound = UpperBoundCounter(nfkc=True, tokenizer_digest=legacy_counter().digest)
    assert bound.digest != legacy_counter().digest
    assert bound.method == "UPPER_BOUND"
    # NFKC can expand a lot: this one character (3 bytes) becomes eighteen.
    assert bound.count_many(["\ufdfa"])[0] > 18
    assert UpperBoundCounter(nfkc=False, tokenizer_digest="x").count_many(["\ufdfa"]) == [3]


any_text = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from([*FRAGMENTS, "<EOT>", "<think>"]), max_size=12).map("".join),
)


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(any_text, min_size=1, max_size=5))
def test_the_upper_bound_is_never_below_the_exact_count(texts: list[str]) -> None:
    for exact, nfkc in ((deepseek_counter(), False), (legacy_counter(), True)):
        bound = UpperBoundCounter(nfkc=nfkc, tokenizer_digest=exact.digest)
        for upper, counted in zip(bound.count_many(texts), exact.count_many(texts), strict=True):
            assert upper >= counted


def test_rendered_digest_is_canonical() -> None:
    first = rendered_digest({"b": [1, {"y": "合同", "x": None}], "a": "ﬁ"})
    second = rendered_digest({"a": "ﬁ", "b": [1, {"x": None, "y": "合同"}]})
    assert first == second
    assert first.startswith("sha256:") and len(first) == len("sha256:") + 64
    assert rendered_digest({"a": "ﬁ"}) != rendered_digest({"a": "fi"})
