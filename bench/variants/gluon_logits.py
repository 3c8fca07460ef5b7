"""Launcher of the Gluon prefill indexer logits (body in ``gluon_logits_jit.py``; sm_90, a Triton
with Gluon, else ImportError): products overlapped with epilogues. Correct but slower on the
H200 than the Triton kernel it would replace (``indexer_logits_jit.logits_planar_kernel``;
bench/RESULTS.md, "The Gluon prefill logits, first run"), so bench/indexer.py --only planar
times it and no default path runs it.
"""

from __future__ import annotations

import triton

from . import gluon_logits_jit as logits_jit

BLOCK_K = 64  # keys per tile: the M of the wgmma products (one warpgroup)
MAX_HEADS = 64  # padded heads (half the N of a product): two tiles of accumulators in registers


def launch(q, weights, kp, ks, out, L: int, lens, pcu, PT: int, W: int, I: int, *,
           stages: int = 4, unroll: int = 4, maxnreg: int = 0) -> None:
    """Prefill int32 keys ``out [T, L]`` (``indexer_tiled._logits_planar``'s contract):
    q ``[T, HI, 128]`` float8_e4m3fn, weights ``[T, HI]`` float32, the key planes ``kp [R, 128]``
    float8_e4m3fn and ``ks [R]`` float32, key_len ``lens [T]``, region starts ``pcu [T]``.
    Two queries a program; ``stages`` key tiles in the ring (>= 3), ``unroll`` tiles an
    iteration of the overlapped loop; ``maxnreg``: registers a thread capped (0: none; 168
    fits three programs a SM, with a 24-byte spill at unroll 2 in an offline compile)."""
    T, HI, _ = q.shape
    hp = max(16, triton.next_power_of_2(HI))
    if hp > MAX_HEADS or stages < 3 or unroll < 1:
        raise ValueError(f"gluon logits: got {HI} heads (padded {hp}), stages {stages}, unroll "
                         f"{unroll}; expected at most {MAX_HEADS} padded heads, stages >= 3, "
                         f"unroll >= 1")
    if T == 0:
        return
    logits_jit.gluon_logits_fwd[(triton.cdiv(T, 2),)](
        q, weights, kp, ks, out, lens, pcu, q.stride(0), q.stride(1), weights.stride(0),
        out.stride(0), T, HI, L, PT, W=W, I=I, HP=hp, BK=BLOCK_K, NS=stages, U=unroll,
        num_warps=4, **({"maxnreg": maxnreg} if maxnreg else {}))
