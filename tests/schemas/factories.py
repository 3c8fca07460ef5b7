"""Plans built directly from random numbers, for codec tests that must not depend on the planner.

The plans are well-typed (every array has its documented shape and dtype) but carry no
planning meaning; semantic tests live in tests/planner.
"""

from __future__ import annotations

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


def make_plan(seed: int, num_requests: int = 16) -> StepPlan:
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
