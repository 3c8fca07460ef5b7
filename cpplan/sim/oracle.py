"""The single-device oracle: the same sparse-MLA layer with every request's whole KV on one
device and no plan (docs/design.md §7). It regenerates keys from coordinates, quantises them
exactly as the cache does (fp8_ds_mla round trip, or bf16 rounding), scores every causal key
with the indexer, selects the top-k in the reference order and attends: no sharding, no
gathers, no merge. Used by ``cpplan simulate``, ``cpplan replay`` and tests/dist.
"""

from __future__ import annotations

import numpy as np
import torch

from cpplan.runtime.kernels import get_kernels
from cpplan.runtime.kernels import reference as kref
from cpplan.schemas.config import ParallelConfig
from cpplan.sim import coords

NO_KEY = -1


def oracle_request(config: ParallelConfig, seed: int, layer: int, key: int, computed: int,
                   scheduled: int, device="cpu", kernels=None,
                   sm_scale: float = coords.SIM_SM_SCALE) -> torch.Tensor:
    """Attention output ``[q, H, 512]`` float32 of one request's query tokens
    (positions ``computed .. computed + scheduled - 1``) at ``layer``."""
    k = kernels or get_kernels(torch.device(device).type)
    extent = computed + scheduled
    dev = torch.device(device)
    all_pos = torch.arange(extent, dtype=torch.int64, device=dev)
    keys = torch.full((extent,), key, dtype=torch.int64, device=dev)
    kv = coords.key_inputs(seed, layer, keys, all_pos)[0]
    # a shared indexer layer selects with its source layer's indexer (config.indexer_sources)
    source = config.indexer_source(layer)
    index_k = coords.key_inputs(seed, source, keys, all_pos)[1]
    if config.kv_cache_dtype == "fp8_ds_mla":
        kv = kref.dequantize_fp8_ds_mla(k.quantize_fp8_ds_mla(kv))
    else:
        kv = kv.to(torch.bfloat16).float()
    k_packed = k.quantize_indexer_k(index_k)
    qpos = all_pos[computed:]
    inp = coords.layer_inputs(seed, layer, keys[computed:], qpos, num_heads=config.num_heads,
                              index_heads=config.index_num_heads)
    sel = inp if source == layer else coords.layer_inputs(
        seed, source, keys[computed:], qpos, num_heads=config.num_heads,
        index_heads=config.index_num_heads)
    ids = all_pos[None, :].expand(scheduled, extent)
    ids = torch.where(ids <= qpos[:, None], ids, NO_KEY)
    # the reference scores every causal key (exact: integer inputs, docs/design.md §7.1)
    top = kref.indexer_topk(sel["index_q"], sel["index_w"], k_packed, ids, ids, config.topk)[1]
    out, _ = k.sparse_mla_attention(inp["q"], kv, top, sm_scale, kv_format="bf16")
    return out


def oracle_step(plan, seed: int, requests=None, device="cpu",
                sm_scale: float = coords.SIM_SM_SCALE) -> dict[int, torch.Tensor]:
    """Request index -> ``[q, L * H * 512]`` float32: every layer's output, concatenated in
    layer order (the layout the simulator restores). ``requests``: indices to compute
    (default all)."""
    cfg = plan.config
    c = plan.num_computed_tokens.np()
    q = plan.num_scheduled_tokens.np()
    keys = coords.request_keys(plan.req_ids)
    todo = range(plan.num_requests) if requests is None else requests
    out = {}
    for i in todo:
        layers = [oracle_request(cfg, seed, layer, int(keys[i]), int(c[i]), int(q[i]), device,
                                 sm_scale=sm_scale)
                  for layer in range(cfg.num_layers)]
        out[i] = torch.cat([x.reshape(int(q[i]), -1) for x in layers], dim=1)
    return out


def max_abs_error(plan, restored: torch.Tensor, expected: dict[int, torch.Tensor]) -> float:
    """Largest |restored - oracle| over the requests in ``expected`` (host float; not step
    code). ``restored``: every query token in global order, or for a step that names its
    sampled rows, one row per sampled request (its last token), in request order."""
    if plan.is_sampled is not None:
        row_of = np.cumsum(plan.is_sampled.np()) - 1
        worst = 0.0
        for i, want in expected.items():
            if plan.is_sampled.np()[i]:
                got = restored[int(row_of[i])].float().to(want.device)
                worst = max(worst, float((got - want[-1]).abs().max()))
        return worst
    qcu = np.concatenate(([0], np.cumsum(plan.num_scheduled_tokens.np().astype(np.int64))))
    worst = 0.0
    for i, want in expected.items():
        got = restored[int(qcu[i]): int(qcu[i + 1])].float().to(want.device)
        worst = max(worst, float((got - want).abs().max()) if got.numel() else 0.0)
    return worst
