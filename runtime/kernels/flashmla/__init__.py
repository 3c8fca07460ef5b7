"""The FlashMLA backend: FlashMLA's SM90 kernels for the attention shapes where they win, the
Triton backend for everything else.

``FLASHMLA`` is the Triton ``KernelSet`` with its two attention ops replaced:
``plan_attention`` returns a plan with ``backend="flashmla"`` where ``attention.choose`` picks
FlashMLA for the shape (the table of measurements in ``attention``'s docstring) and FlashMLA can
run here, and Triton's plan otherwise; ``sparse_mla_attention`` runs a FlashMLA plan through the
adapter in ``attention`` and hands any other plan to Triton. Which op runs where:
``FLASHMLA.backend_of`` (attention: "flashmla" or "triton" per plan, see ``plan.describe()``).
Installing: the ``cpplan[flashmla]`` extra (README, "FlashMLA backend").
"""

from __future__ import annotations

import dataclasses

from ..attention_plan import AttentionPlan, device_spec
from ..dispatch import OP_NAMES
from ..triton import TRITON
from . import attention

__all__ = ["FLASHMLA", "attention", "plan_attention", "sparse_mla_attention"]


def plan_attention(*, num_tokens: int, num_heads: int, topk: int, kv_format: str,
                   num_kv_rows: int, q_dtype, device, fused_remap: bool = False,
                   **forced) -> AttentionPlan:
    """A FlashMLA plan ("flashmla-decode": the fp8 decode kernel over 64-slot pages;
    "flashmla-prefill": bf16 rows, fp8 rows dequantised once first) where ``attention.choose``
    picks FlashMLA and it can run on ``device``; Triton's plan otherwise (and whenever a Triton
    choice is forced or the remap is fused into the kernel, which FlashMLA cannot do)."""
    pick = "triton"
    if not forced and not fused_remap and _runs_on(device):
        pick = attention.choose(num_tokens, num_heads, topk, kv_format, num_kv_rows, q_dtype)
    if pick == "triton":
        return TRITON.plan_attention(num_tokens=num_tokens, num_heads=num_heads, topk=topk,
                                     kv_format=kv_format, num_kv_rows=num_kv_rows,
                                     q_dtype=q_dtype, device=device, fused_remap=fused_remap,
                                     **forced)
    if kv_format != "fp8_ds_mla":
        return AttentionPlan(backend="flashmla", family="flashmla-prefill", fp8_rows="none")
    kernel = attention.fp8_kernel(num_tokens, topk, num_kv_rows)
    return AttentionPlan(backend="flashmla", family=f"flashmla-{kernel}",
                         fp8_rows="in_kernel" if kernel == "decode" else "dequantise_once")


def _runs_on(device) -> bool:
    """FlashMLA imports here and ``device`` (a device or a ``DeviceSpec``) is an sm_90 GPU."""
    spec = device_spec(device)
    return (spec.kind == "cuda" and spec.capability == (9, 0)
            and attention._import()[0] is not None)


def sparse_mla_attention(q, kv, indices, sm_scale: float, kv_format: str = "bf16", *,
                         plan: AttentionPlan | None = None, remap=None):
    """Runs ``plan`` (None: planned here from the operands' shapes): a FlashMLA plan through the
    adapter, any other through Triton's ``sparse_mla_attention``. Contract: the reference's."""
    if plan is None:
        rows = kv.shape[0] * kv.shape[1] if kv.dim() == 3 else kv.shape[0]
        plan = plan_attention(num_tokens=q.shape[0], num_heads=q.shape[1],
                              topk=indices.shape[1], kv_format=kv_format, num_kv_rows=rows,
                              q_dtype=q.dtype, device=q.device, fused_remap=remap is not None)
        if plan.backend == "flashmla" and attention.route(q, kv, indices, kv_format) != "flashmla":
            plan = TRITON.plan_attention(num_tokens=q.shape[0], num_heads=q.shape[1],
                                         topk=indices.shape[1], kv_format=kv_format,
                                         num_kv_rows=rows, q_dtype=q.dtype, device=q.device)
    if plan.backend != "flashmla":
        return TRITON.sparse_mla_attention(q, kv, indices, sm_scale, kv_format, plan=plan,
                                           remap=remap)
    if remap is not None:
        raise attention.KernelBackendError("a FlashMLA plan with a fused remap: FlashMLA takes "
                                           "plain rows (plan with fused_remap=True)")
    kernel = plan.family.removeprefix("flashmla-")
    return attention.sparse_mla_attention(q, kv, indices, sm_scale, kv_format,
                                          fp8_kernel_choice=kernel)


_inherited = dict(TRITON.backend_of)
FLASHMLA = dataclasses.replace(
    TRITON, name="flashmla", plan_attention=plan_attention,
    sparse_mla_attention=sparse_mla_attention,
    backend_of=tuple((op, _inherited.get(op, "triton")) for op in OP_NAMES
                     if op not in ("plan_attention", "sparse_mla_attention")))
