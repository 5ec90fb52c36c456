"""What the simulated model answers: prompt token counts and deterministic words, chunk by chunk, with usage.

Prompt tokens come from a pluggable counter over the request's ``messages``. Completion tokens are words from
a generator seeded by ``(seed, request id)``, one word = one token.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

PromptCounter = Callable[[Sequence[Mapping[str, Any]]], int]

_VOCABULARY: Final = (
    "the", "contract", "clause", "party", "shall", "notice", "term", "review", "liability", "payment",
    "within", "days", "of", "and", "to", "evidence", "section", "agreement", "may", "not", "exceed",
    "limit", "obligation", "under", "this", "renewal", "termination", "breach", "cure", "period",
    "written", "consent",
)  # fmt: skip


def default_prompt_counter(messages: Sequence[Mapping[str, Any]]) -> int:
    """UTF-8 bytes of each message's text // 4, plus 4 per message for the chat-template overhead."""
    return sum(len(_message_text(message).encode()) // 4 + 4 for message in messages)


def _message_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


@dataclass(frozen=True)
class Completion:
    """The deterministic answer to one request: its word groups (one group per content chunk)."""

    chunks: tuple[tuple[str, ...], ...]
    finish_reason: str

    @property
    def tokens(self) -> int:
        return sum(len(chunk) for chunk in self.chunks)


def generate(
    seed: int, request_id: str, max_tokens: int, fixed: int | None, max_per_chunk: int
) -> Completion:
    """``fixed`` tokens (capped at ``max_tokens``), else a count drawn from ``[max(1, max_tokens // 2),
    max_tokens]``, in chunks of 1..``max_per_chunk`` words."""
    rng = random.Random(f"{seed}:{request_id}")
    total = min(fixed, max_tokens) if fixed is not None else rng.randint(max(1, max_tokens // 2), max_tokens)
    chunks: list[tuple[str, ...]] = []
    left = total
    while left:
        size = min(left, rng.randint(1, max_per_chunk))
        chunks.append(tuple(rng.choice(_VOCABULARY) for _ in range(size)))
        left -= size
    return Completion(tuple(chunks), "length" if total == max_tokens else "stop")


def chunk_text(words: Sequence[str], first: bool) -> str:
    """The content of one chunk: its words, after a space unless it is the first."""
    text = " ".join(words)
    return text if first else " " + text


def usage_object(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """An OpenAI ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def cumulative(chunks: Sequence[Sequence[str]]) -> list[int]:
    """Completion tokens so far after each chunk (per-chunk usage is cumulative, as vLLM reports it)."""
    totals: list[int] = []
    running = 0
    for chunk in chunks:
        running += len(chunk)
        totals.append(running)
    return totals


def swap_pairs(values: list[int]) -> list[int]:
    """Swap adjacent values: the ``reorder_usage`` fault's out-of-order usage."""
    swapped = list(values)
    for index in range(0, len(swapped) - 1, 2):
        swapped[index], swapped[index + 1] = swapped[index + 1], swapped[index]
    return swapped
