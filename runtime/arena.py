"""A ring of pinned host arenas for a step's int64 tables, one H2D copy per bind.

Each arena holds ``capacity`` int64 words, sized once at start-up. ``acquire`` waits until the
arena's previous copy has completed (:meth:`ArenaRing.wait_arena_free`, the one named sync of a
step; in steady state it never blocks) and hands out its host words, which bind's host kernel
fills in place; ``commit`` issues one non-blocking copy to the matching device arena and
records the arena's event behind it (``pack`` does both for arrays built elsewhere). On CPU the
host arena is used directly (no copy, no event). Overflow is a CapacityError that states the
numbers.
"""

from __future__ import annotations

import numpy as np
import torch

from cpplan.runtime.segments import graph_segments
from cpplan.runtime.tables import arena_overflow


class ArenaRing:
    """``depth`` arenas of ``capacity`` int64 words on ``device``.

    Views returned by :meth:`commit` (or :meth:`pack`) live until the same arena is packed
    again, ``depth`` binds later: a bound step must finish before then.
    """

    VIEW_CACHE = 256  # (arena, table sizes) -> views kept; a graph key's sizes never change

    def __init__(self, capacity: int, device: torch.device, depth: int = 2) -> None:
        self.capacity, self.device, self.depth = int(capacity), torch.device(device), depth
        self.on_cuda = self.device.type == "cuda"
        self.host = [torch.zeros(self.capacity, dtype=torch.int64, pin_memory=self.on_cuda)
                     for _ in range(depth)]
        self.host_words = [h.numpy() for h in self.host]
        self.dev = ([torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
                     for _ in range(depth)] if self.on_cuda else self.host)
        self.events = [None] * depth  # one per arena, recorded again by each of its copies
        self.next = 0
        self.commits = 0  # commits so far; owner[slot]: the commit whose words the slot holds
        self.owner = [0] * depth
        self._views: dict = {}

    def wait_arena_free(self, slot: int) -> None:
        """The named sync: block until the last H2D copy out of arena ``slot`` has completed."""
        event = self.events[slot]
        if event is not None:
            event.synchronize()

    def acquire(self) -> np.ndarray:
        """The next arena's host words (all ``capacity`` of them), once its last copy has
        completed (:meth:`wait_arena_free`): write the step's tables from word 0, then
        :meth:`commit`."""
        self.wait_arena_free(self.next)
        self.owner[self.next] = -1  # its words are rewritten now: the step bound there is gone
        return self.host_words[self.next]

    def commit(self, names: tuple[str, ...], sizes: tuple[int, ...]) -> dict:
        """Issue the one non-blocking copy of the acquired arena's first ``sum(sizes)`` words
        (tables ``names``, back to back) with an event behind it, and move to the next arena;
        return name -> device tensor view (1-d; reshape as needed). The views of a (arena,
        sizes) pair are made once: rebinding a graph key's static layout creates none."""
        slot = self.next
        self.next = (slot + 1) % self.depth
        self.commits += 1
        self.owner[slot] = self.commits
        key = (slot, names, sizes)
        cached = self._views.get(key)
        if cached is None:
            if len(self._views) >= self.VIEW_CACHE:
                self._views.clear()
            need, dev, views, off = sum(sizes), self.dev[slot], {}, 0
            for name, size in zip(names, sizes):
                views[name] = dev[off: off + size]
                off += size
            cached = self._views[key] = (self.host[slot][:need], dev[:need], views)
        if self.on_cuda:
            host, dev, _ = cached
            dev.copy_(host, non_blocking=True)
            event = self.events[slot]
            if event is None:
                event = self.events[slot] = torch.cuda.Event()
            event.record()
        return cached[2]

    @property
    def lease(self) -> tuple[int, int]:
        """(slot, commit) of the last commit: its views are valid while :meth:`holds` it."""
        slot = (self.next - 1) % self.depth
        return slot, self.owner[slot]

    def holds(self, lease: tuple[int, int]) -> bool:
        """Whether the arena slot of ``lease`` still holds that commit's words."""
        return self.owner[lease[0]] == lease[1]

    def pack(self, arrays: dict, step_id: int) -> dict:
        """Copy ``arrays`` (name -> int64 ndarray) into the next arena (:meth:`acquire`,
        :meth:`commit`); return name -> device tensor views (1-d; reshape as needed)."""
        sizes = {k: int(v.size) for k, v in arrays.items()}
        if sum(sizes.values()) > self.capacity:
            raise arena_overflow(step_id, sizes, self.capacity)
        host_np, off = self.acquire(), 0
        for name, arr in arrays.items():
            host_np[off: off + sizes[name]] = np.asarray(arr, dtype=np.int64).reshape(-1)
            off += sizes[name]
        return self.commit(tuple(sizes), tuple(sizes.values()))


def arena_words(max_tokens: int, max_requests: int, max_blocks_per_request: int,
                pcp_size: int, dcp_size: int, graph_sizes: tuple[int, ...] = ()) -> int:
    """An upper bound of the int64 words one bind needs (see ``segments.build_tables``): segment
    ends and 7 parameters per segment, and the block tables, for ``max_requests`` per step.
    Rows R <= 2 * requests (a split request has two); segments: per token window (3 without
    kv_insert, P + 3 with) 2R + 1, one per gather region (<= requests), one per restored
    (rank, row) (<= P * R); the sampled rows' two indices. A graph-replayable step of size
    G <= ``max_tokens`` packs a static layout instead (``segments.graph_segments`` segments,
    ``[G, 2^k]`` block tables with ``2^k < 2 * max_blocks_per_request``), and the sampled
    rows' indices after it (two per request: <= 2 * min(G, max_requests))."""
    rows = 2 * max_requests
    windows = pcp_size + 3 if pcp_size > 1 else 3
    segments = (windows * (2 * rows + 1) + (max_requests if dcp_size > 1 else 0)
                + pcp_size * rows)
    # + restore_sampled's indices: <= max_requests rows sent and as many restored
    words = 8 * segments + max_requests * max_blocks_per_request + 2 * max_requests
    blocks = 1 << max(0, max_blocks_per_request - 1).bit_length()
    for g in graph_sizes:
        if g <= max_tokens:
            words = max(words, 8 * graph_segments(g, pcp_size) + g * blocks
                        + 2 * min(g, max_requests))
    return words
