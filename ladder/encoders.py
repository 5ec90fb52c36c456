"""Exact counters of tiktoken-format vocabularies: OpenAI ``o200k_base``/``cl100k_base`` and Llama 3.

A tiktoken BPE file is one ``base64(token bytes) rank`` line per token; the split pattern and the special
tokens are not in the file but in the vendor's code, so each family here names them (``ladder.families``) and
the golden tests prove the resulting ids equal to the vendor's own encoder (``tiktoken.get_encoding`` for
OpenAI, ``llama_models``' Tokenizer for Llama). Content is always encoded as ordinary text: a special
token's spelling inside content counts as the text it is, as ``TokenizerCounter`` does.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import tiktoken

from ladder.counting import CountMethod


def parse_tiktoken_bpe(data: bytes) -> dict[bytes, int]:
    """Return the mergeable ranks of a tiktoken BPE file.

    Raises ValueError when a line is not ``base64 rank`` or a rank repeats (not a tiktoken file).
    """
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if not line:
            continue
        token, rank = line.split()
        ranks[base64.b64decode(token, validate=True)] = int(rank)
    if len(set(ranks.values())) != len(ranks):
        raise ValueError("ranks repeat: not a tiktoken BPE file")
    return ranks


# Meta's Llama 3 tokenizer encodes at most this many characters per tiktoken call, and cuts any run of
# whitespace or non-whitespace longer than the second figure (a guard against tiktoken's slow path on long
# runs). Cutting changes where BPE may merge, so the exact count must cut in the very same places.
LLAMA3_MAX_ENCODE_CHARS = 400_000
LLAMA3_MAX_RUN = 25_000


_LONG_RUN = re.compile(rf"\s{{{LLAMA3_MAX_RUN + 1}}}|\S{{{LLAMA3_MAX_RUN + 1}}}")


def llama3_chunks(text: str) -> Iterator[str]:
    """Yield the pieces Meta's Llama 3 tokenizer encodes one by one for ``text``, in order."""
    for start in range(0, len(text), LLAMA3_MAX_ENCODE_CHARS):
        window = text[start : start + LLAMA3_MAX_ENCODE_CHARS]
        # Meta's loop cuts only inside a run longer than the limit; without one (nearly always) the window
        # is one piece, found by the regex engine instead of a Python loop over every character.
        if _LONG_RUN.search(window) is None:
            yield window
            continue
        run = 0
        run_is_space = window[0].isspace() if window else False
        cut = 0
        for index, char in enumerate(window):
            is_space = char.isspace()
            if is_space != run_is_space:
                run, run_is_space = 1, is_space
                continue
            run += 1
            if run > LLAMA3_MAX_RUN:
                yield window[cut:index]
                cut, run = index, 1
        yield window[cut:]


@dataclass(frozen=True, eq=False)
class TiktokenCounter:
    """Exact counts with a tiktoken encoding built from a pinned vocabulary file.

    ``specials`` maps the family's special-token spellings to their ids (the ids a template's specials
    stand for); ``chunks``, when set, is the vendor's own cutting of a text before it is encoded.
    """

    encoding: tiktoken.Encoding
    digest: str
    specials: dict[str, int]
    chunks: Callable[[str], Iterator[str]] | None = None

    @property
    def method(self) -> CountMethod:
        """Always ``EXACT``."""
        return "EXACT"

    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text`` as ordinary text."""
        if self.chunks is None:
            return self.encoding.encode_ordinary(text)
        ids: list[int] = []
        for chunk in self.chunks(text):
            ids.extend(self.encoding.encode_ordinary(chunk))
        return ids

    def special_id(self, token: str) -> int | None:
        """Return the id of a special token of this family, or None when the family gives it none."""
        return self.specials.get(token)

    def count_many(self, texts: Sequence[str]) -> list[int]:
        """Return the exact token count of each text."""
        # Not encode_ordinary_batch: it starts a thread pool on every call, which costs more than it saves.
        encode = self.encoding.encode_ordinary
        if self.chunks is None:
            return [len(encode(text)) for text in texts]
        chunks = self.chunks
        return [sum(len(encode(chunk)) for chunk in chunks(text)) for text in texts]
