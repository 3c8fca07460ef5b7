"""Jitted bodies of the index maps (launched by ``index.py``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["pcu_ptr", "PT"])
def remap_kernel(ids_ptr, pcu_ptr, out_ptr, K, stride_i, stride_o, PT, W, I, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < K
    t = tl.load(ids_ptr + j.to(tl.int64) * stride_i + offs, mask=m, other=-1).to(tl.int64)
    pcu = tl.load(pcu_ptr + j).to(tl.int64)
    g = t // I
    rows = (g % W) * PT + pcu + (g // W) * I + t % I
    tl.store(out_ptr + j.to(tl.int64) * stride_o + offs, tl.where(t >= 0, rows, -1).to(tl.int32), mask=m)


@triton.jit(do_not_specialize=["bt_ptr", "stride_b"])
def filter_kernel(ids_ptr, bt_ptr, out_ptr, K, stride_i, stride_b, stride_o, B, W, rank, I,
            BLOCK: tl.constexpr):
    j = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < K
    t = tl.load(ids_ptr + j.to(tl.int64) * stride_i + offs, mask=m, other=-1).to(tl.int64)
    g = t // I
    mine = (t >= 0) & ((g % W) == rank)
    local = tl.where(mine, (g // W) * I + t % I, 0)
    blk = tl.load(bt_ptr + j.to(tl.int64) * stride_b + local // B, mask=m & mine, other=0).to(tl.int64)
    slot = tl.where(mine, blk * B + local % B, -1)
    tl.store(out_ptr + j.to(tl.int64) * stride_o + offs, slot.to(tl.int32), mask=m)


@triton.jit(do_not_specialize=["bt_ptr", "stride_b"])
def compact_kernel(ids_ptr, bt_ptr, main_ptr, over_ptr, count_ptr, K, WIDTH, stride_i,
                   stride_b, stride_m, stride_v, B, W, rank, I, BLOCK: tl.constexpr):
    """One (row, block of K): ``filter_kernel``'s local slots of the block, packed after those
    of the row's earlier blocks (their count: a pass over the row's ids, no table reads), the
    first WIDTH packed positions into ``main``, the rest into ``over``; -1 at the packed
    positions of this block's range past the row's count; block 0 writes the count."""
    j = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    before = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    total = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        t = tl.load(ids_ptr + j * stride_i + offs, mask=offs < K, other=-1).to(tl.int64)
        n = tl.sum(((t >= 0) & (((t // I) % W) == rank)).to(tl.int32), 0)
        total += n
        before += tl.where(k0 < c * BLOCK, n, 0)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    m = offs < K
    t = tl.load(ids_ptr + j * stride_i + offs, mask=m, other=-1).to(tl.int64)
    g = t // I
    mine = (t >= 0) & ((g % W) == rank)
    local = tl.where(mine, (g // W) * I + t % I, 0)
    blk = tl.load(bt_ptr + j * stride_b + local // B, mask=m & mine, other=0).to(tl.int64)
    slot = (blk * B + local % B).to(tl.int32)
    pos = before + tl.cumsum(mine.to(tl.int32), 0) - 1
    tl.store(main_ptr + j * stride_m + pos, slot, mask=mine & (pos < WIDTH))
    tl.store(over_ptr + j * stride_v + (pos - WIDTH), slot, mask=mine & (pos >= WIDTH))
    empty = m & (offs >= total)  # packed positions no slot of the row reaches
    none = tl.full([BLOCK], -1, tl.int32)
    tl.store(main_ptr + j * stride_m + offs, none, mask=empty & (offs < WIDTH))
    tl.store(over_ptr + j * stride_v + (offs - WIDTH), none, mask=empty & (offs >= WIDTH))
    if c == 0:
        tl.store(count_ptr + j, total)
