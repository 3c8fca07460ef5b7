"""The layout of runtime/kernels: no import cycles, jitted bodies only in ``*_jit`` modules, and
``import triton`` inside the ``triton`` backend package is the Triton compiler."""

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "runtime" / "kernels"
PKG = "cpplan.runtime.kernels"
HAS_GLUON = importlib.util.find_spec("triton.experimental.gluon") is not None


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the kernels package (packages by their __init__)."""
    out = {}
    for f in sorted(KERNELS.rglob("*.py")):
        parts = f.relative_to(KERNELS).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((PKG, *parts))] = f
    return out


def _imports(name: str, path: Path, modules) -> set[str]:
    """Kernels modules that ``name`` imports, by any import statement (also inside functions).
    Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` too, except for packages that
    contain ``name`` (already initialising when it runs)."""
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rsplit(".", 1)[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{anchor}.{base}" if base else anchor
            targets.add(base)
            targets |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
    deps = set()
    for t in targets:
        parts = t.split(".")
        for i in range(len(parts)):
            mod = ".".join(parts[: i + 1])
            if mod in modules and mod != name and not (name.startswith(mod + ".")):
                deps.add(mod)
    return deps


def test_no_import_cycles_static():
    """Every import statement of the package, the lazy ones too, points one way. The only
    upward reference is ``dispatch.get_kernels`` loading a backend package by name (importlib)
    when asked for it; backends import ``dispatch`` for ``KernelSet``."""
    modules = _modules()
    graph = {m: _imports(m, f, modules) for m, f in modules.items()}
    assert graph[f"{PKG}.triton.attention"] >= {f"{PKG}.triton.attention_jit", f"{PKG}.triton.plan"}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join([*stack[stack.index(d):], d]))
            if d not in state:
                visit(d, [*stack, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_every_module_imports_alone():
    """Each module imported first in a clean module table (torch and triton stay loaded), the
    Gluon ones included where this Triton has Gluon: nothing relies on a cycle being broken by
    import order."""
    names = [m for m in _modules() if HAS_GLUON or ".gluon" not in m]
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            f"    for m in [m for m in sys.modules if m.startswith({PKG!r})]:\n"
            "        del sys.modules[m]\n"
            "    importlib.import_module(name)\n"
            "print('ok')\n")
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"


def test_jitted_bodies_live_in_jit_modules():
    """@triton.jit / @gluon.jit only in ``*_jit.py`` modules, which import no other kernels module
    but ``fp8_jit`` (the fp8 helpers both backends' bodies share; it imports none). (attention_jit's
    helpers are imported by bench/variants, nothing of the runtime.)"""
    shared = {f"{PKG}.fp8_jit"}
    for name, f in _modules().items():
        tree = ast.parse(f.read_text())
        decorated = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                     and any("jit" in ast.unparse(d) for d in n.decorator_list)]
        if f.stem.endswith("_jit"):
            allowed = set() if name in shared else shared
            assert _imports(name, f, _modules()) <= allowed, name
        else:
            assert not decorated, f"{name}: jitted {decorated} outside a *_jit module"


def test_import_triton_inside_the_backend_is_the_compiler():
    import triton

    from cpplan.runtime.kernels.triton import attention, attention_jit, plan

    assert attention.triton is triton and attention_jit.triton is triton
    assert KERNELS not in Path(triton.__file__).parents and hasattr(triton, "jit")
    assert plan.GLUON_FAMILIES == ("gluon-small", "gluon-ring")


@pytest.mark.skipif(not HAS_GLUON, reason="this Triton has no Gluon")
def test_gluon_package_imports_on_this_machine():
    from cpplan.runtime.kernels.gluon import decode
    from cpplan.runtime.kernels.triton import plan

    assert decode.BLOCK_K == plan.GLUON_BLOCK_K
    assert plan.gluon_available()


def test_kernel_set_lists_the_ops_step_code_calls():
    """``KernelSet``'s ops are exactly those step code (runtime/*.py) calls on its kernel set
    (``k.op(`` / ``kernels.op(``): an op only tests or the oracle use belongs to the reference
    side (dispatch.py's docstring), and step code calls nothing the table lacks."""
    import re

    from cpplan.runtime.kernels import OP_NAMES

    step = "\n".join(p.read_text() for p in sorted((ROOT / "runtime").glob("*.py")))
    assert set(re.findall(r"\b(?:k|kernels)\.(\w+)\(", step)) == set(OP_NAMES)
