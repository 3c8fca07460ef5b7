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
