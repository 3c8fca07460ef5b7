"""Triton kernels against the torch reference.

Two environments: ``interp`` (CPU, TRITON_INTERPRET=1, small shapes, fp16/fp32 operands: the
interpreter's bf16 ``tl.dot`` is wrong: docs/design.md §The Triton interpreter's bf16 dot) and ``cuda`` (marked gpu: bf16 at full shapes,
H up to 128, topk 2048). Tolerances: norm-relative error of the output against a float32
reference on the same rounded inputs, 3e-3 for fp16 operands and 1.5e-2 for bf16 (the matrix
dtype's rounding of P and of dequantised rows), 1e-5 for fp32; lse absolute 1e-3.
"""

import dataclasses
import os
import threading

import pytest
import torch

from cpplan.runtime.kernels import AttentionPlanError
from cpplan.runtime.kernels import reference as ref
from tests.kernels.caches import block_planar

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERP
ENVS = [
    pytest.param("interp", marks=pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]),
]
TOL = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2, torch.float32: 1e-5}


def _dev(env):
    return "cuda" if env == "cuda" else "cpu"


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _case(env, T, H, topk, N, seed, dtype=None):
    dev = _dev(env)
    dtype = dtype or (torch.bfloat16 if env == "cuda" else torch.float16)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 576, generator=g).to(dtype)
    kv = torch.randn(N, 576, generator=g)
    idx = torch.randint(0, N, (T, topk), generator=g, dtype=torch.int32)
    idx[torch.rand(T, topk, generator=g) < 0.2] = ref.NO_KEY
    if T > 1:
        idx[0] = ref.NO_KEY  # an all-invalid row
    idx[-1, -1] = N - 1  # the last row of the buffer
    if T > 2:
        idx[1, :] = torch.arange(N - topk, N)  # a run of rows at the end of the buffer
    return q.to(dev), kv.to(dev), idx.to(dev)


def _check_attention(out, lse, want_o, want_l, dtype):
    assert not out.isnan().any() and not lse.isnan().any()
    fin = torch.isfinite(want_l)
    assert (out[~fin] == 0).all() and torch.isneginf(lse[~fin]).all()
    assert torch.equal(torch.isfinite(lse), fin)
    assert _rel(out, want_o) < TOL[dtype]
    assert (lse[fin] - want_l[fin]).abs().max().item() < 1e-3


def _plan(q, buf, idx, kv_format, **forced):
    """The Triton plan for these operands, with forced choices (family, fp8_rows, num_splits)."""
    from cpplan.runtime.kernels.triton.plan import plan_attention

    return plan_attention(num_tokens=q.shape[0], num_heads=q.shape[1], topk=idx.shape[1],
                          kv_format=kv_format, num_kv_rows=buf.reshape(-1, buf.shape[-1]).shape[0],
                          q_dtype=q.dtype, device=q.device, **forced)


def _attention_params(env):
    if env == "cuda":
        return [(64, 128, 2048, 8192), (1, 16, 2048, 8192), (33, 64, 2048, 4096), (4, 128, 2000, 3000)]
    return [(3, 16, 70, 100), (1, 64, 70, 90), (2, 128, 64, 80)]


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_attention_matches_reference(env, kv_format):
    """Planned here (plan=None) and with explicit plans: splits 3, each way of reading fp8 rows."""
    from cpplan.runtime.kernels.triton.attention import sparse_mla_attention

    for i, (T, H, topk, N) in enumerate(_attention_params(env)):
        q, kv, idx = _case(env, T, H, topk, N, 100 + i)
        buf = ref.quantize_fp8_ds_mla(kv) if kv_format == "fp8_ds_mla" else kv.to(q.dtype)
        want_o, want_l = ref.sparse_mla_attention(q.float(), buf, idx, 576**-0.5, kv_format)
        out, lse = sparse_mla_attention(q, buf, idx, 576**-0.5, kv_format)
        assert out.dtype == q.dtype and out.shape == (T, H, 512)
        _check_attention(out, lse, want_o, want_l, q.dtype)
        modes = (None, "in_kernel", "dequantise_once") if kv_format == "fp8_ds_mla" else (None,)
        for splits in (None, 3):
            for fp8_rows in modes:
                plan = _plan(q, buf, idx, kv_format, num_splits=splits, fp8_rows=fp8_rows)
                out, lse = sparse_mla_attention(q, buf, idx, 576**-0.5, kv_format, plan=plan)
                assert out.dtype == q.dtype and out.shape == (T, H, 512)
                _check_attention(out, lse, want_o, want_l, q.dtype)


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_keys_major_bench_variant(env, kv_format, prefetch):
    """bench/variants' keys-major kernel (a comparison point of bench/kernel_times.py's sweep) at the
    launch numbers that sweep uses (32 keys; prefetch at 64/128 keys faulted on the H200)."""
    from bench.variants.kmajor import sparse_mla_attention_kmajor

    params = ([(3, 16, 150, 200), (2, 32, 64, 90)] if env == "interp"
              else [(64, 16, 2048, 8192), (33, 32, 2000, 4096), (4, 64, 2048, 3000), (8, 128, 2048, 8192)])
    for i, (T, H, topk, N) in enumerate(params):
        q, kv, idx = _case(env, T, H, topk, N, 300 + i)
        buf = ref.quantize_fp8_ds_mla(kv) if kv_format == "fp8_ds_mla" else kv.to(q.dtype)
        want_o, want_l = ref.sparse_mla_attention(q.float(), buf, idx, 576**-0.5, kv_format)
        for splits in (None, 2):
            plan = dataclasses.replace(_plan(q, buf, idx, kv_format, family="triton-heads", num_splits=splits,
                                             fp8_rows="in_kernel" if kv_format == "fp8_ds_mla" else None),
                                       block_k=32)
            out, lse = sparse_mla_attention_kmajor(q, buf, idx, 576**-0.5, kv_format, plan=plan, prefetch=prefetch)
            assert out.dtype == q.dtype and out.shape == (T, H, 512)
            _check_attention(out, lse, want_o, want_l, q.dtype)


@pytest.mark.parametrize("env", ENVS)
def test_bad_options_name_what_was_expected(env):
    """A forced choice that cannot run here, or an unknown one, is one clear AttentionPlanError
    (a ValueError); so is a plan handed to operands it was not made for."""
    from cpplan.runtime.kernels.triton.attention import sparse_mla_attention

    q, kv, idx = _case(env, 2, 64, 64, 128, 5)
    buf = ref.quantize_fp8_ds_mla(kv)
    with pytest.raises(AttentionPlanError, match="family 'gluon-ring': needs CUDA sm_90, fp8_ds_mla rows read"):
        _plan(q, buf, idx, "fp8_ds_mla", family="gluon-ring")  # 64 heads, and not here
    with pytest.raises(AttentionPlanError, match="fp8_rows 'twice' for kv_format 'fp8_ds_mla': expected 'in_kernel' or"):
        _plan(q, buf, idx, "fp8_ds_mla", fp8_rows="twice")
    with pytest.raises(AttentionPlanError, match="family 'rows', expected one of"):
        _plan(q, kv.to(q.dtype), idx, "bf16", family="rows")
    with pytest.raises(AttentionPlanError, match="family 'triton-heads-scaled': needs fp8_ds_mla rows read in"):
        _plan(q, kv.to(q.dtype), idx, "bf16", family="triton-heads-scaled")
    with pytest.raises(AttentionPlanError, match="family 'gluon-small' reads fp8 rows in the kernel"):
        _plan(q, buf, idx, "fp8_ds_mla", family="gluon-small", fp8_rows="dequantise_once")
    with pytest.raises(AttentionPlanError, match="kv_format 'fp16', expected 'bf16' or 'fp8_ds_mla'"):
        _plan(q, buf, idx, "fp16")
    with pytest.raises(AttentionPlanError, match="plan fp8_rows 'none' for kv_format 'fp8_ds_mla'"):
        sparse_mla_attention(q, buf, idx, 0.05, "fp8_ds_mla", plan=_plan(q, kv, idx, "bf16"))
    with pytest.raises(AttentionPlanError, match="plan for backend 'reference' given to the 'triton'"):
        sparse_mla_attention(q, buf, idx, 0.05, "fp8_ds_mla",
                             plan=ref.plan_attention(num_tokens=2, num_heads=64, topk=64, kv_format="fp8_ds_mla",
                                                     num_kv_rows=128, q_dtype=q.dtype, device=q.device))
    gluon = dataclasses.replace(_plan(q, buf, idx, "fp8_ds_mla"), family="gluon-ring", block_h=32)
    with pytest.raises(AttentionPlanError, match="plan family 'gluon-ring': needs CUDA, bf16 q, at most 32 heads"):
        sparse_mla_attention(q, buf, idx, 0.05, "fp8_ds_mla", plan=gluon)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("H", [1, 8, 16, 32])
def test_gluon_decode_matches_reference(H):
    """The Gluon few-head decode (cp.async ring, keys-major wgmma) against the reference, with
    all-invalid rows, a top-k that is not a multiple of 64, rows at the end of the buffer, T = 1
    and splits that leave a short last split."""
    from cpplan.runtime.kernels.gluon import decode
    from cpplan.runtime.kernels.triton.attention import sparse_mla_attention
    from cpplan.runtime.kernels.triton.plan import gluon_heads, gluon_launch

    for i, (T, topk, N) in enumerate([(64, 2048, 1 << 16), (1, 2048, 8192), (33, 2000, 4096), (5, 70, 300)]):
        q, kv, idx = _case("cuda", T, H, topk, N, 700 + i)
        buf = ref.quantize_fp8_ds_mla(kv).reshape(-1, 64, 656) if N % 64 == 0 else ref.quantize_fp8_ds_mla(kv)
        want_o, want_l = ref.sparse_mla_attention(q.float(), buf, idx, 576**-0.5, "fp8_ds_mla")
        _, ring_warps, ring_stages = gluon_launch(H)
        variants = [(2, 4, "ring"), (2, 8, "ring"), (ring_stages, ring_warps, "ring"), (3, 4, "small"),
                    (3, 8, "small")]
        for stages, warps, variant in variants:  # into NaN-poisoned outputs
            out = torch.full((1, T, H, 512), float("nan"), dtype=q.dtype, device="cuda")
            lse = torch.full((1, T, H), float("nan"), device="cuda")
            decode.launch(q, buf.reshape(-1, 656), idx, out, lse, 576**-0.5, -(-topk // 64) * 64,
                          variant=variant, heads_padded=gluon_heads(H), num_stages=stages, num_warps=warps)
            _check_attention(out[0], lse[0], want_o, want_l, q.dtype)
        for family in ("gluon-small", "gluon-ring"):  # through the plan, partials merged
            for splits in (None, 3, 7):
                plan = _plan(q, buf, idx, "fp8_ds_mla", family=family, num_splits=splits)
                out, lse = sparse_mla_attention(q, buf, idx, 576**-0.5, "fp8_ds_mla", plan=plan)
                _check_attention(out, lse, want_o, want_l, q.dtype)
        if T * topk < 4 * N:  # else dequantise-once comes first and the bf16 kernel runs
            assert _plan(q, buf, idx, "fp8_ds_mla").family == gluon_launch(H)[0]


@pytest.mark.parametrize("env", ENVS)
def test_attention_fp32_operands_and_paged_view(env):
    from cpplan.runtime.kernels.triton.attention import sparse_mla_attention

    q, kv, idx = _case(env, 3, 16, 40, 128, 7, dtype=torch.float32)
    cache = ref.quantize_fp8_ds_mla(kv).reshape(2, 64, 656)
    want_o, want_l = ref.sparse_mla_attention(q, cache, idx, 0.05, "fp8_ds_mla")
    for family in ("triton-heads-scaled", "triton-heads"):
        plan = _plan(q, cache, idx, "fp8_ds_mla", family=family)
        out, lse = sparse_mla_attention(q, cache, idx, 0.05, "fp8_ds_mla", plan=plan)
        tol = 1e-5 if env == "interp" else 3e-3  # tf32 on the GPU
        assert _rel(out, want_o) < tol
        _check_attention(out, lse, want_o, want_l, torch.float32 if env == "interp" else torch.bfloat16)


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("W,I", [(2, 1), (4, 64)])
def test_attention_fused_remap(env, W, I):
    from cpplan.runtime.kernels.triton.attention import sparse_mla_attention

    dev = _dev(env)
    PT, T, topk = (160, 2, 48) if env == "interp" else (4096, 64, 2048)
    q, _, ids = _case(env, T, 16 if env == "interp" else 64, topk, 300 if env == "interp" else 8192, 9)
    ids = torch.where(ids >= 0, ids % (W * PT // 2), ids)  # global token ids of one region
    kv = torch.randn(W * PT, 576, device=dev).to(q.dtype)
    pcu = torch.full((T,), PT // 2, device=dev, dtype=torch.int32)
    rows = ref.remap_to_gathered(ids, pcu, PT, W, I)
    out, lse = sparse_mla_attention(q, kv, ids, 0.05, remap=(pcu, PT, W, I))
    want_o, want_l = ref.sparse_mla_attention(q.float(), kv, rows, 0.05)
    _check_attention(out, lse, want_o, want_l, q.dtype)


@pytest.mark.parametrize("env", ENVS)
def test_lse_merge(env):
    from cpplan.runtime.kernels.triton.merge import lse_merge

    dev = _dev(env)
    R, T, H = (3, 2, 16) if env == "interp" else (8, 64, 128)
    g = torch.Generator().manual_seed(3)
    out = torch.randn(R, T, H, 512, generator=g).to(dev)
    lse = (torch.randn(R, T, H, generator=g) * 5).to(dev)
    lse[:, 0] = float("-inf")  # every part empty
    lse[1:, 1, :3] = float("-inf")  # one live part
    o, l = lse_merge(out, lse)
    wo, wl = ref.lse_merge(out, lse)
    assert not o.isnan().any() and (o[0] == 0).all() and torch.isneginf(l[0]).all()
    torch.testing.assert_close(o, wo, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l, wl, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("W,rank,I", [(1, 0, 1), (2, 1, 1), (4, 3, 2), (2, 0, 64)])
def test_remap_and_filter(env, W, rank, I):
    from cpplan.runtime.kernels.triton import index as ti

    dev = _dev(env)
    T, K = (3, 1100) if env == "interp" else (256, 2048)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(-1, 5000, (T, K), generator=g).to(dev)
    pcu = torch.randint(0, 100, (T,), generator=g).to(dev)
    assert torch.equal(ti.remap_to_gathered(ids, pcu, 3000, W, I), ref.remap_to_gathered(ids, pcu, 3000, W, I))
    bt = torch.randint(0, 1000, (T, 80), generator=g, dtype=torch.int32).to(dev)
    assert torch.equal(ti.filter_local_slots(ids, bt, 64, W, rank, I),
                       ref.filter_local_slots(ids, bt, 64, W, rank, I))


@pytest.mark.parametrize("env", ENVS)
def test_pack_bit_identical(env):
    from cpplan.runtime.kernels.triton import pack as tp

    dev = _dev(env)
    n = 40 if env == "interp" else 4096
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 576, generator=g) * torch.logspace(-30, 30, n)[:, None]
    x[0] = 0.0
    x[1, :128] = 448.0
    x[2, :128] = 2.0**-130  # subnormal inputs: scale 2**-134
    for dtype in (torch.float32, torch.bfloat16):
        xx = (x if dtype == torch.float32 else x / x.abs().amax(1, keepdim=True).clamp_min(1e-30)).to(dtype).to(dev)
        cache = torch.full((n + 5, 656), 0xAB, dtype=torch.uint8, device=dev)
        slots = torch.randperm(n + 5, generator=g)[:n].to(dev)
        slots[3] = -1
        tp.pack_fp8_ds_mla_into(cache, slots, xx)
        want = torch.full_like(cache, 0xAB)
        ref.pack_fp8_ds_mla_into(want, slots, xx)
        assert torch.equal(cache, want)
    k = torch.randn(n, 128, generator=g).to(dev)
    assert torch.equal(tp.quantize_indexer_k(k), ref.quantize_indexer_k(k))
    # into the block-planar indexer K cache (blocks of 4 slots), a skipped slot included
    kc = torch.full((-(-(n + 5) // 4), 4 * 132), 0xAB, dtype=torch.uint8, device=dev)
    want = torch.full_like(kc, 0xAB)
    tp.pack_indexer_k_into(kc, slots, k)
    ref.pack_indexer_k_into(want, slots, k)
    assert torch.equal(kc, want)
    # the indexer query: one scale per (token, head), folded into the weights
    for dtype, heads in ((torch.float32, 64), (torch.bfloat16, 6)):
        q = (torch.randn(n // 4, heads, 128, generator=g)
             * torch.logspace(-3, 3, n // 4)[:, None, None]).to(dtype).to(dev)
        q[0, 0] = 0.0
        w = torch.randn(n // 4, heads, generator=g).to(dev)
        (a8, aw), (b8, bw) = tp.quantize_indexer_q(q, w), ref.quantize_indexer_q(q, w)
        assert torch.equal(a8.view(torch.uint8), b8.view(torch.uint8)) and torch.equal(aw, bw)


@pytest.mark.parametrize("env", ENVS)
def test_dequantize_fp8_ds_mla_exact(env):
    """The one-pass dequantisation equals the reference bit for bit, in float32 and in bf16
    (exact: power-of-two scales), for row counts that do not fill the last block."""
    from cpplan.runtime.kernels.triton import pack as tp

    dev = _dev(env)
    g = torch.Generator().manual_seed(11)
    for n in ((1, 37) if env == "interp" else (1, 37, 65536)):
        x = torch.randn(n, 576, generator=g) * torch.logspace(-8, 8, n)[:, None]
        packed = ref.quantize_fp8_ds_mla(x).to(dev)
        want = ref.dequantize_fp8_ds_mla(packed)
        assert torch.equal(tp.dequantize_fp8_ds_mla(packed), want)
        assert torch.equal(tp.dequantize_fp8_ds_mla(packed.reshape(n, 1, 656), torch.bfloat16),
                           want.to(torch.bfloat16))


def _indexer_inputs(env, T, Hi, N, seed):
    dev = _dev(env)
    dtype = torch.bfloat16 if env == "cuda" else torch.float32
    g = torch.Generator().manual_seed(seed)
    # integer-valued inputs: every score is exact in float32 and float64 (docs/design.md §Exact top-k needs exact scores), ties abound
    q = torch.randint(-2, 3, (T, Hi, 128), generator=g).to(dtype).to(dev)
    w = torch.randint(-2, 3, (T, Hi), generator=g).float().to(dev)
    k = ref.quantize_indexer_k(torch.randint(-3, 4, (N, 128), generator=g).float()).to(dev)
    return q, w, k


@pytest.mark.parametrize("env", ENVS)
def test_old_indexer_bench_variant(env):
    """bench/variants' first Triton indexer (bench/indexer.py's "old" kernel): prefill over a
    gather chunk (W 2, I 64; padded rows, rows shorter than topk, several query chunks) and
    decode over a rank's paged shard equal the reference, order included."""
    from bench.variants import old_indexer as old

    dev = _dev(env)
    T, Hi, PT, topk = (4, 4, 200, 20) if env == "interp" else (64, 64, 8192, 2048)
    W, I = 2, 64
    q, w, k = _indexer_inputs(env, T, Hi, W * PT, 7)
    key_len = torch.randint(1, PT, (T,), generator=torch.Generator().manual_seed(2)).to(dev)
    key_len[0] = 0  # a padded row
    key_len[-1] = min(topk // 2, PT)  # fewer keys than topk
    pcu = torch.zeros(T, dtype=torch.int64, device=dev)
    s, ids = old.indexer_topk_prefill(q, w, k, key_len, pcu, PT, W, I, topk,
                                      logits_budget_bytes=8 * 200 * 2)  # several chunks
    ws, wids = ref.indexer_topk_prefill(q.cpu().double(), w.cpu(), k.cpu(), key_len.cpu(),
                                        pcu.cpu(), PT, W, I, topk)
    assert torch.equal(ids.cpu(), wids) and torch.equal(s.cpu().double(), ws)
    W, rank, I = 4, 2, 1
    T, B, topk, nblk = (3, 64, 16, 4) if env == "interp" else (128, 64, 2048, 64)
    q, w, k = _indexer_inputs(env, T, Hi, 2 * T * nblk * B, 8)
    g = torch.Generator().manual_seed(3)
    bt = torch.stack([torch.randperm(2 * T * nblk, generator=g)[:nblk]
                      for _ in range(T)]).int().to(dev)
    local_len = torch.randint(1, nblk * B, (T,), generator=g).to(dev)
    local_len[-1] = 5
    k = block_planar(k, B)
    s, ids = old.indexer_topk_decode(q, w, k, local_len, bt, B, W, rank, I, topk)
    ws, wids = ref.indexer_topk_decode(q.cpu().double(), w.cpu(), k.cpu(), local_len.cpu(),
                                       bt.cpu(), B, W, rank, I, topk)
    assert torch.equal(ids.cpu(), wids) and torch.equal(s.cpu().double(), ws)


def test_dispatch_table():
    from cpplan.runtime.kernels import (
        OP_NAMES,
        REFERENCE,
        KernelBackendError,
        get_kernels,
    )

    assert get_kernels("cpu") is REFERENCE
    with pytest.raises(KernelBackendError, match="flashmla"):
        get_kernels("cuda", "flashmla")
    with pytest.raises(KernelBackendError):
        get_kernels("cpu", "triton")
    from cpplan.runtime.kernels.triton import TRITON

    assert all(callable(getattr(TRITON, op)) for op in OP_NAMES)


def _sorted_candidate_lists(rows, lists, topk, valid, seed, tie_scores=False, device="cpu"):
    """``lists`` candidate lists per row, each the reference order of its own keys (disjoint
    ids across lists, as DCP shards are), NO_KEY pads last: what the decode indexers return."""
    g = torch.Generator().manual_seed(seed)
    scores, ids = [], []
    for _ in range(lists):
        s = (torch.randint(0, 4, (rows, topk), generator=g).float() if tie_scores
             else torch.randn(rows, topk, generator=g))
        i = torch.randperm(rows * topk * lists, generator=g)[: rows * topk].view(rows, topk)
        i = torch.where(torch.arange(topk)[None, :] < valid, i, ref.NO_KEY)
        s_sorted, i_sorted = ref.topk_reference_order(s, i, topk)
        scores.append(s_sorted)
        ids.append(i_sorted.long())
    # disjoint ids across lists: list r's ids are shifted into their own range
    ids = [torch.where(x >= 0, x + r * rows * topk * lists, x) for r, x in enumerate(ids)]
    return torch.cat(scores, dim=1).to(device), torch.cat(ids, dim=1).to(device)


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("lists", [1, 2, 3, 4])
@pytest.mark.parametrize("valid", [64, 40, 0])
@pytest.mark.parametrize("ties", [False, True])
def test_merge_topk_candidates_equals_the_reference_sort(env, lists, valid, ties):
    """The merge of sorted lists (no sort) picks the same ids in the same order as the two
    stable sorts, with ties across lists broken by id, short lists and empty rows."""
    from cpplan.runtime.kernels.triton import merge as tmerge

    scores, ids = _sorted_candidate_lists(5, lists, 64, valid, seed=lists + valid,
                                          tie_scores=ties, device=_dev(env))
    want = ref.topk_reference_order(scores, ids, 64)[1]
    got = tmerge.merge_topk_candidates(scores, ids, 64, lists)
    assert torch.equal(got, want)


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("lists", [2, 3])
def test_merge_reads_the_packed_all_gather_buffer_in_place(env, lists):
    """The lists as the candidate all-gather leaves them (rank-major ``[W, nd, topk * 8]``
    bytes: float32 scores, then int32 ids), passed as strided ``[nd, W, topk]`` views: the
    same ids as the reference over the unpacked lists, pads (NO_KEY) written by the kernel
    into an unfilled output."""
    from cpplan.runtime.kernels.triton import merge as tmerge

    nd, topk = 5, 64
    scores, ids = _sorted_candidate_lists(nd, lists, topk, 40, seed=lists, tie_scores=True)
    packed = torch.empty(lists, nd, topk * 8, dtype=torch.uint8)
    for r in range(lists):
        packed[r, :, : 4 * topk] = scores[:, r * topk:(r + 1) * topk].contiguous().view(torch.uint8)
        packed[r, :, 4 * topk:] = ids[:, r * topk:(r + 1) * topk].int().contiguous().view(torch.uint8)
    packed = packed.to(_dev(env))
    s_view = packed[..., : 4 * topk].view(torch.float32).permute(1, 0, 2)
    i_view = packed[..., 4 * topk:].view(torch.int32).permute(1, 0, 2)
    want = ref.merge_topk_candidates(scores, ids, topk, lists)
    assert torch.equal(tmerge.merge_topk_candidates(s_view, i_view, topk, lists).cpu(), want)
    assert torch.equal(ref.merge_topk_candidates(s_view.cpu(), i_view.cpu(), topk, lists), want)


@pytest.mark.parametrize("env", ENVS)
def test_merge_topk_candidates_all_equal_scores_keeps_id_order(env):
    from cpplan.runtime.kernels.triton import merge as tmerge

    scores, ids = _sorted_candidate_lists(3, 2, 32, 32, seed=9, device=_dev(env))
    scores = torch.zeros_like(scores)
    ids_sorted = [ref.topk_reference_order(scores[:, r * 32:(r + 1) * 32],
                                           ids[:, r * 32:(r + 1) * 32], 32)[1].long()
                  for r in range(2)]
    ids = torch.cat(ids_sorted, dim=1)
    want = ref.topk_reference_order(scores, ids, 32)[1]
    assert torch.equal(tmerge.merge_topk_candidates(scores, ids, 32, 2), want)


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("pwi", [(1, 2, 1), (2, 2, 4), (3, 3, 2)])
def test_triton_decode_merge_in_a_replayed_step_matches_the_oracle(pwi):
    """End to end: the decode indexer's local lists are in the order the merge needs, so a
    W > 1 step with the Triton merge in place of the sort (and the fused LSE scaling) still
    equals the oracle."""
    from cpplan.planner.compile import compile as compile_plan
    from cpplan.runtime.kernels import REFERENCE
    from cpplan.runtime.kernels.triton import merge as tmerge
    from cpplan.schemas import StepInput
    from cpplan.sim.replay import replay_plan
    from cpplan.sim.simulate import TOLERANCE, SimOptions, preset_config

    p, w, i = pwi
    cfg = preset_config(SimOptions(pcp=p, dcp=w, interleave=i, layers=1))
    step = StepInput.build(2, ["a", "b", "c", "d"], [300, 70, 0, 129], [1, 1, 24, 2],
                           [False, False, True, False])
    lock = threading.Lock()  # replay's ranks are threads; the interpreter is not thread-safe

    def locked(fn):
        def call(*args):
            with lock:
                return fn(*args)
        return call

    kernels = dataclasses.replace(REFERENCE,
                                  merge_topk_candidates=locked(tmerge.merge_topk_candidates),
                                  lse_scale=locked(tmerge.lse_scale))
    result = replay_plan(compile_plan(cfg, step), seed=4, kernels=kernels)
    assert result.max_abs_err <= TOLERANCE


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("pwi", [(1, 1, 1), (2, 2, 4)])
def test_decode_filter_path_in_a_replayed_step_matches_the_oracle(pwi):
    """End to end: the tiled decode indexer's filter path for long rows (small tiles: rows of
    a few hundred keys count as long; ``functools.partial(..., tiles=)`` swapped into a kernel
    set), in a step whose local top-k lists are then merged across DCP ranks: the restored
    outputs equal the single-device oracle, and the path ran."""
    import functools

    from cpplan.planner.compile import compile as compile_plan
    from cpplan.runtime.kernels import REFERENCE
    from cpplan.runtime.kernels.triton import indexer_tiled
    from cpplan.schemas import StepInput
    from cpplan.sim.replay import replay_plan
    from cpplan.sim.simulate import TOLERANCE, SimOptions, preset_config

    p, w, i = pwi
    cfg = preset_config(SimOptions(pcp=p, dcp=w, interleave=i, layers=1, max_model_len=2048))
    step = StepInput.build(2, ["a", "b", "c"], [1500, 900, 129], [1, 1, 2], [False] * 3)
    lock, ran = threading.Lock(), []
    tiles = indexer_tiled.IndexerTiles(decode_block_k=32, select_block=64, select_cap=64,
                                       select_sample=64, split_rows=0, rank_chunk=32,
                                       rank_runs=8, programs_per_sm=8,
                                       filter_chunk=128, filter_cap=256, filter_sample=64,
                                       filter_margin=2.0, split_run=32)
    from cpplan.runtime.kernels.triton import indexer_select

    spy = indexer_select._filter_launch

    def filter_launch(*args, **kwargs):
        ran.append(1)
        return spy(*args, **kwargs)

    def decode(*args, **kwargs):
        with lock:
            return functools.partial(indexer_tiled.indexer_topk_decode, tiles=tiles)(*args,
                                                                                     **kwargs)

    kernels = dataclasses.replace(REFERENCE, indexer_topk_decode=decode)
    indexer_select._filter_launch = filter_launch
    try:
        result = replay_plan(compile_plan(cfg, step), seed=4, kernels=kernels)
    finally:
        indexer_select._filter_launch = spy
    assert ran and result.max_abs_err <= TOLERANCE


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("p", [1, 2])
def test_gathered_prefill_keys_through_the_tiled_indexer_match_the_oracle(p):
    """W == 1: the prefill tokens' keys copied per step and scored by the tiled Triton prefill
    indexer (planes, quantised query) equal the oracle."""
    from cpplan.planner.compile import compile as compile_plan
    from cpplan.runtime.kernels import REFERENCE
    from cpplan.runtime.kernels.triton import indexer_tiled
    from cpplan.schemas import StepInput
    from cpplan.sim.replay import replay_plan
    from cpplan.sim.simulate import TOLERANCE, SimOptions, preset_config

    cfg = preset_config(SimOptions(pcp=p, dcp=1, layers=1))
    # a decode, a fresh prompt, a chunk after history whose rows hold up to 70 keys: more
    # than topk (64) and than one select run (64 keys). The interpreter's cost is per program
    # (rows x runs): 30 prefill rows, not 183 (rows of up to 150 keys) as before
    step = StepInput.build(2, ["a", "b", "c"], [300, 0, 60], [1, 20, 10], [False, True, True])
    assert cfg.topk == 64
    lock, calls = threading.Lock(), []

    # small tiles, as in test_indexer_tiled.py: the interpreter runs every program in turn
    tiles = indexer_tiled.IndexerTiles(block_k=32, select_block=64, select_cap=64,
                                       select_sample=64, split_run=64, rank_chunk=32,
                                       rank_runs=4)

    def prefill(*args, **kwargs):
        with lock:
            calls.append(1)
            return indexer_tiled.indexer_topk_prefill(*args, **kwargs, tiles=tiles)

    kernels = dataclasses.replace(REFERENCE, indexer_topk_prefill=prefill)
    result = replay_plan(compile_plan(cfg, step), seed=4, kernels=kernels)
    assert calls and result.max_abs_err <= TOLERANCE


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("w_size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lse_scale_equals_the_reference(env, w_size, dtype):
    """The fused merge weight x output equals the torch one: rows where this rank has no key
    and rows where no rank has one give 0, never NaN."""
    from cpplan.runtime.kernels.triton import merge as tmerge

    g = torch.Generator().manual_seed(w_size)
    nd, H = 5, 3
    lse = torch.randn(w_size, nd, H, generator=g) * 4
    lse[1, 0] = float("-inf")  # rank 1 has no key for token 0
    lse[:, 2] = float("-inf")  # token 2 has no key anywhere
    out = torch.randn(nd, H, 512, generator=g).to(dtype)
    dev = _dev(env)
    for rank in range(w_size):
        want = ref.lse_scale(out, lse, rank)
        got = tmerge.lse_scale(out.to(dev), lse.to(dev), rank).cpu()
        assert got.dtype == dtype and not torch.isnan(got.float()).any()
        assert torch.allclose(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32
                              else 1e-2, atol=1e-6)
        assert torch.all(got[2] == 0)
    assert torch.all(tmerge.lse_scale(out.to(dev), lse.to(dev), 1).cpu()[0] == 0)


# ------------------------------------------------------------------ compacted DCP decode
def _naive_compact(slots, width):
    """Per-row loops: the local slots in order, split at width, NO_KEY after."""
    T, K = slots.shape
    main = torch.full((T, width), ref.NO_KEY, dtype=torch.int32)
    over = torch.full((T, K - width), ref.NO_KEY, dtype=torch.int32)
    count = torch.zeros(T, dtype=torch.int32)
    for j in range(T):
        mine = [int(s) for s in slots[j].tolist() if s >= 0]
        count[j] = len(mine)
        for p, s in enumerate(mine):
            if p < width:
                main[j, p] = s
            else:
                over[j, p - width] = s
    return main, over, count


@pytest.mark.parametrize("W,rank,I", [(2, 1, 1), (4, 3, 2), (2, 0, 64), (1, 0, 1)])
@pytest.mark.parametrize("width_of", ["share", "all", "none"])
def test_compact_local_slots_equals_per_row_loops(W, rank, I, width_of):
    T, K = 4, 1100
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(-1, 5000, (T, K), generator=g)
    ids[0] = ref.NO_KEY  # a row without keys
    bt = torch.randint(0, 1000, (T, 80), generator=g, dtype=torch.int32)
    width = {"share": ref.compact_width(K, W), "all": K, "none": 0}[width_of]
    want = _naive_compact(ref.filter_local_slots(ids, bt, 64, W, rank, I), width)
    got = ref.compact_local_slots(ids, bt, 64, W, rank, I, width)
    for a, b in zip(got, want):
        assert a.dtype == torch.int32 and torch.equal(a.cpu(), b)


def _owned_candidate_lists(rows, W, I, topk, valid, seed, ties=False, skew_rows=0):
    """Per row, W candidate lists in the reference order, NO_KEY pads last, list r holding only
    ids rank r owns under interleave I (``(id // I) % W == r``), as the decode indexers return
    them: ``[rows, W * topk]`` float32 scores and int32 ids. The first ``skew_rows`` rows score
    list 0 above every other list (all its keys make the merged top-k: the overflow case)."""
    g = torch.Generator().manual_seed(seed)
    scores, ids = [], []
    for r in range(W):
        local = torch.stack([torch.randperm(4 * topk, generator=g)[:topk] for _ in range(rows)])
        t = ((local // I) * W + r) * I + local % I
        t = torch.where(torch.arange(topk)[None, :] < valid, t, ref.NO_KEY)
        s = (torch.randint(0, 3, (rows, topk), generator=g).float() if ties
             else torch.randn(rows, topk, generator=g))
        if r == 0:
            s[:skew_rows] += 100.0
        s_sorted, i_sorted = ref.topk_reference_order(s, t, topk)
        scores.append(s_sorted)
        ids.append(i_sorted)
    return torch.cat(scores, dim=1), torch.cat(ids, dim=1)


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("W,rank,I", [(2, 0, 1), (2, 1, 1), (3, 2, 2), (4, 1, 64)])
@pytest.mark.parametrize("width_of", ["share", "all", "none"])
@pytest.mark.parametrize("valid,ties", [("all", False), ("all", True), ("short", False)])
def test_merge_local_slots_equals_merge_then_compact(env, W, rank, I, width_of, valid, ties):
    """A rank's packed share of the merged top-k, ranked from its own list alone, equals the
    reference (the merged top-k of every list, then this rank's slots packed in its order),
    with ties across lists, short lists, rows without keys, and rows whose top-k is all this
    rank's or none of it (count > width: overflow entries; count 0)."""
    from cpplan.runtime.kernels.triton import merge as tmerge

    T, K = (6, 96) if env != "cuda" else (64, 2048)
    n_valid = K if valid == "all" else K // 3
    scores, ids = _owned_candidate_lists(T, W, I, K, n_valid, seed=W + rank + I, ties=ties,
                                         skew_rows=2)
    ids[-1] = ref.NO_KEY  # a row without keys anywhere
    g = torch.Generator().manual_seed(11)
    bt = torch.randint(0, 1000, (T, 4 * K // 16 + 1), generator=g, dtype=torch.int32)
    width = {"share": ref.compact_width(K, W), "all": K, "none": 0}[width_of]
    want = ref.merge_local_slots(scores, ids, K, W, rank, bt, 16, I, width)
    if valid == "all":  # the skewed row: its whole top-k is rank 0's
        assert int(want[2][0]) == (K if rank == 0 else 0)
    dev = _dev(env)
    got = tmerge.merge_local_slots(scores.to(dev), ids.to(dev), K, W, rank, bt.to(dev), 16, I,
                                   width)
    for a, b in zip(got, want):
        assert a.dtype == torch.int32 and torch.equal(a.cpu(), b)


def test_compact_width():
    assert ref.compact_width(2048, 2) == 1152 and ref.compact_width(2048, 4) == 576
    assert ref.compact_width(2048, 1) == 2048 and ref.compact_width(64, 2) == 48
    assert ref.compact_width(16, 8) == 16


@pytest.mark.parametrize("env", ["reference"] + ENVS)
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_main_pass_plus_overflow_equals_one_pass(env, kv_format):
    """A DCP rank's decode attention over its compacted slots: the pass over main (width) then
    sparse_mla_overflow equals one pass over all its slots (reference attention), rows with and
    without overflow and without any key alike."""
    from cpplan.runtime.kernels.triton.attention import sparse_mla_attention, sparse_mla_overflow

    T, H, K, N = (5, 20, 96, 300) if env != "cuda" else (64, 128, 2048, 8192)
    q, kv, _ = _case("cuda" if env == "cuda" else "interp", T, H, K, N, 9,
                     torch.float32 if env == "reference" else None)
    dev = q.device
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, N, (T, K), generator=g)
    ids[1, 5:] = ref.NO_KEY  # a short row
    ids[2] = ref.NO_KEY  # no key at all
    ids[3] = 2 * torch.randperm(N // 2, generator=g)[:K]  # every key on rank 0: overflow
    bt = torch.arange(N // 16 + 1, dtype=torch.int32).repeat(T, 1)  # identity table, block 16
    W, rank, width = 2, 0, ref.compact_width(K, 2)
    buf = ref.quantize_fp8_ds_mla(kv) if kv_format == "fp8_ds_mla" else kv.to(q.dtype)
    full = ref.filter_local_slots(ids, bt, 16, W, rank, 1)
    want_o, want_l = ref.sparse_mla_attention(q.float().cpu(), buf.cpu(), full, 576**-0.5, kv_format)
    main, over, count = ref.compact_local_slots(ids, bt, 16, W, rank, 1, width)
    assert int(count[3]) > width and int(count[1]) <= width  # both kinds of rows
    if env == "reference":
        out, lse = ref.sparse_mla_attention(q, buf, main, 576**-0.5, kv_format)
        ref.sparse_mla_overflow(q, buf, over, count, width, out, lse, 576**-0.5, kv_format)
    else:
        out, lse = sparse_mla_attention(q, buf.to(dev), main.to(dev), 576**-0.5, kv_format)
        sparse_mla_overflow(q, buf.to(dev), over.to(dev), count.to(dev), width, out, lse,
                            576**-0.5, kv_format)
    _check_attention(out.cpu(), lse.cpu(), want_o, want_l, q.dtype)
