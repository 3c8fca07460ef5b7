"""``cpplan replay STEP.msgpack``: all ranks of one recorded step in one process, vs the oracle.

Ranks run as threads and their collectives are in-process tensor operations; each rank's cache
is rebuilt from coordinates. The seed comes from ``replay.json`` beside the step file (written by
``cpplan simulate --record``; default 0). Exit 0 when the step matches the oracle, 1 otherwise.
A step beyond what one process replays (``check_replay_size``: ranks, tokens, cache bytes,
oracle scores) is refused up front, exit 2, before anything is allocated.
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
# What one replay process holds (every rank is a thread of it): refused above these, up front
MAX_REPLAY_RANKS = 8  # world_size: each rank thread's buffers grow with the world
MAX_REPLAY_TOKENS = 1 << 15  # sum of extents (c + q): the history every rank regenerates
MAX_REPLAY_CACHE_BYTES = 1 << 30  # every rank's layer caches together
MAX_REPLAY_SCORES = 1 << 22  # the oracle's largest request: q * extent indexer scores

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


def check_replay_size(plan) -> None:
    """Refuse (CapacityError, one line) a plan whose replay would outgrow one process: more
    than MAX_REPLAY_RANKS ranks, more than MAX_REPLAY_TOKENS tokens of context, caches beyond
    MAX_REPLAY_CACHE_BYTES, or a request whose oracle scores more than MAX_REPLAY_SCORES
    (query, key) pairs. Computed from the plan's columns only (O(requests))."""
    from cpplan.schemas.errors import CapacityError

    cfg = plan.config
    if cfg.world_size > MAX_REPLAY_RANKS:
        raise CapacityError(f"replay runs every rank in one process: at most {MAX_REPLAY_RANKS}"
                            f" ranks: got {cfg.world_size} (P={cfg.pcp_size}, W={cfg.dcp_size})")
    extents = plan.extent()
    tokens = int(extents.sum())
    if tokens > MAX_REPLAY_TOKENS:
        raise CapacityError(f"replay regenerates every request's context: at most "
                            f"{MAX_REPLAY_TOKENS:,} tokens (sum of c + q): got {tokens:,}")
    # as _run_rank sizes them: 1 + N * blocks of the longest request's shard, per rank, layer
    blocks = 1 + plan.num_requests * max(1, -(-cfg.shard_rows(int(extents.max()))
                                             // cfg.block_size))
    cache = (cfg.world_size * cfg.num_layers * blocks * cfg.block_size
             * (cfg.kv_bytes_per_token + cfg.index_k_bytes_per_token))
    if cache > MAX_REPLAY_CACHE_BYTES:
        raise CapacityError(f"replay's layer caches would take {cache:,} bytes: at most "
                            f"{MAX_REPLAY_CACHE_BYTES:,}")
    scores = int((plan.num_scheduled_tokens.np().astype(extents.dtype) * extents).max())
    if scores > MAX_REPLAY_SCORES:
        raise CapacityError(f"replay's oracle scores q * extent keys per request: at most "
                            f"{MAX_REPLAY_SCORES:,}: got {scores:,}")


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
    from cpplan.sim.replay import check_replayable, replay_plan
    from cpplan.sim.simulate import TOLERANCE

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device here")
    check_replayable(plan)  # not a simulation model's plan: said before its size
    check_replay_size(plan)  # before anything is allocated
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
