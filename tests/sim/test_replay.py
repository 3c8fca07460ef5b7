"""Replay (all ranks of one step as threads of one process) against the single-device oracle."""

from __future__ import annotations

import pytest

from cpplan.planner.compile import compile as compile_plan
from cpplan.schemas import StepInput
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
        rp.oracle_step = lambda p, s, requests=None, device="cpu": real(p, s + 1, requests,
                                                                         device)
        assert rp.replay_plan(plan, seed=0).max_abs_err > 100 * TOLERANCE
    finally:
        rp.oracle_step = real
