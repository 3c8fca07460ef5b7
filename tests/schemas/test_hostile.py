"""Hostile input at the schemas boundary: configs and steps refuse wrong types and sizes at
construction, decoding refuses checksum-valid but inconsistent plans, input files must be
regular and small, outputs never replace a symlink or device (docs/failures.md)."""

import errno
import os
import stat
import tempfile
from pathlib import Path

import msgspec
import numpy as np
import pytest

from cpplan.planner import compile as compile_plan
from cpplan.schemas import (
    ConfigError,
    InputFileError,
    OutputError,
    ParallelConfig,
    PlanFormatError,
    StepInput,
    StepInputError,
    decode_config,
    decode_plan,
    decode_step,
    encode_config_json,
    encode_plan,
    encode_step_json,
)
from cpplan.schemas.codec import decode_json_object
from cpplan.schemas.files import read_input, write_atomic
from tests.cli.inprocess import payload_of, reseal
from tests.schemas.factories import make_plan

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "v2"


# ---------------------------------------------------------------- configs
@pytest.mark.parametrize("kwargs, words", [
    (dict(pcp_size=2.5), "pcp_size must be an integer: got float 2.5"),
    (dict(pcp_size=True), "pcp_size must be an integer: got bool True"),
    (dict(max_model_len="1000"), "max_model_len must be an integer: got str '1000'"),
    (dict(kv_cache_dtype="fp16"), "kv_cache_dtype must be one of fp8_ds_mla, bf16: got 'fp16'"),
    (dict(activation_dtype="int8"), "activation_dtype must be one of"),
    (dict(pcp_size=2**63), "pcp_size must be <= 2147483647: got 9223372036854775808"),
    (dict(pcp_size=2048, dcp_size=1), "pcp_size must be <= 1024: got 2048"),
    (dict(cudagraph_token_sizes=(16, 2**40)), "cudagraph_token_sizes must be in [1, 2147483647]"),
    (dict(cudagraph_token_sizes=(16, True)), "cudagraph_token_sizes must hold integers only"),
    (dict(cudagraph_token_sizes=(16, 8)), "strictly increasing: got [16, 8]"),
    (dict(cudagraph_token_sizes=(8, 8)), "strictly increasing: got [8, 8]"),
    (dict(cudagraph_token_sizes=(0, 8)), "cudagraph_token_sizes must be in [1, 2147483647]"),
    (dict(topk=0), "topk must be positive: got 0"),
    (dict(num_heads=-3), "num_heads must be positive: got -3"),
    (dict(cudagraph_token_sizes="16"), "cudagraph_token_sizes must be a tuple of integers"),
    (dict(gather_workspace_tokens=-1), "gather_workspace_tokens must be >= 0: got -1"),
    (dict(dcp_size=4, max_model_len=2**31 - 1), "gather_workspace_tokens (dcp_size"),
])
def test_config_types_enums_and_bounds(kwargs, words):
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**kwargs)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_config_normalises_numpy_ints_and_lists():
    config = ParallelConfig(pcp_size=np.int64(2), cudagraph_token_sizes=[8, np.int32(16)])
    assert type(config.pcp_size) is int and config.cudagraph_token_sizes == (8, 16)
    assert decode_config(encode_config_json(config)) == config


# ---------------------------------------------------------------- steps
@pytest.mark.parametrize("args, words", [
    ((1, ["a"], [0], [1.5], [True]), "num_scheduled_tokens must hold integers: got float 1.5"),
    ((1, ["a"], [0], [1], ["false"]), "is_prefilling must hold bools (or 0/1 integers): got str"),
    ((1, ["a"], [0], [True], [True]), "num_scheduled_tokens must hold integers: got bool True"),
    ((1, ["a"], [0], np.array([1.0]), [True]), "must have an integer dtype: got float64"),
    ((1, ["a"], [0], [2**40], [True]), "within int32"),
    ((1, ["a"], [0], [2**70], [True]), "beyond int64"),
    ((1, ["a"], [0], [1], np.array([2], np.uint8)), "is_prefilling must be bools"),
    (("7", ["a"], [0], [1], [True]), "step_id must be an integer in [0, "),
    ((True, ["a"], [0], [1], [True]), "step_id must be an integer"),
    ((-1, ["a"], [0], [1], [True]), "step_id must be an integer"),
    ((1, [3], [0], [1], [True]), "req_ids[0] of step 1 must be a str: got int 3"),
    ((1, "ab", [0, 0], [1, 1], [True, True]), "req_ids must be a sequence of str"),
    ((1, ["a"], [[0]], [1], [True]), "must hold integers: got list"),
    ((1, ["a"], np.zeros((1, 1), int), [1], [True]), "one-dimensional"),
])
def test_step_build_refuses_coercion(args, words):
    with pytest.raises(StepInputError) as info:
        StepInput.build(*args)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_step_build_keeps_valid_forms():
    a = StepInput.build(np.int64(4), ("x", "y"), np.array([0, 5], np.int32), [1, 2], [1, False])
    b = StepInput.build(4, ["x", "y"], [0, 5], np.array([1, 2]), np.array([True, False]))
    assert a == b and a.step_id == 4 and a.is_prefilling.np().tolist() == [1, 0]


def test_compile_argument_types():
    step = StepInput.build(1, ["a"], [0], [1], [False])
    with pytest.raises(ConfigError, match="config must be a ParallelConfig: got dict"):
        compile_plan({"pcp_size": 1}, step)
    with pytest.raises(StepInputError, match="step must be a StepInput: got tuple"):
        compile_plan(ParallelConfig(), (1, ["a"]))


def test_step_id_and_req_ids_checked_on_direct_construction():
    good = StepInput.build(1, ["a"], [0], [1], [False])
    with pytest.raises(StepInputError, match="step_id must be an integer"):
        msgspec.structs.replace(good, step_id="1")
    with pytest.raises(StepInputError, match=r"req_ids\[0\] of step 1 must be a str"):
        msgspec.structs.replace(good, req_ids=(1,))


# ---------------------------------------------------------------- inconsistent plans
def _golden(name="mixed_p2w2"):
    return (GOLDEN / f"{name}.msgpack").read_bytes()


def _arr_set(arr, index, value):
    """An Array payload ([dtype, shape, data]) with element ``index`` replaced."""
    dtype, shape, data = arr
    values = np.frombuffer(data, np.dtype(dtype)).copy()
    values[index] = value
    return [dtype, shape, values.tobytes()]


MUTATIONS = {
    "mode out of range": lambda p: p.update(mode=_arr_set(p["mode"], 0, 7)),
    "row past the requests": lambda p: p.update(
        row_request=_arr_set(p["row_request"], -1, len(p["req_ids"]) + 5)),
    "negative T": lambda p: p.update(padded_num_tokens=-4),
    "2**40 T": lambda p: p.update(padded_num_tokens=2**40),
    "T below the tokens": lambda p: p.update(padded_num_tokens=1),
    "chunk of 2G rows": lambda p: p["gather_chunks"][0].update(
        padded_local_total=2**31 - 1, total=2**31 - 1),
    "chunk past int64": lambda p: p["gather_chunks"][0].update(total=2**64 - 1),
    "array shape lies": lambda p: p.update(
        row_num_tokens=[p["row_num_tokens"][0], [p["row_num_tokens"][1][0] + 1, 0], b""]),
    "num_tokens length": lambda p: p.update(num_tokens=p["num_tokens"][:1]),
    "huge world": lambda p: p["config"].update(pcp_size=2**40),
    "wrong dtype": lambda p: p.update(mode=["<i8", p["mode"][1], p["mode"][2] * 8]),
    "collective shape": lambda p: p["collectives"][0].update(shape=[2**40, 656]),
    "collective bytes": lambda p: p["collectives"][0].update(bytes=1),
    "collective name markup": lambda p: p["collectives"][0].update(name="[/]"),
    "step_id string": lambda p: p.update(step_id="7"),
    "negative computed": lambda p: p.update(
        num_computed_tokens=_arr_set(p["num_computed_tokens"], 0, -1)),
    "row offset": lambda p: p.update(
        row_query_offset=_arr_set(p["row_query_offset"], -1, 2**31 - 1)),
    "extra chunk": lambda p: p.update(gather_chunks=p["gather_chunks"] * 2),
    "decode rows": lambda p: p.update(num_decode_rows=10**6),
    "kv write": lambda p: p.update(row_kv_write=_arr_set(p["row_kv_write"], 0, 9)),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_checksum_valid_inconsistent_plan_is_refused(name):
    payload = payload_of(_golden())
    MUTATIONS[name](payload)
    data = reseal(payload)
    with pytest.raises(PlanFormatError) as info:
        decode_plan(data)
    assert "\n" not in str(info.value)


def test_resealed_unchanged_payload_still_decodes():
    assert decode_plan(reseal(payload_of(_golden()))) == decode_plan(_golden())


@pytest.mark.parametrize("name", sorted(p.name[:-8] for p in GOLDEN.glob("*.msgpack")))
def test_every_golden_plan_passes_the_invariants(name):
    decode_plan(_golden(name))


@pytest.mark.parametrize("seed", range(6))
def test_compiled_and_factory_plans_pass_the_invariants(seed):
    rng = np.random.default_rng(seed)
    p = int(rng.choice([1, 2, 3, 4]))
    w = int(rng.choice([1, p]))
    config = ParallelConfig(pcp_size=p, dcp_size=w, interleave_size=int(rng.choice([1, 2, 8])),
                            max_model_len=5000, cudagraph_token_sizes=(64, 256),
                            gather_workspace_tokens=int(rng.choice([0, 20000])))
    n = int(rng.integers(0, 60))
    q = rng.integers(1, 300, n)
    step = StepInput.build(seed, [f"r{i}" for i in range(n)], rng.integers(0, 4000, n), q,
                           rng.integers(0, 2, n).astype(bool))
    plan = compile_plan(config, step)
    assert decode_plan(encode_plan(plan)) == plan
    factory = make_plan(seed, num_requests=seed * 11)
    assert decode_plan(encode_plan(factory)) == factory


# ---------------------------------------------------------------- JSON
def test_json_bom_accepted_duplicate_keys_refused():
    step = StepInput.build(2, ["a"], [0], [3], [True])
    text = encode_step_json(step)
    assert decode_step(b"\xef\xbb\xbf" + text) == step
    config = ParallelConfig(pcp_size=2)
    assert decode_config(b"\xef\xbb\xbf" + encode_config_json(config)) == config
    with pytest.raises(PlanFormatError, match="key 'pcp_size' given twice"):
        decode_config(b'{"pcp_size": 2, "pcp_size": 4}')
    with pytest.raises(PlanFormatError, match="key 'req_id' given twice"):
        decode_step(b'{"step_id": 1, "requests": [{"req_id": "a", "req_id": "b", '
                    b'"num_computed_tokens": 0, "num_scheduled_tokens": 1, '
                    b'"is_prefilling": false}]}')
    with pytest.raises(PlanFormatError, match="invalid replay.json JSON"):
        decode_json_object(b"[1, 2]", "replay.json")


# ---------------------------------------------------------------- input files
def test_read_input_refuses_special_and_large_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputFileError, match="it is a FIFO; expected a regular file"):
        read_input(fifo)  # returns at once: the open does not block on a FIFO
    with pytest.raises(InputFileError, match="/dev/zero: it is a device"):
        read_input("/dev/zero")
    with pytest.raises(InputFileError, match="it is a folder"):
        read_input(tmp_path)
    with pytest.raises(InputFileError, match="No such file or directory"):
        read_input(tmp_path / "missing")
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(300 * 2**20)  # sparse: refused by its size, before a byte is read
    with pytest.raises(InputFileError, match="file too large: got 314,572,800 bytes"):
        read_input(big)
    small = tmp_path / "small"
    small.write_bytes(b"x" * 100)
    assert read_input(small) == b"x" * 100
    with pytest.raises(InputFileError, match="file too large"):
        read_input(small, max_bytes=99)


# ---------------------------------------------------------------- outputs
def test_write_atomic_replaces_only_regular_files(tmp_path):
    target = tmp_path / "out.bin"
    write_atomic(target, b"one")
    write_atomic(target, b"two")
    assert target.read_bytes() == b"two"
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~mask  # not mkstemp's 0600
    link = tmp_path / "link"
    link.symlink_to(target)
    for path, words in ((link, "it is a symlink"), ("/dev/null", "it is a device"),
                        (tmp_path, "it is a folder"),
                        (tmp_path / "no" / "x", "folder"),
                        (tmp_path / ("n" * 300), "File name too long")):
        with pytest.raises(OutputError) as info:
            write_atomic(path, b"x")
        assert words in str(info.value) and str(path) in str(info.value)
        assert ".tmp" not in str(info.value) and "\n" not in str(info.value)
    assert link.is_symlink() and target.read_bytes() == b"two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "out.bin"]


def test_write_atomic_full_disk_names_target_and_leaves_nothing(tmp_path, full_disk):
    with pytest.raises(OutputError, match=r"cannot write .*out\.bin: No space left on device"):
        write_atomic(tmp_path / "out.bin", b"data")
    assert list(tmp_path.iterdir()) == []


def test_write_atomic_read_only_folder(tmp_path, monkeypatch):
    def denied(**kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(OutputError, match=r"cannot write .*x\.msgpack: Permission denied"):
        write_atomic(tmp_path / "x.msgpack", b"data")
