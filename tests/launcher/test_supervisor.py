"""The supervision loop on its own: backoff, crash loops, failed restarts, the other units meanwhile, and a
real Program's exit reasons (a clock and fake units; the real launcher is in test_supervision)."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, field

import pytest

from budgeting.launcher.processes import LaunchError
from budgeting.launcher.supervisor import CrashLoop, Program, RestartPolicy, Supervisor


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Unit:
    name: str
    dead: str | None = None
    restarts: int = 0
    fail_restarts: int = 0
    log: list[str] = field(default_factory=list)

    def exit_reason(self) -> str | None:
        return self.dead

    def restart(self) -> None:
        if self.fail_restarts:
            self.fail_restarts -= 1
            raise LaunchError("port taken")
        self.restarts += 1
        self.dead = None


def test_a_dead_unit_is_restarted_after_a_doubling_backoff(capsys: pytest.CaptureFixture[str]) -> None:
    clock, beat = Clock(), Unit("celery beat")
    supervisor = Supervisor([beat], RestartPolicy(), clock)
    waits = []
    for _ in range(4):
        beat.dead = "was killed by SIGKILL"
        supervisor.check()
        died_at, restarts = clock.now, beat.restarts
        while beat.restarts == restarts:
            clock.now += 0.25
            supervisor.check()
        waits.append(clock.now - died_at)
    assert waits == [0.5, 1.0, 2.0, 4.0]
    out = capsys.readouterr().out
    assert "platform: celery beat was killed by SIGKILL; restarting it in 0.5s" in out
    assert out.count("platform: celery beat restarted") == 4


def test_the_fifth_death_within_the_window_is_a_crash_loop() -> None:
    clock, beat = Clock(), Unit("celery beat")
    supervisor = Supervisor([beat], RestartPolicy(), clock)
    for _ in range(4):
        beat.dead = "exited with code 1"
        supervisor.check()
        clock.now += 10
        supervisor.check()
    beat.dead = "exited with code 1"
    with pytest.raises(CrashLoop, match=r"celery beat is in a crash loop: it died 5 times within 60s"):
        supervisor.check()


def test_deaths_spread_wider_than_the_window_never_make_a_crash_loop() -> None:
    clock, worker = Clock(), Unit("celery worker")
    supervisor = Supervisor([worker], RestartPolicy(), clock)
    for _ in range(20):
        worker.dead = "exited with code 1"
        supervisor.check()
        clock.now += 16
        supervisor.check()
    assert worker.restarts == 20


def test_a_failed_restart_counts_as_a_death_and_is_tried_again(capsys: pytest.CaptureFixture[str]) -> None:
    clock, redis = Clock(), Unit("embedded Redis", fail_restarts=2)
    supervisor = Supervisor([redis], RestartPolicy(), clock)
    redis.dead = "was killed by SIGKILL"
    for _ in range(40):
        supervisor.check()
        clock.now += 0.5
    assert redis.restarts == 1 and redis.dead is None
    assert capsys.readouterr().out.count("embedded Redis did not come back: port taken") == 2


def test_other_units_are_watched_while_one_waits_for_its_restart() -> None:
    clock, postgres, beat = Clock(), Unit("embedded PostgreSQL"), Unit("celery beat")
    supervisor = Supervisor([postgres, beat], RestartPolicy(first_delay_s=5), clock)
    postgres.dead = "was killed by SIGKILL"
    supervisor.check()
    clock.now += 1
    beat.dead = "exited with code 1"
    supervisor.check()
    clock.now += 5
    supervisor.check()
    assert (postgres.restarts, beat.restarts) == (1, 1)


def test_a_program_says_how_it_ended_and_comes_back_as_a_new_process() -> None:
    program = Program("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    program.start()
    assert program.child is not None
    first = program.child.process
    try:
        assert program.exit_reason() is None
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert program.exit_reason() == "was killed by SIGKILL"
        program.restart()
        assert program.child.process.pid != first.pid and program.exit_reason() is None
    finally:
        program.child.process.kill()
        program.child.process.wait(10)
    exits = Program("exits", [sys.executable, "-c", "raise SystemExit(3)"])
    exits.start()
    assert exits.child is not None
    exits.child.process.wait(30)
    deadline = time.monotonic() + 5
    while exits.exit_reason() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exits.exit_reason() == "exited with code 3"
