"""``cpplan simulate``: run the mini serving loop over a PCP x DCP world, check every step
against the single-device oracle.

The world is spawned here (one process per rank), or, under torchrun (RANK, WORLD_SIZE and
MASTER_ADDR set), this process is one rank of torchrun's world, which must have max(P, W)
ranks; NCCL takes GPU LOCAL_RANK. Rank 0 prints the progress, summary and JSON; every rank
exits with its own code.

Exit codes: 0 every step matches, 1 an output differs from the oracle, 2 bad input, 3 plan
mismatch (``--inject-divergence``), 4 a rank was lost.

A lost or hung rank ends the run within about twice ``--timeout``: the others name it at the
next digest check, and the rest get ``--timeout`` more to answer. Every rank's failure is one
line; CPPLAN_TRACEBACK=1 adds the traceback of an unexpected (non-cpplan) error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time

from cpplan.cli.common import bounded_int

EXAMPLE = """example:
  cpplan simulate                      # P=2 x W=2, fp8_ds_mla, 24 steps, 2 layers
  cpplan simulate --pcp 3 --dcp 3 --interleave 2 --kv-cache-dtype bf16 --json
  cpplan simulate --inject-divergence 5:1:reorder   # every rank stops at step 5, exit 3
  torchrun --standalone --nproc-per-node 4 -m cpplan simulate --pcp 4 --dcp 4 --backend nccl
"""


def register(sub) -> None:
    p = sub.add_parser("simulate", help="run the mini serving loop across ranks vs the oracle",
                       description=__doc__, epilog=EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pcp", type=bounded_int(1, 1024), default=2, help="PCP size P (default 2)")
    p.add_argument("--dcp", type=bounded_int(1, 1024), default=2, help="DCP size W (default 2)")
    p.add_argument("--interleave", type=bounded_int(1, INT32_MAX), default=1, help="interleave size I (default 1)")
    p.add_argument("--kv-cache-dtype", choices=("fp8_ds_mla", "bf16"), default="fp8_ds_mla",
                   help="KV cache format (default fp8_ds_mla)")
    p.add_argument("--steps", type=bounded_int(1, 10**6), default=24,
                   help="scheduler steps at most; the workload may end sooner (default 24)")
    p.add_argument("--seed", type=bounded_int(0, 2**63 - 1), default=0,
                   help="seed of the model's weights and inputs (default 0)")
    p.add_argument("--layers", type=bounded_int(1, 1024), default=2, help="layers (default 2)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="collectives: gloo on CPU processes, nccl on one GPU per rank "
                        "(default gloo)")
    p.add_argument("--graphs", action="store_true",
                   help="CUDA-graph sizes 1..128 in the config: decode-only steps are padded "
                        "to them and, on CUDA, replayed from captured graphs")
    p.add_argument("--warmup", action="store_true",
                   help="compile every kernel variant before the first step (cpplan.warmup)")
    p.add_argument("--verify", choices=("every", "sampled", "off"), default="every",
                   help="the plan digest check across ranks before a step's first collective: "
                        "every step, every N-th, or off (default every)")
    p.add_argument("--verify-every", type=bounded_int(1, 10**6), default=4, metavar="N",
                   help="with --verify sampled: check every N-th step (default 4)")
    p.add_argument("--digest-exchange", choices=("auto", "shm", "gloo"), default="auto",
                   help="how the ranks' plan digests meet: a shared-memory board when every "
                        "rank is on this host (auto, shm), or a gloo all-gather (default auto)")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="seconds before a rank missing from the digest check is declared lost "
                        "(default 30)")
    p.add_argument("--record", metavar="DIR", help="write step-N.msgpack + replay.json")
    p.add_argument("--inject-divergence", metavar="STEP:RANK[:KIND]",
                   help="perturb RANK's step input at STEP (kinds: reorder, q+1, drop, "
                        "config, step-id; default q+1); needs --verify every")
    p.add_argument("--indexer-pattern", metavar="FS..",
                   help="per layer F (full indexer) or S (reuses the previous full layer's "
                        "top-k, as GLM-5's shared layers), repeated over the layers (default: "
                        "every layer F)")
    p.add_argument("--sm-scale", type=float, default=None, metavar="X",
                   help="the model's softmax scale, used by the ranks and the oracle "
                        "(default 1/sqrt(576))")
    p.add_argument("--sampled-rows", action="store_true",
                   help="steps name their sampled rows (decodes, prompts that end): only those "
                        "are restored (restore_sampled) and checked")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON summary")
    p.set_defaults(run=run)


MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 86_400.0
MAX_SPAWNED = 64  # ranks spawned on this host (measured: 8 ranks about 0.4 GB each, 11.5 s)
INT32_MAX = 2**31 - 1


def check_record_dir(path: str) -> None:
    """--record DIR must be a writable folder (created if missing), checked before any rank
    starts: found out at the first recorded step it would cost the whole control timeout."""
    import tempfile

    from cpplan.schemas.errors import OutputError

    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputError(f"--record {path}: not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise OutputError(f"--record {path}: cannot write there: {exc.strerror or exc}") \
            from None


def _options(args):
    from cpplan.schemas.errors import ConfigError
    from cpplan.sim.simulate import INJECT_KINDS, Inject, SimOptions

    inject = None
    if args.inject_divergence is not None:
        parts = args.inject_divergence.split(":")
        try:
            step, rank = int(parts[0]), int(parts[1])
        except (ValueError, IndexError):
            raise ConfigError(f"--inject-divergence must be STEP:RANK[:KIND]: got "
                              f"{args.inject_divergence!r}") from None
        kind = parts[2] if len(parts) > 2 else "q+1"
        if kind not in INJECT_KINDS or len(parts) > 3:
            raise ConfigError(f"--inject-divergence kind must be one of {INJECT_KINDS}: "
                              f"got {kind!r}")
        inject = Inject(step, rank, kind)
    if inject is not None and not 0 <= inject.step < args.steps:
        raise ConfigError(f"--inject-divergence step must be in [0, {args.steps}) for --steps "
                          f"{args.steps}: got {inject.step}")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds: got {args.timeout}")
    if not MIN_TIMEOUT_S <= args.timeout <= MAX_TIMEOUT_S:  # also NaN and inf
        raise ConfigError(f"--timeout must be in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}] seconds "
                          f"(a shorter one declares live ranks lost): got {args.timeout}")
    if inject is not None and args.verify != "every":
        raise ConfigError(f"--inject-divergence needs --verify every: got --verify {args.verify} "
                          "(an unchecked step would run different plans on the ranks: NCCL "
                          "hangs, gloo aborts)")
    extra = {}
    if args.indexer_pattern is not None:
        pattern = args.indexer_pattern
        if not pattern or set(pattern) - set("FS") or pattern[0] != "F":
            raise ConfigError(f"--indexer-pattern: got {pattern!r}; expected letters F and S "
                              "starting with F (a shared layer reuses an earlier full one)")
        extra["indexer_pattern"] = pattern
    if args.sm_scale is not None:
        if not (math.isfinite(args.sm_scale) and args.sm_scale > 0):
            raise ConfigError(f"--sm-scale: got {args.sm_scale}; expected a finite positive "
                              "number")
        extra["sm_scale"] = args.sm_scale
    return SimOptions(**extra, sampled_rows=args.sampled_rows,
                      pcp=args.pcp, dcp=args.dcp, interleave=args.interleave,
                      kv_cache_dtype=args.kv_cache_dtype, steps=args.steps, seed=args.seed,
                      layers=args.layers, backend=args.backend, verify=args.verify,
                      verify_every=args.verify_every, digest_exchange=args.digest_exchange,
                      record=args.record, inject=inject,
                      timeout_s=args.timeout, graphs=args.graphs, warmup=args.warmup)


def run(args) -> int:
    from cpplan.schemas.errors import ConfigError
    from cpplan.sim.simulate import check_inject, preset_config

    opts = _options(args)
    config = preset_config(opts)  # ConfigError (exit 2) for an unsupported topology
    world = config.world_size
    if opts.inject and world == 1:
        raise ConfigError("--inject-divergence needs a world of >= 2 ranks (one rank has no one "
                          "to diverge from): got --pcp 1 --dcp 1")
    if opts.inject and not 0 <= opts.inject.rank < world:
        raise ConfigError(f"--inject-divergence rank must be in [0, {world}): got "
                          f"{opts.inject.rank}")
    check_inject(config, opts)  # a step the workload reaches, a kind that changes it
    from cpplan.sim.launch import torchrun_env

    env = torchrun_env()
    if env is None and world > MAX_SPAWNED:
        raise ConfigError(f"--pcp {opts.pcp} --dcp {opts.dcp} spawns {world} processes here "
                          f"(about 0.4 GB each); expected at most {MAX_SPAWNED}: run larger "
                          "worlds under torchrun")
    if opts.record is not None:  # last: a refused run leaves no folder behind
        check_record_dir(opts.record)
    if env is not None:
        return _as_torchrun_rank(opts, world, env, args.json)
    if opts.backend == "nccl":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < world:
            raise ConfigError(f"--backend nccl needs one GPU per rank: {world} ranks, "
                              f"{have} GPUs (NCCL refuses two ranks on one GPU; use "
                              f"'cpplan replay --device cuda' on a single GPU)")
    return _launch(opts, world, args.json)


def _launch(opts, world: int, as_json: bool) -> int:
    from cpplan.sim.launch import World
    from cpplan.sim.simulate import rank_main

    t0 = time.monotonic()
    _header(opts, world, "spawned")
    previous = signal.signal(signal.SIGTERM, _interrupt)  # so the world is closed on SIGTERM
    try:
        w = World(world, backend=opts.backend, timeout_s=max(opts.timeout_s * 4, 60.0))
        try:
            results = w.run(rank_main, opts, timeout_s=max(600.0, opts.timeout_s * 4),
                            settle_s=opts.timeout_s)
        finally:
            w.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    elapsed = time.monotonic() - t0
    return _report(opts, results, elapsed, as_json)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _as_torchrun_rank(opts, world: int, env, as_json: bool) -> int:
    """Run as rank ``env.rank`` of torchrun's world. Errors that every rank detects alike
    (world size, GPUs) are said once, by rank 0 (local rank 0 for GPUs); the others exit with
    the same code silently."""
    from cpplan.schemas.errors import ConfigError, RankLostError
    from cpplan.sim.launch import RankResult, join_torchrun, leave_torchrun
    from cpplan.sim.simulate import rank_main

    if env.world_size != world:
        return _said_once(env.rank, ConfigError(
            f"torchrun's world has {env.world_size} rank(s): --pcp {opts.pcp} --dcp {opts.dcp} "
            f"needs max(P, W) = {world} (--nproc-per-node x --nnodes)"))
    if opts.backend == "nccl":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < env.local_world_size:
            return _said_once(env.local_rank, ConfigError(
                f"--backend nccl needs one GPU per rank: {env.local_world_size} ranks on this "
                f"host, {have} GPUs"))
    ctx = join_torchrun(opts.backend, timeout_s=max(opts.timeout_s * 4, 60.0))
    if ctx.rank == 0:
        _header(opts, world, "torchrun")
    t0 = time.monotonic()
    try:
        value = rank_main(ctx, opts)
    except BaseException:
        leave_torchrun(clean=False)
        raise
    elapsed = time.monotonic() - t0
    error = value.get("error")
    leave_torchrun(clean=not isinstance(error, RankLostError))
    result = RankResult(ctx.rank, value=value)
    if error is not None:  # each rank names its own failure; rank 0 writes the JSON
        code = _report_failures([(ctx.rank, error, value)], as_json and ctx.rank == 0,
                                torchrun=True)
        # torchrun ends the other ranks as soon as it sees one exit: leave now, without the
        # interpreter's teardown (which can outlast its monitor interval), so that every rank's
        # own exit code reaches its report. The world is left and the output flushed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if ctx.rank == 0:
        return _report(opts, [result], elapsed, as_json)
    return _exit_code_of(value)  # the summary is summed over all ranks: the same on each


def _said_once(speaker: int, exc) -> int:
    if speaker == 0:
        raise exc
    return exc.exit_code


def _header(opts, world: int, how: str) -> None:
    sys.stderr.write(f"cpplan simulate: P={opts.pcp} W={opts.dcp} I={opts.interleave} "
                     f"{opts.kv_cache_dtype}, {world} ranks ({opts.backend}, {how}), "
                     f"{opts.steps} steps x {opts.layers} layers\n")


def _exit_code_of(summary: dict) -> int:
    from cpplan.sim.simulate import TOLERANCE

    return 0 if summary["max_abs_err"] <= TOLERANCE else 1


def rank_failures(results, with_values: bool = False) -> list[tuple]:
    """(rank, error, the rank's record or None) of every rank of a world's ``results`` that
    was lost, raised or reported an error (tracebacks of untyped errors go to stderr)."""
    from cpplan.schemas.errors import RankLostError

    failures = []
    for r in results:
        if r.lost:
            failures.append((r.rank, RankLostError(f"rank {r.rank} lost: {r.lost_reason()}"),
                             None))
        elif r.error is not None:
            _traceback(r.tb)
            failures.append((r.rank, r.error, None))
        elif "error" in r.value:
            _traceback(r.value.get("tb", ""))
            failures.append((r.rank, r.value["error"], r.value if with_values else None))
    return failures


def _report(opts, results, elapsed: float, as_json: bool) -> int:
    from cpplan.sim.simulate import TOLERANCE

    failures = rank_failures(results, with_values=True)
    if failures:
        return _report_failures(failures, as_json)
    s = dict(results[0].value)
    s.pop("rank", None)
    ok = _exit_code_of(s) == 0
    s.update(ok=ok, tolerance=TOLERANCE, seconds=round(elapsed, 2), pcp=opts.pcp, dcp=opts.dcp,
             interleave=opts.interleave, kv_cache_dtype=opts.kv_cache_dtype)
    _table(s, sys.stderr if as_json else sys.stdout)
    if as_json:
        print(json.dumps(s))
    return 0 if ok else 1


def _traceback(tb: str) -> None:
    if tb and os.environ.get("CPPLAN_TRACEBACK") == "1":
        sys.stderr.write(tb)


def _report_failures(failures, as_json: bool, torchrun: bool = False) -> int:
    """One line per failed rank; the exit code is the root cause's: a rank's own failure over
    its peers' PeerFailedError, then 3 over 4 over the rest. Under torchrun a rank knows only
    its own failure: its JSON names the rank instead of counting failed ranks."""
    from cpplan.schemas.errors import CpplanError, PeerFailedError

    codes, causes = [], []
    for rank, exc, rec in failures:
        where = f" at step {rec['step']} (ledger {rec['ledger']} collectives, " \
                f"{rec['elapsed_s']:.2f} s after bind)" if rec else ""
        text = " ".join(str(exc).split())
        sys.stderr.write(f"rank {rank}{where}: {type(exc).__name__}: {text}\n")
        code = exc.exit_code if isinstance(exc, CpplanError) else 1
        codes.append(code)
        if not isinstance(exc, PeerFailedError):
            causes.append((code, rank, exc))
    pool = [c for c, _, _ in causes] or codes
    code = max(pool, key=lambda c: (c == 3, c == 4, c))
    if as_json:
        first = causes[0][2] if causes else failures[0][1]
        where = {"rank": failures[0][0]} if torchrun else {"ranks_failed": len(failures)}
        print(json.dumps({"ok": False, "exit_code": code, **where, "error": str(first)}))
    return code


def _table(s: dict, stream) -> None:
    """The summary: on stdout, or on stderr when stdout carries --json."""
    rows = [("steps", s["steps"]), ("query tokens", s["tokens"]),
            ("gather chunks", s["gather_chunks"]), ("preempted / finished",
                                                    f"{s['preempted']} / {s['finished']}"),
            ("collectives (all ranks)", s["collectives"]), ("digest checks passed",
                                                            s["digest_checks"]),
            ("graph-replayable / replayed", f"{s['graph_steps']} / {s['replayed']}"),
            ("max |out - oracle|", f"{s['max_abs_err']:.2e} (tol {s['tolerance']:.0e})"),
            ("result", "OK" if s["ok"] else "MISMATCH"), ("wall time", f"{s['seconds']} s")]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is not None and stream.isatty():
        table = Table(title="cpplan simulate")
        table.add_column("what")
        table.add_column("value", justify="right")
        for k, v in rows:
            table.add_row(k, str(v))
        Console(file=stream).print(table)
        return
    for k, v in rows:
        stream.write(f"{k:>28}  {v}\n")
