"""Jitted body of the FlashMLA decode output's conversion (launched by ``attention.py``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["R"])
def finish_decode_kernel(out_ptr, lse_ptr, lse_out_ptr, R, H: tl.constexpr, HP: tl.constexpr,
                         DV: tl.constexpr, BLOCK: tl.constexpr):
    """Rows (t, h) of the first H of HP heads, R = T * H of them: lse_out = lse with +inf (no
    key) as -inf, and out[t, h] zeroed on those rows only (a masked store: nothing is written
    where every row has a key, so out is not read or rewritten)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = rows < R
    src = (rows // H).to(tl.int64) * HP + rows % H
    lse = tl.load(lse_ptr + src, mask=m, other=0.0)
    empty = m & (lse == float("inf"))
    tl.store(lse_out_ptr + rows, tl.where(empty, float("-inf"), lse), mask=m)
    if tl.max(empty.to(tl.int32), 0) > 0:
        d = tl.arange(0, DV)
        tl.store(out_ptr + src[:, None] * DV + d[None, :],
                 tl.zeros((BLOCK, DV), out_ptr.dtype.element_ty), mask=empty[:, None])
