"""The rooms' import boundaries hold (``./platform lint`` runs the same check), and the check can fail."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

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


# The text rules of ARCHITECTURE.md ("Where a balance is written", "Lock order"): where a pattern of
# hand-written SQL or a row lock may appear in production code, as paths relative to the checkout. Tests and
# bench/ are not production code (the bench's raw psycopg baselines copy the statements on purpose);
# migrations run once at deploy, never on a request's path.
PRODUCTION = ("budgeting", "ledger", "ladder", "reconciliation", "simulation", "gateway")
TEXT_RULES = {
    "select_for_update": (re.compile(r"select_for_update"), {"ledger/locks.py"}),
    "FOR UPDATE": (re.compile(r"\bFOR\s+UPDATE\b", re.I), {"ledger/locks.py", "ledger/statements.py"}),
    "UPDATE ledger_capacityaccount": (
        re.compile(r"\bUPDATE\s+\"?ledger_capacityaccount\b", re.I),
        {"ledger/statements.py"},
    ),
    "INSERT INTO ledger_ledgerentry": (
        re.compile(r"\bINSERT\s+INTO\s+\"?ledger_ledgerentry\b", re.I),
        {"ledger/statements.py"},
    ),
}


def text_rule_breaches(root: Path) -> list[str]:
    """Every production file under ``root`` with a pattern of ``TEXT_RULES`` outside the files it belongs in,
    as ``path: rule``."""
    found: list[str] = []
    for top in PRODUCTION:
        for path in sorted((root / top).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if "/migrations/" in relative:
                continue
            text = path.read_text(encoding="utf-8")
            found.extend(
                f"{relative}: {name}"
                for name, (pattern, allowed) in TEXT_RULES.items()
                if relative not in allowed and pattern.search(text)
            )
    return found


def test_row_locks_and_balance_statements_are_written_only_where_the_map_says():
    assert text_rule_breaches(ROOT) == []
    # The rules are not vacuous: each pattern is found where it belongs.
    for name, (pattern, allowed) in TEXT_RULES.items():
        assert any(pattern.search((ROOT / path).read_text()) for path in allowed), name


def test_a_planted_file_breaks_each_text_rule(tmp_path):
    """Negative control: a file outside the allowed ones with each pattern is reported, the same text in an
    allowed file or in a migration is not."""
    planted = {
        "ledger/services/sneaky.py": "Reservation.objects.select_for_update().get(pk=1)\n",
        "budgeting/admission/sneaky.py": 'SQL = "SELECT id FROM ledger_reservation FOR  update"\n',
        "reconciliation/sneaky.py": 'SQL = """update "ledger_capacityaccount" SET in_flight = 0"""\n',
        "ledger/sneaky.py": 'SQL = "INSERT INTO ledger_ledgerentry (account_id) VALUES (1)"\n',
        "ledger/locks.py": 'SQL = "SELECT 1 FOR UPDATE"  # select_for_update\n',
        "ledger/statements.py": 'SQL = "UPDATE ledger_capacityaccount; INSERT INTO ledger_ledgerentry"\n',
        "ledger/migrations/0099_backfill.py": 'SQL = "UPDATE ledger_capacityaccount SET in_flight = 0"\n',
    }
    for relative, text in planted.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    assert text_rule_breaches(tmp_path) == [
        "budgeting/admission/sneaky.py: FOR UPDATE",
        "ledger/services/sneaky.py: select_for_update",
        "ledger/sneaky.py: INSERT INTO ledger_ledgerentry",
        "reconciliation/sneaky.py: UPDATE ledger_capacityaccount",
    ]


# The "may" column for what is not a room: the libraries a pure room may import beside the standard library.
# The ladder: the vendors' tokenizer libraries it counts with, and orjson, a pure encoder (no I/O, no state)
# that writes the canonical JSON of a large request's digests several times faster than the standard library,
# byte for byte the same (``ladder.components._orjson_canonical`` falls back where it could differ).
MAY_IMPORT = {
    "ladder": {"tokenizers", "tiktoken", "mistral_common", "sentencepiece", "orjson"},
    "tokenbudget_gateway": set(),
}


def libraries_imported_by(package: str) -> set[str]:
    """The top-level packages outside the standard library that ``package`` (and its modules) import."""
    graph = grimp.build_graph(package, include_external_packages=True)
    modules = graph.find_descendants(package) | {package}
    imported = {i for m in modules for i in graph.find_modules_directly_imported_by(m)}
    tops = {name.split(".")[0] for name in imported}
    return tops - set(sys.stdlib_module_names) - {package}


def test_pure_rooms_import_only_the_libraries_they_may():
    for package, allowed in MAY_IMPORT.items():
        assert libraries_imported_by(package) <= allowed, package


def test_a_planted_import_in_a_pure_room_is_found(tmp_path, monkeypatch):
    """Negative control: a package that imports Django beside what the ladder may import is caught."""
    planted = tmp_path / "planted_room"
    planted.mkdir()
    (planted / "__init__.py").write_text("import json\nimport orjson\n")
    (planted / "sneaky.py").write_text(
        "def f():\n    from django.db import connection\n    return connection\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert libraries_imported_by("planted_room") == {"orjson", "django"}
