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


def device_idle(trace: dict, long_us: float = 1000.0) -> dict:
    """Where the device waited, from a Chrome trace (``kernel_device_times``' timeline, read
    with ``json.load``): the span from the first device activity (kernels, copies, sets) to
    the last, the time some activity ran (overlaps counted once), the rest (idle), and the idle
    before the first activity of at least ``long_us`` (at a step's start the device waits on
    the host until a long kernel is queued). Milliseconds."""
    acts = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace.get("traceEvents", ())
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    if not acts:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "idle_before_long_ms": 0.0}
    start, busy, end, before_long, seen_long = acts[0][0], 0.0, acts[0][0], 0.0, False
    for t0, t1 in acts:
        if t0 > end:  # a gap no activity covers
            if not seen_long:
                before_long += t0 - end
            end = t0
        if t1 > end:
            busy += t1 - end
            end = t1
        seen_long = seen_long or t1 - t0 >= long_us
    return {"span_ms": (end - start) / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": (end - start - busy) / 1e3, "idle_before_long_ms": before_long / 1e3}


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
