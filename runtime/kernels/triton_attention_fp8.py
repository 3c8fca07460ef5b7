"""fp8_ds_mla variant of the sparse-MLA kernel: scales applied after the products.

Dequantising every value (fp8 -> float32, times its group's scale, -> bf16) costs more than the
matrix work at few heads (shared/KERNELS.md). Here the 512 latent dims are four groups of 128,
each with one power-of-two scale per key, so
``q . k = sum_g (q_g . raw_g) * scale_g`` and ``P . V_g = (P * scale_g) . raw_g``: the raw fp8
values are only upcast (exact), the scales multiply the [heads, keys] score and probability
tiles, and the output lives in four [heads, 128] accumulators. Exact up to the same roundings as
the plain path (powers of two commute with rounding). Contract: ``reference.sparse_mla_attention``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_attention import _remap_rows


@triton.jit
def _raw(base, valid, g: tl.constexpr, DOT_DTYPE: tl.constexpr):
    raw = tl.load(base[:, None] + g * 128 + tl.arange(0, 128)[None, :], mask=valid[:, None], other=0)
    return raw.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)


@triton.jit
def _store_group(o_ptr, acc, inv_l, g: tl.constexpr, hmask):
    tl.store(o_ptr + g * 128 + tl.arange(0, 128)[None, :], (acc * inv_l[:, None]).to(o_ptr.dtype.element_ty),
             mask=hmask[:, None])


@triton.jit
def _sparse_mla_fwd_fp8(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, pcu_ptr,
    stride_qt, stride_qh, stride_kv, stride_it,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    H, TOPK, keys_per_split, padded_local_total, qk_scale_log2,
    dcp_size: tl.constexpr, interleave: tl.constexpr, REMAP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_h = tl.program_id(0)
    t = tl.program_id(1)
    split = tl.program_id(2)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    q_base = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    d = tl.arange(0, 128)[None, :]
    q0 = tl.load(q_base + d, mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    q1 = tl.load(q_base + 128 + d, mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    q2 = tl.load(q_base + 256 + d, mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    q3 = tl.load(q_base + 384 + d, mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    q_rope = tl.load(q_base + 512 + tl.arange(0, 64)[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    pcu = 0
    if REMAP:
        pcu = tl.load(pcu_ptr + t).to(tl.int32)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc0 = tl.zeros((BLOCK_H, 128), tl.float32)
    acc1 = tl.zeros((BLOCK_H, 128), tl.float32)
    acc2 = tl.zeros((BLOCK_H, 128), tl.float32)
    acc3 = tl.zeros((BLOCK_H, 128), tl.float32)
    k_begin = split * keys_per_split
    k_end = tl.minimum(k_begin + keys_per_split, TOPK)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + t.to(tl.int64) * stride_it + offs, mask=offs < k_end, other=-1)
        valid = idx >= 0
        rows = _remap_rows(tl.where(valid, idx, 0), pcu, padded_local_total, dcp_size, interleave, REMAP)
        base = kv_ptr + rows * stride_kv
        sc = (base + 512).to(tl.pointer_type(tl.float32))
        s0 = tl.load(sc, mask=valid, other=0.0)
        s1 = tl.load(sc + 1, mask=valid, other=0.0)
        s2 = tl.load(sc + 2, mask=valid, other=0.0)
        s3 = tl.load(sc + 3, mask=valid, other=0.0)
        k0r = _raw(base, valid, 0, DOT_DTYPE)
        k1r = _raw(base, valid, 1, DOT_DTYPE)
        k2r = _raw(base, valid, 2, DOT_DTYPE)
        k3r = _raw(base, valid, 3, DOT_DTYPE)
        rope = tl.load((base + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + tl.arange(0, 64)[None, :],
                       mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        s = tl.dot(q_rope, tl.trans(rope), input_precision=PRECISION)
        s += tl.dot(q0, tl.trans(k0r), input_precision=PRECISION) * s0[None, :]
        s += tl.dot(q1, tl.trans(k1r), input_precision=PRECISION) * s1[None, :]
        s += tl.dot(q2, tl.trans(k2r), input_precision=PRECISION) * s2[None, :]
        s += tl.dot(q3, tl.trans(k3r), input_precision=PRECISION) * s3[None, :]
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc0 = tl.dot((p * s0[None, :]).to(DOT_DTYPE), k0r, acc0 * alpha[:, None], input_precision=PRECISION)
        acc1 = tl.dot((p * s1[None, :]).to(DOT_DTYPE), k1r, acc1 * alpha[:, None], input_precision=PRECISION)
        acc2 = tl.dot((p * s2[None, :]).to(DOT_DTYPE), k2r, acc2 * alpha[:, None], input_precision=PRECISION)
        acc3 = tl.dot((p * s3[None, :]).to(DOT_DTYPE), k3r, acc3 * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    has = l_i > 0.0
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(has, (m_safe + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    inv_l = 1.0 / tl.where(has, l_i, 1.0)
    o_ptr = out_ptr + split.to(tl.int64) * stride_os + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
    _store_group(o_ptr, acc0, inv_l, 0, hmask)
    _store_group(o_ptr, acc1, inv_l, 1, hmask)
    _store_group(o_ptr, acc2, inv_l, 2, hmask)
    _store_group(o_ptr, acc3, inv_l, 3, hmask)
    tl.store(lse_ptr + split.to(tl.int64) * stride_ls + t.to(tl.int64) * stride_lt + heads, lse, mask=hmask)
