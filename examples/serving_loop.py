"""A mini serving loop on the embedding API (cpplan.api): PCP 2 x DCP 2 on CPU (gloo).

    python examples/serving_loop.py                          # spawns 2 ranks itself
    torchrun --nproc-per-node 2 examples/serving_loop.py     # or under torchrun

Every rank runs the same deterministic scheduler; each step is compiled, bound (digest check),
run layer by layer with the engine's own tensors (here generated from coordinates), restored to
global order and compared with the single-device oracle.
"""

from __future__ import annotations

import os

import torch

from cpplan.api import Groups, LayerCache, ParallelConfig, StepExecutor, compile
from cpplan.sim import coords
from cpplan.sim.allocator import BlockAllocator
from cpplan.sim.launch import World
from cpplan.sim.oracle import max_abs_error, oracle_step
from cpplan.sim.scheduler import MiniScheduler, preset_requests

CONFIG = ParallelConfig(pcp_size=2, dcp_size=2, interleave_size=1, kv_cache_dtype="fp8_ds_mla",
                        num_heads=8, num_layers=2, topk=64, index_num_heads=4,
                        hidden_size=2 * 8 * 512, activation_dtype="float32", max_model_len=512)
STEPS, SEED, NUM_BLOCKS, MAX_BLOCKS = 8, 0, 64, 4


def serve(groups: Groups) -> float:
    cfg = CONFIG
    executor = StepExecutor.from_groups(cfg, groups, sm_scale=coords.SIM_SM_SCALE, verify="every", max_tokens=256,
                                        max_requests=16)
    caches = [LayerCache.empty(cfg, NUM_BLOCKS, groups.device) for _ in range(cfg.num_layers)]
    blocks = BlockAllocator(NUM_BLOCKS, cfg.block_size, cfg.dcp_size, groups.dcp_rank,
                            cfg.interleave_size)  # the engine's allocator: local blocks
    sched = MiniScheduler(preset_requests(cfg.pcp_size, cfg.max_model_len), token_budget=64,
                          max_running=8, kv_token_budget=900)
    worst = 0.0
    width = cfg.num_heads * cfg.v_head_dim
    for step_id in range(STEPS):
        step = sched.schedule(step_id)
        if step is None:
            break
        for rid in sched.preempted:
            blocks.release(rid)
        plan = compile(cfg, step)
        for rid, extent in zip(plan.req_ids, plan.extent()):
            blocks.ensure(rid, int(extent))
        bound = executor.bind(plan, blocks.table(plan.req_ids, MAX_BLOCKS))
        # this loop's inputs come from (request, position) coordinates, as the oracle's do
        keys = torch.from_numpy(coords.request_keys(plan.req_ids)).index_select(
            0, bound.tables.token_req)
        hidden = torch.zeros(plan.padded_num_tokens, cfg.num_layers * width)
        for layer, cache in enumerate(caches):
            x = coords.layer_inputs(SEED, layer, keys, bound.tables.token_pos,
                                    num_heads=cfg.num_heads, index_heads=cfg.index_num_heads)
            executor.insert(bound, cache, x["kv"], x["index_k"])
            out = executor.attend(bound, cache, x["q"], x["index_q"], x["index_w"])
            hidden[:, layer * width:(layer + 1) * width] = out.reshape(-1, width)
        rows = executor.restore(bound, hidden)  # [sum q, hidden], global order
        executor.finish(bound)
        err = max_abs_error(plan, rows, oracle_step(plan, SEED))
        worst = max(worst, err)
        if groups.rank == 0:
            print(f"step {step_id}: {plan.num_requests} requests, "
                  f"{int(plan.num_scheduled_tokens.np().sum())} tokens, "
                  f"{len(bound.ledger)} collectives, max |out - oracle| {err:.1e}")
        for rid in sched.complete():
            blocks.release(rid)
    return worst


def _spawned(ctx) -> float:
    return serve(Groups.build(CONFIG, store=ctx.store))


if __name__ == "__main__":
    if "RANK" in os.environ:  # torchrun
        serve(Groups.from_env(CONFIG, backend="gloo"))
    else:
        with World(CONFIG.world_size) as world:
            results = world.run(_spawned)
        for r in results:
            assert r.ok, r.tb or r
        print(f"ok: worst error {max(r.value for r in results):.1e} over {STEPS} steps")
