"""A rank's per-step tables: built on the host from the plan, typed on the device.

Two halves, both here: :func:`build_tables` derives the rank's int64 tables (numpy) from the plan
(global facts), the rank's coordinates and its local block tables (the engine's); the executor
packs them into one arena (one H2D copy) and :func:`StepTables.from_arena` names the device views
and expands each gather chunk's O(regions) parameters into its ``[PT]`` source slots, on the
device. ``StepMeta`` holds the host integers a step slices with (never read back from the device).

Sentinels: padded tokens have request 0, position 0 and key length 0 (no key); KV rows that are
not written point at ``dummy_slot``. Gather chunks travel as per-region parameters (padded-local
prefix sums, rows this rank holds, request index): O(requests), never O(KV tokens); the
executor expands them to slots on the device.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cpplan.schemas.errors import CapacityError, StepInputError
from cpplan.schemas.plan import StepPlan
from cpplan.schemas.sharding import local_index, owner, shard_count


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
class RankTables:
    """Host side: name -> int64 ndarray (what the arena receives, in this order) and the meta."""

    arrays: dict
    meta: StepMeta


@dataclasses.dataclass(frozen=True)
class GatherChunkTables:
    """Device tables of one gather chunk c on this rank (W > 1)."""

    src: torch.Tensor  # [PT] int64: cache slot of each padded-local row (DUMMY past a shard)
    num_rows: int  # PT: rows each DCP rank contributes
    token_range: tuple[int, int, int]  # (first token, end, key width) of the chunk's tokens


@dataclasses.dataclass(frozen=True)
class StepTables:
    """One bound step's device tables on one rank: int64 views into the step's arena, alive
    until the arena is reused (``arena_depth`` binds later). T = the plan's padded tokens."""

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
    def from_arena(cls, views: dict, meta: StepMeta, num_requests: int,
                   block_size: int, dummy_slot: int) -> "StepTables":
        """Name the arena views and expand every gather chunk's sources on the device."""
        bt = views["block_tables"].view(num_requests, -1)
        gather = tuple(
            GatherChunkTables(src=gather_sources(views, c, rows, bt, block_size, dummy_slot),
                              num_rows=rows, token_range=meta.chunk_ranges[c])
            for c, rows in enumerate(meta.chunk_rows))
        return cls(token_req=views["token_req"], token_pos=views["token_pos"],
                   key_len=views["key_len"], local_len=views["local_len"],
                   region_pcu=views["region_pcu"], insert_dec=views["insert_dec"],
                   insert_pre=views["insert_pre"], block_tables=bt,
                   restore_index=views["restore_index"], gather=gather)


def gather_sources(views: dict, c: int, num_rows: int, bt: torch.Tensor, block_size: int,
                   dummy_slot: int) -> torch.Tensor:
    """``[PT]`` int64 slots of this rank's shard of each region of gather chunk ``c``, in
    padded-local order (rows past a region's shard -> ``dummy_slot``), from the chunk's
    O(regions) parameters in the arena. Device ops on shapes the plan fixes: no host sync."""
    pcu, held = views[f"gather_pcu[{c}]"], views[f"gather_held[{c}]"]
    req = views[f"gather_req[{c}]"]
    row = torch.arange(num_rows, device=pcu.device)
    region = torch.searchsorted(pcu[1:], row, right=True)
    local = row - pcu[region]
    col = torch.clamp(local // block_size, max=bt.shape[1] - 1)
    slot = bt[req[region], col] * block_size + local % block_size
    return torch.where(local < held[region], slot, torch.full_like(slot, dummy_slot))


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


def _rank_tokens(plan: StepPlan, p: int):
    """(token index, request, position, kv_write) of PCP rank p's real tokens."""
    lens = plan.row_num_tokens.np()[p].astype(np.int64)
    row = np.repeat(np.arange(len(lens)), lens)
    within = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    tok = plan.row_token_start.np()[p].astype(np.int64)[row] + within
    req = plan.row_request.np().astype(np.int64)[row]
    pos = plan.row_position_start()[p][row] + within
    return tok, req, pos, plan.row_kv_write.np()[p][row].astype(bool)


def _slots(block_tables: np.ndarray, req, local, block_size: int) -> np.ndarray:
    col = local // block_size
    if col.size and int(col.max()) >= block_tables.shape[1]:
        raise CapacityError(f"block table too narrow: needs {int(col.max()) + 1} blocks per "
                            f"request, the tables given have {block_tables.shape[1]}")
    return block_tables[req, col].astype(np.int64) * block_size + local % block_size


def _insert_slots(plan, w, block_tables, dummy, tok, req, pos, write, lo, hi):
    """Slots for tokens with lo <= tok < hi, at rows tok - lo (others: dummy)."""
    cfg = plan.config
    out = np.full(hi - lo, dummy, dtype=np.int64)
    sel = (tok >= lo) & (tok < hi) & write & (owner(pos, cfg.dcp_size, cfg.interleave_size) == w)
    loc = local_index(pos[sel], cfg.dcp_size, cfg.interleave_size)
    out[tok[sel] - lo] = _slots(block_tables, req[sel], loc, cfg.block_size)
    return out


def build_tables(plan: StepPlan, pcp_rank: int, dcp_rank: int, block_tables: np.ndarray,
                 dummy_slot: int) -> RankTables:
    """The rank's tables for ``plan``; ``block_tables`` is ``[N, max_blocks]`` int64 (row i: this
    rank's local blocks of request i, in the plan's request order), already validated
    (:func:`check_block_tables`)."""
    cfg = plan.config
    t_pad, nd = plan.padded_num_tokens, plan.num_decode_tokens
    names = {c.name for c in plan.collectives}
    bt = block_tables
    tok, req, pos, write = _rank_tokens(plan, pcp_rank)
    a = {}
    a["token_req"] = np.zeros(t_pad, np.int64)
    a["token_req"][tok] = req
    a["token_pos"] = np.zeros(t_pad, np.int64)
    a["token_pos"][tok] = pos
    key_len = np.zeros(t_pad, np.int64)
    key_len[tok] = pos + 1
    a["key_len"] = key_len
    local_len = np.zeros(t_pad, np.int64)
    local_len[tok] = shard_count(pos + 1, cfg.dcp_size, cfg.interleave_size, dcp_rank)
    a["local_len"] = local_len
    kv_insert = "kv_insert" in names
    a["insert_dec"], a["insert_pre"] = _insert_tables(plan, dcp_rank, bt, dummy_slot, kv_insert,
                                                      (tok, req, pos, write))
    chunk_ranges, chunk_rows = _chunk_tables(plan, dcp_rank, tok, req, key_len, a)
    a["block_tables"] = bt.reshape(-1)
    a["restore_index"] = plan.restore_index()
    n_real = int(tok.size)
    dec_width = int(local_len[:nd].max()) if nd else 0
    local_width = int(key_len[:n_real].max()) if n_real else 0
    meta = StepMeta(num_tokens=n_real, padded=t_pad, num_decode_tokens=nd,
                    decode_width=max(dec_width, 1), local_range=(0, n_real, max(local_width, 1)),
                    chunk_ranges=chunk_ranges, chunk_rows=chunk_rows, kv_insert=kv_insert,
                    decode_merge="decode_out" in names, restore="restore" in names,
                    num_global_tokens=int(a["restore_index"].size))
    return RankTables(arrays=a, meta=meta)


def _insert_tables(plan, dcp_rank, bt, dummy_slot, kv_insert, mine):
    """(insert_dec [nd], insert_pre): cache slots for the local decode tokens, then for the
    prefill tokens: every PCP rank's (``[P * (T - nd)]``, after ``kv_insert``) or this rank's
    own (``[T - nd]``). Tokens this rank does not write point at ``dummy_slot``."""
    t_pad, nd = plan.padded_num_tokens, plan.num_decode_tokens
    dec = _insert_slots(plan, dcp_rank, bt, dummy_slot, *mine, 0, nd)
    if kv_insert:
        parts = [_insert_slots(plan, dcp_rank, bt, dummy_slot, *_rank_tokens(plan, q), nd, t_pad)
                 for q in range(plan.config.pcp_size)]
        return dec, np.concatenate(parts)
    return dec, _insert_slots(plan, dcp_rank, bt, dummy_slot, *mine, nd, t_pad)


def _chunk_tables(plan, dcp_rank, tok, req, key_len, a) -> tuple[tuple, tuple]:
    """Per gather chunk (W > 1): its O(regions) parameters into ``a`` (the executor expands them
    to [PT] slots on the device) and ``region_pcu`` per token; returns (chunk_ranges,
    chunk_rows): each chunk's (first token, end, key width) on this rank, and its PT."""
    nd, n = plan.num_decode_tokens, plan.num_requests
    region_pcu = np.zeros(plan.padded_num_tokens, np.int64)
    chunk_ranges, chunk_rows = [], []
    chunks = plan.gather_chunks if plan.config.dcp_size > 1 else ()
    for c, ch in enumerate(chunks):
        creq = ch.requests.np().astype(np.int64)
        pcu = ch.padded_local_cu.np()
        a[f"gather_pcu[{c}]"] = pcu
        a[f"gather_held[{c}]"] = plan.dcp_local_lens.np()[creq, dcp_rank].astype(np.int64)
        a[f"gather_req[{c}]"] = creq
        region_of = np.full(n, -1, np.int64)
        region_of[creq] = np.arange(len(creq))
        in_chunk = (region_of[req] >= 0) & (tok >= nd)
        ctok = tok[in_chunk]
        region_pcu[ctok] = pcu[region_of[req[in_chunk]]]
        if ctok.size:
            lo, hi = int(ctok.min()), int(ctok.max()) + 1
            assert hi - lo == ctok.size, "a gather chunk's tokens are contiguous on a rank"
            width = int(key_len[lo:hi].max())
        else:
            lo = hi = width = 0
        chunk_ranges.append((lo, hi, width))
        chunk_rows.append(ch.padded_local_total)
    a["region_pcu"] = region_pcu
    return tuple(chunk_ranges), tuple(chunk_rows)
