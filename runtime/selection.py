"""A layer's key selection within one bound step, kept for the layers that reuse it.

A full indexer layer selects each token's top-k keys (the indexer, and for W > 1 decode rows
the merge of every DCP rank's candidates); a shared layer (``ParallelConfig.indexer_sources``,
GLM-5's "S" layers) attends with its source layer's selection of the same step, so it runs no
indexer and issues no indexer collective (docs/design.md §3.8). ``attend(...,
return_selection=True)`` hands the selection to the engine (:class:`Attended`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from cpplan.runtime.kernels.reference.formats import NO_KEY


class Attended(NamedTuple):
    """``attend(..., return_selection=True)``: ``out`` ``[T, H, 512]`` (q's dtype);
    ``topk_ids`` ``[T, topk]`` int32, each token's selected global token ids (positions in its
    request) in the reference order, NO_KEY (-1) past its keys and on padded rows; ``lse``
    ``[T, H]`` float32, natural log, -inf where a token has no key. New tensors on the
    executor's device, owned by the caller."""

    out: torch.Tensor
    topk_ids: torch.Tensor
    lse: torch.Tensor


@dataclasses.dataclass
class Selection:
    """One attention pass's selection on this rank. ``ids`` ``[n, topk]`` int32 global token
    ids in the reference order (None on the compacted W > 1 decode path until asked for);
    ``slots`` ``[n, topk]`` int32 what the attention kernel reads (cache slots, or rows of a
    gathered chunk; None on the compacted path, which reads ``packed`` = (main, overflow,
    count) instead); ``candidates``: the DCP group's (scores, ids) lists the merged ids come
    from there."""

    ids: torch.Tensor | None
    slots: torch.Tensor | None
    packed: tuple | None = None
    candidates: tuple | None = None

    def token_ids(self, kernels, config) -> torch.Tensor:
        if self.ids is None:
            self.ids = kernels.merge_topk_candidates(*self.candidates, config.topk,
                                                     config.dcp_size)
        return self.ids


def keeps_selection(config, layer: int) -> bool:
    """Whether a later layer of ``config`` attends with ``layer``'s selection."""
    sources = config.indexer_sources
    return bool(sources) and layer in sources[layer + 1:]


class LayerPass:
    """One attend call's context: the layer, its indexer source, whether the engine asked for
    the selection (then each pass records its ids and LSE for :meth:`collected`)."""

    def __init__(self, layer: int, source: int, want: bool, keep: bool) -> None:
        self.layer, self.source, self.want, self.keep = layer, source, want, keep
        self.full = source == layer
        self.ids: list = []  # (lo, hi, [hi - lo, topk] int32)
        self.lse: list = []  # (lo, hi, [hi - lo, H] float32)

    def select(self, selections: dict, key: str, compute: Callable[[], Selection]) -> Selection:
        """The pass's selection: computed on a full layer (and kept if a later layer reuses
        it), the source layer's on a shared layer."""
        if not self.full:
            return selections[(self.source, key)]
        sel = compute()
        if self.keep:
            selections[(self.layer, key)] = sel
        return sel

    def collected(self, num_tokens: int, topk: int, num_heads: int, device):
        ids = torch.full((num_tokens, topk), NO_KEY, dtype=torch.int32, device=device)
        lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32,
                         device=device)
        for lo, hi, x in self.ids:
            ids[lo:hi] = x
        for lo, hi, x in self.lse:
            lse[lo:hi] = x
        return ids, lse
