"""The torch reference backend: the semantics every other backend is tested against.

Everything runs on CPU (float32 / float64) and on CUDA; nothing syncs on purpose except where a
docstring says so (the reference is not the hot path on the GPU). Modules: ``formats`` (fp8
cache formats, the dimension constants), ``attention`` (sparse-MLA attention, LSE merge, the
trivial ``plan_attention``), ``index`` (token ids -> gathered rows / local slots), ``indexer``
(indexer scores and the reference-order top-k). Vocabulary (docs/design.md §Symbols): T query
rows, H attention heads, Hi indexer heads, W DCP world size, I interleave, PT padded local total
of a gather chunk, B block (page) size.
"""

from .attention import (
    lse_merge,
    lse_merge_weight,
    lse_scale,
    plan_attention,
    sparse_mla_attention,
    sparse_mla_overflow,
)
from .formats import (
    D_INDEXER,
    D_QK,
    D_ROPE,
    D_V,
    FP8_DS_MLA_BYTES,
    FP8_GROUP,
    FP8_MAX,
    INDEXER_K_BYTES,
    NO_KEY,
    dequantize_fp8_ds_mla,
    dequantize_indexer_k,
    fp8_scale_exponent,
    gather_indexer_k,
    indexer_k_planes,
    pack_fp8_ds_mla_into,
    pack_indexer_k_into,
    quantize_fp8_ds_mla,
    quantize_indexer_k,
    quantize_indexer_q,
    scatter_indexer_k,
)
from .index import (
    compact_local_slots,
    compact_width,
    deinterleave_index_select,
    filter_local_slots,
    remap_to_gathered,
)
from .indexer import (
    decode_key_slots,
    indexer_scores,
    indexer_topk,
    indexer_topk_decode,
    indexer_topk_prefill,
    merge_local_slots,
    merge_topk_candidates,
    prefill_key_rows,
    topk_reference_order,
)

__all__ = [
    "D_INDEXER", "D_QK", "D_ROPE", "D_V", "FP8_DS_MLA_BYTES", "FP8_GROUP", "FP8_MAX",
    "INDEXER_K_BYTES", "NO_KEY", "compact_local_slots", "compact_width", "decode_key_slots",
    "deinterleave_index_select", "dequantize_fp8_ds_mla", "dequantize_indexer_k",
    "filter_local_slots", "fp8_scale_exponent", "gather_indexer_k", "indexer_k_planes",
    "indexer_scores", "indexer_topk", "indexer_topk_decode", "indexer_topk_prefill", "lse_merge",
    "lse_merge_weight", "lse_scale", "merge_local_slots", "merge_topk_candidates", "pack_fp8_ds_mla_into",
    "pack_indexer_k_into", "plan_attention", "prefill_key_rows", "quantize_fp8_ds_mla",
    "quantize_indexer_k", "quantize_indexer_q", "remap_to_gathered", "scatter_indexer_k",
    "sparse_mla_attention", "sparse_mla_overflow", "topk_reference_order",
]
