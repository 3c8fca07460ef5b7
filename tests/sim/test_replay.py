"""Replay (all ranks of one step as threads of one process) against the single-device oracle."""

from __future__ import annotations

import msgspec
import pytest

from cpplan.planner.compile import compile as compile_plan
from cpplan.runtime.segments import graph_key_of
from cpplan.schemas import ParallelConfig, StepInput
from cpplan.sim import replay as rp
from cpplan.sim.replay import replay_plan
from cpplan.sim.simulate import TOLERANCE, SimOptions, preset_config


def _config(p=2, w=2, i=1, kv="fp8_ds_mla", layers=1):
    return preset_config(SimOptions(pcp=p, dcp=w, interleave=i, kv_cache_dtype=kv,
                                    layers=layers))


def _step():
    return StepInput.build(4, ["a", "b", "c", "d", "e"], [100, 0, 160, 0, 5],
                           [1, 3, 40, 200, 1], [False, True, True, True, False])


@pytest.mark.parametrize("pwi", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 4), (3, 3, 2)])
@pytest.mark.parametrize("kv", ["fp8_ds_mla", "bf16"])
def test_replay_matches_oracle(pwi, kv):
    plan = compile_plan(_config(*pwi, kv=kv), _step())
    result = replay_plan(plan, seed=3)
    assert result.max_abs_err <= TOLERANCE
    assert result.tokens == 245


def test_replay_detects_a_wrong_layer():
    """The oracle comparison is sharp: a different seed on the ranks is far out of tolerance."""
    plan = compile_plan(_config(), _step())
    real = rp.oracle_step
    try:
        rp.oracle_step = lambda p, s, requests=None, device="cpu", **kw: real(
            p, s + 1, requests, device, **kw)
        assert rp.replay_plan(plan, seed=0).max_abs_err > 100 * TOLERANCE
    finally:
        rp.oracle_step = real


def _decode_step():
    """Decodes only (one of two tokens): padded to a graph size, the step is graph-replayable."""
    return StepInput.build(6, ["a", "b", "c", "d", "e"], [100, 7, 160, 300, 5],
                           [1, 1, 1, 2, 1], [False] * 5)


@pytest.mark.parametrize("pwi", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 4), (3, 3, 2)])
@pytest.mark.parametrize("kv", ["fp8_ds_mla", "bf16"])
def test_replay_of_a_graph_replayable_step_matches_oracle(pwi, kv):
    """Every padded token goes through the decode pass (static shapes, the graph's key
    width); padded tokens read no key and the real ones still match the oracle."""
    fields = msgspec.structs.asdict(_config(*pwi, kv=kv))
    cfg = ParallelConfig(**{**fields, "cudagraph_token_sizes": (4, 8, 16)})
    plan = compile_plan(cfg, _decode_step())
    assert plan.graph_replayable and plan.padded_num_tokens == 8
    # the longest decode holds 302 keys: 5 blocks of 64 on one rank, 3 (151) on W = 2,
    # 2 (101) on W = 3; rounded up to a power of two
    assert graph_key_of(plan) == (8, {1: 8, 2: 4, 3: 2}[pwi[1]])
    result = replay_plan(plan, seed=3)
    assert result.max_abs_err <= TOLERANCE
    assert result.tokens == 6


def test_replay_sizes_caches_by_the_plan_not_max_model_len():
    """A recorded plan whose config allows 2**30 tokens a request: replay sized every block
    table (and the caches) for max_model_len, asking the allocator for over a terabyte (a raw
    RuntimeError, exit 1 as if the output differed). Now sized by the plan's longest request."""
    cfg = preset_config(SimOptions(pcp=2, dcp=2, interleave=1, kv_cache_dtype="fp8_ds_mla",
                                   layers=1))
    big = 2**30
    cfg = msgspec.structs.replace(cfg, max_model_len=big,
                                  gather_workspace_tokens=cfg.dcp_size * cfg.shard_rows(big))
    plan = compile_plan(cfg, StepInput.build(1, ["a", "b"], [100, 0], [1, 40], [False, True]))
    assert replay_plan(plan, seed=1, device="cpu").max_abs_err <= TOLERANCE
