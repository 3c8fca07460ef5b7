"""A rank's per-step tables: their host integers, layout and segment format, and their expansion
on the device.

``runtime/segments.py`` (:func:`~cpplan.runtime.segments.build_tables`, one jitted pass,
O(P * rows + requests), never O(tokens)) cuts the rank's tables into *segments*, runs of entries
affine in their index ``u``, and writes each segment's end and parameters, then the block
tables' touched columns, into the next arena's words (:data:`TABLE_NAMES`; one H2D copy), with
the step's host integers (``StepMeta``, widths from per-row maxima). :meth:`StepTables.expand`
expands them on the device at first use in a fixed number of torch ops (cached arange, one
searchsorted, one gather, arithmetic), whatever the number of requests, rows or chunks
(docs/design.md §5.3). Sections of ``u``:
tokens ``[0, T)`` (this rank's: token_req, token_pos, key_len, region_pcu); insert ``[T, T + UI)``
(``insert_dec`` then ``insert_pre``: own tokens, or after ``kv_insert`` own decodes then every
PCP rank's prefill tokens); every gather chunk's ``[PT]`` rows, chunk after chunk; restore.

Per segment (a column of ``seg_params [NUM_PARAMS, S]``, its rows named ``SEG_*``):
``x = SEG_X_BASE + SEG_SLOPE * u`` (a token's position, a gather row's local index, a restore
row), ``k = SEG_K_BASE + SEG_SLOPE * u`` (a token's key count; a gather row's local index),
``SEG_REQUEST`` and ``SEG_REGION_PCU`` (tokens: the request, its region's start ``pcu``),
``SEG_BT_ROW_START`` (request * packed block-table width: where its block-table row starts in
the flattened tables) and ``SEG_KEEP_LIMIT`` (insert: 1 where the row's KV is written; gather:
rows of the region this rank holds; a row's slot is kept where the keep test of ``_slots``
passes). Gaps (padding) are zeros.

Sentinels: padded tokens have request 0, position 0 and key length 0 (no key); KV rows that are
not written point at ``dummy_slot``.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import torch

from cpplan.schemas.errors import CapacityError

# rows of seg_params (SEG_X_BASE and SEG_K_BASE adjacent: expand updates both in one op)
(SEG_X_BASE, SEG_K_BASE, SEG_SLOPE, SEG_REQUEST, SEG_REGION_PCU, SEG_BT_ROW_START,
 SEG_KEEP_LIMIT) = range(7)
NUM_PARAMS = 7
# one bind's arena words, in this order: seg_ends [S], seg_params [7, S], block_tables [N, width]
TABLE_NAMES = ("seg_ends", "seg_params", "block_tables")
_IOTA: dict = {}  # device -> arange shared by every bind on it (read only)


class StepMeta(msgspec.Struct, frozen=True, kw_only=True):
    """Host integers of one bound step (per rank). A msgspec Struct, as Layout and RankTables
    are: built in C, where a frozen dataclass sets each field through Python (bind runs cold)."""

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
    # graph-replayable plans (StepPlan.graph_replayable): (T, key blocks), the key of the
    # captured graph that may run this step; None for a step that runs eagerly only
    graph_key: tuple[int, int] | None = None


class Layout(msgspec.Struct, frozen=True, kw_only=True):
    """Host integers of the device expansion: section sizes and the sharding constants."""

    num_requests: int
    insert_len: int  # UI: nd + P * (T - nd) after kv_insert, else T
    dcp_size: int
    dcp_rank: int
    interleave_size: int
    block_size: int
    dummy_slot: int
    restore_len: int  # rows of restore_index: sum q, or P * T for a graph key (static)

    def total(self, meta: StepMeta) -> int:
        return meta.padded + self.insert_len + sum(meta.chunk_rows) + self.restore_len


class RankTables(msgspec.Struct, frozen=True, kw_only=True):
    """Host side: ``words``, the int64 words the arena receives (the tables of
    :data:`TABLE_NAMES`, back to back, ``sizes`` words each), the step's host integers and the
    expansion's layout."""

    words: np.ndarray
    sizes: tuple[int, int, int]
    meta: StepMeta
    layout: Layout

    @property
    def params(self) -> dict:
        """name -> int64 ndarray view of ``words``, in TABLE_NAMES order."""
        out, off = {}, 0
        for name, size in zip(TABLE_NAMES, self.sizes):
            out[name] = self.words[off: off + size]
            off += size
        return out

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
    block_tables: torch.Tensor  # [N, w] this rank's local blocks per request: the engine's
    #                             first w columns, w the most any request holds on this rank
    #                             (graph key: [T, key blocks], zero past N and past its blocks)
    restore_index: torch.Tensor  # [sum q] rows of the P * T restored buffer, global order
    #                              (graph key: [P * T], rows past sum q are 0)
    gather: tuple[GatherChunkTables, ...]  # per gather chunk (empty when W == 1)

    @classmethod
    def expand(cls, views: dict, meta: StepMeta, lay: Layout) -> StepTables:
        """Expand the arena's segments into the step's tables on the arena's device: a fixed
        number of ops on shapes the plan fixes (no host sync, nothing per request or chunk)."""
        ends, seg = views["seg_ends"], views["seg_params"].view(NUM_PARAMS, -1)
        bt = views["block_tables"].view(max(lay.num_requests, 1), -1)  # a step of no requests: [1, 0]
        u = iota(lay.total(meta), ends.device)
        g = seg.index_select(1, torch.searchsorted(ends, u, right=True))
        g[SEG_X_BASE: SEG_K_BASE + 1].addcmul_(g[SEG_SLOPE], u)  # x and k in one op
        t_pad, ui, nd = meta.padded, lay.insert_len, meta.num_decode_tokens
        key_len = g[SEG_K_BASE, :t_pad]
        local_len = key_len if lay.dcp_size == 1 else _shard_count(key_len, lay)
        z_end = t_pad + ui + sum(meta.chunk_rows)
        slots = _slots(g, t_pad, ui, z_end, bt, lay)
        gather, off = [], ui
        for rows, token_range in zip(meta.chunk_rows, meta.chunk_ranges):
            gather.append(GatherChunkTables(src=slots[off: off + rows], num_rows=rows,
                                            token_range=token_range))
            off += rows
        return cls(token_req=g[SEG_REQUEST, :t_pad], token_pos=g[SEG_X_BASE, :t_pad],
                   key_len=key_len, local_len=local_len, region_pcu=g[SEG_REGION_PCU, :t_pad],
                   insert_dec=slots[:nd], insert_pre=slots[nd:ui], block_tables=bt,
                   restore_index=g[SEG_X_BASE, z_end:], gather=tuple(gather))


def arena_overflow(step_id: int, sizes: dict, capacity: int):
    """The CapacityError of a bind whose tables (name -> words) exceed the arena."""
    biggest = max(sizes, key=sizes.get)
    return CapacityError(f"step {step_id} needs {sum(sizes.values()):,} arena words, capacity "
                         f"{capacity:,} (largest table {biggest}: {sizes[biggest]:,})")


def iota(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` on ``device``, from one cached buffer (grown when a step needs more)."""
    have = _IOTA.get(device)
    if have is None or have.numel() < n:
        have = _IOTA[device] = torch.arange(max(n, 2 * have.numel() if have is not None else 0,
                                                1 << 16), device=device)
    return have[:n]


def local_prefill_rows(t: StepTables, meta: StepMeta, lay: Layout, rows: int):
    """W == 1: a contiguous home for the keys the prefill tokens read, so the prefill indexer
    can serve a block of a request's queries from one key tile (docs/design.md §5.4). Request i
    needs keys 0 .. need_i - 1 (its largest key_len among this rank's prefill tokens); they sit
    at rows pcu_i + l of a buffer of ``rows`` rows (``segments.local_prefill_keys``: a bound
    from the plan), pcu the exclusive prefix sum of need. Returns (src [rows]: the cache slot of each row, the dummy slot past the last
    region; pcu [num_tokens - nd]: each prefill token's region start). A fixed number of ops on
    shapes the meta fixes: no host sync, nothing per request."""
    nd, n, bs = meta.num_decode_tokens, meta.num_tokens, lay.block_size
    req, dev = t.token_req[nd:n], t.token_req.device
    need = torch.zeros(lay.num_requests, dtype=torch.int64, device=dev)
    need.scatter_reduce_(0, req, t.key_len[nd:n], "amax")
    cum = torch.cumsum(need, 0)
    start = cum - need
    u = iota(rows, dev)
    r = torch.searchsorted(cum, u, right=True).clamp_max_(lay.num_requests - 1)
    local = u - start[r]
    live = u < cum[-1]
    bt = t.block_tables
    blk = bt.reshape(-1)[r * bt.shape[1] + torch.where(live, local // bs, 0)]
    src = torch.where(live, blk * bs + local % bs, lay.dummy_slot)
    return src, start[req]


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
    this rank writes / holds nothing. Rewrites the insert section's ``SEG_X_BASE`` (position ->
    local index) and ``SEG_K_BASE`` rows of ``g`` in place; those rows are not part of any table."""
    w_size, inter, bs = lay.dcp_size, lay.interleave_size, lay.block_size
    loc = g[SEG_X_BASE, lo:hi]
    if w_size == 1:
        keep = g[SEG_KEEP_LIMIT, lo:hi]  # 1 where written (no gather rows when W == 1)
    else:
        pos, other = g[SEG_X_BASE, lo: lo + ui], g[SEG_K_BASE, lo: lo + ui]
        if inter == 1:
            torch.bitwise_xor(torch.remainder(pos, w_size), lay.dcp_rank, out=other)
            pos.div_(w_size, rounding_mode="floor")  # local index
        else:
            blk = torch.div(pos, inter, rounding_mode="floor")
            torch.bitwise_xor(torch.remainder(blk, w_size), lay.dcp_rank, out=other)
            within = torch.remainder(pos, inter)
            torch.add(within, blk.div_(w_size, rounding_mode="floor"), alpha=inter, out=pos)
        # insert: owner xor rank (0 iff owned) < written flag; gather: local index < held
        keep = torch.lt(g[SEG_K_BASE, lo:hi], g[SEG_KEEP_LIMIT, lo:hi])
    flat = bt.reshape(-1) if bt.numel() else bt.new_zeros(1)
    col = torch.div(loc, bs, rounding_mode="floor")
    if w_size > 1:  # a row this rank does not hold may lie past its table's width
        col.clamp_(max=max(bt.shape[1] - 1, 0))
    col.add_(g[SEG_BT_ROW_START, lo:hi])
    slot = torch.remainder(loc, bs).add_(flat.take(col), alpha=bs)
    if lay.dummy_slot == 0:
        return slot.mul_(keep)
    return torch.where(keep.bool(), slot, lay.dummy_slot)
