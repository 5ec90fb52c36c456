"""A circuit breaker per counting API endpoint, so that a dead API does not add its timeout to every request.

Closed: calls go through; ``failures`` transient failures in a row (timeout, 429, 5xx, unreachable) open it.
Open: no call is made for ``cooldown`` seconds, every count is "counting unavailable" at once. Then one call
is let through (half-open): its success closes the breaker, its failure opens it for another cooldown. Each
change is logged (a warning when it opens) and shown by ``tokenbudget_counting_circuit_open``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass
class Breaker:
    """The breaker of one endpoint (thread-safe). ``clock`` is monotonic seconds."""

    name: str
    failures: int
    cooldown: float
    clock: Clock = time.monotonic
    on_change: Callable[[str, bool], None] | None = None
    _failed: int = 0
    _open_until: float | None = None
    _trial: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def is_open(self) -> bool:
        """Whether calls are refused now (open, and no half-open trial is due)."""
        with self._lock:
            return self._open_until is not None and (self._trial or self.clock() < self._open_until)

    def allow(self) -> bool:
        """Whether a call may be made now; after the cooldown exactly one caller gets the trial call."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._trial or self.clock() < self._open_until:
                return False
            self._trial = True
            return True

    def succeeded(self) -> None:
        """A call answered: the breaker closes (logged if it was open)."""
        with self._lock:
            was_open = self._open_until is not None
            self._failed, self._open_until, self._trial = 0, None, False
        if was_open:
            logger.info("counting API %s answered again: circuit closed", self.name)
            self._changed(False)

    def failed(self, why: str) -> None:
        """A transient failure: opens the breaker after ``failures`` in a row, or at once after a trial."""
        with self._lock:
            self._failed += 1
            reopen = self._trial or (self._open_until is None and self._failed >= self.failures)
            if reopen:
                self._open_until = self.clock() + self.cooldown
                self._trial = False
        if reopen:
            logger.warning(
                "counting API %s failed %d time(s) in a row (%s): circuit open for %.0fs, counting is "
                "unavailable for its models meanwhile",
                self.name,
                self._failed,
                why,
                self.cooldown,
            )
            self._changed(True)

    def _changed(self, opened: bool) -> None:
        if self.on_change is not None:
            self.on_change(self.name, opened)
