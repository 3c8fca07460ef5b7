"""W == 1 prefill tokens scored over a per-step copy of their requests' keys by the prefill
indexer (docs/design.md §5.4), against the single-device oracle on the CPU (ranks as threads),
and the copy's layout against a naive construction."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cpplan.planner.compile import compile as compile_plan
from cpplan.runtime.kernels import REFERENCE
from cpplan.runtime.segments import build_tables, local_prefill_keys
from cpplan.runtime.tables import StepTables, local_prefill_rows
from cpplan.schemas import StepInput
from cpplan.sim.replay import replay_plan
from cpplan.sim.simulate import TOLERANCE, SimOptions, preset_config

# decodes, a fresh prompt, a chunked prefill with history, a one-token prefill, a prefill long
# enough to be split over PCP ranks (head/tail chunks)
STEP = StepInput.build(5, ["a", "b", "c", "d", "e", "f"], [300, 0, 40, 129, 77, 0],
                       [1, 200, 33, 1, 1, 90], [False, True, True, False, True, True])


def _counting(calls: dict):
    def wrap(name):
        inner = getattr(REFERENCE, name)

        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return inner(*args, **kwargs)
        return call
    return dataclasses.replace(REFERENCE, **{n: wrap(n) for n in ("indexer_topk_prefill",
                                                                  "indexer_topk_decode")})


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("kv", ["fp8_ds_mla", "bf16"])
def test_gathered_prefill_keys_match_the_oracle(p, kv):
    plan = compile_plan(preset_config(SimOptions(pcp=p, dcp=1, kv_cache_dtype=kv, layers=2)),
                        STEP)
    calls: dict = {}
    result = replay_plan(plan, seed=3, kernels=_counting(calls))
    assert result.max_abs_err <= TOLERANCE
    # W == 1 has no gather chunks: the prefill indexer runs only over the gathered keys, the
    # decode indexer only for the decode rows
    assert calls.get("indexer_topk_prefill", 0) > 0 and calls.get("indexer_topk_decode", 0) > 0


@pytest.mark.parametrize("p,rank", [(1, 0), (2, 0), (2, 1)])
def test_local_prefill_rows_match_a_naive_layout(p, rank):
    """Region of request i = its largest key_len among this rank's prefill tokens, regions in
    request order; row l of a region is the request's token l, at the slot its block table
    gives; rows past the regions read the dummy slot."""
    cfg = preset_config(SimOptions(pcp=p, dcp=1, layers=1))
    plan = compile_plan(cfg, STEP)
    B, N = cfg.block_size, plan.num_requests
    rng = np.random.default_rng(p + rank)
    width = -(-int(plan.extent().max()) // B)
    bt = rng.permutation(np.arange(1, 1 + N * width)).reshape(N, width).astype(np.int64)
    rt = build_tables(plan, rank, 0, bt, 0)
    views = {k: torch.from_numpy(np.asarray(v)) for k, v in rt.params.items()}
    t = StepTables.expand(views, rt.meta, rt.layout)
    rows = local_prefill_keys(plan)
    src, pcu = local_prefill_rows(t, rt.meta, rt.layout, rows)
    nd, n = rt.meta.num_decode_tokens, rt.meta.num_tokens
    need = {}
    for j in range(nd, n):
        r, kl = int(t.token_req[j]), int(t.key_len[j])
        need[r] = max(need.get(r, 0), kl)
    want_src, start = [], {}
    for r in sorted(need):
        start[r] = len(want_src)
        want_src += [int(bt[r, pos // B]) * B + pos % B for pos in range(need[r])]
    assert rows >= len(want_src) and need
    want_src += [0] * (rows - len(want_src))
    assert src.tolist() == want_src
    assert pcu.tolist() == [start[int(t.token_req[j])] for j in range(nd, n)]
