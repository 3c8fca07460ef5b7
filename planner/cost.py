"""A sparse-aware cost estimate of a plan, per rank (derived on demand; not part of the digest).

Per layer and per world rank g (PCP rank ``g % P``, DCP rank ``g % W``):

* attention keys: a query token at position ``pos`` attends ``min(pos + 1, topk)`` keys
  (``2 * H * keys * (d_qk + d_v)`` FLOPs). Prefill rows see the whole (gathered) context on the
  PCP rank that holds them; replicated and decode rows are computed on every PCP rank. With
  W > 1 a decode token is attended on each DCP rank over that rank's shard only: rank r's share
  is ``min(n, topk) * local_r(n) // n`` keys, ``n = pos + 1`` (the selected keys spread like the
  shard; exact selection depends on scores, which a plan does not know).
* indexer keys: a query token scores every earlier key, ``pos + 1`` (``local_r(pos + 1)`` for a
  decode token on DCP rank r when W > 1); ``2 * index_heads * index_head_dim`` FLOPs per key.
* gathered bytes: every DCP rank receives ``W * PT * (kv_bytes + 132)`` per gather chunk.

Key counts are exact integer sums (closed forms per row); FLOPs are Python ints.
"""

from __future__ import annotations

import msgspec
import numpy as np

from cpplan.schemas.config import INDEXER_K_BYTES_PER_TOKEN
from cpplan.schemas.plan import StepPlan
from cpplan.schemas.sharding import shard_count


class CostEstimate(msgspec.Struct, frozen=True, kw_only=True):
    """Per world rank ``[max(P, W)]``, per layer: ``attention_keys`` / ``indexer_keys`` (summed
    over the rank's query tokens), ``attention_flops`` / ``indexer_flops``, ``gathered_bytes``
    (KV + indexer K received by all-gathers), and ``imbalance`` = max / mean of the per-rank
    FLOP totals (1.0 for an empty step)."""

    attention_keys: tuple[int, ...]
    indexer_keys: tuple[int, ...]
    attention_flops: tuple[int, ...]
    indexer_flops: tuple[int, ...]
    gathered_bytes: tuple[int, ...]
    imbalance: float


def _tri(n: np.ndarray) -> np.ndarray:
    """sum_{m=1..n} m, int64."""
    return n * (n + 1) // 2


def _tri_capped(n: np.ndarray, cap: int) -> np.ndarray:
    """sum_{m=1..n} min(m, cap), int64."""
    m = np.minimum(n, cap)
    return _tri(m) + (n - m) * cap


def _local_lens(n: np.ndarray, w_size: int, inter: int) -> np.ndarray:
    """int64 [W, len(n)]: KV tokens of an extent n on each DCP rank (docs/design.md §3.4)."""
    ranks = np.arange(w_size, dtype=np.int64)[:, None]
    return np.broadcast_to(shard_count(n[None, :], w_size, inter, ranks), (w_size, len(n)))


def _prefill_keys(plan: StepPlan, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """(attention, indexer) keys [P] over each PCP rank's prefill rows."""
    nd = plan.num_decode_rows
    s = plan.row_position_start()[:, nd:]
    e = s + plan.row_num_tokens.np()[:, nd:]
    attn = (_tri_capped(e, cap) - _tri_capped(s, cap)).sum(axis=1)
    return attn, (_tri(e) - _tri(s)).sum(axis=1)


def _decode_keys(plan: StepPlan, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """(attention, indexer) keys [W] over the decode tokens, per DCP rank (full when W == 1)."""
    cfg, nd = plan.config, plan.num_decode_rows
    req = plan.row_request.np()[:nd]
    q = plan.num_scheduled_tokens.np().astype(np.int64)[req]
    c = plan.num_computed_tokens.np().astype(np.int64)[req]
    # n = pos + 1 for every decode token (decodes hold q tokens: 1 + speculative)
    n = np.repeat(c + q - np.cumsum(q), q) + np.arange(int(q.sum())) + 1
    if cfg.dcp_size == 1:
        return np.minimum(n, cap).sum(keepdims=True), n.sum(keepdims=True)
    local = _local_lens(n, cfg.dcp_size, cfg.interleave_size)
    attn = (np.minimum(n, cap) * local // np.maximum(n, 1)).sum(axis=1)
    return attn, local.sum(axis=1)


def estimate_cost(plan: StepPlan) -> CostEstimate:
    """The per-rank, per-layer cost of ``plan`` (see the module docstring for the model)."""
    cfg = plan.config
    p_size, w_size = cfg.pcp_size, cfg.dcp_size
    pa, pi = _prefill_keys(plan, cfg.topk)
    da, di = _decode_keys(plan, cfg.topk)
    world = cfg.world_size
    attn = tuple(int(pa[g % p_size]) + int(da[g % w_size]) for g in range(world))
    index = tuple(int(pi[g % p_size]) + int(di[g % w_size]) for g in range(world))
    attn_flops = tuple(2 * cfg.num_heads * k * (cfg.qk_head_dim + cfg.v_head_dim) for k in attn)
    index_flops = tuple(2 * cfg.index_num_heads * cfg.index_head_dim * k for k in index)
    per_token = cfg.kv_bytes_per_token + INDEXER_K_BYTES_PER_TOKEN
    gathered = w_size * sum(ch.padded_local_total for ch in plan.gather_chunks) * per_token
    totals = [a + b for a, b in zip(attn_flops, index_flops)]
    mean = sum(totals) / world
    return CostEstimate(
        attention_keys=attn,
        indexer_keys=index,
        attention_flops=attn_flops,
        indexer_flops=index_flops,
        gathered_bytes=(gathered,) * world,
        imbalance=max(totals) / mean if mean > 0 else 1.0,
    )
