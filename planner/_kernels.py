"""Numba kernels of the planner: every per-request and per-row loop of a compile, in one call.

numpy call overhead (about 1 us a call) dominates at a few hundred requests, and the greedy
gather-chunk cut is a sequential scan, so the whole derivation runs in one jitted function
(:func:`plan_kernel`) that returns plain arrays; ``planner.compile`` only wraps them. All inputs
are global facts (docs/design.md §3): nothing here depends on the rank that runs it.

``cache=True`` keeps the machine code in ``planner/__pycache__``;
:func:`compile_planner_kernels` compiles (or loads) every signature the planner uses, so a
serving loop pays the JIT cost at start-up.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from cpplan.schemas.plan import MODE_DECODE, MODE_OWNED, MODE_REPLICATED, MODE_SPLIT


@njit(cache=True)
def _request_table(c, q, pre, p_size, w_size, inter, owned, mode, chunk, shard, local):
    """Per request i (docs/design.md §3.1, §3.2, §3.4), written into the [N] / [N, W] outputs:
    ``mode[i]`` (MODE_*; decodes are MODE_OWNED when ``owned``), ``chunk[i]`` (cs = ceil(q/S)
    for split, q otherwise), ``local[i, r]`` (KV tokens of the extent on DCP rank r; the extent
    when W == 1) and ``shard[i]`` = local[i, 0] (shard_rows). Returns (prefill requests, rows R,
    decode tokens nd: those of MODE_DECODE rows, which every rank computes)."""
    s = 2 * p_size
    period = w_size * inter
    n_pre = 0
    n_rows = 0
    nd_tokens = 0
    for i in range(q.shape[0]):
        qi = q[i]
        if pre[i] == 0 and owned:
            m, cs = MODE_OWNED, qi
        elif pre[i] == 0:
            m, cs = MODE_DECODE, qi
            nd_tokens += qi
        elif p_size == 1:
            m, cs = MODE_REPLICATED, qi
        else:
            cs = (qi + s - 1) // s
            if w_size > 1 and s * cs - qi >= cs:
                m, cs = MODE_REPLICATED, qi
            else:
                m = MODE_SPLIT
        mode[i] = m
        chunk[i] = cs
        n_pre += m == MODE_SPLIT or m == MODE_REPLICATED
        n_rows += 2 if m == MODE_SPLIT else 1
        e = c[i] + qi
        base = (e // period) * inter
        rem = e - base * w_size
        for r in range(w_size):
            local[i, r] = base + min(max(rem - r * inter, 0), inter)
        shard[i] = local[i, 0]
    return n_pre, n_rows, nd_tokens


@njit(cache=True)
def _fill_rows(q, mode, chunk, p_size, row_req, off, length, kv_write):
    """Published rows (docs/design.md §3.3): decodes first, then prefills, both by request index; a split
    request's two rows hold chunks p and S-1-p on rank p; an owned decode's row holds its tokens
    on rank ``ordinal % P`` only (ordinal: its place among the decodes). Writes ``row_req`` [R]
    and, per rank, ``off`` / ``length`` [P, R] (query offset, tokens) and ``kv_write`` [P, R].
    Returns the number of MODE_DECODE rows."""
    s = 2 * p_size
    r = 0
    nd_rows = 0
    for i in range(q.shape[0]):
        m = mode[i]
        if m == MODE_DECODE or m == MODE_OWNED:
            row_req[r] = i
            for p in range(p_size):
                mine = m == MODE_DECODE or p == r % p_size  # r: the decode's ordinal
                off[p, r] = 0
                length[p, r] = q[i] if mine else 0
                kv_write[p, r] = mine
            r += 1
            nd_rows += m == MODE_DECODE
    for i in range(q.shape[0]):
        m = mode[i]
        if m == MODE_REPLICATED:
            row_req[r] = i
            for p in range(p_size):
                off[p, r] = 0
                length[p, r] = q[i]
                kv_write[p, r] = p == 0
            r += 1
        elif m == MODE_SPLIT:
            cs, qi = chunk[i], q[i]
            row_req[r] = i
            row_req[r + 1] = i
            for p in range(p_size):
                for j in range(2):
                    k = p if j == 0 else s - 1 - p
                    a = min(k * cs, qi)
                    off[p, r + j] = a
                    length[p, r + j] = min(a + cs, qi) - a
                    kv_write[p, r + j] = 1
            r += 2
    return nd_rows


@njit(cache=True)
def _token_starts(length, start, num_tokens):
    """``start[p, r]``: exclusive prefix sum of ``length[p, :]``; ``num_tokens[p]`` its total."""
    for p in range(length.shape[0]):
        acc = 0
        for r in range(length.shape[1]):
            start[p, r] = acc
            acc += length[p, r]
        num_tokens[p] = acc


@njit(cache=True)
def _cut_chunks(c, q, mode, shard, w_size, budget, n_pre):
    """Greedy gather chunks over the prefill requests in request order (docs/design.md §3.5): a request
    joins the current chunk while ``W * PT`` stays within ``budget``. Returns ``creq`` / ``cpad``
    [n_pre] int32 (request, pad = shard_rows(E)), ``bounds`` [n_chunks + 1] (chunk k holds
    creq[bounds[k]:bounds[k+1]]) and the flat prefix sums ``pcu`` / ``gcu`` [n_pre + n_chunks]
    int64, chunk k's at [bounds[k] + k, bounds[k+1] + k + 1)."""
    creq = np.empty(n_pre, np.int32)
    cpad = np.empty(n_pre, np.int32)
    bounds = np.zeros(n_pre + 1, np.int64)
    pcu = np.empty(2 * n_pre, np.int64)
    gcu = np.empty(2 * n_pre, np.int64)
    j = 0
    nch = 0
    pt = 0
    tot = 0
    for i in range(q.shape[0] if n_pre > 0 else 0):
        if mode[i] == MODE_DECODE:
            continue
        pad = shard[i]
        if j > bounds[nch] and w_size * (pt + pad) > budget:
            nch += 1
            bounds[nch] = j
            pt = 0
            tot = 0
        if j == bounds[nch]:
            pcu[j + nch] = 0
            gcu[j + nch] = 0
        creq[j] = i
        cpad[j] = pad
        pt += pad
        tot += c[i] + q[i]
        pcu[j + nch + 1] = pt
        gcu[j + nch + 1] = tot
        j += 1
    if j > 0:
        nch += 1
        bounds[nch] = j
    return creq, cpad, bounds[: nch + 1], pcu[: n_pre + nch], gcu[: n_pre + nch]


@njit(cache=True)
def plan_kernel(c, q, pre, p_size, w_size, inter, budget, owned):
    """The whole per-step derivation. ``c``, ``q`` int64 [N], ``pre`` uint8 [N] (the step's
    columns); ``owned``: the config's shard_decode_requests. Returns a tuple, in order: request table (``c32``, ``q32`` int32, ``mode`` uint8,
    ``chunk``, ``shard`` int32 [N], ``local`` int32 [N, W]); rows (``row_req`` int32 [R],
    ``off``, ``length``, ``start`` int32 [P, R], ``kv_write`` uint8 [P, R], ``num_tokens`` int64
    [P], ``nd_rows``, ``nd_tokens``); gather chunks (see :func:`_cut_chunks`, empty when
    W == 1)."""
    n = q.shape[0]
    mode = np.empty(n, np.uint8)
    chunk = np.empty(n, np.int32)
    shard = np.empty(n, np.int32)
    local = np.empty((n, w_size), np.int32)
    n_pre, n_rows, nd_tokens = _request_table(
        c, q, pre, p_size, w_size, inter, owned, mode, chunk, shard, local)
    row_req = np.empty(n_rows, np.int32)
    off = np.empty((p_size, n_rows), np.int32)
    length = np.empty((p_size, n_rows), np.int32)
    kv_write = np.empty((p_size, n_rows), np.uint8)
    nd_rows = _fill_rows(q, mode, chunk, p_size, row_req, off, length, kv_write)
    start = np.empty((p_size, n_rows), np.int32)
    num_tokens = np.empty(p_size, np.int64)
    _token_starts(length, start, num_tokens)
    creq, cpad, bounds, pcu, gcu = _cut_chunks(
        c, q, mode, shard, w_size, budget, n_pre if w_size > 1 else 0)
    return (c.astype(np.int32), q.astype(np.int32), mode, chunk, shard, local,
            row_req, off, length, start, kv_write, num_tokens, nd_rows, nd_tokens,
            creq, cpad, bounds, pcu, gcu)


def compile_planner_kernels() -> None:
    """Compile (or load from cache) the planner's kernels for the column dtypes StepInput uses
    (read-only int64 / uint8 views), so the first real step pays no JIT cost."""
    c = np.frombuffer(np.array([5, 0, 40], np.int64).tobytes(), np.int64)
    q = np.frombuffer(np.array([1, 9, 30], np.int64).tobytes(), np.int64)
    pre = np.frombuffer(np.array([0, 1, 1], np.uint8).tobytes(), np.uint8)
    for owned in (False, True):
        plan_kernel(c, q, pre, 2, 2, 1, 1 << 20, owned)
