"""A rank's table segments, built on the host (docs/design.md §5.3): the block-table checks,
:func:`build_tables` (one jitted pass, O(P * rows + requests), never O(tokens)) and the static
layout of graph-replayable steps (docs/design.md §5.6). The segment format and the device
expansion are in ``runtime/tables.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import njit

from cpplan.runtime.executor_args import is_int_in_range
from cpplan.runtime.tables import (
    NUM_PARAMS,
    SEG_BT_ROW_START,
    SEG_K_BASE,
    SEG_KEEP_LIMIT,
    SEG_REGION_PCU,
    SEG_REQUEST,
    SEG_SLOPE,
    SEG_X_BASE,
    TABLE_NAMES,
    Layout,
    RankTables,
    StepMeta,
    arena_overflow,
)
from cpplan.schemas.errors import CapacityError, PlanFormatError, StepInputError
from cpplan.schemas.plan import MODE_DECODE, MODE_OWNED, MODE_SPLIT, StepPlan

_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)  # block-table dtypes used as they are
_NO_WORDS = np.zeros(0, np.int64)  # ``out`` of build_tables' sizing call


def check_block_tables(plan: StepPlan, dcp_rank: int, block_tables, num_blocks: int | None,
                       aliases: AliasCheck | None = None) -> tuple[np.ndarray, int]:
    """Validate a rank's block tables for ``plan`` and return them as ``[N, max_blocks]`` int32
    or int64, C order (other integer types and layouts are converted to int64), with the
    largest block the step touches (0 if none: the caches must hold its rows).

    Checked, because each of these would otherwise write and read the wrong KV silently: a 2-d
    integer array with exactly one row per request of the plan; every block the step touches
    (the first ceil(local tokens / B) of each request on this DCP rank) is not the reserved
    block 0 and, where ``num_blocks`` is known, below it; with ``aliases``, that the blocks the
    step writes alias nothing (:class:`AliasCheck`). O(requests) (+ touched blocks), on the
    host, in jitted calls (bind runs it cold, after the previous step's work: few host
    calls)."""
    n = plan.num_requests
    if num_blocks is not None and not is_int_in_range(num_blocks, 2, 2**62 - 1):
        raise StepInputError(f"step {plan.step_id}: num_blocks: got {num_blocks!r}; expected "
                             "None or the caches' block count, an integer >= 2 (block 0 is "
                             "reserved)")
    if type(block_tables) is np.ndarray:
        bt = block_tables
    else:
        try:
            bt = np.asarray(block_tables)
        except (ValueError, TypeError) as exc:  # ragged lists, objects numpy cannot stack
            raise StepInputError(f"step {plan.step_id}: block_tables must be [num_requests="
                                 f"{n}, max_blocks] integers: got {type(block_tables).__name__} "
                                 f"numpy cannot read as one ({exc})") from None
    if bt.ndim != 2 or bt.shape[0] != n:
        raise StepInputError(f"step {plan.step_id}: block_tables must be [num_requests={n}, "
                             f"max_blocks]: got shape {list(bt.shape)}")
    dt, given = bt.dtype, bt
    if dt is not _I64 and dt is not _I32 or not bt.flags.c_contiguous:
        if dt.kind not in "iu":
            raise StepInputError(f"step {plan.step_id}: block_tables must hold integers: got "
                                 f"dtype {dt}")
        bt = np.ascontiguousarray(bt, dtype=np.int64)
    i, j, need, top = _first_bad_block(bt, plan.dcp_local_lens.np(), dcp_rank,
                                       plan.config.block_size,
                                       -1 if num_blocks is None else int(num_blocks))
    if j == -2:
        raise CapacityError(f"step {plan.step_id}: block table too narrow: request {i} needs "
                            f"{need} blocks on this rank, the tables have {bt.shape[1]}")
    if i >= 0:  # only the blocks the step touches; the rest is the engine's padding
        limit = f"1..{num_blocks - 1}" if num_blocks is not None else ">= 1 (0 is reserved)"
        raise StepInputError(f"step {plan.step_id}: block_tables[{i}][{j}] = {int(given[i, j])}: "
                             f"expected a block in {limit}")
    if aliases is not None:
        aliases.check(plan, dcp_rank, bt, int(top))
    return bt, int(top)


class AliasCheck:
    """Blocks a step writes must belong to one request and one position: a block written by
    request i at block-table column j that appears anywhere else among the step's touched
    blocks (another request's, or another column of i's) would make attention read another
    request's KV, silently. Read-only blocks may be shared (a common prefix). One jitted pass
    over the touched blocks, with a stamp array reused across binds (no clearing), O(touched
    blocks + requests)."""

    def __init__(self) -> None:
        self.stamps = np.zeros(0, dtype=np.int64)  # per block: the bind that last wrote it
        self.writer = np.zeros(0, dtype=np.int64)  # request * 2**32 + column of that write
        self.generation = 0
        self.reads = np.zeros(0, dtype=np.int64)  # per block: the (bind, request) last reading
        self.read_generation = 0

    MAX_STAMPS = 1 << 24  # blocks a stamp array covers (256 MiB with the writers)

    def check(self, plan: StepPlan, dcp_rank: int, bt: np.ndarray, top: int) -> None:
        if top >= self.MAX_STAMPS:  # huge block ids (no num_blocks given): renumber the touched
            need = -(-plan.dcp_local_lens.np()[:, dcp_rank].astype(np.int64)
                     // plan.config.block_size)
            touched = np.arange(bt.shape[1])[None, :] < need[:, None]
            ids, inverse = np.unique(bt[touched], return_inverse=True)
            dense = np.zeros_like(bt)
            dense[touched] = inverse.astype(bt.dtype) + 1
            self._check(plan, dcp_rank, dense, len(ids), bt)
            return
        self._check(plan, dcp_rank, bt, top, bt)

    def _check(self, plan: StepPlan, dcp_rank: int, bt: np.ndarray, top: int,
               given: np.ndarray) -> None:
        if top + 1 > len(self.stamps):
            size = max(top + 1, 2 * len(self.stamps))
            self.stamps = np.zeros(size, dtype=np.int64)
            self.writer = np.zeros(size, dtype=np.int64)
            self.reads = np.zeros(size, dtype=np.int64)
            self.generation = self.read_generation = 0
        self.generation += 1
        cfg = plan.config
        i, j, i2, j2 = _first_alias(bt, plan.num_computed_tokens.np(), plan.dcp_local_lens.np(),
                                    dcp_rank, cfg.dcp_size, cfg.interleave_size, cfg.block_size,
                                    self.stamps, self.writer, self.generation)
        if i < 0:
            i, j, j2 = _first_repeat(bt, plan.dcp_local_lens.np(), dcp_rank, cfg.block_size,
                                     self.reads, self.read_generation)
            self.read_generation += bt.shape[0] + 1
            if i >= 0:
                raise StepInputError(
                    f"step {plan.step_id}: block {int(given[i, j])} is used by request {i} "
                    f"({plan.req_ids[i]!r}) at block-table columns {j2} and {j}; expected each "
                    "block of a request at one column (requests may share read-only blocks)")
        if i >= 0:
            ids = plan.req_ids
            other = (f"request {i2} ({ids[i2]!r}) at column {j2}" if i2 != i
                     else f"its own column {j2}")
            raise StepInputError(
                f"step {plan.step_id}: block {int(given[i, j])} is written by request {i} "
                f"({ids[i]!r}) at block-table column {j} and also used by {other}; expected "
                "each block a step writes to belong to one request and one position")


@njit(cache=True)
def _first_alias(bt, computed, local_lens, dcp_rank, dcp_size, interleave, block_size, stamps,
                 writer, gen):
    """(i, j, i2, j2): the first written block bt[i, j] also touched at (i2, j2), or all -1.
    Request i writes its local tokens [count(c_i), local_lens[i]) on this rank (count: the
    tokens of an extent this DCP rank holds, docs/design.md §3.4), so blocks from
    count(c_i) // B to ceil(local_lens[i] / B) - 1 (none when the range is empty); it
    touches blocks 0 .. that end."""
    n = bt.shape[0]
    span = dcp_size * interleave
    for i in range(n):  # pass 1: stamp the written blocks; a block written twice is an alias
        c = np.int64(computed[i])
        held = (c // span) * interleave + min(max(c % span - dcp_rank * interleave, 0),
                                              interleave)
        end = np.int64(local_lens[i, dcp_rank])  # writes local tokens [held, end)
        first = held // block_size if end > held else end  # none written: an empty range
        for j in range(first, -(-end // block_size)):
            b = bt[i, j]
            if stamps[b] == gen:
                w = writer[b]
                return i, j, w >> 32, w & 0xFFFFFFFF
            stamps[b] = gen
            writer[b] = (np.int64(i) << 32) | j
    for i in range(n):  # pass 2: a read block that some request writes is an alias
        c = np.int64(computed[i])
        held = (c // span) * interleave + min(max(c % span - dcp_rank * interleave, 0),
                                              interleave)
        end = np.int64(local_lens[i, dcp_rank])
        # columns only read: before the first written one (all touched when none is written)
        last = held // block_size if end > held else -(-held // block_size)
        for j in range(last):
            b = bt[i, j]
            if stamps[b] == gen:
                w = writer[b]
                return w >> 32, w & 0xFFFFFFFF, i, j
    return -1, -1, -1, -1


@njit(cache=True)
def _first_repeat(bt, local_lens, dcp_rank, block_size, reads, base):
    """(i, j, j2): the first block bt[i, j] that request i also touches at its column j2 < j,
    or all -1 (two of a request's positions would read one block's KV). ``reads[b]`` is
    stamped ``base + i + 1`` per request, so no clearing between binds."""
    for i in range(bt.shape[0]):
        stamp = base + i + 1
        for j in range(-(-np.int64(local_lens[i, dcp_rank]) // block_size)):
            b = bt[i, j]
            if reads[b] == stamp:
                for j2 in range(j):
                    if bt[i, j2] == b:
                        return i, j, j2
            reads[b] = stamp
    return -1, -1, -1


@njit(cache=True)
def _first_bad_block(bt, local_lens, dcp_rank, block_size, num_blocks):
    """Request i touches its first need_i = ceil(local_lens[i, dcp_rank] / block_size) blocks.
    (i, -2, need_i, 0) for the first request whose need_i exceeds the tables' width; else (i,
    j, 0, 0) for the first (row-major) touched block ``bt[i, j]`` that is < 1 or, where
    ``num_blocks`` >= 0, >= num_blocks; (-1, -1, 0, the largest touched block) if none."""
    width = bt.shape[1]
    for i in range(bt.shape[0]):
        need = -(-np.int64(local_lens[i, dcp_rank]) // block_size)
        if need > width:
            return i, -2, need, np.int64(0)
    top = np.int64(0)
    for i in range(bt.shape[0]):
        need = -(-np.int64(local_lens[i, dcp_rank]) // block_size)
        for j in range(need):
            if bt[i, j] < 1 or (num_blocks >= 0 and bt[i, j] >= num_blocks):
                return i, j, np.int64(0), np.int64(0)
            top = max(top, np.int64(bt[i, j]))
    return -1, -1, np.int64(0), top


def build_tables(plan: StepPlan, pcp_rank: int, dcp_rank: int, block_tables: np.ndarray,
                 dummy_slot: int, out: np.ndarray | None = None) -> RankTables:
    """The rank's segments for ``plan``; ``block_tables`` is ``[N, max_blocks]`` int32 / int64
    (row i: this rank's local blocks of request i, in the plan's request order), already
    validated (:func:`check_block_tables`). O(P * rows + requests), in one jitted call that
    writes the words (segment ends, parameters, block tables: :data:`tables.TABLE_NAMES`)
    straight into ``out`` (bind: the arena's host words; CapacityError if they do not fit), or
    into a new array."""
    cfg = plan.config
    t_pad, p_size = plan.padded_num_tokens, cfg.pcp_size
    graph = plan.graph_replayable
    nd = t_pad if graph else plan.num_decode_tokens  # graph: every padded token is a decode
    names = {c.name for c in plan.collectives}
    kv_insert = "kv_insert" in names
    insert_len = nd + p_size * (t_pad - nd) if kv_insert else t_pad
    ch = _chunks(plan, dcp_rank)
    args = (plan.row_token_start.np(), plan.row_num_tokens.np(), plan.row_query_offset.np(),
            plan.row_kv_write.np(), plan.row_request.np(), plan.num_computed_tokens.np(),
            plan.num_scheduled_tokens.np(), plan.mode.np(), plan.dcp_local_lens.np(),
            block_tables, ch.pcu_of, ch.chunk_of, ch.regions, len(ch.rows), pcp_rank, dcp_rank,
            nd, t_pad, kv_insert, graph_segments(t_pad, p_size) if graph else 0, cfg.dcp_size,
            cfg.interleave_size, cfg.block_size)
    facts = _segment_kernel(*args, _NO_WORDS if out is None else out)
    segs, need = int(facts[F_SEGMENTS]), int(facts[F_WORDS])
    if graph and int(facts[F_REAL_SEGMENTS]) >= segs:
        raise PlanFormatError(f"a graph-replayable step has {int(facts[F_REAL_SEGMENTS])} "
                              f"segments, expected fewer than {segs}")
    sizes = (segs, NUM_PARAMS * segs, need - (NUM_PARAMS + 1) * segs)
    if out is None:
        out = np.empty(need, np.int64)
        facts = _segment_kernel(*args, out)
    elif need > out.size:
        raise arena_overflow(plan.step_id, dict(zip(TABLE_NAMES, sizes)), out.size)
    if facts[F_ORDER] or facts[F_CHUNK_GAP]:
        what = "rows of a rank are not in token order" if facts[F_ORDER] else "a gather "\
            "chunk's tokens are not contiguous on a rank"
        raise PlanFormatError(f"step {plan.step_id}: {what} (expected from row_token_start, "
                              f"an exclusive prefix sum of row_num_tokens)")
    n_real, blocks = int(facts[F_TOKENS]), int(facts[F_GRAPH_BLOCKS])
    if graph:  # static shapes: one capture serves every step of this key
        dec_width = blocks * cfg.block_size
        local_range, restore_len = (0, t_pad, dec_width), p_size * t_pad
    else:
        dec_width = int(facts[F_DECODE_KEYS])
        local_range, restore_len = (0, n_real, max(int(facts[F_KEYS]), 1)), int(facts[F_SUM_Q])
    ranges = (tuple(map(tuple, facts[F_RANGES:].reshape(-1, 3).tolist())) if ch.rows else ())
    meta = StepMeta(num_tokens=n_real, padded=t_pad, num_decode_tokens=nd,
                    decode_width=max(dec_width, 1), local_range=local_range,
                    chunk_ranges=ranges, chunk_rows=ch.rows,
                    kv_insert=kv_insert, decode_merge="decode_out" in names,
                    restore="restore" in names, num_global_tokens=int(facts[F_SUM_Q]),
                    graph_key=(t_pad, blocks) if graph else None)
    layout = Layout(num_requests=t_pad if graph else plan.num_requests, insert_len=insert_len,
                    dcp_size=cfg.dcp_size, dcp_rank=dcp_rank,
                    interleave_size=cfg.interleave_size, block_size=cfg.block_size,
                    dummy_slot=dummy_slot, restore_len=restore_len)
    return RankTables(words=out[:need], sizes=sizes, meta=meta, layout=layout)


def local_prefill_keys(plan: StepPlan) -> int:
    """W == 1: rows of the local prefill keys buffer (tables.local_prefill_rows): the extents of
    the requests past the every-rank decodes (prefills, and owned decodes, which take the same
    path) summed, which bounds what any rank's prefill tokens read."""
    return int(plan.extent()[plan.mode.np() != MODE_DECODE].sum())


def graph_key_of(plan: StepPlan) -> tuple[int, int] | None:
    """(T, key blocks) of a graph-replayable plan, else None. Key blocks: the next power of
    two of the blocks the longest decode holds on any DCP rank, so that steps of one padded
    size share a handful of captures; the decode pass reads ``blocks * block_size`` keys and
    block tables of that width (identical on every rank: it depends on the plan only)."""
    if not plan.graph_replayable:
        return None
    longest = int(plan.dcp_local_lens.np().max()) if plan.num_requests else 0
    blocks = max(1, -(-longest // plan.config.block_size))
    return plan.padded_num_tokens, 1 << (blocks - 1).bit_length()


def graph_segments(t_pad: int, p_size: int) -> int:
    """Segments of a graph-replayable step, padded (static): 3 token windows of at most
    2 * T + 1 segments (a decode-only step has at most T rows), one restore segment per row
    (decodes come from PCP rank 0 only), and a terminal zero segment (restore rows past sum q)."""
    return 3 * (2 * t_pad + 1) + t_pad + 1


@dataclasses.dataclass(frozen=True)
class _Chunks:
    """The gather chunks' regions (W > 1; none otherwise): ``regions`` ``[4, G]`` int64 rows
    request, first and end row in the gather section, rows this rank holds; per request its
    chunk (-1: none) and pcu; PT per chunk."""

    regions: np.ndarray
    chunk_of: np.ndarray  # [N]
    pcu_of: np.ndarray  # [N]
    rows: tuple[int, ...]


# no gather chunks (W == 1, or no prefill): empty per-request arrays read as chunk -1, pcu 0
_NO_CHUNKS = _Chunks(np.zeros((4, 0), np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), ())


def _chunks(plan: StepPlan, dcp_rank: int) -> _Chunks:
    chunks = plan.gather_chunks if plan.config.dcp_size > 1 else ()
    if not chunks:
        return _NO_CHUNKS
    creq = np.concatenate([ch.requests.np() for ch in chunks])
    pcu = np.concatenate([ch.padded_local_cu.np() for ch in chunks])
    sizes = np.array([len(ch.requests) for ch in chunks], np.int64)
    regions, chunk_of, pcu_of = _region_kernel(creq, pcu, sizes, plan.dcp_local_lens.np(),
                                               dcp_rank, plan.num_requests)
    return _Chunks(regions, chunk_of, pcu_of, tuple(ch.padded_local_total for ch in chunks))


@njit(cache=True)
def _region_kernel(creq, pcu, sizes, local_lens, dcp_rank, num_requests):
    """Chunks' ``requests`` and ``padded_local_cu`` concatenated (``sizes[c]`` regions each)
    -> (regions [4, G], chunk_of [N], pcu_of [N]); see :class:`_Chunks`."""
    regions = np.empty((4, creq.size), np.int64)
    chunk_of, pcu_of = np.full(num_requests, -1, np.int64), np.zeros(num_requests, np.int64)
    j, at, off = 0, 0, 0  # region, its entry in pcu, first row of its chunk
    for c in range(sizes.size):
        for _ in range(sizes[c]):
            req = creq[j]
            regions[0, j], regions[1, j], regions[2, j] = req, pcu[at] + off, pcu[at + 1] + off
            regions[3, j] = local_lens[req, dcp_rank]
            chunk_of[req], pcu_of[req] = c, pcu[at]
            j += 1
            at += 1
        off += pcu[at]
        at += 1
    return regions, chunk_of, pcu_of


# facts returned by _segment_kernel (int64 [F_RANGES + 3 * chunks])
F_DECODE_KEYS = 0  # this rank's shard of the longest decode's keys (the local decode width)
F_KEYS = 1  # max key count of the rank's tokens
F_TOKENS = 2  # real tokens of the rank
F_ORDER = 3  # 1: rows of the rank out of token order
F_SUM_Q = 4  # sum q
F_CHUNK_GAP = 5  # 1: a gather chunk's tokens not contiguous on the rank
F_SEGMENTS = 6  # S: segments packed (a graph step's static count)
F_REAL_SEGMENTS = 7  # segments of the step before padding
F_WORDS = 8  # words packed: (1 + NUM_PARAMS) * S + the block tables
F_GRAPH_BLOCKS = 9  # graph-replayable: key blocks (the packed tables' width), else 0
F_RANGES = 10  # per gather chunk (first token, end, key width)


# Over 50 lines on purpose: one jitted pass writes every section's segments in order (numba
# inlines nothing across Python calls cheaply; splitting it costs a call per row).
@njit(cache=True)
def _segment_kernel(start, lens, off, write, row_req, computed, scheduled, mode, local_lens, bt,
                    pcu_of, chunk_of, regions, num_chunks, pcp_rank, dcp_rank, nd, t_pad,
                    kv_insert, graph_segs, w_size, inter, block_size, out):
    """Every segment of the step (see the module docstring), in u order, and the block tables,
    written into ``out`` as the arena's words (``[S]`` ends, ``[7, S]`` parameters, ``[rows,
    width]`` block tables) when they fit, else only sized; returns the facts (F_*). The tables
    keep the columns the step touches on this rank (width: the most blocks a request holds
    here), not the engine's full width: what is copied to the device per step.

    Token windows (rank, tokens [lo, hi) at u = base.., region_pcu on): this rank's decodes and
    prefills (the token section), then the insert section: own tokens, or after ``kv_insert``
    own decodes then every PCP rank's prefills. ``graph_segs`` > 0 (graph-replayable): the
    segments are padded to that static count and the tables to ``[T, blocks]``, blocks the next
    power of two of the longest decode's blocks on any DCP rank (``graph_key_of``)."""
    n_ranks, n_rows = start.shape
    n_reg = regions.shape[1]
    n_win = 3 + (n_ranks if kv_insert else 0)
    wins = np.empty((n_win, 5), np.int64)
    wins[0, 0], wins[0, 1], wins[0, 2], wins[0, 3], wins[0, 4] = pcp_rank, 0, nd, 0, 0
    wins[1, 0], wins[1, 1], wins[1, 2], wins[1, 3], wins[1, 4] = pcp_rank, nd, t_pad, nd, 1
    if kv_insert:
        wins[2, 0], wins[2, 1], wins[2, 2], wins[2, 3], wins[2, 4] = pcp_rank, 0, nd, t_pad, 0
        for q in range(n_ranks):
            wins[3 + q, 0], wins[3 + q, 1], wins[3 + q, 2] = q, nd, t_pad
            wins[3 + q, 3], wins[3 + q, 4] = t_pad + nd + q * (t_pad - nd), 0
        gather_base = t_pad + nd + n_ranks * (t_pad - nd)
    else:
        wins[2, 0], wins[2, 1], wins[2, 2], wins[2, 3], wins[2, 4] = pcp_rank, 0, t_pad, t_pad, 0
        gather_base = 2 * t_pad
    restored = 0
    for p in range(n_ranks):
        for r in range(n_rows):
            if lens[p, r] > 0 and (p == 0 or mode[row_req[r]] == MODE_SPLIT
                                   or mode[row_req[r]] == MODE_OWNED):
                restored += 1
    n_seg = n_win * (2 * n_rows + 1) + n_reg + restored
    segs = graph_segs if graph_segs > 0 else n_seg
    bt_rows, blocks, longest = bt.shape[0], 0, 0
    if graph_segs > 0:  # any DCP rank's longest: the same key on every rank
        for i in range(local_lens.shape[0]):
            for w in range(local_lens.shape[1]):
                longest = max(longest, np.int64(local_lens[i, w]))
        need_blocks, blocks = max(1, -(-longest // block_size)), 1
        while blocks < need_blocks:
            blocks *= 2
        width, bt_rows = blocks, t_pad
    else:  # the columns this rank's step touches (check_block_tables: within the tables)
        for i in range(local_lens.shape[0]):
            longest = max(longest, np.int64(local_lens[i, dcp_rank]))
        width = max(1, -(-longest // block_size))
    facts = np.zeros(F_RANGES + 3 * num_chunks, np.int64)
    facts[F_SEGMENTS], facts[F_REAL_SEGMENTS], facts[F_GRAPH_BLOCKS] = segs, n_seg, blocks
    facts[F_WORDS] = (1 + NUM_PARAMS) * segs + bt_rows * width
    if facts[F_WORDS] > out.size or (graph_segs > 0 and n_seg >= segs):
        return facts  # sized only: the caller raises (or allocates and calls again)
    ends = out[:segs]
    par = out[segs: (1 + NUM_PARAMS) * segs].reshape((NUM_PARAMS, segs))
    par[:, :] = 0
    ranges = facts[F_RANGES:].reshape((num_chunks, 3))
    count = np.zeros(num_chunks, np.int64)
    ranges[:, 0] = 1 << 62
    k = 0
    for w in range(n_win):
        q, lo, hi, pcu_on = wins[w, 0], wins[w, 1], wins[w, 2], wins[w, 4]
        shift = wins[w, 3] - lo  # u = token + shift
        for r in range(n_rows):
            s, e = min(max(start[q, r], lo), hi), min(max(start[q, r] + lens[q, r], lo), hi)
            req = row_req[r]
            c = chunk_of[req] if chunk_of.size else -1
            a = computed[req] + off[q, r] - start[q, r]  # position of token t: a + t
            ends[k], ends[k + 1] = s + shift, e + shift  # the gap before the row, the row
            k += 1
            par[SEG_X_BASE, k], par[SEG_K_BASE, k] = a - shift, a - shift + 1
            par[SEG_SLOPE, k], par[SEG_REQUEST, k] = 1, req
            par[SEG_REGION_PCU, k] = pcu_of[req] * pcu_on if pcu_of.size else 0
            par[SEG_BT_ROW_START, k], par[SEG_KEEP_LIMIT, k] = req * width, write[q, r]
            k += 1
            if w < 2 and e > s:
                facts[F_KEYS] = max(facts[F_KEYS], a + e)
                if w == 0:
                    facts[F_DECODE_KEYS] = max(facts[F_DECODE_KEYS], a + e)
                elif c >= 0:
                    ranges[c, 0], ranges[c, 1] = min(ranges[c, 0], s), max(ranges[c, 1], e)
                    ranges[c, 2], count[c] = max(ranges[c, 2], a + e), count[c] + e - s
        ends[k] = hi + shift
        k += 1
    for j in range(n_reg):  # gather rows: x = k = the region's local row
        ends[k] = regions[2, j] + gather_base
        par[SEG_X_BASE, k] = par[SEG_K_BASE, k] = -(regions[1, j] + gather_base)
        par[SEG_SLOPE, k], par[SEG_KEEP_LIMIT, k] = 1, regions[3, j]
        par[SEG_BT_ROW_START, k] = regions[0, j] * width
        k += 1
    _restore_segments(start, lens, off, row_req, scheduled, mode, t_pad, ends, par, k,
                      gather_base + (regions[2, n_reg - 1] if n_reg else 0), n_seg)
    for c in range(num_chunks):
        if count[c] == 0:
            ranges[c, 0] = ranges[c, 1] = 0
        elif ranges[c, 1] - ranges[c, 0] != count[c]:
            facts[F_CHUNK_GAP] = 1
    for i in range(1, n_seg):
        if ends[i] < ends[i - 1]:
            facts[F_ORDER] = 1
    ends[n_seg:] = 1 << 62  # graph padding: empty zero segments, their ends past every u
    # this rank's shard of the longest decode's keys (sharding.shard_count, for one length)
    dec = facts[F_DECODE_KEYS]
    if w_size > 1:
        base = (dec // inter // w_size) * inter
        dec = base + min(max(dec - base * w_size - dcp_rank * inter, 0), inter)
    facts[F_DECODE_KEYS] = dec
    tables = out[(1 + NUM_PARAMS) * segs: facts[F_WORDS]].reshape((bt_rows, width))
    cols = min(width, bt.shape[1])  # graph: columns past the tables' and rows past N are 0
    for i in range(bt_rows):
        for j in range(cols if i < bt.shape[0] else 0):
            tables[i, j] = bt[i, j]
        for j in range(cols if i < bt.shape[0] else 0, width):
            tables[i, j] = 0
    facts[F_TOKENS] = lens[pcp_rank].sum()
    facts[F_SUM_Q] = scheduled.astype(np.int64).sum()
    return facts


@njit(cache=True)
def _restore_segments(start, lens, off, row_req, scheduled, mode, t_pad, ends, par, k, base,
                      end):
    """From ``k`` to ``end``: one segment per (rank, row) a query token is restored from
    (split rows from every rank, the others from PCP rank 0), in global token order; x = the
    token's row of the ``[P * T]`` buffer."""
    n_ranks, n_rows = start.shape
    n = end - k
    dst, src, length = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
    first = np.empty(scheduled.size, np.int64)  # exclusive prefix sum of q
    acc = 0
    for i in range(scheduled.size):
        first[i] = acc
        acc += scheduled[i]
    j = 0
    for p in range(n_ranks):
        for r in range(n_rows):
            if lens[p, r] > 0 and (p == 0 or mode[row_req[r]] == MODE_SPLIT
                                   or mode[row_req[r]] == MODE_OWNED):
                dst[j] = first[row_req[r]] + off[p, r]
                src[j], length[j] = p * t_pad + start[p, r], lens[p, r]
                j += 1
    for i in np.argsort(dst):
        ends[k] = dst[i] + length[i] + base
        par[SEG_X_BASE, k], par[SEG_SLOPE, k] = src[i] - dst[i] - base, 1
        k += 1


def compile_host_kernels() -> None:
    """Compile (or load from ``__pycache__``) the host kernels for the array types plans carry
    (read-only int32 / uint8 views) and int32 / int64 block tables, so that the first bind pays
    no JIT cost."""
    def ro(dtype, *shape):
        return np.frombuffer(np.zeros(shape, dtype).tobytes(), dtype).reshape(shape)

    rows, lens = ro(np.int32, 1, 1), ro(np.int32, 1, 1)
    regions, chunk_of, pcu_of = _region_kernel(np.zeros(0, np.int32), np.zeros(0, np.int64),
                                               np.zeros(0, np.int64), lens, 0, 1)
    for dtype in (np.int32, np.int64):
        bt = np.ones((1, 1), dtype)
        _first_bad_block(bt, lens, 0, 1, -1)
        _first_alias(bt, ro(np.int32, 1), lens, 0, 1, 1, 1, np.zeros(2, np.int64),
                     np.zeros(2, np.int64), 1)
        _segment_kernel(rows, rows, rows, ro(np.uint8, 1, 1), ro(np.int32, 1), ro(np.int32, 1),
                        ro(np.int32, 1), ro(np.uint8, 1), lens, bt, pcu_of, chunk_of, regions,
                        0, 0, 0, 0, 1, False, 0, 1, 1, 1, _NO_WORDS)
