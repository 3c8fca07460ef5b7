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
a different order, so small differences are expected, not zero); the runtime's ``now`` rows
with the matching ``before`` row (``runtime_variants``: the executor's W > 1 decode attention
through cpplan's ops, before and after the compaction).

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
    variants.update(runtime_variants(a, q, kv, scale))
    want = variants[f"masked (W={a.dcp} rank, today)"]()[0].float()
    print(f"tokens {T}, heads {H}, topk {K}, DCP {a.dcp}: local per row {int(count.min())}-"
          f"{int(count.max())}")
    print("| variant | us | max abs diff vs masked |\n|---|---:|---:|")
    refs = {}
    for name, fn in variants.items():
        try:
            out = fn()[0].float().reshape(want.shape)
            pair, _, which = name.partition(" | ")
            if which.startswith("before"):
                refs[pair] = out
            # runtime rows: other ids than the rows above; "now" against its "before"
            base = refs.get(pair) if which.startswith("now") else None if which else want
            diff = (float("nan") if "all valid" in name or base is None
                    else (out - base).abs().max().item())
            us = do_bench_cudagraph(fn) * 1000
            print(f"| {name} | {us:.1f} | {diff:.3g} |", flush=True)
        except Exception as e:  # noqa: BLE001 (a variant the package refuses: report, go on)
            print(f"| {name} | failed: {type(e).__name__}: {str(e)[:100]} | |", flush=True)


def runtime_variants(a, q, kv, scale):
    """The runtime's own W > 1 decode attention (FlashMLA kernel set), from the W ranks'
    candidate lists of a rank-0 view (interleave 1, an identity block table: rank r owns the
    ids ``W * l + r``, slot ``l``), each in the reference order: the merge + filter +
    attention over all topk columns (before, ``dcp_compact=False``), and the rank's share of
    the merge packed + attention over ``compact_width`` columns + the overflow pass (now),
    without and with 8 rows whose whole top-k is rank 0's (the overflow pass does work)."""
    from cpplan.runtime.kernels import get_kernels
    from cpplan.runtime.kernels import reference as ref

    k = get_kernels("cuda", "flashmla")
    T, K, W = q.shape[0], a.topk, a.dcp
    width = ref.compact_width(K, W)
    qh = q.view(T, -1, 576)
    bt = torch.arange(a.slots // PAGE, device="cuda", dtype=torch.int32).repeat(T, 1)

    def lists(skew_rows):
        s_all, i_all = [], []
        for r in range(W):
            local = torch.stack([torch.randperm(a.slots // W, device="cuda")[:K]
                                 for _ in range(T)])
            s = torch.randn(T, K, device="cuda")
            if r == 0:
                s[:skew_rows] += 100.0
            s_sorted, i_sorted = ref.topk_reference_order(s, W * local + r, K)
            s_all.append(s_sorted)
            i_all.append(i_sorted)
        return torch.stack(s_all, 1), torch.stack(i_all, 1)  # [T, W, K]

    spread, skew = lists(0), lists(8)

    def plan(width_):
        return k.plan_attention(num_tokens=T, num_heads=qh.shape[1], topk=width_,
                                kv_format="fp8_ds_mla", num_kv_rows=kv.shape[0],
                                q_dtype=qh.dtype, device=qh.device)

    p_full, p_narrow = plan(K), plan(width)

    def narrow(main, over, count):
        out, lse = k.sparse_mla_attention(qh, kv, main, scale, "fp8_ds_mla", plan=p_narrow)
        k.sparse_mla_overflow(qh, kv, over, count, width, out, lse, scale, "fp8_ds_mla")
        return out, lse

    def before(c):
        top = k.merge_topk_candidates(*c, K, W)
        slots = k.filter_local_slots(top, bt, PAGE, W, 0, 1)
        return k.sparse_mla_attention(qh, kv, slots, scale, "fp8_ds_mla", plan=p_full)

    def now(c):
        return narrow(*k.merge_local_slots(*c, K, W, 0, bt, PAGE, 1, width))

    b = f"before (merge + filter + FlashMLA over {K})"
    n = f"now (rank's share of the merge + FlashMLA over {width} + overflow)"
    out = {}
    for label, c in (("keys spread", spread), ("8 rows all local", skew)):
        out[f"runtime, {label} | {b}"] = lambda c=c: before(c)
        out[f"runtime, {label} | {n}"] = lambda c=c: now(c)
    return out


if __name__ == "__main__":
    main()
