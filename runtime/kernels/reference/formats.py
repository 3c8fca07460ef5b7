"""fp8 cache formats of the torch reference: quantise, dequantise and pack (bit-exact contracts).

``fp8_ds_mla`` KV rows (656 bytes: 512 fp8 e4m3 latent values, four float32 power-of-two scales,
64 bf16 RoPE values) and indexer keys (132 bytes: 128 fp8 values, one float32 scale); formats in
docs/design.md §The fp8_ds_mla KV token (656 bytes) and §Indexer keys and scores. Runs on CPU and CUDA.

The paged indexer K cache is block-planar, ``[num_blocks, B * 132]`` uint8: a block's B x 128
fp8 values, then its B float32 scales (docs/design.md §4.3; every key row 128-byte aligned).
``gather_indexer_k`` / ``scatter_indexer_k`` move packed 132-byte rows out of and into it.
Sentinel: ``NO_KEY = -1`` in every index / id / slot / row tensor means "no key, never read".
"""

from __future__ import annotations

import torch

NO_KEY = -1
D_QK = 576  # 512 latent + 64 RoPE
D_V = 512
D_ROPE = 64
D_INDEXER = 128
FP8_DS_MLA_BYTES = 656  # 512 fp8 | 4 x fp32 scale | 64 x bf16
INDEXER_K_BYTES = 132  # 128 fp8 | 1 x fp32 scale
FP8_GROUP = 128
FP8_MAX = 448.0
_SCALE_FLOOR = 2.0**-126


def fp8_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(max(amax, 2**-126) / 448))`` as int32, for float32 ``amax`` (any shape).

    Computed from the float32 bits (frexp), never through a rounded log2 or a subnormal quotient:
    with ``a = m * 2**e``, m in [0.5, 1) and ``448 = 0.875 * 2**9``, the result is
    ``e - 9 + (m > 0.875)``. The Triton packer uses the same bit rule, so both are bit-identical.
    """
    a = torch.clamp(amax.float(), min=_SCALE_FLOOR)
    m, e = torch.frexp(a)
    return (e - 9 + (m > 0.875).to(e.dtype)).to(torch.int32)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as float32, exact also where the result is subnormal (via float64)."""
    return torch.pow(2.0, exponent.to(torch.float64)).to(torch.float32)


def _quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, g, 128] float32 -> (fp8 bytes [n, g*128] uint8, scales [n, g] float32)."""
    scale = _pow2(fp8_scale_exponent(x.abs().amax(dim=-1)))
    # x / scale is exact (power of two); do it in float64 so no subnormal step can round.
    q = (x.double() / scale.double().unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).reshape(x.shape[0], x.shape[1] * x.shape[2]), scale


def quantize_fp8_ds_mla(kv: torch.Tensor) -> torch.Tensor:
    """Quantise KV tokens into the ``fp8_ds_mla`` cache format.

    kv: ``[n, 576]`` float (any float dtype; converted to float32 first, which is exact for
    bf16/fp16/fp32 inputs). Returns ``[n, 656]`` uint8 on kv's device, one token per row:
    bytes 0..511 the 512 latent values as fp8 e4m3 (round to nearest even), bytes 512..527 four
    float32 scales (little-endian, one per 128 latent values, each a power of two), bytes
    528..655 the 64 RoPE values as bf16 (round to nearest even).
    """
    n = kv.shape[0]
    assert kv.shape[-1] == D_QK, f"kv last dim {kv.shape[-1]}, expected {D_QK}"
    x = kv.float()
    fp8, scale = _quantize_groups(x[:, :D_V].reshape(n, D_V // FP8_GROUP, FP8_GROUP))
    rope = x[:, D_V:].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, 2 * D_ROPE)
    scale_bytes = scale.contiguous().view(torch.uint8).reshape(n, 16)
    return torch.cat([fp8, scale_bytes, rope], dim=1)


def dequantize_fp8_ds_mla(packed: torch.Tensor) -> torch.Tensor:
    """``[n, 656]`` uint8 fp8_ds_mla rows -> ``[n, 576]`` float32 (exact: scales are powers of 2)."""
    assert packed.dtype == torch.uint8 and packed.shape[-1] == FP8_DS_MLA_BYTES
    n = packed.shape[0]
    p = packed.contiguous()
    vals = p[:, :D_V].view(torch.float8_e4m3fn).float().reshape(n, 4, FP8_GROUP)
    scale = p[:, D_V : D_V + 16].contiguous().view(torch.float32).reshape(n, 4, 1)
    rope = p[:, D_V + 16 :].contiguous().view(torch.bfloat16).float()
    return torch.cat([(vals * scale).reshape(n, D_V), rope], dim=1)


def quantize_indexer_k(k: torch.Tensor) -> torch.Tensor:
    """Indexer keys ``[n, 128]`` float -> ``[n, 132]`` uint8: 128 fp8 e4m3 | one float32 scale.

    Same scale rule as fp8_ds_mla with one group of 128 values.
    """
    n = k.shape[0]
    assert k.shape[-1] == D_INDEXER
    fp8, scale = _quantize_groups(k.float().reshape(n, 1, D_INDEXER))
    return torch.cat([fp8, scale.contiguous().view(torch.uint8).reshape(n, 4)], dim=1)


def quantize_indexer_q(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer query as the model's indexer uses it: fp8 e4m3 with one power-of-two scale
    per (token, head), the scale folded into the head weight (docs/design.md §4.3).

    q: ``[T, Hi, 128]`` float; weights: ``[T, Hi]`` float. Returns ``(q8 [T, Hi, 128]
    float8_e4m3fn, weights * scale [T, Hi] float32)``: ``relu(q . k) * w == relu(q8 . k) * w'``
    up to the rounding of q to fp8 (scale > 0 commutes with the ReLU; powers of two are exact).
    Each head is one group of the K cache's rule (``_quantize_groups``).
    """
    T, H, D = q.shape
    fp8, scale = _quantize_groups(q.float().reshape(T * H, 1, D))
    return fp8.view(torch.float8_e4m3fn).reshape(T, H, D), weights.float() * scale.reshape(T, H)


def dequantize_indexer_k(packed: torch.Tensor) -> torch.Tensor:
    """``[n, 132]`` uint8 -> ``[n, 128]`` float32 (exact)."""
    assert packed.dtype == torch.uint8 and packed.shape[-1] == INDEXER_K_BYTES
    p = packed.contiguous()
    vals = p[:, :D_INDEXER].view(torch.float8_e4m3fn).float()
    return vals * p[:, D_INDEXER:].contiguous().view(torch.float32)


def pack_fp8_ds_mla_into(cache_flat: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Quantise ``kv [n, 576]`` and write row i into ``cache_flat[slots[i]]`` (in place).

    cache_flat: ``[S, 656]`` uint8 (a paged cache ``[num_blocks, 64, 656]`` viewed flat);
    slots: ``[n]`` int64/int32, a slot < 0 is skipped (not written).
    """
    _pack_into(slots, quantize_fp8_ds_mla(kv), cache_flat[:1],
               lambda sl, rows: cache_flat.index_copy_(0, sl, rows))


def pack_indexer_k_into(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
    """Quantise indexer keys ``k [n, 128]`` into the block-planar ``cache [num_blocks, B * 132]``
    uint8 at ``slots`` (slots < 0 skipped)."""
    _pack_into(slots, quantize_indexer_k(k), gather_indexer_k(cache, slots.new_zeros(1)),
               lambda sl, rows: scatter_indexer_k(cache, sl, rows))


def indexer_k_planes(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-planar indexer K cache ``[num_blocks, B * 132]`` uint8 as two views:
    values ``[num_blocks, B, 128]`` and scale bytes ``[num_blocks, B, 4]``."""
    assert cache.dtype == torch.uint8 and cache.dim() == 2 and cache.stride(-1) == 1
    block = cache.shape[1] // INDEXER_K_BYTES
    assert cache.shape[1] == block * INDEXER_K_BYTES, cache.shape
    return (cache[:, : block * D_INDEXER].unflatten(1, (block, D_INDEXER)),
            cache[:, block * D_INDEXER :].unflatten(1, (block, 4)))


def gather_indexer_k(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Packed rows ``[n, 132]`` (128 fp8 | float32 scale) of ``slots [n]`` (each >= 0) of the
    block-planar indexer K cache ``[num_blocks, B * 132]``."""
    values, scales = indexer_k_planes(cache)
    slots = slots.long()
    blk, off = slots // values.shape[1], slots % values.shape[1]
    return torch.cat([values[blk, off], scales[blk, off]], dim=1)


def scatter_indexer_k(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Packed rows ``[n, 132]`` into ``slots [n]`` (each >= 0) of the block-planar indexer K
    cache ``[num_blocks, B * 132]`` (in place; like ``index_copy_``, which of two rows written
    to one slot lands is unspecified)."""
    values, scales = indexer_k_planes(cache)
    slots = slots.long()
    blk, off = slots // values.shape[1], slots % values.shape[1]
    values[blk, off] = rows[:, :D_INDEXER]
    scales[blk, off] = rows[:, D_INDEXER:]


def _pack_into(slots: torch.Tensor, rows: torch.Tensor, slot0: torch.Tensor, write) -> None:
    """``write(slots', rows')``: row i into slot ``slots[i]`` where slots[i] >= 0, without a
    host sync (the executor writes decode tokens through here inside a step, where the GPU
    tests forbid syncs): a skipped row rewrites the first kept row's slot with that same row
    (a duplicate of an identical write), or, when none is kept, slot 0 with its own bytes
    (``slot0 [1, row bytes]``)."""
    keep = slots >= 0
    if keep.numel() == 0:
        return
    # the first kept row (0 when none is), as a 1-element index: indexing with a 0-d tensor
    # would read its value on the host
    first = keep.int().argmax().view(1)
    any_kept = keep.any()
    fill_slot = torch.where(any_kept, slots.index_select(0, first), 0).long()
    fill_row = torch.where(any_kept, rows.index_select(0, first), slot0)
    write(torch.where(keep, slots.long(), fill_slot), torch.where(keep[:, None], rows, fill_row))
