"""Jitted body of the planar prefill logits (launcher and reasoning: ``indexer_tiled.py``).

``logits_planar_kernel``: the prefill logits of ``indexer_tiled_jit.logits_kernel`` (MODE 1,
int32 keys out) over the gathered indexer keys split into two planes: fp8 values ``[R, 128]``
(every row 128-byte aligned, so a row is eight 16-byte loads, and the tile can be fed to the
matrix unit as fp8) and float32 scales ``[R]``. One program per (key split, block of BQ
queries); per key block ``K [BK, 128] @ Q^T [128, BQ * HP]`` with fp8 operands on the GPU
(DOT_DTYPE float8e4nv; the query is the fp8-quantised indexer query, docs/design.md §3.6), or
fp16 / fp32 operands in the interpreter (fp8 values are exact there). The epilogue is the one of
the byte-row kernel: ReLU, the head weights, the sum over each query's heads, the key's
power-of-two scale, the order-preserving int32 key.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .indexer_tiled_jit import _prefill_rows, _store


@triton.jit
def _planar_scores(kp_ptr, ks_ptr, rows, kvalid, qT, w, BQ: tl.constexpr, HP: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Scores [BK, BQ] of key rows ``rows [BK]`` of the planes against qT [128, BQ*HP]."""
    d = tl.arange(0, 128)
    k = tl.load(kp_ptr + rows.to(tl.int64)[:, None] * 128 + d[None, :], mask=kvalid[:, None],
                other=0.0)
    if DOT_DTYPE == tl.float8e4nv:
        acc = tl.dot(k, qT)  # [BK, BQ * HP] fp32
    else:
        acc = tl.dot(k.to(DOT_DTYPE), qT.to(DOT_DTYPE), input_precision=PRECISION)
    scale = tl.load(ks_ptr + rows, mask=kvalid, other=0.0)
    s = tl.maximum(acc, 0.0) * w[None, :]
    BK: tl.constexpr = rows.shape[0]
    s = tl.sum(tl.reshape(s, (BK, BQ, HP)), 2)
    return s * scale[:, None]  # a positive power of two: exact after ReLU and the head sum


# Step-varying ints and index pointers are not specialised (bench/jit_variants.py).
@triton.jit(do_not_specialize=["len_ptr", "pcu_ptr", "T", "L", "PT", "KEYS_PER_SPLIT"])
def logits_planar_kernel(q_ptr, w_ptr, kp_ptr, ks_ptr, out_ptr, len_ptr, pcu_ptr,
                         stride_qt, stride_qh, stride_wt, stride_ot, T, HI, L, PT, KEYS_PER_SPLIT,
                         W: tl.constexpr, I: tl.constexpr, BQ: tl.constexpr, HP: tl.constexpr,
                         BK: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    split = tl.program_id(0)
    j0 = tl.program_id(1) * BQ
    r = tl.arange(0, BQ * HP)
    jr = j0 + r // HP
    hr = r % HP
    cmask = (jr < T) & (hr < HI)
    d = tl.arange(0, 128)
    qT = tl.load(q_ptr + jr.to(tl.int64)[None, :] * stride_qt + hr[None, :] * stride_qh + d[:, None],
                 mask=cmask[None, :], other=0.0)
    w = tl.load(w_ptr + jr.to(tl.int64) * stride_wt + hr, mask=cmask, other=0.0).to(tl.float32)
    jq = j0 + tl.arange(0, BQ)
    qmask = jq < T
    n = tl.load(len_ptr + jq, mask=qmask, other=0).to(tl.int32)
    pcu = tl.load(pcu_ptr + jq, mask=qmask, other=0).to(tl.int64)
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(tl.max(n), lo + KEYS_PER_SPLIT)
    p_lo = tl.min(tl.where(n > 0, pcu, 9223372036854775807))
    shared = tl.max(tl.where(n > 0, pcu, -1)) <= p_lo
    optr = out_ptr + jq.to(tl.int64)[None, :] * stride_ot
    if shared:  # the queries of the block are one request's: one key tile serves all
        for kb in range(lo, hi, BK):
            c = kb + tl.arange(0, BK)
            kvalid = c < hi
            rows = tl.where(kvalid, _prefill_rows(c, p_lo, PT, W, I), 0)
            s = _planar_scores(kp_ptr, ks_ptr, rows, kvalid, qT, w, BQ, HP, DOT_DTYPE, PRECISION)
            valid = c[:, None] < n[None, :]
            _store(optr + c[:, None], s, valid, valid, True)
    else:  # a request boundary inside the block (rare): one key tile per query
        for kb in range(lo, hi, BK):
            c = kb + tl.arange(0, BK)
            kvalid = c < hi
            s = tl.zeros((BK, BQ), tl.float32)
            for qi in tl.static_range(BQ):
                pq = tl.sum(tl.where(tl.arange(0, BQ) == qi, pcu, 0))
                rows = tl.where(kvalid, _prefill_rows(c, pq, PT, W, I), 0)
                sq = _planar_scores(kp_ptr, ks_ptr, rows, kvalid, qT, w, BQ, HP, DOT_DTYPE,
                                    PRECISION)
                s = tl.where(tl.arange(0, BQ)[None, :] == qi, sq, s)
            valid = c[:, None] < n[None, :]
            _store(optr + c[:, None], s, valid, valid, True)
