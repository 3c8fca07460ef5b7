"""bench/common.py's device_idle against a brute-force count over a microsecond grid."""

import importlib.util
import pathlib

import numpy as np
import pytest

# bench/common.py loaded by its path, under its own name: bench/ is not put on sys.path, where
# a module of it could shadow an installed package of the same name for every later test of
# the worker (bench/kernels.py did: the `kernels` package transformers imports; now
# bench/kernel_times.py)
_spec = importlib.util.spec_from_file_location(
    "cpplan_bench_common", pathlib.Path(__file__).resolve().parents[1] / "bench" / "common.py")
_common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_common)
device_idle = _common.device_idle


def _brute(acts, long_us):
    """Covered / uncovered microseconds between the first start and the last end, and the
    uncovered ones before the first start of an activity of at least long_us."""
    lo, hi = min(a for a, _ in acts), max(b for _, b in acts)
    cover = np.zeros(hi - lo, dtype=bool)
    for a, b in acts:
        cover[a - lo:b - lo] = True
    longs = [a for a, b in acts if b - a >= long_us]
    first_long = min(longs) if longs else hi
    return (hi - lo, int(cover.sum()), int((~cover).sum()),
            int((~cover[: first_long - lo]).sum()))


@pytest.mark.parametrize("seed", range(20))
def test_device_idle_equals_a_grid_count(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    starts = np.sort(rng.integers(0, 5000, n))
    durs = rng.integers(0, 1500, n)
    acts = [(int(a), int(a + d)) for a, d in zip(starts, durs)]
    cats = rng.choice(["kernel", "gpu_memcpy", "gpu_memset"], n)
    events = [{"cat": c, "ts": a, "dur": b - a, "name": "k"} for (a, b), c in zip(acts, cats)]
    # host events and events without a duration are not device activity
    events += [{"cat": "cpu_op", "ts": 0, "dur": 10**6}, {"cat": "kernel", "ts": 7, "ph": "i"}]
    rng.shuffle(events)
    got = device_idle({"traceEvents": events}, long_us=1000)
    span, busy, idle, before = _brute(acts, 1000)
    assert got["span_ms"] * 1e3 == pytest.approx(span)
    assert got["busy_ms"] * 1e3 == pytest.approx(busy)
    assert got["idle_ms"] * 1e3 == pytest.approx(idle)
    assert got["idle_before_long_ms"] * 1e3 == pytest.approx(before)


def test_device_idle_of_no_activity_is_zero():
    assert device_idle({"traceEvents": [{"cat": "cpu_op", "ts": 1, "dur": 5}]}) == {
        "span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "idle_before_long_ms": 0.0}
