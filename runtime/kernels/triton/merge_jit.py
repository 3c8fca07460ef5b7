"""Jitted body of the LSE merge (launched by ``merge.py``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["R", "TH"])
def lse_merge_kernel(out_parts, lse_parts, out_ptr, lse_ptr, R, TH,
               stride_or, stride_lr, BLOCK_R: tl.constexpr, BLOCK_ROWS: tl.constexpr,
               DV: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # flat (t, h)
    rmask = rows < TH
    r = tl.arange(0, BLOCK_R)
    lse = tl.load(lse_parts + r[:, None] * stride_lr + rows[None, :],
                  mask=(r[:, None] < R) & rmask[None, :], other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse - m_safe[None, :]), 0)
    lse_out = tl.where(total > 0.0, m_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    lse_safe = tl.where(lse_out == float("-inf"), 0.0, lse_out)
    d = tl.arange(0, DV)
    acc = tl.zeros((BLOCK_ROWS, DV), tl.float32)
    for i in range(R):
        li = tl.load(lse_parts + i * stride_lr + rows, mask=rmask, other=float("-inf"))
        w = tl.exp(li - lse_safe)
        o = tl.load(out_parts + i * stride_or + rows[:, None].to(tl.int64) * DV + d[None, :],
                    mask=rmask[:, None] & (w[:, None] > 0.0), other=0.0)
        acc += w[:, None] * o.to(tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * DV + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None])
    tl.store(lse_ptr + rows, lse_out, mask=rmask)


@triton.jit
def _preceding(s_list, i_list, xs, xi, valid, K, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """How many candidates of one list (scores ``s_list``, ids ``i_list``, K long, in the
    reference order, NO_KEY pads last) precede each x = (xs, xi), score descending then id
    ascending: the first position not preceding it, by binary search (``valid`` x only)."""
    lo = tl.zeros((BLOCK,), tl.int32)
    hi = tl.full((BLOCK,), K, tl.int32)
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        ms = tl.load(s_list + mid, mask=active & valid, other=float("-inf"))
        mi = tl.load(i_list + mid, mask=active & valid, other=-1)
        before = (mi >= 0) & ((ms > xs) | ((ms == xs) & (mi < xi)))
        lo = tl.where(active & before, mid + 1, lo)
        hi = tl.where(active & ~before, mid, hi)
    return lo


@triton.jit(do_not_specialize=["stride_sr", "stride_sw", "stride_ir", "stride_iw", "stride_o"])
def merge_candidates_kernel(s_ptr, i_ptr, out_ptr, stride_sr, stride_sw, stride_ir, stride_iw,
                            stride_o, K: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
                            STEPS: tl.constexpr):
    """Program (row, list r, block of positions): each candidate x of list r lands at its rank
    in the union, the number of candidates of all W lists that precede it (score descending,
    then id ascending), found by a binary search in each sorted list (its own gives its
    position). Ranks of distinct (score, id) pairs are distinct: no two writes collide. List q
    of a row starts at ``s_ptr + row * stride_sr + q * stride_sw`` (ids alike), so the lists can
    be read where the all-gather left them. The programs of list 0 also write NO_KEY to the
    slots past the union's valid candidates (each list's count: a binary search for its first
    pad), so the output needs no fill."""
    row = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    p = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    m = p < K
    s_row = s_ptr + row * stride_sr
    i_row = i_ptr + row * stride_ir
    xs = tl.load(s_row + r * stride_sw + p, mask=m, other=float("-inf"))
    xi = tl.load(i_row + r * stride_iw + p, mask=m, other=-1)
    valid = m & (xi >= 0)
    rank = tl.zeros((BLOCK,), tl.int32)
    for q in tl.static_range(W):
        rank += _preceding(s_row + q * stride_sw, i_row + q * stride_iw, xs, xi, valid, K,
                           BLOCK, STEPS)
    tl.store(out_ptr + row * stride_o + rank, xi.to(tl.int32), mask=valid & (rank < K))
    if r == 0:
        total = tl.zeros((), tl.int32)
        for q in tl.static_range(W):
            first = tl.zeros((), tl.int32)
            last = tl.full((), K, tl.int32)
            for _ in tl.static_range(STEPS):  # first pad of list q (pads are last)
                on = first < last
                half = (first + last) // 2
                live = tl.load(i_row + q * stride_iw + half, mask=on, other=-1) >= 0
                first = tl.where(on & live, half + 1, first)
                last = tl.where(on & ~live, half, last)
            total += first
        tl.store(out_ptr + row * stride_o + p, tl.full((BLOCK,), -1, tl.int32),
                 mask=m & (p >= total))


@triton.jit(do_not_specialize=["bt_ptr", "stride_b"])
def merge_local_kernel(s_ptr, i_ptr, bt_ptr, main_ptr, over_ptr, count_ptr, stride_sr, stride_sw,
                       stride_ir, stride_iw, stride_b, stride_m, stride_v, K, WIDTH, B, I,
                       W: tl.constexpr, RANK: tl.constexpr, BLOCK: tl.constexpr,
                       STEPS: tl.constexpr):
    """Program (row, block of positions of list RANK, this rank's own candidates): a candidate
    is in the merged top-K when its rank among all W lists' candidates (its position plus a
    binary search in each other list, as ``merge_candidates_kernel`` finds it) is below K.
    Those are a prefix of the list (ranks rise along it, pads are last), so a kept candidate's
    packed position is its own: its local slot goes to ``main`` (positions < WIDTH) or
    ``over``, -1 to every other position; each program adds its kept count to ``count``
    (zeroed by the caller)."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = p < K
    s_row = s_ptr + row * stride_sr
    i_row = i_ptr + row * stride_ir
    xs = tl.load(s_row + RANK * stride_sw + p, mask=m, other=float("-inf"))
    xi = tl.load(i_row + RANK * stride_iw + p, mask=m, other=-1)
    rank = p.to(tl.int32)
    valid = m & (xi >= 0)
    for q in tl.static_range(W):
        if q != RANK:
            rank += _preceding(s_row + q * stride_sw, i_row + q * stride_iw, xs, xi, valid, K,
                               BLOCK, STEPS)
    t = xi.to(tl.int64)
    g = t // I
    keep = valid & (rank < K) & ((g % W) == RANK)
    local = tl.where(keep, (g // W) * I + t % I, 0)
    blk = tl.load(bt_ptr + row * stride_b + local // B, mask=keep, other=0).to(tl.int64)
    slot = tl.where(keep, blk * B + local % B, -1).to(tl.int32)
    tl.store(main_ptr + row * stride_m + p, slot, mask=m & (p < WIDTH))
    tl.store(over_ptr + row * stride_v + (p - WIDTH), slot, mask=m & (p >= WIDTH))
    tl.atomic_add(count_ptr + row, tl.sum(keep.to(tl.int32), 0))


@triton.jit(do_not_specialize=["TH", "RANK", "stride_lw"])
def lse_scale_kernel(o_ptr, lse_ptr, out_ptr, TH, RANK, stride_lw,
                     W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                     DV: tl.constexpr):
    """Rows (t, h) of ``o [nd * H, DV]``: times ``exp(lse[RANK] - logsumexp_w lse[w])`` (0 where
    this rank or every rank has no key), in one pass over o."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = rows < TH
    w = tl.arange(0, BLOCK_W)
    lse = tl.load(lse_ptr + w[:, None] * stride_lw + rows[None, :],
                  mask=(w[:, None] < W) & rmask[None, :], other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(lse - m_safe[None, :]), 0)
    total_safe = tl.where(s > 0.0, m_safe + tl.log(tl.where(s > 0.0, s, 1.0)), 0.0)
    mine = tl.load(lse_ptr + RANK * stride_lw + rows, mask=rmask, other=float("-inf"))
    weight = tl.exp(mine - total_safe)
    d = tl.arange(0, DV)
    offs = rows[:, None].to(tl.int64) * DV + d[None, :]
    o = tl.load(o_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (o * weight[:, None]).to(out_ptr.dtype.element_ty),
             mask=rmask[:, None])
