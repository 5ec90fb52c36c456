"""A real LiteLLM proxy for the integration tests: its own venv (built once, cached outside the repository)
and its process, configured with our hook and routing to the provider simulator."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "gateway" / "litellm-requirements.txt"
_DONE = ".complete"


def venv_path() -> Path:
    """``$XDG_CACHE_HOME/token-budget/litellm-venv-<hash>`` (default ``~/.cache``): the hash covers the
    pinned requirements and this Python, so a change to either builds a new venv."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes() + sys.version.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "token-budget" / f"litellm-venv-{digest}"


def ensure_venv() -> tuple[Path, float | None]:
    """The venv's directory, built first if missing; and the build's seconds (``None`` when cached).

    pip installs the pinned ``uv`` first, and uv the rest (it downloads in parallel: about 30 s against
    several minutes for pip). Built in place (a venv cannot be moved) under a lock, and marked complete only
    at the end, so an interrupted build is redone and two test runs never build at once. Raises
    ``RuntimeError`` if an install fails.
    """
    venv = venv_path()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with (venv.parent / f"{venv.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / _DONE).exists():
            return venv, None
        started = time.monotonic()
        python = str(venv / "bin" / "python")
        [uv] = [line for line in REQUIREMENTS.read_text().splitlines() if line.startswith("uv==")]
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        for step in (
            [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", uv],
            [str(venv / "bin" / "uv"), "pip", "install", "--quiet", "--no-deps", "--python", python,
             "-r", str(REQUIREMENTS)],
        ):  # fmt: skip
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"building the LiteLLM venv failed: {step}\n{done.stdout}\n{done.stderr}")
        seconds = time.monotonic() - started
        (venv / _DONE).write_text(f"built in {seconds:.0f} s\n")
        return venv, seconds


@dataclass
class LiteLLMProxy:
    """``litellm --config`` on loopback with our hook loaded; ``master_key`` is random (the proxy refuses
    the documented sample key) and it runs without a database, offline (the local model cost map).
    ``gateway`` is the folder the hook is imported from; ``extra_env`` is added to its environment."""

    venv: Path
    workdir: Path
    port: int
    master_key: str = ""
    process: subprocess.Popen[bytes] | None = None
    gateway: Path = ROOT / "gateway"
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / "proxy.log"

    def start(
        self, config: dict[str, Any], hook_settings: dict[str, Any], api_token: str, master_key: str = ""
    ) -> None:
        """Write the proxy's config and the hook's settings, start it and wait until it answers (with
        ``master_key``, or a random one)."""
        self.master_key = master_key or f"sk-{secrets.token_hex(16)}"
        config_path = self.workdir / "litellm.json"
        settings_path = self.workdir / "tokenbudget-hook.json"
        config_path.write_text(json.dumps(config))
        settings_path.write_text(json.dumps(hook_settings))
        # A clean environment: the proxy would take the platform's DATABASE_URL or REDIS_URL as its own.
        env = {
            "PATH": f"{self.venv / 'bin'}:/usr/bin:/bin",
            "HOME": os.environ.get("HOME", "/tmp"),
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(self.gateway),
            "LITELLM_MASTER_KEY": self.master_key,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "TOKEN_BUDGET_LITELLM_CONFIG": str(settings_path),
            "TOKEN_BUDGET_TOKEN": api_token,
            **self.extra_env,
        }
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [str(self.venv / "bin" / "litellm"), "--config", str(config_path), "--host", "127.0.0.1",
                 "--port", str(self.port), "--num_workers", "1"],
                cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self._wait_ready(timeout=180)

    def _wait_ready(self, timeout: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"the LiteLLM proxy exited with {self.process.returncode}:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health/liveliness", timeout=2):
                    return
            except OSError:  # refused, reset or not answering yet (URLError is one)
                time.sleep(0.3)
        raise AssertionError(f"the LiteLLM proxy did not answer within {timeout} s:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL of its session if it does not stop within 10 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)
