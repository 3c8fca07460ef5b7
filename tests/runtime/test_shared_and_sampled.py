"""Shared-indexer layers and sampled rows through the runtime, every rank of a P x W world in one
process (threads, collectives as tensor operations), against the single-device oracle (which
selects a shared layer's keys with its source layer's indexer inputs and never sees a plan),
a run that recomputes the indexer, and the full restore."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from cpplan.api import LayerCache, ParallelConfig, StepExecutor, StepInput, compile
from cpplan.runtime.collectives import expected_ledger
from cpplan.schemas.config import indexer_sources_from_types
from cpplan.schemas.errors import ConfigError, StepInputError, UsageError
from cpplan.sim import coords
from cpplan.sim.allocator import BlockAllocator
from cpplan.sim.replay import replay_plan
from cpplan.sim.simulate import TOLERANCE

TOPOLOGIES = [(1, 1), (2, 2), (1, 2), (2, 1)]
PATTERN = "FSSF"  # layers 1, 2 reuse layer 0's top-k; layer 3 runs its own
REQS = [(300, 1, False), (0, 40, True), (20, 2, True), (90, 1, False), (0, 5, True),
        (100, 37, True)]


def _config(p, w, pattern=PATTERN, **kw):
    return ParallelConfig(pcp_size=p, dcp_size=w, num_layers=len(pattern), num_heads=8,
                          topk=16, index_num_heads=4, activation_dtype="float32",
                          hidden_size=len(pattern) * 8 * 512, max_model_len=512,
                          indexer_sources=indexer_sources_from_types(pattern), **kw)


def _step(sampled=None, reqs=REQS):
    return StepInput.build(7, [f"r{k}" for k in range(len(reqs))], [r[0] for r in reqs],
                           [r[1] for r in reqs], [r[2] for r in reqs], sampled)


@functools.cache
def _full_replay(p, w):
    """The replay of the plain step (no sampled rows) at seed 3, shared by the two tests that
    read it: the oracle's comparison and the full restore the sampled rows are checked
    against (a replay regenerates every key of every layer: seconds a topology)."""
    return replay_plan(compile(_config(p, w), _step()), seed=3)


@pytest.mark.parametrize("p,w", TOPOLOGIES)
def test_shared_layers_match_the_oracle_and_issue_no_indexer_collectives(p, w):
    plan = compile(_config(p, w), _step())
    res = _full_replay(p, w)  # the ledger is checked against the plan at finish
    assert res.max_abs_err <= TOLERANCE
    names = [e.name.split("[")[0] for e in expected_ledger(plan)]
    per_layer = {n: names.count(n) for n in set(names)}
    indexer = {"indexer_k_insert", "indexer_k_gather", "topk_candidates"} & set(per_layer)
    full = compile(_config(p, w, "FFFF"), _step())
    full_names = [e.name.split("[")[0] for e in expected_ledger(full)]
    for n in indexer:  # issued on the 2 full layers only, against 4 when every layer is full
        assert 2 * full_names.count(n) == 4 * per_layer[n]
    assert res.collectives == p * w // min(p, w) * len(expected_ledger(plan)) or p == w == 1


@pytest.mark.parametrize("p,w", TOPOLOGIES)
def test_sampled_rows_equal_the_full_restores_rows(p, w):
    sampled = [True, False, True, True, False, True]
    got = replay_plan(compile(_config(p, w), _step(sampled)), seed=3)
    full = _full_replay(p, w)  # the same inputs (seed 3), every row restored
    assert got.max_abs_err <= TOLERANCE
    qcu = np.cumsum([r[1] for r in REQS])
    last = [int(qcu[i]) - 1 for i, s in enumerate(sampled) if s]
    assert got.restored.shape == (len(last), full.restored.shape[1])
    assert torch.equal(got.restored, full.restored[last])


def _one_rank(config, step, inputs_of_layer, return_selection=True):
    """Every layer of one step on a one-rank executor; per layer (out, topk_ids, lse)."""
    ex = StepExecutor.local(config, sm_scale=0.2, max_tokens=512, max_requests=8)
    alloc = BlockAllocator(32, config.block_size, 1, 0, 1)
    plan = compile(config, step)
    for rid, e in zip(plan.req_ids, plan.extent()):
        alloc.ensure(rid, int(e))
    bound = ex.bind(plan, alloc.table(plan.req_ids, 8), 32)
    keys = torch.from_numpy(coords.request_keys(plan.req_ids))[bound.tokens.request.clamp(min=0)]
    caches = [LayerCache.empty(config, 32, "cpu") for _ in range(config.num_layers)]
    outs = []
    for layer, cache in enumerate(caches):
        x = inputs_of_layer(layer, keys, bound.tokens.position)
        ex.insert(bound, cache, x["kv"], x["index_k"])
        outs.append(ex.attend(bound, cache, x["q"], x["index_q"], x["index_w"],
                              return_selection=return_selection))
    ex.finish(bound)
    return outs


def test_shared_layer_equals_recomputing_the_source_indexer():
    """A shared layer attends exactly as a full layer fed its source layer's indexer inputs:
    outputs, selections and LSE bit for bit."""
    shared, full = _config(1, 1), _config(1, 1, "FFFF")

    def inputs(pattern_config, layer, keys, pos):
        x = coords.layer_inputs(0, layer, keys, pos, num_heads=8, index_heads=4)
        src = shared.indexer_source(layer)
        s = coords.layer_inputs(0, src, keys, pos, num_heads=8, index_heads=4)
        if pattern_config is shared and src != layer:
            x["index_k"] = x["index_q"] = x["index_w"] = None
        else:
            x["index_q"], x["index_w"] = s["index_q"], s["index_w"]
            x["index_k"] = coords.key_inputs(0, src, keys, pos)[1]
        return x

    a = _one_rank(shared, _step(), lambda *args: inputs(shared, *args))
    b = _one_rank(full, _step(), lambda *args: inputs(full, *args))
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            assert torch.equal(u, v)


def test_selection_is_returned_in_the_reference_order():
    """attend(return_selection=True): ids within each token's causal keys, distinct, -1 last,
    as many as min(topk, keys); padded rows none; lse finite where a key is."""
    cfg = _config(1, 1, "FS")
    out = _one_rank(cfg, _step(), lambda layer, keys, pos: coords.layer_inputs(
        0, layer, keys, pos, num_heads=8, index_heads=4))
    plan = compile(cfg, _step())
    pos = np.concatenate([np.arange(c, c + q) for c, q, _ in
                          [REQS[i] for i in plan.row_request.np()]])
    for _o, ids, lse in out:
        ids = ids.numpy()
        for j, p_ in enumerate(pos):
            sel = ids[j][ids[j] >= 0]
            assert len(sel) == min(cfg.topk, p_ + 1) and len(set(sel)) == len(sel)
            assert sel.max() <= p_ and (ids[j][len(sel):] == -1).all()
        assert torch.isfinite(lse[: len(pos)]).all() and (ids[len(pos):] == -1).all()
    assert torch.equal(out[0][1], out[1][1])  # the shared layer's selection is layer 0's


def test_plain_attend_returns_the_output_only():
    out = _one_rank(_config(1, 1, "F"), _step(), lambda layer, keys, pos: coords.layer_inputs(
        0, layer, keys, pos, num_heads=8, index_heads=4), return_selection=False)
    assert isinstance(out[0], torch.Tensor)


@pytest.mark.parametrize("sources,match", [
    ((0, 2, 2, 3), r"indexer_sources\[1\]: got 2; expected 1"),
    ((0, 1, 2, 2, 4), "one source per layer"),
    ((1, 1, 2, 3), r"indexer_sources\[0\]: got 1"),
])
def test_bad_indexer_sources(sources, match):
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(num_layers=4, indexer_sources=sources)


def test_bad_sampled_flags_and_wrong_restore():
    with pytest.raises(StepInputError, match="is_sampled must be bools"):
        StepInput.build(0, ["a"], [0], [3], [True], [2])
    with pytest.raises(StepInputError, match=r"is_sampled must be None or an Array \|u1 of "
                                             r"shape \(1,\)"):
        StepInput.build(0, ["a"], [0], [3], [True], [True, False])
    cfg = _config(1, 1, "F")
    ex = StepExecutor.local(cfg, sm_scale=0.1, max_tokens=64, max_requests=4)
    bound = ex.bind(compile(cfg, _step([True], reqs=[(0, 3, True)])), np.ones((1, 1), np.int32))
    hidden = torch.zeros(bound.plan.padded_num_tokens, cfg.hidden_size)
    with pytest.raises(UsageError, match="restore on a step that names its sampled rows"):
        ex.restore(bound, hidden)
    bound = ex.bind(compile(cfg, _step(reqs=[(0, 3, True)])), np.ones((1, 1), np.int32))
    with pytest.raises(UsageError, match="restore_sampled on a step that names no sampled"):
        ex.restore_sampled(bound, hidden)


def test_layers_run_in_order():
    cfg = _config(1, 1, "FS")
    ex = StepExecutor.local(cfg, sm_scale=0.1, max_tokens=64, max_requests=4)
    bound = ex.bind(compile(cfg, _step(reqs=[(0, 3, True)])), np.ones((1, 1), np.int32))
    t = bound.plan.padded_num_tokens
    with pytest.raises(UsageError, match="insert of layer 1; expected layer 0"):
        ex.insert(bound, LayerCache.empty(cfg, 2, "cpu"), torch.zeros(t, 576),
                  torch.zeros(t, 128), layer=1)


def test_graph_words_do_not_depend_on_the_sampled_rows():
    """A captured graph copies the same span of arena words at every replay of its key: steps
    of one key that sample different numbers of requests must give spans of one size
    (restore_sampled's indices are read after the graph, from the step's own arena)."""
    from cpplan.runtime.graphs import _graph_views, _words

    cfg = _config(1, 1, "FS", cudagraph_token_sizes=(8,))
    ex = StepExecutor.local(cfg, sm_scale=0.1, max_tokens=64, max_requests=8)
    sizes = set()
    for n, sampled in ((5, [True] * 5), (7, [True, False] * 3 + [True]), (6, None)):
        step = StepInput.build(n, [f"s{n}r{i}" for i in range(n)], [100 + i for i in range(n)],
                               [1] * n, [False] * n, sampled)
        plan = compile(cfg, step)
        bound = ex.bind(plan, np.arange(1, 2 * n + 1, dtype=np.int32).reshape(n, 2), 32)
        assert bound.meta.graph_key is not None
        sizes.add(_words(_graph_views(bound.views))[0].numel())
        if sampled is not None:
            assert bound.views["sampled"].numel() == sum(sampled)
    assert len(sizes) == 1
