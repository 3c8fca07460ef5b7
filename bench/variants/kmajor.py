"""Launcher of the keys-major bench variant (``kmajor_jit.py``) through the runtime's split/merge.

    sparse_mla_attention_kmajor(q, kv, indices, sm_scale, kv_format, plan=plan, prefetch=True)

``plan`` is a Triton ``AttentionPlan`` of a heads family (``dataclasses.replace`` its launch
numbers: block_k 32 was this layout's best); only its splits and launch numbers are read.
"""

from __future__ import annotations

import dataclasses

from cpplan.runtime.kernels.triton.attention import launch_heads_kernel
from cpplan.runtime.kernels.triton.pack import dequantize_fp8_ds_mla
from cpplan.runtime.kernels.triton.plan import heads_block

from .kmajor_jit import sparse_mla_fwd_kmajor


def sparse_mla_attention_kmajor(q, kv, indices, sm_scale: float, kv_format: str = "bf16", *, plan,
                                prefetch: bool = False, evict: bool = False):
    """Same contract as ``reference.sparse_mla_attention``; the plan's fp8_rows are honoured."""
    if kv.dim() == 3:
        kv = kv.reshape(-1, kv.shape[-1])
    fp8 = kv_format == "fp8_ds_mla"
    if fp8 and plan.fp8_rows == "dequantise_once":
        kv, fp8 = dequantize_fp8_ds_mla(kv, q.dtype), False
    plan = dataclasses.replace(plan, block_h=heads_block(q.shape[1]))
    return launch_heads_kernel(sparse_mla_fwd_kmajor, plan, q, kv, indices.contiguous(), sm_scale,
                               KV_FP8=fp8, PREFETCH=prefetch, EVICT=evict)
