"""Plain torch reference ops for sparse MLA: the semantics every other backend is tested against.

Everything here runs on CPU (float32 / float64) and on CUDA. Nothing syncs on purpose except
where a docstring says so (the reference is not the hot path on the GPU; the Triton backend is).
Formats and formulas: DESIGN.md sections 3.4-3.6 and 4; shared/KERNELS.md.

Vocabulary (DESIGN.md section 2): T query rows, H attention heads, Hi indexer heads, W DCP world
size, I interleave, PT padded local total of a gather chunk, B block (page) size.
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
# Reference attention gathers [T_chunk, topk, 576] rows at a time; this bounds that temporary.
_GATHER_BUDGET_ROWS = 1 << 18


# --------------------------------------------------------------------------------------------
# fp8 formats
# --------------------------------------------------------------------------------------------
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
    return q.view(torch.uint8).reshape(x.shape[0], -1), scale


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
    _pack_into(cache_flat, slots, quantize_fp8_ds_mla(kv))


def pack_indexer_k_into(cache_flat: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
    """Quantise indexer keys ``k [n, 128]`` into ``cache_flat [S, 132]`` uint8 at ``slots``."""
    _pack_into(cache_flat, slots, quantize_indexer_k(k))


def _pack_into(cache_flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    keep = slots >= 0
    cache_flat.index_copy_(0, slots[keep].long(), rows[keep])


# --------------------------------------------------------------------------------------------
# sparse MLA attention and the LSE merge
# --------------------------------------------------------------------------------------------
def _gather_kv(kv: torch.Tensor, idx: torch.Tensor, kv_format: str, dtype) -> torch.Tensor:
    """Rows ``kv[idx]`` (idx >= 0 everywhere) as ``dtype`` ``[..., 576]``."""
    flat = idx.reshape(-1).long()
    if kv_format == "fp8_ds_mla":
        rows = dequantize_fp8_ds_mla(kv.index_select(0, flat))
    elif kv_format == "bf16":
        rows = kv.index_select(0, flat)
    else:
        raise ValueError(f"kv_format {kv_format!r}, expected 'bf16' or 'fp8_ds_mla'")
    return rows.to(dtype).reshape(*idx.shape, D_QK)


def sparse_mla_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    kv_format: str = "bf16",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention over the rows that ``indices`` names.

    q: ``[T, H, 576]`` float. kv: a flat buffer of rows, ``[N, 576]`` float (kv_format "bf16":
    unquantised rows of any float dtype) or ``[N, 656]`` uint8 (kv_format "fp8_ds_mla"; a paged
    cache ``[num_blocks, 64, 656]`` is passed flattened and indices are then slots).
    indices: ``[T, topk]`` int32, rows of kv; ``NO_KEY`` (-1) = no key, never read.
    scores = (q . kv[idx]) * sm_scale over all 576 dims; out = softmax(scores) . kv[idx][:, :512].
    Returns ``(out [T, H, 512] q.dtype, lse_base_e [T, H] float32)``; lse is the natural-log
    logsumexp of the scores; a row with no valid key gives out 0 and lse -inf, never NaN.
    Computed in float32 (float64 when q is float64), in chunks of tokens to bound memory.
    """
    if kv.dim() == 3:
        kv = kv.reshape(-1, kv.shape[-1])
    T, H, _ = q.shape
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    topk = indices.shape[1]
    out = torch.empty(T, H, D_V, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    step = max(1, _GATHER_BUDGET_ROWS // max(topk, 1))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        o, l = _attend_chunk(q[t0:t1].to(cdt), kv, indices[t0:t1], sm_scale, kv_format, cdt)
        out[t0:t1] = o.to(q.dtype)
        lse[t0:t1] = l.float()
    return out, lse


def _attend_chunk(q, kv, idx, sm_scale, kv_format, cdt):
    valid = idx >= 0  # [t, k]
    rows = _gather_kv(kv, torch.where(valid, idx, 0), kv_format, cdt)  # [t, k, 576]
    scores = torch.einsum("thd,tkd->thk", q, rows) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where no key
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("thk,tkd->thd", p, rows[..., :D_V])
    return out, lse


def lse_merge(out_parts: torch.Tensor, lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial attention results (DESIGN 3.6).

    out_parts: ``[R, T, H, 512]`` float, lse_parts: ``[R, T, H]`` float32 (natural log, -inf for a
    part with no key). Returns ``(out [T, H, 512] out_parts.dtype, lse [T, H] float32)``:
    ``lse = m + log sum_r exp(lse_r - m)``, ``out = sum_r exp(lse_r - lse) * out_r``; a row whose
    parts are all -inf gives (0, -inf), never NaN.
    """
    cdt = torch.float64 if out_parts.dtype == torch.float64 else torch.float32
    l = lse_parts.to(cdt)
    m = l.amax(dim=0)
    m_safe = torch.where(torch.isinf(m), 0.0, m)
    lse = m_safe + torch.log(torch.exp(l - m_safe).sum(dim=0))
    lse_safe = torch.where(torch.isinf(lse), 0.0, lse)
    w = torch.exp(l - lse_safe)  # [R, T, H]; 0 for empty parts
    out = (w[..., None] * out_parts.to(cdt)).sum(dim=0)
    return out.to(out_parts.dtype), lse.float()


# --------------------------------------------------------------------------------------------
# index maps (DESIGN 3.4 / 3.5)
# --------------------------------------------------------------------------------------------
def remap_to_gathered(
    token_ids: torch.Tensor,
    region_pcu: torch.Tensor,
    padded_local_total: int,
    dcp_size: int,
    interleave: int,
) -> torch.Tensor:
    """Global token ids -> rows of the rank-major gathered buffer ``[W * PT, bytes]``.

    token_ids: ``[T, K]`` int, a token position within query j's request (NO_KEY stays NO_KEY).
    region_pcu: ``[T]`` int, the padded-local prefix sum ``pcu[i]`` of query j's request region in
    the gather chunk. Row = ``owner(t) * PT + pcu + local(t)`` with ``owner(t) = (t // I) % W``,
    ``local(t) = (t // (W*I)) * I + t % I``. Returns ``[T, K]`` int32.
    """
    W, I = dcp_size, interleave
    t = token_ids.long()
    owner = (t // I) % W
    local = (t // (W * I)) * I + t % I
    rows = owner * padded_local_total + region_pcu.long()[:, None] + local
    return torch.where(t >= 0, rows, NO_KEY).to(torch.int32)


def filter_local_slots(
    token_ids: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
) -> torch.Tensor:
    """Global token ids -> this DCP rank's cache slots; ids owned by other ranks -> NO_KEY.

    token_ids: ``[T, K]`` int (NO_KEY = none); block_table: ``[T, max_blocks]`` int32, query j's
    request's local block table on this rank. slot = ``block_table[j, local // B] * B + local % B``.
    Returns ``[T, K]`` int32.
    """
    W, I, B = dcp_size, interleave, block_size
    t = token_ids.long()
    mine = (t >= 0) & (((t // I) % W) == dcp_rank)
    local = torch.where(mine, (t // (W * I)) * I + t % I, 0)
    blocks = torch.gather(block_table.long(), 1, local // B)
    return torch.where(mine, blocks * B + local % B, NO_KEY).to(torch.int32)


def deinterleave_index_select(gathered: torch.Tensor, deinterleave: torch.Tensor) -> torch.Tensor:
    """The plain copy: ``gathered [W*PT, bytes]`` rows in global order, ``[L, bytes]``."""
    return gathered.index_select(0, deinterleave.long())


# indexer ops live in reference_indexer.py; re-exported here so one module names the reference.
from .reference_indexer import (  # noqa: E402
    decode_key_slots,
    indexer_scores,
    indexer_topk,
    indexer_topk_decode,
    indexer_topk_prefill,
    prefill_key_rows,
    topk_reference_order,
)

__all__ = [
    "NO_KEY",
    "decode_key_slots",
    "deinterleave_index_select",
    "dequantize_fp8_ds_mla",
    "dequantize_indexer_k",
    "filter_local_slots",
    "fp8_scale_exponent",
    "indexer_scores",
    "indexer_topk",
    "indexer_topk_decode",
    "indexer_topk_prefill",
    "lse_merge",
    "pack_fp8_ds_mla_into",
    "pack_indexer_k_into",
    "prefill_key_rows",
    "quantize_fp8_ds_mla",
    "quantize_indexer_k",
    "remap_to_gathered",
    "sparse_mla_attention",
    "topk_reference_order",
]
