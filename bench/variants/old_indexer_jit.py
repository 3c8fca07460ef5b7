"""Jitted body of the first Triton indexer (launched by ``old_indexer.py``)."""

from __future__ import annotations

import triton
import triton.language as tl


# B is not specialised: Triton's alignment analysis otherwise assumes key addresses 64-byte
# aligned and emits 16-byte loads (a misaligned address on the H200 with packed rows). The
# tiled indexer (runtime/kernels/triton/indexer_logits_jit.py) reads the block-planar cache with 16-byte loads.
@triton.jit(do_not_specialize=["B"])
def indexer_kernel(q_ptr, w_ptr, k_ptr, out_ptr, rows_ptr, len_ptr, pcu_ptr, bt_ptr,
                    stride_qt, stride_qh, stride_wt, stride_ot, stride_rt, stride_bt,
                    HI, L, PT, B, RANK, W: tl.constexpr, I: tl.constexpr,
                    MODE: tl.constexpr, COMPOSITE: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_L: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    lb = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64)
    c = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    if MODE == 0:
        rows = tl.load(rows_ptr + j * stride_rt + c, mask=c < L, other=-1).to(tl.int64)
        valid = rows >= 0
        n_keys = L
    else:
        n_keys = tl.load(len_ptr + j)
        valid = c < n_keys
        if MODE == 1:
            pcu = tl.load(pcu_ptr + j).to(tl.int64)
            g = c // I
            rows = (g % W) * PT + pcu + (g // W) * I + c % I
        else:  # block-planar paged cache: a block's B x 128 values, then its B scales
            blk = tl.load(bt_ptr + j * stride_bt + c // B, mask=valid, other=0).to(tl.int64)
            rows = blk * B + c % B
    rows = tl.where(valid, rows, 0).to(tl.int64)
    if MODE == 2:
        vb = k_ptr + (rows // B) * B * 132 + (rows % B) * 128
        sb = k_ptr + (rows // B) * B * 132 + B * 128 + (rows % B) * 4
    else:  # packed 132-byte rows
        vb = k_ptr + rows * 132
        sb = vb + 128
    score = tl.full((BLOCK_L,), float("-inf"), tl.float32)
    if lb * BLOCK_L < n_keys:
        heads = tl.arange(0, BLOCK_H)
        hmask = heads < HI
        q = tl.load(q_ptr + j * stride_qt + heads[:, None] * stride_qh + tl.arange(0, 128)[None, :],
                    mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
        w = tl.load(w_ptr + j * stride_wt + heads, mask=hmask, other=0.0).to(tl.float32)
        raw = tl.load(vb[:, None] + tl.arange(0, 128)[None, :], mask=valid[:, None], other=0)
        k = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DOT_DTYPE)
        scale = tl.load(sb.to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale[None, :]
        s = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)
        score = tl.where(valid, s, float("-inf"))
    if COMPOSITE:
        bits = score.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        key = (ordered << 32) | (4294967295 - c.to(tl.int64))
        tl.store(out_ptr + j * stride_ot + c, key, mask=c < L)
    else:
        tl.store(out_ptr + j * stride_ot + c, score, mask=c < L)
