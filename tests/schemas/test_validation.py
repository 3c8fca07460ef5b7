"""Configs and steps refuse bad values with a typed, one-line error naming the rule."""

import pytest

from cpplan.schemas import ConfigError, ParallelConfig, StepInput, StepInputError, shard_rows


def naive_shard_rows(extent, w, i):
    """Count the tokens owned by DCP rank 0, token by token (docs/design.md §3.4)."""
    return sum(1 for t in range(extent) if (t // i) % w == 0)


@pytest.mark.parametrize("w", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("i", [1, 2, 64])
def test_shard_rows_matches_token_count(w, i):
    for extent in list(range(0, 300)) + [1000, 4097, 8191]:
        assert shard_rows(extent, w, i) == naive_shard_rows(extent, w, i)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(pcp_size=2, dcp_size=3), "unsupported topology pcp_size=2 dcp_size=3"),
        (dict(pcp_size=4, dcp_size=2), "unsupported topology"),
        (dict(interleave_size=3), "block_size % interleave_size"),
        (dict(pcp_size=0), "pcp_size must be positive: got 0"),
        (dict(topk=-1), "topk must be positive"),
        (dict(cudagraph_token_sizes=(16, 8)), "strictly increasing"),
        (dict(dcp_size=2, max_model_len=1000, gather_workspace_tokens=999),
         "gather_workspace_tokens must be >= dcp_size * shard_rows(max_model_len) = 1000: got 999"),
    ],
)
def test_config_rules(kwargs, words):
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**kwargs)
    assert words in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("p, w", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 3), (8, 8), (5, 1)])
def test_supported_topologies(p, w):
    assert ParallelConfig(pcp_size=p, dcp_size=w).world_size == max(p, w)


CONFIG = ParallelConfig(max_model_len=1000)


@pytest.mark.parametrize(
    "c, q, words",
    [
        ([0, -1], [1, 1], "request 1 ('b') of step 7: num_computed_tokens must be >= 0: got -1"),
        ([0, 0], [1, 0], "request 1 ('b') of step 7: num_scheduled_tokens must be >= 1: got 0"),
        ([999, 0], [2, 1], "request 0 ('a') of step 7: extent"),
    ],
)
def test_step_rules(c, q, words):
    step = StepInput.build(7, ["a", "b"], c, q, [True, True])
    with pytest.raises(StepInputError) as info:
        step.validate(CONFIG)
    assert words in str(info.value)


def test_duplicate_req_ids_named():
    step = StepInput.build(7, ["a", "b", "a"], [0, 0, 0], [1, 1, 1], [False] * 3)
    with pytest.raises(StepInputError, match=r"request 2 \('a'\) of step 7: req_id must be unique"):
        step.validate(CONFIG)


def test_column_shape_mismatch_is_a_step_error():
    good = StepInput.build(1, ["a"], [0], [1], [False])
    with pytest.raises(StepInputError, match="shape"):
        StepInput(step_id=1, req_ids=("a", "b"), num_computed_tokens=good.num_computed_tokens,
                  num_scheduled_tokens=good.num_scheduled_tokens,
                  is_prefilling=good.is_prefilling)


@pytest.mark.parametrize("c, q", [(2**32 + 5, 2**63 - 2**32), (2**63 - 1, 1), (0, 2**63 - 1)])
def test_int64_columns_cannot_wrap_the_extent(c, q):
    """A StepInput built directly (not through ``build``, which keeps columns in int32) may hold
    int64 counts; c + q once wrapped below max_model_len and compiled into a garbage plan. The
    extent is reported exactly (Python ints), not wrapped."""
    from cpplan.schemas.arrays import Array

    step = StepInput(step_id=1, req_ids=("a",), num_computed_tokens=Array.of([c], "<i8"),
                     num_scheduled_tokens=Array.of([q], "<i8"),
                     is_prefilling=Array.of([1], "|u1"))
    with pytest.raises(StepInputError, match=f"request 0 \\('a'\\) of step 1: extent .* <= "
                                             f"max_model_len 1000: got {c + q}$"):
        step.validate(CONFIG)
