"""Jitted select of the tiled indexer (launchers, reasoning: ``indexer_select.py``).

``select_kernel``: exact top-k of (row, segment) items, persistent programs: a sorted strided
sample gives a threshold, one pass gathers the composites ``key << 32 | (2**32 - 1 - c)`` of the
keys above it and of the first K equal to it (retried with a corrected threshold when the counts
miss), the radix select (histogram passes of BITS bits) is the in-kernel fallback, and a sort of
the CAP candidates (or sorted segments and ranks) orders them (score descending, position
ascending). ``sort_runs_kernel`` / ``rank_runs_kernel``: the split path's sorted runs and their
one-round merge by ranks. ``filter_*_kernel``: the filter path's threshold, counts, gathering
and trim (the order of the launches: ``indexer_select._filter_launch``).

Keys are the logits kernels' order-preserving int32 keys; INT32_MIN (the key of no float we
produce) marks "no key".
"""

from __future__ import annotations

import triton
import triton.language as tl

NO_KEY_BITS = -2147483648  # int32 key "no key"; its unsigned view is 0
NO_COMPOSITE = -9223372036854775808


@triton.jit
def _load_keys(keys_ptr, c, hi, COMPOSITE_IN: tl.constexpr):
    """Chunk of int32 keys (NO_KEY_BITS past hi) and its composites (only for COMPOSITE_IN)."""
    m = c < hi
    if COMPOSITE_IN:
        v = tl.load(keys_ptr + c, mask=m, other=-9223372036854775808)
        key = (v >> 32).to(tl.int32)
    else:
        key = tl.load(keys_ptr + c, mask=m, other=-2147483648)
        v = (key.to(tl.int64) << 32) | (4294967295 - c.to(tl.int64))
    return key, v


@triton.jit
def _digit_histogram(keys_ptr, lo, end, hi, prefix, P: tl.constexpr, HI_SHIFT: tl.constexpr,
                     COMPOSITE_IN: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Histogram of the digit below bit HI_SHIFT over the keys whose higher bits equal prefix."""
    SHIFT: tl.constexpr = HI_SHIFT - BITS if HI_SHIFT > BITS else 0
    WIDTH: tl.constexpr = HI_SHIFT - SHIFT
    hist = tl.zeros((1 << BITS,), tl.int32)
    for c0 in range(lo, end, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        key, _ = _load_keys(keys_ptr, c, hi, COMPOSITE_IN)
        u = key ^ -2147483648  # unsigned order as bits; "no key" -> 0
        valid = u != 0
        if P > 0:
            valid = valid & (((u >> HI_SHIFT) & ((1 << (32 - HI_SHIFT)) - 1)) == prefix)
        hist += tl.histogram((u >> SHIFT) & ((1 << WIDTH) - 1), 1 << BITS, mask=valid)
    return hist


@triton.jit
def _append_digit(prefix, b, HI_SHIFT: tl.constexpr, BITS: tl.constexpr):
    WIDTH: tl.constexpr = BITS if HI_SHIFT > BITS else HI_SHIFT  # noqa: FURB136 (jit code)
    return (prefix << WIDTH) | b


@triton.jit
def _radix_threshold(keys_ptr, lo, hi, K, COMPOSITE_IN: tl.constexpr, BLOCK: tl.constexpr,
                     BITS: tl.constexpr):
    """(threshold key, how many keys equal to it to take) so that the taken keys are the top K.

    Fewer than K valid keys: threshold NO_KEY_BITS and 0 (take every valid key).
    """
    NB: tl.constexpr = 1 << BITS
    NPASS: tl.constexpr = (32 + BITS - 1) // BITS
    bins = tl.arange(0, NB)
    prefix = tl.zeros((), tl.int32)
    krem = K
    take_all = K < 0  # becomes (valid keys <= K) after the first pass
    for p in tl.static_range(NPASS):
        end = tl.where(take_all, lo, hi)  # no more passes once every key is taken
        hist = _digit_histogram(keys_ptr, lo, end, hi, prefix, p, 32 - p * BITS, COMPOSITE_IN,
                                BLOCK, BITS)
        total = tl.sum(hist)
        if p == 0:
            take_all = total <= K
        ge = total - tl.cumsum(hist, 0) + hist  # keys in this digit or above
        b = tl.max(tl.where(ge >= krem, bins, 0))
        krem = krem - tl.sum(tl.where(bins > b, hist, 0))
        prefix = _append_digit(prefix, b, 32 - p * BITS, BITS)
    thr = tl.where(take_all, -2147483648, prefix ^ -2147483648)
    k_eq = tl.where(take_all, 0, krem)
    return thr, k_eq


@triton.jit
def _compact(keys_ptr, dst_ptr, lo, hi, thr, k_eq, COMPOSITE_IN: tl.constexpr,
             BLOCK: tl.constexpr):
    """Writes the composites of keys > thr and the first k_eq keys == thr, in scan order."""
    taken = tl.zeros((), tl.int32)
    eqs = tl.zeros((), tl.int32)
    for c0 in range(lo, hi, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        key, v = _load_keys(keys_ptr, c, hi, COMPOSITE_IN)
        live = key != -2147483648
        eq = (live & (key == thr)).to(tl.int32)
        take = (live & (key > thr)) | ((eq > 0) & (eqs + tl.cumsum(eq, 0) - eq < k_eq))
        ti = take.to(tl.int32)
        tl.store(dst_ptr + taken + tl.cumsum(ti, 0) - ti, v, mask=take)
        taken += tl.sum(ti)
        eqs += tl.sum(eq)
    return taken


@triton.jit
def _bracket_pass(src, gt_buf, eq_buf, lo, hi, thr, K, CAP: tl.constexpr,
                  COMPOSITE_IN: tl.constexpr, BLOCK: tl.constexpr):
    """One scan: composites of keys > thr to gt_buf (first CAP), of the first K keys == thr (in
    scan order, i.e. the lowest positions) to eq_buf. Returns (#>, #==, #valid keys)."""
    n_gt = tl.zeros((), tl.int32)
    n_eq = tl.zeros((), tl.int32)
    n_valid = hi - lo
    if COMPOSITE_IN:
        n_valid = tl.zeros((), tl.int32)
    for c0 in range(lo, hi, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        key, v = _load_keys(src, c, hi, COMPOSITE_IN)
        gt = key > thr  # thr > NO_KEY_BITS: pads and "no key" never count
        eq = key == thr
        packed = gt.to(tl.int32) | (eq.to(tl.int32) << 16)  # one scan for both (BLOCK < 2**16)
        ex = tl.cumsum(packed, 0) - packed
        sg = n_gt + (ex & 65535)
        se = n_eq + (ex >> 16)
        tl.store(gt_buf + sg, v, mask=gt & (sg < CAP))
        tl.store(eq_buf + se, v, mask=eq & (se < K))
        tot = tl.sum(packed, 0)
        n_gt += tot & 65535
        n_eq += tot >> 16
        if COMPOSITE_IN:
            n_valid += tl.sum((key != -2147483648).to(tl.int32), 0)
    return n_gt, n_eq, n_valid


@triton.jit
def _sample_threshold(src, lo, hi, K, MARGIN, COMPOSITE_IN: tl.constexpr, S: tl.constexpr):
    """A strided sample of S keys of [lo, hi), sorted descending, and the key at its threshold
    rank (``_sample_rank``): returns (that threshold key, its sample rank, the sorted sample)."""
    key, idx = _sample_rank(src, lo, hi, K, MARGIN, COMPOSITE_IN, S)
    smp = tl.sort(key, 0, descending=True)
    thr = tl.maximum(tl.max(tl.where(tl.arange(0, S) == idx, smp, -2147483648), 0), -2147483647)
    return thr, idx, smp


@triton.jit
def _sample_rank(src, lo, hi, K, MARGIN, COMPOSITE_IN: tl.constexpr, S: tl.constexpr):
    """A strided sample of S keys of [lo, hi) (unsorted) and the 0-based threshold rank in it,
    ``m + MARGIN * sqrt(m)`` (m = K * S / n: where the K-th key is expected)."""
    n = hi - lo
    pos = lo + ((tl.arange(0, S).to(tl.int64) * n) // S).to(tl.int32)
    key, _ = _load_keys(src, pos, hi, COMPOSITE_IN)
    m = (K * 1.0) * S / (n * 1.0)
    return key, tl.minimum(tl.maximum(m + MARGIN * tl.sqrt(m), -1.0).to(tl.int32) + 1, S - 1)


@triton.jit
def _bracket_select(src, gt_buf, eq_buf, lo, hi, K, MARGIN, COMPOSITE_IN: tl.constexpr,
                    CAP: tl.constexpr, S: tl.constexpr, ATTEMPTS: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Sampled threshold + one gathering pass (retried with a corrected threshold).

    Returns (ok, n_gt, e): when ok, gt_buf[:n_gt] and eq_buf[:e] hold a superset of the top K
    composites (at most CAP + K of them).
    """
    n = hi - lo
    si = tl.arange(0, S)
    thr = tl.zeros((), tl.int32) - 2147483647  # below every real key: take them all
    idx = tl.zeros((), tl.int32) - 1
    smp = tl.zeros((S,), tl.int32)
    if n > CAP:
        thr, idx, smp = _sample_threshold(src, lo, hi, K, MARGIN, COMPOSITE_IN, S)
    ok = tl.zeros((), tl.int32)
    n_gt = tl.zeros((), tl.int32)
    n_eq = tl.zeros((), tl.int32)
    for _a in tl.static_range(ATTEMPTS):
        if ok == 0:
            n_gt, n_eq, n_valid = _bracket_pass(src, gt_buf, eq_buf, lo, hi, thr, K, CAP,
                                                COMPOSITE_IN, BLOCK)
            over = n_gt > CAP
            ok = (~over & (n_gt + n_eq >= tl.minimum(K, n_valid))).to(tl.int32)
            # retry at the sample rank where the observed density puts (K + CAP) / 2 keys
            dens = tl.maximum(tl.where(over, n_gt, n_gt + n_eq), 1)
            new = ((idx + 1).to(tl.int64) * ((K + CAP) // 2) // dens).to(tl.int32) - 1
            new = tl.where(over, tl.minimum(new, idx - 1), tl.maximum(new, idx + 1))
            idx = tl.minimum(tl.maximum(new, 0), S - 1)
            thr = tl.maximum(tl.max(tl.where(si == idx, smp, -2147483648), 0), -2147483647)
    e = tl.where(n_gt < K, tl.minimum(K - n_gt, n_eq), 0)
    return ok, n_gt, e


@triton.jit
def _merge_ranks(buf, v, CAP: tl.constexpr, SEGS: tl.constexpr, LOG_SEG: tl.constexpr,
                 LOG_SEGS: tl.constexpr):
    """The sorted order of the CAP composites v without one sort of CAP: SEGS segments are sorted
    (descending) into buf, then LOG_SEGS rounds merge runs pairwise in place: an element's place
    in the merged run is its index in its run plus the count of elements ahead of it in the
    partner run (a binary search; the left run's elements go first among equals, so the NO_COMPOSITE
    pads get distinct places too). Returns (values, their places 0 .. CAP - 1, each once)."""
    SEG: tl.constexpr = CAP // SEGS
    v = tl.sort(tl.reshape(v, (SEGS, SEG)), 1, descending=True)
    pos = tl.arange(0, SEGS)[:, None] * SEG + tl.arange(0, SEG)[None, :]
    tl.store(buf + pos, v)
    for lvl in tl.static_range(LOG_SEGS):  # runs of SEG << lvl merge into runs twice as long
        tl.debug_barrier()  # the runs, read back by other threads below
        r = pos // (SEG << lvl)
        left = (r % 2) == 0
        partner = buf + (r ^ 1) * (SEG << lvl)
        cnt = tl.zeros((SEGS, SEG), tl.int32)
        for b in tl.static_range(LOG_SEG + lvl):  # probe steps run / 2, run / 4, ..., 1
            a = tl.load(partner + cnt + ((SEG << lvl) >> (b + 1)) - 1)
            cnt += tl.where(left, a > v, a >= v).to(tl.int32) * ((SEG << lvl) >> (b + 1))
        a = tl.load(partner + cnt)  # elements ahead of v: a prefix of the partner run
        cnt += tl.where(left, a > v, a >= v).to(tl.int32)
        pos = pos + cnt - (r % 2) * (SEG << lvl)
        tl.debug_barrier()  # every thread has read the runs before they are rewritten
        tl.store(buf + pos, v)
    return v, pos


@triton.jit
def _keep_top(v, n_live, K, dst, CAP: tl.constexpr):
    """Writes to dst[0 : min(K, n_live)], in v's order, the top K of the first n_live composites
    of v (in position order among equal keys, as the gathering leaves them): the keys above the
    K-th largest key t, then the first of those equal to t. t by bisection on the int32 key:
    the largest t with at least K keys >= t (at most 32 halvings of the live keys' range)."""
    slot = tl.arange(0, CAP)
    live = slot < n_live
    key = (v >> 32).to(tl.int32)
    lo = tl.min(tl.where(live, key, 2147483647), 0).to(tl.int64)
    if n_live > K:  # else every live composite is kept (t = the smallest key)
        k64 = key.to(tl.int64)
        hi = tl.max(tl.where(live, key, -2147483648), 0).to(tl.int64) + 1
        for _ in tl.static_range(32):  # #(key >= lo) >= K > #(key >= hi)
            if hi - lo > 1:
                mid = lo + ((hi - lo) >> 1)
                big = tl.sum((live & (k64 >= mid)).to(tl.int32), 0) >= K
                lo = tl.where(big, mid, lo)
                hi = tl.where(big, hi, mid)
    t = lo.to(tl.int32)
    above = live & (key > t)
    eq = (live & (key == t)).to(tl.int32)
    k_eq = K - tl.sum(above.to(tl.int32), 0)
    take = above | ((eq > 0) & (tl.cumsum(eq, 0) - eq < k_eq))
    ti = take.to(tl.int32)
    tl.store(dst + tl.cumsum(ti, 0) - ti, v, mask=take)


@triton.jit
def _emit(v, row, slot, total, dst, s_ptr, i_ptr, stride_or, K, RANK, W: tl.constexpr,
          I: tl.constexpr, FINAL: tl.constexpr, DECODE_IDS: tl.constexpr, KP: tl.constexpr,
          LIVE_ONLY: tl.constexpr):
    """Writes the sorted composites v (the first ``total`` live): scores / ids, or KP composites,
    at ``slot``. LIVE_ONLY (slots are ranks, the pads may share one): only live entries are
    written, the destination holds its pads already."""
    live = slot < total
    if FINAL:
        key = (v >> 32).to(tl.int32)
        bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
        c = 4294967295 - (v & 4294967295)
        if DECODE_IDS:
            c = (c // I) * (W * I) + RANK * I + c % I
        m = live if LIVE_ONLY else slot < K
        tl.store(s_ptr + row * stride_or + slot,
                 tl.where(live, bits.to(tl.float32, bitcast=True), float("-inf")), mask=m)
        tl.store(i_ptr + row * stride_or + slot, tl.where(live, c, -1).to(tl.int32), mask=m)
    else:
        m = live if LIVE_ONLY else slot < KP
        tl.store(dst + slot, tl.where(live, v, -9223372036854775808), mask=m)


@triton.jit(do_not_specialize=["len_ptr", "skip_ptr", "N", "SEG_LEN", "SEGS", "ITEMS", "K",
                               "RANK"])
def select_kernel(keys_ptr, len_ptr, skip_ptr, buf_ptr, dst_ptr, s_ptr, i_ptr,
                  stride_kr, stride_dr, stride_or, N, SEG_LEN, SEGS, ITEMS, K, RANK, MARGIN,
                  W: tl.constexpr, I: tl.constexpr, HAS_LEN: tl.constexpr, HAS_SKIP: tl.constexpr,
                  COMPOSITE_IN: tl.constexpr,
                  FINAL: tl.constexpr, DECODE_IDS: tl.constexpr, KP: tl.constexpr,
                  CAP: tl.constexpr, S: tl.constexpr, ATTEMPTS: tl.constexpr,
                  BLOCK: tl.constexpr, BITS: tl.constexpr, SORT_SEGS: tl.constexpr,
                  LOG_SEG: tl.constexpr, LOG_SEGS: tl.constexpr, EXACT: tl.constexpr,
                  SORT_SEGS_K: tl.constexpr, LOG_SEG_K: tl.constexpr, LOG_SEGS_K: tl.constexpr):
    """Top-K of keys[row, seg*SEG_LEN : ...] (row length len[row], or N without len_ptr) for the
    items (row, seg) = divmod(item, SEGS) of this persistent program. EXACT: the exact top K of
    the CAP candidates are kept first (``_keep_top``) and only those (KP slots) are ordered.

    Not FINAL: the KP sorted composites go to dst[row, seg*KP : (seg+1)*KP] (pads NO_COMPOSITE).
    FINAL (one segment): scores / ids (NO_KEY pads) go to s / i. Either output holds its pads
    before the launch: empty segments are skipped. buf: this program's scratch,
    CAP + KP composites. HAS_SKIP: the items of rows whose skip flag is set are not processed
    (rows another path has already selected); a program first reads its items' flags, 64 a
    load, and one with nothing to do ends there (the usual case: the filter path selected
    every row, and this launch costs about one load a program).
    """
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    gt_buf = buf_ptr + pid.to(tl.int64) * (CAP + KP)
    eq_buf = gt_buf + CAP
    slot = tl.arange(0, CAP)
    end = ITEMS
    if HAS_SKIP:
        todo = tl.zeros((), tl.int32)
        for j0 in range(pid, ITEMS, 64 * P):
            it = j0 + P * tl.arange(0, 64)
            flag = tl.load(skip_ptr + it // SEGS, mask=it < ITEMS, other=1)
            todo += tl.sum((flag == 0).to(tl.int32), 0)
        end = tl.where(todo > 0, ITEMS, 0)
    for item in range(pid, end, P):
        row = (item // SEGS).to(tl.int64)
        seg = item % SEGS
        n = N
        if HAS_LEN:
            n = tl.minimum(tl.load(len_ptr + row).to(tl.int32), N)
        lo = seg * SEG_LEN
        hi = tl.maximum(tl.minimum(n, lo + SEG_LEN), lo)
        # a segment past the row's end has nothing to select: its outputs hold their pads
        # already (the caller fills them), so it costs one length load (rows shorter than the
        # plan's key width, e.g. a graph's)
        go = (hi > lo).to(tl.int32)
        if HAS_SKIP:
            go = go * (tl.load(skip_ptr + row) == 0).to(tl.int32)
        if go != 0:
            src = keys_ptr + row * stride_kr
            ok, n_gt, e = _bracket_select(src, gt_buf, eq_buf, lo, hi, K, MARGIN, COMPOSITE_IN, CAP,
                                          S, ATTEMPTS, BLOCK)
            if ok == 0:  # the sample missed (adversarial rows) or ATTEMPTS == 0: exact radix select
                thr, k_eq = _radix_threshold(src, lo, hi, K, COMPOSITE_IN, BLOCK, BITS)
                n_gt = _compact(src, gt_buf, lo, hi, thr, k_eq, COMPOSITE_IN, BLOCK)
                e = tl.zeros((), tl.int32)
            tl.debug_barrier()  # the gathering's global writes, read back by other threads below
            v = tl.load(gt_buf + slot, mask=slot < n_gt, other=-9223372036854775808)
            eq = (slot >= n_gt) & (slot < n_gt + e)
            v = tl.where(eq, tl.load(eq_buf + (slot - n_gt), mask=eq, other=0), v)
            total = tl.minimum(K, n_gt + e)
            if EXACT:
                tl.debug_barrier()  # every thread has read the scratch before it is rewritten
                _keep_top(v, n_gt + e, K, gt_buf, CAP)
                tl.debug_barrier()  # the kept composites, read back by other threads below
                kslot = tl.arange(0, KP)
                v = tl.load(gt_buf + kslot, mask=kslot < total, other=-9223372036854775808)
                dst = dst_ptr + row * stride_dr + seg * KP
                if SORT_SEGS_K == 1:
                    v = tl.sort(v, 0, descending=True)
                    _emit(v, row, kslot, total, dst, s_ptr, i_ptr, stride_or, K, RANK, W, I, FINAL,
                          DECODE_IDS, KP, False)
                else:
                    tl.debug_barrier()  # every thread has read the scratch before it is rewritten
                    v, rank = _merge_ranks(gt_buf, v, KP, SORT_SEGS_K, LOG_SEG_K, LOG_SEGS_K)
                    _emit(v, row, rank, total, dst, s_ptr, i_ptr, stride_or, K, RANK, W, I, FINAL,
                          DECODE_IDS, KP, True)
            elif SORT_SEGS == 1:
                v = tl.sort(v, 0, descending=True)
                _emit(v, row, slot, total, dst_ptr + row * stride_dr + seg * KP, s_ptr, i_ptr,
                      stride_or, K, RANK, W, I, FINAL, DECODE_IDS, KP, False)
            else:
                tl.debug_barrier()  # every thread has read the scratch before it is rewritten
                v, rank = _merge_ranks(gt_buf, v, CAP, SORT_SEGS, LOG_SEG, LOG_SEGS)
                _emit(v, row, rank, total, dst_ptr + row * stride_dr + seg * KP, s_ptr, i_ptr,
                      stride_or, K, RANK, W, I, FINAL, DECODE_IDS, KP, True)
            tl.debug_barrier()  # every thread has read the scratch before the next item rewrites it


@triton.jit(do_not_specialize=["len_ptr", "N", "K"])
def sort_runs_kernel(keys_ptr, len_ptr, runs_ptr, s_ptr, i_ptr, stride_kr, stride_rr, stride_or,
                     N, K, HAS_LEN: tl.constexpr, SEG: tl.constexpr, COMPOSITE_IN: tl.constexpr):
    """Program (row, g): the composites of keys[row, g*SEG : (g+1)*SEG] (int32 keys, or
    composites with COMPOSITE_IN), sorted descending, to runs[row, g*SEG : ...]; "no key" and
    columns past the row's length become NO_COMPOSITE; runs wholly past it are left unwritten
    (with HAS_LEN, ``rank_runs_kernel`` reads only the runs below the length). runs_ptr may be
    keys_ptr (sorted in place).
    It also writes the pads (-inf, NO_KEY) of the output slots g*SEG + j*NRUNS*SEG .. below K,
    so the outputs need no fill: ``rank_runs_kernel``, launched after it, overwrites the slots of
    the live composites."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    step = tl.num_programs(1) * SEG
    for s0 in range(g * SEG, K, step):
        o = s0 + tl.arange(0, SEG)
        tl.store(s_ptr + row * stride_or + o, tl.full((SEG,), float("-inf"), tl.float32),
                 mask=o < K)
        tl.store(i_ptr + row * stride_or + o, tl.full((SEG,), -1, tl.int32), mask=o < K)
    n = N
    if HAS_LEN:
        n = tl.minimum(tl.load(len_ptr + row).to(tl.int32), N)
    if g * SEG < n:  # a run past the row's length is not written: rank_runs_kernel skips it
        c = g * SEG + tl.arange(0, SEG)
        key, v = _load_keys(keys_ptr + row * stride_kr, c, n, COMPOSITE_IN)
        v = tl.sort(tl.where(key != -2147483648, v, -9223372036854775808), 0, descending=True)
        tl.debug_barrier()  # in place (runs_ptr == keys_ptr): every thread has read the run
        tl.store(runs_ptr + row * stride_rr + c, v)


@triton.jit(do_not_specialize=["len_ptr", "skip_ptr", "N", "NRUNS", "RUN_KEYS", "K", "RANK"])
def rank_runs_kernel(runs_ptr, len_ptr, skip_ptr, s_ptr, i_ptr, stride_rr, stride_or, N, NRUNS,
                     RUN_KEYS, K, RANK, W: tl.constexpr, I: tl.constexpr, DECODE_IDS: tl.constexpr,
                     HAS_LEN: tl.constexpr, SEG: tl.constexpr, LOG_SEG: tl.constexpr,
                     RUNS: tl.constexpr, CHUNK: tl.constexpr, HAS_SKIP: tl.constexpr,
                     ROW_MAJOR: tl.constexpr):
    """Program (row, g, chunk) of a one-dimensional grid of rows x NRUNS x SEG / CHUNK
    programs (with ROW_MAJOR a row's programs are adjacent, else the rows' programs of one run
    and chunk): the place of each composite of run g (CHUNK of them) among the row's NRUNS <=
    RUNS sorted runs of SEG is the count of composites ahead of it in every run (binary
    searches; runs before g win ties, so the NO_COMPOSITE pads would get distinct places): a
    one-round merge of all runs, whose searches run in parallel. In its own run a live
    composite's count is its index (composites are distinct): that run is not searched. Live
    composites placed before K are written as scores / ids (the outputs hold their pads
    already). HAS_LEN: run t of a row of n = min(len, N) keys holds keys from t*RUN_KEYS on
    (sort_runs_kernel: RUN_KEYS = SEG; a long row's segments: the segment length), so runs
    past n are pads and are not searched. HAS_SKIP: rows whose skip flag is set are left
    alone."""
    pid = tl.program_id(0)
    NCH: tl.constexpr = SEG // CHUNK
    if ROW_MAJOR:
        row = (pid // (NRUNS * NCH)).to(tl.int64)
        g = (pid // NCH) % NRUNS
        ch = pid % NCH
    else:
        R = tl.num_programs(0) // (NRUNS * NCH)
        row = (pid % R).to(tl.int64)
        g = (pid // R) % NRUNS
        ch = pid // (R * NRUNS)
    live_runs = NRUNS
    if HAS_LEN:
        live_runs = tl.minimum((tl.minimum(tl.load(len_ptr + row).to(tl.int32), N) + RUN_KEYS
                                - 1) // RUN_KEYS, NRUNS)
    base = runs_ptr + row * stride_rr
    go = g < live_runs  # runs past the row's end: pads, or (sort_runs_kernel) never written
    if HAS_SKIP:
        go = go & (tl.load(skip_ptr + row) == 0)
    if go:
        v = tl.load(base + g * SEG + ch * CHUNK + tl.arange(0, CHUNK))
        live = v != -9223372036854775808
        if tl.max(live.to(tl.int32), 0) > 0:  # a chunk of pads only: nothing to place
            place = ch * CHUNK + tl.arange(0, CHUNK)  # its index in run g
            for t in tl.static_range(RUNS):  # unrolled: the searches are independent; RUNS is
                if (t < live_runs) & (t != g):  # a bound, so one compile serves every count
                    run = base + t * SEG
                    before = t < g
                    cnt = tl.zeros((CHUNK,), tl.int32)
                    for b in tl.static_range(LOG_SEG):  # probe steps SEG / 2, SEG / 4, ..., 1
                        a = tl.load(run + cnt + ((SEG >> (b + 1)) - 1))
                        cnt += tl.where(before, a >= v, a > v).to(tl.int32) * (SEG >> (b + 1))
                    a = tl.load(run + cnt)
                    place += cnt + tl.where(before, a >= v, a > v).to(tl.int32)
            _emit(v, row, tl.where(live, place, K), K, runs_ptr, s_ptr, i_ptr, stride_or, K,
                  RANK, W, I, True, DECODE_IDS, 1, True)


@triton.jit(do_not_specialize=["len_ptr", "N", "K"])
def filter_threshold_kernel(keys_ptr, len_ptr, thr_ptr, stride_kr, N, K, MARGIN,
                            CAP: tl.constexpr, S: tl.constexpr):
    """Program row of the filter path: the row's sampled threshold to thr[row], the key of a
    strided sample of S keys at the rank ``m + MARGIN * sqrt(m)`` (``_sample_rank``), found by
    bisection rather than by sorting the sample (the same key); rows of at most min(CAP, 2K)
    keys get a threshold below every key (all taken). One program a row, so the sample is
    ranked once, not by every chunk's program."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(len_ptr + row).to(tl.int32), N)
    thr = tl.zeros((), tl.int32) - 2147483647
    if n > tl.minimum(CAP, 2 * K):  # the sorted sample's key at rank idx: its (idx + 1)-th largest
        key, idx = _sample_rank(keys_ptr + row * stride_kr, 0, n, K, MARGIN, False, S)
        thr = tl.maximum(_kth_largest(key, tl.min(key, 0), idx + 1), -2147483647)
    tl.store(thr_ptr + row, thr)


@triton.jit
def _count_chunk(src, n, thr, cnt_ptr, row, chunk, R, C, CH: tl.constexpr):
    """Keys of chunk ``chunk`` (CH of them) of a row of n keys at or above thr to cnt[0, row,
    chunk], live keys to cnt[1, row, chunk] (cnt ``[2, R, C]``)."""
    c = chunk * CH + tl.arange(0, CH)
    key, _ = _load_keys(src, c, n, False)
    tl.store(cnt_ptr + row * C + chunk, tl.sum((key >= thr).to(tl.int32), 0))
    tl.store(cnt_ptr + (R + row) * C + chunk, tl.sum((key != -2147483648).to(tl.int32), 0))


@triton.jit(do_not_specialize=["len_ptr", "N", "C"])
def filter_count_kernel(keys_ptr, len_ptr, thr_ptr, cnt_ptr, stride_kr, N, C,
                        CH: tl.constexpr, G: tl.constexpr = 1):
    """Program (row, p) of the filter path, chunks p*G .. p*G + G - 1 of the row's C chunks
    of CH keys: each chunk's count of keys >= the row's threshold to cnt[0, row, chunk] and
    of live keys to cnt[1, row, chunk]; chunks past the row's end write nothing (the gathering
    reads no count there): a prefill chunk's causal rows are short for most of its launch
    width, and G > 1 makes fewer of those programs."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(len_ptr + row).to(tl.int32), N)
    c0 = tl.program_id(1) * G
    if c0 * CH < n:
        thr = tl.load(thr_ptr + row)
        for chunk in range(c0, tl.minimum(c0 + G, (n + CH - 1) // CH)):
            _count_chunk(keys_ptr + row * stride_kr, n, thr, cnt_ptr, row, chunk,
                         tl.num_programs(0), C, CH)


@triton.jit(do_not_specialize=["len_ptr", "N", "K", "C"])
def filter_scatter_kernel(keys_ptr, len_ptr, thr_ptr, cnt_ptr, cand_ptr, cand_len_ptr, ok_ptr,
                          stride_kr, stride_cr, N, K, C, CAP: tl.constexpr, CH: tl.constexpr,
                          CB: tl.constexpr, G: tl.constexpr = 1):
    """Program (row, p), chunks p*G .. p*G + G - 1 of the row's C chunks of CH keys: the row
    holds its top K in the keys >= its threshold when there are at least min(K, live keys)
    of them and at most CAP (ok); then each chunk's composites of those keys go to
    cand[row, before : ...], ``before`` = the count in the earlier chunks (position order
    kept). Program 0 stores ok[row] and cand_len[row] (the row's count if ok, else 0). CB: a
    power of two >= C. Chunks past the row's end were not counted and gather nothing: their
    programs return at once (program 0 excepted)."""
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * G
    R = tl.num_programs(0)
    n = tl.minimum(tl.load(len_ptr + row).to(tl.int32), N)
    if (c0 == 0) | (c0 * CH < n):
        j = tl.arange(0, CB)
        counted = (j < C) & (j * CH < n)
        ge = tl.load(cnt_ptr + row * C + j, mask=counted, other=0)
        live = tl.load(cnt_ptr + (R + row) * C + j, mask=counted, other=0)
        total = tl.sum(ge, 0)
        ok = (total >= tl.minimum(tl.sum(live, 0), K)) & (total <= CAP)
        if c0 == 0:
            tl.store(ok_ptr + row, ok.to(tl.int32))
            tl.store(cand_len_ptr + row, tl.where(ok, total, 0))
        if ok:
            thr = tl.load(thr_ptr + row)
            before = tl.sum(tl.where(j < c0, ge, 0), 0)
            for chunk in range(c0, tl.minimum(c0 + G, (n + CH - 1) // CH)):
                before = _gather_chunk(keys_ptr + row * stride_kr, cand_ptr + row * stride_cr,
                                       before, n, thr, chunk, CH)


@triton.jit
def _gather_chunk(src, dst, before, n, thr, chunk, CH: tl.constexpr):
    """The composites of chunk ``chunk``'s keys >= thr (of a row of n keys at src) to
    dst[before:], in position order; returns ``before`` plus their count."""
    c = chunk * CH + tl.arange(0, CH)
    key, v = _load_keys(src, c, n, False)
    take = key >= thr
    ti = take.to(tl.int32)
    tl.store(dst + before + tl.cumsum(ti, 0) - ti, v, mask=take)
    return before + tl.sum(ti, 0)


@triton.jit(do_not_specialize=["cand_len_ptr", "K"])
def filter_trim_kernel(cand_ptr, cand_len_ptr, stride_cr, K, CAP: tl.constexpr,
                       BLK: tl.constexpr, THREE_Q: tl.constexpr, RADIX: tl.constexpr = 0):
    """Program row of the filter path, between the gathering and the run sorts: a row with
    more than K candidates (in position order) keeps its exact top K in place, the keys above
    the K-th largest key t, then the first of those equal to t, and its count becomes K; the
    run sorts and ranks then order K composites, not the up to CAP the sampled threshold let
    through. t by bisection on the int32 keys (at most 32 halvings of the live keys' range),
    held as int32 and compacted BLK at a time, so a program is small enough for several a SM
    (``_keep_top`` bisects int64 composites). The bisection covers only the slots a row fills:
    CAP / 2 for a row of at most CAP / 2 candidates (the usual: slots are 1.5x the expected
    count) and, with THREE_Q (CAP >= 64), CAP / 4 + CAP / 8 for one of at most 3 CAP / 8.
    RADIX > 0 (a variant, not timed yet): t by ``_radix_threshold``'s histogram passes of RADIX
    bits over the candidates, read BLK at a time, instead of the bisection."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(cand_len_ptr + row)
    if n > K:
        dst = cand_ptr + row * stride_cr
        if RADIX > 0:
            t, k_eq = _radix_threshold(dst, 0, n, K, True, BLK, RADIX)
        else:
            if THREE_Q and n <= 3 * CAP // 8:
                t, above = _trim_bisect(dst, n, K, CAP // 4, CAP // 8)
            elif n <= CAP // 2:
                t, above = _trim_bisect(dst, n, K, CAP // 2)
            else:
                t, above = _trim_bisect(dst, n, K, CAP)
            k_eq = K - above  # keys equal to t taken, lowest positions
        taken = tl.zeros((), tl.int32)
        eqs = tl.zeros((), tl.int32)
        for b0 in range(0, n, BLK):  # compaction to the left: a block is read whole before
            c = b0 + tl.arange(0, BLK)  # any of it is overwritten (the barrier)
            v = tl.load(dst + c, mask=c < n, other=-9223372036854775808)
            kb = (v >> 32).to(tl.int32)
            eq = (kb == t).to(tl.int32)
            take = (kb > t) | ((eq > 0) & (eqs + tl.cumsum(eq, 0) - eq < k_eq))
            ti = take.to(tl.int32)
            tl.debug_barrier()
            tl.store(dst + taken + tl.cumsum(ti, 0) - ti, v, mask=take)
            taken += tl.sum(ti, 0)
            eqs += tl.sum(eq, 0)
        tl.store(cand_len_ptr + row, K)


@triton.jit
def _trim_bisect(dst, n, K, WIDTH: tl.constexpr, TAIL: tl.constexpr = 0):
    """The K-th largest int32 key t of the n (<= WIDTH + TAIL, > K) candidates at dst and
    #(key > t). TAIL: slots WIDTH .. WIDTH + TAIL - 1 held as a second tensor (so the slots
    bisected need not be a power of two)."""
    slot = tl.arange(0, WIDTH)
    # candidates are keys > NO_KEY_BITS (the threshold is above it), so the pads' key
    # NO_KEY_BITS is below every bisection point: no mask in the counts
    key = (tl.load(dst + slot, mask=slot < n, other=-9223372036854775808) >> 32).to(tl.int32)
    lo = tl.min(tl.where(slot < n, key, 2147483647), 0)
    if TAIL > 0:
        slot2 = WIDTH + tl.arange(0, TAIL)
        key2 = (tl.load(dst + slot2, mask=slot2 < n, other=-9223372036854775808)
                >> 32).to(tl.int32)
        lo = tl.minimum(lo, tl.min(tl.where(slot2 < n, key2, 2147483647), 0))
        t = _kth_largest(key, lo, K, key2)
        return t, tl.sum((key > t).to(tl.int32), 0) + tl.sum((key2 > t).to(tl.int32), 0)
    t = _kth_largest(key, lo, K)
    return t, tl.sum((key > t).to(tl.int32), 0)


@triton.jit
def _kth_largest(key, lo, R, key2=None):
    """The R-th largest of the int32 keys: the largest t with #(key >= t) >= R, by bisection
    between lo (#(key >= lo) >= R) and the largest key (at most 32 halvings). key2: more keys
    (a second tensor), or None."""
    lo = lo.to(tl.int64)
    hi = tl.max(key, 0).to(tl.int64) + 1
    if key2 is not None:
        hi = tl.maximum(hi, tl.max(key2, 0).to(tl.int64) + 1)
    for _ in tl.static_range(32):  # #(key >= lo) >= R > #(key >= hi)
        if hi - lo > 1:
            mid = lo + ((hi - lo) >> 1)
            cnt = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), 0)
            if key2 is not None:
                cnt += tl.sum((key2 >= mid.to(tl.int32)).to(tl.int32), 0)
            lo = tl.where(cnt >= R, mid, lo)
            hi = tl.where(cnt >= R, hi, mid)
    return lo.to(tl.int32)
