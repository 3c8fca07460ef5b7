"""Blocks a step writes must belong to one request and one position (bind refuses the rest):
the check against a token walk written separately, over random block tables with collisions,
and the aliasing that used to give silently wrong attention."""

from __future__ import annotations

import numpy as np
import pytest

from cpplan.api import ParallelConfig, StepExecutor, StepInput, compile
from cpplan.schemas.errors import StepInputError
from cpplan.schemas.sharding import local_index, owner

B = 64


def _walk_aliases(plan, dcp_rank: int, bt: np.ndarray) -> bool:
    """True when some block a request writes (a position in [c, c + q) that this rank owns)
    is also used at another (request, column), or a request uses one block at two columns:
    walking every token of every request."""
    cfg = plan.config
    c = plan.num_computed_tokens.np().astype(int)
    e = plan.extent().astype(int)
    uses: dict = {}  # block -> set of (request, column)
    written = set()
    for i in range(plan.num_requests):
        pos = np.arange(e[i])
        mine = pos[owner(pos, cfg.dcp_size, cfg.interleave_size) == dcp_rank]
        for p in mine.tolist():
            col = int(local_index(np.int64(p), cfg.dcp_size, cfg.interleave_size)) // B
            uses.setdefault(int(bt[i, col]), set()).add((i, col))
            if p >= c[i]:
                written.add(int(bt[i, col]))
    repeated = any(len({i for i, _ in u}) < len(u) for u in uses.values())  # one request's
    return repeated or any(len(uses[b]) > 1 for b in written)  # two columns, or a write shared


@pytest.mark.parametrize("w,inter", [(1, 1), (2, 1), (2, 2), (4, 64)])
def test_the_check_agrees_with_a_token_walk(w, inter):
    cfg = ParallelConfig(dcp_size=w, interleave_size=inter, num_heads=8, topk=16,
                         index_num_heads=4, max_model_len=1024, num_layers=1, hidden_size=64)
    rng = np.random.default_rng(w * 100 + inter)
    refused = accepted = 0
    for trial in range(120):
        n = int(rng.integers(1, 5))
        pre = rng.random(n) < 0.5
        c = rng.integers(0, 300, n)
        q = np.where(pre, rng.integers(1, 200, n), 1)
        step = StepInput.build(trial, [f"r{k}" for k in range(n)], c, q, pre)
        plan = compile(cfg, step)
        width = 10
        bt = (np.arange(1, n * width + 1).reshape(n, width)).astype(np.int32)
        for _ in range(int(rng.integers(0, 3))):  # a few collisions, anywhere
            i, j, i2, j2 = rng.integers(0, n), rng.integers(0, 2), rng.integers(0, n), \
                rng.integers(0, 2)
            bt[i, j] = bt[i2, j2]
        ex = StepExecutor(cfg, sm_scale=0.1, pcp_rank=0, dcp_rank=int(rng.integers(0, w)),
                          comm=None, device="cpu", max_tokens=1024, max_requests=8)
        want = _walk_aliases(plan, ex.dcp_rank, bt)
        try:
            ex.bind(plan, bt, n * width + 1)
            got = False
        except StepInputError as exc:
            assert ("expected each block a step writes to belong to one request" in str(exc)
                    or "expected each block of a request at one column" in str(exc))
            got = True
        assert got == want, (trial, bt.tolist(), c.tolist(), q.tolist())
        refused += got
        accepted += not got
    assert refused >= 5 and accepted >= 5  # both outcomes exercised


def test_shared_read_only_prefix_blocks_stay_legal():
    cfg = ParallelConfig(num_heads=8, topk=16, index_num_heads=4, max_model_len=1024,
                         num_layers=1, hidden_size=64)
    ex = StepExecutor.local(cfg, sm_scale=0.1, max_tokens=64, max_requests=4)
    step = StepInput.build(0, ["a", "b"], [100, 100], [1, 1], [False, False])
    ex.bind(compile(cfg, step), np.array([[1, 2], [1, 3]], np.int32), 8)  # block 1 shared, read
    with pytest.raises(StepInputError, match="block 2 is written by request 1 .'b'. at "
                                             "block-table column 1 and also used by request 0"):
        ex.bind(compile(cfg, step), np.array([[1, 2], [1, 2]], np.int32), 8)


def test_huge_block_ids_are_checked_without_a_huge_stamp_array():
    """Block ids near 2**31 (no num_blocks given): renumbered, not stamped by id."""
    cfg = ParallelConfig(num_heads=8, topk=16, index_num_heads=4, max_model_len=1024,
                         num_layers=1, hidden_size=64)
    ex = StepExecutor.local(cfg, sm_scale=0.1, max_tokens=64, max_requests=4)
    step = StepInput.build(0, ["a", "b"], [100, 100], [1, 1], [False, False])
    big = 2**31 - 10
    ex.bind(compile(cfg, step), np.array([[big, big + 1], [big, big + 2]], np.int64))
    assert len(ex._aliases.stamps) < 1 << 20
    with pytest.raises(StepInputError, match=f"block {big + 1} is written by request 1"):
        ex.bind(compile(cfg, step), np.array([[big, big + 1], [big, big + 1]], np.int64))


def test_a_block_repeated_inside_one_requests_read_columns_is_refused():
    """One request's row mapping two logical blocks to one physical block (read-only) was
    accepted: attention read block 5's KV for both positions (max error 0.21). Two requests
    sharing a read-only block (a common prefix) stay legal."""
    cfg = ParallelConfig(num_heads=8, topk=16, index_num_heads=4, max_model_len=1024,
                         num_layers=1, hidden_size=64)
    plan = compile(cfg, StepInput.build(1, ["a", "b"], [200, 200], [1, 1], [False, False]))
    ex = StepExecutor.local(cfg, sm_scale=0.1, max_tokens=64, max_requests=8)
    shared = np.array([[5, 6, 7, 8], [5, 9, 10, 11]])  # block 5 read by both: a prefix
    assert not _walk_aliases(plan, 0, shared)
    ex.bind(plan, shared)
    repeated = np.array([[5, 6, 5, 8], [12, 9, 10, 11]])
    with pytest.raises(StepInputError) as err:
        ex.bind(plan, repeated)
    assert str(err.value) == ("step 1: block 5 is used by request 0 ('a') at block-table "
                              "columns 0 and 2; expected each block of a request at one column "
                              "(requests may share read-only blocks)")
