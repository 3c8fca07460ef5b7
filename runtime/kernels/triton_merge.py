"""Triton LSE merge of partial attention results (DESIGN 3.6); contract: ``reference.lse_merge``.

One program per (token, block of heads): reads the R partial lse values and R x 512 outputs once,
writes the merged output and lse. A row whose parts are all -inf ends as (0, -inf), never NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lse_merge(out_parts, lse_parts, out_ptr, lse_ptr, R, TH,
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
    for i in range(0, R):
        li = tl.load(lse_parts + i * stride_lr + rows, mask=rmask, other=float("-inf"))
        w = tl.exp(li - lse_safe)
        o = tl.load(out_parts + i * stride_or + rows[:, None].to(tl.int64) * DV + d[None, :],
                    mask=rmask[:, None] & (w[:, None] > 0.0), other=0.0)
        acc += w[:, None] * o.to(tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * DV + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None])
    tl.store(lse_ptr + rows, lse_out, mask=rmask)


def lse_merge_into(out_parts, lse_parts, out, lse) -> None:
    """Merge ``out_parts [R, T, H, 512]`` / ``lse_parts [R, T, H]`` into ``out [T, H, 512]`` and
    ``lse [T, H]`` float32 (preallocated, contiguous)."""
    R, T, H, DV = out_parts.shape
    out_parts, lse_parts = out_parts.contiguous(), lse_parts.contiguous().float()
    assert out.is_contiguous() and lse.is_contiguous()
    block_rows = 4
    grid = (triton.cdiv(T * H, block_rows),)
    _lse_merge[grid](out_parts, lse_parts, out, lse, R, T * H, T * H * DV, T * H,
                     BLOCK_R=max(2, triton.next_power_of_2(R)), BLOCK_ROWS=block_rows, DV=DV,
                     num_warps=4)


def lse_merge(out_parts, lse_parts):
    """Triton ``lse_merge``: returns ``(out [T, H, 512] out_parts.dtype, lse [T, H] float32)``."""
    R, T, H, DV = out_parts.shape
    out = torch.empty(T, H, DV, dtype=out_parts.dtype, device=out_parts.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=out_parts.device)
    lse_merge_into(out_parts, lse_parts, out, lse)
    return out, lse
