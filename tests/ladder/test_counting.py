"""Counting: cache keys, batching, tokenizer hot swap, failure modes, the upper bound and performance."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ladder.counting import (
    Count,
    CountingUnavailable,
    CountMethod,
    MemoryCountCache,
    TextCounts,
    TokenizerCounter,
    UpperBoundCounter,
    cache_key,
    count_stream,
    file_digest,
    image_tokens,
    rendered_digest,
    upper_bound_rule,
)
from ladder.templates import Bound, Cut, Image, Piece, Special, Text

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


class SpyCache(MemoryCountCache):
    """A shared cache that records every key it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[list[str]] = []

    def get_many(self, keys: Sequence[str]) -> list[int | None]:
        self.asked.append(list(keys))
        return super().get_many(keys)


def new_strings(texts: Sequence[str]) -> list[str]:
    """Equal texts as new string objects (as a new request's parse makes them)."""
    return [(text + "\x00")[:-1] for text in texts]


def known_count(
    pieces: Sequence[Piece],
    counter: object,
    cache: MemoryCountCache,
    known: TextCounts,
    revision: str = "meta/1",
) -> int:
    return count_stream(
        pieces,
        counter,  # type: ignore[arg-type]
        cache,
        template_revision=revision,
        image_formula="tiles512",
        known=known,
    ).total


def test_a_warm_count_asks_neither_the_shared_cache_nor_the_counter() -> None:
    texts = [Gen(seed).prose(40) for seed in range(4)] + ["合同条款"]
    spy, cache, known = SpyCounter(legacy_counter()), SpyCache(), TextCounts(10_000)
    first = known_count(stream(texts), spy, cache, known)
    assert len(spy.calls) == 1 and len(cache.asked) == 1
    again = new_strings(texts)
    assert all(a is not b for a, b in zip(again, texts, strict=True))
    assert known_count(stream(again), spy, cache, known) == first
    assert len(spy.calls) == 1 and len(cache.asked) == 1, "every segment came from the process's counts"
    # Another process (an empty TextCounts) finds them in the shared cache, and keeps them.
    other = TextCounts(10_000)
    assert known_count(stream(again), spy, cache, other) == first
    assert len(spy.calls) == 1 and len(cache.asked) == 2
    assert other.get_many(spy.digest, "meta/1", texts) == known.get_many(spy.digest, "meta/1", texts)


def test_process_counts_are_kept_apart_by_counter_digest_and_template_revision() -> None:
    known = TextCounts(1_000)
    known.set_many("sha256:a", "meta/1", {"hello": 3})
    assert known.get_many("sha256:a", "meta/1", ["hello", "other"]) == [3, None]
    assert known.get_many("sha256:b", "meta/1", ["hello"]) == [None]
    assert known.get_many("sha256:a", "meta/2", ["hello"]) == [None]

    spy, cache = SpyCounter(legacy_counter()), MemoryCountCache()
    known_count(stream(["same text"]), spy, cache, known, "meta/1")
    known_count(stream(["same text"]), spy, cache, known, "meta/2")
    assert len(spy.calls) == 2, "a new template revision is counted anew"


def test_a_hot_swapped_tokenizer_never_reuses_the_process_counts_of_the_old_one(tmp_path: Path) -> None:
    old = legacy_counter()
    new = TokenizerCounter.from_file(_modified_copy(LEGACY_FILE, tmp_path / "swapped.json", 20_000))
    texts = [Gen(seed).prose(60) for seed in range(5)]
    known = TextCounts(100_000)
    known_count(stream(texts), old, MemoryCountCache(), known)
    # Poison the old tokenizer's entries: a reuse under the new digest would show.
    known.set_many(old.digest, "meta/1", dict.fromkeys(texts, 10**9))
    spy = SpyCounter(new)
    total = known_count(stream(texts), spy, MemoryCountCache(), known)
    assert spy.calls == [texts]
    assert total == sum(new.count_many(texts)) + len(texts) + 1
    assert known.get_many(new.digest, "meta/1", texts) == new.count_many(texts)


def test_process_counts_are_bounded_by_characters_least_recently_used_out_first() -> None:
    known = TextCounts(10)
    known.set_many("d", "r", {"aaaa": 1, "bbbb": 2})
    assert known.get_many("d", "r", ["aaaa"]) == [1]  # "aaaa" is now the most recently used
    known.set_many("d", "r", {"cccc": 3})
    assert known.get_many("d", "r", ["aaaa", "bbbb", "cccc"]) == [1, None, 3]
    assert known.chars == 8 and len(known) == 2
    known.set_many("d", "r", {"x" * 11: 4})
    assert known.get_many("d", "r", ["x" * 11]) == [None], "a text over the bound is not kept"
    known.clear()
    assert len(known) == 0 and known.chars == 0
    nothing = TextCounts(0)
    nothing.set_many("d", "r", {"a": 1})
    assert len(nothing) == 0


def test_the_least_recently_used_table_is_emptied_first() -> None:
    known = TextCounts(12)
    known.set_many("old", "r", {"aaaa": 1, "bbbb": 2})
    known.set_many("new", "r", {"cccc": 3})
    assert known.get_many("new", "r", ["cccc"]) == [3]  # "new" is the table used most recently
    known.set_many("new", "r", {"dddd": 4, "eeee": 5})
    # Over the bound by eight characters: the old table's two texts go, not the new table's older one.
    assert known.get_many("old", "r", ["aaaa", "bbbb"]) == [None, None]
    assert known.get_many("new", "r", ["cccc", "dddd", "eeee"]) == [3, 4, 5]
    assert known.chars == 12 and len(known) == 3
    known.set_many("old", "r", {"ffff": 6})
    assert known.get_many("new", "r", ["cccc"]) == [None], "then the least recently used text of the next"
    assert known.get_many("old", "r", ["ffff"]) == [6] and known.chars == 12


def test_a_lookup_refreshes_only_what_it_found_and_a_rewrite_is_not_counted_twice() -> None:
    known = TextCounts(12)
    known.set_many("d", "r", {"aaaa": 1, "bbbb": 2, "cccc": 3})
    assert known.get_many("d", "r", ["zzzz", "aaaa", "aaaa"]) == [None, 1, 1]
    known.set_many("d", "r", {"bbbb": 20})  # already held: refreshed, its characters not added again
    assert known.chars == 12
    known.set_many("d", "r", {"dddd": 4})
    assert known.get_many("d", "r", ["aaaa", "bbbb", "cccc", "dddd"]) == [1, 20, None, 4]
    assert known.get_many("other", "r", ["aaaa"]) == [None] and len(known) == 3


OBJECTS = ["template", "evidence:e1", "evidence:e2", "tools:t1"]
piece_texts = st.sampled_from(["system", "\n\n", "alpha beta", "合同条款", "x" * 30, " ", "ﬁ ①"])
costing_pieces = st.one_of(
    st.builds(
        Text, st.sampled_from(["template", "evidence", "tools"]), st.sampled_from(OBJECTS), piece_texts
    ),
    st.builds(Bound, st.sampled_from(["template", "tools"]), st.sampled_from(OBJECTS), piece_texts),
    st.builds(
        Image, st.just("evidence"), st.sampled_from(OBJECTS), st.integers(1, 3000), st.integers(1, 3000)
    ),
)


def reference_count(
    pieces: Sequence[Piece], counter: TokenizerCounter
) -> tuple[dict[str, int], dict[str, int]]:
    """Per bucket and per object, one piece at a time, the specials (the template's) last."""
    per_bucket: dict[str, int] = {}
    per_object: dict[str, int] = {}
    specials = [piece for piece in pieces if isinstance(piece, Special)]
    for piece in [*(p for p in pieces if not isinstance(p, Special | Cut)), *specials]:
        if isinstance(piece, Special):
            bucket, object_id, tokens = "template", "template", 1
        elif isinstance(piece, Text):
            bucket, object_id, tokens = piece.bucket, piece.object_id, counter.count_many([piece.text])[0]
        elif isinstance(piece, Bound):
            bucket, object_id, tokens = piece.bucket, piece.object_id, len(piece.text.encode("utf-8"))
        else:
            assert isinstance(piece, Image)
            bucket, object_id = piece.bucket, piece.object_id
            tokens = image_tokens(piece.width, piece.height, "tiles512")
        per_bucket[bucket] = per_bucket.get(bucket, 0) + tokens
        per_object[object_id] = per_object.get(object_id, 0) + tokens
    return per_bucket, per_object


@settings(max_examples=200, deadline=None)
@given(
    costing=st.lists(costing_pieces, max_size=14),
    separators=st.lists(st.sampled_from([Special("<S>"), Cut()])),
)
def test_every_path_gives_the_count_one_piece_at_a_time_gives(
    costing: list[Piece], separators: list[Piece]
) -> None:
    pieces: list[Piece] = [Special("<SOS>")]
    for index, piece in enumerate(costing):
        pieces.extend((piece, separators[index] if index < len(separators) else Special("<EOT>")))
    counter = legacy_counter()
    per_bucket, per_object = reference_count(pieces, counter)
    has_bound = any(isinstance(piece, Bound) for piece in pieces)
    known, cache = TextCounts(10_000), MemoryCountCache()

    def counted(known: TextCounts | None = None, memo: dict[str, int] | None = None) -> Count:
        return count_stream(
            pieces,
            counter,
            cache,
            template_revision="meta/1",
            image_formula="tiles512",
            memo=memo,
            known=known,
        )

    cold, shared, warm, memo = counted(known=known), counted(), counted(known=known), {"stale": 7}
    walked = counted(known=known, memo=memo)
    for result in (cold, shared, warm, walked):
        assert (result.per_bucket, result.per_object) == (per_bucket, per_object)
        assert list(result.per_bucket) == list(per_bucket) and list(result.per_object) == list(per_object)
        assert result.total == sum(per_bucket.values())
        assert result.method == ("UPPER_BOUND" if has_bound else "EXACT")
    texts = {piece.text for piece in pieces if isinstance(piece, Text)}
    assert memo == {"stale": 7} | {text: counter.count_many([text])[0] for text in texts}


def test_the_steady_state_fills_the_walk_memo_and_asks_nothing_else() -> None:
    texts = ["alpha beta", "gamma", "alpha beta"]
    spy, cache, known = SpyCounter(legacy_counter()), SpyCache(), TextCounts(10_000)
    first = known_count(stream(texts), spy, cache, known)
    memo: dict[str, int] = {}
    again = count_stream(
        stream(new_strings(texts)),
        spy,
        cache,
        template_revision="meta/1",
        image_formula="tiles512",
        memo=memo,
        known=known,
    )
    assert again.total == first and len(spy.calls) == 1 and len(cache.asked) == 1
    assert memo == dict(zip(texts, legacy_counter().count_many(texts), strict=True))


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
    first = TokenizerCounter.from_file(DEEPSEEK_FILE).tokenizer
    assert TokenizerCounter.from_file(DEEPSEEK_FILE).tokenizer is first
    assert TokenizerCounter.from_file(str(DEEPSEEK_FILE)).tokenizer is first


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
