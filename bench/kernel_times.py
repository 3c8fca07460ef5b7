"""Kernel benchmarks on one GPU: every kernel's median time against naive torch and the machine's
ceilings measured in the same run (bf16 matmul 8192^3, device-to-device copy).

    python bench/kernel_times.py [--quick] [--json out.json] [--only ceil,prefill,reuse,decode,plans,remap,small,sweep]

Parts: ceil (the two ceilings), prefill (bf16 and fp8 rows, in-kernel and dequantised once),
reuse (in-kernel vs dequantise-once by references per row), decode (Triton and the Gluon
variants; every query reads its own rows), plans (default plans by decode shape; split counts
and head blocks around them at T <= 2), remap (zero-copy remap vs index_select, attention and
indexer), small (merge, pack, remap, filter), sweep (launch variants and the keys-major variant
of bench/variants; not in the default list). Attention runs through the runtime's plans: forced
choices go through ``plan_attention``'s keywords, launch numbers through ``dataclasses.replace``.
Prints a markdown table (the one recorded in bench/RESULTS.md). FLOPs of sparse MLA per
query token: 2 * H * topk * (576 + 512); bytes of decode: topk * 656 per query (the KV rows read).
"""

# ruff: noqa: B023, BLE001, C408
# B023: every lambda here is timed by bench() before its loop variables move on; BLE001: a
# variant that fails to compile or run is reported and the other measurements go on.
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
import triton
from triton.testing import do_bench

from cpplan.runtime.kernels import reference as ref
from cpplan.runtime.kernels.triton import attention as ta
from cpplan.runtime.kernels.triton import index as ti
from cpplan.runtime.kernels.triton import merge as tm
from cpplan.runtime.kernels.triton import pack as tp
from cpplan.runtime.kernels.triton.plan import plan_attention

ROWS: list[dict] = []


def bench(fn, ms_hint=None):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=200 if ms_hint is None else max(100, 20 * ms_hint),
                    return_mode="median")


def row(name, ms, flops=None, bytes_=None, vs=None, note=""):
    r = {"name": name, "ms": ms, "tflops": flops / ms / 1e9 if flops else None,
         "gbs": bytes_ / ms / 1e6 if bytes_ else None, "vs": vs, "note": note}
    ROWS.append(r)
    tf = f"{r['tflops']:.0f} TFLOP/s" if r["tflops"] else ""
    gb = f"{r['gbs']:.0f} GB/s" if r["gbs"] else ""
    print(f"{name:58s} {ms * 1e3:10.1f} us  {tf:>14s} {gb:>12s}  {note}", flush=True)
    return r


def ceilings():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    row("ceiling: bf16 matmul 8192^3", bench(lambda: a @ b), flops=2 * 8192**3)
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    row("ceiling: device copy 2 GiB (read + write)", bench(lambda: y.copy_(x)), bytes_=2 * x.numel())


def _inputs(T, H, topk, N, fmt, seed=0, distinct=False):
    """q, kv rows and indices. Prefill (distinct False): 64 random index rows repeated over the
    tokens (neighbouring prefill queries share most of their keys, so rows are re-read from L2).
    Decode (distinct True): every query reads its own rows (a random permutation shifted by a
    random offset per query), as requests with their own caches do: the reads come from HBM."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, 576, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(N, 576, device="cuda", generator=g)
    buf = tp.quantize_fp8_ds_mla(kv) if fmt == "fp8_ds_mla" else kv.to(torch.bfloat16)
    if distinct:
        perm = torch.randperm(N, device="cuda", generator=g)[:topk]
        shift = torch.randint(0, N, (T, 1), device="cuda", generator=g)
        return q, buf, ((perm[None, :] + shift) % N).int().contiguous()
    idx = torch.stack([torch.randperm(N, device="cuda", generator=g)[:topk] for _ in range(min(T, 64))])
    idx = idx.repeat(triton.cdiv(T, idx.shape[0]), 1)[:T].int().contiguous()
    return q, buf, idx


def attn_plan(q, kv, idx, fmt, *, launch=None, **forced):
    """The runtime's plan for these operands; ``forced``: plan_attention's family / fp8_rows /
    num_splits (None = its choice); ``launch``: block_k / num_warps / num_stages to replace."""
    p = plan_attention(num_tokens=q.shape[0], num_heads=q.shape[1], topk=idx.shape[1], kv_format=fmt,
                       num_kv_rows=kv.reshape(-1, kv.shape[-1]).shape[0], q_dtype=q.dtype,
                       device=q.device, **forced)
    return dataclasses.replace(p, **{k: v for k, v in (launch or {}).items() if v is not None})


def naive_torch(q, kv, idx, sm_scale, chunk=256):
    """Gather rows, two einsums and a softmax in bf16 (the baseline the issue measured)."""
    out = torch.empty(q.shape[0], q.shape[1], 512, dtype=q.dtype, device=q.device)
    for t0 in range(0, q.shape[0], chunk):
        i = idx[t0:t0 + chunk]
        rows = kv[i.clamp_min(0).long()]
        s = torch.einsum("thd,tkd->thk", q[t0:t0 + chunk], rows).float() * sm_scale
        s = s.masked_fill((i < 0)[:, None, :], float("-inf"))
        p = torch.softmax(s, -1).to(q.dtype)
        out[t0:t0 + chunk] = torch.einsum("thk,tkd->thd", p, rows[..., :512])
    return out


def attn_flops(T, H, topk):
    return 2 * T * H * topk * (576 + 512)


_FAMILY = {"scaled_dots": "triton-heads-scaled", "dequant": "triton-heads"}  # the earlier option names


def bench_prefill(quick):
    T, H, topk, N = 4096, 128, 2048, 65536
    fl = attn_flops(T, H, topk)
    sm = 576**-0.5
    q, kv, idx = _inputs(T, H, topk, N, "bf16")
    naive = row("prefill naive torch bf16 T4096 H128 k2048", bench(lambda: naive_torch(q, kv, idx, sm)), fl)
    configs = [(64, 8, 3), (64, 8, 4), (64, 8, 2)] if not quick else [(64, 8, 3)]
    best = None
    for bk, nw, ns in configs:
        try:
            p = attn_plan(q, kv, idx, "bf16", launch=dict(block_k=bk, num_warps=nw, num_stages=ns))
            ms = bench(lambda: ta.sparse_mla_attention(q, kv, idx, sm, "bf16", plan=p))
        except Exception as e:  # a config that does not compile (registers / shared memory)
            print(f"prefill bf16 bk{bk} w{nw} s{ns}: {type(e).__name__}: {str(e)[:120]}")
            continue
        r = row(f"prefill triton bf16 bk{bk} w{nw} s{ns}", ms, fl, vs=naive["ms"] / ms,
                note=f"{naive['ms'] / ms:.2f}x naive")
        best = r if best is None or ms < best["ms"] else best
    q, kv8, idx = _inputs(T, H, topk, N, "fp8_ds_mla")
    best8 = None
    for (bk, nw, ns), var in [(c, "scaled_dots") for c in configs[:2]] + [(configs[0], "dequant")]:
        try:
            p = attn_plan(q, kv8, idx, "fp8_ds_mla", family=_FAMILY[var], fp8_rows="in_kernel",
                          launch=dict(block_k=bk, num_warps=nw, num_stages=ns))
            ms = bench(lambda: ta.sparse_mla_attention(q, kv8, idx, sm, "fp8_ds_mla", plan=p))
        except Exception as e:
            print(f"prefill fp8 {var} bk{bk} w{nw} s{ns}: {type(e).__name__}: {str(e)[:120]}")
            continue
        r = row(f"prefill triton fp8_ds_mla {var} bk{bk} w{nw} s{ns}", ms, fl,
                note=f"{best['ms'] / ms:.2f}x best bf16" if best else "")
        best8 = r if best8 is None or ms < best8["ms"] else best8
    p = attn_plan(q, kv8, idx, "fp8_ds_mla", fp8_rows="dequantise_once")
    ms = bench(lambda: ta.sparse_mla_attention(q, kv8, idx, sm, "fp8_ds_mla", plan=p))
    r = row("prefill triton fp8_ds_mla dequantise_once (default here)", ms, fl,
            note=f"{best['ms'] / ms:.2f}x best bf16" if best else "")
    best8 = r if best8 is None or ms < best8["ms"] else best8
    return best, best8


def bench_reuse(quick):
    """fp8 rows dequantised in the kernel vs once up front, by references per row (T * topk / N):
    where ``DEQUANTISE_ONCE_REUSE`` comes from."""
    sm, topk, H, N = 576**-0.5, 2048, 128, 65536
    q, kv8, idx = _inputs(4096, H, topk, N, "fp8_ds_mla", seed=7)
    row(f"dequantize_fp8_ds_mla -> bf16, {N} rows", bench(lambda: tp.dequantize_fp8_ds_mla(kv8, torch.bfloat16)),
        bytes_=N * (656 + 1152))
    for T in ((64, 256) if quick else (16, 64, 128, 256, 1024, 4096)):
        qt, it = q[:T].contiguous(), idx[:T].contiguous()
        pa = attn_plan(qt, kv8, it, "fp8_ds_mla", fp8_rows="in_kernel")
        pb = attn_plan(qt, kv8, it, "fp8_ds_mla", fp8_rows="dequantise_once")
        a = bench(lambda: ta.sparse_mla_attention(qt, kv8, it, sm, "fp8_ds_mla", plan=pa))
        b = bench(lambda: ta.sparse_mla_attention(qt, kv8, it, sm, "fp8_ds_mla", plan=pb))
        reuse = T * topk / N
        row(f"reuse {reuse:6.1f} (T {T}): in_kernel / dequantise_once", a, attn_flops(T, H, topk),
            note=f"once {b * 1e3:.1f} us: {a / b:.2f}x")


def bench_decode(quick):
    sm = 576**-0.5
    for B, H in ((128, 128), (256, 16), (64, 32)):
        topk, N = 2048, 1 << 18  # a paged cache of 4096 blocks x 64 slots
        q, kv8, idx = _inputs(B, H, topk, N, "fp8_ds_mla", seed=B + H, distinct=True)
        fl, by = attn_flops(B, H, topk), B * topk * 656
        kvb = ref.dequantize_fp8_ds_mla(kv8).to(torch.bfloat16)
        row(f"decode naive torch (pre-dequantised bf16 rows) B{B} H{H}",
            bench(lambda: naive_torch(q, kvb, idx, sm)), fl, by)
        for splits, var, ns in ((None, "scaled_dots", 2), (None, "scaled_dots", 3), (4, "scaled_dots", 2),
                                (None, "dequant", 2)):
            p = attn_plan(q, kv8, idx, "fp8_ds_mla", family=_FAMILY[var], num_splits=splits,
                          launch=dict(num_stages=ns))
            ms = bench(lambda: ta.sparse_mla_attention(q, kv8, idx, sm, "fp8_ds_mla", plan=p))
            row(f"decode triton fp8 {var} B{B} H{H} k2048 splits={splits or 'auto'} s{ns}", ms, fl, by)
        if H <= 32:
            for var, splits, ns, nw in (("ring", None, None, None), ("ring", None, 2, None), ("small", 1, None, 4),
                                        ("small", 2, None, 4), ("small", 4, None, 4), ("small", 1, None, 8)):
                p = attn_plan(q, kv8, idx, "fp8_ds_mla", family=f"gluon-{var}", num_splits=splits,
                              launch=dict(num_stages=ns, num_warps=nw))
                ms = bench(lambda: ta.sparse_mla_attention(q, kv8, idx, sm, "fp8_ds_mla", plan=p))
                row(f"decode gluon {var} fp8 B{B} H{H} k2048 splits={splits or 'auto'} s{ns or 'auto'} "
                    f"w{nw or 'auto'}", ms, fl, by)
        p = attn_plan(q, kv8, idx, "fp8_ds_mla")
        ms = bench(lambda: ta.sparse_mla_attention(q, kv8, idx, sm, "fp8_ds_mla", plan=p))
        row(f"decode default B{B} H{H} k2048", ms, fl, by, note=p.describe())


def bench_plans(quick):
    """The default plan per decode shape, and for T <= 2 (few programs: most SMs idle unless the
    top-k is split) the split counts and head blocks around it: where plan.heads_splits and
    heads_block would be retuned."""
    sm = 576**-0.5
    shapes = [(1, 128, "fp8_ds_mla"), (1, 128, "bf16"), (2, 128, "fp8_ds_mla"), (1, 16, "fp8_ds_mla")]
    if not quick:
        shapes += [(128, 128, "fp8_ds_mla"), (256, 16, "fp8_ds_mla"), (64, 32, "fp8_ds_mla")]
    for T, H, fmt in shapes:
        q, kv, idx = _inputs(T, H, 2048, 1 << 18, fmt, seed=T + H, distinct=True)
        fl, by = attn_flops(T, H, 2048), T * 2048 * (656 if fmt == "fp8_ds_mla" else 1152)
        p = attn_plan(q, kv, idx, fmt)
        ms = bench(lambda: ta.sparse_mla_attention(q, kv, idx, sm, fmt, plan=p))
        row(f"plan default T{T} H{H} {fmt}", ms, fl, by, note=p.describe())
        if T > 2 or not p.family.startswith("triton"):
            continue
        # (splits, block_h, block_k, num_warps, num_stages, family); None = the plan's own
        alternatives = [(8, None, None, None, None, None), (16, None, None, None, None, None),
                        (32, None, None, None, None, None), (32, 32, None, 4, 2, None),
                        (32, 16, None, 4, 2, None)]
        if T == 1:  # the single-token decode goal (issue 12): smaller key blocks, more splits
            alternatives += [(64, 16, 32, 4, 2, None), (64, 16, 32, 2, 2, None),
                             (32, 16, 64, 4, 3, None), (64, 32, 32, 4, 2, None)]
            if fmt == "fp8_ds_mla":
                alternatives += [(32, 16, 64, 4, 2, "triton-heads-scaled"),
                                 (64, 16, 32, 4, 2, "triton-heads-scaled")]
        for splits, block_h, block_k, warps, stages, family in alternatives:
            alt = attn_plan(q, kv, idx, fmt, num_splits=splits, family=family)
            launch = dict(block_h=block_h, block_k=block_k, num_warps=warps, num_stages=stages)
            alt = dataclasses.replace(alt, **{k: v for k, v in launch.items() if v is not None})
            ms = bench(lambda: ta.sparse_mla_attention(q, kv, idx, sm, fmt, plan=alt))
            row(f"plan alternative T{T} H{H} {fmt}", ms, fl, by, note=alt.describe())


def bench_remap_vs_copy():
    """Zero-copy remap vs index_select deinterleave, for attention and the indexer (docs/design.md §Gather chunks and the deinterleave map)."""
    W, I, E = 4, 1, 65536
    PT = E // W
    sm = 576**-0.5
    g = torch.Generator(device="cuda").manual_seed(1)
    gathered = tp.quantize_fp8_ds_mla(torch.randn(W * PT, 576, device="cuda", generator=g))
    t = torch.arange(E, device="cuda")
    dein = ref.remap_to_gathered(t[None], torch.zeros(1, dtype=torch.int64, device="cuda"), PT, W, I)[0].long()
    for T in (4096, 256):
        H, topk = 128, 2048
        q = torch.randn(T, H, 576, device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.randint(0, E, (T, topk), device="cuda", generator=g, dtype=torch.int32)
        pcu = torch.zeros(T, dtype=torch.int32, device="cuda")
        fused = bench(lambda: ta.sparse_mla_attention(q, gathered, ids, sm, "fp8_ds_mla", remap=(pcu, PT, W, I)))
        two = bench(lambda: ta.sparse_mla_attention(q, gathered, ti.remap_to_gathered(ids, pcu, PT, W, I),
                                                    sm, "fp8_ds_mla"))
        copy = bench(lambda: ta.sparse_mla_attention(q, ref.deinterleave_index_select(gathered, dein),
                                                     ids, sm, "fp8_ds_mla"))
        sel = bench(lambda: ref.deinterleave_index_select(gathered, dein))
        rmp = bench(lambda: ti.remap_to_gathered(ids, pcu, PT, W, I))
        row(f"attn T{T}: fused remap + kernel", fused, note=f"{copy / fused:.3f}x vs copy")
        row(f"attn T{T}: remap kernel + kernel", two, note=f"remap alone {rmp * 1e3:.1f} us")
        row(f"attn T{T}: index_select deinterleave + kernel", copy, note=f"copy alone {sel * 1e3:.1f} us")
    # indexer: T queries of one request at positions spread over E, 64 heads; the first Triton
    # indexer (bench/variants/old_indexer.py), whose kernel reads rows through the remap
    from variants import old_indexer as tx

    kx = tp.quantize_indexer_k(torch.randint(-3, 4, (W * PT, 128), device="cuda", generator=g).float())
    T, Hi = 512, 64
    qx = torch.randn(T, Hi, 128, device="cuda", generator=g).to(torch.bfloat16)
    wx = torch.randn(T, Hi, device="cuda", generator=g)
    key_len = torch.linspace(E // 2, E, T, device="cuda").long()
    pcu = torch.zeros(T, dtype=torch.int64, device="cuda")
    fl = 2 * Hi * 128 * int(key_len.sum())
    a = bench(lambda: tx.indexer_topk_prefill(qx, wx, kx, key_len, pcu, PT, W, I, 2048, max_keys=E))
    b = bench(lambda: tx.indexer_topk_prefill(qx, wx, ref.deinterleave_index_select(kx, dein), key_len,
                                              pcu, E, 1, 1, 2048, max_keys=E))
    keys = torch.empty(T, E, dtype=torch.int64, device="cuda")
    s_only = bench(lambda: tx._launch(qx, wx, kx, keys, tx.MODE_PREFILL, True, E, lens=key_len, pcu=pcu,
                                      PT=PT, W=W, I=I))
    k_only = bench(lambda: torch.topk(keys, 2048, dim=1))
    row(f"indexer T{T} E{E}: remap in kernel + top-k", a, fl, note=f"{b / a:.3f}x vs copy")
    row(f"indexer T{T} E{E}: index_select + kernel + top-k", b, fl)
    row(f"indexer T{T} E{E}: scores kernel alone", s_only, fl)
    row(f"indexer T{T} E{E}: torch.topk alone [T, E] int64", k_only)


def bench_small_ops():
    R, T, H = 4, 128, 128
    out = torch.randn(R, T, H, 512, device="cuda")
    lse = torch.randn(R, T, H, device="cuda")
    by = out.numel() * 4 + T * H * 512 * 4
    row("lse_merge triton R4 T128 H128 fp32", bench(lambda: tm.lse_merge(out, lse)), bytes_=by)
    row("lse_merge torch reference", bench(lambda: ref.lse_merge(out, lse)), bytes_=by)
    n = 65536
    kv = torch.randn(n, 576, device="cuda").to(torch.bfloat16)
    cache = torch.empty(n * 2, 656, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(n * 2, device="cuda")[:n]
    by = n * (576 * 2 + 656)
    row("pack fp8_ds_mla triton 65536 tokens", bench(lambda: tp.pack_fp8_ds_mla_into(cache, slots, kv)), bytes_=by)
    row("pack fp8_ds_mla torch reference", bench(lambda: ref.pack_fp8_ds_mla_into(cache, slots, kv)), bytes_=by)
    ids = torch.randint(0, 1 << 20, (4096, 2048), device="cuda")
    pcu = torch.zeros(4096, dtype=torch.int64, device="cuda")
    by = ids.numel() * (8 + 4)
    row("remap triton [4096, 2048]", bench(lambda: ti.remap_to_gathered(ids, pcu, 1 << 18, 4, 1)), bytes_=by)
    row("remap torch reference", bench(lambda: ref.remap_to_gathered(ids, pcu, 1 << 18, 4, 1)), bytes_=by)
    bt = torch.randint(0, 1 << 14, (4096, 1 << 12), device="cuda", dtype=torch.int32)
    row("filter_local_slots triton [4096, 2048]", bench(lambda: ti.filter_local_slots(ids, bt, 64, 4, 1, 1)), bytes_=by)


# ---- variant sweep (the launch numbers in runtime/kernels/triton/plan.py come from here) ----

def _cfg(family="triton-heads", bk=64, nw=8, ns=2, kmajor=False, pf=False, ev=False):
    """One sweep point: a heads family with launch numbers, or (kmajor) bench/variants' keys-major
    kernel with optional register prefetch / evict-first loads."""
    return dict(family=family, block_k=bk, num_warps=nw, num_stages=ns, kmajor=kmajor, prefetch=pf, evict=ev)


def _cfg_name(c):
    s = "keys" if c["kmajor"] else c["family"]
    s += f" bk{c['block_k']} w{c['num_warps']} s{c['num_stages']}"
    for k, tag in (("prefetch", "pf"), ("evict", "evict")):
        if c[k]:
            s += f" {tag}"
    return s


_K = dict(kmajor=True)
SWEEP = {
    # regime: (T, H, topk, N, kv_format, splits to try, configs); first config = the earlier default.
    # fp8 rows are read in the kernel (fp8_rows "in_kernel") in every regime. Keys-major prefetch
    # at 64/128 keys is left out: an illegal address on the H200 (bench/RESULTS.md).
    "decode_h16": (256, 16, 2048, 1 << 18, "fp8_ds_mla", (None, 2, 4), [
        _cfg("triton-heads-scaled", nw=4, ns=3), _cfg(nw=4, ns=2),
        _cfg(bk=32, nw=4, ns=1, **_K), _cfg(bk=32, nw=4, ns=2, **_K), _cfg(bk=32, nw=4, ns=3, **_K),
        _cfg(bk=32, nw=4, ns=1, pf=True, **_K), _cfg(bk=64, nw=8, ns=2, **_K), _cfg(bk=64, nw=4, ns=2, **_K),
        _cfg(bk=32, nw=4, ns=2, ev=True, **_K)]),
    "decode_h128": (128, 128, 2048, 1 << 18, "fp8_ds_mla", (None, 2), [
        _cfg(), _cfg(ns=3), _cfg(bk=32, ns=2), _cfg("triton-heads-scaled"), _cfg(bk=64, nw=8, ns=2, **_K)]),
    "prefill_bf16": (4096, 128, 2048, 65536, "bf16", (None,), [
        _cfg(ns=3), _cfg(ns=4), _cfg(bk=32, ns=4), _cfg(bk=128, ns=1), _cfg(nw=8, ns=2, **_K)]),
    "prefill_fp8": (4096, 128, 2048, 65536, "fp8_ds_mla", (None,), [
        _cfg(ns=3), _cfg(ns=2), _cfg(bk=32, ns=3), _cfg("triton-heads-scaled", ns=3)]),
}


def _sweep_call(c, q, kv, idx, fmt, splits):
    """A callable running sweep point ``c`` with ``splits`` (None: the plan's)."""
    from variants.kmajor import sparse_mla_attention_kmajor

    sm = 576**-0.5
    p = attn_plan(q, kv, idx, fmt, family="triton-heads" if c["kmajor"] else c["family"], num_splits=splits,
                  fp8_rows="in_kernel" if fmt == "fp8_ds_mla" else None,
                  launch={k: c[k] for k in ("block_k", "num_warps", "num_stages")})
    if c["kmajor"]:
        return lambda: sparse_mla_attention_kmajor(q, kv, idx, sm, fmt, plan=p, prefetch=c["prefetch"],
                                                   evict=c["evict"])
    return lambda: ta.sparse_mla_attention(q, kv, idx, sm, fmt, plan=p)


def _warm(task):
    """Compile one (regime, config) in a worker process (fills Triton's on-disk cache)."""
    regime, ci = task
    _T, H, topk, _N, fmt, _, cfgs = SWEEP[regime]
    t0 = time.time()
    try:
        q, kv, idx = _inputs(8, H, topk, 4096, fmt)
        _sweep_call(cfgs[ci], q, kv, idx, fmt, None)()
        torch.cuda.synchronize()
        return regime, ci, None, time.time() - t0
    except Exception as e:  # registers / shared memory / unsupported: reported, skipped
        return regime, ci, f"{type(e).__name__}: {str(e)[:160]}", time.time() - t0


def sweep(regimes=None, workers=12):
    import concurrent.futures as cf
    import multiprocessing as mp

    regimes = regimes or list(SWEEP)
    tasks = [(r, i) for r in regimes for i in range(len(SWEEP[r][6]))]
    t0 = time.time()
    failed = {}
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for r, i, err, _dt in ex.map(_warm, tasks):
            if err:
                failed[(r, i)] = err
                print(f"compile {r} {_cfg_name(SWEEP[r][6][i])}: {err}", flush=True)
    print(f"# compiled {len(tasks)} variants in {time.time() - t0:.0f} s ({len(failed)} failed)", flush=True)
    best = {}
    for r in regimes:
        T, H, topk, N, fmt, splits_list, cfgs = SWEEP[r]
        q, kv, idx = _inputs(T, H, topk, N, fmt, seed=7)
        fl, by = attn_flops(T, H, topk), T * topk * (656 if fmt == "fp8_ds_mla" else 1152)
        want = _sweep_call(cfgs[0], q, kv, idx, fmt, None)()[0].float()
        base = None
        for i, c in enumerate(cfgs):
            if (r, i) in failed:
                continue
            for sp in splits_list:
                try:
                    fn = _sweep_call(c, q, kv, idx, fmt, sp)
                    o = fn()[0].float()
                    err = ((o - want).norm() / want.norm()).item()
                    ms = bench(fn)
                except Exception as e:
                    print(f"{r} {_cfg_name(c)} splits={sp}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                base = base or ms
                rr = row(f"sweep {r} {_cfg_name(c)} splits={sp or 'auto'}", ms, fl, by,
                         note=f"{base / ms:.2f}x first, rel err {err:.1e}")
                if err < 1.5e-2 and (r not in best or ms < best[r][1]):
                    best[r] = (f"{_cfg_name(c)} splits={sp or 'auto'}", ms, rr["tflops"], rr["gbs"])
        del q, kv, idx
        torch.cuda.empty_cache()
    for r, (name, ms, tf, gb) in best.items():
        print(f"# best {r}: {name}: {ms * 1e3:.1f} us {tf:.0f} TFLOP/s {gb:.0f} GB/s", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="ceil,prefill,reuse,decode,remap,small",
                    help="comma-separated parts (see the module docstring)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    parts = a.only.split(",")
    steps = {"ceil": ceilings, "prefill": lambda: bench_prefill(a.quick),
             "reuse": lambda: bench_reuse(a.quick),
             "decode": lambda: bench_decode(a.quick), "plans": lambda: bench_plans(a.quick),
             "remap": bench_remap_vs_copy,
             "small": bench_small_ops, "sweep": sweep}
    for p in parts:
        try:
            steps[p]()
        except Exception as e:  # keep the other measurements
            print(f"{p}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(ROWS, f, indent=1)
    print("\n| kernel | median us | TFLOP/s | GB/s | note |\n|---|---|---|---|---|")
    for r in ROWS:
        tf = f"{r['tflops']:.0f}" if r["tflops"] else ""
        gb = f"{r['gbs']:.0f}" if r["gbs"] else ""
        print(f"| {r['name']} | {r['ms'] * 1e3:.1f} | {tf} | {gb} | {r['note']} |")


if __name__ == "__main__":
    sys.exit(main())
