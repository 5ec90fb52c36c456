"""The rooms' import boundaries hold (``./platform lint`` runs the same check), and the check can fail."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
ENV = {
    **os.environ,
    "DATABASE_URL": os.environ.get("DATABASE_URL", "postgres://lint@127.0.0.1:1/lint"),
    "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:1/0"),
}


def lint_imports(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(config), "--no-cache"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_project_keeps_every_contract():
    result = lint_imports(ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


def test_a_broken_boundary_fails_the_check(tmp_path):
    """Negative control: a contract the code does break (the ledger imports the catalog's models, as it may)
    is reported as broken, with the import that breaks it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    config = tmp_path / ".importlinter"
    config.write_text(
        "[importlinter]\n"
        f"root_packages =\n    {chr(10).join('    ' + p for p in project['root_packages']).strip()}\n\n"
        "[importlinter:contract:on-purpose]\n"
        "name = on purpose: the ledger may not import the catalog\n"
        "type = forbidden\n"
        "source_modules =\n    ledger\n"
        "forbidden_modules =\n    budgeting.catalog\n"
    )
    result = lint_imports(config)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BROKEN" in result.stdout
    assert "ledger." in result.stdout and "-> budgeting.catalog" in result.stdout
