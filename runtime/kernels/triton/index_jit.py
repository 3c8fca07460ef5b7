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
