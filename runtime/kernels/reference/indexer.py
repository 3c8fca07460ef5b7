"""Plain torch reference of the sparse-attention indexer (docs/design.md §Decode rows: LSE merge and top-k merge; §Indexer keys and scores).

score(query j, key) = sum_h w8[j, h] * ReLU(q8[j, h] . k_dequant), with ``(q8, w8) =
quantize_indexer_q(q, w)`` (the query in fp8 with one power-of-two scale per head, the scale
folded into the head weight, as the model's own indexer does: docs/design.md §4.3), then the
top-k keys in the **reference order**: score descending, then global token id ascending. The
key set of a query is given as a rectangle of key rows (rows of a packed K buffer) plus their global token ids, with
NO_KEY (-1) where a query has fewer keys than the rectangle is wide. Two helpers build that
rectangle for the two cases the runtime has:

- prefill (``prefill_key_rows``): keys = the request's tokens ``0 .. key_len[j]-1`` (key_len =
  query position + 1, causal) in a gather chunk's rank-major gathered K buffer; rows through
  ``remap_to_gathered``, ids = token positions.
- decode (``decode_key_slots``): keys = the tokens of this DCP rank's local shard of the request,
  ``local_len[j]`` of them, as cache slots through the local block table; ids = their global
  token positions ``(l // I) * W * I + rank * I + l % I``. Each rank's local top-k is then merged
  across ranks by the same order (exact).

``indexer_topk_prefill`` / ``indexer_topk_decode`` compose these; the Triton backend implements
the same two entry points without materialising the rectangles.
"""

from __future__ import annotations

import torch

from .formats import INDEXER_K_BYTES, NO_KEY, dequantize_indexer_k, gather_indexer_k, quantize_indexer_q
from .index import remap_to_gathered

_SCORE_BUDGET = 1 << 22  # gathered [t, L, 128] elements per chunk in indexer_scores


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, k_packed: torch.Tensor, key_rows: torch.Tensor
) -> torch.Tensor:
    """Indexer logits for a rectangle of keys.

    q: ``[T, Hi, 128]`` float (quantised here); weights: ``[T, Hi]`` float; k_packed:
    ``[N, 132]`` uint8 packed indexer keys (128 fp8 + fp32 scale); key_rows: ``[T, L]`` int, rows of k_packed, NO_KEY = none.
    Returns ``[T, L]`` scores: float64 on CPU (exact for the oracle: docs/design.md §Exact top-k needs exact scores), float32 on CUDA;
    -inf where key_rows is NO_KEY.
    """
    cdt = torch.float64 if q.device.type == "cpu" else torch.float32
    q, weights = quantize_indexer_q(q, weights)
    T, L = key_rows.shape
    out = torch.empty(T, L, dtype=cdt, device=q.device)
    step = max(1, _SCORE_BUDGET // max(L * q.shape[-1], 1))
    for t0 in range(0, T, step):
        rows = key_rows[t0 : t0 + step]
        valid = rows >= 0
        k = dequantize_indexer_k(k_packed.index_select(0, torch.where(valid, rows, 0).reshape(-1).long()))
        k = k.to(cdt).reshape(*rows.shape, -1)  # [t, L, 128]
        logits = torch.einsum("thd,tld->thl", q[t0 : t0 + step].to(cdt), k).clamp_min(0)
        s = torch.einsum("th,thl->tl", weights[t0 : t0 + step].to(cdt), logits)
        out[t0 : t0 + step] = s.masked_fill(~valid, float("-inf"))
    return out


def topk_reference_order(
    scores: torch.Tensor, key_ids: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k in the reference order: score descending, then id ascending.

    scores: ``[T, L]`` float; key_ids: ``[T, L]`` int global token ids, NO_KEY = not a key (its
    score is ignored). Returns ``(top_scores [T, topk] scores.dtype, top_ids [T, topk] int32)``;
    slots beyond the valid keys hold id NO_KEY and score -inf. Exact (two stable sorts), so it
    also serves the cross-rank merge of local candidates.
    """
    T = scores.shape[0]
    valid = key_ids >= 0
    s = scores.masked_fill(~valid, float("-inf"))
    ids = torch.where(valid, key_ids.long(), torch.iinfo(torch.int64).max)
    o1 = torch.sort(ids, dim=1, stable=True).indices
    s1 = torch.gather(s, 1, o1)
    o2 = torch.sort(s1, dim=1, descending=True, stable=True).indices
    order = torch.gather(o1, 1, o2)[:, :topk]
    top_s = torch.gather(s, 1, order)
    top_ids = torch.where(torch.gather(valid, 1, order), torch.gather(key_ids.long(), 1, order), NO_KEY)
    if order.shape[1] < topk:
        pad = topk - order.shape[1]
        top_s = torch.cat([top_s, top_s.new_full((T, pad), float("-inf"))], dim=1)
        top_ids = torch.cat([top_ids, top_ids.new_full((T, pad), NO_KEY)], dim=1)
    return top_s, top_ids.to(torch.int32)


def merge_topk_candidates(scores: torch.Tensor, key_ids: torch.Tensor, topk: int,
                          num_lists: int) -> torch.Tensor:
    """The cross-rank decode top-k merge (docs/design.md §3.6): ``scores`` / ``key_ids``
    ``[T, num_lists * topk]`` (rank-major columns) or ``[T, num_lists, topk]`` hold, per row,
    ``num_lists`` candidate lists, each in the reference order with NO_KEY pads last; returns
    the top-k ids over all lists, ``[T, topk]`` int32 in the reference order (NO_KEY pads).
    Here: :func:`topk_reference_order`, which does not need the lists sorted; a backend may
    rely on it (a merge, not a sort)."""
    s, i = (candidate_lists(x, topk, num_lists).reshape(x.shape[0], -1) for x in (scores, key_ids))
    return topk_reference_order(s, i, topk)[1]


def merge_local_slots(scores: torch.Tensor, key_ids: torch.Tensor, topk: int, num_lists: int,
                      dcp_rank: int, block_table: torch.Tensor, block_size: int,
                      interleave: int, width: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A DCP rank's share of the merged decode top-k, packed (docs/design.md §3.6):
    ``compact_local_slots(merge_topk_candidates(scores, key_ids, topk, num_lists),
    block_table, block_size, num_lists, dcp_rank, interleave, width)``, i.e. ``(main [T,
    width], over [T, topk - width], count [T])`` int32. A backend may rely on list
    ``dcp_rank`` holding exactly that rank's keys, in the merged order: its keys in the merged
    top-k are then the first ``count`` of that list, those whose rank among all the lists'
    candidates is below topk, and no merged list need be built."""
    from .index import compact_local_slots

    top = merge_topk_candidates(scores, key_ids, topk, num_lists)
    return compact_local_slots(top, block_table, block_size, num_lists, dcp_rank, interleave,
                               width)


def candidate_lists(x: torch.Tensor, topk: int, num_lists: int) -> torch.Tensor:
    """``merge_topk_candidates``' input ``[T, num_lists * topk]`` or ``[T, num_lists, topk]``
    as a ``[T, num_lists, topk]`` view (ValueError, got / expected, for any other shape)."""
    if x.dim() == 3 and tuple(x.shape[1:]) == (num_lists, topk):
        return x
    if x.dim() != 2 or x.shape[1] != num_lists * topk:
        raise ValueError(f"merge_topk_candidates: got {tuple(x.shape)}, expected "
                         f"[T, num_lists * topk = {num_lists * topk}] or [T, {num_lists}, {topk}]")
    return x.reshape(x.shape[0], num_lists, topk)


def indexer_topk(q, weights, k_packed, key_rows, key_ids, topk: int):
    """``topk_reference_order(indexer_scores(q, weights, k_packed, key_rows), key_ids, topk)``.

    key_ids: ``[T, L]`` global token ids matching key_rows (NO_KEY where key_rows is NO_KEY).
    """
    ids = torch.where(key_rows >= 0, key_ids.long(), NO_KEY)
    return topk_reference_order(indexer_scores(q, weights, k_packed, key_rows), ids, topk)


def prefill_key_rows(key_len, region_pcu, padded_local_total: int, dcp_size: int, interleave: int,
                     max_keys: int | None = None):
    """Key rectangle of prefill queries over a gather chunk's gathered K buffer.

    key_len: ``[T]`` int, keys of query j are its request's tokens ``0 .. key_len[j]-1``
    (0 = no keys, e.g. a padded row); region_pcu: ``[T]`` int (see ``remap_to_gathered``).
    max_keys: the rectangle width L (default ``max(key_len)``, which syncs).
    Returns ``(key_rows [T, L] int32, key_ids [T, L] int64)``, NO_KEY beyond key_len.
    """
    L = (int(key_len.max()) if key_len.numel() else 0) if max_keys is None else max_keys
    t = torch.arange(L, device=key_len.device)[None, :].expand(key_len.shape[0], L)
    ids = torch.where(t < key_len.long()[:, None], t, NO_KEY)
    rows = remap_to_gathered(ids, region_pcu, padded_local_total, dcp_size, interleave)
    return rows, ids


def decode_key_slots(local_len, block_table, block_size: int, dcp_size: int, dcp_rank: int,
                     interleave: int, max_keys: int | None = None):
    """Key rectangle of decode queries over this DCP rank's local paged K cache.

    local_len: ``[T]`` int, tokens of query j's request held by this rank (its shard of the
    extent); block_table: ``[T, max_blocks]`` int32 local block table of query j's request.
    Returns ``(slots [T, L] int32, key_ids [T, L] int64)``: local index l -> slot
    ``block_table[j, l // B] * B + l % B`` and global id ``(l // I) * W * I + rank * I + l % I``.
    """
    W, I, B = dcp_size, interleave, block_size
    L = (int(local_len.max()) if local_len.numel() else 0) if max_keys is None else max_keys
    l = torch.arange(L, device=local_len.device)[None, :].expand(local_len.shape[0], L)
    valid = l < local_len.long()[:, None]
    blocks = torch.gather(block_table.long(), 1, torch.where(valid, l // B, 0))
    slots = torch.where(valid, blocks * B + l % B, NO_KEY).to(torch.int32)
    ids = torch.where(valid, (l // I) * W * I + dcp_rank * I + l % I, NO_KEY)
    return slots, ids


def topk_out(out, T: int, topk: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` of ``indexer_topk_prefill`` checked: (scores ``[T, topk]`` float32, ids
    ``[T, topk]`` int32) on ``device``, views allowed (ValueError, got / expected)."""
    want = ((T, topk), torch.float32), ((T, topk), torch.int32)
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and all(isinstance(x, torch.Tensor) for x in out)):
        raise ValueError(f"indexer_topk_prefill out: got {type(out).__name__}, expected "
                         f"(scores [{T}, {topk}] float32, ids [{T}, {topk}] int32)")
    for x, (shape, dtype), name in zip(out, want, ("scores", "ids")):
        if tuple(x.shape) != shape or x.dtype != dtype or x.device != torch.device(device) \
                or (x.numel() and x.stride(-1) != 1):
            raise ValueError(f"indexer_topk_prefill out {name}: got {tuple(x.shape)} {x.dtype} "
                             f"on {x.device} (last stride {x.stride(-1)}), expected "
                             f"[{T}, {topk}] {dtype} on {device}, last stride 1")
    return out[0], out[1]


def indexer_topk_prefill(q, weights, k_gathered, key_len, region_pcu, padded_local_total: int,
                         dcp_size: int, interleave: int, topk: int, *,
                         max_keys: int | None = None, out=None):
    """Prefill top-k over a gather chunk. Returns ``(top_scores [T, topk], top_ids [T, topk]
    int32)``, ids = token positions in the request (feed them to ``remap_to_gathered`` for the
    attention rows). k_gathered: ``[W * PT, 132]`` uint8. Other args: ``prefill_key_rows``
    (pass ``max_keys`` from the plan: without it the width is read from the device, a sync).
    out: optional (scores, ids) to write them into and return (``topk_out``), e.g. rows of a
    larger buffer that also holds the decode rows' top-k (no concatenation afterwards).
    """
    if out is not None:
        out = topk_out(out, q.shape[0], topk, q.device)
    rows, ids = prefill_key_rows(key_len, region_pcu, padded_local_total, dcp_size, interleave,
                                 max_keys)
    top = indexer_topk(q, weights, k_gathered, rows, ids, topk)
    if out is None:
        return top
    out[0].copy_(top[0])
    out[1].copy_(top[1])
    return out


def indexer_topk_decode(q, weights, k_cache, local_len, block_table, block_size: int,
                        dcp_size: int, dcp_rank: int, interleave: int, topk: int, *,
                        max_keys: int | None = None):
    """This rank's local top-k of decode queries, as (score, global id) candidates.

    k_cache: ``[num_blocks, block_size * 132]`` uint8, the rank's block-planar paged indexer
    K cache (``formats.indexer_k_planes``). Returns ``(top_scores [T, topk], top_ids [T, topk]
    int32)``; merge across DCP ranks with ``topk_reference_order`` over the all-gathered
    ``[T, W * topk]`` candidates.
    """
    slots, ids = decode_key_slots(local_len, block_table, block_size, dcp_size, dcp_rank, interleave,
                                  max_keys)
    assert k_cache.shape[1] == block_size * INDEXER_K_BYTES, (k_cache.shape, block_size)
    rows = gather_indexer_k(k_cache, torch.arange(k_cache.shape[0] * block_size,
                                                  device=k_cache.device))  # slot s -> row s
    return indexer_topk(q, weights, rows, slots, ids, topk)
