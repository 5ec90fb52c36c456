"""Keeps the platform's processes running: restarts whatever dies, with backoff, and gives up on a crash loop.

Each supervised unit (a gunicorn master, the Celery worker, Celery beat, the embedded PostgreSQL or Redis)
is polled; when one has died the launcher says which and why, waits a backoff that doubles with each recent
death, and restarts only that unit while the others go on serving. A unit that dies ``crash_loop_deaths``
times within ``crash_loop_window_s`` is in a crash loop: restarting it again would only hide the fault, so
the launcher says so and stops the whole platform (``CrashLoop``).

A small loop of our own rather than supervisord or circus (both install from PyPI): supervisord gives up
only on a program that dies within ``startsecs`` of starting and restarts one that ran a while without end,
so stopping everything on a crash loop would take an event listener of ours anyway; circus brings ZeroMQ
and Tornado. Both would add a daemon and a configuration file beside a launcher that already starts, orders
and stops its children, and must bring the embedded servers back on the port and password that every
other process was given.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from budgeting.launcher.processes import Child, LaunchError, say, spawn


class Supervised(Protocol):
    """What the supervisor needs of a unit. ``exit_reason`` is None while it runs; ``restart`` raises
    LaunchError when the unit does not come back."""

    @property
    def name(self) -> str: ...

    def exit_reason(self) -> str | None: ...

    def restart(self) -> None: ...


class CrashLoop(LaunchError):
    """A unit keeps dying; the platform stops."""


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    crash_loop_deaths: int = 5
    crash_loop_window_s: float = 60.0

    def delay(self, recent_deaths: int) -> float:
        """Seconds to wait before restarting a unit that died ``recent_deaths`` times within the window."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** (recent_deaths - 1))


@dataclass
class Program:
    """An application process the launcher runs from ``argv`` (gunicorn, the Celery worker, Celery beat)."""

    name: str
    argv: Sequence[str]
    pass_fds: Sequence[int] = ()
    child: Child | None = None

    def start(self) -> None:
        self.child = Child(self.name, spawn(self.argv, pass_fds=self.pass_fds))

    def exit_reason(self) -> str | None:
        return self.child.exit_reason() if self.child is not None else None

    def restart(self) -> None:
        if self.child is not None:
            self.child.end_leftovers()
        self.start()


@dataclass
class _Watch:
    unit: Supervised
    deaths: deque[float] = field(default_factory=deque)
    restart_at: float | None = None


class Supervisor:
    """Call ``check`` every fraction of a second: it notices deaths and performs due restarts.

    Raises CrashLoop when a unit dies too often. Restarts happen inside ``check``: an embedded PostgreSQL
    takes a second or two to accept connections again, during which the other units are not looked at.
    """

    def __init__(
        self,
        units: Sequence[Supervised],
        policy: RestartPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._watches = [_Watch(unit) for unit in units]
        self._policy = policy or RestartPolicy()
        self._clock = clock

    def check(self) -> None:
        for watch in self._watches:
            if watch.restart_at is None:
                reason = watch.unit.exit_reason()
                if reason is not None:
                    self._died(watch, reason)
            elif self._clock() >= watch.restart_at:
                self._restart(watch)

    def _died(self, watch: _Watch, reason: str) -> None:
        policy = self._policy
        now = self._clock()
        watch.deaths.append(now)
        while watch.deaths[0] < now - policy.crash_loop_window_s:
            watch.deaths.popleft()
        recent = len(watch.deaths)
        name = watch.unit.name
        if recent >= policy.crash_loop_deaths:
            raise CrashLoop(
                f"{name} is in a crash loop: it died {recent} times within {policy.crash_loop_window_s:g}s "
                f"(last: {reason}); giving up and stopping the platform"
            )
        delay = policy.delay(recent)
        say(
            f"{name} {reason}; restarting it in {delay:g}s "
            f"({recent} of {policy.crash_loop_deaths - 1} restarts allowed within "
            f"{policy.crash_loop_window_s:g}s)"
        )
        watch.restart_at = now + delay

    def _restart(self, watch: _Watch) -> None:
        watch.restart_at = None
        try:
            watch.unit.restart()
        except LaunchError as error:
            self._died(watch, f"did not come back: {error}")
            return
        say(f"{watch.unit.name} restarted")
