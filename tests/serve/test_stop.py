"""Stopping in the serving scheduler (no torch, no model), against a naive loop written here:
each request's tokens come from a fixed function of (request, output index), so the served
output must be that sequence cut after its first stop token ("stop"), or at its
``max_new_tokens`` ("length"). A finished request's blocks are free when ``complete``
returns, and a waiting request is admitted in the very next step; a request preempted and
recomputed still stops at its first stop token."""

from __future__ import annotations

import pytest

from cpplan.serve.blocks import BlockBook
from cpplan.serve.scheduler import Request, Scheduler


def token(index: int, k: int) -> int:
    """The "model": request ``index``'s output token ``k`` (any batching, any rank)."""
    return (index * 7 + k * 3) % 11


def naive(index: int, max_new: int, stop: frozenset) -> tuple[list[int], str]:
    """One request alone: tokens until a stop token (kept) or ``max_new`` of them."""
    out = []
    while len(out) < max_new:
        out.append(token(index, len(out)))
        if out[-1] in stop:
            return out, "stop"
    return out, "length"


def _drive(reqs, book, *, budget=64, seqs=64):
    """Serve ``reqs`` to the end; per step the scheduled (index, tokens) and the requests
    finished, and the blocks every rank held after ``complete``."""
    sched = Scheduler(reqs, book, max_num_batched_tokens=budget, max_num_seqs=seqs)
    steps, step_id = [], 0
    while sched.has_work:
        sched.schedule(step_id)
        sampled = {r.index: token(r.index, len(r.output)) for r, n in sched.scheduled
                   if r.computed + n == len(r.tokens)}
        scheduled = [(r.index, n) for r, n in sched.scheduled]
        done = sched.complete(sampled)
        held = {rid for rank in book.ranks for rid in rank.blocks}
        steps.append((scheduled, [r.index for r in done], held))
        step_id += 1
        assert step_id < 1000
    return sched, steps


@pytest.mark.parametrize("w", [1, 2])
def test_outputs_stop_at_the_first_stop_token_as_the_naive_loop(w):
    stops = [frozenset({9}), frozenset({3, 9}), frozenset(), frozenset({token(3, 4)}),
             frozenset({token(4, 0)})]
    lengths, max_new = [3, 1, 70, 9, 200], [8, 8, 6, 5, 4]
    reqs = [Request(i, list(range(n)), m, stop=s)
            for i, (n, m, s) in enumerate(zip(lengths, max_new, stops))]
    _drive(reqs, BlockBook(64, 16, w, 1), budget=32)
    for r in reqs:
        want, reason = naive(r.index, r.max_new_tokens, r.stop)
        assert (r.output, r.finish_reason) == (want, reason), r.index
    # each kind is exercised: a stop mid-sequence, a stop at the first token, a stop at the
    # last allowed token ("stop", not "length"), and a plain length
    assert [r.finish_reason for r in reqs] == ["stop", "stop", "length", "stop", "stop"]
    assert len(reqs[3].output) == reqs[3].max_new_tokens and len(reqs[4].output) == 1


def test_a_stopped_request_frees_its_blocks_and_a_waiting_one_is_admitted_next_step():
    # two requests run at once (max_num_seqs 2); request 0 stops at its 3rd token
    stop0 = frozenset({token(0, 2)})
    assert token(0, 0) not in stop0 and token(0, 1) not in stop0
    reqs = [Request(0, [1, 2], 10, stop=stop0), Request(1, [3] * 5, 10),
            Request(2, [4] * 4, 3)]
    sched, steps = _drive(reqs, BlockBook(16, 16, 1, 1), seqs=2)
    stopped_at = next(k for k, (_, done, _) in enumerate(steps) if 0 in done)
    assert reqs[0].finish_reason == "stop" and reqs[0].finish_step == stopped_at
    assert "r0" not in steps[stopped_at][2]  # its blocks free once complete returned
    assert all(2 not in dict(s) for s, _, _ in steps[: stopped_at + 1])
    assert 2 in dict(steps[stopped_at + 1][0])  # admitted in the very next step
    assert reqs[2].first_step == stopped_at + 1
    assert all(naive(r.index, r.max_new_tokens, r.stop)[0] == r.output for r in reqs)


def test_requests_stopping_in_the_same_step_beside_a_chunked_prefill():
    # 0 and 1 decode side by side and stop at their 3rd token, while 2's 300-token prompt is
    # still being prefilled in chunks of what the budget leaves
    reqs = [Request(0, [1], 6, stop=frozenset({token(0, 2)})),
            Request(1, [2, 3], 6, stop=frozenset({token(1, 2)})),
            Request(2, list(range(300)), 2)]
    for r in reqs[:2]:
        assert naive(r.index, 6, r.stop) == ([token(r.index, k) for k in range(3)], "stop")
    sched, steps = _drive(reqs, BlockBook(64, 16, 2, 1), budget=40)
    assert reqs[0].finish_step == reqs[1].finish_step
    k = reqs[0].finish_step
    assert dict(steps[k][0])[2] > 1  # the chunked prefill ran in the stopping step
    assert sorted(steps[k][1]) == [0, 1] and {"r0", "r1"}.isdisjoint(steps[k][2])


def test_a_request_stops_at_the_first_token_after_its_preemption():
    # 3 usable blocks of 16: the 31-token request, growing into its third block at step 2,
    # preempts the later 5-token one after it has sampled 2 tokens; recomputed, its next
    # token is a stop
    stop = frozenset({token(1, 2)})
    assert naive(1, 6, stop) == ([token(1, k) for k in range(3)], "stop")
    reqs = [Request(0, list(range(31)), 14), Request(1, [7] * 5, 6, stop=stop)]
    book = BlockBook(4, 16, 1, 1)
    sched = Scheduler(reqs, book, max_num_batched_tokens=64, max_num_seqs=4)
    seen, step_id = [], 0  # (step, outputs of request 1 when it was preempted)
    preempt = sched._preempt

    def recording(r):
        seen.append((step_id, len(r.output)))
        preempt(r)

    sched._preempt = recording
    while sched.has_work:
        sched.schedule(step_id)
        sched.complete({r.index: token(r.index, len(r.output)) for r, n in sched.scheduled
                        if r.computed + n == len(r.tokens)})
        step_id += 1
    assert seen and seen[-1][1] == 2 and reqs[1].preemptions == len(seen)
    assert (reqs[1].output, reqs[1].finish_reason) == (naive(1, 6, stop)[0], "stop")
    assert reqs[0].output == naive(0, 14, frozenset())[0]
    assert all(not rank.blocks for rank in book.ranks)
