"""Validated consistency (SPEC §4): how far each counter's admitted counts drift from what providers report.

Every settled call records the provider-reported input (``Reservation.input_reported``) beside the count it
was admitted with (``input_reserved``) and the manifest says which counter produced that count
(``count_method``). The drift of one call is ``|reported − admitted| / admitted``; a status is the p50 and
p99 of it over the latest ``window`` such calls of one model revision and counter, judged against the
policy's ``counterDrift`` bound. ``UPPER_BOUND`` counts overcount by design: they are shown, never bounded.

Admission asks ``out_of_bound(model revision)`` on every request, so the verdicts are computed at most once
per ``REFRESH_SECONDS`` per process (one statement) and read from memory in between.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from django.db import connection

from ladder.policy import DriftBound

BOUNDED_METHODS = frozenset({"EXACT", "PROVIDER_COUNT"})
DEFAULT_WINDOW = 200
REFRESH_SECONDS = 30.0

_WINDOW_SQL = """
    SELECT name, count_method, input_reported, input_reserved
      FROM (SELECT m.name, mf.count_method, r.input_reported, r.input_reserved,
                   row_number() OVER (PARTITION BY r.model_revision_id, mf.count_method
                                      ORDER BY r.id DESC) AS n
              FROM ledger_reservation r
              JOIN budgeting_modelrevision m ON m.id = r.model_revision_id
              JOIN budgeting_manifest mf ON mf.id = r.manifest_id
             WHERE r.input_reported IS NOT NULL AND r.input_reserved > 0 AND r.state = 'SETTLED'
               {only}) latest
     WHERE n <= %s
     ORDER BY name, count_method
"""


@dataclass(frozen=True)
class DriftStatus:
    """The drift of one model revision's counter over its latest settled calls."""

    model_revision: str
    count_method: str
    calls: int
    p50: float
    p99: float
    bound: DriftBound | None

    @property
    def bounded(self) -> bool:
        """Whether a bound applies: one is configured, the counter is not a bound itself, and enough calls."""
        return (
            self.bound is not None
            and self.count_method in BOUNDED_METHODS
            and self.calls >= self.bound.min_calls
        )

    @property
    def exceeded(self) -> bool:
        """Whether the drift is out of the policy's bound."""
        if not self.bounded:
            return False
        assert self.bound is not None
        return self.p99 > self.bound.max_p99 or (
            self.bound.max_p50 is not None and self.p50 > self.bound.max_p50
        )

    @property
    def falls_back(self) -> bool:
        """Whether this counter is out of bound and the policy makes its counting unavailable."""
        return self.exceeded and self.bound is not None and self.bound.on_exceeded == "COUNTING_UNAVAILABLE"


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (0 < q ≤ 1) of ascending values; 0.0 for none."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def statuses(bound: DriftBound | None, *, model_revision: str | None = None) -> list[DriftStatus]:
    """The drift status of every (model revision, counter) with settled calls (or of one model revision)."""
    window = bound.window if bound is not None else DEFAULT_WINDOW
    only = "AND m.name = %s" if model_revision is not None else ""
    params: list[str | int] = [model_revision] if model_revision is not None else []
    with connection.cursor() as cursor:
        cursor.execute(_WINDOW_SQL.format(only=only), [*params, window])
        rows = cursor.fetchall()
    grouped: dict[tuple[str, str], list[float]] = {}
    for name, method, reported, admitted in rows:
        grouped.setdefault((name, method), []).append(abs(reported - admitted) / admitted)
    return [_status(name, method, drifts, bound) for (name, method), drifts in grouped.items()]


def _status(name: str, method: str, drifts: Iterable[float], bound: DriftBound | None) -> DriftStatus:
    ordered = sorted(drifts)
    return DriftStatus(name, method, len(ordered), percentile(ordered, 0.5), percentile(ordered, 0.99), bound)


class _Verdicts:
    """Which model revisions' counters fall back, refreshed at most every ``REFRESH_SECONDS``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.key: DriftBound | None = None
        self.until = 0.0
        self.falling_back: frozenset[tuple[str, str]] = frozenset()

    def get(self, bound: DriftBound) -> frozenset[tuple[str, str]]:
        now = time.monotonic()
        with self.lock:
            if self.key == bound and now < self.until:
                return self.falling_back
        found = frozenset(
            (status.model_revision, status.count_method) for status in statuses(bound) if status.falls_back
        )
        with self.lock:
            self.key, self.until, self.falling_back = bound, now + REFRESH_SECONDS, found
        return found

    def clear(self) -> None:
        with self.lock:
            self.key, self.until, self.falling_back = None, 0.0, frozenset()


_VERDICTS = _Verdicts()


def falling_back(bound: DriftBound | None) -> frozenset[tuple[str, str]]:
    """(model revision, count method) pairs whose counting is unavailable because their drift is out of the
    bound and the policy says so (empty without a bound or with ``onExceeded: ALERT``)."""
    if bound is None or bound.on_exceeded != "COUNTING_UNAVAILABLE":
        return frozenset()
    return _VERDICTS.get(bound)


def forget() -> None:
    """Drop the remembered verdicts (tests; they are otherwise at most ``REFRESH_SECONDS`` old)."""
    _VERDICTS.clear()
