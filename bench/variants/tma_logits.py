"""Launcher of the TMA prefill indexer logits (body and why in ``tma_logits_jit.py``): the
contract of ``indexer_tiled._logits_planar``; bench/indexer.py --only planar times it beside the
default kernel, keys checked equal."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import tma_logits_jit as jit

_DOT = {torch.float16: tl.float16, torch.float32: tl.float32}


def launch(q, weights, kp, ks, out, L: int, lens, pcu, PT: int, W: int, I: int, *, bq: int = 2,
           bk: int = 64, warps: int = 4, stages: int = 3, maxnreg: int = 0) -> None:
    """Prefill int32 keys ``out [T, L]`` from the planes (``kp [R, 128]`` fp8, or its bytes in
    the interpreter with a float q holding fp8 values; ``ks [R]`` float32)."""
    T, HI, _ = q.shape
    if W > 1 and I % bk:
        raise ValueError(f"tma logits: got interleave {I} at {W} ranks with {bk}-key tiles; "
                         f"expected one rank or an interleave that is a multiple of the tile")
    if T == 0:
        return
    dot = tl.float8e4nv if q.dtype == torch.float8_e4m3fn else _DOT[q.dtype]
    hp = max(16, triton.next_power_of_2(HI))
    desc = TensorDescriptor.from_tensor(kp, [bk, 128])
    jit.logits_planar_tma_kernel[(1, triton.cdiv(T, bq))](
        q, weights, desc, ks, out, lens, pcu, q.stride(0), q.stride(1), weights.stride(0),
        out.stride(0), T, HI, L, PT, triton.cdiv(L, bk) * bk, W=W, I=I, BQ=bq, HP=hp, BK=bk,
        DOT_DTYPE=dot, PRECISION="ieee" if dot == tl.float32 else "tf32", num_warps=warps,
        num_stages=stages,
        **({"maxnreg": maxnreg} if maxnreg and q.is_cuda and bq * hp <= 128 else {}))
