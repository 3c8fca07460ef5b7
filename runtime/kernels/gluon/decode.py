"""Launcher of the Gluon few-head fp8 decode (bodies in ``decode_jit.py``).

Imported only where a plan chose a Gluon family (``triton/plan.py`` decides, with the numbers
passed here); importing this module fails with ImportError on a Triton without Gluon.
"""

from __future__ import annotations

from . import decode_jit

BLOCK_K = 64  # keys per step: the M of the wgmma products (``triton.plan.GLUON_BLOCK_K``)
_LOG2E = 1.4426950408889634
_KERNELS = {"ring": decode_jit.gluon_decode_fwd_ring, "small": decode_jit.gluon_decode_fwd_small}


def launch(q, kv, indices, out, lse, sm_scale: float, keys_per_split: int, *, variant: str,
           heads_padded: int, num_stages: int, num_warps: int) -> None:
    """Fill ``out [splits, T, H, 512]`` and ``lse [splits, T, H]`` float32 (splits from their
    shape) from ``q [T, H, 576]`` bf16 (H <= 32), ``kv [N, 656]`` uint8 fp8_ds_mla rows and
    ``indices [T, topk]`` int32 rows (NO_KEY = none); ``keys_per_split`` a multiple of
    ``BLOCK_K``; heads_padded: the N of the products (a power of two >= max(H, 16)). variant
    "small" (num_stages unused) or "ring" (num_stages blocks in flight)."""
    if variant not in _KERNELS:
        raise ValueError(f"gluon variant {variant!r}, expected one of {sorted(_KERNELS)}")
    T, H, _ = q.shape
    assert keys_per_split % BLOCK_K == 0 and num_warps in (4, 8) and H <= heads_padded
    splits = out.shape[0]
    _KERNELS[variant][(T, splits)](
        q, kv, indices, out, lse,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        H, indices.shape[1], keys_per_split, sm_scale * _LOG2E,
        HP=heads_padded, NS=num_stages, BK=BLOCK_K, W=num_warps, num_warps=num_warps,
    )
