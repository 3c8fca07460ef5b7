"""Triton merges (docs/design.md §3.6): the LSE merge of partial attention results (contract:
``reference.lse_merge``), the cross-rank decode top-k merge of sorted candidate lists
(``reference.merge_topk_candidates``) and a rank's packed share of it
(``reference.merge_local_slots``).

One program per (token, block of heads): reads the R partial lse values and R x 512 outputs once,
writes the merged output and lse. A row whose parts are all -inf ends as (0, -inf), never NaN.
"""

from __future__ import annotations

import torch
import triton

from ..reference.indexer import candidate_lists
from .merge_jit import (
    lse_merge_kernel,
    lse_scale_kernel,
    merge_candidates_kernel,
    merge_local_kernel,
)


def lse_merge_into(out_parts, lse_parts, out, lse) -> None:
    """Merge ``out_parts [R, T, H, 512]`` / ``lse_parts [R, T, H]`` into ``out [T, H, 512]`` and
    ``lse [T, H]`` float32 (preallocated, contiguous)."""
    R, T, H, DV = out_parts.shape
    out_parts, lse_parts = out_parts.contiguous(), lse_parts.contiguous().float()
    assert out.is_contiguous() and lse.is_contiguous()
    block_rows = 4
    grid = (triton.cdiv(T * H, block_rows),)
    lse_merge_kernel[grid](out_parts, lse_parts, out, lse, R, T * H, T * H * DV, T * H,
                     BLOCK_R=max(2, triton.next_power_of_2(R)), BLOCK_ROWS=block_rows, DV=DV,
                     num_warps=4)


def lse_merge(out_parts, lse_parts):
    """Triton ``lse_merge``: returns ``(out [T, H, 512] out_parts.dtype, lse [T, H] float32)``."""
    _, T, H, DV = out_parts.shape
    out = torch.empty(T, H, DV, dtype=out_parts.dtype, device=out_parts.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=out_parts.device)
    lse_merge_into(out_parts, lse_parts, out, lse)
    return out, lse


def merge_topk_candidates(scores: torch.Tensor, key_ids: torch.Tensor, topk: int,
                          num_lists: int) -> torch.Tensor:
    """Triton ``merge_topk_candidates`` (contract: ``reference.merge_topk_candidates``): a merge
    of the ``num_lists`` sorted candidate lists of each row, by rank (one binary search per
    candidate and list), instead of sorting ``[T, num_lists * topk]``. Relies on each list being
    in the reference order with NO_KEY pads last, as the decode indexers return them. The lists
    are read in place through their strides (``[T, num_lists, topk]`` views with unit last
    stride, e.g. of the all-gather's packed buffer): no copy."""
    scores, key_ids = (candidate_lists(x, topk, num_lists) for x in (scores, key_ids))
    T = key_ids.shape[0]
    out = torch.empty((T, topk), dtype=torch.int32, device=key_ids.device)
    if T == 0 or topk == 0:
        return out
    if scores.dtype != torch.float32 or scores.stride(2) != 1:
        scores = scores.float().contiguous()
    if key_ids.stride(2) != 1:
        key_ids = key_ids.contiguous()
    block = min(256, triton.next_power_of_2(topk))
    grid = (T, num_lists, triton.cdiv(topk, block))
    merge_candidates_kernel[grid](scores, key_ids, out, scores.stride(0), scores.stride(1),
                                  key_ids.stride(0), key_ids.stride(1), out.stride(0), K=topk,
                                  W=num_lists, BLOCK=block, STEPS=max(1, topk.bit_length()),
                                  num_warps=4)
    return out


def merge_local_slots(scores: torch.Tensor, key_ids: torch.Tensor, topk: int, num_lists: int,
                      dcp_rank: int, block_table: torch.Tensor, block_size: int,
                      interleave: int, width: int):
    """Triton ``merge_local_slots`` (contract: the reference's): only list ``dcp_rank`` is
    ranked against the others (1 / W of ``merge_topk_candidates``' searches, no merged list),
    and its kept candidates' slots are written where they land, so no compaction pass follows.
    The lists are read in place, as ``merge_topk_candidates`` reads them."""
    scores, key_ids = (candidate_lists(x, topk, num_lists) for x in (scores, key_ids))
    T = key_ids.shape[0]
    dev = key_ids.device
    main = torch.empty(T, width, dtype=torch.int32, device=dev)
    over = torch.empty(T, topk - width, dtype=torch.int32, device=dev)
    count = torch.zeros(T, dtype=torch.int32, device=dev)
    if T == 0 or topk == 0:
        return main, over, count
    if scores.dtype != torch.float32 or scores.stride(2) != 1:
        scores = scores.float().contiguous()
    if key_ids.stride(2) != 1:
        key_ids = key_ids.contiguous()
    bt = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    block = min(256, triton.next_power_of_2(topk))
    merge_local_kernel[(T, triton.cdiv(topk, block))](
        scores, key_ids, bt, main, over, count, scores.stride(0), scores.stride(1),
        key_ids.stride(0), key_ids.stride(1), bt.stride(0), main.stride(0),
        max(1, over.stride(0)), topk, width, block_size, interleave, W=num_lists, RANK=dcp_rank,
        BLOCK=block, STEPS=max(1, topk.bit_length()), num_warps=4)
    return main, over, count


def lse_scale(out_part: torch.Tensor, lse_all: torch.Tensor, rank: int) -> torch.Tensor:
    """Triton ``lse_scale`` (contract: ``reference.lse_scale``): the merge weights and the scaled
    output in one pass over ``out_part`` (no float32 copy of it)."""
    nd, H, DV = out_part.shape
    W = lse_all.shape[0]
    out_part = out_part.contiguous()
    lse_all = lse_all.float().reshape(W, nd * H).contiguous()
    out = torch.empty_like(out_part)
    if nd * H == 0:
        return out
    block_rows = 4
    lse_scale_kernel[(triton.cdiv(nd * H, block_rows),)](
        out_part, lse_all, out, nd * H, rank, lse_all.stride(0), W=W,
        BLOCK_W=max(2, triton.next_power_of_2(W)), BLOCK_ROWS=block_rows, DV=DV, num_warps=4)
    return out
