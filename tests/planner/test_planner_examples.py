"""The facts docs/design.md §3 states, one example test each (plus the reference's verdict)."""

from __future__ import annotations

import numpy as np
import planner_reference as ref
import pytest

from cpplan import planner
from cpplan.schemas import (
    EAGER,
    MODE_DECODE,
    MODE_REPLICATED,
    MODE_SPLIT,
    ParallelConfig,
    StepInput,
    StepInputError,
    shard_rows,
)


def _cfg(p: int, w: int, inter: int = 1, **kw) -> ParallelConfig:
    kw.setdefault("max_model_len", 4096)
    return ParallelConfig(pcp_size=p, dcp_size=w, interleave_size=inter, **kw)


def _step(c, q, pre, step_id: int = 0) -> StepInput:
    return StepInput.build(step_id, [f"r{i}" for i in range(len(q))], c, q, pre)


def _compile_checked(cfg: ParallelConfig, step: StepInput):
    plan = planner.compile(cfg, step)
    ref.assert_plan_matches(plan, ref.reference_plan(cfg, step))
    return plan


def test_p2_replicated_set_when_w_gt_1():
    qs = list(range(1, 41))
    plan = _compile_checked(_cfg(2, 2), _step([0] * 40, qs, [1] * 40))
    replicated = {q for q, m in zip(qs, plan.mode.np()) if m == MODE_REPLICATED}
    assert replicated == {1, 2, 3, 5, 6, 9}


def test_w1_never_replicates_and_keeps_zero_length_rows():
    plan = _compile_checked(_cfg(4, 1), _step([0], [3], [1]))
    assert plan.mode.np().tolist() == [MODE_SPLIT]
    assert plan.row_request.np().tolist() == [0, 0]
    # cs = 1: chunks 0..2 hold a token each, 3..7 are empty
    assert plan.row_num_tokens.np().tolist() == [[1, 0], [1, 0], [1, 0], [0, 0]]
    assert plan.num_tokens == (1, 1, 1, 0)
    assert plan.padded_num_tokens == 1


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_rank_r_takes_chunks_r_and_s_minus_1_minus_r(p):
    s, cs = 2 * p, 10
    plan = _compile_checked(_cfg(p, 1), _step([7], [s * cs], [1]))
    offsets = plan.row_query_offset.np()
    for r in range(p):
        assert offsets[r].tolist() == [r * cs, (s - 1 - r) * cs]
    assert (plan.row_position_start() == offsets + 7).all()


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("q", [None, 1, 7, 1000])
def test_first_row_of_a_full_split_is_a_full_chunk(p, q):
    s = 2 * p
    q = s * s if q is None else s * s + q
    plan = _compile_checked(_cfg(p, p), _step([0], [q], [1]))
    cs = -(-q // s)
    lens = plan.row_num_tokens.np()
    assert plan.mode.np()[0] == MODE_SPLIT and plan.chunk_size.np()[0] == cs
    assert (lens[:, 0] == cs).all()
    assert (lens[1:, 1] == cs).all() and 0 < lens[0, 1] <= cs
    assert lens.sum() == q


def test_decodes_first_then_prefills_by_request_index():
    pre = [1, 0, 1, 0, 0]
    plan = _compile_checked(_cfg(2, 2), _step([0, 90, 10, 50, 7], [64, 1, 2, 3, 1], pre))
    assert plan.row_request.np().tolist() == [1, 3, 4, 0, 0, 2]
    assert plan.num_decode_rows == 3 and plan.num_decode_tokens == 5
    assert plan.mode.np().tolist() == [MODE_SPLIT, MODE_DECODE, MODE_REPLICATED, MODE_DECODE,
                                       MODE_DECODE]
    assert plan.row_kv_write.np().tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]
    assert plan.row_token_start.np().tolist() == [[0, 1, 4, 5, 21, 37]] * 2


def test_worked_deinterleave_example():
    plan = _compile_checked(_cfg(2, 2), _step([0, 0], [164, 3], [1, 1]))
    (chunk,) = plan.gather_chunks
    assert chunk.pad.np().tolist() == [82, 2]
    assert chunk.padded_local_total == 84 and chunk.total == 167
    assert chunk.padded_local_cu.np().tolist() == [0, 82, 84]
    d = chunk.deinterleave(2, 1)
    assert d.dtype == np.int64
    assert d[0:6].tolist() == [0, 84, 1, 85, 2, 86]
    assert d[164:167].tolist() == [82, 166, 83]
    assert chunk.gathered_row(np.array([1, 1, 1]), np.array([0, 1, 2]), 2, 1).tolist() == [
        82, 166, 83]


@pytest.mark.parametrize("inter", [1, 2, 64])
@pytest.mark.parametrize("w", [2, 4, 8])
def test_shard_rows_and_local_lens_match_dealing(inter, w):
    extents = [1, 2, 3, inter, inter + 1, w * inter - 1, w * inter, w * inter + 1, 1000, 4095]
    plan = _compile_checked(_cfg(1, w, inter), _step(np.array(extents) - 1, [1] * 10, [0] * 10))
    for e, shard, local in zip(extents, plan.dcp_shard_rows.np(), plan.dcp_local_lens.np()):
        owner = (np.arange(e) // inter) % w  # runs of I dealt round robin
        assert local.tolist() == np.bincount(owner, minlength=w).tolist()
        assert shard == local[0] == local.max() == shard_rows(e, w, inter)


def test_p1_and_p1_w1_replicate_every_prefill_in_one_row():
    for w in (1, 4):
        plan = _compile_checked(_cfg(1, w), _step([0, 5, 0], [100, 1, 2], [1, 0, 1]))
        assert plan.mode.np().tolist() == [MODE_REPLICATED, MODE_DECODE, MODE_REPLICATED]
        assert plan.row_request.np().tolist() == [1, 0, 2]
        names = [c.name for c in plan.collectives]
        pcp = [c for c in plan.collectives if c.group == "pcp"]
        assert pcp == []
        if w == 1:
            assert names == [] and plan.gather_chunks == ()
        else:
            assert names == ["indexer_k_gather[0]", "kv_gather[0]", "topk_candidates",
                             "decode_lse", "decode_out"]


def test_collective_order_interleaves_chunks():
    cfg = _cfg(2, 2, max_model_len=256)  # workspace = 2 * 128 gathered rows
    plan = _compile_checked(cfg, _step([0, 0, 100, 10], [200, 100, 1, 80], [1, 1, 0, 1]))
    assert [c.name for c in plan.collectives] == [
        "kv_insert", "indexer_k_insert", "indexer_k_gather[0]", "kv_gather[0]",
        "indexer_k_gather[1]", "kv_gather[1]", "topk_candidates", "decode_lse", "decode_out",
        "restore"]
    assert [ch.requests.np().tolist() for ch in plan.gather_chunks] == [[0], [1, 3]]
    restore = plan.collectives[-1]
    assert restore.per_layer is False and restore.shape == (plan.padded_num_tokens, 7168)
    topk = plan.collectives[6]
    assert topk.dtype == "float32+int32" and topk.bytes == 1 * 2048 * 8


def test_decode_only_step_has_no_insert():
    plan = _compile_checked(_cfg(2, 2), _step([10, 20], [1, 3], [0, 0]))
    assert [c.name for c in plan.collectives] == ["topk_candidates", "decode_lse",
                                                  "decode_out", "restore"]
    assert plan.num_decode_tokens == 4 and plan.collectives[0].shape == (4, 2048)


def test_cudagraph_sizes_and_eager():
    step = _step([0, 3], [40, 1], [1, 0])  # P=2, W=1: cs=10, 21 tokens per rank
    assert planner.compile(_cfg(2, 1), step).cudagraph_size == EAGER
    plan = _compile_checked(_cfg(2, 1, cudagraph_token_sizes=(8, 16, 32)), step)
    assert (plan.padded_num_tokens, plan.cudagraph_size, plan.num_tokens) == (32, 32, (21, 21))
    plan = _compile_checked(_cfg(2, 1, cudagraph_token_sizes=(8, 21)), step)
    assert (plan.padded_num_tokens, plan.cudagraph_size) == (21, 21)
    plan = _compile_checked(_cfg(2, 1, cudagraph_token_sizes=(8, 16)), step)
    assert (plan.padded_num_tokens, plan.cudagraph_size) == (21, EAGER)


def test_empty_step():
    for p, w in ((1, 1), (2, 2), (4, 1)):
        plan = _compile_checked(_cfg(p, w), _step([], [], []))
        assert plan.num_rows == 0 and plan.padded_num_tokens == 0
        assert plan.restore_index().tolist() == []


def test_restore_index_small():
    plan = _compile_checked(_cfg(2, 2), _step([0, 8], [16, 1], [1, 0]))
    # T = 9: rank 0 holds [decode, chunk0 (0..3), chunk3 (12..15)], rank 1 chunk1, chunk2
    assert plan.padded_num_tokens == 9
    assert plan.restore_index().tolist() == [
        1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17, 5, 6, 7, 8, 0]


@pytest.mark.parametrize("bad, match", [
    (dict(c=[-1], q=[1], pre=[0]), "num_computed_tokens must be >= 0"),
    (dict(c=[0], q=[0], pre=[1]), "num_scheduled_tokens must be >= 1"),
    (dict(c=[4000], q=[100], pre=[1]), "max_model_len"),
])
def test_bad_steps_raise_step_input_error(bad, match):
    with pytest.raises(StepInputError, match=match):
        planner.compile(_cfg(2, 2), _step(bad["c"], bad["q"], bad["pre"]))


def test_duplicate_req_id_raises():
    step = StepInput.build(0, ["a", "a"], [0, 0], [1, 1], [0, 0])
    with pytest.raises(StepInputError, match="unique"):
        planner.compile(_cfg(2, 2), step)


def test_cost_estimate_small():
    cfg = _cfg(2, 2, topk=4, num_heads=2, index_num_heads=1)
    plan = planner.compile(cfg, _step([0, 6], [8, 1], [1, 0]))
    cost = planner.estimate_cost(plan)
    # prefill q=8, cs=2: rank 0 positions {0,1,6,7}, rank 1 {2,3,4,5}; decode position 6 (n=7)
    # on DCP rank 0 (local 4 of 7 keys) and rank 1 (3 of 7)
    prefill_attn = [1 + 2 + 4 + 4, 3 + 4 + 4 + 4]
    decode_attn = [4 * 4 // 7, 4 * 3 // 7]
    assert cost.attention_keys == tuple(a + d for a, d in zip(prefill_attn, decode_attn))
    assert cost.indexer_keys == (1 + 2 + 7 + 8 + 4, 3 + 4 + 5 + 6 + 3)
    assert cost.attention_flops[0] == 2 * 2 * cost.attention_keys[0] * (576 + 512)
    assert cost.indexer_flops[1] == 2 * 1 * 128 * cost.indexer_keys[1]
    assert cost.gathered_bytes == (2 * 4 * (656 + 132),) * 2
    totals = [a + b for a, b in zip(cost.attention_flops, cost.indexer_flops)]
    assert cost.imbalance == pytest.approx(max(totals) / (sum(totals) / 2))


def test_chunk_cut_at_exact_budget():
    # max_model_len 256, W=2, I=1: workspace 256 gathered rows = PT 128
    cfg = _cfg(2, 2, max_model_len=256)
    plan = _compile_checked(cfg, _step([0, 0, 0], [128, 128, 1], [1, 1, 1]))
    # pads 64 + 64 = 128 exactly fills the workspace; the third request starts a new chunk
    assert [ch.requests.np().tolist() for ch in plan.gather_chunks] == [[0, 1], [2]]
    assert [ch.padded_local_total for ch in plan.gather_chunks] == [128, 1]
