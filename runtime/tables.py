"""A rank's token-level tables for one plan (numpy, host side of bind; no torch).

Everything is derived from the plan (global facts) plus the rank's coordinates and its local
block tables (the engine's). The tables are int64 and land in the arena; ``RankTables.meta``
holds the host integers the step needs for slicing (never read back from the device).

Sentinels: padded tokens have request 0, position 0 and key length 0 (no key); KV rows that are
not written point at ``dummy_slot``. Gather chunks travel as per-region parameters (padded-local
prefix sums, rows this rank holds, request index): O(requests), never O(KV tokens); the
executor expands them to slots on the device.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cpplan.schemas.errors import CapacityError
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
    arrays: dict  # name -> int64 ndarray
    meta: StepMeta


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
                 dummy_slot: int, request_keys: np.ndarray | None = None) -> RankTables:
    """The rank's tables for ``plan``; ``block_tables`` is ``[N, max_blocks]`` (row i: this
    rank's local blocks of request i, in the plan's request order)."""
    cfg = plan.config
    t_pad, nd, n = plan.padded_num_tokens, plan.num_decode_tokens, plan.num_requests
    names = {c.name for c in plan.collectives}
    bt = np.asarray(block_tables, dtype=np.int64).reshape(n, -1)
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
    a["request_keys"] = (np.zeros(n, np.int64) if request_keys is None
                         else np.asarray(request_keys, np.int64))
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
