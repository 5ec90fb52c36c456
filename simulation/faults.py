"""Scripted misbehaviour of the provider simulator: which fault the next chat requests and lookups get.

Faults are queued with ``FaultScripts.add`` for the next ``count`` requests (optionally only those with a
given request id), or come per request in the header ``X-Sim-Fault: name[;param=value...]``
(``script_from_header``), which wins over queued scripts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

_HEADER_PARAMS: Final = frozenset(
    {"delay_s", "after_chunks", "status_code", "completion_tokens", "chunk_delay_s"}
)


class Fault(StrEnum):
    """A scripted misbehaviour; ``simulation.provider``'s docstring says what each one bills."""

    DELAY = "delay"
    RESET_BEFORE_READ = "reset_before_read"
    RESET_AFTER_READ = "reset_after_read"
    HTTP_5XX_AFTER_READ = "http_5xx_after_read"
    CUT_AFTER_CHUNKS = "cut_after_chunks"
    OMIT_USAGE = "omit_usage"
    DUPLICATE_USAGE = "duplicate_usage"
    REORDER_USAGE = "reorder_usage"
    BILL_WITHOUT_ANSWER = "bill_without_answer"
    RATE_LIMITED = "rate_limited"


class LookupFault(StrEnum):
    """A scripted misbehaviour of the lookup endpoint."""

    UNKNOWN = "unknown"  # answer 200 with status "unknown"
    HTTP_500 = "http_500"
    DELAY = "delay"  # sleep delay_s, then answer normally
    RESET = "reset"


class CountFault(StrEnum):
    """A scripted misbehaviour of the counting endpoints (Anthropic, Gemini, OpenAI)."""

    DELAY = "delay"  # sleep delay_s, then answer normally
    RATE_LIMITED = "rate_limited"  # 429 in the API's own error shape
    HTTP_5XX = "http_5xx"  # 500 (Anthropic: 529 overloaded) in the API's own error shape
    HANG = "hang"  # sleep delay_s and close the connection without an answer (a client times out first)


@dataclass(frozen=True)
class Script:
    """How to answer one request. Raises ``ValueError`` on parameters that cannot apply."""

    fault: Fault | None = None
    delay_s: float = 0.0
    after_chunks: int = 0
    status_code: int = 500
    completion_tokens: int | None = None
    chunk_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_s < 0 or self.chunk_delay_s < 0:
            raise ValueError("delays cannot be negative")
        if self.fault is Fault.DELAY and self.delay_s <= 0:
            raise ValueError("the delay fault needs delay_s > 0")
        if self.after_chunks < 0:
            raise ValueError("after_chunks cannot be negative")
        if not 500 <= self.status_code <= 599:
            raise ValueError("status_code must be a 5xx")
        if self.completion_tokens is not None and self.completion_tokens < 1:
            raise ValueError("completion_tokens must be positive")


@dataclass
class _Pending:
    script: Script | LookupFault | CountFault
    remaining: int
    request_id: str | None
    delay_s: float = 0.0


class FaultScripts:
    """The thread-safe queues of chat and lookup scripts, consumed as requests arrive."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scripts: list[_Pending] = []
        self._lookup_scripts: list[_Pending] = []
        self._count_scripts: list[_Pending] = []

    def add(self, script: Script, *, count: int, request_id: str | None) -> None:
        """Answer the next ``count`` chat requests (only those with ``request_id``, if given) this way.

        Raises ``ValueError`` if ``count`` is not positive.
        """
        if count < 1:
            raise ValueError("count must be positive")
        with self._lock:
            self._scripts.append(_Pending(script, count, request_id))

    def add_lookup(self, fault: LookupFault, *, count: int, request_id: str | None, delay_s: float) -> None:
        """Misbehave on the next ``count`` lookups. Raises ``ValueError`` if ``count`` is not positive."""
        if count < 1:
            raise ValueError("count must be positive")
        with self._lock:
            self._lookup_scripts.append(_Pending(fault, count, request_id, delay_s))

    def add_count(self, fault: CountFault, *, count: int, delay_s: float) -> None:
        """Misbehave on the next ``count`` counting requests. Raises ``ValueError`` if ``count`` is not
        positive or a delay is negative."""
        if count < 1 or delay_s < 0:
            raise ValueError("count must be positive and delay_s not negative")
        with self._lock:
            self._count_scripts.append(_Pending(fault, count, None, delay_s))

    def take_count(self) -> tuple[CountFault | None, float]:
        """The fault and delay of the next counting request; ``(None, 0.0)`` when none is queued."""
        with self._lock:
            pending = _take(self._count_scripts, None)
        if pending is None:
            return None, 0.0
        assert isinstance(pending.script, CountFault)
        return pending.script, pending.delay_s

    def clear(self) -> None:
        """Forget every queued script."""
        with self._lock:
            self._scripts.clear()
            self._lookup_scripts.clear()
            self._count_scripts.clear()

    def take(self, request_id: str | None) -> Script:
        """The script of the next chat request: one for its id first, else the oldest general one."""
        with self._lock:
            pending = _take(self._scripts, request_id)
        if pending is None:
            return Script()
        assert isinstance(pending.script, Script)
        return pending.script

    def take_lookup(self, request_id: str) -> tuple[LookupFault | None, float]:
        """The fault and delay of the next lookup of ``request_id``; ``(None, 0.0)`` when none is queued."""
        with self._lock:
            pending = _take(self._lookup_scripts, request_id)
        if pending is None:
            return None, 0.0
        assert isinstance(pending.script, LookupFault)
        return pending.script, pending.delay_s


def script_from_header(header: str) -> Script:
    """Parse ``X-Sim-Fault: name[;param=value...]``. Raises ``ValueError`` for anything unknown."""
    name, *params = (part.strip() for part in header.split(";"))
    values: dict[str, Any] = {}
    for param in params:
        key, sep, raw = param.partition("=")
        if not sep or key not in _HEADER_PARAMS:
            raise ValueError(f"unknown X-Sim-Fault parameter {param!r}")
        values[key] = float(raw) if key.endswith("_s") else int(raw)
    return Script(fault=Fault(name) if name else None, **values)


def _take(queue: list[_Pending], request_id: str | None) -> _Pending | None:
    chosen = next((p for p in queue if p.request_id is not None and p.request_id == request_id), None)
    if chosen is None:
        chosen = next((p for p in queue if p.request_id is None), None)
    if chosen is None:
        return None
    chosen.remaining -= 1
    if chosen.remaining == 0:
        queue.remove(chosen)
    return chosen
