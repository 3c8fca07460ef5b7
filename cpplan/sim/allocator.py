"""The engine's side of the paged KV cache in the simulator: one rank's block allocator.

Each rank keeps its own local blocks for its DCP shard of every request (docs/design.md §3.4:
a rank holds ``shard_count`` of a request's rows); block 0 is the reserved dummy block.
"""

from __future__ import annotations

import numpy as np

from cpplan.schemas.sharding import shard_count


class BlockAllocator:
    """One rank's paged blocks: request id -> local block ids (block 0 is the dummy)."""

    def __init__(self, num_blocks: int, block_size: int, dcp_size: int, dcp_rank: int,
                 interleave_size: int) -> None:
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, 0, -1))
        self.block_size, self.w, self.rank, self.inter = block_size, dcp_size, dcp_rank, \
            interleave_size
        self.blocks: dict[str, list[int]] = {}

    def ensure(self, req_id: str, extent: int) -> None:
        held = int(shard_count(np.int64(extent), self.w, self.inter, self.rank))
        need = -(-held // self.block_size)
        mine = self.blocks.setdefault(req_id, [])
        while len(mine) < need:
            if not self.free:
                raise MemoryError(f"rank {self.rank}: out of KV blocks")
            mine.append(self.free.pop())

    def release(self, req_id: str) -> None:
        self.free.extend(reversed(self.blocks.pop(req_id, [])))

    def table(self, req_ids, width: int) -> np.ndarray:
        out = np.zeros((len(req_ids), width), dtype=np.int32)
        for i, rid in enumerate(req_ids):
            mine = self.blocks.get(rid, [])
            out[i, : len(mine)] = mine
        return out
