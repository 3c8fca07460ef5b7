"""Runtime step overheads on CPU (gloo): bind cost, digest-check cost, next to kv_insert.

    python bench/step.py [--repeat 50] [--worlds 2 4 8]
    python bench/step.py --issue15 [--repeat 50]    # only the host bind cases of issue 15

1. bind (tables + arena pack, no device copy on CPU) per step, median, for 64 / 512 / 4096
   requests (P = W = 2, a mix of decodes and prefills; compile time shown for scale);
2. the digest check (xxh3-128 of the plan + async 16-byte gloo all-gather, awaited) at world
   2 / 4 / 8, next to one typical kv_insert (gloo all-gather of [T - nd, 656] uint8 per rank,
   T = 512) in the same world. Worlds are spawned processes on this host: on a 2-core machine
   a world of 8 is oversubscribed, so its figures are an upper bound.
3. (``--issue15``) host bind at full model dims (128 heads, topk 2048, fp8_ds_mla,
   max_model_len 32k) for 64 decodes of 2k-6k context, and for a 32k prompt plus those 64
   decodes, at P = W = 1 and P = W = 2 (rank 0). Host time on a GPU is the host tables, the
   arena pack and the launch of the device ops (about 5-10 us each there), so the device ops
   one bind issues are counted (ATen calls that are not views); on this CPU the "device" ops
   also run on the host, which the bind column includes.
Writes a markdown table to stdout (bench/RESULTS_step.md holds the last run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from cpplan.api import ParallelConfig, StepExecutor, StepInput, compile
from cpplan.runtime.executor import DUMMY_SLOT
from cpplan.runtime.groups import Groups
from cpplan.runtime.segments import build_tables
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
        ex = StepExecutor(cfg, pcp_rank=0, dcp_rank=0, comm=_NoComm(), device="cpu",
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


def _issue15_config(w: int) -> ParallelConfig:
    return ParallelConfig(pcp_size=w, dcp_size=w, kv_cache_dtype="fp8_ds_mla", num_layers=4,
                          num_heads=128, topk=2048, index_num_heads=64, hidden_size=7168,
                          activation_dtype="bfloat16", max_model_len=32768)


def _issue15_step(prompt: int, n: int = 64) -> StepInput:
    ctx = 2048 + (np.arange(n, dtype=np.int64) * 1543) % 4096  # 2k-6k contexts
    ids = [f"d{i}" for i in range(n)] + (["prompt"] if prompt else [])
    c = np.concatenate([ctx, [0] if prompt else []]).astype(np.int64)
    q = np.concatenate([np.ones(n, np.int64), [prompt] if prompt else []]).astype(np.int64)
    return StepInput.build(0, ids, c, q, np.arange(len(ids)) == n)


def _host_params(host):
    return getattr(host, "params", None) or host.arrays


def bench_issue15(repeat: int) -> list[tuple]:
    """(case, P = W, T, check ms, host tables ms, arena pack ms, device ops, bind ms), rank 0."""
    rows = []
    for prompt in (0, 32768):
        for w in (1, 2):
            cfg = _issue15_config(w)
            plan = compile(cfg, _issue15_step(prompt))
            width = -(-cfg.shard_rows(cfg.max_model_len) // cfg.block_size)
            bt = np.arange(plan.num_requests * width, dtype=np.int64).reshape(-1, width) + 1
            ex = StepExecutor(cfg, pcp_rank=0, dcp_rank=0, comm=_NoComm(), device="cpu",
                              max_tokens=plan.padded_num_tokens, max_requests=plan.num_requests)
            ex.bind(plan, bt)  # warm (cached buffers)
            with _OpCount() as ops:
                ex.bind(plan, bt)
            t_check, t_host, t_pack, t_bind = [], [], [], []
            for _ in range(repeat):  # host parts alone: on a GPU no device op runs on the host
                t0 = time.perf_counter()
                checked = ex._check_bind(plan, bt, None)
                t1 = time.perf_counter()
                host = build_tables(plan, 0, 0, checked, DUMMY_SLOT)
                t2 = time.perf_counter()
                ex.arena.pack(_host_params(host), plan.step_id)
                t3 = time.perf_counter()
                t_check.append(t1 - t0)
                t_host.append(t2 - t1)
                t_pack.append(t3 - t2)
            for _ in range(repeat):
                t0 = time.perf_counter()
                ex.bind(plan, bt)
                t_bind.append(time.perf_counter() - t0)
            case = "32k prompt + 64 decodes" if prompt else "64 decodes"
            med = [statistics.median(x) * 1e3 for x in (t_check, t_host, t_pack, t_bind)]
            rows.append((case, w, plan.padded_num_tokens, *med[:3], ops.count, med[3]))
    return rows


def print_issue15(repeat: int) -> None:
    print("## host bind, issue 15 cases (rank 0, full dims, CPU, medians)\n")
    print("| case | P = W | T per rank | check tables ms | host tables ms | arena pack ms | "
          "host sum ms | device ops per bind | bind ms (CPU: incl. the device ops) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case, w, t, tc, th, tp, n_ops, tb in bench_issue15(repeat):
        print(f"| {case} | {w} | {t} | {tc:.3f} | {th:.3f} | {tp:.3f} | {tc + th + tp:.3f} | "
              f"{n_ops} | {tb:.3f} |")


def _collective_costs(ctx, repeat: int) -> tuple[float, float]:
    w = ctx.world_size
    cfg = _config(w)
    groups = Groups.build(cfg, store=ctx.store)
    check = DigestCheck(groups, "every")
    plan = compile(cfg, _step(512))
    t_digest = []
    for _ in range(repeat):
        dist.barrier(group=groups.control)
        t0 = time.perf_counter()
        check.start(plan).wait()
        t_digest.append(time.perf_counter() - t0)
    inp = torch.zeros(512, cfg.kv_bytes_per_token, dtype=torch.uint8)
    out = torch.empty(w * 512, cfg.kv_bytes_per_token, dtype=torch.uint8)
    from cpplan.runtime.collectives import all_gather_tensor

    t_kv = []
    for _ in range(repeat):
        dist.barrier(group=groups.pcp)
        t0 = time.perf_counter()
        all_gather_tensor(out, inp, group=groups.pcp)
        t_kv.append(time.perf_counter() - t0)
    return statistics.median(t_digest) * 1e3, statistics.median(t_kv) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--issue15", action="store_true", help="only the issue 15 bind cases")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.issue15:
        print_issue15(args.repeat)
        return
    print("## bind (per rank, CPU: tables + arena pack)\n")
    print("| requests | T per rank | gather chunks | compile ms | host tables ms | "
          "bind ms (CPU: incl. device-side expansion) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, t, ch, tc, th, tb in bench_bind(args.repeat):
        print(f"| {n} | {t} | {ch} | {tc:.3f} | {th:.3f} | {tb:.3f} |")
    print("\n## digest check vs one kv_insert (gloo, spawned ranks on this host)\n")
    print("| world | digest check ms (median) | kv_insert [512, 656] u8 ms (median) |")
    print("|---:|---:|---:|")
    for w in args.worlds:
        with World(w, timeout_s=120) as world:
            res = world.run(_collective_costs, args.repeat)
        vals = [r.value for r in res]
        assert all(r.ok for r in res), [r.tb for r in res]
        print(f"| {w} | {max(v[0] for v in vals):.3f} | {max(v[1] for v in vals):.3f} |")


if __name__ == "__main__":
    main()
