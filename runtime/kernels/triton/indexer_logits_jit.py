"""Jitted logits of the tiled indexer (launchers, tile reasoning: ``indexer_tiled.py``).

Two kernels, one program per (key split, block of BQ queries), each looping over key blocks of
BK keys up to the block's largest causal bound; per key block one matrix product
``K [BK, 128] @ Q^T [128, BQ * HP]`` (keys on the M side, queries x heads on the N side), then
ReLU, the head weights, the sum over each query's HP heads and the per-key scale, giving
``[BK, BQ]`` scores:

- ``logits_kernel``: keys as explicit packed 132-byte rows (float32 scores), or decode slots
  through the block table in the block-planar paged cache (a block's BLOCK x 128 fp8 values,
  then its BLOCK float32 scales: 16-byte loads of 128-byte aligned rows, where packed rows at a
  132-byte stride allow 4-byte ones; int32 keys); fp8 -> DOT_DTYPE.
- ``logits_planar_kernel``: prefill keys as two planes, fp8 values ``[R, 128]`` (128-byte
  aligned rows) and float32 scales ``[R]``; fp8 operands on the GPU (DOT_DTYPE float8e4nv, the
  query being the fp8-quantised indexer query, docs/design.md §4.3), fp16 / fp32 in the
  interpreter (fp8 values are exact there); rows through the gather chunk's remap; int32 keys.
  With TMA (``kp`` a tensor descriptor, boxes of ``[BK, 128]``) a key tile is one bulk copy of
  one thread, waited on through an mbarrier; it needs each tile to be one run of consecutive
  rows (the launcher checks: one rank, or an interleave that BK divides). Without, each thread
  copies 16-byte pieces of the tile's rows (eight per row), which takes about 45 more
  instructions a thread per tile and a barrier of the whole program (bench/RESULTS.md, "The
  prefill logits with TMA key tiles").

Ordered key of a float32 score: its bits if >= 0, else bits ^ 0x7FFFFFFF; signed int32 order of
the keys is the float order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _score_tile(k_ptr, rows, kvalid, qT, w, BQ: tl.constexpr, HP: tl.constexpr,
                DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Scores [BK, BQ] of key rows ``rows [BK]`` (kvalid: rows to read) against qT [128, BQ*HP]."""
    kb = k_ptr + rows.to(tl.int64) * 132
    raw = tl.load(kb[:, None] + tl.arange(0, 128)[None, :], mask=kvalid[:, None], other=0)
    k8 = raw.to(tl.float8e4nv, bitcast=True)
    scale = tl.load((kb + 128).to(tl.pointer_type(tl.float32)), mask=kvalid, other=0.0)
    if DOT_DTYPE == tl.float8e4nv:  # fp8 products (qT: the fp8 query itself)
        acc = tl.dot(k8, qT)  # [BK, BQ * HP] fp32
    else:  # exact: e4m3 values are representable in fp16, bf16 and fp32
        acc = tl.dot(k8.to(DOT_DTYPE), qT, input_precision=PRECISION)
    return _epilogue(acc, w, scale, BQ, HP)


@triton.jit
def _epilogue(acc, w, scale, BQ: tl.constexpr, HP: tl.constexpr):
    """[BK, BQ * HP] products -> [BK, BQ] scores: ReLU, head weights, the sum over each query's
    heads, then the key's scale (a positive power of two: exact after ReLU and the sum)."""
    s = tl.maximum(acc, 0.0) * w[None, :]
    BK: tl.constexpr = acc.shape[0]
    return tl.sum(tl.reshape(s, (BK, BQ, HP)), 2) * scale[:, None]


@triton.jit
def _query_tile(q_ptr, w_ptr, j0, T, HI, stride_qt, stride_qh, stride_wt, BQ: tl.constexpr,
                HP: tl.constexpr):
    """Queries j0 .. j0 + BQ - 1 as the B operand ``Q^T [128, BQ * HP]`` (q's dtype; padded
    heads and queries past T are 0) and their head weights ``[BQ * HP]`` float32."""
    r = tl.arange(0, BQ * HP)
    jr = j0 + r // HP
    hr = r % HP
    cmask = (jr < T) & (hr < HI)
    d = tl.arange(0, 128)
    qT = tl.load(q_ptr + jr.to(tl.int64)[None, :] * stride_qt + hr[None, :] * stride_qh + d[:, None],
                 mask=cmask[None, :], other=0.0)
    w = tl.load(w_ptr + jr.to(tl.int64) * stride_wt + hr, mask=cmask, other=0.0).to(tl.float32)
    return qT, w


@triton.jit
def _prefill_rows(c, pcu, PT, W: tl.constexpr, I: tl.constexpr):
    """The plane rows of key positions ``c`` of a request whose region starts at ``pcu``
    (the gather chunk's remap: interleaves of I keys dealt round-robin to W ranks' regions of PT
    rows)."""
    g = c // I
    return (g % W) * PT + pcu + (g // W) * I + c % I


# Step-varying ints and index pointers are not specialised (bench/jit_variants.py: each new
# "== 1" / "multiple of 16" / 16-byte-alignment class is a compile of seconds on the GPU);
# the output row stride stays specialised and is made a multiple of 16 by the launchers.
@triton.jit(do_not_specialize=["rows_ptr", "len_ptr", "bt_ptr", "stride_rt", "stride_bt", "T",
                               "L", "KEYS_PER_SPLIT"])
def logits_kernel(q_ptr, w_ptr, k_ptr, out_ptr, rows_ptr, len_ptr, bt_ptr,
                  stride_qt, stride_qh, stride_wt, stride_ot, stride_rt, stride_bt,
                  T, HI, L, KEYS_PER_SPLIT, MODE: tl.constexpr, OUT_KEYS: tl.constexpr,
                  BQ: tl.constexpr, HP: tl.constexpr, BK: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr):
    """MODE 0 explicit packed rows, 2 decode over the block-planar paged cache (one query per
    program: BQ 1)."""
    split = tl.program_id(0)
    j0 = tl.program_id(1) * BQ
    qT, w = _query_tile(q_ptr, w_ptr, j0, T, HI, stride_qt, stride_qh, stride_wt, BQ, HP)
    qT = qT.to(DOT_DTYPE)
    jq = j0 + tl.arange(0, BQ)
    qmask = jq < T
    if MODE == 0:
        n = tl.where(qmask, L, 0)
    else:
        n = tl.load(len_ptr + jq, mask=qmask, other=0).to(tl.int32)
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(tl.max(n), lo + KEYS_PER_SPLIT)
    optr = out_ptr + jq.to(tl.int64)[None, :] * stride_ot
    if MODE == 0:
        for kb in range(lo, hi, BK):
            c = kb + tl.arange(0, BK)
            rows = tl.load(rows_ptr + j0.to(tl.int64) * stride_rt + c, mask=c < L, other=-1)
            kvalid = rows >= 0
            s = _score_tile(k_ptr, tl.where(kvalid, rows, 0), kvalid, qT, w, BQ, HP, DOT_DTYPE,
                            PRECISION)
            _store(optr + c[:, None], s, kvalid[:, None] & qmask[None, :],
                   (c < L)[:, None] & qmask[None, :], OUT_KEYS)
    else:  # MODE 2: the paged cache, block-planar, BLOCK (constexpr) tokens a block
        for kb in range(lo, hi, BK):
            c = kb + tl.arange(0, BK)
            kvalid = c < hi
            # past the row's keys: block 0 (a real block; those scores are never stored).
            # BLOCK a constexpr: value rows provably 128-byte aligned, loaded 16 bytes a time
            blk = tl.load(bt_ptr + j0.to(tl.int64) * stride_bt + c // BLOCK, mask=kvalid,
                          other=0)
            base = blk.to(tl.int64) * (BLOCK * 132)
            o = c % BLOCK
            s = _planar_scores(k_ptr + base, k_ptr + base + BLOCK * 128, o, kvalid, qT, w, BQ,
                               HP, DOT_DTYPE, PRECISION, True)
            valid = c[:, None] < n[None, :]
            _store(optr + c[:, None], s, valid, valid, OUT_KEYS)


@triton.jit
def _store(ptrs, s, valid, mask, OUT_KEYS: tl.constexpr):
    """Scores (-inf where not valid) or int32 keys (valid entries only) of a [BK, BQ] tile."""
    if OUT_KEYS:
        bits = s.to(tl.int32, bitcast=True)
        tl.store(ptrs, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), mask=valid)
    else:
        tl.store(ptrs, tl.where(valid, s, float("-inf")), mask=mask)


@triton.jit
def _planar_scores(kp_ptr, ks_ptr, rows, kvalid, qT, w, BQ: tl.constexpr, HP: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """Scores [BK, BQ] of key rows ``rows [BK]`` of the planes against qT [128, BQ*HP]
    (kp_ptr, ks_ptr: one pointer, or one per key; SCALE_BYTES: ks_ptr a byte pointer)."""
    d = tl.arange(0, 128)
    # rows past the block's keys are clamped to row 0 by the caller: a real row, whose scores
    # are never stored (each key's scores depend on its own row only), so no mask
    k = tl.load((kp_ptr + rows.to(tl.int64) * 128)[:, None] + d[None, :])
    if SCALE_BYTES:
        scale = tl.load((ks_ptr + rows * 4).to(tl.pointer_type(tl.float32)), mask=kvalid,
                        other=0.0)
    else:
        scale = tl.load(ks_ptr + rows, mask=kvalid, other=0.0)
    return _tile_scores(k, scale, qT, w, BQ, HP, DOT_DTYPE, PRECISION)


@triton.jit
def _tile_scores(k, scale, qT, w, BQ: tl.constexpr, HP: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Scores [BK, BQ] of a key tile ``k [BK, 128]`` (fp8, or the interpreter's bytes of fp8)
    with its scales ``[BK]`` against qT [128, BQ*HP]."""
    if k.dtype == tl.uint8:  # the interpreter's planes: bytes
        k = k.to(tl.float8e4nv, bitcast=True)
    if DOT_DTYPE == tl.float8e4nv:
        acc = tl.dot(k, qT)  # [BK, BQ * HP] fp32
    else:
        acc = tl.dot(k.to(DOT_DTYPE), qT.to(DOT_DTYPE), input_precision=PRECISION)
    return _epilogue(acc, w, scale, BQ, HP)


# Over 50 lines on purpose: one program's loop over key tiles (shared or per-query tiles, causal
# stop, fused epilogue) is the kernel. Step-varying ints and index pointers are not specialised.
@triton.jit(do_not_specialize=["len_ptr", "pcu_ptr", "T", "L", "PT", "KEYS_PER_SPLIT"])
def logits_planar_kernel(q_ptr, w_ptr, kp_ptr, ks_ptr, out_ptr, len_ptr, pcu_ptr,
                         stride_qt, stride_qh, stride_wt, stride_ot, T, HI, L, PT, KEYS_PER_SPLIT,
                         W: tl.constexpr, I: tl.constexpr, BQ: tl.constexpr, HP: tl.constexpr,
                         BK: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                         TMA: tl.constexpr):
    """kp_ptr: the value plane, or (TMA) a tensor descriptor over it with boxes of [BK, 128]."""
    split = tl.program_id(0)
    # the last query blocks first: a prefill's later queries have the most keys, and the
    # longest programs starting first leave no long tail (longest processing time first)
    j0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BQ
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
    # one key tile serves the block's queries when they are one request's; a request boundary
    # inside the block (rare) takes one pass per query. One loop either way: a second loop
    # would allocate its own pipeline buffers, and the doubled shared memory kept the kernel
    # at one program per SM (no overlap of one program's products with another's epilogue)
    passes = tl.where(shared, 1, BQ)
    for qi in range(passes):
        pq = tl.where(shared, p_lo, tl.sum(tl.where(tl.arange(0, BQ) == qi, pcu, 0)))
        jb = tl.arange(0, BQ)
        mine = (jb == qi) | (jb >= tl.where(shared, 0, BQ))  # the pass's queries: all if shared
        for kb in range(lo, hi, BK):
            c = kb + tl.arange(0, BK)
            kvalid = c < hi
            if TMA:  # the tile is one run of rows from its first; rows past the plane read 0
                r0 = _prefill_rows(kb, pq, PT, W, I)
                k = kp_ptr.load([r0.to(tl.int32), 0])
                scale = tl.load(ks_ptr + r0 + tl.arange(0, BK), mask=kvalid, other=0.0)
                s = _tile_scores(k, scale, qT, w, BQ, HP, DOT_DTYPE, PRECISION)
            else:
                rows = tl.where(kvalid, _prefill_rows(c, pq, PT, W, I), 0)
                s = _planar_scores(kp_ptr, ks_ptr, rows, kvalid, qT, w, BQ, HP, DOT_DTYPE,
                                   PRECISION, False)
            valid = (c[:, None] < n[None, :]) & mine[None, :]
            _store(optr + c[:, None], s, valid, valid, True)


@triton.jit(do_not_specialize=["T"])
def tile_offsets_kernel(len_ptr, cum_ptr, T, BK: tl.constexpr, CHUNK: tl.constexpr):
    """One program: ``cum[0] = 0``, ``cum[r + 1]`` = the BK-key tiles of rows 0 .. r
    (``cdiv(len, BK)`` each), int32."""
    carry = tl.sum(tl.zeros([CHUNK], tl.int32), 0)
    tl.store(cum_ptr, carry)
    for c0 in range(0, T, CHUNK):
        r = c0 + tl.arange(0, CHUNK)
        tiles = (tl.load(len_ptr + r, mask=r < T, other=0).to(tl.int32) + BK - 1) // BK
        tl.store(cum_ptr + 1 + r, tl.cumsum(tiles, 0) + carry, mask=r < T)
        carry += tl.sum(tiles, 0)


# Over 50 lines on purpose, as the kernels above: the balanced split and the key loop are one.
@triton.jit(do_not_specialize=["len_ptr", "bt_ptr", "cum_ptr", "stride_bt", "T"])
def logits_balanced_kernel(q_ptr, w_ptr, k_ptr, out_ptr, len_ptr, bt_ptr, cum_ptr,
                           stride_qt, stride_qh, stride_wt, stride_ot, stride_bt, T, HI,
                           HP: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr,
                           PRECISION: tl.constexpr, BLOCK: tl.constexpr):
    """Decode keys over the block-planar paged cache, the batch's key tiles split evenly over
    the programs whatever the rows' lengths: program p of P takes tiles
    [p * total / P, (p + 1) * total / P) of the rows' tiles laid end to end (``cum``: their
    prefix sums), a row at a time (its query loaded once per row). int32 keys, as MODE 2 of
    ``logits_kernel`` writes them."""
    p = tl.program_id(0).to(tl.int64)
    total = tl.load(cum_ptr + T).to(tl.int64)  # tiles (int32: < 2**31); their product, int64
    g = ((p * total) // tl.num_programs(0)).to(tl.int32)
    g_end = (((p + 1) * total) // tl.num_programs(0)).to(tl.int32)
    lo = tl.program_id(0) * 0  # the last row r with cum[r] <= g: bisection over [0, T)
    hi = lo + T
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = tl.load(cum_ptr + mid) <= g
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    r = lo
    while g < g_end:
        c_r = tl.load(cum_ptr + r)
        stop = tl.minimum(g_end, tl.load(cum_ptr + r + 1))
        if stop > g:  # rows without keys have no tiles: passed over
            qT, w = _query_tile(q_ptr, w_ptr, r, T, HI, stride_qt, stride_qh, stride_wt, 1, HP)
            qT = qT.to(DOT_DTYPE)
            n = tl.load(len_ptr + r).to(tl.int32)
            optr = out_ptr + r.to(tl.int64) * stride_ot
            bt_row = bt_ptr + r.to(tl.int64) * stride_bt
            for kb in range((g - c_r) * BK, (stop - c_r) * BK, BK):
                c = kb + tl.arange(0, BK)
                kvalid = c < n
                # past the row's keys: block 0 (a real block; those scores are never stored)
                blk = tl.load(bt_row + c // BLOCK, mask=kvalid, other=0)
                base = blk.to(tl.int64) * (BLOCK * 132)
                s = _planar_scores(k_ptr + base, k_ptr + base + BLOCK * 128, c % BLOCK, kvalid,
                                   qT, w, 1, HP, DOT_DTYPE, PRECISION, True)
                _store(optr + c[:, None], s, kvalid[:, None], kvalid[:, None], True)
            g = stop
        r += 1
