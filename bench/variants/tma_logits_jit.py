"""Jitted body of the TMA prefill indexer logits (bench variant until it wins on the H200).

Same contract and int32 keys as ``indexer_logits_jit.logits_planar_kernel``; the one change:
the key tiles are read by the tensor memory accelerator through a host-made descriptor over the
fp8 value plane (``kp_desc``: ``[R, 128]``, boxes of ``[BK, 128]``) instead of per-thread 16-byte
``cp.async`` copies. Why: in the compiled loop of the ``cp.async`` kernel (sm_90, Triton 3.6)
about 60 of ~270 instructions a thread per key tile compute and predicate the copies' addresses,
and each stage waits on a barrier of the whole program; a TMA copy is one instruction of one
thread, waited on through an mbarrier. A box needs consecutive rows, so a key tile must be one
run of the gather chunk's remap (``W == 1``, or ``BK`` dividing the interleave): the launcher
checks. Rows past the plane are zero-filled by the copy; rows past a query's keys are read but
never stored (each key's scores depend on its own row only).
"""

from __future__ import annotations

import triton
import triton.language as tl

from cpplan.runtime.kernels.triton.indexer_logits_jit import _epilogue, _query_tile, _store


@triton.jit
def _tile_row(kb, pq, PT, W: tl.constexpr, I: tl.constexpr):
    """The plane row of key position ``kb`` (a tile's first; the tile is one run of the remap)."""
    if W == 1:
        return pq + kb
    else:
        g = kb // I
        return (g % W) * PT + pq + (g // W) * I + kb % I


# Over 50 lines on purpose, as the kernel it varies: the loop over key tiles is the kernel.
@triton.jit(do_not_specialize=["len_ptr", "pcu_ptr", "T", "L", "PT", "KEYS_PER_SPLIT"])
def logits_planar_tma_kernel(q_ptr, w_ptr, kp_desc, ks_ptr, out_ptr, len_ptr, pcu_ptr,
                             stride_qt, stride_qh, stride_wt, stride_ot, T, HI, L, PT,
                             KEYS_PER_SPLIT, W: tl.constexpr, I: tl.constexpr, BQ: tl.constexpr,
                             HP: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr,
                             PRECISION: tl.constexpr):
    split = tl.program_id(0)
    j0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BQ  # the last query blocks first
    qT, w = _query_tile(q_ptr, w_ptr, j0, T, HI, stride_qt, stride_qh, stride_wt, BQ, HP)
    jq = j0 + tl.arange(0, BQ)
    qmask = jq < T
    n = tl.load(len_ptr + jq, mask=qmask, other=0).to(tl.int32)
    pcu = tl.load(pcu_ptr + jq, mask=qmask, other=0).to(tl.int64)
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(tl.max(n), lo + KEYS_PER_SPLIT)
    p_lo = tl.min(tl.where(n > 0, pcu, 9223372036854775807))
    shared = tl.max(tl.where(n > 0, pcu, -1)) <= p_lo
    optr = out_ptr + jq.to(tl.int64)[None, :] * stride_ot
    passes = tl.where(shared, 1, BQ)
    for qi in range(passes):
        pq = tl.where(shared, p_lo, tl.sum(tl.where(tl.arange(0, BQ) == qi, pcu, 0)))
        jb = tl.arange(0, BQ)
        mine = (jb == qi) | (jb >= tl.where(shared, 0, BQ))
        for kb in range(lo, hi, BK):
            c = kb + tl.arange(0, BK)
            kvalid = c < hi
            r0 = _tile_row(kb, pq, PT, W, I)
            k = kp_desc.load([r0.to(tl.int32), 0])
            if k.dtype == tl.uint8:  # the interpreter's planes: bytes
                k = k.to(tl.float8e4nv, bitcast=True)
            if DOT_DTYPE == tl.float8e4nv:
                acc = tl.dot(k, qT)
            else:
                acc = tl.dot(k.to(DOT_DTYPE), qT.to(DOT_DTYPE), input_precision=PRECISION)
            scale = tl.load(ks_ptr + r0 + tl.arange(0, BK), mask=kvalid, other=0.0)
            s = _epilogue(acc, w, scale, BQ, HP)
            valid = (c[:, None] < n[None, :]) & mine[None, :]
            _store(optr + c[:, None], s, valid, valid, True)
