"""What the CPU benchmarks share: the realistic step mix and a median timer."""

from __future__ import annotations

import statistics
import time

import numpy as np

from cpplan.schemas import StepInput


def make_step(n: int, seed: int, max_model_len: int = 131072) -> StepInput:
    """n requests in a random scheduler order: 90% decodes with contexts up to max_model_len,
    10% prefills of 1..16k query tokens, a third of them chunked (1..32k tokens already in)."""
    rng = np.random.default_rng(seed)
    pre = rng.random(n) < 0.10
    q = np.where(pre, rng.integers(1, 16385, n), 1)
    chunked = pre & (rng.random(n) < 1 / 3)
    c = np.where(pre, np.where(chunked, rng.integers(1, 32769, n), 0),
                 rng.integers(1, max_model_len, n))
    return StepInput.build(seed, [f"req-{seed}-{i}" for i in range(n)], c, q, pre)


def median_us(fn, repeat: int, warmup: int = 0) -> float:
    """Median wall time of ``fn()`` in microseconds over ``repeat`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3
