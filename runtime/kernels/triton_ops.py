"""The Triton ``KernelSet``: Triton kernels where they exist, the torch reference elsewhere.

Ops kept on the reference (listed in ``TRITON.backend_of``): dequantisation helpers (tests and
oracles only), ``deinterleave_index_select`` (it *is* the plain torch copy, kept for
comparison) and ``topk_reference_order`` (the cross-rank candidate merge: two stable sorts of
``[nd, W * topk]``, torch's sort is the fast path there).
"""

from __future__ import annotations

from . import reference as ref
from . import triton_attention, triton_index, triton_indexer, triton_merge, triton_pack
from .dispatch import KernelSet

_REF_OPS = ("dequantize_fp8_ds_mla", "dequantize_indexer_k", "deinterleave_index_select",
            "topk_reference_order")

TRITON = KernelSet(
    name="triton",
    quantize_fp8_ds_mla=triton_pack.quantize_fp8_ds_mla,
    dequantize_fp8_ds_mla=ref.dequantize_fp8_ds_mla,
    quantize_indexer_k=triton_pack.quantize_indexer_k,
    dequantize_indexer_k=ref.dequantize_indexer_k,
    pack_fp8_ds_mla_into=triton_pack.pack_fp8_ds_mla_into,
    pack_indexer_k_into=triton_pack.pack_indexer_k_into,
    sparse_mla_attention=triton_attention.sparse_mla_attention,
    lse_merge=triton_merge.lse_merge,
    remap_to_gathered=triton_index.remap_to_gathered,
    filter_local_slots=triton_index.filter_local_slots,
    deinterleave_index_select=ref.deinterleave_index_select,
    indexer_scores=triton_indexer.indexer_scores,
    topk_reference_order=ref.topk_reference_order,
    indexer_topk=triton_indexer.indexer_topk,
    indexer_topk_prefill=triton_indexer.indexer_topk_prefill,
    indexer_topk_decode=triton_indexer.indexer_topk_decode,
    backend_of=tuple((op, "reference") for op in _REF_OPS),
)
