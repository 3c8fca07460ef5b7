"""Triton index maps (docs/design.md §DCP sharding, §Gather chunks and the deinterleave map): global token ids -> gathered rows, or -> local slots.

Contracts: ``reference.remap_to_gathered`` and ``reference.filter_local_slots``. One program per
(query row, block of K). The attention kernel can also fuse the remap (``remap=`` keyword of
``attention.sparse_mla_attention``), which skips this pass altogether.
"""

from __future__ import annotations

import torch
import triton

from .index_jit import filter_kernel, remap_kernel

_BLOCK = 1024


def remap_to_gathered(token_ids, region_pcu, padded_local_total: int, dcp_size: int, interleave: int):
    """Triton ``remap_to_gathered``: ``[T, K]`` ids -> ``[T, K]`` int32 gathered rows."""
    T, K = token_ids.shape
    ids = token_ids if token_ids.stride(-1) == 1 else token_ids.contiguous()
    out = torch.empty(T, K, dtype=torch.int32, device=ids.device)
    if T and K:
        remap_kernel[(T, triton.cdiv(K, _BLOCK))](ids, region_pcu.contiguous(), out, K, ids.stride(0),
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
        filter_kernel[(T, triton.cdiv(K, _BLOCK))](ids, bt, out, K, ids.stride(0), bt.stride(0),
                                             out.stride(0), block_size, dcp_size, dcp_rank,
                                             interleave, BLOCK=_BLOCK, num_warps=4)
    return out
