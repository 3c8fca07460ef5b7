"""Data flows one way (docs/design.md §8): nothing under runtime/, planner/ or schemas/ imports
the embedding API, the CLI or the simulation harness. Checked statically (ast) over every
module, so a lazy import inside a function counts too. (torch in planner/schemas:
tests/test_boundary.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOWER_LAYERS = ("runtime", "planner", "schemas")
FORBIDDEN = ("cpplan.api", "cpplan.cli", "cpplan.sim")


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import; ``from cpplan import sim`` counts as ``cpplan.sim``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _forbidden(module: str) -> bool:
    return any(module == bad or module.startswith(bad + ".") for bad in FORBIDDEN)


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return [f"{where}:{line} imports {mod}"
            for line, mod in _imported_modules(tree) if _forbidden(mod)]


def test_lower_layers_do_not_import_api_cli_or_sim():
    files = [p for layer in LOWER_LAYERS for p in sorted((ROOT / layer).rglob("*.py"))]
    assert len(files) > 20  # the scan really sees the packages
    bad = [v for p in files for v in _violations(p)]
    assert bad == []


@pytest.mark.parametrize("source,hit", [
    ("import cpplan.sim.launch\n", True),
    ("from cpplan.sim.replay import replay_plan\n", True),
    ("from cpplan import sim\n", True),
    ("def f():\n    from cpplan.api import StepExecutor\n", True),
    ("import cpplan.cli as c\n", True),
    ("from cpplan import simple\n", False),
    ("from cpplan.runtime import collectives\n", False),
    ("from . import sim\n", False),  # relative: inside the same package, never a layer above
])
def test_the_scan_catches_upward_imports(tmp_path, source, hit):
    module = tmp_path / "x.py"
    module.write_text(source)
    assert bool(_violations(module)) is hit
