"""Plans built directly from random numbers, for codec tests that must not depend on the planner.

:func:`make_plan` derives every table from random request columns with plain Python loops (a
reference written apart from the planner's kernels and from the decoder's invariant kernel),
so its plans pass decoding's consistency checks. :func:`make_raw_plan` is the older generator
whose arrays are well-typed random numbers with no planning meaning; decoding refuses its plans,
and its payload bytes stay pinned in tests/schemas/golden.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from cpplan.schemas import Collective, GatherChunk, ParallelConfig, StepInput, StepPlan
from cpplan.schemas.arrays import i32, i64, u8


def make_config(rng: np.random.Generator) -> ParallelConfig:
    topo = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 4), (8, 8), (3, 1)]
    p, w = topo[rng.integers(len(topo))]
    return ParallelConfig(
        pcp_size=p, dcp_size=w, interleave_size=int(rng.choice([1, 2, 16, 64])),
        max_model_len=int(rng.integers(1_000, 200_000)),
        cudagraph_token_sizes=tuple(sorted(set(int(x) for x in rng.integers(1, 512, 3)))),
    )


def make_step(rng: np.random.Generator, num_requests: int) -> StepInput:
    return StepInput.build(
        int(rng.integers(0, 10**6)),
        [f"req-{rng.integers(10**9)}-{i}" for i in range(num_requests)],
        rng.integers(0, 100_000, num_requests),
        rng.integers(1, 4_000, num_requests),
        rng.integers(0, 2, num_requests).astype(bool),
    )


def make_raw_plan(seed: int, num_requests: int = 16) -> StepPlan:
    rng = np.random.default_rng(seed)
    config = make_config(rng)
    p, w = config.pcp_size, config.dcp_size
    n = num_requests
    num_rows = n + int(rng.integers(0, n + 1))
    num_chunks = int(rng.integers(0, 4)) if w > 1 else 0
    chunks = []
    for _ in range(num_chunks):
        k = int(rng.integers(1, 5))
        pad = rng.integers(0, 500, k)
        ext = rng.integers(1, 900, k)
        chunks.append(GatherChunk(
            requests=i32(rng.integers(0, max(n, 1), k)), pad=i32(pad),
            padded_local_cu=i64(np.concatenate(([0], np.cumsum(pad)))),
            global_cu=i64(np.concatenate(([0], np.cumsum(ext)))),
            padded_local_total=int(pad.sum()), total=int(ext.sum()),
        ))
    collectives = tuple(
        Collective(name=f"kv_gather[{c}]", op="all_gather", group="dcp", dtype="uint8",
                   shape=(int(rng.integers(1, 999)), 656), bytes=int(rng.integers(1, 10**6)),
                   per_layer=True)
        for c in range(num_chunks)
    )
    return StepPlan(
        config=config,
        step_id=int(rng.integers(0, 10**6)),
        req_ids=tuple(f"r{seed}-{i}" for i in range(n)),
        num_computed_tokens=i32(rng.integers(0, 100_000, n)),
        num_scheduled_tokens=i32(rng.integers(1, 4_000, n)),
        is_prefilling=u8(rng.integers(0, 2, n)),
        mode=u8(rng.integers(0, 3, n)),
        chunk_size=i32(rng.integers(1, 100, n)),
        dcp_shard_rows=i32(rng.integers(1, 100_000, n)),
        dcp_local_lens=i32(rng.integers(0, 100_000, (n, w))),
        row_request=i32(rng.integers(0, max(n, 1), num_rows)),
        row_query_offset=i32(rng.integers(0, 4_000, (p, num_rows))),
        row_num_tokens=i32(rng.integers(0, 4_000, (p, num_rows))),
        row_token_start=i32(rng.integers(0, 4_000, (p, num_rows))),
        row_kv_write=u8(rng.integers(0, 2, (p, num_rows))),
        num_decode_rows=int(rng.integers(0, n + 1)),
        num_decode_tokens=int(rng.integers(0, n + 1)),
        num_tokens=tuple(int(x) for x in rng.integers(0, 10_000, p)),
        padded_num_tokens=int(rng.integers(0, 10_000)),
        cudagraph_size=int(rng.integers(0, 512)),
        gather_chunks=tuple(chunks),
        collectives=collectives,
    )


def _mode(pre: bool, q: int, p: int, w: int) -> tuple[int, int]:
    """(mode, chunk size): decode 0, split 1, replicated 2 (docs/design.md §3.1)."""
    if not pre:
        return 0, q
    if p == 1:
        return 2, q
    cs = -(-q // (2 * p))
    if w > 1 and 2 * p * cs - q >= cs:  # the last chunk would be empty: replicate
        return 2, q
    return 1, cs


def _local_lens(extent: int, w: int, inter: int) -> list[int]:
    """KV tokens of [0, extent) on each DCP rank: whole periods, then the partial one."""
    periods, rest = divmod(extent, w * inter)
    return [periods * inter + min(max(rest - r * inter, 0), inter) for r in range(w)]


def _rows(q, modes, chunks, p_size):
    """(row request, [P][R] offsets, lengths, kv writes): decodes, then prefills."""
    order = [i for i in range(len(q)) if modes[i] == 0]
    order += [i for i in range(len(q)) if modes[i] != 0]
    req, off, ln, kv = [], [[] for _ in range(p_size)], [[] for _ in range(p_size)], \
        [[] for _ in range(p_size)]
    for i in order:
        for j in range(2 if modes[i] == 1 else 1):
            req.append(i)
            for p in range(p_size):
                if modes[i] == 1:
                    k = p if j == 0 else 2 * p_size - 1 - p
                    a = min(k * chunks[i], q[i])
                    off[p].append(a)
                    ln[p].append(min(a + chunks[i], q[i]) - a)
                    kv[p].append(1)
                else:
                    off[p].append(0)
                    ln[p].append(q[i])
                    kv[p].append(1 if modes[i] == 0 or p == 0 else 0)
    return req, off, ln, kv


def _chunks(c, q, modes, shard, w, budget) -> list[GatherChunk]:
    groups: list[list[int]] = []
    for i in range(len(q)):
        if modes[i] == 0:
            continue
        if groups and w * (sum(shard[r] for r in groups[-1]) + shard[i]) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    out = []
    for g in groups:
        pads, ext = [shard[i] for i in g], [c[i] + q[i] for i in g]
        out.append(GatherChunk(
            requests=i32(g), pad=i32(pads),
            padded_local_cu=i64([sum(pads[:k]) for k in range(len(g) + 1)]),
            global_cu=i64([sum(ext[:k]) for k in range(len(g) + 1)]),
            padded_local_total=sum(pads), total=sum(ext)))
    return out


def make_plan(seed: int, num_requests: int = 16) -> StepPlan:
    """A random plan that is consistent (every table derived from the request columns)."""
    rng = np.random.default_rng(seed)
    config = make_config(rng)
    p, w, inter = config.pcp_size, config.dcp_size, config.interleave_size
    n = num_requests
    q = [int(x) for x in rng.integers(1, 4_000, n)]
    c = [int(rng.integers(0, config.max_model_len - qi + 1)) for qi in q]
    pre = [bool(x) for x in rng.integers(0, 2, n)]
    modes, chunks = zip(*[_mode(pre[i], q[i], p, w) for i in range(n)]) if n else ((), ())
    local = [_local_lens(c[i] + q[i], w, inter) for i in range(n)]
    shard = [lens[0] for lens in local]
    req, off, ln, kv = _rows(q, modes, chunks, p)
    counts = tuple(sum(ln[r]) for r in range(p))
    starts = [[sum(ln[r][:j]) for j in range(len(req))] for r in range(p)]
    sizes = config.cudagraph_token_sizes
    k = bisect_left(sizes, max(counts))
    padded, graph = (sizes[k], sizes[k]) if k < len(sizes) else (max(counts), 0)
    gather = _chunks(c, q, modes, shard, w, config.gather_workspace_tokens) if w > 1 else []
    n_dec = sum(1 for m in modes if m == 0)
    return StepPlan(
        config=config, step_id=int(rng.integers(0, 10**6)),
        req_ids=tuple(f"r{seed}-{i}" for i in range(n)),
        num_computed_tokens=i32(c), num_scheduled_tokens=i32(q), is_prefilling=u8(pre),
        mode=u8(modes), chunk_size=i32(chunks), dcp_shard_rows=i32(shard),
        dcp_local_lens=i32(np.array(local, dtype=np.int64).reshape(n, w)),
        row_request=i32(req), row_query_offset=i32(np.array(off).reshape(p, len(req))),
        row_num_tokens=i32(np.array(ln).reshape(p, len(req))),
        row_token_start=i32(np.array(starts).reshape(p, len(req))),
        row_kv_write=u8(np.array(kv).reshape(p, len(req))),
        num_decode_rows=n_dec, num_decode_tokens=sum(q[i] for i in range(n) if modes[i] == 0),
        num_tokens=counts, padded_num_tokens=padded, cudagraph_size=graph,
        gather_chunks=tuple(gather),
        collectives=tuple(
            Collective(name=f"kv_gather[{k}]", op="all_gather", group="dcp", dtype="uint8",
                       shape=(ch.padded_local_total, 656), bytes=ch.padded_local_total * 656,
                       per_layer=True) for k, ch in enumerate(gather)),
    )
