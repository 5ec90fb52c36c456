"""No Django secret key derived from the install folder (issue 11, item 14) and a production configuration
that passes ``manage.py check --deploy`` (item 16), while the local run stays zero-config plain http.

Settings are loaded in subprocesses: they are read once per process, from the environment."""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from budgeting.launcher import commands

ROOT = Path(__file__).resolve().parents[2]
SHOW = """
import json, django
django.setup()
from django.conf import settings as s
print(json.dumps({name: getattr(s, name) for name in (
    "SECRET_KEY", "DJANGO_ENV", "SECURE_SSL_REDIRECT", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE",
    "SECURE_HSTS_SECONDS", "SECURE_PROXY_SSL_HEADER")}))
"""
PRODUCTION = {"DJANGO_ENV": "production", "ALLOWED_HOSTS": "tokens.example.com"}


def environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"SECRET_KEY", "DJANGO_ENV", "DEBUG"}}
    return {**env, "TB_VAR_DIR": str(tmp_path), "DJANGO_SETTINGS_MODULE": "budgeting.settings", **extra}


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def loaded(tmp_path: Path, **extra: str) -> dict[str, object]:
    done = run(["-c", SHOW], environment(tmp_path, **extra))
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_without_a_configured_key_none_is_derived_from_the_install_folder(tmp_path: Path) -> None:
    first, second = loaded(tmp_path), loaded(tmp_path)
    for key in (first["SECRET_KEY"], second["SECRET_KEY"]):
        assert isinstance(key, str) and len(key) >= 50
        assert str(ROOT) not in key and "insecure" not in key
    assert first["SECRET_KEY"] != second["SECRET_KEY"]


def test_the_key_the_launcher_generated_is_the_one_every_process_uses(tmp_path: Path) -> None:
    key = secrets.token_urlsafe(50)
    (tmp_path / "secret_key").write_text(key + "\n")
    assert loaded(tmp_path)["SECRET_KEY"] == key
    assert loaded(tmp_path, SECRET_KEY="from-the-environment")["SECRET_KEY"] == "from-the-environment"


def test_production_refuses_to_start_without_a_secret_key(tmp_path: Path) -> None:
    (tmp_path / "secret_key").write_text(secrets.token_urlsafe(50))
    done = run(["-c", SHOW], environment(tmp_path, **PRODUCTION))
    assert done.returncode != 0
    assert "ImproperlyConfigured: SECRET_KEY is not set" in done.stderr
    assert run(["-c", SHOW], environment(tmp_path, DJANGO_ENV="staging")).returncode != 0


def test_check_deploy_passes_for_production(tmp_path: Path) -> None:
    env = environment(tmp_path, **PRODUCTION, SECRET_KEY=secrets.token_urlsafe(50))
    done = run(["manage.py", "check", "--deploy", "--fail-level", "WARNING"], env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "System check identified no issues" in done.stdout and "WARNING" not in done.stdout + done.stderr
    production = loaded(
        tmp_path, **PRODUCTION, SECRET_KEY="k" * 60, SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto: https"
    )
    assert production["SECURE_SSL_REDIRECT"] and production["SESSION_COOKIE_SECURE"]
    assert production["CSRF_COOKIE_SECURE"] and production["SECURE_HSTS_SECONDS"] == 365 * 24 * 3600
    assert production["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]


def test_the_local_configuration_stays_plain_http(tmp_path: Path) -> None:
    local = loaded(tmp_path)
    assert local["DJANGO_ENV"] == "local"
    assert not (local["SECURE_SSL_REDIRECT"] or local["SESSION_COOKIE_SECURE"] or local["CSRF_COOKIE_SECURE"])
    assert local["SECURE_HSTS_SECONDS"] == 0 and local["SECURE_PROXY_SSL_HEADER"] is None


ENVIRONMENT_KEYS = (
    "SECRET_KEY", "METRICS_TOKEN", "DJANGO_ENV", "LEASE_SECONDS", "WEB_CONCURRENCY",
    "PROMETHEUS_MULTIPROC_DIR",
)  # fmt: skip


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``demo_environment`` writes os.environ; monkeypatch puts every key back afterwards."""
    for key in ENVIRONMENT_KEYS:
        monkeypatch.delenv(key, raising=False)


def test_the_launcher_generates_its_secrets_once_as_private_files(
    tmp_path: Path, clean_environment: None
) -> None:
    commands.demo_environment(tmp_path)
    generated = {name: (tmp_path / name).read_text().strip() for name in ("secret_key", "metrics_token")}
    for name, value in generated.items():
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
        assert len(value) >= 50 and str(ROOT) not in value
    assert os.environ["SECRET_KEY"] == generated["secret_key"]
    assert os.environ["METRICS_TOKEN"] == generated["metrics_token"]
    for key in ("SECRET_KEY", "METRICS_TOKEN"):
        del os.environ[key]
    commands.demo_environment(tmp_path)
    assert (os.environ["SECRET_KEY"], os.environ["METRICS_TOKEN"]) == (
        generated["secret_key"],
        generated["metrics_token"],
    )


def test_the_launcher_generates_no_key_for_production(tmp_path: Path, clean_environment: None) -> None:
    os.environ["DJANGO_ENV"] = "production"
    commands.demo_environment(tmp_path)
    assert "SECRET_KEY" not in os.environ and not (tmp_path / "secret_key").exists()
