"""The reference sparse-MLA model the simulator runs on each rank, through the embedding API.

Each layer's inputs come from coordinates (:mod:`cpplan.sim.coords`), not from the previous
layer, so every layer's attention output can be checked against the oracle; the step's
"hidden" rows are every layer's output concatenated (``hidden_size = L * H * 512`` in the
simulator's preset), which ``restore`` brings to global order.
"""

from __future__ import annotations

import numpy as np
import torch

from cpplan.runtime.collectives import ACT_DTYPES
from cpplan.runtime.executor import BoundStep, LayerCache, StepExecutor
from cpplan.runtime.kernels import scatter_indexer_k
from cpplan.schemas.plan import StepPlan
from cpplan.schemas.sharding import local_index, owner
from cpplan.sim import coords


def request_keys_on(plan: StepPlan, device) -> torch.Tensor:
    """``[N]`` int64 input coordinates of the plan's requests on ``device`` (uploaded before a
    step starts: the simulator's own data, not the executor's)."""
    return torch.from_numpy(coords.request_keys(plan.req_ids)).to(device)


def run_step(executor: StepExecutor, bound: BoundStep, caches: list[LayerCache],
             seed: int, request_keys: torch.Tensor, graphs=None) -> torch.Tensor:
    """Every layer of one bound step; returns the restored ``[sum q, L * H * 512]`` rows (or,
    for a step that names its sampled rows, those ``[n_sampled, L * H * 512]``).
    ``request_keys`` ``[N]`` int64 on the executor's device (:func:`request_keys_on`);
    ``graphs``: a :class:`~cpplan.runtime.graphs.StepGraphs` over :func:`step_layers` with the
    same caches and seed (graph-replayable steps are then replayed), or None (eager)."""
    if graphs is None:
        hidden = step_layers(executor, bound, caches, seed, request_keys)
    else:  # a graph's inputs have static shapes: the keys padded to T (N <= T there)
        if bound.meta.graph_key is not None:
            padded = request_keys.new_zeros(bound.meta.padded)
            padded[: request_keys.shape[0]] = request_keys
            request_keys = padded
        hidden = graphs.run(bound, request_keys)
    if bound.plan.is_sampled is not None:  # the step names its sampled rows: those only
        restored = executor.restore_sampled(bound, hidden)
    else:
        restored = executor.restore(bound, hidden)
    executor.finish(bound)
    return restored


def step_layers(executor: StepExecutor, bound: BoundStep, caches: list[LayerCache],
                seed: int, request_keys: torch.Tensor) -> torch.Tensor:
    """The per-layer work of one step (a graph's body): every layer's inputs from coordinates,
    insert and attend; returns the rank's ``[T, L * H * 512]`` rows."""
    cfg, t = executor.config, bound.tables
    keys = request_keys.index_select(0, t.token_req)
    pos = t.token_pos
    width = cfg.num_heads * cfg.v_head_dim
    act = ACT_DTYPES[cfg.activation_dtype]
    hidden = torch.zeros(pos.shape[0], cfg.num_layers * width, dtype=act, device=pos.device)
    for layer, cache in enumerate(caches):
        x = coords.layer_inputs(seed, layer, keys, pos, num_heads=cfg.num_heads,
                                index_heads=cfg.index_num_heads)
        if cfg.indexer_source(layer) != layer:  # a shared indexer layer: no index inputs
            x["index_k"] = x["index_q"] = x["index_w"] = None
        executor.insert(bound, cache, x["kv"], x["index_k"])
        out = executor.attend(bound, cache, x["q"].to(act), x["index_q"], x["index_w"])
        hidden[:, layer * width: (layer + 1) * width] = out.reshape(out.shape[0], width)
    return hidden


def prefill_history(executor: StepExecutor, plan: StepPlan, caches: list[LayerCache],
                    block_tables: np.ndarray, seed: int) -> None:
    """Write every request's tokens before this step (positions < c) that this rank owns into
    its caches, from coordinates: what earlier steps would have written (replay)."""
    cfg, dev = plan.config, executor.device
    c = plan.num_computed_tokens.np().astype(np.int64)
    keys = coords.request_keys(plan.req_ids)
    req = np.repeat(np.arange(plan.num_requests), c)
    pos = np.arange(int(c.sum()), dtype=np.int64) - np.repeat(np.cumsum(c) - c, c)
    mine = owner(pos, cfg.dcp_size, cfg.interleave_size) == executor.dcp_rank
    req, pos = req[mine], pos[mine]
    if pos.size == 0:
        return
    loc = local_index(pos, cfg.dcp_size, cfg.interleave_size)
    bt = np.asarray(block_tables, dtype=np.int64)
    slots = torch.from_numpy(bt[req, loc // cfg.block_size] * cfg.block_size
                             + loc % cfg.block_size).to(dev)
    key_t = torch.from_numpy(keys[req]).to(dev)
    pos_t = torch.from_numpy(pos).to(dev)
    for layer, cache in enumerate(caches):
        kv, k = coords.key_inputs(seed, layer, key_t, pos_t)
        cache.kv.index_copy_(0, slots, executor.pack_kv(kv))
        scatter_indexer_k(cache.index_k, slots, executor.kernels.quantize_indexer_k(k))
