"""Hypothesis strategies for planner tests: supported configs and global batches."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from cpplan.schemas.config import ParallelConfig, indexer_sources_from_types, shard_rows
from cpplan.schemas.step import StepInput

SIZES = (1, 2, 3, 4, 8)
TOPOLOGIES = tuple((p, w) for p in SIZES for w in SIZES if w == 1 or p == 1 or w == p)
INTERLEAVES = (1, 2, 16, 64)


@st.composite
def configs(draw, max_model_len: int = 262144, small_dims: bool = False) -> ParallelConfig:
    """A supported ParallelConfig: topology, interleave, dtypes, graph sizes, a workspace from
    the minimum up to a few times it (so steps need one or several gather chunks) and, where it
    is allowed (P > 1, W == 1), decode ownership on or off."""
    p, w = draw(st.sampled_from(TOPOLOGIES))
    inter = draw(st.sampled_from(INTERLEAVES))
    minimum = w * shard_rows(max_model_len, w, inter)
    workspace = draw(st.sampled_from((0, minimum, minimum + 1, 2 * minimum, 5 * minimum)))
    graphs = draw(st.sampled_from(((), (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
                                   (8, 64, 512, 4096, 32768))))
    layers = draw(st.sampled_from((61, 1, 4, 8)))
    pattern = draw(st.lists(st.sampled_from("FS"), min_size=layers - 1, max_size=layers - 1))
    sources = draw(st.sampled_from(((), indexer_sources_from_types(["F"] + pattern))))
    shard = draw(st.booleans()) if p > 1 and w == 1 else False  # vLLM's decode ownership
    return ParallelConfig(
        shard_decode_requests=shard,
        num_layers=layers, indexer_sources=sources,
        pcp_size=p, dcp_size=w, interleave_size=inter, max_model_len=max_model_len,
        gather_workspace_tokens=workspace, cudagraph_token_sizes=graphs,
        kv_cache_dtype=draw(st.sampled_from(("fp8_ds_mla", "bf16"))),
        activation_dtype=draw(st.sampled_from(("bfloat16", "float32"))),
        num_heads=draw(st.sampled_from((128, 16))) if not small_dims else 8,
    )


@st.composite
def steps(draw, max_requests: int = 300, max_context: int = 200_000,
          max_query: int = 20_000) -> StepInput:
    """A global batch of 0..max_requests requests: decodes (q 1..4, speculative) and prefills
    (short q, where the replicated rule lives, or long), contexts up to ``max_context``.

    A few requests (up to 12) are drawn element by element, so Hypothesis can shrink and hit
    edge values; the bulk comes from a seeded numpy generator whose size, decode share and
    length scales Hypothesis draws (drawing 300 requests one by one costs ~50 ms an example).
    """
    small_q = st.integers(1, 80)
    request = st.tuples(st.booleans(), st.integers(0, max_context),
                        st.one_of(small_q, st.integers(1, max_query)), st.integers(1, 4))
    head = draw(st.lists(request, max_size=min(12, max_requests)))
    c = [ctx for _, ctx, _, _ in head]
    q = [(qp if pre else qd) for pre, _, qp, qd in head]
    pre = [pre for pre, _, _, _ in head]
    n_bulk = draw(st.integers(0, max_requests - len(head)))
    decode_share = draw(st.sampled_from((0.0, 0.5, 0.9, 1.0)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bulk_pre = rng.random(n_bulk) >= decode_share
    bulk_c = _log_uniform(rng, n_bulk, max_context + 1) - 1
    bulk_c[rng.random(n_bulk) < 0.2] = 0  # fresh prompts
    long_q = _log_uniform(rng, n_bulk, max_query)
    short_q = rng.integers(1, 81, n_bulk)
    bulk_q = np.where(rng.random(n_bulk) < 0.5, short_q, long_q)
    decode_q = np.where(rng.random(n_bulk) < 0.8, 1, rng.integers(1, 5, n_bulk))
    bulk_q = np.where(bulk_pre, bulk_q, decode_q)
    order = draw(st.sampled_from(("head_first", "bulk_first")))
    parts = [(c, q, pre), (bulk_c.tolist(), bulk_q.tolist(), bulk_pre.tolist())]
    if order == "bulk_first":
        parts.reverse()
    c, q, pre = (parts[0][k] + parts[1][k] for k in range(3))
    n = len(q)
    # a third of the steps name their sampled rows (any subset: the planner does not judge)
    sampled = (rng.random(n) < 0.7).tolist() if draw(st.integers(0, 2)) == 0 else None
    return StepInput.build(draw(st.integers(0, 2**40)), [f"r{i}" for i in range(n)], c, q, pre,
                           sampled)


def _log_uniform(rng, n: int, high: int) -> np.ndarray:
    """int64 [n] in [1, high], log-uniformly distributed (short and long lengths alike)."""
    return np.minimum(np.exp(rng.uniform(0, np.log(high + 1), n)).astype(np.int64), high)
