"""The per-request, per-row and per-chunk invariants of a decoded plan, in one jitted pass.

Decoding must stay cheap (a 512-request plan decodes in tens of microseconds) and a numpy
expression costs about a microsecond however small its array, so the dozens of comparisons run
as one numba loop that re-derives each table from the request columns and the config (the
rules of docs/design.md §3) and returns the first broken rule. This is a second, plain
derivation written apart from the planner's kernels: a plan either matches it exactly or is
refused. :mod:`cpplan.schemas.invariants` turns the returned rule into the one-line error.
"""

from __future__ import annotations

import numpy as np
from numba import njit

OK = 0
# rule ids (index into invariants.KERNEL_RULES)
(C_NEG, Q_LOW, EXTENT, PRE, MODE, CHUNK, SHARD, LOCAL, ROWS, ROW_REQ, ROW_OFF, ROW_LEN, ROW_KV,
 ROW_START, NUM_TOKENS, DEC_ROWS, DEC_TOKENS, N_CHUNKS, CH_SIZE, CH_REQ, CH_PAD, CH_PCU,
 CH_GCU, CH_PT, CH_TOTAL) = range(1, 26)


@njit(cache=True)
def _expected_mode(pre, q, p_size, w_size, owned):
    """(mode, chunk_size) of one request (decode 0, split 1, replicated 2, owned decode 3)."""
    if pre == 0:
        return (3 if owned else 0), q
    if p_size == 1:
        return 2, q
    s = 2 * p_size
    cs = (q + s - 1) // s
    if w_size > 1 and s * cs - q >= cs:
        return 2, q
    return 1, cs


@njit(cache=True)
def check_requests(c, q, pre, mode, cs, shard, local, p_size, w_size, inter, max_len, owned):
    """Request columns. Returns (rule, flat index, value found), rule 0 when all hold."""
    period = w_size * inter
    for i in range(q.shape[0]):
        ci, qi = np.int64(c[i]), np.int64(q[i])
        if ci < 0:
            return C_NEG, i, ci
        if qi < 1:
            return Q_LOW, i, qi
        e = ci + qi
        if e > max_len:
            return EXTENT, i, e
        if pre[i] > 1:
            return PRE, i, np.int64(pre[i])
        m, chunk = _expected_mode(pre[i], qi, p_size, w_size, owned)
        if mode[i] != m:
            return MODE, i, np.int64(mode[i])
        if cs[i] != chunk:
            return CHUNK, i, np.int64(cs[i])
        base = (e // period) * inter
        if shard[i] != base + min(e % period, inter):
            return SHARD, i, np.int64(shard[i])
        rem = e - base * w_size
        for r in range(w_size):
            if local[i * w_size + r] != base + min(max(rem - r * inter, 0), inter):
                return LOCAL, i * w_size + r, np.int64(local[i * w_size + r])
    return OK, 0, np.int64(0)


@njit(cache=True)
def _check_row(q, mode, cs, i, j, r, p_size, row_count, off, length, kv):
    """Row r: request i's (j-th) row on every rank (an owned decode's on rank r % P only: r is
    its ordinal among the decodes, which come first). Returns (rule, flat index, value)."""
    s = 2 * p_size
    n_rows = row_count
    for p in range(p_size):
        if mode[i] == 1:
            k = p if j == 0 else s - 1 - p
            a = min(k * np.int64(cs[i]), np.int64(q[i]))
            ln = min(a + cs[i], np.int64(q[i])) - a
            w = 1
        elif mode[i] == 3:
            mine = p == r % p_size
            a, ln = 0, np.int64(q[i]) if mine else 0
            w = 1 if mine else 0
        else:
            a, ln = 0, np.int64(q[i])
            w = 1 if mode[i] == 0 or p == 0 else 0
        if off[p * n_rows + r] != a:
            return ROW_OFF, p * n_rows + r, np.int64(off[p * n_rows + r])
        if length[p * n_rows + r] != ln:
            return ROW_LEN, p * n_rows + r, np.int64(length[p * n_rows + r])
        if kv[p * n_rows + r] != w:
            return ROW_KV, p * n_rows + r, np.int64(kv[p * n_rows + r])
    return OK, 0, np.int64(0)


@njit(cache=True)
def check_rows(q, mode, cs, row_req, off, length, start, kv, num_tokens, nd_rows, nd_tokens):
    # off, length, start, kv: [P, R] flattened
    """Row tables in published order (decodes, owned or not, then prefills, a split request
    twice), token starts, per-rank counts and the decode totals (of the every-rank decodes,
    mode 0). Call after :func:`check_requests`."""
    n, p_size, n_rows = q.shape[0], num_tokens.shape[0], row_req.shape[0]
    expected = 0
    for i in range(n):
        expected += 2 if mode[i] == 1 else 1
    if expected != n_rows:
        return ROWS, 0, np.int64(n_rows)
    r = 0
    dec_rows = 0
    dec_tokens = np.int64(0)
    for phase in range(2):
        if phase == 1 and nd_rows != dec_rows:
            return DEC_ROWS, 0, np.int64(nd_rows)
        for i in range(n):
            if (mode[i] == 0 or mode[i] == 3) != (phase == 0):
                continue
            for j in range(2 if mode[i] == 1 else 1):
                if row_req[r] != i:
                    return ROW_REQ, r, np.int64(row_req[r])
                rule, at, got = _check_row(q, mode, cs, i, j, r, p_size, n_rows, off, length, kv)
                if rule != OK:
                    return rule, at, got
                if mode[i] == 0:
                    dec_rows += 1
                    dec_tokens += length[r]
                r += 1
    if dec_tokens != nd_tokens:
        return DEC_TOKENS, 0, np.int64(nd_tokens)
    for p in range(p_size):
        acc = np.int64(0)
        for r in range(n_rows):
            if start[p * n_rows + r] != acc:
                return ROW_START, p * n_rows + r, np.int64(start[p * n_rows + r])
            acc += length[p * n_rows + r]
        if num_tokens[p] != acc:
            return NUM_TOKENS, p, np.int64(num_tokens[p])
    return OK, 0, np.int64(0)


@njit(cache=True)
def check_chunks(c, q, mode, shard, w_size, budget, sizes, creq, cpad, pcu, gcu, pts, totals):
    """Gather chunks (W > 1): the greedy cut of the prefill requests in request order, a
    request joining the current chunk while W * PT stays within ``budget``. ``sizes`` [K] are the
    chunks' request counts; ``creq`` / ``cpad`` [sum sizes] and ``pcu`` / ``gcu``
    [sum sizes + K] their arrays concatenated; ``pts`` / ``totals`` [K]."""
    k = -1
    j = 0  # position in creq
    base = 0  # chunk k's first position in creq
    pt = np.int64(0)
    tot = np.int64(0)
    for i in range(q.shape[0]):
        if mode[i] == 0 or mode[i] == 3:
            continue
        pad = np.int64(shard[i])
        if k < 0 or w_size * (pt + pad) > budget:
            if k >= 0:
                rule, at, got = _close_chunk(k, j - base, pt, tot, sizes, pts, totals)
                if rule != OK:
                    return rule, at, got
            k += 1
            if k >= sizes.shape[0]:
                return N_CHUNKS, 0, np.int64(sizes.shape[0])
            base = j
            pt, tot = np.int64(0), np.int64(0)
            if pcu[j + k] != 0:
                return CH_PCU, j + k, pcu[j + k]
            if gcu[j + k] != 0:
                return CH_GCU, j + k, gcu[j + k]
        if j - base >= sizes[k]:
            return CH_SIZE, k, np.int64(sizes[k])
        if creq[j] != i:
            return CH_REQ, j, np.int64(creq[j])
        if cpad[j] != pad:
            return CH_PAD, j, np.int64(cpad[j])
        pt += pad
        tot += np.int64(c[i]) + q[i]
        if pcu[j + k + 1] != pt:
            return CH_PCU, j + k + 1, pcu[j + k + 1]
        if gcu[j + k + 1] != tot:
            return CH_GCU, j + k + 1, gcu[j + k + 1]
        j += 1
    if k >= 0:
        rule, at, got = _close_chunk(k, j - base, pt, tot, sizes, pts, totals)
        if rule != OK:
            return rule, at, got
    if k + 1 != sizes.shape[0]:
        return N_CHUNKS, 0, np.int64(sizes.shape[0])
    return OK, 0, np.int64(0)


@njit(cache=True)
def _close_chunk(k, count, pt, tot, sizes, pts, totals):
    if sizes[k] != count:
        return CH_SIZE, k, np.int64(sizes[k])
    if pts[k] != pt:
        return CH_PT, k, np.int64(pts[k])
    if totals[k] != tot:
        return CH_TOTAL, k, np.int64(totals[k])
    return OK, 0, np.int64(0)


@njit(cache=True)
def check_tables(c, q, pre, mode, cs, shard, local, row_req, off, length, start, kv,
                 num_tokens, nd_rows, nd_tokens, p_size, w_size, inter, max_len, budget,
                 sizes, creq, cpad, pcu, gcu, pts, totals, owned):
    """All three checks in one call (a numba call costs microseconds); 2-D tables come
    flattened (local [N * W], the row tables [P * R])."""
    rule, at, got = check_requests(c, q, pre, mode, cs, shard, local, p_size, w_size, inter,
                                   max_len, owned)
    if rule != OK:
        return rule, at, got
    rule, at, got = check_rows(q, mode, cs, row_req, off, length, start, kv, num_tokens,
                               nd_rows, nd_tokens)
    if rule != OK or w_size == 1:
        return rule, at, got
    return check_chunks(c, q, mode, shard, w_size, budget, sizes, creq, cpad, pcu, gcu, pts,
                        totals)
