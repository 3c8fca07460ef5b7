"""Jitted bodies of the Triton sparse-MLA attention (launched by ``attention.py``).

One program per (block of heads, query token, split of the top-k). Each step gathers BLOCK_K
rows named by the indices and runs an online softmax with two matrix products: scores over the
512 latent + 64 RoPE dims, then P . V with V = the 512 latent dims of the same rows. Heads sit on
the rows of the products (16-64 per program). Two kernels:

- ``sparse_mla_fwd`` (family "triton-heads"): bf16 rows cast to the operand dtype, or fp8_ds_mla
  rows dequantised in registers (value x its group's power-of-two scale: exact);
- ``sparse_mla_fwd_scaled`` (family "triton-heads-scaled", fp8 rows only): the raw fp8 values are
  only upcast and the group scales multiply the score and probability tiles instead
  (``q . k = sum_g (q_g . raw_g) * scale_g``, ``P . V_g = (P * scale_g) . raw_g``), with the
  output in four [heads, 128] accumulators; cheaper than dequantising every value at few heads.

Both write a partial (out, lse) per split. REMAP maps global token ids to rows of the rank-major
gathered buffer in the kernel (docs/design.md §Gather chunks and the deinterleave map).
The helpers here are shared by every Triton attention kernel, also bench/variants'; nothing in
this module imports another kernels module.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_raw(kv_ptr, rows, valid, stride_kv, KV_FP8: tl.constexpr):
    """Rows ``kv[rows]`` as stored: (latent [BLOCK_K, 512] uint8 or bf16, scales [BLOCK_K, 4] fp32
    (1.0 for bf16), rope [BLOCK_K, 64] bf16); 0 where not valid."""
    d_lat = tl.arange(0, 512)
    d_rope = tl.arange(0, 64)
    base = kv_ptr + rows.to(tl.int64) * stride_kv
    if KV_FP8:
        raw = tl.load(base[:, None] + d_lat[None, :], mask=valid[:, None], other=0)
        sc_ptr = (base + 512).to(tl.pointer_type(tl.float32))
        scale = tl.load(sc_ptr[:, None] + tl.arange(0, 4)[None, :], mask=valid[:, None], other=0.0)
        rope_ptr = (base + 528).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_ptr[:, None] + d_rope[None, :], mask=valid[:, None], other=0.0)
    else:
        raw = tl.load(base[:, None] + d_lat[None, :], mask=valid[:, None], other=0.0)
        scale = tl.full((rows.shape[0], 4), 1.0, tl.float32)
        rope = tl.load(base[:, None] + 512 + d_rope[None, :], mask=valid[:, None], other=0.0)
    return raw, scale, rope


@triton.jit
def dequant(raw, scale, rope, KV_FP8: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """(latent, rope) in DOT_DTYPE. fp8: value * its group's power-of-two scale in float32 (exact)."""
    if KV_FP8:
        vals = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        lat = tl.reshape(tl.reshape(vals, (BLOCK_K, 4, 128)) * scale[:, :, None], (BLOCK_K, 512))
        return lat.to(DOT_DTYPE), rope.to(DOT_DTYPE)
    else:
        return raw.to(DOT_DTYPE), rope.to(DOT_DTYPE)


@triton.jit
def remap_rows(ids, pcu, padded_local_total, dcp_size: tl.constexpr, interleave: tl.constexpr,
               REMAP: tl.constexpr):
    """Token ids (>= 0) -> int64 rows; with REMAP the gathered-buffer row, in int32 arithmetic with
    W and I compile-time constants (ids and rows stay below 2**31)."""
    if REMAP:
        grp = ids // interleave
        ids = ((grp % dcp_size) * padded_local_total + pcu
               + (grp // dcp_size) * interleave + ids % interleave)
    return ids.to(tl.int64)


@triton.jit
def block_rows(idx_ptr, t, stride_it, k0, k_end, pcu, padded_local_total, dcp_size: tl.constexpr,
               interleave: tl.constexpr, REMAP: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows (int64) and validity of top-k slots ``k0 .. k0 + BLOCK_K`` (slots >= k_end: invalid)."""
    offs = k0 + tl.arange(0, BLOCK_K)
    idx = tl.load(idx_ptr + t.to(tl.int64) * stride_it + offs, mask=offs < k_end, other=-1)
    valid = idx >= 0
    rows = remap_rows(tl.where(valid, idx, 0), pcu, padded_local_total, dcp_size, interleave, REMAP)
    return rows, valid


@triton.jit
def _softmax_step(q_lat, q_rope, lat, rope, valid, m_i, l_i, acc, qk_scale_log2,
                  DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """One block of the online softmax, heads on the rows: S = Q K^T, acc = acc * alpha + P V."""
    s = tl.dot(q_lat, tl.trans(lat), input_precision=PRECISION)
    s = tl.dot(q_rope, tl.trans(rope), s, input_precision=PRECISION)
    s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(DOT_DTYPE), lat, acc, input_precision=PRECISION)
    return m_new, l_i, acc


# Arguments that change with the step (T * H strides, split sizes, table slices): left
# unspecialised, so a new step shape is not a new compile (bench/jit_variants.py)
STEP_VARYING = ["pcu_ptr", "stride_ls", "stride_lt", "keys_per_split", "padded_local_total"]


@triton.jit(do_not_specialize=STEP_VARYING)
def sparse_mla_fwd(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, pcu_ptr,
    stride_qt, stride_qh, stride_kv, stride_it,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    H, TOPK, keys_per_split, padded_local_total, qk_scale_log2,
    dcp_size: tl.constexpr, interleave: tl.constexpr, KV_FP8: tl.constexpr, REMAP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_h = tl.program_id(0)  # head blocks of one token run side by side: they share rows in L2
    t = tl.program_id(1)
    split = tl.program_id(2)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    q_base = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_base + tl.arange(0, 512)[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    q_rope = tl.load(q_base + 512 + tl.arange(0, 64)[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    pcu = 0
    if REMAP:
        pcu = tl.load(pcu_ptr + t).to(tl.int32)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, 512), tl.float32)
    k_begin = split * keys_per_split
    k_end = tl.minimum(k_begin + keys_per_split, TOPK)
    for k0 in tl.range(k_begin, k_end, BLOCK_K):
        rows, valid = block_rows(idx_ptr, t, stride_it, k0, k_end, pcu, padded_local_total,
                                 dcp_size, interleave, REMAP, BLOCK_K)
        raw, scale, rope = gather_raw(kv_ptr, rows, valid, stride_kv, KV_FP8)
        lat, rp = dequant(raw, scale, rope, KV_FP8, BLOCK_K, DOT_DTYPE)
        m_i, l_i, acc = _softmax_step(q_lat, q_rope, lat, rp, valid, m_i, l_i, acc, qk_scale_log2,
                                      DOT_DTYPE, PRECISION)

    has = l_i > 0.0
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(has, (m_safe + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    o_ptr = out_ptr + split.to(tl.int64) * stride_os + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
    tl.store(o_ptr + tl.arange(0, 512)[None, :], out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    tl.store(lse_ptr + split.to(tl.int64) * stride_ls + t.to(tl.int64) * stride_lt + heads, lse, mask=hmask)


@triton.jit
def _raw(base, valid, g: tl.constexpr, DOT_DTYPE: tl.constexpr):
    raw = tl.load(base[:, None] + g * 128 + tl.arange(0, 128)[None, :], mask=valid[:, None], other=0)
    return raw.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)


@triton.jit
def _store_group(o_ptr, acc, inv_l, g: tl.constexpr, hmask):
    tl.store(o_ptr + g * 128 + tl.arange(0, 128)[None, :], (acc * inv_l[:, None]).to(o_ptr.dtype.element_ty),
             mask=hmask[:, None])


# Over 50 lines on purpose: the four fp8 groups of a key block are unrolled by hand (Triton
# has no per-group loop over a tile's columns); a helper per group would only move the lines.
@triton.jit(do_not_specialize=STEP_VARYING)
def sparse_mla_fwd_scaled(
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
        rows = remap_rows(tl.where(valid, idx, 0), pcu, padded_local_total, dcp_size, interleave, REMAP)
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


@triton.jit(do_not_specialize=["count_ptr", "WIDTH"])
def sparse_mla_overflow_kernel(
    q_ptr, kv_ptr, idx_ptr, count_ptr, out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh, stride_lt,
    H, WIDTH, qk_scale_log2,
    KV_FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The overflow of a compacted decode pass (``sparse_mla_overflow``): a row holding more
    than WIDTH local slots attends over the ``count - WIDTH`` in ``idx`` and LSE-merges the
    result into its (out, lse) in place; any other row's programs end at once."""
    pid_h = tl.program_id(0)
    t = tl.program_id(1)
    n = tl.load(count_ptr + t) - WIDTH
    if n > 0:
        heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        q_base = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
        q_lat = tl.load(q_base + tl.arange(0, 512)[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
        q_rope = tl.load(q_base + 512 + tl.arange(0, 64)[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, 512), tl.float32)
        for k0 in tl.range(0, n, BLOCK_K):
            rows, valid = block_rows(idx_ptr, t, stride_it, k0, n, 0, 0, 1, 1, False, BLOCK_K)
            raw, scale, rope = gather_raw(kv_ptr, rows, valid, stride_kv, KV_FP8)
            lat, rp = dequant(raw, scale, rope, KV_FP8, BLOCK_K, DOT_DTYPE)
            m_i, l_i, acc = _softmax_step(q_lat, q_rope, lat, rp, valid, m_i, l_i, acc,
                                          qk_scale_log2, DOT_DTYPE, PRECISION)
        has = l_i > 0.0
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        lse2 = tl.where(has, (m_safe + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                        float("-inf"))
        o2 = acc / tl.where(has, l_i, 1.0)[:, None]
        d = tl.arange(0, 512)
        o_ptrs = out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
        l_ptrs = lse_ptr + t.to(tl.int64) * stride_lt + heads
        lse1 = tl.load(l_ptrs, mask=hmask, other=float("-inf"))
        o1 = tl.load(o_ptrs, mask=hmask[:, None], other=0.0).to(tl.float32)
        m = tl.maximum(lse1, lse2)
        m = tl.where(m == float("-inf"), 0.0, m)
        e1 = tl.exp(lse1 - m)
        e2 = tl.exp(lse2 - m)
        tot = e1 + e2
        some = tot > 0.0
        w1 = tl.where(some, e1 / tl.where(some, tot, 1.0), 0.0)
        w2 = tl.where(some, e2 / tl.where(some, tot, 1.0), 0.0)
        o = o1 * w1[:, None] + o2 * w2[:, None]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
        tl.store(l_ptrs, tl.where(some, m + tl.log(tl.where(some, tot, 1.0)), float("-inf")),
                 mask=hmask)
