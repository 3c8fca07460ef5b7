"""Codec cost: encode + digest and decode of plans with 64, 512 and 4096 requests.

Also measures the two candidate 128-bit hashes over the same payloads (xxh3_128, the one the
codec uses, and blake2b-128) so the choice stays backed by a figure.

    python bench/codec.py            # full run
    python bench/codec.py --quick    # fewer repetitions

Goal (issue 2): at 512 requests, encode + digest <= 50 us and decode <= 50 us (medians).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpplan.schemas import ParallelConfig, StepInput, decode_plan, digest, encode_plan  # noqa: E402
from cpplan.schemas.codec import plan_payload  # noqa: E402


def realistic_step(num_requests: int, seed: int = 0) -> StepInput:
    """90% decodes with contexts up to 128k; 10% prefills of 1..16k tokens, a third chunked."""
    rng = np.random.default_rng(seed)
    prefill = rng.random(num_requests) < 0.10
    q = np.where(prefill, rng.integers(1, 16_384, num_requests), 1)
    chunked = prefill & (rng.random(num_requests) < 0.33)
    c = np.where(prefill, np.where(chunked, rng.integers(1, 64_000, num_requests), 0),
                 rng.integers(1, 128_000, num_requests))
    return StepInput.build(1, [f"req-{i}" for i in range(num_requests)], c, q, prefill)


def make_plan(num_requests: int, pcp: int = 4):
    from cpplan.planner import compile as compile_plan

    config = ParallelConfig(pcp_size=pcp, dcp_size=pcp, interleave_size=1,
                            max_model_len=200_000, cudagraph_token_sizes=(512, 1024, 2048, 4096))
    return compile_plan(config, realistic_step(num_requests))


def median_us(fn, repeat: int) -> float:
    for _ in range(min(repeat, 50)):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    repeat = 200 if args.quick else 2000
    rows = []
    for n in (64, 512, 4096):
        plan = make_plan(n)
        data = encode_plan(plan)
        payload = plan_payload(plan)
        enc = median_us(lambda: (encode_plan(plan), digest(plan)), repeat)
        dec = median_us(lambda: decode_plan(data), repeat)
        xxh = median_us(lambda: xxhash.xxh3_128_digest(payload), repeat)
        b2 = median_us(lambda: hashlib.blake2b(payload, digest_size=16).digest(), repeat)
        rows.append((n, len(data), enc, dec, xxh, b2))
    print(f"{'requests':>8} {'file B':>9} {'encode+digest us':>17} {'decode us':>10} "
          f"{'xxh3_128 us':>12} {'blake2b us':>11} {'blake2b/xxh3':>13}")
    for n, size, enc, dec, xxh, b2 in rows:
        print(f"{n:>8} {size:>9,} {enc:>17.1f} {dec:>10.1f} {xxh:>12.2f} {b2:>11.2f} "
              f"{b2 / xxh:>13.1f}x")
    n, _, enc, dec, *_ = rows[1]
    ok = enc <= 50 and dec <= 50
    print(f"goal at {n} requests: encode+digest {enc:.1f} us (<= 50), decode {dec:.1f} us "
          f"(<= 50): {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
