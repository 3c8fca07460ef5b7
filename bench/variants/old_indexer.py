"""The first Triton indexer, one program per (query, block of 128 keys): bench/indexer.py's
"old" kernel, against which it times and checks the tiled one (the Triton set's indexer,
``runtime/kernels/triton/indexer_tiled.py``; the figures that retired this one: bench/RESULTS.md,
"The tiled indexer with the sampled-threshold select: now the default").

Scores sum_h w_h * ReLU(q_h . k) over packed fp8 keys, q quantised first
(``quantize_indexer_q``, docs/design.md §4.3): a [Hi, 128] x [128, 128] product on the fp8 keys
upcast exactly to the operand dtype, the per-key scale after it. Key rows from an explicit
rectangle (ROWS), a gather chunk's region (PREFILL) or the paged cache through the block table
(DECODE); the last two write int64 composites ``ordered(score) << 32 | (2**32 - 1 - c)`` and
``torch.topk`` of those is the reference order (docs/design.md §3.6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpplan.runtime.kernels.reference.formats import INDEXER_K_BYTES, NO_KEY
from cpplan.runtime.kernels.reference.indexer import topk_out, topk_reference_order
from cpplan.runtime.kernels.triton.pack import quantize_indexer_q

from .old_indexer_jit import indexer_kernel

MODE_ROWS, MODE_PREFILL, MODE_DECODE = 0, 1, 2
LOGITS_BUDGET_BYTES = 1 << 28
_BLOCK_L = 128
_DOT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _launch(q, weights, k, out, mode, composite, L, rows=None, lens=None, pcu=None, bt=None,
            PT=0, W=1, I=1, B=1, rank=0):
    # the fp8 indexer query (reference.quantize_indexer_q), its values in q's dtype
    q, weights = quantize_indexer_q(q, weights, dtype=q.dtype)
    T, HI, _ = q.shape
    dummy = out
    rows_, lens_, pcu_, bt_ = (x if x is not None else dummy for x in (rows, lens, pcu, bt))
    grid = (triton.cdiv(L, _BLOCK_L), T)
    indexer_kernel[grid](
        q, weights, k, out, rows_, lens_, pcu_, bt_,
        q.stride(0), q.stride(1), weights.stride(0), out.stride(0),
        rows.stride(0) if rows is not None else 0, bt.stride(0) if bt is not None else 0,
        HI, L, PT, B, rank, W=W, I=I,
        MODE=mode, COMPOSITE=composite, BLOCK_H=max(16, triton.next_power_of_2(HI)),
        BLOCK_L=_BLOCK_L, DOT_DTYPE=_DOT[q.dtype],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)


def indexer_scores(q, weights, k_packed, key_rows):
    """Triton ``indexer_scores`` (float32 scores ``[T, L]``, -inf where key_rows is NO_KEY)."""
    T, L = key_rows.shape
    out = torch.empty(T, L, dtype=torch.float32, device=q.device)
    if T and L:
        _launch(q, weights, k_packed, out, MODE_ROWS, False, L, rows=key_rows.contiguous())
    return out


def indexer_topk(q, weights, k_packed, key_rows, key_ids, topk: int):
    """Triton scores + exact reference-order top-k over explicit (key_rows, key_ids)."""
    ids = torch.where(key_rows >= 0, key_ids.long(), NO_KEY)
    return topk_reference_order(indexer_scores(q, weights, k_packed, key_rows), ids, topk)


def _decode_keys(keys, topk):
    """int64 sort keys [t, L] -> (scores [t, topk] float32, positions c [t, topk] int64, valid)."""
    top = torch.topk(keys, min(topk, keys.shape[1]), dim=1, largest=True, sorted=True).values
    ordered = (top >> 32).to(torch.int32)
    bits = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    scores = bits.view(torch.float32)
    c = 4294967295 - (top & 4294967295)
    return scores, c, ~torch.isneginf(scores)


def _chunked_topk(q, topk, L, budget, launch, to_ids, out=None):
    T = q.shape[0]
    if out is None:
        top_s = torch.empty((T, topk), dtype=torch.float32, device=q.device)
        top_i = torch.empty((T, topk), dtype=torch.int32, device=q.device)
    else:
        top_s, top_i = topk_out(out, T, topk, q.device)
    top_s.fill_(float("-inf"))
    top_i.fill_(NO_KEY)
    if T == 0 or L == 0:
        return top_s, top_i
    step = max(1, budget // (8 * L))
    keys = torch.empty(min(step, T), L, dtype=torch.int64, device=q.device)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        launch(t0, t1, keys[: t1 - t0])
        s, c, valid = _decode_keys(keys[: t1 - t0], topk)
        kk = s.shape[1]
        top_s[t0:t1, :kk] = s
        top_i[t0:t1, :kk] = torch.where(valid, to_ids(c), NO_KEY).to(torch.int32)
    return top_s, top_i


def indexer_topk_prefill(q, weights, k_gathered, key_len, region_pcu, padded_local_total: int,
                         dcp_size: int, interleave: int, topk: int, *, max_keys: int | None = None,
                         logits_budget_bytes: int = LOGITS_BUDGET_BYTES, out=None):
    """Triton ``indexer_topk_prefill`` (contract in ``reference.indexer``); scores float32.

    max_keys: the widest key_len (from the plan; default ``max(key_len)``, which syncs).
    """
    L = (int(key_len.max()) if key_len.numel() else 0) if max_keys is None else max_keys
    key_len, region_pcu = key_len.contiguous(), region_pcu.contiguous()

    def launch(t0, t1, out):
        _launch(q[t0:t1], weights[t0:t1], k_gathered, out, MODE_PREFILL, True, L,
                lens=key_len[t0:t1], pcu=region_pcu[t0:t1], PT=padded_local_total,
                W=dcp_size, I=interleave)

    return _chunked_topk(q, topk, L, logits_budget_bytes, launch, lambda c: c, out)


def indexer_topk_decode(q, weights, k_cache, local_len, block_table, block_size: int,
                        dcp_size: int, dcp_rank: int, interleave: int, topk: int, *,
                        max_keys: int | None = None, logits_budget_bytes: int = LOGITS_BUDGET_BYTES):
    """Triton ``indexer_topk_decode``: the rank's local top-k as (score, global id) candidates
    from the block-planar cache ``k_cache [num_blocks, block_size * 132]``."""
    L = (int(local_len.max()) if local_len.numel() else 0) if max_keys is None else max_keys
    assert k_cache.dim() == 2 and k_cache.shape[1] == block_size * INDEXER_K_BYTES, \
        (k_cache.shape, block_size)
    local_len, block_table = local_len.contiguous(), block_table.contiguous()
    W, I = dcp_size, interleave

    def launch(t0, t1, out):
        _launch(q[t0:t1], weights[t0:t1], k_cache, out, MODE_DECODE, True, L,
                lens=local_len[t0:t1], bt=block_table[t0:t1], W=W, I=I, B=block_size,
                rank=dcp_rank)

    return _chunked_topk(q, topk, L, logits_budget_bytes, launch,
                         lambda c: (c // I) * W * I + dcp_rank * I + c % I)
