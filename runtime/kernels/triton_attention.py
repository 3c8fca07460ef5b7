"""Triton sparse-MLA attention (prefill and decode) over bf16 or fp8_ds_mla KV rows.

One program per (query token, block of heads, split of the top-k). Each step gathers BLOCK_K
rows named by the indices, dequantises fp8_ds_mla rows in registers (scales are powers of two,
so the product is exact), and runs an online softmax with two matrix products: scores over the
512 latent + 64 RoPE dims, then P . V with V = the 512 latent dims of the same rows.

Heads: BLOCK_H = next power of two of H, clamped to [16, 64]; H = 8..32 per rank pays for 16..32
rows of the product, not 64. Few tokens (decode): the top-k is split over programs, each writes a
float32 partial (out, lse) and ``triton_merge.lse_merge_into`` combines them (DESIGN 3.6).
Optional fused remap: indices may be global token ids of a gather chunk, mapped to rows of the
rank-major gathered buffer in the kernel (DESIGN 3.5), so no deinterleaved copy is needed.

``sparse_mla_attention`` is also the entry point that picks a path: fp8_ds_mla rows that many
tokens read (a prefill over a gathered buffer) are dequantised once and read by the bf16 kernel;
the fp8 decode with at most 32 heads on Hopper runs ``gluon_attention``. Contract:
``reference.sparse_mla_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import D_QK, D_V, FP8_DS_MLA_BYTES

_LOG2E = 1.4426950408889634


@triton.jit
def _ld(ptrs, mask, other, EVICT: tl.constexpr):
    """``tl.load``; EVICT marks streamed rows evict-first (decode: read once, keep L2 for others)."""
    if EVICT:
        return tl.load(ptrs, mask=mask, other=other, eviction_policy="evict_first")
    else:
        return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def _gather_raw(kv_ptr, rows, valid, stride_kv, KV_FP8: tl.constexpr, EVICT: tl.constexpr):
    """Rows ``kv[rows]`` as stored: (latent [BLOCK_K, 512] uint8 or bf16, scales [BLOCK_K, 4] fp32
    (1.0 for bf16), rope [BLOCK_K, 64] bf16); 0 where not valid. No arithmetic on the values, so
    a loop can issue the next block's gather before it computes on this one (PREFETCH)."""
    d_lat = tl.arange(0, 512)
    d_rope = tl.arange(0, 64)
    base = kv_ptr + rows.to(tl.int64) * stride_kv
    if KV_FP8:
        raw = _ld(base[:, None] + d_lat[None, :], valid[:, None], 0, EVICT)
        sc_ptr = (base + 512).to(tl.pointer_type(tl.float32))
        scale = _ld(sc_ptr[:, None] + tl.arange(0, 4)[None, :], valid[:, None], 0.0, EVICT)
        rope_ptr = (base + 528).to(tl.pointer_type(tl.bfloat16))
        rope = _ld(rope_ptr[:, None] + d_rope[None, :], valid[:, None], 0.0, EVICT)
    else:
        raw = _ld(base[:, None] + d_lat[None, :], valid[:, None], 0.0, EVICT)
        scale = tl.full((rows.shape[0], 4), 1.0, tl.float32)
        rope = _ld(base[:, None] + 512 + d_rope[None, :], valid[:, None], 0.0, EVICT)
    return raw, scale, rope


@triton.jit
def _dequant(raw, scale, rope, KV_FP8: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
             DEQ_BF16: tl.constexpr):
    """(latent, rope) in DOT_DTYPE. fp8: value * its group's power-of-two scale (exact); DEQ_BF16
    multiplies in bf16 (one rounding of the exact product, as float32-then-round gives)."""
    if KV_FP8:
        if DEQ_BF16:
            vals = raw.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
            lat = tl.reshape(tl.reshape(vals, (BLOCK_K, 4, 128)) * scale.to(DOT_DTYPE)[:, :, None],
                             (BLOCK_K, 512))
        else:
            vals = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            lat = tl.reshape(tl.reshape(vals, (BLOCK_K, 4, 128)) * scale[:, :, None], (BLOCK_K, 512))
        return lat.to(DOT_DTYPE), rope.to(DOT_DTYPE)
    else:
        return raw.to(DOT_DTYPE), rope.to(DOT_DTYPE)


@triton.jit
def _load_kv_tile(kv_ptr, rows, valid, stride_kv, KV_FP8: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_DTYPE: tl.constexpr):
    """Rows ``kv[rows]`` as (latent [BLOCK_K, 512], rope [BLOCK_K, 64]) in DOT_DTYPE; 0 if invalid."""
    raw, scale, rope = _gather_raw(kv_ptr, rows, valid, stride_kv, KV_FP8, False)
    return _dequant(raw, scale, rope, KV_FP8, BLOCK_K, DOT_DTYPE, False)


@triton.jit
def _remap_rows(ids, pcu, padded_local_total, dcp_size: tl.constexpr, interleave: tl.constexpr,
                REMAP: tl.constexpr):
    """Token ids (>= 0) -> int64 rows; with REMAP the gathered-buffer row of DESIGN 3.5, in int32
    arithmetic with W and I compile-time constants (ids and rows stay below 2**31)."""
    if REMAP:
        grp = ids // interleave
        ids = ((grp % dcp_size) * padded_local_total + pcu
               + (grp // dcp_size) * interleave + ids % interleave)
    return ids.to(tl.int64)


@triton.jit
def _block_rows(idx_ptr, t, stride_it, k0, k_end, pcu, padded_local_total, dcp_size: tl.constexpr,
                interleave: tl.constexpr, REMAP: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows (int64) and validity of top-k slots ``k0 .. k0 + BLOCK_K`` (slots >= k_end: invalid)."""
    offs = k0 + tl.arange(0, BLOCK_K)
    idx = tl.load(idx_ptr + t.to(tl.int64) * stride_it + offs, mask=offs < k_end, other=-1)
    valid = idx >= 0
    rows = _remap_rows(tl.where(valid, idx, 0), pcu, padded_local_total, dcp_size, interleave, REMAP)
    return rows, valid


@triton.jit
def _softmax_step(q_lat, q_rope, lat, rope, valid, m_i, l_i, acc, qk_scale_log2,
                  DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """One block of the online softmax, heads on the rows: S = Q K^T, acc = acc * alpha + P V."""
    s = tl.dot(q_lat, tl.trans(lat), input_precision=PRECISION)
    s = tl.dot(q_rope, tl.trans(rope), s, input_precision=PRECISION)
    s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(DOT_DTYPE), lat, acc, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _sparse_mla_fwd(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, pcu_ptr,
    stride_qt, stride_qh, stride_kv, stride_it,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    H, TOPK, keys_per_split, padded_local_total, qk_scale_log2,
    dcp_size: tl.constexpr, interleave: tl.constexpr, KV_FP8: tl.constexpr, REMAP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr = False,
    DEQ_BF16: tl.constexpr = False, EVICT: tl.constexpr = False, WS: tl.constexpr = False,
):
    """Heads on the rows of the products. PREFETCH: the next block's rows are gathered into
    registers (as stored: fp8 bytes, scales, rope) before this block's products, and the indices
    one block further ahead, so the gather latency overlaps the matrix work."""
    pid_h = tl.program_id(0)  # head blocks of one token run side by side: they share rows in L2
    t = tl.program_id(1)
    split = tl.program_id(2)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    q_base = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_base + tl.arange(0, 512)[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    q_rope = tl.load(q_base + 512 + tl.arange(0, 64)[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    pcu = 0
    if REMAP:
        pcu = tl.load(pcu_ptr + t).to(tl.int32)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, 512), tl.float32)
    k_begin = split * keys_per_split
    k_end = tl.minimum(k_begin + keys_per_split, TOPK)
    if PREFETCH:
        rows, valid = _block_rows(idx_ptr, t, stride_it, k_begin, k_end, pcu, padded_local_total,
                                  dcp_size, interleave, REMAP, BLOCK_K)
        raw, scale, rope = _gather_raw(kv_ptr, rows, valid, stride_kv, KV_FP8, EVICT)
        rows_n, valid_n = _block_rows(idx_ptr, t, stride_it, k_begin + BLOCK_K, k_end, pcu,
                                      padded_local_total, dcp_size, interleave, REMAP, BLOCK_K)
        for k0 in tl.range(k_begin, k_end, BLOCK_K, warp_specialize=WS):
            raw_n, scale_n, rope_n = _gather_raw(kv_ptr, rows_n, valid_n, stride_kv, KV_FP8, EVICT)
            rows_nn, valid_nn = _block_rows(idx_ptr, t, stride_it, k0 + 2 * BLOCK_K, k_end, pcu,
                                            padded_local_total, dcp_size, interleave, REMAP, BLOCK_K)
            lat, rp = _dequant(raw, scale, rope, KV_FP8, BLOCK_K, DOT_DTYPE, DEQ_BF16)
            m_i, l_i, acc = _softmax_step(q_lat, q_rope, lat, rp, valid, m_i, l_i, acc, qk_scale_log2,
                                          DOT_DTYPE, PRECISION)
            raw, scale, rope, valid = raw_n, scale_n, rope_n, valid_n
            rows_n, valid_n = rows_nn, valid_nn
    else:
        for k0 in tl.range(k_begin, k_end, BLOCK_K, warp_specialize=WS):
            rows, valid = _block_rows(idx_ptr, t, stride_it, k0, k_end, pcu, padded_local_total,
                                      dcp_size, interleave, REMAP, BLOCK_K)
            raw, scale, rope = _gather_raw(kv_ptr, rows, valid, stride_kv, KV_FP8, EVICT)
            lat, rp = _dequant(raw, scale, rope, KV_FP8, BLOCK_K, DOT_DTYPE, DEQ_BF16)
            m_i, l_i, acc = _softmax_step(q_lat, q_rope, lat, rp, valid, m_i, l_i, acc, qk_scale_log2,
                                          DOT_DTYPE, PRECISION)

    has = l_i > 0.0
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(has, (m_safe + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    o_ptr = out_ptr + split.to(tl.int64) * stride_os + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
    tl.store(o_ptr + tl.arange(0, 512)[None, :], out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    tl.store(lse_ptr + split.to(tl.int64) * stride_ls + t.to(tl.int64) * stride_lt + heads, lse, mask=hmask)


_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _gluon():
    """``gluon_attention``, or None where this Triton has no Gluon (the Triton kernels then run)."""
    try:
        from . import gluon_attention
    except ImportError:
        return None
    return gluon_attention


def _block_h(H: int) -> int:
    return max(16, min(64, triton.next_power_of_2(H)))


def _num_splits(T: int, H: int, topk: int, block_k: int, device: torch.device) -> int:
    """Split the top-k over programs until the grid covers every SM once (bench/kernels.py:
    more splits cost more than they gain once every SM has a program)."""
    if device.type != "cuda":
        return 1 if T > 1 else min(2, triton.cdiv(topk, block_k))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = T * triton.cdiv(H, _block_h(H))
    splits = 1
    while programs * splits < sms and splits * 2 * block_k * 2 <= topk:
        splits *= 2
    return splits


# fp8_ds_mla rows referenced at least this many times on average (T * topk >= REUSE * rows) are
# dequantised once into a bf16 buffer and read by the bf16 kernel. H200, 128 heads, 65,536 rows
# (bench/kernels.py --only reuse; bench/RESULTS.md): in-kernel / once = 0.80x at 0.5 references
# per row, 0.99x at 2, 1.03x at 4, 1.08x at 8, 1.13x at 128; the pass itself is 36 us (3.3 TB/s).
DEQUANTISE_ONCE_REUSE = 4


def default_config(kv_format: str, T: int, H: int, operand_bytes: int = 2, *, topk: int = 0,
                   rows: int = 0) -> dict:
    """The launch choice per regime, from the H200 sweep (bench/kernels.py --only sweep;
    bench/RESULTS.md). Keys: layout ("heads": heads on the rows of the products, 16-64
    per program; "keys": keys on the rows, heads the narrow side, triton_attention_kmajor),
    fp8_variant (heads layout only), block_k, num_warps, num_stages, prefetch, deq_bf16, evict,
    fp8_rows ("in_kernel": fp8 rows dequantised by the attention kernel at every reference;
    "dequantise_once": a prefill over a gathered buffer whose ``rows`` are each referenced
    ``DEQUANTISE_ONCE_REUSE`` times or more by the ``T x topk`` indices is dequantised to bf16 in
    one pass first, then read by the bf16 kernel; the DCP gather still moves 656 B per token).
    ``operand_bytes`` 4 (float32 q: exact "ieee" products, used by replays against the oracle)
    halves the key block and drops pipelining: 64 fp32 rows of 576 in two stages need 258 KB of
    shared memory, above the H200's 227 KB (seen 2026-11-29)."""
    fp8 = kv_format == "fp8_ds_mla"
    if fp8 and rows and T * topk >= DEQUANTISE_ONCE_REUSE * rows:
        return dict(default_config("bf16", T, H, operand_bytes), fp8_rows="dequantise_once")
    return dict(_launch_config(fp8, H, operand_bytes), fp8_rows="in_kernel")


def _launch_config(fp8: bool, H: int, operand_bytes: int) -> dict:
    block_h = _block_h(H)
    if operand_bytes >= 4 and not fp8:
        return dict(layout="heads", fp8_variant="dequant", block_k=32,
                    num_warps=4 if block_h <= 32 else 8, num_stages=1, prefetch=False,
                    deq_bf16=False, evict=False)
    # keys-major (layout="keys", 32 keys, prefetch) measured 344-347 vs 359-376 us at B 256, H 16,
    # but its prefetch variants at 64/128 keys hit an illegal address on the H200 (2026-11-29):
    # not the default until that is explained (bench/RESULTS.md).
    if block_h <= 32:
        return dict(layout="heads", fp8_variant="scaled_dots" if fp8 else "dequant", block_k=64,
                    num_warps=4, num_stages=2, prefetch=False, deq_bf16=False, evict=False)
    # bf16 rows: 3 stages 9.43 ms vs 2 stages 10.06 ms at T 4096, H 128 (2026-11-29, second run)
    return dict(layout="heads", fp8_variant="dequant", block_k=64, num_warps=8, num_stages=2 if fp8 else 3,
                prefetch=False, deq_bf16=False, evict=False)


def sparse_mla_attention(q, kv, indices, sm_scale: float, kv_format: str = "bf16", *,
                         remap=None, num_splits: int | None = None, block_k: int | None = None,
                         num_warps: int | None = None, num_stages: int | None = None,
                         fp8_variant: str = "auto", layout: str = "auto", prefetch: bool | None = None,
                         deq_bf16: bool | None = None, evict: bool | None = None, ws: bool = False,
                         fp8_rows: str = "auto", gluon_variant: str | None = None):
    """Triton ``sparse_mla_attention``; same contract as the reference, plus keyword options.

    remap: None, or ``(region_pcu [T] int, padded_local_total, dcp_size, interleave)``: indices
    are then global token ids (NO_KEY = none) mapped in the kernel to rows of the rank-major
    gathered buffer as ``reference.remap_to_gathered`` does. num_splits: top-k splits (default:
    chosen from T and the SM count; > 1 writes float32 partials and merges them).
    layout: "heads" (heads on the rows of the products), "keys" (keys on the rows:
    ``triton_attention_kmajor``, for few heads), "gluon" (``gluon_attention``: cp.async gather
    ring, keys-major wgmma; fp8 rows, bf16 q, <= 32 heads, sm_90, no fused remap) or "auto"
    (gluon where it applies, else ``default_config``).
    fp8_variant (heads layout): "scaled_dots" (``triton_attention_fp8``: scales applied to the
    score and probability tiles), "dequant" (every value scaled in registers before the products)
    or "auto" (``default_config``). prefetch: gather the next block into registers before this
    block's products; deq_bf16: dequantise in bf16 arithmetic; evict: evict-first KV loads; ws:
    ``tl.range(warp_specialize=True)``. fp8_rows: "in_kernel", "dequantise_once" (fp8 rows
    to a bf16 buffer in one pass, then the bf16 kernel; for buffers whose rows many tokens
    read) or "auto". gluon_variant: "ring" or "small" (``gluon_attention``; None: its default
    for the head count). Every option None/"auto" takes ``default_config``.
    Operands: q's dtype (bf16 on GPU; fp16/fp32 in the interpreter) is the matrix dtype; bf16
    rows are cast to it, fp8 rows are dequantised to it.
    """
    from .triton_merge import lse_merge_into

    if kv.dim() == 3:
        kv = kv.reshape(-1, kv.shape[-1])
    T, H, D = q.shape
    assert D == D_QK and q.stride(-1) == 1 and kv.stride(-1) == 1
    fp8 = kv_format == "fp8_ds_mla"
    if fp8:
        assert kv.dtype == torch.uint8 and kv.shape[1] == FP8_DS_MLA_BYTES
    elif kv_format != "bf16":
        raise ValueError(f"kv_format {kv_format!r}, expected 'bf16' or 'fp8_ds_mla'")
    indices = indices.contiguous()
    topk = indices.shape[1]
    cfg = default_config(kv_format, T, H, q.element_size(), topk=topk, rows=kv.shape[0])
    if fp8_rows == "auto":  # the Gluon decode reads fp8 rows itself
        fp8_rows = "in_kernel" if layout == "gluon" else cfg["fp8_rows"]
    if fp8 and fp8_rows == "dequantise_once":
        from .triton_pack import dequantize_fp8_ds_mla

        kv = dequantize_fp8_ds_mla(kv, q.dtype)  # each row once instead of once per reference
        fp8, kv_format = False, "bf16"
        cfg = default_config(kv_format, T, H, q.element_size())
    elif fp8_rows not in ("in_kernel", "dequantise_once"):
        raise ValueError(f"fp8_rows {fp8_rows!r}, expected 'auto', 'in_kernel' or 'dequantise_once'")
    gluon_attention = _gluon() if (layout in ("auto", "gluon") and q.is_cuda) else None
    if layout == "auto" and remap is None and fp8 and gluon_attention and gluon_attention.supported(q, kv_format):
        layout = "gluon"  # few-head fp8 decode: 1.5-1.9x the Triton kernels (bench/RESULTS.md)
    layout = cfg["layout"] if layout == "auto" else layout
    if layout == "gluon" and (remap is not None or not gluon_attention or not gluon_attention.supported(q, kv_format)):
        raise ValueError("layout 'gluon': needs CUDA sm_90, fp8_ds_mla rows, bf16 q, <= 32 heads, no fused "
                         "remap and a Triton with Gluon (tested: 3.6)")
    fp8_variant = cfg["fp8_variant"] if fp8_variant == "auto" else fp8_variant
    block_h = _block_h(H) if layout == "heads" else max(16, min(64, triton.next_power_of_2(H)))
    block_k = 64 if layout == "gluon" else (block_k or cfg["block_k"])  # gluon: the wgmma M
    prefetch = cfg["prefetch"] if prefetch is None else prefetch
    deq_bf16 = cfg["deq_bf16"] if deq_bf16 is None else deq_bf16
    evict = cfg["evict"] if evict is None else evict
    if layout == "gluon" and not num_splits:
        num_splits = gluon_attention.default_splits(T, H, topk, q.device)
    splits = num_splits or cfg.get("splits") or _num_splits(T, H, topk, block_k, q.device)
    per_split = triton.cdiv(triton.cdiv(topk, splits), block_k) * block_k
    splits = max(1, triton.cdiv(topk, per_split))
    lse = torch.empty(splits, T, H, dtype=torch.float32, device=q.device)
    out = torch.empty(splits, T, H, D_V, dtype=q.dtype if splits == 1 else torch.float32, device=q.device)
    pcu, pt, w, il = (remap if remap is not None else (indices, 0, 1, 1))
    grid = (triton.cdiv(H, block_h), T, splits)
    args = (q, kv, indices, out, lse, pcu,
            q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            H, topk, per_split, pt, sm_scale * _LOG2E)
    if layout == "gluon":
        gluon_attention.launch(q, kv, indices, out, lse, sm_scale, per_split, num_stages=num_stages,
                               num_warps=num_warps, variant=gluon_variant)
    elif layout == "keys":
        from .triton_attention_kmajor import _sparse_mla_fwd_kmajor

        kernel, extra = _sparse_mla_fwd_kmajor, {"KV_FP8": fp8, "PREFETCH": prefetch, "EVICT": evict}
    elif layout != "heads":
        raise ValueError(f"layout {layout!r}, expected 'auto', 'heads', 'keys' or 'gluon'")
    elif fp8 and fp8_variant == "scaled_dots":
        from .triton_attention_fp8 import _sparse_mla_fwd_fp8

        kernel, extra = _sparse_mla_fwd_fp8, {}
    else:
        kernel, extra = _sparse_mla_fwd, {"KV_FP8": fp8, "PREFETCH": prefetch, "EVICT": evict,
                                          "DEQ_BF16": deq_bf16 and q.dtype == torch.bfloat16, "WS": ws}
    if layout != "gluon":
        kernel[grid](
            *args, dcp_size=w, interleave=il, **extra,
            REMAP=remap is not None, BLOCK_H=block_h, BLOCK_K=block_k,
            DOT_DTYPE=_DOT_DTYPES[q.dtype], PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
        )
    if splits == 1:
        return out[0], lse[0]
    final = torch.empty(T, H, D_V, dtype=q.dtype, device=q.device)
    final_lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    lse_merge_into(out, lse, final, final_lse)
    return final, final_lse
