"""The gateway client installs alone: every module of ``tokenbudget_gateway`` imports with the stdlib only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"

# Run with -I (no PYTHONPATH, no current folder, no user site) and -S (no site-packages): only the standard
# library and the folder put on sys.path here can be imported, as on a gateway that installed this alone.
IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys
sys.path.insert(0, {gateway!r})
import tokenbudget_gateway
assert tokenbudget_gateway.__file__.startswith({gateway!r}), tokenbudget_gateway.__file__
names = [info.name for info in pkgutil.walk_packages(tokenbudget_gateway.__path__, "tokenbudget_gateway.")]
for name in names:
    importlib.import_module(name)
try:
    import django
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("django is importable here, so this run proves nothing")
print(" ".join(sorted(names)))
"""


def run_isolated(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_every_gateway_module_imports_without_django() -> None:
    result = run_isolated(IMPORT_EVERY_MODULE.format(gateway=str(GATEWAY)))

    assert result.returncode == 0, result.stderr
    imported = set(result.stdout.split())
    assert {"tokenbudget_gateway.client", "tokenbudget_gateway.transport"} <= imported
    assert imported == {
        f"tokenbudget_gateway.{path.stem}" for path in (GATEWAY / "tokenbudget_gateway").glob("[!_]*.py")
    }


def test_the_isolated_run_fails_when_a_module_needs_django(tmp_path: Path) -> None:
    """Negative control: the same run, over a copy of the package with one module importing Django, fails."""
    package = tmp_path / "tokenbudget_gateway"
    package.mkdir()
    for source in (GATEWAY / "tokenbudget_gateway").glob("*.py"):
        (package / source.name).write_text(source.read_text())
    (package / "needs_django.py").write_text(
        '"""A module that is not standard-library only."""\n\nimport django\n'
    )

    result = run_isolated(IMPORT_EVERY_MODULE.format(gateway=str(tmp_path)))

    assert result.returncode != 0
    assert "No module named 'django'" in result.stderr
