"""One attention or indexer call per case, bracketed for Nsight Compute (the profile behind
bench/RESULTS.md).

    ncu --clock-control none --profile-from-start off --set full -o rep \\
        python3 bench/profile_kernels.py --case decode_h16

Each attention case builds the inputs of bench/kernels.py, each indexer case (``INDEXER_CASES``)
those of bench/indexer.py's first prefill case (T 4096 x N 32768: the whole prefill indexer, its
logits and select kernels (the select in the build the indexer takes for these rows); or the
logits alone, with TMA or per-thread key copies; ``--inputs normal``: normal draws); each runs
twice outside the profiled range (compilation, caches), then once between ``cudaProfilerStart``
and ``cudaProfilerStop``.
``--list`` prints the cases; ``--time`` times every attention case with do_bench instead (no ncu
needed).
"""

from __future__ import annotations

import argparse
import sys

import torch

CASES = {
    # name: (T, H, topk, rows, kv_format, forced plan choices, launch numbers, keys-major prefetch)
    "prefill_bf16": (4096, 128, 2048, 65536, "bf16", {}, {}, None),
    "prefill_fp8_in_kernel": (4096, 128, 2048, 65536, "fp8_ds_mla", {"fp8_rows": "in_kernel"}, {}, None),
    "prefill_fp8_once": (4096, 128, 2048, 65536, "fp8_ds_mla", {"fp8_rows": "dequantise_once"}, {}, None),
    "decode_h128": (128, 128, 2048, 1 << 18, "fp8_ds_mla", {}, {}, None),
    "decode_h16": (256, 16, 2048, 1 << 18, "fp8_ds_mla", {}, {}, None),
    "decode_h16_keys": (256, 16, 2048, 1 << 18, "fp8_ds_mla", {"family": "triton-heads"},
                        {"block_k": 32, "num_warps": 4, "num_stages": 1}, True),
    "decode_h16_gluon": (256, 16, 2048, 1 << 18, "fp8_ds_mla", {"family": "gluon-small"}, {}, None),
    "decode_h32_gluon": (64, 32, 2048, 1 << 18, "fp8_ds_mla", {"family": "gluon-ring"}, {}, None),
    "decode_h16_scaled": (256, 16, 2048, 1 << 18, "fp8_ds_mla", {"family": "triton-heads-scaled"}, {}, None),
    "decode_h16_dequant": (256, 16, 2048, 1 << 18, "fp8_ds_mla", {"family": "triton-heads"}, {}, None),
}
# name: what one call runs, on bench/indexer.py's prefill inputs (T 4096 x N 32768)
INDEXER_CASES = {
    "indexer_prefill": "indexer_topk_prefill (quantise, planes, logits, select)",
    "indexer_logits": "the prefill logits alone, default tiles (TMA key tiles)",
    "indexer_logits_copies": "the prefill logits alone, default tiles, per-thread key copies",
    "indexer_logits_ws": "the prefill logits alone, the warp-specialised Gluon kernel (defaults)",
    "indexer_select_cuda": "the select alone on the logits' keys: the CUDA row top-k",
}


def build_indexer(case: str):
    from indexer import PREFILL, prefill_inputs  # bench/indexer.py

    from cpplan.runtime.kernels.triton import indexer_tiled as it
    from cpplan.runtime.kernels.triton import pack

    args, _ = prefill_inputs(*PREFILL[0])
    N = args[5]  # keys
    if case == "indexer_prefill":
        return lambda: it.indexer_topk_prefill(*args, max_keys=N)
    q, w, k, key_len, pcu = args[:5]
    q8, w8 = pack.quantize_indexer_q(q, w)
    kp, ks = it.split_planes(k)
    out = torch.empty(q.shape[0], N, dtype=torch.int32, device="cuda")
    t = it.IndexerTiles()
    if case == "indexer_select_cuda":
        from cpplan.runtime.kernels.cuda import row_topk

        it.prefill_logits(q8, w8, kp, ks, out, N, key_len, pcu, N, 1, 1, t)
        lens = key_len.int()
        top_s = torch.empty(q.shape[0], 2048, device="cuda")
        top_i = torch.empty(q.shape[0], 2048, dtype=torch.int32, device="cuda")
        defines = row_topk.select_defines(N, 2048, t.cuda_select_short_keys,
                                          t.cuda_select_merge)  # the build the indexer takes
        return lambda: row_topk.select(out, lens, 2048, top_s, top_i, defines=defines)
    if case == "indexer_logits_ws":
        from cpplan.runtime.kernels.gluon import indexer_logits as ws

        return lambda: ws.launch(q8, w8, kp, ks, out, key_len, pcu, N, 1, 1,
                                 **t.ws_launch_options())
    return lambda: it._logits_planar(q8, w8, kp, ks, out, N, key_len, pcu, N, 1, 1, bq=t.block_q,
                                     bk=t.block_k, warps=t.logits_warps, stages=t.logits_stages,
                                     maxnreg=t.logits_maxnreg,
                                     tma=case == "indexer_logits")


def build(case: str):
    if case in INDEXER_CASES:
        return build_indexer(case)
    from kernel_times import (  # same inputs as the benchmark table (bench/ is on sys.path)
        _inputs,
        attn_plan,
    )
    from variants.kmajor import sparse_mla_attention_kmajor

    from cpplan.runtime.kernels.triton import attention as ta

    T, H, topk, rows, fmt, forced, launch, keys_prefetch = CASES[case]
    q, kv, idx = _inputs(T, H, topk, rows, fmt, seed=T + H, distinct=case.startswith("decode"))
    plan = attn_plan(q, kv, idx, fmt, launch=launch, **forced)
    if keys_prefetch is not None:
        return lambda: sparse_mla_attention_kmajor(q, kv, idx, 576**-0.5, fmt, plan=plan, prefetch=keys_prefetch)
    return lambda: ta.sparse_mla_attention(q, kv, idx, 576**-0.5, fmt, plan=plan)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=sorted([*CASES, *INDEXER_CASES]))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--time", action="store_true", help="time every case (median, do_bench)")
    ap.add_argument("--inputs", choices=["integer", "normal"], default="integer",
                    help="the indexer cases' inputs, as bench/indexer.py's --inputs")
    a = ap.parse_args(argv)
    if a.inputs != "integer":
        import indexer  # bench/indexer.py: its prefill_inputs read this

        indexer.INPUTS = a.inputs
    if a.list:
        print("\n".join([*CASES, *INDEXER_CASES]))
        return 0
    if a.time:
        from triton.testing import do_bench

        for case, (T, H, topk, *_rest) in CASES.items():
            fn = build(case)
            fn()
            ms = do_bench(fn, warmup=25, rep=300, return_mode="median")
            tf = 2 * T * H * topk * 1088 / ms / 1e9
            print(f"{case:24s} {ms * 1e3:9.1f} us {tf:6.0f} TFLOP/s {T * topk * 656 / ms / 1e6:7.0f} GB/s (fp8 rows)")
        return 0
    if a.case is None:
        ap.error("--case is required (or --list / --time)")
    fn = build(a.case)
    fn()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
