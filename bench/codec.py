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
import sys
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import make_step, median_us  # noqa: E402  (bench/common.py)

from cpplan.schemas import ParallelConfig, decode_plan, digest, encode_plan  # noqa: E402
from cpplan.schemas.codec import plan_payload  # noqa: E402


def make_plan(num_requests: int, pcp: int = 4):
    from cpplan.planner import compile as compile_plan

    config = ParallelConfig(pcp_size=pcp, dcp_size=pcp, interleave_size=1,
                            max_model_len=200_000, cudagraph_token_sizes=(512, 1024, 2048, 4096))
    return compile_plan(config, make_step(num_requests, seed=0))


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
        enc = median_us(lambda: (encode_plan(plan), digest(plan)), repeat, warmup=50)
        dec = median_us(lambda: decode_plan(data), repeat, warmup=50)
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
