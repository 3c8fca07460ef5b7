"""Triton LSE merge of partial attention results (docs/design.md §Decode rows: LSE merge and top-k merge); contract: ``reference.lse_merge``.

One program per (token, block of heads): reads the R partial lse values and R x 512 outputs once,
writes the merged output and lse. A row whose parts are all -inf ends as (0, -inf), never NaN.
"""

from __future__ import annotations

import torch
import triton

from .merge_jit import lse_merge_kernel


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
