"""Hypothesis properties of compiled plans.

Plan level (600 examples, 0..300 requests, contexts up to 200k, every supported topology):
the plan equals the naive reference field by field, and the structural invariants of docs/design.md §3
hold. Token level (150 examples, up to 32 requests of up to 8k tokens): the deinterleave and
the restore index are checked against a brute-force simulation of the ranks' buffers.

Example counts: the "ci" profile is derandomized, so every run draws the same examples: the
count buys a fixed corpus, not fresh search (``HYPOTHESIS_PROFILE=dev`` explores new ones).
600 plan-level examples draw each of the 13 topologies x 4 interleaves about 11 times, with
the workspace, graph-size and layer choices varied across them (2,000 took 51 s on the 2-core
machine, 600 take 16 s, for fewer repeats of the same choices); the token-level brute force is
150 (300: 6.0 s, 150: 2.9 s). The quick lane (tests/lane.py) runs both on 60 and 20.
"""

from __future__ import annotations

import numpy as np
import planner_reference as ref
from hypothesis import given, note, settings
from planner_strategies import configs, steps

from cpplan import planner
from cpplan.schemas import MODE_OWNED, MODE_SPLIT, StepPlan
from tests.lane import examples


def _check_coverage(plan: StepPlan) -> None:
    """Split requests: every query token on exactly one rank; others: once on every rank."""
    q = plan.num_scheduled_tokens.np()
    mode = plan.mode.np()
    req = plan.row_request.np()
    offs, lens = plan.row_query_offset.np(), plan.row_num_tokens.np()
    p_size = plan.config.pcp_size
    seen = {}
    for r, i in enumerate(req.tolist()):
        for p in range(p_size):
            seen.setdefault((i, p), []).append((int(offs[p, r]), int(lens[p, r])))
    for i in range(len(q)):
        if mode[i] == MODE_SPLIT:
            spans = sorted(s for p in range(p_size) for s in seen[(i, p)] if s[1] > 0)
            ends = [o + n for o, n in spans]
            assert [o for o, _ in spans] == [0] + ends[:-1] and ends[-1] == q[i]
        elif mode[i] == MODE_OWNED:  # the whole query on exactly one rank, empty elsewhere
            spans = sorted(s for p in range(p_size) for s in seen[(i, p)])
            assert spans == [(0, 0)] * (p_size - 1) + [(0, int(q[i]))]
        else:
            for p in range(p_size):
                assert seen[(i, p)] == [(0, int(q[i]))]


def _check_shapes(plan: StepPlan) -> None:
    lens = plan.row_num_tokens.np()
    assert plan.num_tokens == tuple(int(x) for x in lens.sum(axis=1))
    assert plan.padded_num_tokens >= max(plan.num_tokens)
    graph = plan.cudagraph_size
    assert graph == 0 or (graph == plan.padded_num_tokens and graph in plan.config.cudagraph_token_sizes)
    nd = plan.num_decode_rows
    assert (plan.mode.np()[plan.row_request.np()[:nd]] == 0).all()
    assert (plan.mode.np()[plan.row_request.np()[nd:]] != 0).all()
    assert int(lens[0, :nd].sum()) == plan.num_decode_tokens


@settings(max_examples=examples(600, quick=60))
@given(config=configs(), step=steps())
def test_plan_equals_reference(config, step):
    _note_step(step)
    plan = planner.compile(config, step)
    facts = ref.reference_plan(config, step)
    # row map identical on every rank (the reference builds each rank's rows independently)
    for rank_rows in facts["rank_row_request"]:
        assert rank_rows == facts["row_request"]
    assert [tuple(c) for c in ref.plan_facts(plan)["collectives"]] == facts["collectives"]
    ref.assert_plan_matches(plan, facts)
    _check_coverage(plan)
    _check_shapes(plan)


def _note_step(step) -> None:
    note(f"c={step.num_computed_tokens.np().tolist()}")
    note(f"q={step.num_scheduled_tokens.np().tolist()}")
    note(f"pre={step.is_prefilling.np().tolist()}")


# ------------------------------------------------------------------ token level
def _dealt(extent: int, w: int, inter: int) -> list[np.ndarray]:
    """Per DCP rank, the request's token ids it holds in local order: runs of I dealt round
    robin (brute force; no owner/local formula)."""
    runs = np.arange(extent) // inter
    return [np.nonzero(runs % w == r)[0] for r in range(w)]


def _check_chunk(plan: StepPlan, chunk) -> None:
    cfg = plan.config
    w, inter = cfg.dcp_size, cfg.interleave_size
    pt = chunk.padded_local_total
    extents = plan.extent()[chunk.requests.np()]
    gathered = np.full(w * pt, -1, dtype=np.int64)  # rank-major all-gather of [PT] per rank
    gstart = np.concatenate(([0], np.cumsum(extents)))
    local_start = 0
    for j, e in enumerate(extents.tolist()):
        held = _dealt(e, w, inter)
        assert max(len(h) for h in held) == chunk.pad.np()[j]
        for r, tokens in enumerate(held):
            at = r * pt + local_start
            gathered[at:at + len(tokens)] = gstart[j] + tokens
        local_start += chunk.pad.np()[j]
    assert local_start == pt and gstart[-1] == chunk.total
    d = chunk.deinterleave(w, inter)
    assert len(np.unique(d)) == len(d) == chunk.total  # a permutation onto the live rows
    assert (gathered[d] == np.arange(chunk.total)).all()


def _check_restore(plan: StepPlan, facts: dict) -> None:
    """Fill each rank's [T] buffer from the reference's rows with global query ids, gather
    rank-major, and check restore_index() reads them back in global order."""
    t_pad, q = plan.padded_num_tokens, facts["num_scheduled_tokens"]
    qcu = np.concatenate(([0], np.cumsum(q))).astype(np.int64)
    buf = np.full(plan.config.pcp_size * t_pad, -1, dtype=np.int64)
    for p, (reqs, offs, lens) in enumerate(zip(
            facts["rank_row_request"], facts["row_query_offset"], facts["row_num_tokens"])):
        at = p * t_pad
        for i, o, n in zip(reqs, offs, lens):
            if facts["mode"][i] in (MODE_SPLIT, MODE_OWNED) or p == 0:  # their own tokens
                buf[at:at + n] = qcu[i] + o + np.arange(n)
            at += n
    restore = plan.restore_index()
    assert (buf[restore] == np.arange(qcu[-1])).all()


@settings(max_examples=examples(150, quick=20))
@given(config=configs(max_model_len=8192), step=steps(32, 8191, 8192))
def test_token_level_deinterleave_and_restore(config, step):
    step = _clip_extents(step, 8192)
    _note_step(step)
    plan = planner.compile(config, step)
    facts = ref.reference_plan(config, step)
    ref.assert_plan_matches(plan, facts)
    for chunk in plan.gather_chunks:
        _check_chunk(plan, chunk)
    covered = sorted(i for ch in plan.gather_chunks for i in ch.requests.np().tolist())
    if config.dcp_size > 1:
        assert covered == [i for i, m in enumerate(facts["mode"]) if m != 0]
    _check_restore(plan, facts)


def _clip_extents(step, max_len: int):
    """Keep c + q <= max_len by shrinking c (the strategy draws c and q independently)."""
    c = step.num_computed_tokens.np()
    q = np.minimum(step.num_scheduled_tokens.np(), max_len)
    c = np.minimum(c, max_len - q)
    return type(step).build(step.step_id, step.req_ids, c, q, step.is_prefilling.np())
