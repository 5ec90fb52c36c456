"""Final usages sent to our API together: one ``POST /api/v1/reservations:usage`` for the reports of many
calls.

A call's final usage is reported after its answer went to the proxy's client (``async_log_success_event``),
so nothing waits for it; what it costs is CPU — the proxy's event loop, our API, the database — that every
other call on the same machine shares. Posted one by one, that is one HTTP exchange per call. Here a report
waits at most ``flush_s`` (``usageFlushSeconds``) for others, and up to ``MAX_REPORTS`` go in one request;
our API applies each as its own usage call would and answers each with its own status. What a report waits
is what the reservation's concurrency slot and unused output stay held after the call ended: 0.1 s by
default, against calls that last seconds. 0 sends what has gathered as soon as the loop is free.

A report our API refuses (a stale fence: the reclaimer took the lease over; an unknown reservation) is
logged, as a refused usage call was. If the request fails (our API unreachable within the deadline, retries
included), its reports are logged and left: the leases expire and the reclaimer settles those calls from the
provider's records. So are the reports still waiting when the proxy stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from tokenbudget_gateway.errors import GatewayError

if TYPE_CHECKING:
    from tokenbudget_litellm.calls import Api

logger = logging.getLogger(__name__)

REPORTS_PATH: Final = "/api/v1/reservations:usage"
MAX_REPORTS: Final = 100
"""Our API's limit on the reports of one request."""


@dataclass(frozen=True)
class _Report:
    body: Mapping[str, Any]
    queued_at: float


class UsageReports:
    """The reports waiting to be sent, and the task that sends them (see the module docstring)."""

    def __init__(self, api: Api, *, flush_s: float, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._api = api
        self._flush_s = flush_s
        self._monotonic = monotonic
        self._waiting: list[_Report] = []
        self._full: asyncio.Event | None = None
        self._sender: asyncio.Task[None] | None = None

    def add(self, body: Mapping[str, Any]) -> None:
        """Queue one report: a usage call's body with its ``reservationId``."""
        self._waiting.append(_Report(body, self._monotonic()))
        if self._sender is None or self._sender.done():
            # An event of the running loop's (a loop's primitives serve no other).
            self._full = asyncio.Event()
            self._sender = asyncio.get_running_loop().create_task(self._send_all(self._full))
        if len(self._waiting) >= MAX_REPORTS and self._full is not None:
            self._full.set()

    async def flush(self) -> None:
        """Send what is waiting now, and return once it is sent."""
        if self._sender is None or self._sender.done():
            return
        if self._full is not None:
            self._full.set()
        await asyncio.shield(self._sender)

    async def _send_all(self, full: asyncio.Event) -> None:
        while self._waiting:
            wait = self._waiting[0].queued_at + self._flush_s - self._monotonic()
            if wait > 0 and not full.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(full.wait(), wait)
            batch, self._waiting = self._waiting[:MAX_REPORTS], self._waiting[MAX_REPORTS:]
            if len(self._waiting) < MAX_REPORTS:
                full.clear()
            await self._send([report.body for report in batch])

    async def _send(self, reports: list[Mapping[str, Any]]) -> None:
        try:
            response = await self._api.request("POST", REPORTS_PATH, {"usage": reports})
        except GatewayError as exc:
            logger.warning(
                "usage of reservations %s not posted; the reclaimer will settle them: %s",
                ", ".join(str(report["reservationId"]) for report in reports),
                exc,
            )
            return
        results = response.body.get("results") if isinstance(response.body, dict) else None
        for result in results if isinstance(results, list) else ():
            if isinstance(result, dict) and result.get("status") != 200:
                problem = result.get("problem")
                problem = problem if isinstance(problem, dict) else {}
                logger.warning(
                    "usage of reservation %s refused: %s %s: %s",
                    result.get("reservationId"),
                    result.get("status"),
                    problem.get("code"),
                    problem.get("detail", ""),
                )
