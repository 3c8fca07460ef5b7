"""CUDA-graph replay (runtime/graphs.py) on one GPU, skipped without CUDA: replayed steps equal
the eager steps bit for bit and match the oracle; a step with no graph key runs eagerly and
matches the oracle; once a key is captured, its later steps compile no kernel."""

from __future__ import annotations

import functools

import msgspec
import numpy as np
import pytest
import torch

from cpplan.planner.compile import compile as compile_plan
from cpplan.runtime.executor import LayerCache, StepExecutor
from cpplan.runtime.graphs import StepGraphs
from cpplan.schemas import ParallelConfig, StepInput
from cpplan.sim.allocator import BlockAllocator
from cpplan.sim.model import prefill_history, request_keys_on, run_step, step_layers
from cpplan.sim.oracle import max_abs_error, oracle_step
from cpplan.sim.replay import ThreadComm, ThreadWorld
from cpplan.sim.simulate import TOLERANCE, SimOptions, preset_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WIDTH = 16  # blocks per request in the block tables (1024 keys)


def _config(kv: str, pattern: str | None = None) -> ParallelConfig:
    fields = msgspec.structs.asdict(preset_config(SimOptions(
        pcp=1, dcp=1, kv_cache_dtype=kv, layers=2, max_model_len=1024,
        indexer_pattern=pattern)))
    return ParallelConfig(**{**fields, "cudagraph_token_sizes": (8, 16)})


def _steps(cfg: ParallelConfig) -> list:
    """Three decode-only steps of one graph key (T 8, 4 key blocks: contexts 130-250) with
    different requests and contexts, then a mixed step (no graph key)."""
    rng = np.random.default_rng(7)
    plans = []
    for s, n in enumerate((5, 7, 6)):
        ids = [f"s{s}r{i}" for i in range(n)]
        plans.append(compile_plan(cfg, StepInput.build(
            s, ids, rng.integers(130, 250, n).tolist(), [1] * n, [False] * n)))
    plans.append(compile_plan(cfg, StepInput.build(
        3, ["m0", "m1", "m2"], [140, 0, 90], [1, 40, 1], [False, True, False])))
    return plans


class _Rig:
    """One executor with its caches (one set for every step: a graph keeps their addresses)
    and a block allocator over every step's requests."""

    def __init__(self, cfg, plans, graphs: bool) -> None:
        self.cfg, self.seed = cfg, 5
        comm = ThreadComm(ThreadWorld(1), 0, 1, 1)
        self.ex = StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=comm, device="cuda",
                               max_tokens=64, max_requests=16, max_blocks_per_request=WIDTH)
        self.num_blocks = 1 + sum(p.num_requests for p in plans) * WIDTH
        self.alloc = BlockAllocator(self.num_blocks, cfg.block_size, 1, 0, 1)
        self.caches = [LayerCache.empty(cfg, self.num_blocks, "cuda")
                       for _ in range(cfg.num_layers)]
        body = functools.partial(_body, self.ex, caches=self.caches, seed=self.seed)
        self.graphs = StepGraphs(self.ex, body, enabled=graphs)

    def prepare(self, plan):
        """The step's block tables and keys, its requests' history written (set-up)."""
        for rid, extent in zip(plan.req_ids, plan.extent()):
            self.alloc.ensure(rid, int(extent))
        tables = self.alloc.table(plan.req_ids, WIDTH)
        prefill_history(self.ex, plan, self.caches, tables, self.seed)
        return tables, request_keys_on(plan, self.ex.device)

    def step(self, plan, tables, keys) -> torch.Tensor:
        bound = self.ex.bind(plan, tables, self.num_blocks)
        out = run_step(self.ex, bound, self.caches, self.seed, keys, graphs=self.graphs)
        return out.clone()

    def run(self, plan) -> torch.Tensor:
        return self.step(plan, *self.prepare(plan))


def _body(ex, bound, keys, *, caches, seed):
    return step_layers(ex, bound, caches, seed, keys)


@pytest.mark.parametrize("pattern", [None, "FS"], ids=["all-full", "shared"])
@pytest.mark.parametrize("kv", ["fp8_ds_mla", "bf16"])
def test_graph_replay_equals_eager_bit_for_bit_and_the_oracle(kv, pattern):
    """FS: layer 1 reuses layer 0's selection inside the captured graph too."""
    cfg = _config(kv, pattern)
    plans = _steps(cfg)
    assert [p.graph_replayable for p in plans] == [True, True, True, False]
    eager, graph = _Rig(cfg, plans, graphs=False), _Rig(cfg, plans, graphs=True)
    for plan in plans:
        want, got = eager.run(plan), graph.run(plan)
        assert torch.equal(got, want), f"step {plan.step_id}: graph differs from eager"
        err = max_abs_error(plan, got, oracle_step(plan, graph.seed, device="cuda"))
        assert err <= TOLERANCE, f"step {plan.step_id}: {err} vs the oracle"
    (cap,) = graph.graphs.captured.values()  # one key: captured at step 0, replayed twice
    assert cap.replays == 2 and not eager.graphs.captured
    assert len(cap.ledger) == 0  # P = W = 1: no collective inside


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_no_kernel_compiles_after_the_first_step_of_a_key(graphs):
    """Steady state compiles nothing: replays run no Python at all, and eager steps of one key
    have the same static shapes (the graph key), so the kernels' specialisations repeat."""
    triton = pytest.importorskip("triton")
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is None or not hasattr(knobs, "jit_post_compile_hook"):
        pytest.skip("this Triton has no jit_post_compile_hook")
    cfg = _config("fp8_ds_mla")
    plans = _steps(cfg)[:3]
    rig = _Rig(cfg, plans, graphs=graphs)
    rig.run(plans[0])  # warm-up: compiles (and captures)
    compiled = []
    old = knobs.jit_post_compile_hook
    for plan in plans[1:]:
        tables, keys = rig.prepare(plan)  # set-up outside the count
        torch.cuda.synchronize()
        knobs.jit_post_compile_hook = lambda *a, **k: compiled.append(str(k.get("fn", a)))
        try:
            rig.step(plan, tables, keys)
            torch.cuda.synchronize()
        finally:
            knobs.jit_post_compile_hook = old
    assert compiled == [], f"{len(compiled)} kernel(s) compiled after warm-up: {compiled[:4]}"
