"""What a DCP rank's decode attention costs in FlashMLA, and what compacting its indices buys.

At DCP size W a decode token's global top-k (2048) is spread over the ranks; rank r attends to
the ~topk / W of them it holds and passes the rest as -1. FlashMLA's fp8 decode kernel then
still walks all topk slots. This bench times, on one GPU, for 64 decode tokens x 128 heads
over a 262,144-slot fp8_ds_mla cache (medians of ``do_bench_cudagraph``, replayed graphs):

- ``all valid``: 2048 local indices (the one-GPU step);
- ``masked``: the same 2048 slots, a W = 2 rank's view: every other index -1 (cpplan today);
- ``compacted + topk_length``: the local ones first, -1 after, ``topk_length`` = the count,
  a fresh scheduling metadata each call (it depends on topk_length's values);
- ``compacted, stale metadata``: the same, the metadata computed once for full-length rows;
- ``compacted, trimmed``: the local ones first, the index width cut to the widest row's count
  (rounded up to 64), no topk_length.

Each variant's output is compared with the masked one (max abs difference; the kernels sum in
a different order, so small differences are expected, not zero).

    python bench/dcp_attention.py [--tokens 64] [--topk 2048] [--dcp 2]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench_cudagraph

FP8_BYTES, PAGE, D_V = 656, 64, 512


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--slots", type=int, default=1 << 18)
    a = ap.parse_args()
    import flash_mla as fm

    torch.manual_seed(0)
    T, K, H = a.tokens, a.topk, 128
    dev = "cuda"
    from cpplan.runtime.kernels.triton import pack

    kv = pack.quantize_fp8_ds_mla((torch.randn(a.slots, 576, device=dev) * 0.5).bfloat16())
    kvp = kv.view(-1, PAGE, 1, FP8_BYTES)
    q = (torch.randn(T, 1, H, 576, device=dev) * 0.5).bfloat16()
    full = torch.stack([torch.randperm(a.slots, device=dev)[:K] for _ in range(T)]).int()
    # a rank's view at DCP size W: the slots it holds (interleave 1: every W-th token)
    mine = (full % a.dcp) == 0
    masked = torch.where(mine, full, -1)
    order = torch.argsort((~mine).int(), dim=1, stable=True)
    compact = torch.gather(masked, 1, order)
    count = mine.sum(1).int()
    width = int(-(-int(count.max()) // 64) * 64)
    scale = 576 ** -0.5

    def call(idx, meta, topk_length=None):
        return fm.flash_mla_with_kvcache(q, kvp, None, None, D_V, meta, softmax_scale=scale,
                                         is_fp8_kvcache=True, indices=idx.view(T, 1, -1),
                                         topk_length=topk_length, use_legacy=True,
                                         kv_format="V32")

    metas = {}

    def fixed(name, idx, topk_length=None):
        if name not in metas:
            metas[name] = fm.get_mla_metadata()[0]
        return call(idx, metas[name], topk_length)

    stale = fm.get_mla_metadata()[0]
    call(compact, stale)  # metadata for full-length rows, reused below with topk_length
    variants = {
        "all valid (one GPU)": lambda: fixed("all", full),
        f"masked (W={a.dcp} rank, today)": lambda: fixed("masked", masked),
        "compacted + topk_length, fresh metadata": lambda: call(compact, fm.get_mla_metadata()[0],
                                                                count),
        "compacted + topk_length, stale metadata": lambda: call(compact, stale, count),
        f"compacted, trimmed to {width}": lambda: fixed("trim", compact[:, :width].contiguous()),
    }
    want = variants[f"masked (W={a.dcp} rank, today)"]()[0].float()
    print(f"tokens {T}, heads {H}, topk {K}, DCP {a.dcp}: local per row {int(count.min())}-"
          f"{int(count.max())}")
    print("| variant | us | max abs diff vs masked |\n|---|---:|---:|")
    for name, fn in variants.items():
        try:
            out = fn()[0].float()
            diff = (out - want).abs().max().item() if "all valid" not in name else float("nan")
            us = do_bench_cudagraph(fn) * 1000
            print(f"| {name} | {us:.1f} | {diff:.3g} |", flush=True)
        except Exception as e:  # noqa: BLE001 (a variant the package refuses: report, go on)
            print(f"| {name} | failed: {type(e).__name__}: {str(e)[:100]} | |", flush=True)


if __name__ == "__main__":
    main()
