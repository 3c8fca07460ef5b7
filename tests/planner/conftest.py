"""Planner tests: the naive reference and the step strategies are helper modules of this folder,
registered under unique names so they never collide with another folder's helpers."""

import importlib.util
import pathlib
import sys

_HERE = pathlib.Path(__file__).parent


def _register(stem: str, name: str) -> None:
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, _HERE / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_register("reference", "planner_reference")
_register("strategies", "planner_strategies")
