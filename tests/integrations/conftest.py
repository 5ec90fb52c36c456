"""Fixtures of the LiteLLM integration tests: a real LiteLLM proxy in front of the provider simulator, and our
API served by gunicorn on pytest-django's test database (real commits), the demo configuration applied.

The proxy takes tens of seconds to start and lives for the module; the simulator and gunicorn are started anew
for every test (the simulator's ledger is compared with that test's reservations, whose data is flushed after
it), on ports fixed for the module because the proxy's configuration names them."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from budgeting.provisioning.apply import apply_config
from budgeting.provisioning.source import load_file
from simulation.completions import default_prompt_counter
from simulation.provider import Simulator
from tests.e2e_faults.harness import DEMO, PROVIDER_KEY, TOKEN, database_url_for_subprocesses
from tests.integrations.litellm_proxy import ROOT, LiteLLMProxy, ensure_venv
from tests.ports import free_port

# The model groups the proxy serves, and how the hook maps each (tokenbudget_litellm.settings).
MODEL_GROUPS = {
    "contract-review": {
        "modelPool": "eu-large",
        "modelRevision": "model@2026-07-01",
        "taskClass": "contract-review",
        "tenant": "t-19",
        "maxOutput": 200,
        "outputSafety": ["No legal advice beyond the documents."],
        "authorizationScope": {"permissions": ["contracts:read"]},
        # A call admitted on the fallback model goes to the proxy model serving it.
        "deployments": {"small@2026-05-12": "contract-review-small"},
    },
    "support": {
        "modelPool": "eu-large",
        "modelRevision": "model@2026-07-01",
        "taskClass": "support-chat",
        "tenant": "t-19",
        "maxOutput": 100,
    },
}


# The hook's one deadline per call to our API: short, so the hung-API test is quick, and long enough for a
# fresh server's first (cold) admission of a 20k-token request on a busy machine.
HOOK_DEADLINE_S = 8


@dataclass
class RecordingCounter:
    """The simulator's prompt counter, keeping every ``messages`` list it counted: what the provider got."""

    seen: list[list[dict[str, Any]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, messages: Sequence[Mapping[str, Any]]) -> int:
        with self.lock:
            self.seen.append(copy.deepcopy([dict(message) for message in messages]))
        return default_prompt_counter(messages)


@dataclass
class Ports:
    api: int
    sim: int


@pytest.fixture(scope="session")
def litellm_venv() -> Path:
    venv, seconds = ensure_venv()
    if seconds is not None:
        print(f"\nLiteLLM venv built in {seconds:.0f} s at {venv}")
    return venv


@pytest.fixture(scope="module")
def ports() -> Ports:
    return Ports(api=free_port(), sim=free_port())


@contextlib.contextmanager
def running_proxy(
    venv: Path,
    ports: Ports,
    workdir: Path,
    *,
    model_groups: Mapping[str, Any] = MODEL_GROUPS,
    refuser_first: bool = False,
    **settings: Any,
) -> Iterator[LiteLLMProxy]:
    """A LiteLLM proxy serving ``model_groups`` (and ``contract-review-small``) from the simulator on
    ``ports.sim``, its hook calling our API on ``ports.api``, the ``refuser`` callback after it (before it
    with ``refuser_first``); ``settings`` are added to the hook's."""
    proxy = LiteLLMProxy(venv, workdir, free_port())

    def backend(model: str) -> dict[str, str]:
        return {
            "model": f"openai/{model}",
            "api_base": f"http://127.0.0.1:{ports.sim}/v1",
            "api_key": PROVIDER_KEY,
        }

    callbacks = ["tokenbudget_litellm.hook.proxy_handler_instance", "refuser.proxy_handler_instance"]
    config = {
        "model_list": [
            *({"model_name": name, "litellm_params": backend("model@2026-07-01")} for name in model_groups),
            {"model_name": "contract-review-small", "litellm_params": backend("small@2026-05-12")},
        ],
        "litellm_settings": {
            # Ours, then a guardrail refusing what a test asks it to (``refuser``, beside the config).
            "callbacks": callbacks[::-1] if refuser_first else callbacks
        },
    }
    shutil.copy(Path(__file__).with_name("refuser.py"), proxy.workdir)
    hook_settings = {
        "apiUrl": f"http://127.0.0.1:{ports.api}",
        "timeoutSeconds": HOOK_DEADLINE_S,
        "modelGroups": model_groups,
        **settings,
    }
    started = time.monotonic()
    try:
        proxy.start(config, hook_settings, TOKEN)
        print(f"\nLiteLLM proxy ready in {time.monotonic() - started:.1f} s")
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def proxy(
    litellm_venv: Path, ports: Ports, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiteLLMProxy]:
    with running_proxy(litellm_venv, ports, tmp_path_factory.mktemp("litellm")) as proxy:
        yield proxy


@pytest.fixture
def sim(ports: Ports) -> Iterator[tuple[Simulator, RecordingCounter]]:
    counter = RecordingCounter()
    simulator = Simulator(seed=5, max_words_per_chunk=3, prompt_counter=counter)
    simulator.start(port=ports.sim)
    yield simulator, counter
    simulator.stop()


@dataclass
class Gunicorn:
    """Our API, served by gunicorn on the test database."""

    port: int
    log: Path
    process: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    quit_seconds: int = 5

    def start(self) -> None:
        env = {
            **os.environ,
            "DATABASE_URL": database_url_for_subprocesses(),
            "DB_CONN_MAX_AGE": "0",
            **self.env,
        }
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "budgeting.wsgi:application", "--bind",
                 f"127.0.0.1:{self.port}", "--workers", "1", "--threads", "4", "--log-level", "warning",
                 "--graceful-timeout", str(self.quit_seconds)],
                cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        # Generous: on a busy machine gunicorn takes a while to import the app.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/", timeout=2):
                    return
            except OSError:  # refused, reset or not answering yet (URLError is one)
                time.sleep(0.2)
        raise AssertionError(
            f"gunicorn did not answer on {self.port}:\n{self.log.read_text(errors='replace')}"
        )

    def stop(self) -> None:
        """gunicorn's quick shutdown (SIGQUIT: its workers are killed after ``quit_seconds`` if they do not
        stop), then SIGKILL to whatever of its session is left, the master included if it has not exited: a
        worker outliving its master would keep serving, and holding connections to, the test database."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(self.quit_seconds + 2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(5)


@pytest.fixture
def api_env() -> dict[str, str]:
    """Settings of our API for this test (overridden by a test module: a short lease)."""
    return {}


@pytest.fixture
def api(
    transactional_db: None, redis_db: Any, ports: Ports, tmp_path: Path, api_env: dict[str, str]
) -> Iterator[Gunicorn]:
    """The demo configuration applied, committed, and served by gunicorn (stopped before the test's data is
    flushed, so no request of it can hold a lock the flush waits for)."""
    apply_config(load_file(DEMO))
    server = Gunicorn(ports.api, tmp_path / "gunicorn.log", env=api_env)
    try:
        server.start()
        yield server
    finally:
        server.stop()
