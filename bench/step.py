"""Runtime step overheads on CPU (gloo): bind cost, digest-check cost, next to kv_insert.

    python bench/step.py [--repeat 50] [--worlds 2 4 8]
    python bench/step.py --host-bind [--repeat 50]  # only host bind at full model dims (3.)
    python bench/step.py --digest-only [--repeat 50] [--worlds 2 4 8]

1. bind (tables + arena pack, no device copy on CPU) per step, median, for 64 / 512 / 4096
   requests (P = W = 2, a mix of decodes and prefills; compile time shown for scale);
2. the digest check (xxh3-128 of the plan + the 17-byte exchange: the shared-memory board and
   the gloo all-gather, each awaited, after a barrier) at world 2 / 4 / 8, next to one
   typical kv_insert (gloo all-gather of [T - nd, 656] uint8 per rank,
   T = 512) in the same world. Worlds are spawned processes on this host: on a 2-core machine
   a world of 8 is oversubscribed, so its figures are an upper bound.
3. (``--host-bind``; ``--issue15`` is its old name) host bind at full model dims (128 heads,
   topk 2048, fp8_ds_mla, max_model_len 32k) for 64 decodes of 2k-6k context (also with
   CUDA-graph sizes: the static layout ``bench/step_gpu.py --graphs`` binds), and for a 32k
   prompt plus those 64 decodes, at P = W = 1 and P = W = 2 (rank 0). Parts: the block-table
   check, the host tables (written into the arena) and the arena's copy (on CUDA the one H2D
   copy and its event; on this CPU none). Host time on a GPU also counts the launch of device
   ops (about 5-10 us each there), so the ATen calls that are not views are counted, for bind
   (on CUDA add the H2D copy) and for the table expansion at first use (``BoundStep.tables``,
   in the first insert, not in bind), as well as the Python and C calls one bind makes. Back to
   back, bind runs with hot caches; in a step it follows the previous step's work (on the H200:
   0.36 ms in ``bench/step_gpu.py --prompt 0`` against 93 us for its parts alone), so it is
   also timed after each of a small CPU step (insert + attend of another executor's 2 layers,
   reference kernels): the "bind ms in a step" column, which moves by tens of percent between
   runs.
Writes a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from cpplan.api import ParallelConfig, StepExecutor, StepInput, compile
from cpplan.runtime.executor import DUMMY_SLOT
from cpplan.runtime.groups import Groups
from cpplan.runtime.segments import build_tables
from cpplan.runtime.tables import TABLE_NAMES
from cpplan.runtime.verify import DigestCheck
from cpplan.sim.launch import World


class _NoComm:
    """No transport: these plans are bound and never run."""


def _config(w: int) -> ParallelConfig:
    return ParallelConfig(pcp_size=w, dcp_size=w, num_heads=16, topk=2048,
                          activation_dtype="bfloat16", max_model_len=131072, num_layers=61)


def _step(n: int, seed: int = 0) -> StepInput:
    rng = np.random.default_rng(seed)
    pre = np.arange(n) % 8 == 0  # 1 in 8 prefilling
    c = rng.integers(0, 8192, n)
    q = np.where(pre, rng.integers(1, max(2, 8192 // max(n // 8, 1)), n), 1)
    return StepInput.build(1, [f"r{i}" for i in range(n)], c, q, pre)


def bench_bind(repeat: int) -> list[tuple]:
    rows = []
    cfg = _config(2)
    for n in (64, 512, 4096):
        plan = compile(cfg, _step(n))
        blocks = -(-cfg.shard_rows(cfg.max_model_len) // cfg.block_size)
        tables = (np.arange(n * 130, dtype=np.int32).reshape(n, 130) % 100000) + 1
        ex = StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=_NoComm(), device="cpu",
                          max_tokens=plan.padded_num_tokens, max_requests=n,
                          max_blocks_per_request=130)
        assert blocks >= 130
        t_compile, t_bind, t_host = [], [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            p = compile(cfg, _step(n))
            t1 = time.perf_counter()
            ex.bind(p, tables)
            t2 = time.perf_counter()
            build_tables(p, 0, 0, tables.astype(np.int64), DUMMY_SLOT)
            t3 = time.perf_counter()
            t_compile.append(t1 - t0)
            t_bind.append(t2 - t1)
            t_host.append(t3 - t2)
        rows.append((n, plan.padded_num_tokens, len(plan.gather_chunks),
                     statistics.median(t_compile) * 1e3, statistics.median(t_host) * 1e3,
                     statistics.median(t_bind) * 1e3))
    return rows


class _OpCount(TorchDispatchMode):
    """Counts the ATen calls that may launch a kernel (views and bare allocations excluded)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ret = func._schema.returns
        view = bool(ret) and ret[0].alias_info is not None and not ret[0].alias_info.is_write
        if not view and func.__name__ not in ("empty.memory_format", "empty_strided.default"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _host_calls(fn) -> int:
    """Python and C functions ``fn()`` calls (``sys.setprofile``): each is host work that runs
    cold in a step (its code and data out of the caches after the step's other work)."""
    count = 0

    def prof(frame, event, arg):
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count - 1  # setprofile(None) itself


def _full_dims_config(w: int, graphs: tuple[int, ...] = ()) -> ParallelConfig:
    return ParallelConfig(pcp_size=w, dcp_size=w, kv_cache_dtype="fp8_ds_mla", num_layers=4,
                          cudagraph_token_sizes=graphs,
                          num_heads=128, topk=2048, index_num_heads=64, hidden_size=7168,
                          activation_dtype="bfloat16", max_model_len=32768)


GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # bench/step_gpu.py --graphs


def _decodes_step(prompt: int, n: int = 64) -> StepInput:
    ctx = 2048 + (np.arange(n, dtype=np.int64) * 1543) % 4096  # 2k-6k contexts
    ids = [f"d{i}" for i in range(n)] + (["prompt"] if prompt else [])
    c = np.concatenate([ctx, [0] if prompt else []]).astype(np.int64)
    q = np.concatenate([np.ones(n, np.int64), [prompt] if prompt else []]).astype(np.int64)
    return StepInput.build(0, ids, c, q, np.arange(len(ids)) == n)


class _OtherWork:
    """What runs between two binds in a serving loop, in small: the per-layer work of a tiny
    decode step of another executor (reference kernels, 2 layers), never a bind."""

    def __init__(self) -> None:
        from cpplan.api import LayerCache

        cfg = ParallelConfig(num_heads=8, topk=64, index_num_heads=4, hidden_size=512,
                             activation_dtype="float32", max_model_len=1024, num_layers=2)
        n = 8
        plan = compile(cfg, StepInput.build(0, [f"o{i}" for i in range(n)],
                                            64 + 17 * np.arange(n), np.ones(n, np.int64),
                                            np.zeros(n, bool)))
        width = -(-cfg.max_model_len // cfg.block_size)
        self.ex = StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0,
                               comm=_NoComm(), device="cpu", max_tokens=plan.padded_num_tokens,
                               max_requests=n)
        self.plan, self.tables = plan, np.arange(n * width).reshape(n, width) + 1
        self.bound = self.ex.bind(plan, self.tables)
        self.caches = [LayerCache.empty(cfg, 1 + n * width, "cpu") for _ in range(2)]
        gen = torch.Generator().manual_seed(0)
        t = plan.padded_num_tokens
        self.x = (torch.randn(t, cfg.qk_head_dim, generator=gen),
                  torch.randn(t, cfg.index_head_dim, generator=gen))
        self.q = (torch.randn(t, cfg.num_heads, cfg.qk_head_dim, generator=gen),
                  torch.randn(t, cfg.index_num_heads, cfg.index_head_dim, generator=gen),
                  torch.rand(t, cfg.index_num_heads, generator=gen))

    def __call__(self) -> None:
        for cache in self.caches:  # a step's layers (they run in order: the counts reset)
            self.ex.insert(self.bound, cache, *self.x)
            self.ex.attend(self.bound, cache, *self.q)
        self.bound.layers_inserted = self.bound.layers_attended = 0


def bench_host_bind(repeat: int) -> list[tuple]:
    """(case, P = W, T, check ms, host tables ms, arena copy ms, device ops of bind and of the
    expansion at first use, host calls, bind ms, bind ms in a step), rank 0."""
    rows, other = [], _OtherWork()
    for prompt, graphs in ((0, ()), (0, GRAPH_SIZES), (32768, ())):
        for w in (1, 2):
            cfg = _full_dims_config(w, graphs)
            plan = compile(cfg, _decodes_step(prompt))
            width = -(-cfg.shard_rows(cfg.max_model_len) // cfg.block_size)
            bt = np.arange(plan.num_requests * width, dtype=np.int64).reshape(-1, width) + 1
            ex = StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=_NoComm(),
                              device="cpu", max_tokens=plan.padded_num_tokens,
                              max_requests=plan.num_requests)
            ex.bind(plan, bt).tables  # warm (cached buffers)
            with _OpCount() as ops:
                bound = ex.bind(plan, bt)
            with _OpCount() as expand_ops:
                bound.tables
            calls = _host_calls(lambda: ex.bind(plan, bt))
            t_check, t_host, t_copy, t_bind, t_plain = [], [], [], [], []
            aliases = ex._aliases
            for _ in range(repeat):  # the check without the aliasing pass, in the same run
                ex._aliases = None
                t0 = time.perf_counter()
                ex._check_bind(plan, bt, None)
                t_plain.append(time.perf_counter() - t0)
                ex._aliases = aliases
            for _ in range(repeat):  # bind's parts alone: check, tables into the arena, copy
                t0 = time.perf_counter()
                checked, _ = ex._check_bind(plan, bt, None)
                t1 = time.perf_counter()
                host = build_tables(plan, 0, 0, checked, DUMMY_SLOT, out=ex.arena.acquire())
                t2 = time.perf_counter()
                ex.arena.commit(TABLE_NAMES, host.sizes)
                t3 = time.perf_counter()
                t_check.append(t1 - t0)
                t_host.append(t2 - t1)
                t_copy.append(t3 - t2)
            for _ in range(repeat):
                t0 = time.perf_counter()
                ex.bind(plan, bt)
                t_bind.append(time.perf_counter() - t0)
            t_step = []
            for _ in range(repeat):
                other()
                t0 = time.perf_counter()
                ex.bind(plan, bt)
                t_step.append(time.perf_counter() - t0)
            case = ("32k prompt + 64 decodes" if prompt else "64 decodes"
                    + (" (graph sizes: static layout)" if graphs else ""))
            med = [statistics.median(x) * 1e3 for x in (t_check, t_host, t_copy, t_bind, t_step,
                                                        t_plain)]
            rows.append((case, w, plan.padded_num_tokens, *med[:3], ops.count, expand_ops.count,
                         calls, *med[3:]))
    return rows


def print_host_bind(repeat: int) -> None:
    print("## host bind at full model dims (rank 0, CPU, medians)\n")
    print("| case | P = W | T per rank | check tables ms | of it: aliasing ms | host tables ms "
          "| arena copy ms | host sum ms | device ops per bind | expansion ops (first use) | "
          "host calls per bind | bind ms (CPU: incl. the device ops) | bind ms in a step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case, w, t, tc, th, tp, n_ops, n_exp, calls, tb, ts, plain in bench_host_bind(repeat):
        print(f"| {case} | {w} | {t} | {tc:.3f} | {tc - plain:.3f} | {th:.3f} | {tp:.3f} | "
              f"{tc + th + tp:.3f} | {n_ops} | {n_exp} | {calls} | {tb:.3f} | {ts:.3f} |")


def _collective_costs(ctx, repeat: int) -> tuple[float, float, float]:
    """Digest check with the shared-memory board, with gloo (ms), one kv_insert (ms)."""
    w = ctx.world_size
    cfg = _config(w)
    groups = Groups.build(cfg, store=ctx.store)
    plan = compile(cfg, _step(512))
    t_digest = {}
    for kind in ("shm", "gloo"):
        check, t_digest[kind] = DigestCheck(groups, "every", exchange=kind), []
        for _ in range(repeat):
            dist.barrier(group=groups.control)
            t0 = time.perf_counter()
            check.start(plan).wait()
            t_digest[kind].append(time.perf_counter() - t0)
        check.close()
    inp = torch.zeros(512, cfg.kv_bytes_per_token, dtype=torch.uint8)
    out = torch.empty(w * 512, cfg.kv_bytes_per_token, dtype=torch.uint8)
    from cpplan.runtime.collectives import all_gather_tensor

    t_kv = []
    for _ in range(repeat):
        dist.barrier(group=groups.pcp)
        t0 = time.perf_counter()
        all_gather_tensor(out, inp, group=groups.pcp)
        t_kv.append(time.perf_counter() - t0)
    return (statistics.median(t_digest["shm"]) * 1e3, statistics.median(t_digest["gloo"]) * 1e3,
            statistics.median(t_kv) * 1e3)


def print_bind(repeat: int) -> None:
    print("## bind (per rank, CPU: tables + arena pack)\n")
    print("| requests | T per rank | gather chunks | compile ms | host tables ms | "
          "bind ms (CPU: incl. device-side expansion) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, t, ch, tc, th, tb in bench_bind(repeat):
        print(f"| {n} | {t} | {ch} | {tc:.3f} | {th:.3f} | {tb:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--host-bind", action="store_true",
                    help="only host bind at full model dims (64 decodes, a 32k prompt)")
    ap.add_argument("--issue15", action="store_true", dest="host_bind",
                    help=argparse.SUPPRESS)  # the old name of --host-bind
    ap.add_argument("--digest-only", action="store_true", help="only the digest-check table")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.host_bind:
        print_host_bind(args.repeat)
        return
    if not args.digest_only:
        print_bind(args.repeat)
    print("\n## digest check vs one kv_insert (spawned ranks on this host)\n")
    print("| world | digest check, shared-memory board ms | digest check, gloo all-gather ms "
          "| gloo / board | kv_insert [512, 656] u8 ms (gloo) |")
    print("|---:|---:|---:|---:|---:|")
    for w in args.worlds:
        with World(w, timeout_s=120) as world:
            res = world.run(_collective_costs, args.repeat)
        vals = [r.value for r in res]
        assert all(r.ok for r in res), [r.tb for r in res]
        shm, gloo, kv = (max(v[k] for v in vals) for k in range(3))
        print(f"| {w} | {shm:.4f} | {gloo:.3f} | {gloo / shm:.0f}x | {kv:.3f} |")


if __name__ == "__main__":
    main()
