"""The LiteLLM integration needs no Django: all of ``tokenbudget_litellm`` but the hook and its transport
imports with the standard library only, and what those miss there is LiteLLM's (FastAPI, aiohttp)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"

# -I -S: no PYTHONPATH, no current folder, no site-packages; only the standard library and the gateway folder.
IMPORT = """
import importlib, sys
sys.path.insert(0, {gateway!r})
for name in ("tokenbudget_litellm", "tokenbudget_litellm.settings", "tokenbudget_litellm.mapping",
             "tokenbudget_litellm.calls", "tokenbudget_litellm.reports", "tokenbudget_litellm.arrival"):
    importlib.import_module(name)
for name in ("tokenbudget_litellm.transport", "tokenbudget_litellm.hook"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as missing:
        print(missing.name)
"""


def test_only_the_hook_needs_more_than_the_standard_library() -> None:
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", IMPORT.format(gateway=str(GATEWAY))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    transport, hook = result.stdout.split()
    assert transport == "aiohttp" and hook in {"fastapi", "litellm", "aiohttp"}
    modules = {path.stem for path in (GATEWAY / "tokenbudget_litellm").glob("[!_]*.py")}
    expected = {"settings", "mapping", "calls", "reports", "arrival", "transport", "hook"}
    assert modules == expected, "a new module: add it above"
