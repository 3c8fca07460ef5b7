"""The plane split of the prefill indexer's keys: one Triton launch against two torch copies.

    python bench/split_planes.py [--rounds 5]      # a CUDA machine; prints a table

For each prefill case of ``bench/indexer.py`` (integer inputs): the whole indexer
(``indexer_topk_prefill``) with ``split_planes`` taking the launch and the copies by turns,
``--rounds`` medians each (``triton.testing.do_bench``), their ratio; then each form of the
split alone, fifty calls back to back, as device time per kernel (torch.profiler), which a ~5 us
kernel needs: its ``do_bench`` rows wander by tens of us on some cards (bench/RESULTS.md,
"the plane split in one launch").
"""

from __future__ import annotations

import argparse
import statistics

import indexer as bi
import torch
from common import kernel_device_times
from triton.testing import do_bench

from cpplan.runtime.kernels.triton import indexer_tiled as it

CASES = ((4096, 32768), (2048, 65536), (8192, 8192))
FORMS = (("one launch", True), ("two copies", False))


def whole_by_turns(args, N: int, rounds: int) -> dict[str, list[float]]:
    """The whole indexer's median us per round, the split's two forms by turns."""
    orig = it.split_planes
    times = {name: [] for name, _ in FORMS}
    try:
        for _ in range(rounds):
            for name, kernel in FORMS:
                it.split_planes = lambda kp, kernel=kernel: orig(kp, kernel=kernel)
                fn = lambda: it.indexer_topk_prefill(*args, max_keys=N)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                times[name].append(do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3)
    finally:
        it.split_planes = orig
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the whole, each form once")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/split_planes.py: needs a CUDA device (got none)")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; whole: medians of "
          f"{a.rounds} rounds; alone: device us a call over 50 calls")
    print("| case | whole, one launch us | whole, two copies us | ratio | split alone, one "
          "launch us | split alone, two copies us |")
    print("|---|---:|---:|---:|---:|---:|")
    bi.INPUTS = "integer"
    for T, N in CASES:
        args, _ = bi.prefill_inputs(T, N)
        med = {n: statistics.median(v) for n, v in whole_by_turns(args, N, a.rounds).items()}
        alone = {name: sum(r[2] for r in kernel_device_times(
            lambda kernel=kernel: it.split_planes(args[2], kernel=kernel), 50))
            for name, kernel in FORMS}
        launch, copies = med["one launch"], med["two copies"]
        print(f"| T {T} x N {N} | {launch:.1f} | {copies:.1f} | {launch / copies:.3f} | "
              f"{alone['one launch']:.1f} | {alone['two copies']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
