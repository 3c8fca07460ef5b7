"""The invariants of a decoded StepPlan, checked before anything reads it (docs/design.md §6.3;
docs/failures.md).

A plan file whose checksum and digest are right can still say nonsense (a mode of 7, a row
pointing past the requests, T = 2**40, a gather chunk of 2 G rows); ``inspect``, ``diff``,
``draw`` and the runtime index and allocate by these numbers. :func:`check_plan` refuses such a
plan with one :class:`PlanFormatError` line. The tables are re-derived from the request columns
and the config in one jitted pass (:mod:`cpplan.schemas._invariant_kernel`; no Python loop over
requests or rows, one over gather chunks and collectives only), so decoding stays cheap.

What holds afterwards: every array has its documented dtype and shape; every count and size is
within int32; the request columns satisfy the step rules (``c >= 0``, ``q >= 1``,
``c + q <= max_model_len``) and every derived table (modes, chunk sizes, DCP shard rows and
local lengths, the published rows with their offsets, lengths, token starts and KV writes, the
per-rank counts, T and the CUDA-graph size, the greedy gather chunks and their prefix sums)
equals the one the rules give; collectives have known names, ops, groups and dtypes, shapes
within int32 and byte counts that add up. Not checked: that req_ids are unique (a set of
strings would cost as much as the rest of decoding).
"""

from __future__ import annotations

import math
import operator
import re
from bisect import bisect_left

import numpy as np

from cpplan.schemas import _invariant_kernel as K
from cpplan.schemas.errors import PlanFormatError
from cpplan.schemas.plan import EAGER, StepPlan

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

_REQUEST_ARRAYS = (("num_computed_tokens", "<i4"), ("num_scheduled_tokens", "<i4"),
                   ("is_prefilling", "|u1"), ("mode", "|u1"), ("chunk_size", "<i4"),
                   ("dcp_shard_rows", "<i4"))
_RANK_ROW_ARRAYS = (("row_query_offset", "<i4"), ("row_num_tokens", "<i4"),
                    ("row_token_start", "<i4"), ("row_kv_write", "|u1"))
_SHAPED_ARRAYS = operator.attrgetter(*[name for name, _ in _REQUEST_ARRAYS], "dcp_local_lens",
                                     "row_request", *[name for name, _ in _RANK_ROW_ARRAYS])
_SHAPED_DTYPES = tuple(d for _, d in _REQUEST_ARRAYS) + ("<i4", "<i4") \
    + tuple(d for _, d in _RANK_ROW_ARRAYS)
_COLLECTIVE_NAME = re.compile(
    r"(kv_insert|indexer_k_insert|topk_candidates|decode_lse|decode_out|restore"
    r"|restore_sampled"
    r"|(indexer_k|kv)_gather\[(0|[1-9][0-9]{0,8})\])")
_COLLECTIVE_ITEMSIZE = {"uint8": 1, "float32": 4, "bfloat16": 2, "float16": 2,
                        "float32+int32": 8, "float32+int64": 12}


def _fail(rule: str) -> None:
    raise PlanFormatError(f"inconsistent plan: {rule}")


def check_plan(plan: StepPlan) -> None:
    """Raise PlanFormatError (one line, naming the broken rule) unless ``plan`` holds the
    invariants listed in the module docstring."""
    _check_scalars(plan)
    _check_shapes(plan)
    _check_tables(plan)
    _check_padding(plan)
    _check_collectives(plan)
    _check_sampled(plan)


def _check_sampled(plan: StepPlan) -> None:
    """Sampled rows (schema 2): both fields or neither; one source per sampled request, each a
    real token of its rank."""
    flags, src = plan.is_sampled, plan.sampled_source
    if flags is None and src is None:
        return
    n = len(plan.req_ids)
    if flags is None or src is None or flags.dtype != "|u1" or flags.shape != (n,) \
            or src.dtype != "<i4" or len(src.shape) != 2 or src.shape[1:] != (2,):
        _fail(f"is_sampled (|u1 [{n}]) and sampled_source (<i4 [n_sampled, 2]) must be given "
              f"together: got {getattr(flags, 'shape', None)}, {getattr(src, 'shape', None)}")
    f = flags.np()
    if f.size and f.max() > 1:
        _fail("is_sampled must be 0 or 1")
    if src.shape[0] != int(f.sum()):
        _fail(f"sampled_source must have one row per sampled request ({int(f.sum())}): got "
              f"{src.shape[0]}")
    if src.shape[0]:
        rank, token = src.np()[:, 0], src.np()[:, 1]
        limit = np.asarray(plan.num_tokens, dtype=np.int64)
        if rank.min() < 0 or rank.max() >= plan.config.pcp_size or token.min() < 0 \
                or (token >= limit[np.clip(rank, 0, len(limit) - 1)]).any():
            _fail("sampled_source must name a PCP rank and one of its real tokens")


def _int_in(name: str, value, lo: int, hi: int) -> None:
    if type(value) is not int or not lo <= value <= hi:
        _fail(f"{name} must be an integer in [{lo}, {hi}]: got {value!r}")


def _check_scalars(plan: StepPlan) -> None:
    _int_in("step_id", plan.step_id, 0, INT64_MAX)
    if len(plan.num_tokens) != plan.config.pcp_size:
        _fail(f"num_tokens must have pcp_size = {plan.config.pcp_size} entries: got "
              f"{len(plan.num_tokens)}")
    for p, count in enumerate(plan.num_tokens):
        _int_in(f"num_tokens[{p}]", count, 0, INT32_MAX)
    _int_in("padded_num_tokens", plan.padded_num_tokens, 0, INT32_MAX)
    _int_in("num_decode_tokens", plan.num_decode_tokens, 0, INT32_MAX)
    _int_in("num_decode_rows", plan.num_decode_rows, 0, INT32_MAX)
    _int_in("cudagraph_size", plan.cudagraph_size, 0, INT32_MAX)


def _check_shapes(plan: StepPlan) -> None:
    n, p_size, w_size = len(plan.req_ids), plan.config.pcp_size, plan.config.dcp_size
    r = plan.row_request.shape[0] if len(plan.row_request.shape) == 1 else -1
    arrays = _SHAPED_ARRAYS(plan)
    if tuple(a.dtype for a in arrays) == _SHAPED_DTYPES and tuple(a.shape for a in arrays) \
            == ((n,),) * len(_REQUEST_ARRAYS) + ((n, w_size), (r,)) \
            + ((p_size, r),) * len(_RANK_ROW_ARRAYS):
        return  # the common case, in two comparisons; otherwise name the first mismatch
    expected = [(name, dtype, (n,)) for name, dtype in _REQUEST_ARRAYS]
    expected += [("dcp_local_lens", "<i4", (n, w_size)), ("row_request", "<i4", (max(r, 0),))]
    expected += [(name, dtype, (p_size, max(r, 0))) for name, dtype in _RANK_ROW_ARRAYS]
    for name, dtype, shape in expected:
        arr = getattr(plan, name)
        if arr.dtype != dtype or arr.shape != shape:
            _fail(f"{name} must be {dtype} of shape {shape} (num_requests={n}, pcp_size="
                  f"{p_size}, dcp_size={w_size}): got {arr.dtype} of shape {arr.shape}")


KERNEL_RULES = {
    K.C_NEG: ("num_computed_tokens", "must be >= 0"),
    K.Q_LOW: ("num_scheduled_tokens", "must be >= 1"),
    K.EXTENT: ("extent", "(c + q) must be <= max_model_len"),
    K.PRE: ("is_prefilling", "must be 0 or 1"),
    K.MODE: ("mode", "must follow is_prefilling, q, pcp_size, dcp_size and "
                     "shard_decode_requests"),
    K.CHUNK: ("chunk_size", "must be ceil(q / 2P) for a split request, q otherwise"),
    K.SHARD: ("dcp_shard_rows", "must be shard_rows(c + q)"),
    K.LOCAL: ("dcp_local_lens", "must be the KV tokens of the extent on each DCP rank"),
    K.ROWS: ("row_request", "length must be one row per request plus one per split request"),
    K.ROW_REQ: ("row_request", "must list decodes, then prefills (a split request twice), "
                               "in request order"),
    K.ROW_OFF: ("row_query_offset", "must be the row's chunk offset in its request"),
    K.ROW_LEN: ("row_num_tokens", "must be the row's chunk length"),
    K.ROW_KV: ("row_kv_write", "must be 1, or 0 for a replicated row off PCP rank 0 or an "
                               "owned decode off its owner"),
    K.ROW_START: ("row_token_start", "must be the sum of the rank's earlier row lengths"),
    K.NUM_TOKENS: ("num_tokens", "must be the rank's row lengths summed"),
    K.DEC_ROWS: ("num_decode_rows", "must be the number of decode requests (0 when owned)"),
    K.DEC_TOKENS: ("num_decode_tokens", "must be the decode rows' tokens"),
    K.N_CHUNKS: ("gather_chunks", "count must be the greedy cut's of the prefill requests"),
    K.CH_SIZE: ("gather chunk", "must hold the requests of the greedy cut within the workspace"),
    K.CH_REQ: ("gather chunk requests", "must be the prefill requests in request order"),
    K.CH_PAD: ("gather chunk pad", "must be dcp_shard_rows of its request"),
    K.CH_PCU: ("gather chunk padded_local_cu", "must be the prefix sums of the chunk's pads"),
    K.CH_GCU: ("gather chunk global_cu", "must be the prefix sums of the chunk's extents"),
    K.CH_PT: ("gather chunk padded_local_total", "must be the sum of the chunk's pads"),
    K.CH_TOTAL: ("gather chunk total", "must be the sum of the chunk's extents"),
}


_DTYPES = {"<i4": np.dtype("<i4"), "<i8": np.dtype("<i8"), "|u1": np.dtype("|u1")}
# kernel arguments of a plan without gather chunks (read-only like the decoded views, so the
# jitted function keeps one signature)
_EMPTY = {name: np.frombuffer(b"", dtype) for name, dtype in _DTYPES.items()}
_NO_INTS = np.zeros(0, np.int64)


def _flat(arr) -> np.ndarray:
    """A 1-D read-only view of an Array (shape already checked)."""
    return np.frombuffer(arr.data, _DTYPES[arr.dtype])


def _check_tables(plan: StepPlan) -> None:
    """Requests, rows and gather chunks, by the jitted re-derivation (one call)."""
    cfg = plan.config
    chunks = plan.gather_chunks
    if cfg.dcp_size == 1 and chunks:
        _fail(f"gather_chunks must be empty with dcp_size 1: got {len(chunks)}")
    _check_chunk_shapes(chunks)
    if chunks:  # the chunks' arrays concatenated, and their sizes and totals
        req, pad, pcu, gcu, sizes, pts, totals = [], [], [], [], [], [], []
        for ch in chunks:
            req.append(ch.requests.data)
            pad.append(ch.pad.data)
            pcu.append(ch.padded_local_cu.data)
            gcu.append(ch.global_cu.data)
            sizes.append(ch.requests.shape[0])
            pts.append(ch.padded_local_total)
            totals.append(ch.total)
        c_req, c_pad = np.frombuffer(b"".join(req), "<i4"), np.frombuffer(b"".join(pad), "<i4")
        c_pcu, c_gcu = np.frombuffer(b"".join(pcu), "<i8"), np.frombuffer(b"".join(gcu), "<i8")
        c_sizes, c_pts, c_totals = (np.array(v, np.int64) for v in (sizes, pts, totals))
    else:
        c_req, c_pad, c_pcu, c_gcu = _EMPTY["<i4"], _EMPTY["<i4"], _EMPTY["<i8"], _EMPTY["<i8"]
        c_sizes = c_pts = c_totals = _NO_INTS

    n, r = len(plan.req_ids), plan.row_request.shape[0]
    rule, at, got = K.check_tables(
        _flat(plan.num_computed_tokens), _flat(plan.num_scheduled_tokens),
        _flat(plan.is_prefilling), _flat(plan.mode), _flat(plan.chunk_size),
        _flat(plan.dcp_shard_rows), _flat(plan.dcp_local_lens), _flat(plan.row_request),
        _flat(plan.row_query_offset), _flat(plan.row_num_tokens), _flat(plan.row_token_start),
        _flat(plan.row_kv_write), np.array(plan.num_tokens, np.int64), plan.num_decode_rows,
        plan.num_decode_tokens, cfg.pcp_size, cfg.dcp_size, cfg.interleave_size,
        cfg.max_model_len, cfg.gather_workspace_tokens,
        c_sizes, c_req, c_pad, c_pcu, c_gcu, c_pts, c_totals, bool(cfg.shard_decode_requests))
    if rule == K.OK:
        return
    name, words = KERNEL_RULES[rule]
    shape = {K.LOCAL: (n, cfg.dcp_size)}.get(rule)
    if rule in (K.ROW_OFF, K.ROW_LEN, K.ROW_KV, K.ROW_START):
        shape = (cfg.pcp_size, r)
    if rule in (K.ROWS, K.DEC_ROWS, K.DEC_TOKENS, K.N_CHUNKS):  # whole-plan counts
        _fail(f"{name} {words}: got {got}")
    where = ", ".join(map(str, np.unravel_index(at, shape))) if shape else str(at)
    _fail(f"{name}[{where}] {words}: got {got}")


def _check_chunk_shapes(chunks) -> None:
    for k, ch in enumerate(chunks):
        req, pad, pcu, gcu = ch.requests, ch.pad, ch.padded_local_cu, ch.global_cu
        m = req.shape[0] if len(req.shape) == 1 else 0
        if m < 1 or req.dtype != "<i4" or pad.dtype != "<i4" or pcu.dtype != "<i8" \
                or gcu.dtype != "<i8" or pad.shape != req.shape or pcu.shape != (m + 1,) \
                or gcu.shape != (m + 1,):
            arrays = (req, pad, pcu, gcu)
            _fail(f"gather chunk {k} must hold n >= 1 requests as <i4 requests [n], <i4 pad "
                  f"[n], <i8 padded_local_cu [n+1], <i8 global_cu [n+1]: got "
                  + ", ".join(f"{a.dtype} {list(a.shape)}" for a in arrays))
        if not (0 <= ch.padded_local_total <= INT32_MAX and 0 <= ch.total <= INT32_MAX):
            _fail(f"gather chunk {k} padded_local_total and total must be in [0, {INT32_MAX}]: "
                  f"got {ch.padded_local_total}, {ch.total}")


def _check_padding(plan: StepPlan) -> None:
    sizes, top = plan.config.cudagraph_token_sizes, max(plan.num_tokens)
    k = bisect_left(sizes, top)
    expected = (sizes[k], sizes[k]) if k < len(sizes) else (top, EAGER)
    if (plan.padded_num_tokens, plan.cudagraph_size) != expected:
        _fail(f"(padded_num_tokens, cudagraph_size) must be {expected} for {top} tokens on the "
              f"fullest rank and cudagraph_token_sizes {list(sizes)}: got "
              f"({plan.padded_num_tokens}, {plan.cudagraph_size})")


_KNOWN_KEYS: set = set()  # (name, op, group, dtype) already found valid
_VALID_COLLECTIVES: set = set()  # whole Collective structs already found valid (they repeat)


def _check_collectives(plan: StepPlan) -> None:
    limit = 6 + 2 * len(plan.gather_chunks)
    if len(plan.collectives) > limit:
        _fail(f"a step issues at most {limit} collectives: got {len(plan.collectives)}")
    for c in plan.collectives:
        if c in _VALID_COLLECTIVES:
            continue
        key = (c.name, c.op, c.group, c.dtype)
        if key not in _KNOWN_KEYS:
            if not _COLLECTIVE_NAME.fullmatch(c.name) or c.op not in ("all_gather", "all_reduce") \
                    or c.group not in ("pcp", "dcp") or c.dtype not in _COLLECTIVE_ITEMSIZE:
                _fail(f"collective {c.name!r}: unknown name, op {c.op!r}, group {c.group!r} or "
                      f"dtype {c.dtype!r}")
            if len(_KNOWN_KEYS) < 4096:
                _KNOWN_KEYS.add(key)
        shape = c.shape
        if not 1 <= len(shape) <= 3 or min(shape) < 0 or max(shape) > INT32_MAX:
            _fail(f"collective {c.name!r}: shape must have 1 to 3 dimensions in [0, "
                  f"{INT32_MAX}]: got {list(shape)}")
        layers = c.layers
        if layers and (not c.per_layer or list(layers) != sorted(set(layers))
                       or layers[0] < 0 or layers[-1] >= plan.config.num_layers):
            _fail(f"collective {c.name!r}: layers must be distinct ascending layers of a "
                  f"per-layer entry, below num_layers {plan.config.num_layers}: got "
                  f"{list(layers)}")
        size = _COLLECTIVE_ITEMSIZE[c.dtype] * math.prod(shape)
        if c.bytes != size:
            _fail(f"collective {c.name!r}: bytes must be prod(shape) * itemsize = {size}: got "
                  f"{c.bytes}")
        if len(_VALID_COLLECTIVES) < 4096:
            _VALID_COLLECTIVES.add(c)
