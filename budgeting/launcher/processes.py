"""The launcher's processes: children it supervises, helpers it runs, signals, ports, private files."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import http.client
import os
import pwd
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

BASE_DIR = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"
CHILD_GRACE_SECONDS = 30.0
PR_SET_PDEATHSIG = 1


class Stop(Exception):
    """Raised in the main thread by SIGINT or SIGTERM, so that everything started is unwound."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class LaunchError(Exception):
    """A step failed; the message says what happened and, where possible, what to do."""


def say(message: str) -> None:
    print(f"platform: {message}", flush=True)


def var_dir() -> Path:
    """The same folder ``budgeting.settings`` reads ``embedded.env`` from."""
    return Path(os.environ.get("TB_VAR_DIR", BASE_DIR / "var")).resolve()


def free_port() -> int:
    """A loopback port that was free a moment ago; callers retry if another process takes it first."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def listen(port: int) -> socket.socket:
    """The API's listening socket on ``LOOPBACK:port``, bound here and handed to every gunicorn master.

    One socket for all masters means one queue of connections: while a master is being restarted the
    other one's workers take everything, and no connection waits in a socket that is about to close.
    Raises LaunchError when the port is taken.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((LOOPBACK, port))
    except OSError as error:
        sock.close()
        raise LaunchError(
            f"{LOOPBACK}:{port} is not free ({error}); stop whatever serves it or set PORT"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def http_answers(port: int) -> bool:
    """Whether gunicorn answers HTTP on ``port`` (the socket itself accepts as soon as it is bound)."""
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=2)
    try:
        connection.request("GET", "/api/v1/")
        connection.getresponse().read()
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()
    return True


def die_with_launcher(signum: int) -> None:
    """Runs in each child before exec: Linux sends it ``signum`` if the launcher dies without cleaning up."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)


def spawn(
    argv: Sequence[str],
    *,
    user: str | None = None,
    output: IO[bytes] | None = None,
    death_signal: int = signal.SIGTERM,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen[bytes]:
    """Start a supervised child in its own session: a terminal Ctrl-C reaches only the launcher, which then
    stops the children in order (applications first, then Redis and PostgreSQL). ``user`` runs it as that
    user, ``output`` takes its stdout and stderr, ``pass_fds`` are inherited (the API's socket)."""
    group = pwd.getpwnam(user).pw_gid if user is not None else None
    return subprocess.Popen(
        list(argv),
        cwd=BASE_DIR,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT if output is not None else None,
        start_new_session=True,
        user=user,
        group=group,
        extra_groups=[] if user is not None else None,
        pass_fds=tuple(pass_fds),
        # Set after the user switch (Popen switches first), which would otherwise clear it.
        preexec_fn=functools.partial(die_with_launcher, death_signal) if sys.platform == "linux" else None,
    )


def run_helper(argv: Sequence[str], *, what: str, user: str | None = None, cwd: Path = BASE_DIR) -> None:
    """Run a helper command to completion, as ``user`` when given.

    Output goes through a temporary file, not a pipe: ``pg_ctl start`` leaves the postmaster holding its
    stdout, so reading a pipe to EOF would hang. Raises LaunchError with the output when the command fails.
    """
    group = pwd.getpwnam(user).pw_gid if user is not None else None
    with tempfile.TemporaryFile() as output:
        result = subprocess.run(
            list(argv),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            user=user,
            group=group,
            extra_groups=[] if user is not None else None,
            check=False,
        )
        output.seek(0)
        text = output.read().decode(errors="replace")
    if result.returncode != 0:
        raise LaunchError(f"{what} failed with exit code {result.returncode}:\n{text.rstrip()}")


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (it holds passwords), replacing it atomically."""
    temporary = path.with_name(path.name + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    temporary.replace(path)


def generated_secret(path: Path) -> str:
    """The secret kept in ``path``, created at random (owner-only) the first time and reused afterwards."""
    if path.exists():
        value = path.read_text().strip()
        if value:
            return value
    value = secrets.token_urlsafe(48)
    write_private(path, value + "\n")
    return value


@dataclass
class Child:
    """A supervised process; ``stop_signal`` asks it to stop (PostgreSQL's fast shutdown is SIGINT)."""

    name: str
    process: subprocess.Popen[bytes]
    stop_signal: signal.Signals = signal.SIGTERM

    def send(self, signum: signal.Signals) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)

    def exit_reason(self) -> str | None:
        """How the process ended (``exited with code 1``, ``was killed by SIGKILL``), None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def end_leftovers(self) -> None:
        """Ask what is left of a dead child's session (gunicorn workers, Celery pool processes) to stop."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGTERM)

    def finish(self, deadline: float) -> None:
        """Wait for the process until ``deadline``, then kill what is left of its session."""
        try:
            self.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            say(f"{self.name} did not stop in time; killing it")
        # Its session's process group also holds gunicorn workers and Celery pool processes.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def stop_children(children: Sequence[Child]) -> None:
    """Ask every child to stop at once, then wait for all of them under one shared deadline."""
    for child in children:
        child.send(child.stop_signal)
    deadline = time.monotonic() + CHILD_GRACE_SECONDS
    for child in children:
        child.finish(deadline)


def raise_stop(signum: int, _frame: FrameType | None) -> None:
    raise Stop(signum)


def note_repeat(signum: int, _frame: FrameType | None) -> None:
    say(f"{signal.Signals(signum).name} again: already stopping, every step has a timeout")
