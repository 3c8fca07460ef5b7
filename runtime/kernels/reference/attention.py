"""Reference sparse-MLA attention and the exact LSE merge (torch; CPU and CUDA).

The semantics every other backend is tested against; docs/design.md §Reference attention
semantics and §Decode rows: LSE merge and top-k merge. ``plan_attention`` is trivial here (one
family, nothing to tune): it exists so every ``KernelSet`` has the same plan/run pair.
"""

from __future__ import annotations

import torch

from ..attention_plan import AttentionPlan, AttentionPlanError, check_kv_format
from .formats import D_QK, D_V, dequantize_fp8_ds_mla
from .index import remap_to_gathered

# Reference attention gathers [T_chunk, topk, 576] rows at a time; this bounds that temporary.
_GATHER_BUDGET_ROWS = 1 << 18


def plan_attention(*, num_tokens: int, num_heads: int, topk: int, kv_format: str, num_kv_rows: int,
                   q_dtype, device, fused_remap: bool = False) -> AttentionPlan:
    """The reference's plan: family "reference"; fp8 rows are dequantised at every reference."""
    check_kv_format(kv_format)
    return AttentionPlan(backend="reference", family="reference",
                         fp8_rows="in_kernel" if kv_format == "fp8_ds_mla" else "none")


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
    *,
    plan: AttentionPlan | None = None,
    remap=None,
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
    plan: None, or this backend's ``plan_attention`` result (checked; there is nothing to choose).
    remap: None, or ``(region_pcu [T] int, padded_local_total, dcp_size, interleave)``: indices
    are then global token ids, mapped to rows as ``remap_to_gathered`` does.
    """
    check_kv_format(kv_format)
    if plan is not None and plan.backend != "reference":
        raise AttentionPlanError(f"plan for backend {plan.backend!r} given to the 'reference' attention: "
                                 "expected one from its own plan_attention")
    if remap is not None:
        indices = remap_to_gathered(indices, *remap)
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
    # a missing slot reads row 0 and is then zeroed, as the kernels' masked loads give 0: row 0
    # is the reserved slot that padded tokens write, so it may hold anything, NaN included,
    # and a zero weight would not cancel that (0 * NaN = NaN)
    rows = _gather_kv(kv, torch.where(valid, idx, 0), kv_format, cdt)  # [t, k, 576]
    rows = rows.masked_fill(~valid[..., None], 0.0)
    scores = torch.einsum("thd,tkd->thk", q, rows) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where no key
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("thk,tkd->thd", p, rows[..., :D_V])
    return out, lse


def lse_merge(out_parts: torch.Tensor, lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial attention results (docs/design.md §Decode rows: LSE merge and top-k
    merge).

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



def lse_merge_weight(lse_all: torch.Tensor, rank: int) -> torch.Tensor:
    """``exp(lse_rank - lse)`` with ``lse = logsumexp_r lse_r`` over ``lse_all [W, nd, H]``;
    0 where this rank (or every rank) has no key: never NaN."""
    lse_all = lse_all.float()
    m = lse_all.amax(dim=0)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    total = m_safe + torch.log(torch.exp(lse_all - m_safe).sum(dim=0))
    total_safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    return torch.exp(lse_all[rank] - total_safe)


def lse_scale(out_part: torch.Tensor, lse_all: torch.Tensor, rank: int) -> torch.Tensor:
    """This DCP rank's share of the exact decode merge (docs/design.md §3.6): ``out_part
    [nd, H, 512]`` times :func:`lse_merge_weight` of ``lse_all [W, nd, H]``, in float32, returned
    contiguous in ``out_part``'s dtype; summing every rank's result (``decode_out``) gives the
    merged output."""
    weight = lse_merge_weight(lse_all, rank)
    return (out_part.float() * weight[..., None]).to(out_part.dtype).contiguous()


def sparse_mla_overflow(q: torch.Tensor, kv: torch.Tensor, over: torch.Tensor,
                        count: torch.Tensor, width: int, out: torch.Tensor, lse: torch.Tensor,
                        sm_scale: float, kv_format: str = "bf16") -> None:
    """The rest of a compacted decode attention (``merge_local_slots``): rows with
    ``count > width`` attend over ``over[t, :count - width]`` and that part is LSE-merged into
    ``out [T, H, 512]`` / ``lse [T, H]`` float32 in place (they hold the pass over ``main``);
    other rows are left as they are. Exact: the merge of the two parts equals one pass over
    all the row's slots up to float rounding."""
    if over.shape[1] == 0 or q.shape[0] == 0:
        return
    cols = torch.arange(over.shape[1], device=over.device)
    idx = torch.where(cols[None, :] < (count.long() - width)[:, None], over, -1)
    o2, lse2 = sparse_mla_attention(q, kv, idx, sm_scale, kv_format)
    merged, merged_lse = lse_merge(torch.stack([out.float(), o2.float()]),
                                   torch.stack([lse.float(), lse2.float()]))
    extra = (count.long() > width)[:, None]
    out.copy_(torch.where(extra[..., None], merged.to(out.dtype), out))
    lse.copy_(torch.where(extra, merged_lse, lse.float()).to(lse.dtype))
