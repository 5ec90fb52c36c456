"""Tokenizer families: how a tokenizer file becomes a counter, which chat templates frame it, and its bound.

A model revision names its tokenizer, and the tokenizer names its family (the catalog's ``Tokenizer.family``).
The family says how the file's bytes are read (a Hugging Face ``tokenizers`` JSON, or a tiktoken BPE file
with the vendor's split pattern and special tokens), which chat-template families are proven for it, and the
upper bound proven for it when counting is unavailable. A family not listed here is refused by provisioning.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import tiktoken
from tokenizers import Tokenizer

from ladder.counting import CountingUnavailable, SegmentCounter, TokenizerCounter, UpperBoundRule, file_digest
from ladder.counting import upper_bound_rule as json_upper_bound_rule
from ladder.encoders import TiktokenCounter, llama3_chunks, parse_tiktoken_bpe
from ladder.mistral import load_mistral

Loader = Callable[[bytes, str, str], SegmentCounter]
"""Builds a counter from a file's bytes, its digest and its file name."""


class UnknownFamily(ValueError):
    """A tokenizer family that is not in ``FAMILIES``."""


# The split patterns and special tokens are the vendors' (tiktoken_ext.openai_public for OpenAI,
# llama_models.llama3.tokenizer for Meta): the golden tests compare ids with those very modules.
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
    r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA3_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)


def _hf_json(data: bytes, digest: str, name: str) -> SegmentCounter:
    # Content that spells an added token is counted as that token, as a server's tokenizer reads the prompt.
    return TokenizerCounter(Tokenizer.from_buffer(data), digest)


def _openai(encoding_name: str, pattern: str) -> Loader:
    def load(data: bytes, digest: str, name: str) -> SegmentCounter:
        encoding = tiktoken.Encoding(
            name=encoding_name, pat_str=pattern, mergeable_ranks=parse_tiktoken_bpe(data), special_tokens={}
        )
        return TiktokenCounter(encoding, digest, specials={})

    return load


def _llama3(data: bytes, digest: str, name: str) -> SegmentCounter:
    ranks = parse_tiktoken_bpe(data)
    # Meta's tokenizer numbers 256 special tokens after the vocabulary: its named ones, then reserved ones.
    names = LLAMA3_SPECIALS + tuple(
        f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(LLAMA3_SPECIALS))
    )
    specials = {token: len(ranks) + index for index, token in enumerate(names)}
    encoding = tiktoken.Encoding(
        name="llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    return TiktokenCounter(encoding, digest, specials=specials, chunks=llama3_chunks)


def _json_bound(data: bytes) -> UpperBoundRule | None:
    document = json.loads(data)
    if not isinstance(document, dict):
        raise ValueError("a tokenizers JSON file is an object")
    return json_upper_bound_rule(document)


def _tiktoken_bound(data: bytes) -> UpperBoundRule | None:
    # Every token of a tiktoken vocabulary is a non-empty byte string and nothing normalises the text first,
    # so a text never has more tokens than UTF-8 bytes (the Llama 3 cutting only splits the text).
    parse_tiktoken_bpe(data)
    return "UTF8_BYTES"


def _tekken_check(data: bytes) -> UpperBoundRule | None:
    # No approved bound: Mistral's rendering re-serialises tool JSON and merges messages, so the bytes of the
    # request JSON are not proven to exceed its tokens.
    document = json.loads(data)
    if not isinstance(document, dict) or not {"config", "vocab"} <= document.keys():
        raise ValueError("a tekken file has a config and a vocab")
    return None


def _sentencepiece_check(data: bytes) -> UpperBoundRule | None:
    import sentencepiece

    try:
        sentencepiece.SentencePieceProcessor(model_proto=data)
    except Exception as exc:  # the C++ loader raises plain RuntimeError/OSError for anything malformed
        raise ValueError(f"not a sentencepiece model: {exc}") from exc
    # No approved bound: sentencepiece adds a dummy prefix to each piece mistral_common encodes.
    return None


T = TypeVar("T")

_LOCK = threading.Lock()
# The answers of checks of whole files (``checked_by_content``): a process sees a handful of files.
_CHECKED: dict[tuple[str, bytes], object] = {}
_CHECKED_KEPT = 64


def checked_by_content(kind: str, data: bytes, check: Callable[[bytes], T]) -> T:
    """``check(data)``, remembered by ``kind`` and the sha256 of ``data``. A check of a tokenizer file parses
    all of it (DeepSeek-V3's 8 MB JSON, say), and provisioning checks every file a document names each time it
    reads one. What ``check`` raises is raised again on the next call, not remembered."""
    key = (kind, hashlib.sha256(data).digest())
    with _LOCK:
        if key in _CHECKED:
            return cast(T, _CHECKED[key])
    answer = check(data)
    with _LOCK:
        if len(_CHECKED) >= _CHECKED_KEPT:
            _CHECKED.clear()
        _CHECKED[key] = answer
    return answer


@dataclass(frozen=True)
class Family:
    """One tokenizer family: its loader, the chat templates proven for it, and its file check and bound."""

    name: str
    description: str
    templates: frozenset[str]
    loader: Loader
    check: Callable[[bytes], UpperBoundRule | None]

    def bound_rule(self, data: bytes) -> UpperBoundRule | None:
        """Return the upper-bound rule proven for this file of the family, or None.

        Raises ValueError when the bytes are not a file of this family's format. Remembered by the file's
        content (``checked_by_content``).
        """
        return checked_by_content(self.name, data, self.check)


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "byte-level-bpe",
            "Hugging Face tokenizers JSON, byte-level BPE without a normaliser",
            frozenset({"deepseek", "meta"}),
            _hf_json,
            _json_bound,
        ),
        Family(
            "byte-level-bpe-nfkc",
            "Hugging Face tokenizers JSON, byte-level BPE after NFKC",
            # Not deepseek: its cuts are proven for DeepSeek-V3's pre-tokenizer, which has no normaliser.
            frozenset({"meta"}),
            _hf_json,
            _json_bound,
        ),
        Family(
            "o200k_base",
            "OpenAI o200k_base (tiktoken BPE file): GPT-4o, 4.1, 5, o-series",
            frozenset({"openai"}),
            _openai("o200k_base", O200K_PATTERN),
            _tiktoken_bound,
        ),
        Family(
            "cl100k_base",
            "OpenAI cl100k_base (tiktoken BPE file): GPT-4, GPT-3.5",
            frozenset({"openai"}),
            _openai("cl100k_base", CL100K_PATTERN),
            _tiktoken_bound,
        ),
        Family(
            "llama3",
            "Meta Llama 3.x (tiktoken BPE file, Meta's pattern and 256 special tokens)",
            frozenset({"llama3"}),
            _llama3,
            _tiktoken_bound,
        ),
        Family(
            "mistral-tekken",
            "Mistral tekken JSON (Nemo, Pixtral, Large 2, Small 3), framed by mistral_common",
            frozenset({"mistral"}),
            load_mistral,
            _tekken_check,
        ),
        Family(
            "mistral-sentencepiece",
            "Mistral sentencepiece .model.v3/.v7 (7B v0.3, Mixtral, Large 2411), framed by mistral_common",
            frozenset({"mistral"}),
            load_mistral,
            _sentencepiece_check,
        ),
    )
}
TOKENIZER_FAMILIES: tuple[str, ...] = tuple(sorted(FAMILIES))


def get_family(name: str) -> Family:
    """Return the family called ``name``. Raises UnknownFamily."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownFamily(
            f"unknown tokenizer family {name!r} (known: {', '.join(TOKENIZER_FAMILIES)})"
        ) from None


# One counter per file content per process, and the digest of each file version seen (keyed by its stat).
_BY_DIGEST: dict[str, SegmentCounter] = {}
_DIGEST_BY_STAT: dict[tuple[str, str, int, int, int, int, int], str] = {}


def load_counter(family: str, path: Path, *, expected_digest: str | None = None) -> SegmentCounter:
    """Return the exact counter of the ``family`` file at ``path``, built at most once per file content.

    The digest is computed from the very bytes that are loaded, so it always names what counts.
    Raises CountingUnavailable if the family is unknown, the file is missing, unreadable or not of the
    family, or (when ``expected_digest`` is given) not the expected file.
    """
    try:
        loader = get_family(family).loader
        # A rewritten or replaced file (or a symlink pointed elsewhere: stat follows it) has a new stat key,
        # so it is read and hashed again. No resolve(): it costs ten stats, on every admission.
        stat = path.stat()
        key = (family, str(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
        with _LOCK:
            digest = _DIGEST_BY_STAT.get(key, "")
            counter = _BY_DIGEST.get(f"{family}:{digest}")
        if counter is None:
            data = path.read_bytes()
            digest = file_digest(data)
            counter = loader(data, digest, path.name)
            with _LOCK:
                counter = _BY_DIGEST.setdefault(f"{family}:{digest}", counter)
                _DIGEST_BY_STAT[key] = digest
    except UnknownFamily as exc:
        raise CountingUnavailable(str(exc)) from exc
    except OSError as exc:
        raise CountingUnavailable(f"tokenizer file {path} is unavailable: {exc}") from exc
    except Exception as exc:  # the Rust loaders raise plain Exception for a malformed file
        raise CountingUnavailable(f"tokenizer file {path} cannot be loaded as {family}: {exc}") from exc
    if expected_digest is not None and digest != expected_digest:
        raise CountingUnavailable(f"tokenizer file {path} has digest {digest}, expected {expected_digest}")
    return counter
