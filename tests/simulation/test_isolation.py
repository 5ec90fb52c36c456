"""Nothing in production imports the simulation tooling: no module of the platform's rooms imports it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION_ROOMS = ("budgeting", "ledger", "ladder", "reconciliation")


def imported_modules(source: str) -> set[str]:
    """The absolute module names a Python source imports, at any depth of its syntax tree."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            modules.add(node.module)
    return modules


def imports_simulation(source: str) -> bool:
    return any(name == "simulation" or name.startswith("simulation.") for name in imported_modules(source))


def test_no_production_module_imports_simulation() -> None:
    sources = [path for room in PRODUCTION_ROOMS for path in sorted((ROOT / room).rglob("*.py"))]
    offenders = [str(path.relative_to(ROOT)) for path in sources if imports_simulation(path.read_text())]

    assert len(sources) > 50
    assert offenders == []


def test_the_check_sees_every_form_of_import() -> None:
    """Negative control: each way of importing the simulator is caught, lookalike names are not."""
    assert imports_simulation("import simulation")
    assert imports_simulation("from simulation.provider import Simulator")
    assert imports_simulation("def f():\n    from simulation import traffic\n")
    assert imports_simulation("import simulation.traffic as traffic")
    assert not imports_simulation("import simulations\nfrom reconciliation import simulation_notes\n")
