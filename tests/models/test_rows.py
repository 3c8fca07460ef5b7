"""cpplan/models/rows.py's token ids of a rank's rows against a row-by-row walk of the plan's
token view, over random steps (prefill chunks, decodes, a speculative row) and PCP ranks."""

import types

import numpy as np
import pytest
import torch

from cpplan.models.rows import rank_token_ids
from cpplan.planner import compile as compile_plan
from cpplan.runtime.tokens import host_tokens
from cpplan.schemas import ParallelConfig, StepInput
from cpplan.schemas.errors import TensorArgError


def _bound(plan, pcp_rank: int):
    """The parts of a bound step rank_token_ids may read: the host rows and the plan (no
    device tables: reading ``tokens`` would expand them, which a graph step must not)."""
    return types.SimpleNamespace(host_tokens=host_tokens(plan, pcp_rank), plan=plan)


def _walk(bound, sequences) -> list[int]:
    request, position, _ = bound.host_tokens
    return [sequences[r][p] if r >= 0 else 0 for r, p in zip(request, position)]


@pytest.mark.parametrize("p_size,w_size", [(1, 1), (2, 1), (3, 3)])
def test_token_ids_equal_a_walk_of_the_rows(p_size, w_size):
    cfg = ParallelConfig(pcp_size=p_size, dcp_size=w_size, num_heads=8, topk=64,
                         index_num_heads=4, max_model_len=4096, block_size=64,
                         activation_dtype="float32", num_layers=1, hidden_size=256,
                         cudagraph_token_sizes=(8, 16))
    rng = np.random.default_rng(p_size * 10 + w_size)
    for seed in range(12):
        n = int(rng.integers(1, 9))
        pre = rng.random(n) < 0.5
        c = rng.integers(0, 900, n)
        q = np.where(pre, rng.integers(1, 300, n), rng.integers(1, 3, n))
        step = StepInput.build(seed, [f"r{k}" for k in range(n)], c, q, pre)
        plan = compile_plan(cfg, step)
        sequences = [rng.integers(0, 50_000, int(c[i] + q[i])).tolist() for i in range(n)]
        for rank in range(p_size):
            bound = _bound(plan, rank)
            got = rank_token_ids(bound, sequences, device="cpu")
            assert got.dtype == torch.int64 and got.tolist() == _walk(bound, sequences)


def test_a_sequence_shorter_than_its_scheduled_positions_is_named():
    cfg = ParallelConfig(pcp_size=1, dcp_size=1, num_heads=8, topk=64, index_num_heads=4,
                         max_model_len=4096, block_size=64, activation_dtype="float32",
                         num_layers=1, hidden_size=256)
    plan = compile_plan(cfg, StepInput.build(4, ["a", "b"], [0, 10], [5, 1], [True, False]))
    with pytest.raises(TensorArgError, match="step 4: request 1 has 10 tokens; expected at "
                                             "least 11"):
        rank_token_ids(_bound(plan, 0), [[1] * 5, [2] * 10], device="cpu")
