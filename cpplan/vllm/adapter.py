"""vLLM 0.32's per-rank step metadata, derived from a cpplan plan alone (no vLLM import).

An engine that hands cpplan its global batch (:func:`step_input`) gets back a plan whose rows
are the rows vLLM's ``PCPManager.partition_batch`` gives each PCP rank; :func:`local_batch`
states that partition in vLLM's own field names, and :func:`dsa_metadata` what vLLM's sparse-MLA
builders (the DSA indexer's and FlashMLA-sparse's) derive from it on the host. A guard compares
them with what vLLM built; a differential suite (tests/with_vllm/test_differential.py) holds them equal
to vLLM's code. Numpy only, so they run in a scheduler process and in CI without vLLM.

Inputs the plan does not hold, and what is assumed of them (vLLM's value would differ if the
assumption broke; :func:`step_input` refuses a batch that breaks the first):

- ``prefill_len``: vLLM marks a local row prefilling when its first position is below the
  request's ``prefill_len``; a prefilling request is assumed to schedule prompt tokens only
  (``c + q <= prefill_len``), a decode to sit past its prompt (``prefill_len <= c``), so every
  row of a request is prefilling exactly when the request is.
- positions: vLLM gathers them from its GPU cursor; here they are ``c + offset`` from the CPU
  ``num_computed_tokens_np``, which agree except after an asynchronous speculative rejection.
- The CUDA-graph descriptor (``batch_desc``): the plan's ``padded_num_tokens`` is its token
  count; whether it is a FULL graph (which also pads the request count) is the engine's
  ``cudagraph_mode`` and speculative depth, keyword arguments here (docstrings say the rule).
- The DSA budgets are engine settings, keyword arguments whose defaults follow vLLM's own
  defaults for the config's ``max_model_len`` and ``num_heads`` (:func:`dsa_metadata`).
"""

from __future__ import annotations

from numbers import Integral

import numpy as np

from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.errors import ConfigError, StepInputError
from cpplan.schemas.plan import EAGER, MODE_DECODE, StepPlan
from cpplan.schemas.sharding import shard_count
from cpplan.schemas.step import StepInput

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
LOCAL_BATCH_FIELDS = (
    "req_ids", "num_reqs", "num_reqs_after_padding", "idx_mapping_np", "num_scheduled_tokens",
    "num_tokens", "num_tokens_after_padding", "query_start_loc_np", "positions", "seq_lens",
    "seq_lens_cpu_upper_bound", "num_computed_tokens_np", "is_prefilling_np", "has_prefill",
    "logits_indices", "cu_num_logits_np", "dcp_local_seq_lens_cpu_upper_bound",
    "hidden_restore_idx", "padded_gather_idx", "gathered_kv_write_mask", "local_gather_idx",
)
DSA_FIELDS = (
    "indexer_num_decodes", "indexer_num_decode_tokens", "indexer_num_prefills",
    "indexer_num_prefill_tokens", "indexer_chunk_specs", "pcp_row_start_cu", "pcp_global_cu",
    "pcp_padded_local_cu", "pcp_padded_local_total", "pcp_total", "pcp_deinterleave_idx",
    "flashmla_num_decodes", "flashmla_num_decode_tokens", "flashmla_num_prefills",
    "flashmla_num_prefill_tokens", "row_bounds", "shard_rows", "workspace_starts",
    "workspace_chunk_bounds", "workspace_chunk_tokens", "workspace_chunk_rows",
    "prefill_request_id", "dcp_local_seq_lens",
)
_TOPOLOGY_KEYS = ("pcp_size", "dcp_size", "interleave_size", "shard_decode_requests")
# vLLM's FlashMLA-sparse decode threshold by heads per rank (not SM100); 256 otherwise
_FLASHMLA_THRESHOLDS = {16: 128, 32: 128, 64: 256, 128: 256}
_INDEXER_BYTES_RATIO = 576 * 2 // 132  # indexer prefill K buffer: bf16 KV rows / 132-B keys


# ------------------------------------------------------------------------ engine -> cpplan
def config_for(pcp: int, dcp: int, interleave: int = 1, shard_decode_requests: bool | None = None,
               **model_dims) -> ParallelConfig:
    """The ParallelConfig of a vLLM engine at PCP ``pcp``, DCP ``dcp`` and
    ``cp_kv_cache_interleave_size`` ``interleave``. ``shard_decode_requests`` None is vLLM's
    own rule (``pcp_shard_decode_requests``: on exactly when pcp > 1 and dcp == 1);
    ``model_dims`` are further ParallelConfig fields (num_heads, topk, max_model_len,
    cudagraph_token_sizes: vLLM's captured sizes, ...). ConfigError for a topology or field the
    config refuses."""
    clash = sorted(set(model_dims) & set(_TOPOLOGY_KEYS))
    if clash:
        raise ConfigError(f"config_for: {', '.join(clash)} come from its pcp, dcp, interleave "
                          f"and shard_decode_requests arguments: got them in model_dims too")
    if shard_decode_requests is None:  # a pcp or dcp of a wrong type is the config's to refuse
        shard_decode_requests = (isinstance(pcp, Integral) and isinstance(dcp, Integral)
                                 and pcp > 1 and dcp == 1)
    try:
        return ParallelConfig(pcp_size=pcp, dcp_size=dcp, interleave_size=interleave,
                              shard_decode_requests=shard_decode_requests, **model_dims)
    except TypeError as err:  # msgspec: an unknown field name
        raise ConfigError(f"config_for: {err}: expected ParallelConfig fields") from None


def step_input(input_batch, step_id: int = 0) -> StepInput:
    """The StepInput of vLLM's global ``InputBatch`` (vllm/v1/worker/gpu/input_batch.py), read
    by attribute only (``req_ids``, ``num_scheduled_tokens``, ``num_computed_tokens_np``,
    ``is_prefilling_np`` and, where present, ``prefill_len_np``), so any object with them does.
    ``is_sampled`` stays None: vLLM restores every hidden state before sampling. StepInputError
    for a prefilling request that schedules past its ``prefill_len`` (its rows would then be
    prefilling on some ranks only, which a plan cannot state)."""
    req_ids = tuple(input_batch.req_ids)
    n = len(req_ids)
    columns = {}
    for name in ("num_scheduled_tokens", "num_computed_tokens_np", "is_prefilling_np"):
        column = np.asarray(getattr(input_batch, name))
        if column.ndim != 1 or column.shape[0] < n:
            raise StepInputError(f"step {step_id}: input_batch.{name} must hold one entry per "
                                 f"request ({n}): got shape {column.shape}")
        columns[name] = column[:n]
    c, q = columns["num_computed_tokens_np"], columns["num_scheduled_tokens"]
    pre = columns["is_prefilling_np"]
    prefill_len = getattr(input_batch, "prefill_len_np", None)
    if prefill_len is not None and n:
        prefill_len = np.asarray(prefill_len)[:n].astype(np.int64)
        past = pre.astype(bool) & (c.astype(np.int64) + q > prefill_len)
        if past.any():
            i = int(np.argmax(past))
            raise StepInputError(
                f"request {i} ({req_ids[i]!r}) of step {step_id}: a prefilling request must "
                f"schedule prompt tokens only (num_computed_tokens + num_scheduled_tokens <= "
                f"prefill_len {int(prefill_len[i])}): got {int(c[i]) + int(q[i])}")
    return StepInput.build(step_id, req_ids, c, q, pre)


# ------------------------------------------------------------------------ the local batch
def _check_ranks(plan, pcp_rank, dcp_rank, what: str) -> None:
    if not isinstance(plan, StepPlan):
        raise ConfigError(f"{what}: plan must be a StepPlan: got {type(plan).__name__}")
    for name, rank, size in (("pcp_rank", pcp_rank, plan.config.pcp_size),
                             ("dcp_rank", dcp_rank, plan.config.dcp_size)):
        if type(rank) is not int or not 0 <= rank < size:
            raise ConfigError(f"{what}: {name} must be an int in [0, {size}): got {rank!r}")


def full_graph_num_reqs(plan: StepPlan, cudagraph_mode: str = "FULL_AND_PIECEWISE",
                        num_speculative_tokens: int = 0) -> int | None:
    """vLLM's ``batch_desc.num_reqs`` when the step runs a FULL CUDA graph, else None (eager and
    PIECEWISE pad no requests). FULL is a uniform decode graph of ``decode_query_len = 1 +
    num_speculative_tokens`` tokens a request: the plan pads to a graph size (a multiple of
    it), every request schedules exactly that many, and none is a prefill (at P == 1, where
    vLLM runs no PCP manager, a one-token prefill over a context runs as a decode). Its
    request count is then ``T // decode_query_len``. ConfigError where the plan's token count
    cannot be vLLM's: graph sizes under ``NONE``, or a step FULL_DECODE_ONLY runs eager."""
    if cudagraph_mode not in CUDAGRAPH_MODES:
        raise ConfigError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}: got "
                          f"{cudagraph_mode!r}")
    if type(num_speculative_tokens) is not int or num_speculative_tokens < 0:
        raise ConfigError(f"num_speculative_tokens must be an int >= 0: got "
                          f"{num_speculative_tokens!r}")
    if plan.cudagraph_size == EAGER:
        return None
    if cudagraph_mode == "NONE":
        raise ConfigError(f"step {plan.step_id} is padded to CUDA-graph size "
                          f"{plan.cudagraph_size}, but cudagraph_mode NONE runs it eager: "
                          f"expected a config without cudagraph_token_sizes")
    per_req = 1 + num_speculative_tokens
    q = plan.num_scheduled_tokens.np()
    pre = plan.is_prefilling.np().astype(bool)
    if plan.config.pcp_size == 1:
        pre = pre & ~((q == 1) & (plan.num_computed_tokens.np() > 0))
    full = (cudagraph_mode != "PIECEWISE" and len(q) > 0 and not pre.any()
            and bool((q == per_req).all()) and plan.padded_num_tokens % per_req == 0)
    if not full and cudagraph_mode == "FULL_DECODE_ONLY":
        raise ConfigError(f"step {plan.step_id} is padded to CUDA-graph size "
                          f"{plan.cudagraph_size}, but FULL_DECODE_ONLY runs it eager (it is "
                          f"not a uniform decode of {per_req} tokens a request)")
    return plan.padded_num_tokens // per_req if full else None


def _ranks_rows(plan: StepPlan):
    """Every rank's kept rows (tokens > 0), flattened: rank, row, request, query offset,
    length, token start; vLLM drops the zero-length rows cpplan keeps."""
    lens = plan.row_num_tokens.np()
    rank, row = np.nonzero(lens > 0)
    req = plan.row_request.np()[row].astype(np.int64)
    return (rank, row, req, plan.row_query_offset.np()[rank, row].astype(np.int64),
            lens[rank, row].astype(np.int64), plan.row_token_start.np()[rank, row].astype(np.int64))


def _segments(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Token indices of the runs ``[starts[k], starts[k] + lens[k])``, concatenated."""
    within = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(starts, lens) + within


def _gather_maps(plan: StepPlan, rows) -> dict:
    """PCPManager's private arrays over all ranks: the padded gathered buffer ``[P * T]``'s
    global token per row (0 for padding), whether that copy's KV is written (split and owned
    rows from the rank holding them, the rest from PCP rank 0 only), and each global token's
    row there (taken from the writing copy)."""
    p_size, t_pad = plan.config.pcp_size, plan.padded_num_tokens
    rank, row, req, off, length, start = rows
    q = plan.num_scheduled_tokens.np().astype(np.int64)
    qcu = np.concatenate(([0], np.cumsum(q)))
    src = _segments(rank * t_pad + start, length)
    dst = _segments(qcu[req] + off, length)
    mode = plan.mode.np()[req]
    writes = (plan.row_kv_write.np()[rank, row] != 0) & ((mode != MODE_DECODE) | (rank == 0))
    writes = np.repeat(writes, length)
    padded_gather_idx = np.zeros(p_size * t_pad, dtype=np.int64)
    padded_gather_idx[src] = dst
    mask = np.zeros(p_size * t_pad, dtype=np.bool_)
    mask[src[writes]] = True
    hidden_restore_idx = np.empty(int(qcu[-1]), dtype=np.int64)
    hidden_restore_idx[dst[writes]] = src[writes]
    return {"hidden_restore_idx": hidden_restore_idx, "padded_gather_idx": padded_gather_idx,
            "gathered_kv_write_mask": mask}


def _padded(values: np.ndarray, size: int, dtype) -> np.ndarray:
    out = np.zeros(size, dtype=dtype)
    out[: len(values)] = values
    return out


def _batch_fields(plan, req, off, length, num_reqs_padded: int | None) -> dict:
    """The InputBatch fields of rows (request, query offset, length) in local order, with
    vLLM's padding of the request count to ``num_reqs_padded`` (None: none)."""
    c = plan.num_computed_tokens.np().astype(np.int64)
    pre = plan.is_prefilling.np().astype(np.bool_)
    n, t_pad = len(req), plan.padded_num_tokens
    nrp = n if num_reqs_padded is None else num_reqs_padded
    if nrp < n:
        raise ConfigError(f"step {plan.step_id}: a FULL graph of {nrp} requests cannot hold "
                          f"the {n} rows of a rank")
    num_tokens = int(length.sum())
    qsl = np.full(nrp + 1, num_tokens, dtype=np.int32)
    qsl[0] = 0
    qsl[1: n + 1] = np.cumsum(length)
    first = c[req] + off
    positions = np.zeros(t_pad, dtype=np.int64)
    positions[:num_tokens] = _segments(first, length)
    ends = first + length
    return {
        "req_ids": [plan.req_ids[i] for i in req.tolist()], "num_reqs": n,
        "num_reqs_after_padding": nrp, "idx_mapping_np": req.astype(np.intp),
        "num_scheduled_tokens": length.astype(np.int32), "num_tokens": num_tokens,
        "num_tokens_after_padding": t_pad, "query_start_loc_np": qsl, "positions": positions,
        "seq_lens": _padded(ends if num_tokens else np.zeros(n), nrp, np.int32),
        "seq_lens_cpu_upper_bound": _padded(ends, nrp, np.int32),
        "num_computed_tokens_np": first.astype(np.int32),
        "is_prefilling_np": _padded(pre[req], nrp, np.bool_),
        "has_prefill": bool(pre[req].any()),
    }


def local_batch(plan: StepPlan, pcp_rank: int, dcp_rank: int = 0, *,
                cudagraph_mode: str = "FULL_AND_PIECEWISE", num_speculative_tokens: int = 0
                ) -> dict:
    """What vLLM 0.32's ``PCPManager.partition_batch`` gives PCP rank ``pcp_rank`` (the same on
    every DCP rank), keyed by vLLM's InputBatch names (:data:`LOCAL_BATCH_FIELDS`), plus the
    manager's private arrays without their underscore. Host numpy arrays, ints, a bool and a
    list of req_ids; ``idx_mapping_np`` holds positions in the global batch (vLLM maps them
    through the global batch's ``idx_mapping_np``).

    The rank's rows are its rows of the plan with tokens, in the plan's order (decodes, then
    prefills, by request; a split request's head before its tail), which is vLLM's order. A
    rank with none gets vLLM's placeholder: request 0, no tokens. The request count is padded
    under a FULL graph (:func:`full_graph_num_reqs`, from the two keywords): query starts with
    the token count, the rest with zeros. At P == 1 vLLM builds no PCP manager: the result is
    the global batch as its runner prepares it (every request in order, logits at each last
    token, no DCP upper bound, no private arrays; padded positions, stale in vLLM, as 0)."""
    _check_ranks(plan, pcp_rank, dcp_rank, "local_batch")
    if not plan.num_requests:
        raise StepInputError(f"step {plan.step_id} has no requests: vLLM partitions no empty "
                             f"batch (it runs no model on one)")
    nrp = full_graph_num_reqs(plan, cudagraph_mode, num_speculative_tokens)
    if plan.config.pcp_size == 1:
        return _global_batch(plan, nrp)
    rows = _ranks_rows(plan)
    mine = rows[0] == pcp_rank
    req, off, length = rows[2][mine], rows[3][mine], rows[4][mine]
    if not len(req):  # vLLM's placeholder segment: request 0, an empty slice
        req, off, length = (np.zeros(1, dtype=np.int64) for _ in range(3))
    out = _batch_fields(plan, req, off, length, nrp)
    n, num_tokens = out["num_reqs"], out["num_tokens"]
    out["logits_indices"] = out["query_start_loc_np"][1:] - np.int32(1)
    out["cu_num_logits_np"] = (np.arange(n + 1, dtype=np.int32) if num_tokens
                               else np.zeros(n + 1, dtype=np.int32))
    out["dcp_local_seq_lens_cpu_upper_bound"] = (
        _padded(plan.dcp_shard_rows.np()[req], out["num_reqs_after_padding"], np.int32)
        if plan.config.dcp_size > 1 else None)
    out.update(_gather_maps(plan, rows))
    t_pad = plan.padded_num_tokens
    out["local_gather_idx"] = out["padded_gather_idx"][pcp_rank * t_pad: (pcp_rank + 1) * t_pad]
    return out


def _global_batch(plan: StepPlan, nrp: int | None) -> dict:
    """P == 1: the global InputBatch of vLLM's runner (``prepare_inputs``), one row a request."""
    n = plan.num_requests
    q = plan.num_scheduled_tokens.np().astype(np.int64)
    out = _batch_fields(plan, np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), q, nrp)
    out["is_prefilling_np"] = plan.is_prefilling.np().astype(np.bool_)
    out["logits_indices"] = out["query_start_loc_np"][1: n + 1].astype(np.int64) - 1
    out["cu_num_logits_np"] = np.arange(n + 1, dtype=np.int32)
    out["dcp_local_seq_lens_cpu_upper_bound"] = None
    out.update(dict.fromkeys(("hidden_restore_idx", "padded_gather_idx",
                              "gathered_kv_write_mask", "local_gather_idx")))
    return out


# ------------------------------------------------------------------------ the DSA builders
def _split_decodes_and_prefills(qsl, is_prefilling, max_query_len, num_tokens, threshold,
                                require_uniform, treat_short_extends_as_decodes):
    """vLLM's ``split_decodes_and_prefills`` (v1/attention/backends/utils.py) on host arrays:
    (num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)."""
    n = len(qsl) - 1
    if (max_query_len <= threshold and (not require_uniform or threshold <= 1)
            and treat_short_extends_as_decodes):
        return n, 0, num_tokens, 0
    q = np.diff(qsl)
    if q[0] > threshold:
        return 0, n, 0, num_tokens
    if require_uniform:
        if treat_short_extends_as_decodes and bool(((q == q[0]) | (q == 0)).all()):
            return n, 0, num_tokens, 0
        is_prefill = (q != q[0]) & (q != 0)
    else:
        is_prefill = q > threshold
    if not treat_short_extends_as_decodes:
        is_prefill = is_prefill | is_prefilling[:n]
    if not is_prefill.any():
        return n, 0, num_tokens, 0
    first = int(np.argmax(is_prefill))
    return first, n - first, int(qsl[first]), num_tokens - int(qsl[first])


def _split_indexer_chunks(seq_lens, query_lens, workspace_size, max_logits_bytes):
    """The indexer's ``_split_indexer_prefill_chunks``: [(req_start, req_stop, q_start,
    q_stop)], requests grouped under the K-buffer and logits budgets, then cut on queries."""
    chunks, n, max_elems, end = [], len(seq_lens), max_logits_bytes // 4, 0
    seq_lens, query_lens = [int(s) for s in seq_lens], [int(x) for x in query_lens]
    while end < n:
        start, chunk_m, chunk_n = end, 0, 0
        while end < n:
            new_m, new_n = chunk_m + query_lens[end], chunk_n + seq_lens[end]
            if new_n > workspace_size or new_m * new_n > max_elems:
                break
            chunk_m, chunk_n, end = new_m, new_n, end + 1
        if end == start:  # one request over the budget alone: cut on its queries
            chunk_m, chunk_n, end = query_lens[end], seq_lens[end], end + 1
        max_q = max(1, max_elems // chunk_n) if chunk_n > 0 else max(1, chunk_m)
        chunks += [(start, end, q, q + min(max_q, chunk_m - q)) for q in range(0, chunk_m, max_q)]
    return chunks


def _run_bounds(req: np.ndarray) -> np.ndarray:
    """``request_row_bounds``: run r of one request's adjacent rows is [b[r], b[r + 1])."""
    return np.flatnonzero(np.r_[True, req[1:] != req[:-1], True])


def _pcp_chunk_plan(req, shard, dcp_size: int, interleave: int) -> dict:
    """``build_pcp_global_chunk_plan`` of one chunk's rows (request, shard rows of the whole
    request): prefix sums over the rows, a region's first row carrying its padded extent, and
    every global row's place in the rank-major gathered buffer."""
    bounds = _run_bounds(req)
    first = bounds[:-1]
    region_padded = shard[first].astype(np.int64)
    row_padded = np.zeros(len(req), dtype=np.int64)
    row_padded[first] = region_padded
    global_cu = np.concatenate(([0], np.cumsum(row_padded * dcp_size))).astype(np.int32)
    padded_cu = np.concatenate(([0], np.cumsum(row_padded))).astype(np.int32)
    region_of_row = np.repeat(np.arange(len(first)), np.diff(bounds))
    row_start_cu = np.append(global_cu[first][region_of_row], global_cu[-1]).astype(np.int32)
    padded_total, extent = int(padded_cu[-1]), region_padded * dcp_size
    region = np.repeat(np.arange(len(first)), extent)
    t = np.arange(int(extent.sum()), dtype=np.int64) - np.repeat(global_cu[first], extent)
    local = np.minimum((t // (dcp_size * interleave)) * interleave + t % interleave,
                       region_padded[region] - 1)
    idx = ((t // interleave) % dcp_size) * padded_total + padded_cu[first][region] + local
    return {"row_start_cu": row_start_cu, "global_cu": global_cu, "padded_local_cu": padded_cu,
            "padded_local_total": padded_total, "total": int(global_cu[-1]),
            "deinterleave_idx": idx}


def _prefill_chunk_plans(lb, nd, nr, pq, budget, logits_bytes, config) -> tuple[list, list]:
    """PCP + DCP: ``_split_pcp_dcp_prefill_chunks`` (requests charged once, sized by their
    shards x W and rows x longest row, widened back to rows) and each chunk's global plan."""
    w_size = config.dcp_size
    req = lb["idx_mapping_np"][:nr].astype(np.int64)
    shard = lb["dcp_local_seq_lens_cpu_upper_bound"][:nr]
    bounds = _run_bounds(req[nd:])
    first = bounds[:-1]
    seq = shard[nd:][first].astype(np.int64) * w_size
    query = np.diff(bounds) * np.maximum.reduceat(pq, first)
    specs = [(nd + int(bounds[a]), nd + int(bounds[b]), qa, qb)
             for a, b, qa, qb in _split_indexer_chunks(seq, query, budget, logits_bytes)]
    plans = [_pcp_chunk_plan(req[a:b], shard[a:b], w_size, config.interleave_size)
             for a, b, _, _ in specs]
    return specs, plans


def _indexer(lb, view, config, threshold, require_uniform, budget, logits_bytes) -> dict:
    """The DSA indexer builder's host derivation: its decode / prefill split, the prefill chunk
    specs (row slice, query slice) and, under PCP + DCP, each chunk's PCPGlobalChunkPlan."""
    nr, qsl, num_tokens = view
    pcp_dcp = config.pcp_size > 1 and config.dcp_size > 1
    split, specs, plans = (0, 0, 0, 0), [], []
    if num_tokens:  # a rank's placeholder row builds no indexer metadata
        split = _split_decodes_and_prefills(
            qsl, lb["is_prefilling_np"], int(lb["num_scheduled_tokens"].max()), num_tokens,
            threshold, require_uniform, config.pcp_size == 1)
    nd, n_pre = split[0], split[1]
    if n_pre:
        pq = np.diff(qsl[nd: nd + n_pre + 1])
        if pcp_dcp:
            specs, plans = _prefill_chunk_plans(lb, nd, nr, pq, budget, logits_bytes, config)
        else:
            specs = [(nd + a, nd + b, qa, qb) for a, b, qa, qb in _split_indexer_chunks(
                lb["seq_lens_cpu_upper_bound"][nd:nr], pq, budget, logits_bytes)]
    out = dict(zip(("indexer_num_decodes", "indexer_num_prefills", "indexer_num_decode_tokens",
                    "indexer_num_prefill_tokens"), split))
    out["indexer_chunk_specs"] = np.array(specs, dtype=np.int64).reshape(-1, 4)
    for key in ("row_start_cu", "global_cu", "padded_local_cu", "padded_local_total", "total",
                "deinterleave_idx"):
        out["pcp_" + key] = tuple(p[key] for p in plans) if pcp_dcp else None
    return out


def _workspace_chunks(rows: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """``split_prefill_chunks``: entries grouped greedily while their rows fit the budget."""
    bounds, i, n = [], 0, len(rows)
    while i < n:
        start, total = i, 0
        while i < n and total + int(rows[i]) <= budget:
            total, i = total + int(rows[i]), i + 1
        bounds.append((start, i))
    return bounds


def _flashmla(lb, view, config, threshold, budget) -> dict:
    """FlashMLA-sparse's separate prefill / decode path (its only path under PCP + DCP): the
    split (active decodes), one workspace entry per prefill row (per request under PCP + DCP,
    holding its DCP shard: ``gathered_prefill_shards``), each token's entry, and the workspace
    chunks with their starts rebased to 0 per chunk."""
    nr, qsl, num_tokens = view
    pcp_dcp = config.pcp_size > 1 and config.dcp_size > 1
    out = dict.fromkeys(("row_bounds", "shard_rows", "workspace_starts", "workspace_chunk_bounds",
                         "workspace_chunk_tokens", "workspace_chunk_rows", "prefill_request_id"))
    split = (0, 0, 0, 0)
    if num_tokens:
        split = _split_decodes_and_prefills(
            qsl, lb["is_prefilling_np"], int(lb["num_scheduled_tokens"].max()), num_tokens,
            threshold, True, config.pcp_size == 1)
    nd, n_pre, nd_tokens = split[0], split[1], split[2]
    if nd and int(qsl[1] - qsl[0]) == 0:
        # a FULL graph's padded view of a rank with no rows: vLLM's builder asserts a decode
        # query length > 0 (``_build_fp8_separate_prefill_decode``), so no metadata exists
        raise ConfigError("FlashMLA-sparse builds no metadata for this rank: its FULL-graph "
                          "batch pads a rank with no rows to decodes of 0 tokens; expected "
                          "an eager or PIECEWISE step, or a decode on every PCP rank")
    out.update(flashmla_num_decodes=nd_tokens // int(qsl[1] - qsl[0]) if nd else 0,
               flashmla_num_prefills=n_pre, flashmla_num_decode_tokens=nd_tokens,
               flashmla_num_prefill_tokens=num_tokens - nd_tokens if num_tokens else 0)
    if not n_pre:
        return out
    rows = lb["seq_lens_cpu_upper_bound"][nd:nr].astype(np.int32)
    bounds = np.arange(n_pre + 1)
    if pcp_dcp:
        bounds = _run_bounds(lb["idx_mapping_np"][nd:nr].astype(np.int64))
        out["shard_rows"] = lb["dcp_local_seq_lens_cpu_upper_bound"][nd:nr][bounds[:-1]].astype(
            np.int64)
        rows, budget = out["shard_rows"].astype(np.int32), budget // config.dcp_size
    if (rows > budget).any():
        raise ConfigError(f"a prefill entry of {int(rows.max())} rows exceeds FlashMLA-sparse's "
                          f"workspace of {budget} rows: expected a larger workspace factor")
    tok_start, tok_stop = qsl[nd + bounds[:-1]], qsl[nd + bounds[1:]]
    request_id = np.full(num_tokens, -1, dtype=np.int32)
    request_id[_segments(tok_start, tok_stop - tok_start)] = np.repeat(
        np.arange(len(rows), dtype=np.int32), tok_stop - tok_start)
    starts = np.zeros(len(rows), dtype=np.int32)
    starts[1:] = np.cumsum(rows[:-1])
    chunks = _workspace_chunks(rows, budget)
    for a, b in chunks:
        starts[a:b] -= starts[a]
    out.update(row_bounds=bounds.astype(np.int64), workspace_starts=starts,
               workspace_chunk_bounds=np.array(chunks, dtype=np.int64).reshape(-1, 2),
               workspace_chunk_tokens=np.array([(tok_start[a], tok_stop[b - 1]) for a, b in chunks],
                                               dtype=np.int64).reshape(-1, 2),
               workspace_chunk_rows=np.array([rows[a:b].sum() for a, b in chunks], dtype=np.int64),
               prefill_request_id=request_id)
    return out


def dsa_metadata(plan: StepPlan, pcp_rank: int, dcp_rank: int = 0, *,
                 cudagraph_mode: str = "FULL_AND_PIECEWISE", num_speculative_tokens: int = 0,
                 prefill_workspace_factor: int | None = None, indexer_max_logits_mb: int = 512,
                 indexer_require_uniform: bool = True,
                 flashmla_decode_threshold: int | None = None) -> dict:
    """What vLLM 0.32's sparse-MLA builders derive on the host for PCP rank ``pcp_rank``, DCP
    rank ``dcp_rank`` (:data:`DSA_FIELDS`), from :func:`local_batch` (same keywords) the way
    its attention metadata carries it (a FULL graph's padded request and token counts, eager's
    and PIECEWISE's real ones):

    - the DSA indexer (``indexer_*``): its decode / prefill split and prefill chunk specs,
      ``[n, 4]`` (row start, row stop, query start, query stop); under PCP + DCP
      (``_split_pcp_dcp_prefill_chunks``) each spec's PCPGlobalChunkPlan (``pcp_*``, one entry
      per spec; None otherwise);
    - FlashMLA-sparse's separate prefill / decode path (``flashmla_*`` and the workspace
      fields; FP8 KV with 32 heads or more, and always under PCP + DCP): its split, entries
      (``row_bounds``, under PCP + DCP ``shard_rows`` from ``gathered_prefill_shards``),
      ``workspace_starts`` rebased per chunk, chunk bounds, token slices and rows, and each
      token's entry (``prefill_request_id``, -1 for decodes); None without prefills;
    - ``dcp_local_seq_lens`` (W > 1): this DCP rank's share of each row's ``seq_lens``.

    Engine settings, with vLLM's defaults: ``prefill_workspace_factor``
    (``sparse_mla_prefill_workspace_factor``; None: 5 for max_model_len <= 256K, else 2) sizes
    the indexer's K buffer (``max_model_len * 8 * factor`` rows) and FlashMLA's workspace
    (``max_model_len * factor``, divided by W under PCP + DCP); ``indexer_max_logits_mb``
    (``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB``); the indexer's decode threshold is ``1 +
    num_speculative_tokens`` and ``indexer_require_uniform`` is True where it has neither a
    varlen nor a flattened decode kernel (Hopper); ``flashmla_decode_threshold`` None is vLLM's
    Hopper rule by ``config.num_heads`` (the heads per TP rank): 128 for 16 or 32 heads, 256
    otherwise, at least 1 + num_speculative_tokens, and 1 when W > 1 with an interleave > 1."""
    _check_ranks(plan, pcp_rank, dcp_rank, "dsa_metadata")
    config = plan.config
    lb = local_batch(plan, pcp_rank, dcp_rank, cudagraph_mode=cudagraph_mode,
                     num_speculative_tokens=num_speculative_tokens)
    factor = prefill_workspace_factor
    if factor is None:
        factor = 5 if config.max_model_len <= 256 * 1024 else 2
    for name, value, low in (("prefill_workspace_factor", factor, 2),
                             ("indexer_max_logits_mb", indexer_max_logits_mb, 1)):
        if type(value) is not int or value < low:
            raise ConfigError(f"{name} must be an int >= {low}: got {value!r}")
    full = full_graph_num_reqs(plan, cudagraph_mode, num_speculative_tokens) is not None
    nr = lb["num_reqs_after_padding"] if full else lb["num_reqs"]
    view = (nr, lb["query_start_loc_np"][: nr + 1].astype(np.int64),
            lb["num_tokens_after_padding"] if full else lb["num_tokens"])
    threshold = flashmla_decode_threshold
    if threshold is None:
        threshold = _FLASHMLA_THRESHOLDS.get(config.num_heads, 256)
        threshold = max(threshold, 1 + num_speculative_tokens) if num_speculative_tokens else threshold
        threshold = 1 if config.dcp_size > 1 and config.interleave_size != 1 else threshold
    out = _indexer(lb, view, config, 1 + num_speculative_tokens, bool(indexer_require_uniform),
                   config.max_model_len * _INDEXER_BYTES_RATIO * factor,
                   indexer_max_logits_mb * 1024 * 1024)
    out.update(_flashmla(lb, view, config, threshold, config.max_model_len * factor))
    out["dcp_local_seq_lens"] = None
    if config.dcp_size > 1:
        seq_lens = lb["seq_lens"][: lb["num_reqs"]].astype(np.int64)
        out["dcp_local_seq_lens"] = _padded(
            shard_count(seq_lens, config.dcp_size, config.interleave_size, dcp_rank),
            lb["num_reqs_after_padding"], np.int32)
    return {key: out[key] for key in DSA_FIELDS}
