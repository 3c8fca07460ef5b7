"""Where the warp-specialised prefill logits copy and quantise the query, and how their loop
is built, timed by turns.

    python bench/query_staging.py [--rounds 5] [--cases 4096x32768,8192x8192]
                                  [--variants math_stage,"no unroll",...]   # a CUDA machine

``IndexerTiles`` on the prefill cases of ``bench/indexer.py`` (integer inputs). By default
four: the default (``quantize_indexer_q`` launched first, the loader's warpgroup copying the
fp8 query before the partitions start, the math loop unrolled by the ring's stages),
``ws_math_stage`` (each math warpgroup copies its own queries under the loader's first key
copies), ``ws_quantise`` (the loader's warpgroup quantises the query in the kernel, no launch)
and both. Each is first checked equal to the default's ids and
scores; then the whole indexer (``indexer_topk_prefill``) and the logits alone
(``prefill_logits``: the fp8 query given, or the raw one where the kernel quantises) are timed
``--rounds`` times with all of them by turns (``triton.testing.do_bench`` medians; a card that
drifts weighs on each alike), and the table gives each median and its ratio to the default's.
The logits rows of the default and ``ws_math_stage`` leave out the quantisation launch that the
whole includes. ``--variants`` names others of ``VARIANTS`` instead (the default always
first): ``no unroll`` (the math warpgroups' loop a tile a trip), ``thread arrive`` (every
math thread arrives on the free barriers). Figures: bench/RESULTS.md,
"thirty-sixth session" to "thirty-eighth session" (each table says which loop its default
ran).
"""

from __future__ import annotations

import argparse
import statistics

import indexer as bi
import torch
from triton.testing import do_bench

from cpplan.runtime.kernels.triton import indexer_tiled as it
from cpplan.runtime.kernels.triton import pack

VARIANTS = {"default": {}, "math_stage": {"ws_math_stage": True},
            "quantise": {"ws_quantise": True},
            "math_stage + quantise": {"ws_math_stage": True, "ws_quantise": True},
            "no unroll": {"ws_unroll": False}, "thread arrive": {"ws_thread_arrive": True}}
STAGING = ("default", "math_stage", "quantise", "math_stage + quantise")


def by_turns(fns: dict, rounds: int) -> dict[str, float]:
    """Median us of each callable over ``rounds`` rounds, all of them once a round."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def case(T: int, N: int, rounds: int, names=STAGING) -> bool:
    """Prints the case's rows; returns whether every variant equals the default."""
    args, flops = bi.prefill_inputs(T, N)
    q, w, k, key_len, pcu = args[:5]
    want = it.indexer_topk_prefill(*args, max_keys=N)
    whole, logits, ok = {}, {}, True
    q8, w8 = pack.quantize_indexer_q(q, w)
    kp, ks = it.split_planes(k)
    keys = torch.empty(T, N, dtype=torch.int32, device="cuda")
    for name in names:
        tiles = it.IndexerTiles(**VARIANTS[name])
        whole[name] = lambda tiles=tiles: it.indexer_topk_prefill(*args, max_keys=N, tiles=tiles)
        ok &= all(torch.equal(a, b) for a, b in zip(whole[name](), want))
        quant = tiles.ws_quantise
        logits[name] = lambda tiles=tiles, quant=quant: it.prefill_logits(
            q if quant else q8, w if quant else w8, kp, ks, keys, N, key_len, pcu, N, 1, 1,
            tiles, quantise=quant)
    w_med, l_med = by_turns(whole, rounds), by_turns(logits, rounds)
    for name in names:
        print(f"| T {T} x N {N} | {name} | {w_med[name]:.1f} | "
              f"{w_med[name] / w_med['default']:.4f} | {l_med[name]:.1f} | "
              f"{flops / l_med[name] / 1e6:.0f} |", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each variant once a round")
    ap.add_argument("--cases", default="4096x32768,2048x65536,8192x8192", metavar="TxN,...")
    ap.add_argument("--variants", default=",".join(STAGING[1:]), metavar="NAME,...",
                    help=f"timed against the default: {', '.join(list(VARIANTS)[1:])}")
    a = ap.parse_args()
    names = ["default", *(v.strip() for v in a.variants.split(",") if v.strip())]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: got {', '.join(unknown)}; expected names among "
                 f"{', '.join(list(VARIANTS)[1:])}")
    try:
        cases = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",")]
        if any(len(c) != 2 or min(c) < 1 for c in cases):
            raise ValueError
    except ValueError:
        ap.error(f"--cases: got {a.cases!r}; expected TxN pairs, e.g. 4096x32768,8192x8192")
    if a.rounds < 1:
        ap.error(f"--rounds: got {a.rounds}; expected at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("bench/query_staging.py: needs a CUDA device (got none)")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; medians of {a.rounds} "
          f"rounds, the variants by turns")
    print("| case | tiles | whole us | whole / default | logits us | logits TFLOP/s-eq |")
    print("|---|---|---:|---:|---:|---:|")
    bi.INPUTS = "integer"
    ok = all([case(T, N, a.rounds, names) for T, N in cases])
    print(f"every variant equals the default: {ok}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
