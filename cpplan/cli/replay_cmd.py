"""``cpplan replay STEP.msgpack``: all ranks of one recorded step in one process, vs the oracle.

Ranks run as threads and their collectives are in-process tensor operations; each rank's cache
is rebuilt from coordinates. The seed comes from ``replay.json`` beside the step file (written by
``cpplan simulate --record``; default 0). Exit 0 when the step matches the oracle, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from cpplan.cli.common import bounded_int
from cpplan.schemas.files import read_input

MAX_SEED = 2**63 - 1
MAX_META_BYTES = 1 << 20  # replay.json holds a seed

EXAMPLE = """example:
  cpplan simulate --record runs/a && cpplan replay runs/a/step-7.msgpack --device cpu
"""


def register(sub) -> None:
    p = sub.add_parser("replay", help="run all ranks of a recorded step in one process",
                       description=__doc__, epilog=EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", metavar="STEP.msgpack")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=bounded_int(0, MAX_SEED), default=None,
                   help="override replay.json's seed")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(run=run)


def _meta_from(meta_path: str) -> tuple[int, float]:
    """(seed, sm_scale) in ``replay.json``: a JSON object whose optional "seed" is an integer
    in [0, MAX_SEED] and optional "sm_scale" a finite positive number (the recorded run's
    softmax scale; default the simulator's); anything else is a one-line PlanFormatError
    naming the file."""
    import math

    from cpplan.schemas.codec import decode_json_object
    from cpplan.schemas.errors import PlanFormatError
    from cpplan.sim.coords import SIM_SM_SCALE

    meta = decode_json_object(read_input(meta_path, max_bytes=MAX_META_BYTES), meta_path)
    seed = meta.get("seed", 0)
    if type(seed) is not int or not 0 <= seed <= MAX_SEED:
        raise PlanFormatError(f"{meta_path}: seed must be an integer in [0, {MAX_SEED}]: got "
                              f"{seed!r}"[:200])
    scale = meta.get("sm_scale", SIM_SM_SCALE)
    if type(scale) not in (int, float) or not (math.isfinite(scale) and scale > 0):
        raise PlanFormatError(f"{meta_path}: sm_scale must be a finite positive number: got "
                              f"{scale!r}"[:200])
    return seed, float(scale)


def run(args) -> int:
    from cpplan.schemas.codec import decode_plan
    from cpplan.schemas.errors import ConfigError, StepInputError

    plan = decode_plan(read_input(args.step))
    if plan.num_requests == 0:
        raise StepInputError(f"step {plan.step_id} has no requests: nothing to replay")
    from cpplan.sim.coords import SIM_SM_SCALE

    seed, sm_scale = args.seed, SIM_SM_SCALE
    meta_path = os.path.join(os.path.dirname(os.path.abspath(args.step)), "replay.json")
    if os.path.lexists(meta_path):
        recorded, sm_scale = _meta_from(meta_path)
        seed = recorded if seed is None else seed
    from cpplan.sim.replay import replay_plan
    from cpplan.sim.simulate import TOLERANCE

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device here")
    result = replay_plan(plan, seed or 0, device=args.device, sm_scale=sm_scale)
    ok = result.max_abs_err <= TOLERANCE
    summary = {"step_id": result.step_id, "ranks": plan.config.world_size,
               "tokens": result.tokens, "collectives": result.collectives,
               "max_abs_err": result.max_abs_err, "tolerance": TOLERANCE, "ok": ok,
               "device": args.device}
    sys.stderr.write(f"replay step {result.step_id}: {plan.config.world_size} ranks on "
                     f"{args.device}, {result.tokens} tokens, {result.collectives} collectives, "
                     f"max |out - oracle| {result.max_abs_err:.2e} -> {'OK' if ok else 'MISMATCH'}\n")
    if args.json:
        print(json.dumps(summary))
    return 0 if ok else 1
