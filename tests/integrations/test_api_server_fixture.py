"""The ``Gunicorn`` fixture leaves no process of our API behind: a worker outliving the test would keep
holding connections to the test database (PostgreSQL's "being accessed by other users" when it is dropped)
and could answer a later test's requests on a reused port."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.integrations.conftest import Gunicorn
from tests.ports import free_port

pytestmark = pytest.mark.django_db(transaction=True)


def _session(leader: int) -> set[int]:
    """The live processes of the session ``leader`` started (zombies are dead: they hold nothing)."""
    members = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        state, session = fields[0], int(fields[3])
        if session == leader and state != "Z":
            members.add(int(entry.name))
    return members


def _left_after(server: Gunicorn) -> set[int]:
    """What of the server's session is still alive once ``stop()`` has returned, given a moment for the
    SIGKILLed to die (a signal is delivered, not awaited)."""
    assert server.process is not None
    deadline = time.monotonic() + 5
    while (left := _session(server.process.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _started(tmp_path: Path) -> Gunicorn:
    server = Gunicorn(free_port(), tmp_path / "gunicorn.log", quit_seconds=1)
    server.start()
    assert server.process is not None
    assert len(_session(server.process.pid)) == 2  # the master and its one worker
    return server


def test_stop_ends_the_master_and_its_worker(tmp_path: Path) -> None:
    server = _started(tmp_path)
    assert server.process is not None
    server.stop()
    assert _left_after(server) == set()


def test_stop_ends_a_master_and_a_worker_that_do_not_answer_signals(tmp_path: Path) -> None:
    """Both stopped (SIGSTOP): the quick shutdown cannot run, and the session is killed whole."""
    server = _started(tmp_path)
    assert server.process is not None
    members = _session(server.process.pid)
    for pid in members:
        os.kill(pid, signal.SIGSTOP)
    server.stop()
    assert _left_after(server) == set()
