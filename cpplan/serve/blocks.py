"""Paged KV blocks of every DCP rank, as one deterministic book (no torch).

Each DCP rank holds ``shard_count(extent, W, I, rank)`` KV rows of a request of ``extent``
tokens (docs/design.md §3.4) in its own blocks of ``block_size`` rows; block 0 of every rank
is the reserved dummy block. The scheduler runs the same book on every rank (it sees only
global facts), so a preemption decided because one rank's blocks run out is decided alike on
all ranks; each rank reads its own block table from the book.
"""

from __future__ import annotations

import numpy as np

from cpplan.schemas.sharding import shard_count


class RankBlocks:
    """One DCP rank's blocks: request id -> local block ids (block 0 never handed out)."""

    def __init__(self, num_blocks: int, block_size: int, dcp_size: int, dcp_rank: int,
                 interleave_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.w, self.rank, self.inter = dcp_size, dcp_rank, interleave_size
        self.free = list(range(num_blocks - 1, 0, -1))  # pop() hands out 1, 2, ...
        self.blocks: dict[str, list[int]] = {}

    def needed(self, extent: int) -> int:
        """Blocks this rank holds for a request of ``extent`` tokens."""
        rows = int(shard_count(np.int64(extent), self.w, self.inter, self.rank))
        return -(-rows // self.block_size)

    def shortfall(self, req_id: str, extent: int) -> int:
        """Blocks missing to hold ``req_id`` at ``extent`` tokens (0: it fits)."""
        more = self.needed(extent) - len(self.blocks.get(req_id, ()))
        return max(0, more - len(self.free))

    def grow(self, req_id: str, extent: int) -> None:
        mine = self.blocks.setdefault(req_id, [])
        need = self.needed(extent)
        if need - len(mine) > len(self.free):
            raise AssertionError(f"rank {self.rank}: grow without a shortfall check")
        while len(mine) < need:
            mine.append(self.free.pop())

    def release(self, req_id: str) -> None:
        self.free.extend(reversed(self.blocks.pop(req_id, [])))


class BlockBook:
    """The blocks of DCP ranks 0..W-1 (``num_blocks`` per rank, block 0 reserved)."""

    def __init__(self, num_blocks: int, block_size: int, dcp_size: int,
                 interleave_size: int) -> None:
        self.num_blocks = num_blocks
        self.ranks = [RankBlocks(num_blocks, block_size, dcp_size, r, interleave_size)
                      for r in range(dcp_size)]

    def fits(self, req_id: str, extent: int) -> bool:
        """Whether every rank can hold ``req_id`` at ``extent`` tokens now."""
        return all(r.shortfall(req_id, extent) == 0 for r in self.ranks)

    def capacity_ok(self, extent: int) -> bool:
        """Whether an empty book could hold one request of ``extent`` tokens."""
        return all(r.needed(extent) <= self.num_blocks - 1 for r in self.ranks)

    def grow(self, req_id: str, extent: int) -> None:
        for r in self.ranks:
            r.grow(req_id, extent)

    def release(self, req_id: str) -> None:
        for r in self.ranks:
            r.release(req_id)

    def table(self, dcp_rank: int, req_ids, width: int) -> np.ndarray:
        """``[len(req_ids), width]`` int32: DCP rank ``dcp_rank``'s blocks of each request
        (zeros past its last block)."""
        held = self.ranks[dcp_rank].blocks
        out = np.zeros((len(req_ids), width), dtype=np.int32)
        for i, rid in enumerate(req_ids):
            mine = held.get(rid, ())
            out[i, : len(mine)] = mine
        return out

    def blocks_for(self, extent: int) -> int:
        """Blocks the fullest rank needs for ``extent`` tokens (a table's width)."""
        return max(r.needed(extent) for r in self.ranks)
