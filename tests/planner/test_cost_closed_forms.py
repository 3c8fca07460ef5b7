"""The cost model's per-request closed forms (planner/cost.py) against a token walk written here:
every decode token at n = c+1 .. c+q, its keys counted one by one (issue 31 item 6)."""

import random

import numpy as np
import pytest

from cpplan import planner
from cpplan.planner import cost as cost_mod
from cpplan.schemas import ConfigError, ParallelConfig, StepInput, StepInputError
from cpplan.schemas.sharding import shard_count


def _walk_decode_keys(plan):
    """(attention, indexer) keys per DCP rank, token by token, Python ints."""
    cfg, w = plan.config, plan.config.dcp_size
    attn, index = [0] * w, [0] * w
    c, q = plan.num_computed_tokens.np(), plan.num_scheduled_tokens.np()
    for i in plan.row_request.np()[: plan.num_decode_rows]:
        for n in range(int(c[i]) + 1, int(c[i]) + int(q[i]) + 1):
            for r in range(w):
                local = int(shard_count(n, w, cfg.interleave_size, r))
                index[r] += local
                attn[r] += min(n, cfg.topk) * local // n
    return attn, index


def _cases(count):
    rng = random.Random(31)
    made = 0
    while made < count:
        p = rng.choice([1, 2, 4])
        w = rng.choice([1, 2, 3, 4, 8]) if p == 1 else p
        try:
            cfg = ParallelConfig(pcp_size=p, dcp_size=w, interleave_size=rng.choice([1, 2, 3, 64]),
                                 topk=rng.choice([1, 4, 64, 2048]), max_model_len=4096)
            n = rng.randint(1, 12)
            c = [rng.randint(0, 3000) for _ in range(n)]
            q = [min(rng.randint(1, 30), 4096 - x) for x in c]
            pre = [rng.random() < 0.3 for _ in range(n)]
            plan = planner.compile(cfg, StepInput.build(1, [f"r{k}" for k in range(n)], c, q, pre))
        except (ConfigError, StepInputError):
            continue
        made += 1
        yield plan


@pytest.mark.parametrize("plan", list(_cases(60)), ids=lambda p: f"P{p.config.pcp_size}"
                         f"W{p.config.dcp_size}I{p.config.interleave_size}k{p.config.topk}")
def test_decode_keys_equal_a_token_walk(plan):
    attn, index = cost_mod._decode_keys(plan, plan.config.topk)
    want_attn, want_index = _walk_decode_keys(plan)
    assert attn.tolist() == want_attn and index.tolist() == want_index


def test_past_walk_cap_the_estimate_stays_close(monkeypatch):
    # beyond MAX_WALKED_TOKENS a request's tokens past top-k take its last token's share:
    # the indexer keys stay exact, the attention keys within one key per token and rank
    cfg = ParallelConfig(dcp_size=4, interleave_size=2, topk=64, max_model_len=4096)
    plan = planner.compile(cfg, StepInput.build(1, ["a", "b"], [100, 2000], [300, 40],
                                                [False, False]))
    monkeypatch.setattr(cost_mod, "MAX_WALKED_TOKENS", 0)
    attn, index = cost_mod._decode_keys(plan, 64)
    want_attn, want_index = _walk_decode_keys(plan)
    assert index.tolist() == want_index
    assert np.abs(attn - np.array(want_attn)).max() <= (400 - 100) + 40  # tokens past top-k
