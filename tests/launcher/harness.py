"""The real launcher (``python -m budgeting.launcher run``) in a process of its own, on its own embedded
PostgreSQL and Redis under a temporary ``TB_VAR_DIR``, and the processes it runs, found through ``/proc``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DEMO_TOKEN = "tb_demo_gateway_eu_0000000000000000"
# The launcher must start its own servers and generate its own secrets, whatever this process was given.
NOT_INHERITED = (
    "DATABASE_URL", "REDIS_URL", "PROMETHEUS_MULTIPROC_DIR", "SECRET_KEY", "METRICS_TOKEN",
    "METRICS_ALLOWED_NETWORKS", "DJANGO_ENV", "LEASE_SECONDS", "WEB_CONCURRENCY", "PORT", "TB_VAR_DIR",
)  # fmt: skip
UP_SECONDS = 240.0
STOP_SECONDS = 90.0
# How each kind of process the launcher runs shows in its command line (only its children are looked at).
KINDS: dict[str, Callable[[str], bool]] = {
    "gunicorn": lambda command: "gunicorn" in command,
    "celery worker": lambda command: "celery" in command and "beat" not in command,
    "celery beat": lambda command: "celery" in command and "beat" in command,
    "postgres": lambda command: "bin/postgres" in command,
    "redis": lambda command: "redis-server" in command,
}


def process_table() -> dict[int, tuple[int, str]]:
    """``{pid: (parent pid, command line)}`` of every live (not zombie) process."""
    table: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            state, parent = stat[stat.rindex(")") + 2 :].split()[:2]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            if state != "Z":
                table[int(entry.name)] = (int(parent), command)
    return table


def alive(pid: int) -> bool:
    return pid in process_table()


@dataclass
class Launcher:
    root: Path
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, *, timeout: float, start: int = 0) -> re.Match[str]:
        """The first match of ``pattern`` in the launcher's output after character ``start``."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.output()[start:])
            if found is not None:
                return found
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"no {pattern!r} in the launcher's output (exit code {self.process.poll()}):\n"
                    + self.output()[-6000:]
                )
            time.sleep(0.1)

    def children(self) -> dict[str, list[int]]:
        """The launcher's supervised processes by kind (gunicorn masters, Celery, PostgreSQL, Redis)."""
        found: dict[str, list[int]] = {kind: [] for kind in KINDS}
        for pid, (parent, command) in process_table().items():
            if parent != self.process.pid:
                continue
            for kind, matches in KINDS.items():
                if matches(command):
                    found[kind].append(pid)
        return found

    def web_workers(self) -> list[int]:
        masters = set(self.children()["gunicorn"])
        return [pid for pid, (parent, _) in process_table().items() if parent in masters]

    def one(self, kind: str) -> int:
        pids = self.children()[kind]
        assert len(pids) == 1, (kind, pids)
        return pids[0]

    def manage_env(self) -> dict[str, str]:
        """An environment in which ``manage.py`` (or a Django script) talks to this launcher's servers."""
        env = {key: value for key, value in os.environ.items() if key not in NOT_INHERITED}
        return {**env, "TB_VAR_DIR": str(self.root), "DJANGO_SETTINGS_MODULE": "budgeting.settings"}

    def probe(self, *args: str, timeout: float = 120) -> Any:
        """Run ``tests.launcher.probe`` against this launcher's database; its JSON answer."""
        done = subprocess.run(
            [sys.executable, "-m", "tests.launcher.probe", *args],
            cwd=ROOT,
            env=self.manage_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout)

    def get(self, path: str, *, token: str = DEMO_TOKEN, timeout: float = 5) -> tuple[int, str, bytes]:
        """``(status, content type, body)`` of one GET to the platform; raises OSError without an answer."""
        request = urllib.request.Request(self.base_url + path, headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.headers.get("Content-Type", ""), response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get("Content-Type", ""), error.read()

    def stop(self) -> int:
        """SIGTERM, as Ctrl-C would; the exit code. Kills what is left if the launcher hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(STOP_SECONDS)
        finally:
            self.kill_leftovers()

    def leftovers(self) -> list[tuple[int, str]]:
        """Processes of this platform still alive (found by its folder or its port in their command line)."""
        marks = (str(self.root), f"127.0.0.1:{self.port}")
        return [
            (pid, command)
            for pid, (_, command) in process_table().items()
            if any(mark in command for mark in marks) and pid != os.getpid()
        ]

    def kill_leftovers(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for pid, _ in self.leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def start_launcher(root: Path, **env: str) -> Launcher:
    """Start ``python -m budgeting.launcher run`` with its data under ``root``; return once it is up."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = root / "launcher.log"
    environment = {key: value for key, value in os.environ.items() if key not in NOT_INHERITED}
    environment.update(
        TB_VAR_DIR=str(root),
        TOKENIZER_DIR=str(Path(settings.TOKENIZER_DIR).resolve()),
        PORT=str(port),
        PYTHONUNBUFFERED="1",
        **env,
    )
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "budgeting.launcher", "run"],
            cwd=ROOT,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    launcher = Launcher(root=root, port=port, process=process, log=log)
    try:
        launcher.wait_for(r"platform: up in", timeout=UP_SECONDS)
    except BaseException:
        launcher.stop()
        raise
    return launcher


@contextlib.contextmanager
def running_launcher(**env: str) -> Iterator[Launcher]:
    """A launcher on a folder of its own, removed afterwards.

    Not under pytest's temporary folder: when the launcher runs as root, PostgreSQL runs as another user
    that must traverse the path to its data, and a pytest run that starts meanwhile makes its root folder
    owner-only again.
    """
    root = Path(tempfile.mkdtemp(prefix="tb-launcher-"))
    try:
        launcher = start_launcher(root, **env)
        try:
            yield launcher
        finally:
            launcher.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def wait_until(condition: Callable[[], Any], *, timeout: float, what: str) -> Any:
    """Poll ``condition`` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)
