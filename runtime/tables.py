"""A rank's per-step tables: parameters built on the host, token tables expanded on the device.

Two halves, both here. :func:`build_tables` (numpy, O(rows + requests), never O(tokens)) cuts the
rank's tables into *segments*, runs of consecutive entries that are affine in their index, and
returns each segment's end and parameters plus the host integers of the step (``StepMeta``);
the executor packs them into one arena (one H2D copy) and :meth:`StepTables.expand` expands them
on the device with a fixed number of vectorised torch ops (arange, one searchsorted, one gather,
then arithmetic; see docs/design.md §5.3), whatever the number of requests, rows or chunks.

The expanded index space ``u`` has four sections, each a concatenation of segments:

- tokens ``[0, T)``: this rank's tokens (token_req, token_pos, key_len, region_pcu);
- insert ``[T, T + UI)``: the tokens whose KV this rank may write, in ``insert_dec`` /
  ``insert_pre`` order (own tokens, or after ``kv_insert`` own decodes then every PCP rank's
  prefill tokens);
- gather: every gather chunk's ``[PT]`` padded-local rows, chunk after chunk;
- restore ``[sum q]``: the restore index.

Per segment (columns of ``seg_params``): ``A``, ``K``, ``B`` with values ``x = A + B * u`` (a
token's position, a gather row's local index, a restore row) and ``k = K + B * u`` (a token's key
count; a gather row's local index again), ``REQ`` and ``PCU`` (token section),
``BTROW`` (request * block-table width) and ``LIM`` (insert: 1 where the row's KV is written;
gather: rows of the region this rank holds). Gaps between rows (padding) are segments of zeros.

Sentinels: padded tokens have request 0, position 0 and key length 0 (no key); KV rows that are
not written point at ``dummy_slot``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cpplan.schemas.errors import CapacityError, PlanFormatError, StepInputError
from cpplan.schemas.plan import MODE_SPLIT, StepPlan
from cpplan.schemas.sharding import shard_count

A, K, B, REQ, PCU, BTROW, LIM = range(7)  # rows of seg_params
NUM_PARAMS = 7
_IOTA: dict = {}  # device -> arange shared by every bind on it (read only)


@dataclasses.dataclass(frozen=True)
class StepMeta:
    """Host integers of one bound step (per rank)."""

    num_tokens: int  # real tokens of this rank
    padded: int  # T
    num_decode_tokens: int  # nd (tokens [0, nd) of every rank are the decode tokens)
    decode_width: int  # key rectangle width of the local decode pass (max local keys)
    local_range: tuple[int, int, int]  # W == 1: (start, end, width) of the all-local pass
    chunk_ranges: tuple[tuple[int, int, int], ...]  # W > 1: per gather chunk (start, end, width)
    chunk_rows: tuple[int, ...]  # PT per gather chunk
    kv_insert: bool  # the plan lists kv_insert (P > 1 and prefill rows)
    decode_merge: bool  # the plan lists topk_candidates / decode_lse / decode_out
    restore: bool  # the plan lists restore
    num_global_tokens: int  # sum q


@dataclasses.dataclass(frozen=True)
class Layout:
    """Host integers of the device expansion: section sizes and the sharding constants."""

    num_requests: int
    insert_len: int  # UI: nd + P * (T - nd) after kv_insert, else T
    dcp_size: int
    dcp_rank: int
    interleave_size: int
    block_size: int
    dummy_slot: int

    def total(self, meta: StepMeta) -> int:
        return meta.padded + self.insert_len + sum(meta.chunk_rows) + meta.num_global_tokens


@dataclasses.dataclass(frozen=True)
class RankTables:
    """Host side: ``params`` name -> int64 ndarray (what the arena receives, in this order),
    the step's host integers and the expansion's layout."""

    params: dict
    meta: StepMeta
    layout: Layout

    @property
    def arrays(self) -> dict:
        """The expanded tables as numpy arrays, through :meth:`StepTables.expand` on the CPU
        (for tests and debugging; bind expands on its own device)."""
        views = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in self.params.items()}
        t = StepTables.expand(views, self.meta, self.layout)
        out = {f.name: getattr(t, f.name).numpy() for f in dataclasses.fields(t)
               if f.name != "gather"}
        out.update({f"gather_src[{c}]": g.src.numpy() for c, g in enumerate(t.gather)})
        return out


@dataclasses.dataclass(frozen=True)
class GatherChunkTables:
    """Device tables of one gather chunk c on this rank (W > 1)."""

    src: torch.Tensor  # [PT] int64: cache slot of each padded-local row (DUMMY past a shard)
    num_rows: int  # PT: rows each DCP rank contributes
    token_range: tuple[int, int, int]  # (first token, end, key width) of the chunk's tokens


@dataclasses.dataclass(frozen=True)
class StepTables:
    """One bound step's device tables on one rank, int64, expanded from the step's arena
    (``block_tables`` is a view into it, alive until the arena is reused ``arena_depth`` binds
    later). T = the plan's padded tokens."""

    token_req: torch.Tensor  # [T] request index per token (0 for padding)
    token_pos: torch.Tensor  # [T] position in the request (0 for padding)
    key_len: torch.Tensor  # [T] causal key count, pos + 1 (0 for padding: no key)
    local_len: torch.Tensor  # [T] keys of this rank's DCP shard within the causal prefix
    region_pcu: torch.Tensor  # [T] padded-local prefix offset of the token's region (prefill)
    insert_dec: torch.Tensor  # [nd] cache slot per decode token (DUMMY if not owned)
    insert_pre: torch.Tensor  # [T - nd] or [P * (T - nd)] after kv_insert: prefill slots
    block_tables: torch.Tensor  # [N, max_blocks] this rank's local blocks per request
    restore_index: torch.Tensor  # [sum q] rows of the P * T restored buffer, global order
    gather: tuple[GatherChunkTables, ...]  # per gather chunk (empty when W == 1)

    @classmethod
    def expand(cls, views: dict, meta: StepMeta, lay: Layout) -> "StepTables":
        """Expand the arena's segments into the step's tables on the arena's device: a fixed
        number of ops on shapes the plan fixes (no host sync, nothing per request or chunk)."""
        ends, seg = views["seg_ends"], views["seg_params"].view(NUM_PARAMS, -1)
        bt = views["block_tables"].view(lay.num_requests, -1)
        u = _iota(lay.total(meta), ends.device)
        g = seg.index_select(1, torch.searchsorted(ends, u, right=True))
        g[A: K + 1].addcmul_(g[B], u)  # x and k in one op
        t_pad, ui, nd = meta.padded, lay.insert_len, meta.num_decode_tokens
        key_len = g[K, :t_pad]
        local_len = key_len if lay.dcp_size == 1 else _shard_count(key_len, lay)
        z_end = t_pad + ui + sum(meta.chunk_rows)
        slots = _slots(g, t_pad, ui, z_end, bt, lay)
        gather, off = [], ui
        for rows, token_range in zip(meta.chunk_rows, meta.chunk_ranges):
            gather.append(GatherChunkTables(src=slots[off: off + rows], num_rows=rows,
                                            token_range=token_range))
            off += rows
        return cls(token_req=g[REQ, :t_pad], token_pos=g[A, :t_pad], key_len=key_len,
                   local_len=local_len, region_pcu=g[PCU, :t_pad], insert_dec=slots[:nd],
                   insert_pre=slots[nd:ui], block_tables=bt, restore_index=g[A, z_end:],
                   gather=tuple(gather))


def _iota(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` on ``device``, from one cached buffer (grown when a step needs more)."""
    have = _IOTA.get(device)
    if have is None or have.numel() < n:
        have = _IOTA[device] = torch.arange(max(n, 2 * have.numel() if have is not None else 0,
                                                1 << 16), device=device)
    return have[:n]


def _shard_count(length: torch.Tensor, lay: Layout) -> torch.Tensor:
    """torch version of ``sharding.shard_count`` for this rank (W > 1)."""
    w_size, inter, rank = lay.dcp_size, lay.interleave_size, lay.dcp_rank
    if inter == 1:  # ceil((L - rank) / W), 0 when L <= rank: the same count in two ops
        return torch.add(length, w_size - 1 - rank).div_(w_size, rounding_mode="floor")
    period = w_size * inter
    full = torch.div(length, period, rounding_mode="floor")
    part = torch.remainder(length, period).sub_(rank * inter).clamp_(0, inter)
    return part.add_(full, alpha=inter)


def _slots(g: torch.Tensor, lo: int, ui: int, hi: int, bt: torch.Tensor,
           lay: Layout) -> torch.Tensor:
    """Cache slots of u in ``[lo, hi)`` (the insert section, then the gather rows), dummy where
    this rank writes / holds nothing. Rewrites the insert section's ``A`` (position -> local
    index) and ``K`` rows of ``g`` in place; those rows are not part of any table."""
    w_size, inter, bs = lay.dcp_size, lay.interleave_size, lay.block_size
    loc = g[A, lo:hi]
    if w_size == 1:
        keep = g[LIM, lo:hi]  # 1 where written (no gather rows when W == 1)
    else:
        pos, other = g[A, lo: lo + ui], g[K, lo: lo + ui]
        if inter == 1:
            torch.bitwise_xor(torch.remainder(pos, w_size), lay.dcp_rank, out=other)
            pos.div_(w_size, rounding_mode="floor")  # local index
        else:
            blk = torch.div(pos, inter, rounding_mode="floor")
            torch.bitwise_xor(torch.remainder(blk, w_size), lay.dcp_rank, out=other)
            within = torch.remainder(pos, inter)
            torch.add(within, blk.div_(w_size, rounding_mode="floor"), alpha=inter, out=pos)
        # insert: owner xor rank (0 iff owned) < written flag; gather: local index < held
        keep = torch.lt(g[K, lo:hi], g[LIM, lo:hi])
    flat = bt.reshape(-1) if bt.numel() else bt.new_zeros(1)
    col = torch.div(loc, bs, rounding_mode="floor")
    if w_size > 1:  # a row this rank does not hold may lie past its table's width
        col.clamp_(max=max(bt.shape[1] - 1, 0))
    col.add_(g[BTROW, lo:hi])
    slot = torch.remainder(loc, bs).add_(flat.take(col), alpha=bs)
    if lay.dummy_slot == 0:
        return slot.mul_(keep)
    return torch.where(keep.bool(), slot, lay.dummy_slot)


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
    width = int(need.max()) if need.size else 0
    head = bt[:, :width]  # only the blocks the step touches; the rest is the engine's padding
    used = np.arange(width)[None, :] < need[:, None]
    bad = used & ((head < 1) | ((head >= num_blocks) if num_blocks is not None else False))
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        limit = f"1..{num_blocks - 1}" if num_blocks is not None else ">= 1 (0 is reserved)"
        raise StepInputError(f"step {plan.step_id}: block_tables[{i}][{j}] = {int(bt[i, j])}: "
                             f"expected a block in {limit}")
    return bt


def build_tables(plan: StepPlan, pcp_rank: int, dcp_rank: int, block_tables: np.ndarray,
                 dummy_slot: int) -> RankTables:
    """The rank's segments for ``plan``; ``block_tables`` is ``[N, max_blocks]`` int64 (row i:
    this rank's local blocks of request i, in the plan's request order), already validated
    (:func:`check_block_tables`). O(P * rows + requests) numpy work."""
    cfg = plan.config
    t_pad, nd, p_size = plan.padded_num_tokens, plan.num_decode_tokens, cfg.pcp_size
    names = {c.name for c in plan.collectives}
    kv_insert = "kv_insert" in names
    rows = _rows(plan)
    width = block_tables.shape[1]
    chunks = _chunks(plan, dcp_rank)
    # token windows (rank, first token, end, first u, region_pcu applies): this rank's tokens
    # (decodes, then prefills), then the insert section
    wins = [(pcp_rank, 0, nd, 0, 0), (pcp_rank, nd, t_pad, nd, 1)]
    if kv_insert:
        wins.append((pcp_rank, 0, nd, t_pad, 0))
        wins += [(q, nd, t_pad, t_pad + nd + q * (t_pad - nd), 0) for q in range(p_size)]
        insert_len = nd + p_size * (t_pad - nd)
    else:
        wins.append((pcp_rank, 0, t_pad, t_pad, 0))
        insert_len = t_pad
    tok_ends, tok_par, s, e = _token_segments(rows, np.array(wins, np.int64), chunks, width)
    g_ends, g_par = _gather_segments(chunks, t_pad + insert_len, width)
    r_ends, r_par = _restore_segments(plan, rows, t_pad + insert_len + chunks.total)
    ends = np.concatenate([tok_ends, g_ends, r_ends])
    if ends.size and (np.diff(ends) < 0).any():
        raise PlanFormatError(f"step {plan.step_id}: rows of a rank are not in token order "
                              f"(row_token_start must be an exclusive prefix sum of lengths)")
    meta = _meta(plan, pcp_rank, dcp_rank, rows, s, e, chunks, kv_insert, names)
    layout = Layout(num_requests=plan.num_requests, insert_len=insert_len,
                    dcp_size=cfg.dcp_size, dcp_rank=dcp_rank,
                    interleave_size=cfg.interleave_size, block_size=cfg.block_size,
                    dummy_slot=dummy_slot)
    params = {"seg_ends": ends,
              "seg_params": np.concatenate([tok_par, g_par, r_par], axis=1),
              "block_tables": block_tables.reshape(-1)}
    return RankTables(params=params, meta=meta, layout=layout)


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Per PCP rank and row, int64 ``[P, R]``: token start and end; ``a`` with position =
    a + token; the written flag. ``req`` ``[R]``."""

    start: np.ndarray
    end: np.ndarray
    a: np.ndarray
    write: np.ndarray
    req: np.ndarray


def _rows(plan: StepPlan) -> _Rows:
    start = plan.row_token_start.np().astype(np.int64)
    req = plan.row_request.np().astype(np.int64)
    first = plan.num_computed_tokens.np().astype(np.int64)[req] + plan.row_query_offset.np()
    return _Rows(start=start, end=start + plan.row_num_tokens.np(), a=first - start,
                 write=plan.row_kv_write.np().astype(np.int64), req=req)


@dataclasses.dataclass(frozen=True)
class _Chunks:
    """The gather chunks' regions, concatenated (W > 1; empty otherwise): request, first and
    end row in the gather section, rows held here; per request its chunk (-1: none) and pcu."""

    req: np.ndarray
    start: np.ndarray
    end: np.ndarray
    held: np.ndarray
    chunk_of: np.ndarray  # [N]
    pcu_of: np.ndarray  # [N]
    rows: tuple[int, ...]  # PT per chunk
    total: int


def _chunks(plan: StepPlan, dcp_rank: int) -> _Chunks:
    n = plan.num_requests
    chunk_of, pcu_of = np.full(n, -1, np.int64), np.zeros(n, np.int64)
    chunks = plan.gather_chunks if plan.config.dcp_size > 1 else ()
    reqs, starts, ends, off = [], [], [], 0
    for c, ch in enumerate(chunks):
        creq, pcu = ch.requests.np(), ch.padded_local_cu.np()
        chunk_of[creq], pcu_of[creq] = c, pcu[:-1]
        reqs.append(creq)
        starts.append(pcu[:-1] + off)
        ends.append(pcu[1:] + off)
        off += ch.padded_local_total
    if not chunks:
        empty = np.zeros(0, np.int64)
        return _Chunks(empty, empty, empty, empty, chunk_of, pcu_of, (), 0)
    req = np.concatenate(reqs).astype(np.int64)
    held = plan.dcp_local_lens.np()[req, dcp_rank].astype(np.int64)
    return _Chunks(req, np.concatenate(starts), np.concatenate(ends), held, chunk_of, pcu_of,
                   tuple(ch.padded_local_total for ch in chunks), off)


def _token_segments(rows: _Rows, wins: np.ndarray, chunks: _Chunks, width: int):
    """Segments of token windows ``wins`` ``[nw, 5]`` (rank q, tokens [lo, hi) at u = base..,
    region_pcu on/off): per window a gap before each row, the row clipped to the window, and
    the gap after the last row. Returns (ends, params [6, S], clipped starts and ends
    ``[nw, R]``)."""
    q, lo, hi, base, pcu_on = wins.T
    s = np.clip(rows.start[q], lo[:, None], hi[:, None])
    e = np.clip(rows.end[q], lo[:, None], hi[:, None])
    shift = (base - lo)[:, None]  # u = token + shift
    nw, nr = s.shape
    ends = np.empty((nw, 2 * nr + 1), np.int64)
    ends[:, 0:2 * nr:2] = s
    ends[:, 1:2 * nr:2] = e
    ends[:, -1] = hi
    ends += shift
    par = np.zeros((NUM_PARAMS, nw, 2 * nr + 1), np.int64)
    real = par[:, :, 1:2 * nr:2]
    real[A] = rows.a[q] - shift
    real[K] = real[A] + 1
    real[B] = 1
    real[REQ] = rows.req
    real[PCU] = chunks.pcu_of[rows.req] * pcu_on[:, None]
    real[BTROW] = rows.req * width
    real[LIM] = rows.write[q]
    return ends.reshape(-1), par.reshape(NUM_PARAMS, -1), s, e


def _gather_segments(chunks: _Chunks, base: int, width: int):
    """One segment per region: u = base + row; x = the region's local row."""
    par = np.zeros((NUM_PARAMS, chunks.req.size), np.int64)
    par[A] = par[K] = -(chunks.start + base)
    par[B] = 1
    par[BTROW] = chunks.req * width
    par[LIM] = chunks.held
    return chunks.end + base, par


def _restore_segments(plan: StepPlan, rows: _Rows, base: int):
    """One segment per (rank, row) a query token is restored from (split rows from every rank,
    the others from PCP rank 0), in global token order: x = row of the ``[P * T]`` buffer."""
    lens = plan.row_num_tokens.np()
    take = lens > 0
    take[1:, plan.mode.np()[rows.req] != MODE_SPLIT] = False
    rank, row = np.nonzero(take)
    q = plan.num_scheduled_tokens.np().astype(np.int64)
    qcu = np.cumsum(q) - q
    dst = qcu[rows.req[row]] + plan.row_query_offset.np()[rank, row]
    order = np.argsort(dst, kind="stable")
    rank, row, dst = rank[order], row[order], dst[order]
    par = np.zeros((NUM_PARAMS, dst.size), np.int64)
    par[A] = rank * plan.padded_num_tokens + rows.start[rank, row] - dst - base
    par[B] = 1
    return dst + lens[rank, row] + base, par


def _meta(plan, pcp_rank, dcp_rank, rows, s, e, chunks, kv_insert, names) -> StepMeta:
    """Host integers from the rows of the token section (windows 0 and 1 of ``s`` / ``e``):
    widths are the largest key counts of a row's last token."""
    cfg = plan.config
    nd = plan.num_decode_tokens
    keys = np.where(e[:2] > s[:2], rows.a[pcp_rank] + e[:2], 0)  # [2, R]
    dec_keys = int(keys[0].max()) if keys.size else 0
    dec_width = int(shard_count(dec_keys, cfg.dcp_size, cfg.interleave_size, dcp_rank))
    n_real = int(plan.row_num_tokens.np()[pcp_rank].sum())
    chunk_ranges = _chunk_ranges(plan, rows, s[1], e[1], keys[1], chunks)
    return StepMeta(num_tokens=n_real, padded=plan.padded_num_tokens, num_decode_tokens=nd,
                    decode_width=max(dec_width, 1),
                    local_range=(0, n_real, max(int(keys.max()) if keys.size else 0, 1)),
                    chunk_ranges=chunk_ranges, chunk_rows=chunks.rows, kv_insert=kv_insert,
                    decode_merge="decode_out" in names, restore="restore" in names,
                    num_global_tokens=int(plan.num_scheduled_tokens.np().sum()))


def _chunk_ranges(plan, rows, s, e, keys, chunks) -> tuple:
    """(first token, end, key width) of each gather chunk's prefill tokens on this rank."""
    nch = len(chunks.rows)
    if not nch:
        return ()
    ch = chunks.chunk_of[rows.req]
    sel = (e > s) & (ch >= 0)
    ch, s, e, keys = ch[sel], s[sel], e[sel], keys[sel]
    lo = np.full(nch, plan.padded_num_tokens, np.int64)
    hi, wd, count = (np.zeros(nch, np.int64) for _ in range(3))
    np.minimum.at(lo, ch, s)
    np.maximum.at(hi, ch, e)
    np.maximum.at(wd, ch, keys)
    np.add.at(count, ch, e - s)
    lo[count == 0] = 0
    assert np.array_equal(hi - lo, count), "a gather chunk's tokens are contiguous on a rank"
    return tuple(zip(lo.tolist(), hi.tolist(), wd.tolist()))
