"""Triton index maps (DESIGN 3.4 / 3.5): global token ids -> gathered rows, or -> local slots.

Contracts: ``reference.remap_to_gathered`` and ``reference.filter_local_slots``. One program per
(query row, block of K). The attention kernel can also fuse the remap (``remap=`` keyword of
``triton_attention.sparse_mla_attention``), which skips this pass altogether.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _remap(ids_ptr, pcu_ptr, out_ptr, K, stride_i, stride_o, PT, W, I, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < K
    t = tl.load(ids_ptr + j.to(tl.int64) * stride_i + offs, mask=m, other=-1).to(tl.int64)
    pcu = tl.load(pcu_ptr + j).to(tl.int64)
    g = t // I
    rows = (g % W) * PT + pcu + (g // W) * I + t % I
    tl.store(out_ptr + j.to(tl.int64) * stride_o + offs, tl.where(t >= 0, rows, -1).to(tl.int32), mask=m)


@triton.jit
def _filter(ids_ptr, bt_ptr, out_ptr, K, stride_i, stride_b, stride_o, B, W, rank, I,
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


def remap_to_gathered(token_ids, region_pcu, padded_local_total: int, dcp_size: int, interleave: int):
    """Triton ``remap_to_gathered``: ``[T, K]`` ids -> ``[T, K]`` int32 gathered rows."""
    T, K = token_ids.shape
    ids = token_ids if token_ids.stride(-1) == 1 else token_ids.contiguous()
    out = torch.empty(T, K, dtype=torch.int32, device=ids.device)
    if T and K:
        _remap[(T, triton.cdiv(K, _BLOCK))](ids, region_pcu.contiguous(), out, K, ids.stride(0),
                                            out.stride(0), padded_local_total, dcp_size, interleave,
                                            BLOCK=_BLOCK, num_warps=4)
    return out


def filter_local_slots(token_ids, block_table, block_size: int, dcp_size: int, dcp_rank: int,
                       interleave: int):
    """Triton ``filter_local_slots``: ``[T, K]`` ids -> ``[T, K]`` int32 local slots or -1."""
    T, K = token_ids.shape
    ids = token_ids if token_ids.stride(-1) == 1 else token_ids.contiguous()
    bt = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    out = torch.empty(T, K, dtype=torch.int32, device=ids.device)
    if T and K:
        _filter[(T, triton.cdiv(K, _BLOCK))](ids, bt, out, K, ids.stride(0), bt.stride(0),
                                             out.stride(0), block_size, dcp_size, dcp_rank,
                                             interleave, BLOCK=_BLOCK, num_warps=4)
    return out
