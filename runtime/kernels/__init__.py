"""Sparse-MLA kernels behind one dispatch table: torch reference (CPU, CUDA) and Triton (CUDA;
its attention runs a Gluon kernel for the few-head fp8 decode on Hopper).

Use ``get_kernels(device, backend=None)`` and call ops on the returned ``KernelSet`` (the ops
step code calls); attention is planned once (``plan_attention`` -> ``AttentionPlan``) and run per
layer with ``plan=``. The reference functions are also exported directly, those only tests and
the oracle call (dequantisation, ``indexer_topk`` over explicit rows, ...) included. Layout: ``dispatch.py`` (the table),
``attention_plan.py`` (the plan), one package per backend: ``reference/`` (contracts in its
docstrings), ``triton/``, ``gluon/`` (used by ``triton/``).
"""

from .attention_plan import AttentionPlan, AttentionPlanError, DeviceSpec
from .dispatch import (
    BACKENDS,
    OP_NAMES,
    REFERENCE,
    KernelBackendError,
    KernelSet,
    get_kernels,
)
from .reference import (
    D_QK,
    D_ROPE,
    D_V,
    FP8_DS_MLA_BYTES,
    INDEXER_K_BYTES,
    NO_KEY,
    decode_key_slots,
    deinterleave_index_select,
    dequantize_fp8_ds_mla,
    dequantize_indexer_k,
    filter_local_slots,
    gather_indexer_k,
    indexer_k_planes,
    indexer_scores,
    indexer_topk,
    indexer_topk_decode,
    indexer_topk_prefill,
    lse_merge,
    pack_fp8_ds_mla_into,
    pack_indexer_k_into,
    prefill_key_rows,
    quantize_fp8_ds_mla,
    quantize_indexer_k,
    remap_to_gathered,
    scatter_indexer_k,
    sparse_mla_attention,
    topk_reference_order,
)

__all__ = [
    "BACKENDS", "D_QK", "D_ROPE", "D_V", "FP8_DS_MLA_BYTES", "INDEXER_K_BYTES", "NO_KEY",
    "OP_NAMES", "REFERENCE", "AttentionPlan", "AttentionPlanError", "DeviceSpec",
    "KernelBackendError", "KernelSet", "decode_key_slots", "deinterleave_index_select",
    "dequantize_fp8_ds_mla", "dequantize_indexer_k", "filter_local_slots", "gather_indexer_k",
    "get_kernels", "indexer_k_planes", "indexer_scores", "indexer_topk", "indexer_topk_decode",
    "indexer_topk_prefill", "lse_merge", "pack_fp8_ds_mla_into", "pack_indexer_k_into",
    "prefill_key_rows", "quantize_fp8_ds_mla", "quantize_indexer_k", "remap_to_gathered",
    "scatter_indexer_k", "sparse_mla_attention", "topk_reference_order",
]
