"""A real gunicorn serving the platform on the pytest-django test database (for tests that need a second
process, or what only a real server does). Use it with ``django_db(transaction=True)`` so both see commits."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from django.db import connection

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def database_url() -> str:
    s = connection.settings_dict
    password = f":{s['PASSWORD']}" if s["PASSWORD"] else ""
    return f"postgres://{s['USER']}{password}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


@contextlib.contextmanager
def gunicorn() -> Iterator[str]:
    """Start one sync gunicorn worker; yields its base URL and stops it afterwards."""
    port = free_port()
    env = {**os.environ, "DATABASE_URL": database_url(), "DJANGO_SETTINGS_MODULE": "budgeting.settings"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "budgeting.wsgi:application",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            "1",
            "--log-level",
            "warning",
            # A loaded CI machine may take long over the first request's imports: do not kill the worker.
            "--timeout",
            "300",
        ],
        cwd=ROOT,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(base)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=60)


def _wait(base: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/api/v1/", timeout=5):
                return
        except OSError:  # refused, reset, or no answer yet while the worker starts
            time.sleep(0.2)
    raise AssertionError(f"gunicorn did not answer at {base}")
