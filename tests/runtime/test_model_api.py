"""The executor's model-facing contract: the model's softmax scale, the one-rank executor with
no torch.distributed world, and the public token view (each against a reference written
separately: the single-device oracle, a token walk of the naive planner's rows)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cpplan.api import LayerCache, ParallelConfig, StepExecutor, StepInput, compile
from cpplan.runtime.tokens import PAD_REQUEST
from cpplan.schemas.errors import ConfigError
from cpplan.sim.allocator import BlockAllocator
from cpplan.sim.model import request_keys_on, run_step
from cpplan.sim.oracle import max_abs_error, oracle_step
from tests.planner.reference import rank_rows, request_mode

CFG = ParallelConfig(num_heads=8, num_layers=2, topk=16, index_num_heads=4,
                     hidden_size=2 * 8 * 512, activation_dtype="float32", max_model_len=256)
STEP = StepInput.build(0, ["a", "b", "c"], [0, 0, 0], [40, 3, 70], [True, True, True])


def _run(sm_scale: float, config=CFG):
    """One prefill step of the simulator's coordinate model on a one-rank executor: the
    restored rows and the plan."""
    ex = StepExecutor.local(config, sm_scale=sm_scale, max_tokens=256, max_requests=8)
    alloc = BlockAllocator(16, config.block_size, 1, 0, 1)
    plan = compile(config, STEP)
    for rid, e in zip(plan.req_ids, plan.extent()):
        alloc.ensure(rid, int(e))
    caches = [LayerCache.empty(config, 16, "cpu") for _ in range(config.num_layers)]
    bound = ex.bind(plan, alloc.table(plan.req_ids, 4), 16)
    return run_step(ex, bound, caches, 0, request_keys_on(plan, "cpu")), plan


@pytest.mark.parametrize("scale", [0.0625, 0.13523])
def test_attention_uses_the_models_scale(scale):
    """A model's scale (GLM-5's, DeepSeek-V3.2's) against the dense oracle at that scale; the
    oracle at 1/sqrt(576) is far off, so a fixed scale would be caught."""
    rows, plan = _run(scale)
    assert max_abs_error(plan, rows, oracle_step(plan, 0, sm_scale=scale)) < 2e-5
    wrong = max_abs_error(plan, rows, oracle_step(plan, 0, sm_scale=576 ** -0.5))
    assert wrong > 1e-2


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, float("nan"), float("inf"), True, "0.1", None])
def test_bad_scales_are_refused(bad):
    with pytest.raises(ConfigError, match="sm_scale: got .*expected a finite positive float"):
        StepExecutor.local(CFG, sm_scale=bad)


def test_the_scale_is_required():
    with pytest.raises(TypeError, match="sm_scale"):
        StepExecutor.local(CFG)  # no default that would be right for a model


def test_local_executor_needs_no_world():
    assert not dist.is_initialized()
    rows, plan = _run(0.1)
    assert rows.shape == (int(plan.num_scheduled_tokens.np().sum()), CFG.hidden_size)
    assert not dist.is_initialized()


def test_local_executor_refuses_more_ranks():
    cfg = ParallelConfig(pcp_size=2, num_heads=8, topk=16, index_num_heads=4,
                         max_model_len=256)
    with pytest.raises(ConfigError, match="expected 1 and 1"):
        StepExecutor.local(cfg, sm_scale=0.1)


def _token_walk(config: ParallelConfig, step: StepInput, p: int):
    """(request, position) of rank p's tokens in its order, from the naive planner's rows."""
    c = step.num_computed_tokens.np().tolist()
    q = step.num_scheduled_tokens.np().tolist()
    pre = step.is_prefilling.np().tolist()
    reqs = list(zip(c, q, [bool(x) for x in pre]))
    modes = [request_mode(config.pcp_size, config.dcp_size, qi, bool(pi))
             for qi, pi in zip(q, pre)]
    out = []
    for req, off, n, _ in rank_rows(p, config.pcp_size, reqs, modes):
        out += [(req, c[req] + off + j) for j in range(n)]
    return out


@pytest.mark.parametrize("p_size,w_size", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 3), (4, 1)])
@pytest.mark.parametrize("graphs", [(), (8, 64, 128)])
def test_token_view_matches_a_token_walk(p_size, w_size, graphs):
    cfg = ParallelConfig(pcp_size=p_size, dcp_size=w_size, num_heads=8, topk=16,
                         index_num_heads=4, max_model_len=512, cudagraph_token_sizes=graphs)
    rng = np.random.default_rng(p_size * 10 + w_size)
    for step_id in range(6):
        n = int(rng.integers(1, 7))
        pre = rng.random(n) < 0.6
        q = np.where(pre, rng.integers(1, 60, n), 1)
        c = rng.integers(0, 100, n)
        step = StepInput.build(step_id, [f"r{i}" for i in range(n)], c, q, pre)
        plan = compile(cfg, step)
        for rank in range(cfg.world_size):
            p = rank if p_size > 1 else 0
            ex = StepExecutor(cfg, sm_scale=0.1, pcp_rank=p, dcp_rank=rank if w_size > 1 else 0,
                              comm=None, device="cpu", max_tokens=512, max_requests=8)
            tables = np.arange(1, 8 * n + 1, dtype=np.int32).reshape(n, 8)  # distinct blocks
            tv = ex.bind(plan, tables).tokens
            want = _token_walk(cfg, step, p)
            t_pad = plan.padded_num_tokens
            assert tv.num_tokens == len(want) and tv.padded_num_tokens == t_pad
            got = list(zip(tv.request_np[:len(want)].tolist(), tv.position_np[:len(want)].tolist()))
            assert got == want
            assert (tv.request_np[len(want):] == PAD_REQUEST).all()
            assert (tv.position_np[len(want):] == 0).all()
            assert tv.valid_np.tolist() == [k < len(want) for k in range(t_pad)]
            for host, dev in ((tv.request_np, tv.request), (tv.position_np, tv.position),
                              (tv.valid_np, tv.valid)):
                assert dev.device.type == "cpu" and np.array_equal(dev.numpy(), host)


def test_one_plan_serves_any_scale():
    """The scale is the executor's (a float: plans hold none), so one plan serves models of
    different scales and its digest does not depend on it."""
    a, _ = _run(0.1)
    b, _ = _run(0.2)
    assert not torch.allclose(a, b)
    assert math.isclose(StepExecutor.local(CFG, sm_scale=np.float32(0.25)).sm_scale, 0.25)
