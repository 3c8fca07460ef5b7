"""The serving scheduler and block book on their own (no torch, no model): against a direct
account of every step. Each step keeps the token budget and ``max_num_seqs``, every DCP rank's
blocks stay within its book (and match the shard of each request's extent), a request is
sampled exactly when a step reaches its last token, preempted requests recompute from 0, and
every request ends with ``max_new_tokens`` tokens."""

import numpy as np
import pytest

from cpplan.schemas.errors import ConfigError
from cpplan.schemas.sharding import shard_count
from cpplan.serve.blocks import BlockBook
from cpplan.serve.scheduler import Request, Scheduler


def _drive(lengths, new, *, budget, seqs, blocks, w=1, inter=1, bs=64):
    book = BlockBook(blocks, bs, w, inter)
    reqs = [Request(i, list(range(n)), new) for i, n in enumerate(lengths)]
    sched = Scheduler(reqs, book, max_num_batched_tokens=budget, max_num_seqs=seqs)
    steps = 0
    while sched.has_work:
        step = sched.schedule(steps)
        q = step.num_scheduled_tokens.np()
        c = step.num_computed_tokens.np()
        assert q.sum() <= budget and len(q) <= seqs and (q >= 1).all()
        for rank in book.ranks:
            held = sum(len(b) for b in rank.blocks.values())
            assert held <= blocks - 1 and len(rank.free) + held == blocks - 1
            for (r, n) in sched.scheduled:
                rows = int(shard_count(np.int64(r.computed + n), w, inter, rank.rank))
                assert len(rank.blocks[r.req_id]) * bs >= rows
        sampled = step.is_sampled.np().astype(bool)
        for k, (r, n) in enumerate(sched.scheduled):
            assert c[k] == r.computed and sampled[k] == (r.computed + n == len(r.tokens))
        sched.complete({r.index: 7 for (r, _), s in zip(sched.scheduled, sampled) if s})
        steps += 1
        assert steps < 10_000
    assert all(len(r.output) == new for r in reqs)
    assert all(not rank.blocks and len(rank.free) == blocks - 1 for rank in book.ranks)
    return sched, reqs, steps


@pytest.mark.parametrize("w,inter", [(1, 1), (2, 1), (3, 2)])
def test_every_request_finishes_within_the_budget_and_blocks(w, inter):
    sched, _, _ = _drive([1, 3, 70, 300, 129, 64], 9, budget=64, seqs=4, blocks=40, w=w,
                         inter=inter)
    assert sched.preempted == 0


def test_a_small_book_preempts_and_still_finishes():
    sched, reqs, _ = _drive([126, 126, 5], 5, budget=64, seqs=8, blocks=4)
    assert sched.preempted > 0 and sum(r.preemptions for r in reqs) == sched.preempted


def test_chunked_prefill_mixes_with_decodes():
    book = BlockBook(32, 64, 1, 1)
    reqs = [Request(0, [1, 2], 3), Request(1, list(range(200)), 3)]
    sched = Scheduler(reqs, book, max_num_batched_tokens=32, max_num_seqs=4)
    first = sched.schedule(0)
    assert first.num_scheduled_tokens.np().tolist() == [2, 30]
    sched.complete({0: 5})
    second = sched.schedule(1)
    assert second.num_scheduled_tokens.np().tolist() == [1, 31]  # a decode beside a chunk


def test_a_request_no_rank_can_hold_is_refused():
    with pytest.raises(ConfigError, match="raise --num-blocks"):
        Scheduler([Request(0, list(range(200)), 100)], BlockBook(3, 64, 1, 1),
                  max_num_batched_tokens=64, max_num_seqs=4)
