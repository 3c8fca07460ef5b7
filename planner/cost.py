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

Key counts are exact integer sums (closed forms per row and per request: memory and time
follow the plan's rows and requests, never its token counts); FLOPs are Python ints.
"""

from __future__ import annotations

import msgspec
import numpy as np

from cpplan.schemas.config import INDEXER_K_BYTES_PER_TOKEN
from cpplan.schemas.plan import StepPlan


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


def _prefill_keys(plan: StepPlan, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """(attention, indexer) keys [P] over each PCP rank's prefill rows."""
    nd = plan.num_decode_rows
    s = plan.row_position_start()[:, nd:]
    e = s + plan.row_num_tokens.np()[:, nd:]
    attn = (_tri_capped(e, cap) - _tri_capped(s, cap)).sum(axis=1)
    return attn, (_tri(e) - _tri(s)).sum(axis=1)


MAX_WALKED_TOKENS = 1 << 18  # decode tokens past top-k summed one by one (W > 1), ~30 MB


def _per_rank(w_size: int, everywhere, below, at, j) -> np.ndarray:
    """int64 [W]: per DCP rank r, sum(everywhere) + sum(below[j > r]) + sum(at[j == r]).
    O(len + W); int64 arithmetic wraps, which is exact as long as the true totals fit int64
    (every sum here is of integers whose total does: at most 2**31 tokens times 2**31 keys)."""
    out = np.zeros(w_size, dtype=np.int64)
    out += np.sum(everywhere, dtype=np.int64)
    diff = np.zeros(w_size + 1, dtype=np.int64)
    np.add.at(diff, np.zeros(1, dtype=np.int64), np.sum(below, dtype=np.int64, keepdims=True))
    np.add.at(diff, j, -below)
    out += np.cumsum(diff, dtype=np.int64)[:w_size]
    np.add.at(out, j, at)
    return out


def _shard_prefix_sums(x: np.ndarray, sign: np.ndarray, w_size: int, inter: int) -> np.ndarray:
    """int64 [W]: per DCP rank r, sum over i of sign[i] * F_r(x[i]), where
    F_r(x) = sum_{n=1..x} local_r(n) (local_r(n) = shard_count(n, W, I, r)), in closed form:
    F_r(x) = x * count_r(x) - (sum of the positions t < x that rank r holds). O(len(x) + W)."""
    i, period = inter, w_size * inter
    k = x // period
    rem = x - k * period
    j, f = rem // i, rem % i
    # F_r(x) = x*k*I - A(k) - k*I*I*r + G_r, with G_r = I*rem - I(I-1)/2 - I*I*r for r < j,
    # f(f+1)/2 at r = j and 0 above (k full periods, then the partial one)
    const = x * (k * i) - ((k * (k - 1) // 2) * i) * period - (k * i) * (i - 1) // 2
    below = i * rem - i * (i - 1) // 2
    point = f * (f + 1) // 2
    ranks = np.arange(w_size, dtype=np.int64)
    slope = _per_rank(w_size, sign * (k * i * i), sign * (i * i), np.zeros_like(j), j)
    return _per_rank(w_size, sign * const, sign * below, sign * point, j) - slope * ranks


def _capped_shares(n: np.ndarray, weight: np.ndarray, w_size: int, inter: int,
                   cap: int) -> np.ndarray:
    """int64 [W]: per DCP rank r, sum of weight * (cap * local_r(n) // n) (local_r(n) takes
    three values over the ranks: below the partial period's rank, at it, above it)."""
    k = n // (w_size * inter)
    rem = n - k * w_size * inter
    j, f = rem // inter, rem % inter
    lo = cap * (k * inter) // n
    hi = cap * (k * inter + inter) // n
    mid = cap * (k * inter + f) // n
    return _per_rank(w_size, weight * lo, weight * (hi - lo), weight * (mid - lo), j)


def _decode_keys(plan: StepPlan, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """(attention, indexer) keys [W] over the decode tokens, per DCP rank (full when W == 1).
    Per request closed forms (a decode's tokens sit at n = c+1 .. c+q): nothing per token is
    built, except past top-k with W > 1 (n > topk: rank r's share cap * local_r(n) // n),
    summed token by token while the step has at most MAX_WALKED_TOKENS such tokens; beyond,
    every such token of a request counts its last token's share (an estimate either way)."""
    cfg, nd = plan.config, plan.num_decode_rows
    req = plan.row_request.np()[:nd]
    q = plan.num_scheduled_tokens.np().astype(np.int64)[req]
    a = plan.num_computed_tokens.np().astype(np.int64)[req]
    b = a + q
    if cfg.dcp_size == 1:
        attn = np.sum(_tri_capped(b, cap) - _tri_capped(a, cap), dtype=np.int64, keepdims=True)
        return attn, np.sum(_tri(b) - _tri(a), dtype=np.int64, keepdims=True)
    w_size, inter = cfg.dcp_size, cfg.interleave_size
    both = np.concatenate([b, a])
    sign = np.concatenate([np.ones_like(b), -np.ones_like(a)])
    index = _shard_prefix_sums(both, sign, w_size, inter)
    attn = _shard_prefix_sums(np.minimum(both, cap), sign, w_size, inter)  # n <= cap: all
    start = np.maximum(a, cap)
    count = np.maximum(b - start, 0)
    walked = int(count.sum())
    if walked <= MAX_WALKED_TOKENS:  # each token past top-k: n = start + 1 .. b
        n = np.repeat(start - np.cumsum(count) + count, count) + np.arange(walked) + 1
        attn = attn + _capped_shares(n, np.ones_like(n), w_size, inter, cap)
    else:
        has = count > 0
        attn = attn + _capped_shares(b[has], count[has], w_size, inter, cap)
    return attn, index


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
