"""Decoding untrusted bytes raises only PlanFormatError (or SchemaVersionError).

A seeded loop of mutated, truncated and random inputs, plus hypothesis-generated structured
garbage (valid msgpack of the wrong shape). Every mutated file that still parses as msgpack must
be rejected by the checksum.
"""

import msgspec
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from cpplan.schemas import PlanFormatError, codec, decode_config, decode_plan, decode_step, encode_plan
from tests.lane import examples
from tests.schemas.factories import make_plan

NUM_FUZZ_CASES = 20_000
DECODERS = (decode_plan, decode_step, decode_config)


def _decode_all_ways(data: bytes) -> list[Exception]:
    """Run every decoder; return what they raised. Anything not PlanFormatError fails."""
    raised = []
    for decode in DECODERS:
        try:
            decode(data)
        except PlanFormatError as exc:
            assert "\n" not in str(exc), str(exc)
            raised.append(exc)
    return raised


def _mutate(rng: np.random.Generator, data: bytes) -> bytes:
    buf = bytearray(data)
    kind = rng.integers(6)
    if kind == 0:  # flip bits
        for _ in range(rng.integers(1, 4)):
            buf[rng.integers(len(buf))] ^= 1 << int(rng.integers(8))
    elif kind == 1:  # truncate
        buf = buf[: rng.integers(len(buf))]
    elif kind == 2:  # random bytes
        buf = bytearray(rng.bytes(int(rng.integers(0, 300))))
    elif kind == 3:  # overwrite a run with 0xff (huge lengths, invalid UTF-8)
        start = rng.integers(len(buf))
        buf[start:start + 4] = b"\xff\xff\xff\xff"
    elif kind == 4:  # splice: insert random bytes
        at = rng.integers(len(buf))
        buf[at:at] = rng.bytes(int(rng.integers(1, 8)))
    else:  # byte replaced by a msgpack container header claiming 2**32 - 1 items
        at = rng.integers(len(buf))
        buf[at:at + 1] = b"\xdd\xff\xff\xff\xff"
    return bytes(buf)


def test_seeded_mutation_loop():
    rng = np.random.default_rng(20261129)
    corpus = [encode_plan(make_plan(s, num_requests=int(n))) for s, n in enumerate([0, 3, 40])]
    rejected_by_checksum = parsed = 0
    for case in range(NUM_FUZZ_CASES):
        original = corpus[case % len(corpus)]
        data = _mutate(rng, original)
        if data == original:
            continue
        body_ok = len(data) > 16
        if body_ok:
            try:
                msgspec.msgpack.decode(data[:-16])
                parsed += 1
            except (msgspec.DecodeError, UnicodeDecodeError):
                body_ok = False
        # decode_plan must refuse every mutated plan file, without exception to that rule
        with pytest.raises(PlanFormatError) as info:
            decode_plan(data)
        if body_ok and "checksum" in str(info.value):
            rejected_by_checksum += 1
        if case % 10 == 0:
            _decode_all_ways(data)
    # every mutated file that still parses is rejected by the checksum
    assert rejected_by_checksum == parsed
    assert parsed > 1_000  # the loop exercised the parse-but-wrong path, not just garbage


def _with_checksum(body: bytes) -> bytes:
    return body + xxhash.xxh3_128_digest(body)


garbage = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70).filter(lambda x: -2**63 <= x < 2**64)
    | st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.text(max_size=8), children, max_size=6),
    max_leaves=30,
)


@settings(max_examples=examples(400, quick=50))
@given(garbage)
def test_structured_garbage_with_valid_checksum(obj):
    """Valid msgpack (even with a correct checksum) of the wrong shape is a PlanFormatError."""
    body = msgspec.msgpack.encode(obj)
    assert len(_decode_all_ways(_with_checksum(body))) == len(DECODERS)
    _decode_all_ways(body)
    _decode_all_ways(msgspec.json.encode(obj))


@settings(max_examples=examples(200, quick=30))
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), garbage)
def test_wrong_payload_inside_a_valid_envelope(kinds, obj):
    payload = msgspec.msgpack.encode(obj)
    for k in kinds:
        kind = (codec.KIND_PLAN, codec.KIND_STEP, codec.KIND_CONFIG, "other", "", "cpplan.plan ")[k]
        env = codec.Envelope(kind, 1, "0", "", payload, xxhash.xxh3_128_digest(payload))
        # only the decoder of the envelope's own kind may accept it (an empty config map is a
        # valid all-defaults config); the others must refuse with PlanFormatError
        assert len(_decode_all_ways(_with_checksum(msgspec.msgpack.encode(env)))) >= 2


def test_deep_nesting_and_huge_lengths():
    deep = b"\x91" * 100_000 + b"\xc0"
    huge_array = b"\xdd\xff\xff\xff\xff"
    huge_bin = b"\xc6\xff\xff\xff\xff" + b"x" * 10
    bad_utf8 = b"\xa2\xff\xfe"
    for body in (deep, huge_array, huge_bin, bad_utf8):
        assert len(_decode_all_ways(_with_checksum(body))) == 3
        _decode_all_ways(body)
    deep_json = b"[" * 100_000 + b"]" * 100_000
    _decode_all_ways(deep_json)


def test_size_cap_enforced_before_decoding():
    data = encode_plan(make_plan(1))
    with pytest.raises(PlanFormatError, match="file too large"):
        decode_plan(data, max_bytes=len(data) - 1)


def test_newer_schema_version_is_its_own_error():
    plan = make_plan(2)
    payload = codec.plan_payload(plan)
    env = codec.Envelope(codec.KIND_PLAN, codec.SCHEMA_VERSION + 1, "9.9.9",
                         codec.config_fingerprint(plan.config), payload,
                         xxhash.xxh3_128_digest(payload))
    with pytest.raises(codec.SchemaVersionError, match=f"schema version {codec.SCHEMA_VERSION + 1}"):
        decode_plan(_with_checksum(msgspec.msgpack.encode(env)))


def test_wrong_kind_named():
    from cpplan.schemas import encode_config

    data = encode_config(make_plan(0).config)
    with pytest.raises(PlanFormatError, match="wrong kind of file: got 'cpplan.config', expected "
                                              "'cpplan.plan'"):
        decode_plan(data)
