"""``./platform run`` supervises (issue 11, items 7, 13, 14): against the real launcher with its embedded
PostgreSQL and Redis, each kind of process it runs is killed with SIGKILL and comes back while the API keeps
answering, a process that keeps dying ends in a "crash loop" stop of the whole platform, and the secrets it
generated (Django's key, the metrics scrape token) are private files under ``var/``."""

from __future__ import annotations

import os
import re
import signal
import stat
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.launcher.harness import Launcher, alive, running_launcher, wait_until

pytestmark = pytest.mark.slow

RESTART_SECONDS = 60.0


@pytest.fixture(scope="module")
def launcher() -> Iterator[Launcher]:
    with running_launcher(WEB_CONCURRENCY="2") as launcher:
        yield launcher


@dataclass
class Answers:
    """GET /api/v1/reservations/<unknown id> in a loop (it reads the database: 404 when all is well)."""

    launcher: Launcher
    seen: list[tuple[float, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status, content_type, _ = self.launcher.get(f"/api/v1/reservations/{uuid.uuid4()}")
                answer = f"{status} {content_type.split(';')[0]}"
            except OSError as error:
                answer = f"no answer ({type(error).__name__})"
            self.seen.append((time.monotonic(), answer))
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def between(self, start: float, end: float) -> Counter[str]:
        return Counter(answer for moment, answer in self.seen if start <= moment <= end)


NAMES = {
    "gunicorn": "gunicorn 1",
    "celery worker": "celery worker",
    "celery beat": "celery beat",
    "redis": "embedded Redis",
    "postgres": "embedded PostgreSQL",
}
NOT_FOUND = "404 application/problem+json"
UNAVAILABLE = "503 application/problem+json"


@pytest.mark.parametrize("kind", list(NAMES))
def test_a_killed_process_is_restarted_while_the_api_keeps_answering(launcher: Launcher, kind: str) -> None:
    before = launcher.children()
    victim = before[kind][0]
    mark = len(launcher.output())
    answers = Answers(launcher)
    try:
        wait_until(lambda: answers.seen, timeout=10, what="a first answer")
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        name = re.escape(NAMES[kind])
        launcher.wait_for(rf"platform: {name} was killed by SIGKILL; restarting it", timeout=10, start=mark)
        launcher.wait_for(rf"platform: {name} restarted", timeout=RESTART_SECONDS, start=mark)
        back = wait_until(
            lambda: (
                (now := launcher.children())[kind]
                and len(now[kind]) == len(before[kind])
                and victim not in now[kind]
                and all(alive(pid) for pid in now[kind])
            ),
            timeout=RESTART_SECONDS,
            what=f"{kind} to be back",
        )
        assert back
        # The API answers from the database again (PostgreSQL's clients reconnect on their own).
        wait_until(
            lambda: answers.seen[-1][0] > killed_at and answers.seen[-1][1] == NOT_FOUND,
            timeout=RESTART_SECONDS,
            what="the API to answer again",
        )
        recovered_at = time.monotonic()
    finally:
        answers.stop()
    during = answers.between(killed_at, recovered_at)
    said = re.findall(r"^platform: .*$", launcher.output()[mark:], re.MULTILINE)
    print(
        f"\n{kind}: back in {recovered_at - killed_at:.1f}s; answers meanwhile: {dict(during)}",
        *said,
        sep="\n  ",
    )
    assert set(during) <= {NOT_FOUND, UNAVAILABLE}, during
    assert during[NOT_FOUND] > 0, "the API stopped answering"
    if kind != "postgres":
        assert during[UNAVAILABLE] == 0, during
    # Nothing else was restarted.
    others = {k: v for k, v in launcher.children().items() if k != kind}
    assert others == {k: v for k, v in before.items() if k != kind}


def test_the_generated_secrets_are_private_and_metrics_need_the_token(launcher: Launcher) -> None:
    secrets = {}
    for name in ("secret_key", "metrics_token"):
        path = launcher.root / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        secrets[name] = path.read_text().strip()
        assert len(secrets[name]) >= 50
    assert f"Authorization: Bearer {secrets['metrics_token']}" in launcher.output()
    web = launcher.children()["gunicorn"][0]
    raw = Path(f"/proc/{web}/environ").read_bytes().decode()
    environment = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
    assert environment["SECRET_KEY"] == secrets["secret_key"]
    assert str(launcher.root) not in environment["SECRET_KEY"]
    status, content_type, body = launcher.get("/metrics", token="not-the-token")
    assert (status, content_type.split(";")[0]) == (401, "text/plain") and b"t-19" not in body
    status, _, body = launcher.get("/metrics", token=secrets["metrics_token"])
    assert status == 200 and b"tokenbudget_metrics_database_up 1.0" in body


def test_a_process_that_keeps_dying_stops_the_platform_as_a_crash_loop(launcher: Launcher) -> None:
    """Runs last: it ends the module's launcher."""
    mark = len(launcher.output())
    killed: set[int] = set()
    deadline = time.monotonic() + 120
    while launcher.process.poll() is None and time.monotonic() < deadline:
        for pid in launcher.children()["celery beat"]:
            if pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.05)
    assert launcher.process.wait(60) == 1
    output = launcher.output()[mark:]
    assert re.search(
        r"platform: celery beat is in a crash loop: it died 5 times within 60s "
        r"\(last: was killed by SIGKILL\); giving up and stopping the platform",
        output,
    ), output
    delays = re.findall(r"celery beat was killed by SIGKILL; restarting it in ([\d.]+)s", output)
    assert [float(delay) for delay in delays] == sorted(float(delay) for delay in delays)
    # Stopped cleanly: nothing of the platform is left running, the port is free, PostgreSQL shut down.
    wait_until(lambda: not launcher.leftovers(), timeout=30, what="every process of the platform to end")
    assert not (launcher.root / "pg" / "postmaster.pid").exists()
    assert "database system is shut down" in (launcher.root / "pg" / "server.log").read_text()
