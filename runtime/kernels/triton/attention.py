"""Triton sparse-MLA attention (prefill and decode) over bf16 or fp8_ds_mla KV rows: runs a plan.

``sparse_mla_attention(..., plan=...)`` runs an ``AttentionPlan`` from ``plan.plan_attention``
as it is: the fp8 rows pass (dequantise once or not), the kernel family (``attention_jit``'s
heads kernels or the Gluon decode in ``..gluon``), the splits of the top-k and the launch
numbers. With more than one split, each writes a float32 partial (out, lse) and
``merge.lse_merge_into`` combines them (docs/design.md §Decode rows: LSE merge and top-k merge). Only what
would otherwise fail silently is checked here, from host metadata (no sync). Contract:
``reference.sparse_mla_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention_plan import AttentionPlan, AttentionPlanError, check_kv_format
from ..reference.formats import D_QK, D_V, FP8_DS_MLA_BYTES
from . import attention_jit
from .merge import lse_merge_into
from .pack import dequantize_fp8_ds_mla
from .plan import GLUON_FAMILIES, keys_per_split, plan_attention

_LOG2E = 1.4426950408889634
_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def sparse_mla_attention(q, kv, indices, sm_scale: float, kv_format: str = "bf16", *,
                         plan: AttentionPlan | None = None, remap=None):
    """Triton ``sparse_mla_attention``: the reference's contract, run as ``plan`` says.

    plan: from this backend's ``plan_attention`` for this shape (None: planned here, for direct
    calls and tests). remap: None, or ``(region_pcu [T] int, padded_local_total, dcp_size,
    interleave)``: indices are then global token ids (NO_KEY = none) mapped in the kernel to rows
    of the rank-major gathered buffer as ``reference.remap_to_gathered`` does.
    Operands: q's dtype (bf16 on GPU; fp16/fp32 in the interpreter) is the matrix dtype; bf16
    rows are cast to it, fp8 rows are dequantised to it.
    """
    check_kv_format(kv_format)
    if kv.dim() == 3:
        kv = kv.reshape(-1, kv.shape[-1])
    T, H, D = q.shape
    assert D == D_QK and q.stride(-1) == 1 and kv.stride(-1) == 1
    fp8 = kv_format == "fp8_ds_mla"
    assert not fp8 or (kv.dtype == torch.uint8 and kv.shape[1] == FP8_DS_MLA_BYTES)
    indices = indices.contiguous()
    if plan is None:
        plan = plan_attention(num_tokens=T, num_heads=H, topk=indices.shape[1], kv_format=kv_format,
                              num_kv_rows=kv.shape[0], q_dtype=q.dtype, device=q.device,
                              fused_remap=remap is not None)
    _check_plan(plan, q, kv_format, remap)
    if plan.fp8_rows == "dequantise_once":
        kv, fp8 = dequantize_fp8_ds_mla(kv, q.dtype), False  # each row once, not once per reference
    if plan.family in GLUON_FAMILIES:
        from ..gluon import decode  # the plan chose Gluon: this Triton has it

        def launch(out, lse, per_split):
            decode.launch(q, kv, indices, out, lse, sm_scale, per_split, variant=plan.family.removeprefix("gluon-"),
                          heads_padded=plan.block_h, num_stages=plan.num_stages, num_warps=plan.num_warps)

        return run_splits(plan, q, indices.shape[1], launch)
    if plan.family == "triton-heads-scaled":
        return launch_heads_kernel(attention_jit.sparse_mla_fwd_scaled, plan, q, kv, indices, sm_scale, remap)
    return launch_heads_kernel(attention_jit.sparse_mla_fwd, plan, q, kv, indices, sm_scale, remap, KV_FP8=fp8)


def _check_plan(plan: AttentionPlan, q, kv_format: str, remap) -> None:
    if plan.backend != "triton":
        raise AttentionPlanError(f"plan for backend {plan.backend!r} given to the 'triton' attention: "
                                 "expected one from its own plan_attention")
    if (kv_format == "fp8_ds_mla") != (plan.fp8_rows != "none"):
        raise AttentionPlanError(f"plan fp8_rows {plan.fp8_rows!r} for kv_format {kv_format!r}: expected "
                                 "'none' for bf16 rows, 'in_kernel' or 'dequantise_once' for fp8_ds_mla")
    if plan.family in GLUON_FAMILIES:
        if not (q.is_cuda and q.dtype == torch.bfloat16 and q.shape[1] <= plan.block_h <= 32
                and remap is None and plan.fp8_rows == "in_kernel"):
            raise AttentionPlanError(
                f"plan family {plan.family!r}: needs CUDA, bf16 q, at most {plan.block_h} heads (<= 32), fp8 "
                f"rows read in the kernel, no fused remap; got {q.device.type} {q.dtype} q, {q.shape[1]} heads, "
                f"fp8_rows {plan.fp8_rows!r}, remap {'fused' if remap is not None else 'none'}")
    elif plan.family == "triton-heads-scaled":
        if plan.fp8_rows != "in_kernel":
            raise AttentionPlanError(f"plan family 'triton-heads-scaled' with fp8_rows {plan.fp8_rows!r}: "
                                     "expected 'in_kernel'")
    elif plan.family != "triton-heads":
        raise AttentionPlanError(f"plan family {plan.family!r}: not a Triton family")


def launch_heads_kernel(kernel, plan: AttentionPlan, q, kv, indices, sm_scale: float, remap=None,
                        **constexprs):
    """Run ``kernel`` (the signature of ``attention_jit.sparse_mla_fwd``; bench/variants' kernels
    too) over a grid of (head blocks, tokens, splits) with the plan's launch numbers; merge."""
    T, H, _ = q.shape
    pcu, pt, w, il = remap if remap is not None else (indices, 0, 1, 1)

    def launch(out, lse, per_split):
        grid = (triton.cdiv(H, plan.block_h), T, out.shape[0])
        kernel[grid](
            q, kv, indices, out, lse, pcu,
            q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            H, indices.shape[1], per_split, pt, sm_scale * _LOG2E,
            dcp_size=w, interleave=il, REMAP=remap is not None, BLOCK_H=plan.block_h,
            BLOCK_K=plan.block_k, DOT_DTYPE=_DOT_DTYPES[q.dtype],
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=plan.num_warps, num_stages=plan.num_stages, **constexprs,
        )

    return run_splits(plan, q, indices.shape[1], launch)


def run_splits(plan: AttentionPlan, q, topk: int, launch):
    """Allocate the partials of ``plan.num_splits`` splits (whole key blocks each, recounted from
    this call's ``topk``), call ``launch(out, lse, keys_per_split)``, merge them.
    Returns ``(out [T, H, 512] q.dtype, lse [T, H] float32)``."""
    T, H, _ = q.shape
    per_split = keys_per_split(topk, plan.num_splits, plan.block_k)
    splits = max(1, triton.cdiv(topk, per_split))
    lse = torch.empty(splits, T, H, dtype=torch.float32, device=q.device)
    out = torch.empty(splits, T, H, D_V, dtype=q.dtype if splits == 1 else torch.float32, device=q.device)
    if T == 0:
        return out[0].to(q.dtype), lse[0]
    launch(out, lse, per_split)
    if splits == 1:
        return out[0], lse[0]
    final = torch.empty(T, H, D_V, dtype=q.dtype, device=q.device)
    final_lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    lse_merge_into(out, lse, final, final_lse)
    return final, final_lse


def sparse_mla_overflow(q, kv, over, count, width: int, out, lse, sm_scale: float,
                        kv_format: str = "bf16") -> None:
    """Triton ``sparse_mla_overflow`` (contract: the reference's): one program per (16 heads,
    token); a token without overflow (``count <= width``, the common case) costs a load of its
    count. ``out`` / ``lse`` are updated in place. Keys 64 at a time, 8 warps, no software
    pipelining: faster than 32 keys, 4 warps and 2 stages (bench/overflow_sweep.py;
    bench/RESULTS.md, "What changed (each timed against what it replaced)")."""
    check_kv_format(kv_format)
    if kv.dim() == 3:
        kv = kv.reshape(-1, kv.shape[-1])
    T, H, _ = q.shape
    if T == 0 or over.shape[1] == 0:
        return
    assert q.stride(-1) == 1 and kv.stride(-1) == 1 and out.stride(-1) == 1
    assert lse.stride(-1) == 1 and lse.dtype == torch.float32
    over = over.contiguous()
    block_h = 16
    attention_jit.sparse_mla_overflow_kernel[(triton.cdiv(H, block_h), T)](
        q, kv, over, count, out, lse, q.stride(0), q.stride(1), kv.stride(0), over.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), H, width, sm_scale * _LOG2E,
        KV_FP8=kv_format == "fp8_ds_mla", BLOCK_H=block_h, BLOCK_K=64,
        DOT_DTYPE=_DOT_DTYPES[q.dtype], PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8, num_stages=1)
