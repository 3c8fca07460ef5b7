"""Every struct survives encode -> decode unchanged, in each of its encodings."""

import msgspec
import numpy as np
import pytest

from cpplan.schemas import (
    Array,
    ParallelConfig,
    codec,
    decode_config,
    decode_plan,
    decode_step,
    digest,
    encode_config,
    encode_config_json,
    encode_plan,
    encode_step,
    encode_step_json,
)
from tests.schemas.factories import make_config, make_plan, make_step


@pytest.mark.parametrize("seed", range(8))
def test_plan_round_trip(seed):
    plan = make_plan(seed, num_requests=seed * 7)
    back = decode_plan(encode_plan(plan))
    assert back == plan
    assert digest(back) == digest(plan)
    assert encode_plan(back) == encode_plan(plan)


@pytest.mark.parametrize("seed", range(8))
def test_step_round_trip_json_msgpack_and_bare(seed):
    step = make_step(np.random.default_rng(seed), num_requests=seed * 5)
    assert decode_step(encode_step_json(step)) == step
    assert decode_step(encode_step(step)) == step
    bare = msgspec.msgpack.encode(msgspec.json.decode(encode_step_json(step)))
    assert decode_step(bare) == step


@pytest.mark.parametrize("seed", range(8))
def test_config_round_trip(seed):
    config = make_config(np.random.default_rng(seed))
    assert decode_config(encode_config(config)) == config
    assert decode_config(encode_config_json(config)) == config


def test_array_round_trip_is_read_only_view():
    values = np.arange(12, dtype=np.int64).reshape(3, 4)
    arr = Array.of(values, "<i8")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(arr), type=Array)
    np.testing.assert_array_equal(back.np(), values)
    assert not back.np().flags.writeable


def test_gather_chunk_and_collective_round_trip():
    plan = make_plan(3, num_requests=20)
    for obj in (*plan.gather_chunks, *plan.collectives):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(obj), type=type(obj)) == obj


def test_step_json_is_the_design_form():
    step = decode_step(
        b'{"step_id": 17, "requests": [\n'
        b' {"req_id": "r0", "num_computed_tokens": 500, "num_scheduled_tokens": 1,'
        b' "is_prefilling": false},\n'
        b' {"req_id": "r1", "num_computed_tokens": 100, "num_scheduled_tokens": 64,'
        b' "is_prefilling": true}]}'
    )
    assert step.step_id == 17 and step.req_ids == ("r0", "r1")
    assert step.num_computed_tokens.np().tolist() == [500, 100]
    assert step.num_scheduled_tokens.np().tolist() == [1, 64]
    assert step.is_prefilling.np().tolist() == [0, 1]


def test_same_plan_same_file_bytes_and_envelope_fields():
    plan = make_plan(5)
    data = encode_plan(plan)
    env = codec.read_envelope(data)
    assert env.kind == codec.KIND_PLAN and env.schema_version == codec.SCHEMA_VERSION
    assert env.digest == digest(plan)
    assert env.config_fingerprint == codec.config_fingerprint(plan.config)
    assert len(env.digest) == 16
    assert data == encode_plan(make_plan(5))


def test_default_config_resolves_workspace_minimum():
    config = ParallelConfig(pcp_size=4, dcp_size=4, max_model_len=1000)
    assert config.gather_workspace_tokens == 4 * 250
    assert decode_config(encode_config_json(config)) == config
