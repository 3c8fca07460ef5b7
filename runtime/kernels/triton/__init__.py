"""The Triton backend: Triton kernels where they exist, the torch reference elsewhere.

Modules: ``plan`` (the attention plan: family, splits, launch numbers), ``attention`` (runs a
plan; jitted bodies in ``attention_jit``; the Gluon decode in ``..gluon``), ``indexer_tiled``
(the indexer: query x key tiles, then an exact top-k from a sampled threshold), ``pack``,
``index``, ``merge`` (each with its jitted bodies in a ``*_jit`` module). Inside this package
``import triton`` is the Triton compiler (absolute imports), never this package.

Ops kept on the reference (listed in ``TRITON.backend_of``): the dequantisation helpers (tests
and oracles only), ``deinterleave_index_select`` (it *is* the plain torch copy) and
``topk_reference_order`` (two stable sorts).
"""

from __future__ import annotations

from .. import reference as ref
from ..dispatch import KernelSet
from . import attention, index, indexer_tiled, merge, pack, plan

_REF_OPS = ("dequantize_fp8_ds_mla", "dequantize_indexer_k", "deinterleave_index_select",
            "topk_reference_order")

TRITON = KernelSet(
    name="triton",
    quantize_fp8_ds_mla=pack.quantize_fp8_ds_mla,
    dequantize_fp8_ds_mla=ref.dequantize_fp8_ds_mla,
    quantize_indexer_k=pack.quantize_indexer_k,
    dequantize_indexer_k=ref.dequantize_indexer_k,
    pack_fp8_ds_mla_into=pack.pack_fp8_ds_mla_into,
    pack_indexer_k_into=pack.pack_indexer_k_into,
    plan_attention=plan.plan_attention,
    sparse_mla_attention=attention.sparse_mla_attention,
    lse_merge=merge.lse_merge,
    lse_scale=merge.lse_scale,
    remap_to_gathered=index.remap_to_gathered,
    filter_local_slots=index.filter_local_slots,
    sparse_mla_overflow=attention.sparse_mla_overflow,
    deinterleave_index_select=ref.deinterleave_index_select,
    indexer_scores=indexer_tiled.indexer_scores,
    topk_reference_order=ref.topk_reference_order,
    merge_topk_candidates=merge.merge_topk_candidates,
    merge_local_slots=merge.merge_local_slots,
    indexer_topk=indexer_tiled.indexer_topk,
    indexer_topk_prefill=indexer_tiled.indexer_topk_prefill,
    indexer_topk_decode=indexer_tiled.indexer_topk_decode,
    backend_of=tuple((op, "reference") for op in _REF_OPS),
)

__all__ = ["TRITON"]
