"""GPU checks (skipped without CUDA): replay on the device matches the oracle, and a bound step
runs under ``torch.cuda.set_sync_debug_mode("error")`` without any host sync."""

from __future__ import annotations

import contextlib

import pytest
import torch

from cpplan.planner.compile import compile as compile_plan
from cpplan.runtime.kernels import get_kernels
from cpplan.runtime.replay import replay_plan
from cpplan.runtime.simulate import TOLERANCE, SimOptions, preset_config
from cpplan.schemas import StepInput

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Triton attention accumulates in float32 but in another order and with bf16 tensor-core
# inputs where the kernel chooses them; allow a looser bound for it than for the reference.
TRITON_TOLERANCE = 2e-2


def _plan(p, w, i, kv, layers=2):
    cfg = preset_config(SimOptions(pcp=p, dcp=w, interleave=i, kv_cache_dtype=kv, layers=layers))
    step = StepInput.build(4, ["a", "b", "c", "d", "e"], [100, 0, 160, 0, 5],
                           [1, 3, 40, 200, 1], [False, True, True, True, False])
    return compile_plan(cfg, step)


@contextlib.contextmanager
def _no_sync():
    # entered on every rank thread after a barrier (the mode is process-wide): no sync here
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("pwi", [(1, 1, 1), (2, 2, 1), (3, 3, 2)])
@pytest.mark.parametrize("kv", ["fp8_ds_mla", "bf16"])
def test_replay_cuda_reference_matches_oracle(pwi, kv):
    result = replay_plan(_plan(*pwi, kv), seed=1, device="cuda",
                         kernels=get_kernels("cuda", "reference"))
    assert result.max_abs_err <= TOLERANCE


@pytest.mark.parametrize("kv", ["fp8_ds_mla", "bf16"])
def test_replay_cuda_default_kernels_match_oracle(kv):
    result = replay_plan(_plan(2, 2, 1, kv), seed=1, device="cuda")
    assert result.max_abs_err <= TRITON_TOLERANCE


@pytest.mark.parametrize("backend", ["reference", None])
@pytest.mark.parametrize("pwi", [(1, 1, 1), (2, 2, 1)])
def test_bound_step_has_no_host_sync(pwi, backend):
    kernels = get_kernels("cuda", backend)
    replay_plan(_plan(*pwi, "fp8_ds_mla"), seed=1, device="cuda", kernels=kernels)  # warm-up
    replay_plan(_plan(*pwi, "fp8_ds_mla"), seed=1, device="cuda", kernels=kernels,
                step_guard=_no_sync)
