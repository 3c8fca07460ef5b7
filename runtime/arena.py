"""A ring of pinned host arenas for a step's int64 tables, one H2D copy per bind.

Each arena holds ``capacity`` int64 words, sized once at start-up. ``pack`` waits until the
arena's previous copy has completed (:meth:`ArenaRing.wait_arena_free`, the one named sync of a
step; in steady state it never blocks), writes the tables into it, issues one non-blocking copy
to the matching device arena and records an event behind it. On CPU the host arena is used
directly (no copy, no event). Overflow is a CapacityError that states the numbers.
"""

from __future__ import annotations

import numpy as np
import torch

from cpplan.runtime.segments import graph_segments
from cpplan.schemas.errors import CapacityError


class ArenaRing:
    """``depth`` arenas of ``capacity`` int64 words on ``device``.

    Views returned by :meth:`pack` live until the same arena is packed again, ``depth`` binds
    later: a bound step must finish before then.
    """

    def __init__(self, capacity: int, device: torch.device, depth: int = 2) -> None:
        self.capacity, self.device, self.depth = int(capacity), torch.device(device), depth
        on_cuda = self.device.type == "cuda"
        self.host = [torch.zeros(self.capacity, dtype=torch.int64, pin_memory=on_cuda)
                     for _ in range(depth)]
        self.dev = ([torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
                     for _ in range(depth)] if on_cuda else self.host)
        self.events = [None] * depth
        self.next = 0

    def wait_arena_free(self, slot: int) -> None:
        """The named sync: block until the last H2D copy out of arena ``slot`` has completed."""
        event = self.events[slot]
        if event is not None:
            event.synchronize()

    def pack(self, arrays: dict, step_id: int) -> dict:
        """Copy ``arrays`` (name -> int64 ndarray) into the next arena; return name -> device
        tensor views (1-d; reshape as needed)."""
        sizes = {k: int(v.size) for k, v in arrays.items()}
        need = sum(sizes.values())
        if need > self.capacity:
            biggest = max(sizes, key=sizes.get)
            raise CapacityError(
                f"step {step_id} needs {need:,} arena words, capacity {self.capacity:,} "
                f"(largest table {biggest}: {sizes[biggest]:,})")
        slot = self.next
        self.next = (slot + 1) % self.depth
        self.wait_arena_free(slot)
        host_np = self.host[slot].numpy()
        offsets, off = {}, 0
        for name, arr in arrays.items():
            host_np[off: off + sizes[name]] = np.asarray(arr, dtype=np.int64).reshape(-1)
            offsets[name] = off
            off += sizes[name]
        dev = self.dev[slot]
        if self.device.type == "cuda":
            dev[:need].copy_(self.host[slot][:need], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.events[slot] = event
        return {name: dev[offsets[name]: offsets[name] + sizes[name]] for name in arrays}


def arena_words(max_tokens: int, max_requests: int, max_blocks_per_request: int,
                pcp_size: int, dcp_size: int, graph_sizes: tuple[int, ...] = ()) -> int:
    """An upper bound of the int64 words one bind needs (see ``segments.build_tables``): segment
    ends and 7 parameters per segment, and the block tables, for ``max_requests`` per step.
    Rows R <= 2 * requests (a split request has two); segments: per token window (3 without
    kv_insert, P + 3 with) 2R + 1, one per gather region (<= requests), one per restored
    (rank, row) (<= P * R). A graph-replayable step of size G <= ``max_tokens`` packs a static
    layout instead (``segments.graph_segments`` segments, ``[G, 2^k]`` block tables with
    ``2^k < 2 * max_blocks_per_request``)."""
    rows = 2 * max_requests
    windows = pcp_size + 3 if pcp_size > 1 else 3
    segments = (windows * (2 * rows + 1) + (max_requests if dcp_size > 1 else 0)
                + pcp_size * rows)
    words = 8 * segments + max_requests * max_blocks_per_request
    blocks = 1 << max(0, max_blocks_per_request - 1).bit_length()
    for g in graph_sizes:
        if g <= max_tokens:
            words = max(words, 8 * graph_segments(g, pcp_size) + g * blocks)
    return words
