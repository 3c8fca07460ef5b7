"""The harness's engine side: the block allocator against a position-by-position count of the
rows a rank owns, and the mini scheduler's budgets, determinism and completion."""

from __future__ import annotations

import numpy as np
import pytest

from cpplan.sim.allocator import BlockAllocator
from cpplan.sim.scheduler import MiniScheduler, preset_requests


def _rows_owned(extent: int, w: int, inter: int, rank: int) -> int:
    """Naive: position p lives on rank (p // I) % W."""
    return sum(1 for p in range(extent) if (p // inter) % w == rank)


@pytest.mark.parametrize("w,inter", [(1, 1), (2, 1), (3, 2), (4, 64)])
def test_allocator_holds_ceil_of_owned_rows(w, inter):
    bs = 16
    for rank in range(w):
        alloc = BlockAllocator(64, bs, w, rank, inter)
        extents = {"a": 1, "b": 37, "c": 200}
        for rid, extent in extents.items():
            alloc.ensure(rid, extent)
        for rid, extent in extents.items():
            assert len(alloc.blocks[rid]) == -(-_rows_owned(extent, w, inter, rank) // bs)
        held = [b for blocks in alloc.blocks.values() for b in blocks]
        assert 0 not in held and len(set(held)) == len(held)
        table = alloc.table(["c", "zz", "a"], width=16)
        assert table.dtype == np.int32 and table.shape == (3, 16)
        assert list(table[0, : len(alloc.blocks["c"])]) == alloc.blocks["c"]
        assert not table[1].any()  # an unknown request: all dummy
        freed = list(alloc.blocks["c"])
        alloc.release("c")
        assert "c" not in alloc.blocks and set(freed) <= set(alloc.free)


def test_allocator_refuses_when_out_of_blocks():
    alloc = BlockAllocator(3, 4, 1, 0, 1)  # blocks 1 and 2 usable
    alloc.ensure("a", 8)
    with pytest.raises(MemoryError, match="out of KV blocks"):
        alloc.ensure("b", 1)


def _drive(sched: MiniScheduler, steps: int = 400):
    out = []
    for step_id in range(steps):
        step = sched.schedule(step_id)
        if step is None:
            break
        out.append((step, list(sched.preempted)))
        sched.complete()
    return out


def test_scheduler_budgets_determinism_and_completion():
    def make():
        return MiniScheduler(preset_requests(2, 512, num_long=3), token_budget=64,
                             max_running=6, kv_token_budget=700, max_prefill_chunk=24)

    reqs = preset_requests(2, 512, num_long=3)
    run_a, run_b = _drive(make()), _drive(make())
    assert [s.num_scheduled_tokens.np().tolist() for s, _ in run_a] == \
        [s.num_scheduled_tokens.np().tolist() for s, _ in run_b]
    for step, _ in run_a:
        q = step.num_scheduled_tokens.np()
        c = step.num_computed_tokens.np()
        pre = step.is_prefilling.np().astype(bool)
        assert q.sum() <= 64 and len(q) <= 6
        assert (c + q).sum() <= 700
        assert np.all(q[~pre] == 1) and np.all(q[pre] <= 24)
        assert len(set(step.req_ids)) == len(step.req_ids)
    sched = make()
    _drive(sched)
    assert sorted(sched.finished) == sorted(r.req_id for r in reqs)
    assert not sched.running and not sched.waiting
