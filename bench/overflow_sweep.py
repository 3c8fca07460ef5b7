"""Launch sizes of the compacted DCP attention's overflow pass (``sparse_mla_overflow_kernel``).

On one GPU: 64 decode tokens x 128 heads over a 262,144-slot fp8_ds_mla cache, width 1152 of
2048 (W = 2), 8 rows holding their whole top-k on this rank (896 overflow keys each), the others
none. Each variant (heads a program, keys a step, warps, stages) is graph-timed
(``do_bench_cudagraph``, median) and its result compared with the first row's, the launch the
runtime used before 2026-12-01 (the baseline of the same run).

    python bench/overflow_sweep.py
"""
from __future__ import annotations

import torch
import triton
from triton.testing import do_bench_cudagraph

from cpplan.runtime.kernels.triton import attention_jit, pack
from cpplan.runtime.kernels.triton.attention import _DOT_DTYPES, _LOG2E

T, H, K, WIDTH, SLOTS, SKEWED = 64, 128, 2048, 1152, 1 << 18, 8
# (heads a program, keys a step, warps, stages); the first is the baseline (the old launch)
VARIANTS = [(16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 8, 2), (16, 64, 8, 1), (16, 64, 8, 3),
            (16, 64, 16, 1), (16, 128, 8, 1), (32, 64, 8, 2), (64, 32, 8, 2)]


def main() -> None:
    torch.manual_seed(0)
    kv = pack.quantize_fp8_ds_mla((torch.randn(SLOTS, 576, device="cuda") * 0.5).bfloat16())
    q = (torch.randn(T, H, 576, device="cuda") * 0.5).bfloat16()
    over = torch.full((T, K - WIDTH), -1, dtype=torch.int32, device="cuda")
    count = torch.full((T,), 1024, dtype=torch.int32, device="cuda")
    for j in range(SKEWED):
        over[j] = torch.randperm(SLOTS, device="cuda")[: K - WIDTH].int()
        count[j] = K
    out0 = (torch.randn(T, H, 512, device="cuda") * 0.1).bfloat16()
    lse0 = torch.randn(T, H, device="cuda")
    scale = 576 ** -0.5

    def launch(out, lse, block_h, block_k, warps, stages):
        attention_jit.sparse_mla_overflow_kernel[(triton.cdiv(H, block_h), T)](
            q, kv, over, count, out, lse, q.stride(0), q.stride(1), kv.stride(0),
            over.stride(0), out.stride(0), out.stride(1), lse.stride(0), H, WIDTH,
            scale * _LOG2E, KV_FP8=True, BLOCK_H=block_h, BLOCK_K=block_k,
            DOT_DTYPE=_DOT_DTYPES[q.dtype], PRECISION="tf32", num_warps=warps,
            num_stages=stages)

    ref_o, ref_l = out0.clone(), lse0.clone()
    launch(ref_o, ref_l, *VARIANTS[0])
    print(f"{SKEWED} of {T} rows x {K - WIDTH} overflow keys, {H} heads, fp8_ds_mla")
    print("| heads | keys a step | warps | stages | us | x baseline | max diff out | max diff lse |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    for v in VARIANTS:
        cols = " | ".join(map(str, v))
        try:
            o, lse = out0.clone(), lse0.clone()
            launch(o, lse, *v)
            d_out = (o.float() - ref_o.float()).abs().max().item()
            d_lse = (lse - ref_l).abs().max().item()
            o2, lse2 = out0.clone(), lse0.clone()
            us = do_bench_cudagraph(lambda v=v: launch(o2, lse2, *v)) * 1000
            base = base or us
            print(f"| {cols} | {us:.1f} | {base / us:.2f} | {d_out:.3g} | {d_lse:.3g} |",
                  flush=True)
        except Exception as e:  # noqa: BLE001 (a launch the GPU refuses: report, go on)
            print(f"| {cols} | failed: {type(e).__name__}: {str(e)[:100]} | | | |", flush=True)


if __name__ == "__main__":
    import argparse
    import sys

    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/overflow_sweep.py: needs a CUDA GPU")
    main()
