"""A rank's table segments, built on the host (docs/design.md §5.3): the block-table checks,
:func:`build_tables` (one jitted pass, O(P * rows + requests), never O(tokens)) and the static
layout of graph-replayable steps (docs/design.md §5.6). The segment format and the device
expansion are in ``runtime/tables.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import njit

from cpplan.runtime.tables import (
    A,
    B,
    BTROW,
    K,
    LIM,
    NUM_PARAMS,
    PCU,
    REQ,
    Layout,
    RankTables,
    StepMeta,
)
from cpplan.schemas.errors import CapacityError, PlanFormatError, StepInputError
from cpplan.schemas.plan import MODE_SPLIT, StepPlan
from cpplan.schemas.sharding import shard_count


def check_block_tables(plan: StepPlan, dcp_rank: int, block_tables, num_blocks: int | None
                       ) -> np.ndarray:
    """Validate a rank's block tables for ``plan`` and return them as ``[N, max_blocks]`` int64.

    Checked, because each of these would otherwise write and read the wrong KV silently: a 2-d
    integer array with exactly one row per request of the plan; every block the step touches
    (the first ceil(local tokens / B) of each request on this DCP rank) is not the reserved
    block 0 and, where ``num_blocks`` is known, below it. O(requests), on the host."""
    n = plan.num_requests
    bt = np.asarray(block_tables)
    if bt.ndim != 2 or bt.shape[0] != n:
        raise StepInputError(f"step {plan.step_id}: block_tables must be [num_requests={n}, "
                             f"max_blocks]: got shape {list(bt.shape)}")
    if bt.dtype.kind not in "iu":
        raise StepInputError(f"step {plan.step_id}: block_tables must hold integers: got "
                             f"dtype {bt.dtype}")
    bt = bt.astype(np.int64, copy=False)
    cfg = plan.config
    held = plan.dcp_local_lens.np()[:, dcp_rank].astype(np.int64) if n else np.zeros(0, np.int64)
    need = -(-held // cfg.block_size)
    if need.size and int(need.max()) > bt.shape[1]:
        i = int(np.argmax(need))
        raise CapacityError(f"step {plan.step_id}: block table too narrow: request {i} needs "
                            f"{int(need[i])} blocks on this rank, the tables have {bt.shape[1]}")
    # only the blocks the step touches; the rest is the engine's padding
    i, j = _first_bad_block(bt, need, -1 if num_blocks is None else num_blocks)
    if i >= 0:
        limit = f"1..{num_blocks - 1}" if num_blocks is not None else ">= 1 (0 is reserved)"
        raise StepInputError(f"step {plan.step_id}: block_tables[{i}][{j}] = {int(bt[i, j])}: "
                             f"expected a block in {limit}")
    return bt


@njit(cache=True)
def _first_bad_block(bt, need, num_blocks):
    """(i, j) of the first (row-major) block ``bt[i, j]``, ``j < need[i]``, that is < 1 or,
    where ``num_blocks`` >= 0, >= num_blocks; (-1, -1) if none."""
    for i in range(bt.shape[0]):
        for j in range(need[i]):
            if bt[i, j] < 1 or (num_blocks >= 0 and bt[i, j] >= num_blocks):
                return i, j
    return -1, -1


def build_tables(plan: StepPlan, pcp_rank: int, dcp_rank: int, block_tables: np.ndarray,
                 dummy_slot: int) -> RankTables:
    """The rank's segments for ``plan``; ``block_tables`` is ``[N, max_blocks]`` int64 (row i:
    this rank's local blocks of request i, in the plan's request order), already validated
    (:func:`check_block_tables`). O(P * rows + requests), in one jitted call."""
    cfg = plan.config
    t_pad, nd, p_size = plan.padded_num_tokens, plan.num_decode_tokens, cfg.pcp_size
    graph_key = graph_key_of(plan)
    num_requests = plan.num_requests
    if graph_key is not None:  # every padded token is a decode (docs/design.md §3.7)
        nd = num_requests = t_pad
        block_tables = _graph_block_tables(block_tables, t_pad, graph_key[1])
    names = {c.name for c in plan.collectives}
    kv_insert = "kv_insert" in names
    # token windows (rank, first token, end, first u, region_pcu on): this rank's decodes and
    # prefills (the token section), then the insert section
    wins = [(pcp_rank, 0, nd, 0, 0), (pcp_rank, nd, t_pad, nd, 1)]
    if kv_insert:
        wins.append((pcp_rank, 0, nd, t_pad, 0))
        wins += [(q, nd, t_pad, t_pad + nd + q * (t_pad - nd), 0) for q in range(p_size)]
        insert_len = nd + p_size * (t_pad - nd)
    else:
        wins.append((pcp_rank, 0, t_pad, t_pad, 0))
        insert_len = t_pad
    ch = _chunks(plan, dcp_rank)
    ends, par, ranges, facts = _segment_kernel(
        plan.row_token_start.np(), plan.row_num_tokens.np(), plan.row_query_offset.np(),
        plan.row_kv_write.np(), plan.row_request.np(), plan.num_computed_tokens.np(),
        plan.num_scheduled_tokens.np(), plan.mode.np(), np.array(wins, np.int64), ch.pcu_of,
        ch.chunk_of, ch.regions, block_tables.shape[1], t_pad, t_pad + insert_len, len(ch.rows))
    if facts[3] or facts[5]:
        what = "rows of a rank are not in token order" if facts[3] else "a gather chunk's "\
            "tokens are not contiguous on a rank"
        raise PlanFormatError(f"step {plan.step_id}: {what} (expected from row_token_start, "
                              f"an exclusive prefix sum of row_num_tokens)")
    dec_width = int(shard_count(int(facts[0]), cfg.dcp_size, cfg.interleave_size, dcp_rank))
    n_real = int(facts[2])
    local_range = (0, n_real, max(int(facts[1]), 1))
    restore_len = int(facts[4])
    if graph_key is not None:  # static shapes: one capture serves every step of this key
        dec_width = graph_key[1] * cfg.block_size
        local_range, restore_len = (0, t_pad, dec_width), p_size * t_pad
        ends, par = _pad_segments(ends, par, graph_segments(t_pad, p_size))
    meta = StepMeta(num_tokens=n_real, padded=t_pad, num_decode_tokens=nd,
                    decode_width=max(dec_width, 1), local_range=local_range,
                    chunk_ranges=tuple(map(tuple, ranges.tolist())), chunk_rows=ch.rows,
                    kv_insert=kv_insert, decode_merge="decode_out" in names,
                    restore="restore" in names, num_global_tokens=int(facts[4]),
                    graph_key=graph_key)
    layout = Layout(num_requests=num_requests, insert_len=insert_len,
                    dcp_size=cfg.dcp_size, dcp_rank=dcp_rank,
                    interleave_size=cfg.interleave_size, block_size=cfg.block_size,
                    dummy_slot=dummy_slot, restore_len=restore_len)
    params = {"seg_ends": ends, "seg_params": par, "block_tables": block_tables.reshape(-1)}
    return RankTables(params=params, meta=meta, layout=layout)


def local_prefill_keys(plan: StepPlan) -> int:
    """W == 1: rows of the local prefill keys buffer (tables.local_prefill_rows): the extents of
    the prefilling requests summed, which bounds what any rank's prefill tokens read."""
    return int(plan.extent()[plan.is_prefilling.np().astype(bool)].sum())


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


def _pad_segments(ends: np.ndarray, par: np.ndarray, total: int):
    """Segments padded to ``total`` with empty zero segments (their ends past every u)."""
    if ends.size >= total:
        raise PlanFormatError(f"a graph-replayable step has {ends.size} segments, expected "
                              f"fewer than {total}")
    ends_p = np.full(total, 1 << 62, np.int64)
    par_p = np.zeros((NUM_PARAMS, total), np.int64)
    ends_p[: ends.size], par_p[:, : ends.size] = ends, par
    return ends_p, par_p


def _graph_block_tables(block_tables: np.ndarray, t_pad: int, blocks: int) -> np.ndarray:
    """``[N, w]`` -> ``[T, blocks]``: a static shape per graph key; the columns past the
    request's blocks and the rows past N are 0 (never read: they hold no key)."""
    out = np.zeros((t_pad, blocks), np.int64)
    n, w = block_tables.shape[0], min(block_tables.shape[1], blocks)
    out[:n, :w] = block_tables[:, :w]
    return out


@dataclasses.dataclass(frozen=True)
class _Chunks:
    """The gather chunks' regions (W > 1; none otherwise): ``regions`` ``[4, G]`` int64 rows
    request, first and end row in the gather section, rows this rank holds; per request its
    chunk (-1: none) and pcu; PT per chunk."""

    regions: np.ndarray
    chunk_of: np.ndarray  # [N]
    pcu_of: np.ndarray  # [N]
    rows: tuple[int, ...]


def _chunks(plan: StepPlan, dcp_rank: int) -> _Chunks:
    chunks = plan.gather_chunks if plan.config.dcp_size > 1 else ()
    if chunks:
        creq = np.concatenate([ch.requests.np() for ch in chunks])
        pcu = np.concatenate([ch.padded_local_cu.np() for ch in chunks])
    else:
        creq, pcu = np.zeros(0, np.int32), np.zeros(0, np.int64)
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


# Over 50 lines on purpose: one jitted pass writes every section's segments in order (numba
# inlines nothing across Python calls cheaply; splitting it costs a call per row).
@njit(cache=True)
def _segment_kernel(start, lens, off, write, row_req, computed, scheduled, mode, wins, pcu_of,
                    chunk_of, regions, width, t_pad, gather_base, num_chunks):
    """Every segment of the step (see the module docstring), in u order, and the host facts.
    Token windows ``wins`` ``[nw, 5]`` (rank, tokens [lo, hi) at u = base.., region_pcu on);
    windows 0 and 1 are this rank's decodes and prefills. Returns (ends [S], params [7, S],
    per chunk (first token, end, key width) [C, 3], facts: max decode key count, max key
    count, real tokens, rows out of token order, sum q, a chunk's tokens not contiguous)."""
    n_ranks, n_rows = start.shape
    n_win, n_reg = wins.shape[0], regions.shape[1]
    restored = 0
    for p in range(n_ranks):
        for r in range(n_rows):
            if lens[p, r] > 0 and (p == 0 or mode[row_req[r]] == MODE_SPLIT):
                restored += 1
    n_tok = n_win * (2 * n_rows + 1)
    ends = np.empty(n_tok + n_reg + restored, np.int64)
    par = np.zeros((NUM_PARAMS, ends.size), np.int64)
    facts = np.zeros(6, np.int64)
    ranges = np.zeros((num_chunks, 3), np.int64)
    count = np.zeros(num_chunks, np.int64)
    ranges[:, 0] = 1 << 62
    k = 0
    for w in range(n_win):
        q, lo, hi, pcu_on = wins[w, 0], wins[w, 1], wins[w, 2], wins[w, 4]
        shift = wins[w, 3] - lo  # u = token + shift
        for r in range(n_rows):
            s, e = min(max(start[q, r], lo), hi), min(max(start[q, r] + lens[q, r], lo), hi)
            req = row_req[r]
            a = computed[req] + off[q, r] - start[q, r]  # position of token t: a + t
            ends[k], ends[k + 1] = s + shift, e + shift  # the gap before the row, the row
            k += 1
            par[A, k], par[K, k], par[B, k] = a - shift, a - shift + 1, 1
            par[REQ, k], par[PCU, k] = req, pcu_of[req] * pcu_on
            par[BTROW, k], par[LIM, k] = req * width, write[q, r]
            k += 1
            if w < 2 and e > s:
                facts[1] = max(facts[1], a + e)
                if w == 0:
                    facts[0] = max(facts[0], a + e)
                elif chunk_of[req] >= 0:
                    c = chunk_of[req]
                    ranges[c, 0], ranges[c, 1] = min(ranges[c, 0], s), max(ranges[c, 1], e)
                    ranges[c, 2], count[c] = max(ranges[c, 2], a + e), count[c] + e - s
        ends[k] = hi + shift
        k += 1
    for j in range(n_reg):  # gather rows: x = k = the region's local row
        ends[k] = regions[2, j] + gather_base
        par[A, k] = par[K, k] = -(regions[1, j] + gather_base)
        par[B, k], par[BTROW, k], par[LIM, k] = 1, regions[0, j] * width, regions[3, j]
        k += 1
    _restore_segments(start, lens, off, row_req, scheduled, mode, t_pad, ends, par, k,
                      gather_base + (regions[2, n_reg - 1] if n_reg else 0))
    for c in range(num_chunks):
        if count[c] == 0:
            ranges[c, 0] = ranges[c, 1] = 0
        elif ranges[c, 1] - ranges[c, 0] != count[c]:
            facts[5] = 1
    for i in range(1, ends.size):
        if ends[i] < ends[i - 1]:
            facts[3] = 1
    facts[2] = lens[wins[0, 0]].sum()
    facts[4] = scheduled.astype(np.int64).sum()
    return ends, par, ranges, facts


@njit(cache=True)
def _restore_segments(start, lens, off, row_req, scheduled, mode, t_pad, ends, par, k, base):
    """From ``k`` on: one segment per (rank, row) a query token is restored from (split rows
    from every rank, the others from PCP rank 0), in global token order; x = the token's row
    of the ``[P * T]`` buffer."""
    n_ranks, n_rows = start.shape
    n = ends.size - k
    dst, src, length = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
    first = np.empty(scheduled.size, np.int64)  # exclusive prefix sum of q
    acc = 0
    for i in range(scheduled.size):
        first[i] = acc
        acc += scheduled[i]
    j = 0
    for p in range(n_ranks):
        for r in range(n_rows):
            if lens[p, r] > 0 and (p == 0 or mode[row_req[r]] == MODE_SPLIT):
                dst[j] = first[row_req[r]] + off[p, r]
                src[j], length[j] = p * t_pad + start[p, r], lens[p, r]
                j += 1
    for i in np.argsort(dst):
        ends[k] = dst[i] + length[i] + base
        par[A, k], par[B, k] = src[i] - dst[i] - base, 1
        k += 1


def compile_host_kernels() -> None:
    """Compile (or load from ``__pycache__``) the host kernels for the array types plans carry
    (read-only int32 / uint8 views), so that the first bind pays no JIT cost."""
    def ro(dtype, *shape):
        return np.frombuffer(np.zeros(shape, dtype).tobytes(), dtype).reshape(shape)

    _first_bad_block(np.ones((1, 1), np.int64), np.ones(1, np.int64), -1)
    regions, chunk_of, pcu_of = _region_kernel(np.zeros(0, np.int32), np.zeros(0, np.int64),
                                               np.zeros(0, np.int64), ro(np.int32, 1, 1), 0, 1)
    rows = ro(np.int32, 1, 1)
    _segment_kernel(rows, rows, rows, ro(np.uint8, 1, 1), ro(np.int32, 1), ro(np.int32, 1),
                    ro(np.int32, 1), ro(np.uint8, 1), np.zeros((1, 5), np.int64), pcu_of,
                    chunk_of, regions, 1, 1, 1, 0)
