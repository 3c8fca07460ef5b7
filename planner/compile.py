"""``compile(config, step) -> StepPlan``: one scheduler step compiled for every rank (docs/design.md §3).

A pure function of ``(ParallelConfig, StepInput)``: no rank, clock, hash seed, set/dict order or
float enters it, so every rank builds the same plan and the same digest. The per-request and
per-row work is one numba call (:mod:`cpplan.planner._kernels`); this module validates, picks the
padded size, lists the collectives and wraps the arrays (each packed once, as contiguous
little-endian bytes).
"""

from __future__ import annotations

from bisect import bisect_left

import msgspec
import numpy as np

from cpplan.planner._kernels import plan_kernel
from cpplan.schemas import names
from cpplan.schemas.arrays import Array
from cpplan.schemas.config import INDEXER_K_BYTES_PER_TOKEN, MAX_SUPPORTED_TOKENS, ParallelConfig
from cpplan.schemas.errors import ConfigError, StepInputError
from cpplan.schemas.names import TOPK_CANDIDATE_DTYPE
from cpplan.schemas.plan import EAGER, PER_RANK_MODES, Collective, GatherChunk, StepPlan
from cpplan.schemas.step import StepInput

ACTIVATION_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
TOPK_CANDIDATE_BYTES = 4 + 4  # float32 score, int32 global token id


def compile(config: ParallelConfig, step: StepInput) -> StepPlan:  # noqa: A001 (the API name)
    """The StepPlan of ``step`` under ``config`` (every field: docs/design.md §3, schemas/plan.py).

    Raises StepInputError for a step the config cannot run (bad counts, duplicate req_id, an
    extent above max_model_len, more tokens than int32 holds) or an argument of the wrong type
    (ConfigError for the config).
    """
    _check_arguments(config, step)
    c = _column(step.num_computed_tokens, np.int64)
    q = _column(step.num_scheduled_tokens, np.int64)
    pre = _column(step.is_prefilling, np.uint8)
    (c32, q32, mode, chunk, shard, local, row_req, off, length, start, kv_write, num_tokens,
     nd_rows, nd_tokens, creq, cpad, bounds, pcu, gcu) = plan_kernel(
        c, q, pre, config.pcp_size, config.dcp_size, config.interleave_size,
        config.gather_workspace_tokens, bool(config.shard_decode_requests))
    counts = tuple(num_tokens.tolist())
    if max(counts) > MAX_SUPPORTED_TOKENS:
        raise StepInputError(
            f"step {step.step_id}: tokens per PCP rank must be <= {MAX_SUPPORTED_TOKENS}: "
            f"got {max(counts)}")
    padded, graph = padded_size(max(counts), config.cudagraph_token_sizes)
    chunks = _gather_chunks(creq, cpad, bounds.tolist(), pcu, gcu)
    n, p_size, n_rows = len(step.req_ids), config.pcp_size, len(row_req)
    sampled = None if step.is_sampled is None else step.is_sampled.np()
    source = (None if sampled is None else
              sampled_source(sampled, q32, mode, row_req, off, length, start))
    rows_sampled = (None if source is None or p_size == 1 or not len(source)
                    else int(np.bincount(source[:, 0], minlength=p_size).max()))
    return StepPlan(
        config=config,
        step_id=step.step_id,
        req_ids=step.req_ids,
        num_computed_tokens=Array("<i4", (n,), c32.tobytes()),
        num_scheduled_tokens=Array("<i4", (n,), q32.tobytes()),
        is_prefilling=Array("|u1", (n,), pre.tobytes()),
        mode=Array("|u1", (n,), mode.tobytes()),
        chunk_size=Array("<i4", (n,), chunk.tobytes()),
        dcp_shard_rows=Array("<i4", (n,), shard.tobytes()),
        dcp_local_lens=Array("<i4", (n, config.dcp_size), local.tobytes()),
        row_request=Array("<i4", (n_rows,), row_req.tobytes()),
        row_query_offset=Array("<i4", (p_size, n_rows), off.tobytes()),
        row_num_tokens=Array("<i4", (p_size, n_rows), length.tobytes()),
        row_token_start=Array("<i4", (p_size, n_rows), start.tobytes()),
        row_kv_write=Array("|u1", (p_size, n_rows), kv_write.tobytes()),
        num_decode_rows=nd_rows,
        num_decode_tokens=nd_tokens,
        num_tokens=counts,
        padded_num_tokens=padded,
        cudagraph_size=graph,
        gather_chunks=chunks,
        collectives=collectives(config, padded, decode_rows_issued(padded, graph, nd_tokens,
                                                                   n_rows > nd_rows),
                                n_rows > nd_rows, [ch.padded_local_total for ch in chunks],
                                sampled_rows=None if sampled is None else rows_sampled or 0),
        is_sampled=None if sampled is None else Array("|u1", (n,), sampled.tobytes()),
        sampled_source=(None if source is None
                        else Array("<i4", (len(source), 2), source.tobytes())),
    )


def sampled_source(sampled: np.ndarray, q: np.ndarray, mode: np.ndarray, row_req: np.ndarray,
                   off: np.ndarray, length: np.ndarray, start: np.ndarray) -> np.ndarray:
    """int32 [n_sampled, 2]: per sampled request (ascending index), the PCP rank holding its
    last scheduled token and that token's index in the rank's order; split and owned requests
    from the rank whose row holds it, the others from rank 0 (their rows are the same on every
    rank).
    O(P * rows), vectorised."""
    last = q.astype(np.int64)[row_req] - 1  # [R] the request's last query offset
    holds = (off <= last) & (last < off + length) & (sampled[row_req] != 0)
    holds[1:] &= np.isin(mode[row_req], PER_RANK_MODES)[None, :]
    rank, row = np.nonzero(holds)
    order = np.argsort(row_req[row], kind="stable")
    rank, row = rank[order], row[order]
    token = start[rank, row].astype(np.int64) + last[row] - off[rank, row]
    return np.stack([rank, token], axis=1).astype(np.int32).reshape(-1, 2)


def _check_arguments(config, step) -> None:
    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"compile: config must be a ParallelConfig: got {type(config).__name__}")
    if not isinstance(step, StepInput):
        raise StepInputError(f"compile: step must be a StepInput: got {type(step).__name__}")
    step.validate(config)


def _column(column: Array, dtype) -> np.ndarray:
    """A step column as the kernel's dtype (a no-op view for columns StepInput.build made)."""
    arr = column.np()
    return arr if arr.dtype == dtype else arr.astype(dtype)


def padded_size(max_tokens: int, graph_sizes: tuple[int, ...]) -> tuple[int, int]:
    """(T, cudagraph_size) per docs/design.md §3.7: the smallest configured graph size holding the
    largest rank's token count, else eager (EAGER) at that count."""
    k = bisect_left(graph_sizes, max_tokens)
    if k < len(graph_sizes):
        return graph_sizes[k], graph_sizes[k]
    return max_tokens, EAGER


def decode_rows_issued(padded: int, graph: int, nd_tokens: int, has_prefill: bool) -> int:
    """The decode rows the decode collectives carry (docs/design.md §3.7): T for a graph-replayable
    step (decode-only, padded to a CUDA-graph size: a captured graph runs every padded token),
    otherwise nd."""
    return padded if graph != EAGER and not has_prefill and nd_tokens > 0 else nd_tokens


def _gather_chunks(creq, cpad, bounds: list[int], pcu, gcu) -> tuple[GatherChunk, ...]:
    """GatherChunk k from the kernel's flat arrays (see ``_kernels._cut_chunks``): slices of one
    bytes object per array, so each chunk costs a few struct constructions."""
    if len(bounds) < 2:
        return ()
    req_b, pad_b, pcu_b, gcu_b = creq.tobytes(), cpad.tobytes(), pcu.tobytes(), gcu.tobytes()
    pcu_l, gcu_l = pcu.tolist(), gcu.tolist()
    out = []
    for k in range(len(bounds) - 1):
        a, b = bounds[k], bounds[k + 1]
        lo, hi = a + k, b + k + 1
        out.append(GatherChunk(
            requests=Array("<i4", (b - a,), req_b[4 * a:4 * b]),
            pad=Array("<i4", (b - a,), pad_b[4 * a:4 * b]),
            padded_local_cu=Array("<i8", (b - a + 1,), pcu_b[8 * lo:8 * hi]),
            global_cu=Array("<i8", (b - a + 1,), gcu_b[8 * lo:8 * hi]),
            padded_local_total=pcu_l[hi - 1],
            total=gcu_l[hi - 1],
        ))
    return tuple(out)


def collectives(config: ParallelConfig, padded: int, nd_tokens: int, has_prefill: bool,
                chunk_rows: list[int], sampled_rows: int | None = None
                ) -> tuple[Collective, ...]:
    """The step's collectives in issue order, each present exactly when its docs/design.md §3.8 condition
    holds. ``padded`` is T, ``nd_tokens`` the decode rows the decode collectives carry
    (:func:`decode_rows_issued`), ``chunk_rows`` PT per chunk, ``sampled_rows`` M of a step
    that names its sampled rows (None: it does not, and every token is restored). The
    indexer's collectives list the full indexer layers where some layers share a top-k."""
    p_size, w_size = config.pcp_size, config.dcp_size
    full = config.full_indexer_layers if config.indexer_sources else ()
    kv, ik = config.kv_bytes_per_token, INDEXER_K_BYTES_PER_TOKEN
    act, act_size = config.activation_dtype, ACTIVATION_ITEMSIZE[config.activation_dtype]
    out = []
    if p_size > 1 and has_prefill:
        rows = padded - nd_tokens
        out.append(_coll(names.KV_INSERT, "uint8", (rows, kv), rows * kv))
        out.append(_coll(names.INDEXER_K_INSERT, "uint8", (rows, ik), rows * ik))
    for k, pt in enumerate(chunk_rows):
        out.append(_coll(names.INDEXER_K_GATHER, "uint8", (pt, ik), pt * ik, chunk=k))
        out.append(_coll(names.KV_GATHER, "uint8", (pt, kv), pt * kv, chunk=k))
    if w_size > 1 and nd_tokens > 0:
        nd, h, topk = nd_tokens, config.num_heads, config.topk
        out.append(_coll(names.TOPK_CANDIDATES, TOPK_CANDIDATE_DTYPE, (nd, topk),
                         nd * topk * TOPK_CANDIDATE_BYTES))
        out.append(_coll(names.DECODE_LSE, "float32", (nd, h), nd * h * 4))
        out.append(_coll(names.DECODE_OUT, act, (nd, h, config.v_head_dim),
                         nd * h * config.v_head_dim * act_size))
    hidden = config.hidden_size
    if p_size > 1 and sampled_rows is None:
        out.append(_coll(names.RESTORE, act, (padded, hidden), padded * hidden * act_size))
    elif p_size > 1 and sampled_rows:
        out.append(_coll(names.RESTORE_SAMPLED, act, (sampled_rows, hidden),
                         sampled_rows * hidden * act_size))
    return tuple(out if not full else
                 [msgspec.structs.replace(c, layers=full)
                  if names.kind_of(c.name).indexer else c for c in out])


def _coll(kind: names.CollectiveKind, dtype: str, shape: tuple[int, ...], nbytes: int,
          chunk: int | None = None) -> Collective:
    return Collective(name=kind.label(chunk), op=kind.op.value, group=kind.group.value,
                      dtype=dtype, shape=shape, bytes=nbytes, per_layer=kind.per_layer)
