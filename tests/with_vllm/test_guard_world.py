"""The plugin in spawned gloo worlds of vLLM ranks: vLLM's own parallel state (its PCP, DCP and
TP groups over gloo), a real PCPManager on every rank, the plugin registered from the
environment (CPPLAN_VLLM=record,guard) as vLLM's worker would.

Each job partitions a few seeded global batches, then issues "the step's first collective" (an
all-gather over the PCP group) and records the steps that reached it. Clean steps pass on every
rank; a divergence injected on one rank (its global batch changed, or its manager ordering its
rows otherwise) raises VllmGuardError on every rank at that step, before the collective, naming
the step, the rank and the first differing field; the recorded steps read back with
``cpplan inspect``. References: the batches, the configs and the digests are built here from
the batch columns (StepInput.build, ParallelConfig), not through cpplan.vllm; the differing
field and index come from the injection itself, or from vLLM's own partition."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

pytest.importorskip("vllm")

from cpplan.sim.launch import PRELOAD, World  # noqa: E402

# world ranks are vLLM's layout, PCP x TP (rank = pcp_rank * TP + tp_rank); W is DCP
TOPOLOGIES = [  # (P, W, TP, interleave, shard_decode_requests)
    pytest.param((2, 1, 1, 1, True), id="p2w1-owned"),
    pytest.param((2, 2, 1, 4, False), id="p2w2-i4"),
    pytest.param((2, 1, 2, 1, True), id="p2w1-tp2"),
    pytest.param((4, 4, 1, 1, False), id="p4w4"),
]
STEPS = 4  # steps 0..2 clean, step 3 diverges (batch job)
MAX_REQS, MAX_TOKENS = 64, 4096
PRELOAD_VLLM = PRELOAD + ("vllm.config", "vllm.distributed.parallel_state",
                          "vllm.v1.worker.gpu.pcp_manager", "cpplan.vllm.plugin",
                          "cpplan.vllm.adapter", "cpplan.vllm.guard", "cpplan.planner")


# ------------------------------------------------------------------ batches (both sides)
def batch_columns(seed: int, step: int) -> dict:
    """One global batch: decodes (q = 1, past their prompt) and prefill chunks (inside their
    prompt), shuffled; a permutation of state slots as idx_mapping (vLLM's persistent rows)."""
    rng = np.random.default_rng([seed, step])
    n = int(rng.integers(3, 9))
    decode = rng.random(n) < 0.5
    decode[:2] = [True, True]  # at least two decodes and a prefill: every rank has both kinds
    decode[2] = False
    rng.shuffle(decode)
    c = np.where(decode, rng.integers(1, 300, n), rng.integers(0, 200, n))
    q = np.where(decode, 1, rng.integers(1, 48, n))
    prefill_len = np.where(decode, rng.integers(1, c + 1), c + q + rng.integers(0, 20, n) * (
        rng.random(n) < 0.5))
    return {"req_ids": [f"s{step}r{i}" for i in range(n)], "c": c.astype(np.int32),
            "q": q.astype(np.int32), "prefill_len": prefill_len.astype(np.int32),
            "idx": rng.permutation(MAX_REQS)[:n].astype(np.intp)}


def perturbed(cols: dict) -> tuple[dict, int]:
    """The batch with its first decode one token further along (the divergent rank's view),
    and that request's index."""
    i = int(np.flatnonzero(cols["c"] >= cols["prefill_len"])[0])
    cols = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in cols.items()}
    cols["c"][i] += 1
    return cols, i


def input_batch(cols: dict):
    from tests.with_vllm.batches import input_batch as build

    return build(cols)


def eager():
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=0, num_reqs=None)


def prefills_first(segments, is_prefilling):
    """An injected ordering bug: prefills before decodes (vLLM orders decodes first)."""
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    ordered = PCPManager._reorder_segments(segments, is_prefilling)
    return _relaid(sorted(ordered, key=lambda s: not bool(is_prefilling[s.global_batch_req_idx])))


def _relaid(segments):
    from dataclasses import replace

    out, offset = [], 0
    for s in segments:
        out.append(replace(s, rank_local_batch_slice=slice(offset, offset + s.num_tokens)))
        offset += s.num_tokens
    return out


# ------------------------------------------------------------------ on each rank
def _vllm_world(ctx, p: int, w: int, tp: int):
    """vLLM's parallel state over the World's gloo world (once per process)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        with set_current_vllm_config(VllmConfig()):
            ps.init_distributed_environment(ctx.world_size, ctx.rank, "env://", ctx.rank,
                                            backend="gloo")
            ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                         prefill_context_model_parallel_size=p,
                                         decode_context_model_parallel_size=w, backend="gloo")
    return ps


def _guarded_steps(ctx, p, w, tp, interleave, shard, folder, seed, inject):
    """Partition STEPS batches; ``inject``: ("batch" | "order", world rank, step) or None.
    Returns (steps whose collective ran, the step that raised, its message, a reference)."""
    import torch
    import torch.distributed as dist
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    from cpplan.vllm import plugin
    from cpplan.vllm.guard import VllmGuardError

    ps = _vllm_world(ctx, p, w, tp)
    pcp_rank = ps.get_pcp_group().rank_in_group
    dcp_rank = ps.get_dcp_group().rank_in_group if w > 1 else 0
    os.environ.update({"CPPLAN_VLLM": "record,guard", "CPPLAN_VLLM_DIR": folder,
                       "CPPLAN_VLLM_TIMEOUT_S": "30"})
    plugin.register()

    def manager():
        return PCPManager(p, pcp_rank, torch.device("cpu"), shard, max_num_reqs=MAX_REQS,
                          max_num_tokens=MAX_TOKENS, dcp_world_size=w, dcp_rank=dcp_rank,
                          cp_interleave=interleave)

    mgr = manager()
    reached, reference = [], None
    kind, bad_rank, bad_step = inject if inject is not None else (None, -1, -1)
    try:
        for k in range(STEPS):
            cols = batch_columns(seed, k)
            if k == bad_step and ctx.rank == bad_rank and kind == "batch":
                cols, reference = perturbed(cols)
            if k == bad_step and ctx.rank == bad_rank and kind == "order":
                # vLLM's own partition, clean and with the bug: the first row the bug moves
                original = PCPManager.partition_batch.__wrapped__
                good = original(manager(), input_batch(cols), eager()).req_ids
                buggy = manager()
                buggy._reorder_segments = prefills_first
                bad = original(buggy, input_batch(cols), eager()).req_ids
                reference = next(i for i, (a, b) in enumerate(zip(bad, good)) if a != b)
                mgr._reorder_segments = prefills_first
            try:
                mgr.partition_batch(input_batch(cols), eager())
            except VllmGuardError as exc:
                return reached, k, str(exc), reference
            outs = [torch.zeros(1) for _ in range(p)]  # the step's first collective
            dist.all_gather(outs, torch.ones(1), group=ps.get_pcp_group().cpu_group)
            reached.append(k)
        return reached, None, "", reference
    finally:
        plugin.uninstall()


# ------------------------------------------------------------------ the tests
@pytest.fixture(scope="module", params=TOPOLOGIES)
def world(request):
    p, w, tp, interleave, shard = request.param
    with World(p * tp, timeout_s=60, preload=PRELOAD_VLLM) as wd:
        yield wd, (p, w, tp, interleave, shard)


def _run(world, folder, seed, inject):
    wd, topo = world
    results = wd.run(_guarded_steps, *topo, str(folder), seed, inject, timeout_s=300,
                     settle_s=60)
    lost = [(r.rank, r.lost_reason()) for r in results if r.lost]
    errors = [(r.rank, r.error, r.tb[-600:]) for r in results if r.error is not None]
    assert lost == [] and errors == [], (lost, errors)
    return [r.value for r in results]


def _reference_plans(topo, seed: int, steps):
    """The digest of each clean step, from a config and StepInput built here."""
    from cpplan.planner import compile as compile_plan
    from cpplan.schemas import ParallelConfig, StepInput, digest

    p, w, _, interleave, shard = topo
    config = ParallelConfig(pcp_size=p, dcp_size=w, interleave_size=interleave,
                            shard_decode_requests=shard)
    out = {}
    for k in steps:
        cols = batch_columns(seed, k)
        step = StepInput.build(k, cols["req_ids"], cols["c"], cols["q"],
                               cols["c"] < cols["prefill_len"])
        out[k] = digest(compile_plan(config, step)).hex()
    return out


def test_a_changed_batch_is_caught_on_every_rank_and_clean_steps_are_recorded(world, tmp_path):
    wd, topo = world
    p, w, tp = topo[:3]
    bad_rank = wd.world_size - 1
    values = _run(world, tmp_path, 11, ("batch", bad_rank, STEPS - 1))
    reference = values[bad_rank][3]  # the request whose num_computed_tokens was changed
    for rank, (reached, raised_at, message, _) in enumerate(values):
        assert reached == list(range(STEPS - 1)), rank  # the bad step's collective never ran
        assert raised_at == STEPS - 1, rank
        assert message.startswith(f"cpplan guard, step {STEPS - 1}: "), message
        # compared with a clean rank of its PCP group (rank 0's at TP 1)
        assert re.search(rf"on rank {bad_rank} vs rank \d+: num_computed_tokens\[{reference}\]",
                         message), message
        assert "different global batches" in message
    # rank 0 recorded every step (the bad one too: its own, clean view), whole files only
    digests = _reference_plans(topo, 11, range(STEPS))
    names = sorted(os.listdir(tmp_path))
    expected = sorted([f"step-{k:06d}-{digests[k]}.msgpack" for k in range(STEPS)]
                      + ["config.json", "replay-config.json"])
    assert names == expected
    from tests.cli.inprocess import run_cli

    for k in range(STEPS):
        got = run_cli("inspect", tmp_path / f"step-{k:06d}-{digests[k]}.msgpack", "--config",
                      tmp_path / "config.json", "--json")
        assert got.code == 0, got.stderr
        report = json.loads(got.stdout)
        assert (report["digest"], report["step_id"]) == (digests[k], k)
        assert report["config"]["pcp_size"] == p and report["config"]["dcp_size"] == w


def test_a_rank_ordering_its_rows_otherwise_is_caught_on_every_rank(world, tmp_path):
    wd, topo = world
    bad_rank = 1  # PCP rank 1 at TP 1; PCP rank 0 of the second TP rank at TP 2
    values = _run(world, tmp_path, 5, ("order", bad_rank, 1))
    index = values[bad_rank][3]  # vLLM's own partition: the first row the bug moved
    p, w, tp = topo[:3]
    pcp, dcp = bad_rank // tp, (bad_rank // tp if w > 1 else 0)
    for rank, (reached, raised_at, message, _) in enumerate(values):
        assert (reached, raised_at) == ([0], 1), rank
        assert message.startswith(
            f"cpplan guard, step 1: rank {bad_rank} (PCP rank {pcp}, DCP rank {dcp}): vLLM's "
            f"partition_batch differs from cpplan's plan at req_ids[{index}]: "), message
