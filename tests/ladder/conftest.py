"""Shared fixtures of the ladder tests: the real tokenizer files, model specs and counters. No database."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from ladder.counting import SegmentCounter, TokenizerCounter, UpperBoundRule, upper_bound_rule
from ladder.families import load_counter
from ladder.rungs import ModelSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = Path(os.environ.get("TOKENIZER_DIR", REPO_ROOT / "var" / "tokenizers"))
DEEPSEEK_FILE = TOKENIZER_DIR / "deepseek_v3.json"
LEGACY_FILE = TOKENIZER_DIR / "claude_legacy.json"

ALL_CAPABILITIES = frozenset({"tools", "json_schema", "vision"})


def deepseek_counter() -> TokenizerCounter:
    """DeepSeek-V3's counter as the API loads it."""
    counter = load_counter("byte-level-bpe", DEEPSEEK_FILE)
    assert isinstance(counter, TokenizerCounter)
    return counter


def legacy_counter() -> TokenizerCounter:
    return TokenizerCounter.from_file(LEGACY_FILE)


def raw_tokenizer(path: Path) -> Tokenizer:
    """A separate instance that recognises special tokens: the oracle for whole-stream counts."""
    return Tokenizer.from_file(str(path))


@functools.cache
def bound_rule(path: Path) -> UpperBoundRule | None:
    return upper_bound_rule(json.loads(path.read_text(encoding="utf-8")))


def models(context_window: int = 200_000) -> dict[str, ModelSpec]:
    """The primary model, a compatible fallback on the other tokenizer, and one fallback per failing
    dimension."""
    ds = deepseek_counter().digest
    legacy = legacy_counter().digest
    ds_bound = bound_rule(DEEPSEEK_FILE)
    legacy_bound = bound_rule(LEGACY_FILE)

    def spec(model_id: str, digest: str, family: str, **overrides: object) -> ModelSpec:
        fields: dict[str, object] = {
            "id": model_id,
            "context_window": context_window,
            "max_output": 8000,
            "template_family": family,
            "image_formula": "tiles512" if family == "deepseek" else "pixels750",
            "capabilities": ALL_CAPABILITIES,
            "data_residency": "eu",
            "safety_tier": 2,
            "tokenizer_digest": digest,
            "upper_bound": ds_bound if family == "deepseek" else legacy_bound,
        }
        fields.update(overrides)
        return ModelSpec(**fields)  # type: ignore[arg-type]

    return {
        "ds@1": spec("ds@1", ds, "deepseek"),
        "legacy@1": spec("legacy@1", legacy, "meta", context_window=context_window * 4),
        "us@1": spec("us@1", legacy, "meta", context_window=context_window * 4, data_residency="us"),
        "notools@1": spec(
            "notools@1",
            legacy,
            "meta",
            context_window=context_window * 4,
            capabilities=frozenset({"json_schema"}),
        ),
        "lowtier@1": spec("lowtier@1", legacy, "meta", context_window=context_window * 4, safety_tier=1),
    }


def counter_for(model: ModelSpec) -> SegmentCounter:
    """Exact counters by tokenizer digest, as the platform's registry would resolve them."""
    for counter in (deepseek_counter(), legacy_counter()):
        if counter.digest == model.tokenizer_digest:
            return counter
    raise AssertionError(f"no tokenizer for {model.id}")


@pytest.fixture(scope="session")
def raw_tokenizers() -> dict[str, Tokenizer]:
    """Oracle tokenizers by tokenizer digest."""
    return {
        deepseek_counter().digest: raw_tokenizer(DEEPSEEK_FILE),
        legacy_counter().digest: raw_tokenizer(LEGACY_FILE),
    }


@pytest.fixture
def spec_models() -> dict[str, ModelSpec]:
    return models()


@pytest.fixture
def counters() -> Callable[[ModelSpec], SegmentCounter]:
    return counter_for
