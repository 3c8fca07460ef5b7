"""The Triton backend: a Triton kernel for every op of the set.

Modules: ``plan`` (the attention plan: family, splits, launch numbers), ``attention`` (runs a
plan; jitted bodies in ``attention_jit``; the Gluon decode in ``..gluon``), ``indexer_tiled``
(the indexer: query x key tiles, the Gluon prefill logits in ``..gluon`` on Hopper, then an
exact top-k from a sampled threshold, ``indexer_select``), ``pack``,
``index``, ``merge`` (each with its jitted bodies in a ``*_jit`` module). Inside this package
``import triton`` is the Triton compiler (absolute imports), never this package. Every op of
the set has a Triton kernel; the test-only ops' Triton versions (``merge.lse_merge``,
``indexer_tiled.indexer_scores`` / ``indexer_topk``, ``pack.dequantize_fp8_ds_mla``) are module
functions (``dispatch``'s docstring).
"""

from __future__ import annotations

from ..dispatch import KernelSet
from . import attention, index, indexer_tiled, merge, pack, plan

TRITON = KernelSet(
    name="triton",
    quantize_fp8_ds_mla=pack.quantize_fp8_ds_mla,
    quantize_indexer_k=pack.quantize_indexer_k,
    pack_fp8_ds_mla_into=pack.pack_fp8_ds_mla_into,
    pack_indexer_k_into=pack.pack_indexer_k_into,
    plan_attention=plan.plan_attention,
    sparse_mla_attention=attention.sparse_mla_attention,
    sparse_mla_overflow=attention.sparse_mla_overflow,
    lse_scale=merge.lse_scale,
    remap_to_gathered=index.remap_to_gathered,
    filter_local_slots=index.filter_local_slots,
    merge_topk_candidates=merge.merge_topk_candidates,
    merge_local_slots=merge.merge_local_slots,
    indexer_topk_prefill=indexer_tiled.indexer_topk_prefill,
    indexer_topk_decode=indexer_tiled.indexer_topk_decode,
)

__all__ = ["TRITON"]
