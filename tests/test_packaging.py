"""pyproject.toml lists its packages explicitly (the folders map onto cpplan.*): none may be
missed. Python 3.10 (the declared minimum) has no tomllib: tomli is used when installed, else a
small reader of the two [tool.setuptools] keys this test needs, itself checked against tomllib
where that exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

try:
    import tomllib as _toml
except ImportError:  # Python 3.10
    try:
        import tomli as _toml
    except ImportError:
        _toml = None


def _setuptools_table_minimal(text: str) -> dict:
    """``packages`` (a list of strings) and ``package-dir`` (an inline table of strings) from
    the ``[tool.setuptools]`` table, each as written in this repository's pyproject."""
    body = text.split("[tool.setuptools]\n", 1)[1].split("\n[", 1)[0]
    packages = re.search(r"^packages\s*=\s*(\[.*?\])", body, re.S | re.M).group(1)
    mapping = re.search(r"^package-dir\s*=\s*(\{.*?\})", body, re.S | re.M).group(1)
    as_dict = re.sub(r'("[^"]*")\s*=\s*', r"\1: ", mapping)
    return {"packages": ast.literal_eval(packages), "package-dir": ast.literal_eval(as_dict)}


def _setuptools_table() -> dict:
    text = (ROOT / "pyproject.toml").read_text()
    if _toml is not None:
        return _toml.loads(text)["tool"]["setuptools"]
    return _setuptools_table_minimal(text)


def test_packages_list_matches_folders():
    meta = _setuptools_table()
    listed = set(meta["packages"])
    found = set()
    for pkg, folder in meta["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    assert found == listed, f"pyproject packages {sorted(listed)} != folders {sorted(found)}"


@pytest.mark.skipif(_toml is None, reason="no TOML parser to compare with (Python 3.10)")
def test_minimal_reader_agrees_with_toml():
    text = (ROOT / "pyproject.toml").read_text()
    full = _toml.loads(text)["tool"]["setuptools"]
    small = _setuptools_table_minimal(text)
    assert small == {"packages": full["packages"], "package-dir": full["package-dir"]}
