"""Bench variant (never a default): sparse-MLA kernel with keys on the wide side of the products.

With 8-32 heads per rank, ``S = Q K^T`` puts the heads on the M side of the product, which the
Hopper tensor cores (wgmma, M = 64 per warpgroup) cannot fill. Here the products are transposed:
``S^T = K Q^T`` ([keys, heads]: M = BLOCK_K keys, N = heads) and ``O^T = V^T P^T`` ([512, heads]:
M = 512), so the keys fill M and the heads are the narrow N side. The softmax reduces over the
key axis (axis 0).

fp8_ds_mla rows: the 512 latent dims are four groups of 128 with one power-of-two scale per key,
so the raw fp8 values are only upcast (exact) and the scales multiply the [keys, heads] score
and probability tiles (``q . k = sum_g scale_g (q_g . raw_g)``, ``P V_g = (P scale_g) raw_g``).
bf16 rows take the same path with no scales.

PREFETCH: the next block's rows are gathered into registers as stored (fp8 bytes, scales, rope)
before this block's products, and the indices one block further ahead, so several gathers are in
flight per program. Contract: ``reference.sparse_mla_attention``.

Why it is here and not in the runtime (bench/RESULTS.md, variant sweep): at B 256 H 16 its best
(32 keys, prefetch) measured 344-347 us against 359-376 for the heads kernels, but its prefetch
variants at 64/128 keys hit an illegal address on the H200 (cause not found); at 64-128 heads it
lost everywhere; the Gluon decode (214.8 us) now runs that shape on sm_90. Launched by
``kmajor.py`` for comparison in bench/kernel_times.py's sweep.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cpplan.runtime.kernels.triton.attention_jit import block_rows as _block_rows


@triton.jit
def _ld(ptrs, mask, other, EVICT: tl.constexpr):
    """``tl.load``; EVICT marks streamed rows evict-first (decode: read once, keep L2 for others)."""
    if EVICT:
        return tl.load(ptrs, mask=mask, other=other, eviction_policy="evict_first")
    else:
        return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def _gather_groups(kv_ptr, rows, valid, stride_kv, KV_FP8: tl.constexpr, EVICT: tl.constexpr):
    """kv[rows] as stored: four [BLOCK_K, 128] latent groups, four [BLOCK_K] scales, rope [BLOCK_K, 64]."""
    base = kv_ptr + rows * stride_kv
    d = tl.arange(0, 128)[None, :]
    m = valid[:, None]
    if KV_FP8:
        r0 = _ld(base[:, None] + d, m, 0, EVICT)
        r1 = _ld(base[:, None] + 128 + d, m, 0, EVICT)
        r2 = _ld(base[:, None] + 256 + d, m, 0, EVICT)
        r3 = _ld(base[:, None] + 384 + d, m, 0, EVICT)
        sc = (base + 512).to(tl.pointer_type(tl.float32))
        s0 = _ld(sc, valid, 0.0, EVICT)
        s1 = _ld(sc + 1, valid, 0.0, EVICT)
        s2 = _ld(sc + 2, valid, 0.0, EVICT)
        s3 = _ld(sc + 3, valid, 0.0, EVICT)
        rope = _ld((base + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + tl.arange(0, 64)[None, :],
                   m, 0.0, EVICT)
    else:
        r0 = _ld(base[:, None] + d, m, 0.0, EVICT)
        r1 = _ld(base[:, None] + 128 + d, m, 0.0, EVICT)
        r2 = _ld(base[:, None] + 256 + d, m, 0.0, EVICT)
        r3 = _ld(base[:, None] + 384 + d, m, 0.0, EVICT)
        s0 = tl.full((rows.shape[0],), 1.0, tl.float32)
        s1 = s0
        s2 = s0
        s3 = s0
        rope = _ld(base[:, None] + 512 + tl.arange(0, 64)[None, :], m, 0.0, EVICT)
    return r0, r1, r2, r3, s0, s1, s2, s3, rope


@triton.jit
def _up(raw, KV_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    if KV_FP8:
        return raw.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
    else:
        return raw.to(DOT_DTYPE)


@triton.jit
def _deq(raw, sc, DOT_DTYPE: tl.constexpr):
    return (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]).to(DOT_DTYPE)


@triton.jit
def _kstep(qT0, qT1, qT2, qT3, qTr, r0, r1, r2, r3, s0, s1, s2, s3, rope, valid,
           m_i, l_i, a0, a1, a2, a3, qk_scale_log2,
           KV_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, REUP: tl.constexpr):
    """One block, keys on the rows: S^T [keys, heads], acc_g^T [128, heads]."""
    k0 = _up(r0, KV_FP8, DOT_DTYPE)
    k1 = _up(r1, KV_FP8, DOT_DTYPE)
    k2 = _up(r2, KV_FP8, DOT_DTYPE)
    k3 = _up(r3, KV_FP8, DOT_DTYPE)
    kr = rope.to(DOT_DTYPE)
    s = tl.dot(kr, qTr, input_precision=PRECISION)
    if KV_FP8:
        s += tl.dot(k0, qT0, input_precision=PRECISION) * s0[:, None]
        s += tl.dot(k1, qT1, input_precision=PRECISION) * s1[:, None]
        s += tl.dot(k2, qT2, input_precision=PRECISION) * s2[:, None]
        s += tl.dot(k3, qT3, input_precision=PRECISION) * s3[:, None]
    else:
        s = tl.dot(k0, qT0, s, input_precision=PRECISION)
        s = tl.dot(k1, qT1, s, input_precision=PRECISION)
        s = tl.dot(k2, qT2, s, input_precision=PRECISION)
        s = tl.dot(k3, qT3, s, input_precision=PRECISION)
    s = tl.where(valid[:, None], s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[None, :])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 0)
    if KV_FP8 and REUP:
        # dequantise again for P V (value * scale: not the tiles above, so not merged with them):
        # the upcast S tiles die before the softmax instead of living on in registers
        pd = p.to(DOT_DTYPE)
        a0 = tl.dot(tl.trans(_deq(r0, s0, DOT_DTYPE)), pd, a0 * alpha[None, :], input_precision=PRECISION)
        a1 = tl.dot(tl.trans(_deq(r1, s1, DOT_DTYPE)), pd, a1 * alpha[None, :], input_precision=PRECISION)
        a2 = tl.dot(tl.trans(_deq(r2, s2, DOT_DTYPE)), pd, a2 * alpha[None, :], input_precision=PRECISION)
        a3 = tl.dot(tl.trans(_deq(r3, s3, DOT_DTYPE)), pd, a3 * alpha[None, :], input_precision=PRECISION)
    elif KV_FP8:
        a0 = tl.dot(tl.trans(k0), (p * s0[:, None]).to(DOT_DTYPE), a0 * alpha[None, :], input_precision=PRECISION)
        a1 = tl.dot(tl.trans(k1), (p * s1[:, None]).to(DOT_DTYPE), a1 * alpha[None, :], input_precision=PRECISION)
        a2 = tl.dot(tl.trans(k2), (p * s2[:, None]).to(DOT_DTYPE), a2 * alpha[None, :], input_precision=PRECISION)
        a3 = tl.dot(tl.trans(k3), (p * s3[:, None]).to(DOT_DTYPE), a3 * alpha[None, :], input_precision=PRECISION)
    else:
        pd = p.to(DOT_DTYPE)
        a0 = tl.dot(tl.trans(k0), pd, a0 * alpha[None, :], input_precision=PRECISION)
        a1 = tl.dot(tl.trans(k1), pd, a1 * alpha[None, :], input_precision=PRECISION)
        a2 = tl.dot(tl.trans(k2), pd, a2 * alpha[None, :], input_precision=PRECISION)
        a3 = tl.dot(tl.trans(k3), pd, a3 * alpha[None, :], input_precision=PRECISION)
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def _store_group_t(o_ptr, acc, inv_l, g: tl.constexpr, hmask):
    tl.store(o_ptr + g * 128 + tl.arange(0, 128)[:, None], (acc * inv_l[None, :]).to(o_ptr.dtype.element_ty),
             mask=hmask[None, :])


# Over 50 lines: a kept bench variant, unchanged from when it was a runtime kernel.
@triton.jit
def sparse_mla_fwd_kmajor(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, pcu_ptr,
    stride_qt, stride_qh, stride_kv, stride_it,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    H, TOPK, keys_per_split, padded_local_total, qk_scale_log2,
    dcp_size: tl.constexpr, interleave: tl.constexpr, KV_FP8: tl.constexpr, REMAP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr = True, EVICT: tl.constexpr = False, REUP: tl.constexpr = False,
):
    pid_h = tl.program_id(0)
    t = tl.program_id(1)
    split = tl.program_id(2)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    q_base = q_ptr + t.to(tl.int64) * stride_qt + heads[None, :] * stride_qh  # Q^T tiles [dims, heads]
    d = tl.arange(0, 128)[:, None]
    qT0 = tl.load(q_base + d, mask=hmask[None, :], other=0.0).to(DOT_DTYPE)
    qT1 = tl.load(q_base + 128 + d, mask=hmask[None, :], other=0.0).to(DOT_DTYPE)
    qT2 = tl.load(q_base + 256 + d, mask=hmask[None, :], other=0.0).to(DOT_DTYPE)
    qT3 = tl.load(q_base + 384 + d, mask=hmask[None, :], other=0.0).to(DOT_DTYPE)
    qTr = tl.load(q_base + 512 + tl.arange(0, 64)[:, None], mask=hmask[None, :], other=0.0).to(DOT_DTYPE)
    pcu = 0
    if REMAP:
        pcu = tl.load(pcu_ptr + t).to(tl.int32)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    a0 = tl.zeros((128, BLOCK_H), tl.float32)
    a1 = tl.zeros((128, BLOCK_H), tl.float32)
    a2 = tl.zeros((128, BLOCK_H), tl.float32)
    a3 = tl.zeros((128, BLOCK_H), tl.float32)
    k_begin = split * keys_per_split
    k_end = tl.minimum(k_begin + keys_per_split, TOPK)
    if PREFETCH:
        rows, valid = _block_rows(idx_ptr, t, stride_it, k_begin, k_end, pcu, padded_local_total,
                                  dcp_size, interleave, REMAP, BLOCK_K)
        r0, r1, r2, r3, s0, s1, s2, s3, rope = _gather_groups(kv_ptr, rows, valid, stride_kv, KV_FP8, EVICT)
        rows_n, valid_n = _block_rows(idx_ptr, t, stride_it, k_begin + BLOCK_K, k_end, pcu,
                                      padded_local_total, dcp_size, interleave, REMAP, BLOCK_K)
        for k0 in range(k_begin, k_end, BLOCK_K):
            n0, n1, n2, n3, ns0, ns1, ns2, ns3, nrope = _gather_groups(kv_ptr, rows_n, valid_n, stride_kv,
                                                                       KV_FP8, EVICT)
            rows_nn, valid_nn = _block_rows(idx_ptr, t, stride_it, k0 + 2 * BLOCK_K, k_end, pcu,
                                            padded_local_total, dcp_size, interleave, REMAP, BLOCK_K)
            m_i, l_i, a0, a1, a2, a3 = _kstep(qT0, qT1, qT2, qT3, qTr, r0, r1, r2, r3, s0, s1, s2, s3, rope,
                                              valid, m_i, l_i, a0, a1, a2, a3, qk_scale_log2,
                                              KV_FP8, DOT_DTYPE, PRECISION, REUP)
            r0, r1, r2, r3, s0, s1, s2, s3, rope, valid = n0, n1, n2, n3, ns0, ns1, ns2, ns3, nrope, valid_n
            rows_n, valid_n = rows_nn, valid_nn
    else:
        for k0 in range(k_begin, k_end, BLOCK_K):
            rows, valid = _block_rows(idx_ptr, t, stride_it, k0, k_end, pcu, padded_local_total,
                                      dcp_size, interleave, REMAP, BLOCK_K)
            r0, r1, r2, r3, s0, s1, s2, s3, rope = _gather_groups(kv_ptr, rows, valid, stride_kv, KV_FP8, EVICT)
            m_i, l_i, a0, a1, a2, a3 = _kstep(qT0, qT1, qT2, qT3, qTr, r0, r1, r2, r3, s0, s1, s2, s3, rope,
                                              valid, m_i, l_i, a0, a1, a2, a3, qk_scale_log2,
                                              KV_FP8, DOT_DTYPE, PRECISION, REUP)

    has = l_i > 0.0
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(has, (m_safe + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    inv_l = 1.0 / tl.where(has, l_i, 1.0)
    o_ptr = out_ptr + split.to(tl.int64) * stride_os + t.to(tl.int64) * stride_ot + heads[None, :] * stride_oh
    _store_group_t(o_ptr, a0, inv_l, 0, hmask)
    _store_group_t(o_ptr, a1, inv_l, 1, hmask)
    _store_group_t(o_ptr, a2, inv_l, 2, hmask)
    _store_group_t(o_ptr, a3, inv_l, 3, hmask)
    tl.store(lse_ptr + split.to(tl.int64) * stride_ls + t.to(tl.int64) * stride_lt + heads, lse, mask=hmask)
