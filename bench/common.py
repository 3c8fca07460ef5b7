"""What the benchmarks share: the realistic step mix, a median timer, device time per kernel."""

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


def kernel_device_times(fn, calls: int, timeline: str | None = None
                        ) -> list[tuple[str, float, float]]:
    """Device time per kernel name of ``fn()`` (torch.profiler, CUDA activity; one warm-up
    call first): rows (name, launches per call, us per call) over ``calls`` calls, largest
    first. Device durations, so a host-bound call's rows still say what its kernels cost.
    timeline: also profile the host (CPU activity) and write a Chrome trace of the calls to
    this path (chrome://tracing or ui.perfetto.dev: where the device waits on the host)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if timeline else [])
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    if timeline:
        prof.export_chrome_trace(timeline)
    rows = [(ev.key, ev.count / calls, (ev.self_device_time_total or 0) / calls)
            for ev in prof.key_averages()]
    return sorted((r for r in rows if r[2] > 0), key=lambda r: -r[2])
