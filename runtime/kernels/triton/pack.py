"""Triton fp8 packing of new KV / indexer-K tokens into their cache slots (the KV insert's write).

Bit-identical to ``reference.quantize_fp8_ds_mla`` / ``quantize_indexer_k``: the scale exponent
comes from the float32 bits of the group's amax (``reference.fp8_scale_exponent``), values are
scaled by 2**-e in two exact power-of-two steps (no subnormal scale is ever formed in the
multiply), cast to fp8 e4m3 with round-to-nearest-even (integer bit arithmetic, ``fp8_jit.to_e4m3_bits``), RoPE cast to bf16 (RNE).
One program per token; slots < 0 are skipped. Jitted bodies: ``pack_jit.py``.
"""

from __future__ import annotations

import torch
import triton

from ..reference.formats import D_QK, FP8_DS_MLA_BYTES, INDEXER_K_BYTES
from .pack_jit import pack_fp8, quantize_q_fp8, unpack_fp8_ds_mla


def _pack(cache_flat, slots, x, groups: int, has_rope: bool, planar_block: int = 0) -> None:
    assert cache_flat.dtype == torch.uint8 and cache_flat.stride(-1) == 1 and x.stride(-1) == 1
    n = x.shape[0]
    if n == 0:
        return
    pack_fp8[(n,)](x, slots.contiguous(), cache_flat, x.stride(0), cache_flat.stride(0),
                    GROUPS=groups, HAS_ROPE=has_rope, PLANAR_BLOCK=planar_block, num_warps=4)


def pack_fp8_ds_mla_into(cache_flat, slots, kv) -> None:
    """Triton ``pack_fp8_ds_mla_into``: ``kv [n, 576]`` float into ``cache_flat [S, 656]``."""
    if cache_flat.dim() == 3:
        cache_flat = cache_flat.view(-1, FP8_DS_MLA_BYTES)
    _pack(cache_flat, slots, kv, 4, True)


def pack_indexer_k_into(cache, slots, k) -> None:
    """Triton ``pack_indexer_k_into``: ``k [n, 128]`` float into the block-planar ``cache
    [num_blocks, B * 132]`` (B x 128 fp8 values, then B float32 scales, a block)."""
    block = cache.shape[1] // INDEXER_K_BYTES
    assert cache.dim() == 2 and cache.shape[1] == block * INDEXER_K_BYTES, cache.shape
    _pack(cache, slots, k, 1, False, block)


def quantize_fp8_ds_mla(kv):
    """Triton ``quantize_fp8_ds_mla``: ``[n, 576]`` -> ``[n, 656]`` uint8."""
    out = torch.empty(kv.shape[0], FP8_DS_MLA_BYTES, dtype=torch.uint8, device=kv.device)
    pack_fp8_ds_mla_into(out, torch.arange(kv.shape[0], device=kv.device), kv)
    return out


def quantize_indexer_k(k):
    """Triton ``quantize_indexer_k``: ``[n, 128]`` -> ``[n, 132]`` uint8."""
    out = torch.empty(k.shape[0], INDEXER_K_BYTES, dtype=torch.uint8, device=k.device)
    _pack(out, torch.arange(k.shape[0], device=k.device), k, 1, False)
    return out


def quantize_indexer_q(q, weights, dtype=torch.float8_e4m3fn):
    """Triton ``quantize_indexer_q``: ``q [T, Hi, 128]`` float, ``weights [T, Hi]`` ->
    ``(q8 [T, Hi, 128], weights * scale [T, Hi] float32)``, one launch. q8 holds the fp8 values
    as float8_e4m3fn, or in ``dtype`` (bf16, fp16, fp32 hold them exactly)."""
    T, HI, D = q.shape
    assert D == 128 and q.stride(-1) == 1, f"q {tuple(q.shape)}, expected [T, Hi, 128] with unit last stride"
    fp8 = dtype == torch.float8_e4m3fn
    q8 = torch.empty(T, HI, D, dtype=torch.uint8 if fp8 else dtype, device=q.device)
    w8 = torch.empty(T, HI, dtype=torch.float32, device=q.device)
    if T and HI:
        hp = triton.next_power_of_2(HI)
        bt = max(1, 64 // hp)
        quantize_q_fp8[(triton.cdiv(T, bt),)](q, weights, q8, w8, T, q.stride(0), q.stride(1),
                                              weights.stride(0), HI, BT=bt, HP=hp, num_warps=8)
    return (q8.view(torch.float8_e4m3fn) if fp8 else q8), w8


def dequantize_fp8_ds_mla(packed, dtype=torch.float32):
    """Triton ``dequantize_fp8_ds_mla``: ``[n, 656]`` uint8 -> ``[n, 576]`` ``dtype`` (float32
    like the reference; bf16 is exact too: power-of-two scales keep the fp8 mantissa)."""
    if packed.dim() == 3:
        packed = packed.reshape(-1, FP8_DS_MLA_BYTES)
    assert packed.dtype == torch.uint8 and packed.shape[1] == FP8_DS_MLA_BYTES and packed.stride(1) == 1
    n = packed.shape[0]
    out = torch.empty(n, D_QK, dtype=dtype, device=packed.device)
    if n:
        block_r = 16
        unpack_fp8_ds_mla[(triton.cdiv(n, block_r),)](packed, out, n, packed.stride(0), out.stride(0),
                                                      BLOCK_R=block_r, num_warps=4)
    return out
