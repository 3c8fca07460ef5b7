"""The Triton backend: Triton kernels where they exist, the torch reference elsewhere.

Modules: ``plan`` (the attention plan: family, splits, launch numbers), ``attention`` (runs a
plan; jitted bodies in ``attention_jit``; the Gluon decode in ``..gluon``), ``indexer_tiled``
(the step's indexer: query x key tiles and an exact sampled-threshold top-k), ``indexer`` (the
earlier per-query kernel: scores and the explicit-rows entry points, and bench's baseline),
``pack``, ``index``, ``merge`` (each with its jitted bodies in a ``*_jit`` module). Inside this
package ``import triton`` is the Triton compiler (absolute imports), never this package.

Ops kept on the reference (listed in ``TRITON.backend_of``): dequantisation helpers (tests and
oracles only), ``deinterleave_index_select`` (it *is* the plain torch copy, kept for
comparison), ``topk_reference_order`` and ``merge_topk_candidates`` (the cross-rank candidate
merge: two stable sorts of ``[nd, W * topk]``; ``merge.merge_topk_candidates`` merges the sorted
lists without sorting, waiting for a GPU measurement before it becomes the default).
"""

from __future__ import annotations

from .. import reference as ref
from ..dispatch import KernelSet
from . import attention, index, indexer, indexer_tiled, merge, pack, plan

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
    # the W > 1 decode merge in Triton (a merge of the W sorted candidate lists, no sort; the
    # LSE weights and scaling in one pass): P = W = 2 decode step (64 x 2k-6k) replayed 2.65 ms
    # vs 3.18 with the torch path, 64k-128k 5.18 vs 6.05 (bench/step_gpu.py --merge both, two
    # H200s, 2026-11-30)
    lse_scale=merge.lse_scale,
    remap_to_gathered=index.remap_to_gathered,
    filter_local_slots=index.filter_local_slots,
    sparse_mla_overflow=attention.sparse_mla_overflow,
    deinterleave_index_select=ref.deinterleave_index_select,
    indexer_scores=indexer.indexer_scores,
    topk_reference_order=ref.topk_reference_order,
    merge_topk_candidates=merge.merge_topk_candidates,
    merge_local_slots=merge.merge_local_slots,
    indexer_topk=indexer.indexer_topk,
    # the tiled indexer (fp8 planar prefill logits, sampled-threshold select): T 4096 over
    # N 32768 3.81 ms vs 15.79 for the first kernel, same selection and order (bench/indexer.py
    # --quick, H200, 2026-12-01, seventh session; tiles: indexer_tiled.IndexerTiles, e.g. through
    # functools.partial(indexer_tiled.indexer_topk_decode, tiles=...) in dataclasses.replace)
    indexer_topk_prefill=indexer_tiled.indexer_topk_prefill,
    indexer_topk_decode=indexer_tiled.indexer_topk_decode,
    backend_of=tuple((op, "reference") for op in _REF_OPS),
)

__all__ = ["TRITON"]
