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

EXAMPLE = """example:
  cpplan simulate --record runs/a && cpplan replay runs/a/step-7.msgpack --device cpu
"""


def register(sub) -> None:
    p = sub.add_parser("replay", help="run all ranks of a recorded step in one process",
                       description=__doc__, epilog=EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", metavar="STEP.msgpack")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=None, help="override replay.json's seed")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(run=run)


def run(args) -> int:
    from cpplan.sim.replay import replay_plan
    from cpplan.sim.simulate import TOLERANCE
    from cpplan.schemas.codec import decode_plan
    from cpplan.schemas.errors import ConfigError

    with open(args.step, "rb") as f:
        plan = decode_plan(f.read())
    seed = args.seed
    meta_path = os.path.join(os.path.dirname(os.path.abspath(args.step)), "replay.json")
    if seed is None and os.path.exists(meta_path):
        with open(meta_path) as f:
            seed = int(json.load(f).get("seed", 0))
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device here")
    result = replay_plan(plan, seed or 0, device=args.device)
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
