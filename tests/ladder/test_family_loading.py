"""Tokenizer families: each loads its pinned file, refuses what is not its own, one counter per file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ladder.counting import CountingUnavailable
from ladder.encoders import llama3_chunks
from ladder.families import FAMILIES, checked_by_content, get_family, load_counter

from .conftest import DEEPSEEK_FILE, TOKENIZER_DIR

FILES = {
    "byte-level-bpe": DEEPSEEK_FILE,
    "o200k_base": TOKENIZER_DIR / "o200k_base.tiktoken",
    "cl100k_base": TOKENIZER_DIR / "cl100k_base.tiktoken",
    "llama3": TOKENIZER_DIR / "llama3.tokenizer.model",
}


@pytest.mark.parametrize("family", sorted(FILES))
def test_each_family_loads_its_file_once_per_content(family: str) -> None:
    counter = load_counter(family, FILES[family])
    assert counter.method == "EXACT"
    assert load_counter(family, FILES[family]) is counter
    assert counter.count_many(["hello world", ""])[1] == 0


def test_an_unknown_family_a_wrong_file_and_a_wrong_digest_are_unavailable(tmp_path: Path) -> None:
    with pytest.raises(CountingUnavailable, match="unknown tokenizer family"):
        load_counter("sentencepiece", FILES["llama3"])
    with pytest.raises(CountingUnavailable, match="cannot be loaded as o200k_base"):
        load_counter("o200k_base", DEEPSEEK_FILE)
    with pytest.raises(CountingUnavailable, match="expected sha256:00"):
        load_counter("llama3", FILES["llama3"], expected_digest="sha256:" + "0" * 64)
    with pytest.raises(CountingUnavailable, match="unavailable"):
        load_counter("llama3", tmp_path / "missing.model")


def test_a_replaced_file_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "vocab.tiktoken"
    shutil.copy(FILES["cl100k_base"], path)
    first = load_counter("cl100k_base", path)
    shutil.copy(FILES["o200k_base"], tmp_path / "other")
    (tmp_path / "other").replace(path)
    second = load_counter("cl100k_base", path)
    assert second.digest != first.digest


def test_tiktoken_families_have_the_byte_bound_and_check_their_format() -> None:
    for name in ("o200k_base", "cl100k_base", "llama3"):
        assert get_family(name).bound_rule(FILES[name].read_bytes()) == "UTF8_BYTES"
        with pytest.raises(ValueError):
            get_family(name).bound_rule(DEEPSEEK_FILE.read_bytes())
    assert set(FILES) <= set(FAMILIES)


def test_a_check_of_a_file_runs_once_per_content_and_kind_and_a_refusal_is_not_remembered() -> None:
    seen: list[bytes] = []

    def check(data: bytes) -> int:
        seen.append(data)
        if data == b"not a file of its family":
            raise ValueError(data)
        return len(data)

    kind = f"test-{id(seen)}"  # a kind no other test checks under
    assert checked_by_content(kind, b"one", check) == 3
    assert checked_by_content(kind, b"one", check) == 3
    assert seen == [b"one"]
    assert checked_by_content(kind, b"other", check) == 5  # another content is checked
    assert checked_by_content(f"{kind}-2", b"one", check) == 3  # so is the same content under another kind
    assert seen == [b"one", b"other", b"one"]
    for _ in range(2):
        with pytest.raises(ValueError):
            checked_by_content(kind, b"not a file of its family", check)
    assert seen[3:] == [b"not a file of its family"] * 2


def test_a_family_refuses_a_file_not_its_own_after_accepting_its_own() -> None:
    # The bound rule is remembered by content: a file of another format with the same family is still refused.
    family = get_family("cl100k_base")
    assert family.bound_rule(FILES["cl100k_base"].read_bytes()) == "UTF8_BYTES"
    with pytest.raises(ValueError):
        family.bound_rule(DEEPSEEK_FILE.read_bytes())
    assert family.bound_rule(FILES["cl100k_base"].read_bytes()) == "UTF8_BYTES"


def test_llama3_cuts_long_runs_where_meta_does() -> None:
    text = "a" * 60_000 + " " * 3 + "b"
    chunks = list(llama3_chunks(text))
    assert "".join(chunks) == text
    assert [len(chunk) for chunk in chunks] == [25_000, 25_000, 10_004]
    assert list(llama3_chunks("")) == []
