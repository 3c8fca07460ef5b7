"""The vLLM guard's cost per step on the CPU (needs vLLM: the venv of docs/vllm.md).

Part 1, one rank's own work after vLLM's ``partition_batch`` (what the plugin's ``guard`` mode
adds to a step, the exchange excluded): the StepInput of the global batch, the plan, its
digest, ``local_batch`` and the comparison with vLLM's partition (cpplan/vllm/guard.py
``check_partition``). Baseline in the same run: vLLM's own ``partition_batch`` of that batch.

Part 2, the exchange: ``GuardExchange.agree`` (one row a rank, shared-memory board and gloo)
in spawned worlds of 2 and 4 ranks, clean steps.

    python bench/vllm_guard.py [--repeats 200] [--requests 16,256,1024]

Prints medians (these machines are shared and noisy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def guard_costs(n_requests: int, p: int, w: int, repeats: int) -> tuple[float, float]:
    """(median guard work, median vLLM partition_batch), microseconds, on PCP rank 0."""
    import torch
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    from cpplan.planner import compile as compile_plan
    from cpplan.schemas.codec import digest
    from cpplan.vllm import adapter
    from cpplan.vllm.guard import check_partition
    from tests.with_vllm import batches, vllm_side

    rng = np.random.default_rng(n_requests)
    cols = batches.random_batch(rng, max_reqs=n_requests, max_chunk=64, decode_share=0.9)
    while len(cols["req_ids"]) != n_requests:
        cols = batches.random_batch(rng, max_reqs=n_requests, max_chunk=64, decode_share=0.9)
    cols["idx"] = np.arange(n_requests, dtype=np.intp)
    shard = p > 1 and w == 1
    mgr = PCPManager(p, 0, torch.device("cpu"), shard, max_num_reqs=4096, max_num_tokens=1 << 16,
                     dcp_world_size=w, dcp_rank=0, cp_interleave=1)
    batch = batches.input_batch(cols)
    desc = vllm_side.descriptor("NONE")
    config = adapter.config_for(p, w, 1, shard)
    local = mgr.partition_batch(batch, desc)

    def guard():
        step = adapter.step_input(batch)
        plan = compile_plan(config, step)
        digest(plan)
        expected = adapter.local_batch(plan, 0, 0, cudagraph_mode="NONE")
        assert check_partition(mgr, batch, local, expected, "all", "rank 0") is None

    guard()
    return _median_us(guard, repeats), _median_us(lambda: mgr.partition_batch(batch, desc),
                                                  repeats)


def _exchange_rank(rank: int, size: int, port: int, kind: str, repeats: int, out):
    import torch.distributed as dist

    from cpplan.vllm.guard import NO_DIGEST, GuardExchange

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    ex = GuardExchange([dist.group.WORLD], kind=kind, timeout_s=60)
    for seq in range(20):
        ex.agree(seq, NO_DIGEST, 0, None, None)
    times = []
    for seq in range(20, 20 + repeats):
        t0 = time.perf_counter()
        ex.agree(seq, NO_DIGEST, 0, None, None)
        times.append(time.perf_counter() - t0)
    ex.close()
    dist.destroy_process_group()
    if rank == 0:
        out.put(statistics.median(times) * 1e6)


def exchange_cost(size: int, kind: str, repeats: int) -> float:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_exchange_rank, args=(r, size, port, kind, repeats, out))
             for r in range(size)]
    for proc in procs:
        proc.start()
    value = out.get(timeout=300)
    for proc in procs:
        proc.join(60)
    return value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--requests", default="16,256,1024")
    args = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm  # noqa: F401
        from vllm.v1.worker.gpu import pcp_manager  # noqa: F401
    print(f"{'requests':>8} {'P x W':>6} {'guard us':>10} {'partition_batch us':>19} "
          f"{'guard / partition':>18}")
    for n in (int(x) for x in args.requests.split(",")):
        for p, w in ((2, 1), (4, 4)):
            g, base = guard_costs(n, p, w, args.repeats)
            print(f"{n:>8} {p}x{w:>4} {g:>10.0f} {base:>19.0f} {g / base:>18.2f}")
            sys.stdout.flush()
    print(f"\n{'ranks':>5} {'exchange':>8} {'agree() us':>11}")
    for size in (2, 4):
        for kind in ("shm", "gloo"):
            print(f"{size:>5} {kind:>8} {exchange_cost(size, kind, args.repeats):>11.0f}")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
