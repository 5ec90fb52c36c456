"""The provider simulator's billing ledger: what each provider request was billed, next to settled usage.

Thread-safe: handler threads write it while tests and ``manage.py simulate`` read it. Writers pass in the
current time (the simulator's clock).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from typing import Final


class BillingStatus(StrEnum):
    """How a provider request ended, from the provider's billing point of view."""

    RUNNING = "running"
    COMPLETED = "completed"
    CUT = "cut"
    FAILED_UNPROCESSED = "failed_unprocessed"


BILLED_STATUSES: Final = frozenset({BillingStatus.COMPLETED, BillingStatus.CUT})


@dataclass(frozen=True)
class BillingEntry:
    """One provider request as the provider's billing ledger sees it (a snapshot)."""

    request_id: str
    model: str
    api_key_id: str
    project_id: str
    prompt_tokens: int
    completion_tokens: int
    status: BillingStatus
    started_at: datetime
    finished_at: datetime | None

    @property
    def billed(self) -> bool:
        """Whether the request appears in billing exports."""
        return self.status in BILLED_STATUSES


@dataclass(frozen=True)
class BillingMismatch:
    """One provider request whose settled ``(input, output)`` differs from what the simulator billed."""

    request_id: str
    settled: tuple[int, int]
    billed: tuple[int, int]


@dataclass(frozen=True)
class BillingComparison:
    """``Simulator.compare``: settled usage next to the simulator's billing ledger."""

    compared: int
    mismatches: tuple[BillingMismatch, ...]
    unsettled: tuple[str, ...]
    settled_input: int
    settled_output: int
    billed_input: int
    billed_output: int

    @property
    def ok(self) -> bool:
        """Every settled request matches its bill (unsettled ones are reported, not judged)."""
        return not self.mismatches


def api_key_id(api_key: str) -> str:
    """The non-secret id under which exports group an API key (keys themselves are never exported)."""
    return "key_" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


class BillingLedger:
    """One row per provider request id, written as a request is refused, begins, produces and ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str, BillingEntry] = {}

    def entry(self, request_id: str) -> BillingEntry | None:
        """The row of ``request_id``, if the simulator has seen it."""
        with self._lock:
            return self._rows.get(request_id)

    def entries(self) -> list[BillingEntry]:
        """Every row, oldest first."""
        with self._lock:
            rows = list(self._rows.values())
        return sorted(rows, key=lambda row: (row.started_at, row.request_id))

    def record_unprocessed(
        self, request_id: str, model: str, key_id: str, project_id: str, *, now: datetime
    ) -> None:
        """Record a request refused before it was processed (billed nothing)."""
        with self._lock:
            if request_id in self._rows:
                # Never overwrite what an earlier attempt was billed.
                return
            self._rows[request_id] = BillingEntry(
                request_id=request_id,
                model=model,
                api_key_id=key_id,
                project_id=project_id,
                prompt_tokens=0,
                completion_tokens=0,
                status=BillingStatus.FAILED_UNPROCESSED,
                started_at=now,
                finished_at=now,
            )

    def begin(
        self, request_id: str, model: str, key_id: str, project_id: str, prompt_tokens: int, *, now: datetime
    ) -> bool:
        """Register a processed request as running; False if the id was already used by a processed one."""
        with self._lock:
            existing = self._rows.get(request_id)
            if existing is not None and existing.status is not BillingStatus.FAILED_UNPROCESSED:
                return False
            self._rows[request_id] = BillingEntry(
                request_id=request_id,
                model=model,
                api_key_id=key_id,
                project_id=project_id,
                prompt_tokens=prompt_tokens,
                completion_tokens=0,
                status=BillingStatus.RUNNING,
                started_at=now,
                finished_at=None,
            )
            return True

    def produce(self, request_id: str, tokens: int) -> None:
        """Bill ``tokens`` more completion tokens to a running request."""
        with self._lock:
            row = self._rows[request_id]
            if row.status is BillingStatus.RUNNING:
                self._rows[request_id] = replace(row, completion_tokens=row.completion_tokens + tokens)

    def finish(self, request_id: str, status: BillingStatus, *, now: datetime) -> None:
        """End a running request with ``status``; a request that already ended keeps its first ending."""
        with self._lock:
            row = self._rows[request_id]
            if row.status is BillingStatus.RUNNING:
                self._rows[request_id] = replace(row, status=status, finished_at=now)

    def compare(self, settled: Mapping[str, tuple[int, int]]) -> BillingComparison:
        """Compare what a client settled, ``{provider request id: (input, output)}``, with what was billed.

        An id the simulator never billed (never seen, or refused unprocessed) was billed ``(0, 0)``. An id
        still running is a mismatch whatever its counts so far: its bill is not final, so nothing settled
        can equal it. Billed ids absent from ``settled`` are listed as ``unsettled`` (still being
        reconciled, or lost).
        """
        rows = {row.request_id: row for row in self.entries()}
        mismatches: list[BillingMismatch] = []
        for request_id, ours in sorted(settled.items()):
            row = rows.get(request_id)
            billed = (row.prompt_tokens, row.completion_tokens) if row is not None else (0, 0)
            running = row is not None and row.status is BillingStatus.RUNNING
            if running or (ours[0], ours[1]) != billed:
                mismatches.append(BillingMismatch(request_id, (ours[0], ours[1]), billed))
        unsettled = tuple(
            sorted(
                request_id
                for request_id, row in rows.items()
                if request_id not in settled and (row.billed or row.status is BillingStatus.RUNNING)
            )
        )
        billed_rows = [row for row in rows.values() if row.billed]
        return BillingComparison(
            compared=len(settled),
            mismatches=tuple(mismatches),
            unsettled=unsettled,
            settled_input=sum(ours[0] for ours in settled.values()),
            settled_output=sum(ours[1] for ours in settled.values()),
            billed_input=sum(row.prompt_tokens for row in billed_rows),
            billed_output=sum(row.completion_tokens for row in billed_rows),
        )
