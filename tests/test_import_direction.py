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


def _imports_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def test_only_cpplan_vllm_imports_vllm():
    """vLLM is an optional engine: nothing of the package outside cpplan/vllm/ imports it (its
    tests and bench/vllm_guard.py do), so the planner, runtime and CLI install and run without
    it (issue 64's contract)."""
    roots = [ROOT / d for d in ("planner", "schemas", "runtime", "cpplan")]
    files = [p for r in roots for p in sorted(r.rglob("*.py"))
             if not p.is_relative_to(ROOT / "cpplan" / "vllm")]
    assert len(files) > 50
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in files
           for line, mod in _imported_modules(ast.parse(p.read_text(), filename=str(p)))
           if _imports_vllm(mod)]
    assert bad == []
    # and the scan would see one
    assert _imports_vllm("vllm.v1.worker.gpu.pcp_manager") and not _imports_vllm("vllmx")


def test_the_adapter_does_not_import_vllm():
    """adapter.py and version.py run where vLLM is absent (a scheduler process, the main CI
    venv): only the plugin (and check_vllm_version, lazily, inside a function) import it."""
    for name in ("adapter.py", "guard.py", "record.py"):
        tree = ast.parse((ROOT / "cpplan" / "vllm" / name).read_text())
        assert not [m for _, m in _imported_modules(tree) if _imports_vllm(m)], name
