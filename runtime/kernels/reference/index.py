"""Reference index maps: global token ids -> gathered rows or -> this rank's cache slots.

docs/design.md §DCP sharding and §Gather chunks and the deinterleave map.
"""

from __future__ import annotations

import torch

from .formats import NO_KEY


def remap_to_gathered(
    token_ids: torch.Tensor,
    region_pcu: torch.Tensor,
    padded_local_total: int,
    dcp_size: int,
    interleave: int,
) -> torch.Tensor:
    """Global token ids -> rows of the rank-major gathered buffer ``[W * PT, bytes]``.

    token_ids: ``[T, K]`` int, a token position within query j's request (NO_KEY stays NO_KEY).
    region_pcu: ``[T]`` int, the padded-local prefix sum ``pcu[i]`` of query j's request region in
    the gather chunk. Row = ``owner(t) * PT + pcu + local(t)`` with ``owner(t) = (t // I) % W``,
    ``local(t) = (t // (W*I)) * I + t % I``. Returns ``[T, K]`` int32.
    """
    W, I = dcp_size, interleave
    t = token_ids.long()
    owner = (t // I) % W
    local = (t // (W * I)) * I + t % I
    rows = owner * padded_local_total + region_pcu.long()[:, None] + local
    return torch.where(t >= 0, rows, NO_KEY).to(torch.int32)


def filter_local_slots(
    token_ids: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
) -> torch.Tensor:
    """Global token ids -> this DCP rank's cache slots; ids owned by other ranks -> NO_KEY.

    token_ids: ``[T, K]`` int (NO_KEY = none); block_table: ``[T, max_blocks]`` int32, query j's
    request's local block table on this rank. slot = ``block_table[j, local // B] * B + local % B``.
    Returns ``[T, K]`` int32.
    """
    W, I, B = dcp_size, interleave, block_size
    t = token_ids.long()
    mine = (t >= 0) & (((t // I) % W) == dcp_rank)
    local = torch.where(mine, (t // (W * I)) * I + t % I, 0)
    blocks = torch.gather(block_table.long(), 1, local // B)
    return torch.where(mine, blocks * B + local % B, NO_KEY).to(torch.int32)


def deinterleave_index_select(gathered: torch.Tensor, deinterleave: torch.Tensor) -> torch.Tensor:
    """The plain copy: ``gathered [W*PT, bytes]`` rows in global order, ``[L, bytes]``."""
    return gathered.index_select(0, deinterleave.long())


def compact_width(topk: int, dcp_size: int) -> int:
    """Index width of a DCP rank's compacted decode attention: 9/8 of its expected share of
    the top-k (``topk / dcp_size``), rounded up to 64 slots (16 below topk 256), at most
    ``topk``. Rows holding more of their top-k than this take the overflow pass."""
    unit = 64 if topk >= 256 else 16
    want = -(-topk * 9 // (8 * dcp_size))
    return min(topk, -(-want // unit) * unit)


def compact_local_slots(
    token_ids: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`filter_local_slots`, this rank's slots packed to the front of each row in the
    row's order: ``(main [T, width], over [T, K - width], count [T])`` int32, where the row's
    ``count`` local slots fill ``main`` then ``over`` and every other entry is NO_KEY. A DCP
    rank attends over ``main`` (a narrower index than K) and only rows with ``count > width``
    over ``over`` (``sparse_mla_overflow``)."""
    slots = filter_local_slots(token_ids, block_table, block_size, dcp_size, dcp_rank,
                               interleave)
    mine = slots >= 0
    order = torch.argsort((~mine).to(torch.int8), dim=1, stable=True)
    packed = torch.gather(slots, 1, order)
    count = mine.sum(dim=1, dtype=torch.int32)
    return (packed[:, :width].contiguous(), packed[:, width:].contiguous(), count)
