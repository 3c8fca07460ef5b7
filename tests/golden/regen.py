"""Regenerate the golden plans on purpose:  python -m tests.golden.regen

Writes tests/golden/v<SCHEMA_VERSION>/: for each scenario its step and config JSON (when
missing, or with --inputs), the compiled plan and its `cpplan inspect --json` report. Refuses
to run when the schema version changed but the folder was not bumped: the newest existing
folder must be v<SCHEMA_VERSION>, or absent (then it is created).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cpplan.planner import compile as compile_plan
from cpplan.report import plan_report
from cpplan.schemas import (
    SCHEMA_VERSION,
    decode_config,
    decode_step,
    encode_config_json,
    encode_plan,
    encode_step_json,
)

ROOT = Path(__file__).resolve().parent


def golden_dir() -> Path:
    return ROOT / f"v{SCHEMA_VERSION}"


def check_version_folder() -> None:
    versions = sorted(int(p.name[1:]) for p in ROOT.glob("v*") if p.name[1:].isdigit())
    if versions and versions[-1] != SCHEMA_VERSION:
        sys.exit(f"refusing: schema version is {SCHEMA_VERSION} but the newest golden folder is "
                 f"v{versions[-1]}; bump SCHEMA_VERSION (and its folder) deliberately")


def report_json(plan) -> str:
    return json.dumps(plan_report(plan), indent=1, sort_keys=True) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", action="store_true",
                        help="also rewrite the step/config JSON from tests/golden/scenarios.py")
    args = parser.parse_args()
    check_version_folder()
    from tests.golden.scenarios import scenarios

    out = golden_dir()
    out.mkdir(exist_ok=True)
    for name, (config, step) in scenarios().items():
        step_path, config_path = out / f"{name}.step.json", out / f"{name}.config.json"
        if args.inputs or not step_path.exists():
            step_path.write_bytes(encode_step_json(step) + b"\n")
            config_path.write_bytes(encode_config_json(config) + b"\n")
        plan = compile_plan(decode_config(config_path.read_bytes()),
                            decode_step(step_path.read_bytes()))
        (out / f"{name}.msgpack").write_bytes(encode_plan(plan))
        (out / f"{name}.inspect.json").write_text(report_json(plan))
    print(f"wrote {len(scenarios())} scenarios to {out}")


if __name__ == "__main__":
    main()
