"""cpplan plan: compile a step file into a plan file and print its digest."""

from __future__ import annotations

import argparse

from cpplan.cli.common import PATHS_NOTE, add_config_flags, config_from_args, named, path_arg, read_file
from cpplan.schemas import decode_step, digest, encode_plan
from cpplan.schemas.files import check_output_target, write_atomic

EXAMPLE = """example:
  cpplan plan examples/step.json --pcp 2 --dcp 2 -o step.msgpack
  cpplan plan step.json --config config.json -o step.msgpack
""" + PATHS_NOTE + "\n"


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan", help="compile a step into a plan file", epilog=EXAMPLE,
        description="Compile STEP (JSON or msgpack) for a config; write the plan; print its "
                    "digest. The same step and config always give the same file bytes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("step", metavar="STEP", type=path_arg, help="step file (JSON or msgpack)")
    parser.add_argument("-o", "--output", required=True, metavar="PLAN.msgpack", type=path_arg,
                        help="the plan file to write (never one of the inputs)")
    add_config_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from cpplan.planner import compile as compile_plan

    inputs = (args.step, args.config)
    check_output_target(args.output, inputs)  # before the work, not after
    config = config_from_args(args)
    step = named(args.step, decode_step, read_file(args.step))
    plan = compile_plan(config, step)
    write_atomic(args.output, encode_plan(plan), inputs=inputs)
    print(digest(plan).hex())
    return 0
