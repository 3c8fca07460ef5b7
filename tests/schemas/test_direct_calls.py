"""The codec and file helpers called directly with the wrong types, odd paths and old versions:
each failure is the project's own error in one line (docs/design.md §6.7, §6.10), and a
replaced file keeps its permission bits."""

import os
import stat

import pytest

from cpplan.schemas import (
    SCHEMA_VERSION,
    InputFileError,
    OutputError,
    PlanFormatError,
    SchemaVersionError,
    codec,
    decode_config,
    decode_plan,
    decode_step,
    encode_plan,
)
from cpplan.schemas.files import check_output_target, read_input, write_atomic
from tests.cli.inprocess import payload_of, reseal
from tests.schemas.factories import make_plan


def _one_line(info, *words):
    text = str(info.value)
    assert "\n" not in text and all(w in text for w in words), text


@pytest.mark.parametrize("call", [
    lambda: codec.read_envelope("x" * 40),
    lambda: codec.read_envelope(None),
    lambda: codec.read_envelope(40),
    lambda: decode_plan("x" * 40),
    lambda: decode_step(None),
    lambda: decode_config(3),
])
def test_decoders_refuse_what_is_not_bytes(call):
    with pytest.raises(PlanFormatError) as info:
        call()
    _one_line(info, "expected the bytes of a cpplan file: got")


@pytest.mark.parametrize("data, got", [('{"seed": 1}', "str"), (None, "NoneType"), (7, "int"),
                                       ([b"{}"], "list")])
def test_decode_json_object_refuses_what_is_not_bytes(data, got):
    with pytest.raises(PlanFormatError) as info:
        codec.decode_json_object(data, "replay.json")
    _one_line(info, f"expected the bytes of replay.json (JSON): got {got}")
    assert codec.decode_json_object(b'{"seed": 1}', "replay.json") == {"seed": 1}


@pytest.mark.parametrize("version", [0, -1, -(2**63)])
def test_schema_versions_below_one_are_refused(monkeypatch, version):
    payload = payload_of(encode_plan(make_plan(3)))
    monkeypatch.setattr(codec, "SCHEMA_VERSION", version)
    data = reseal(payload)
    monkeypatch.undo()
    for decode in (decode_plan, codec.read_envelope):
        with pytest.raises(PlanFormatError) as info:
            decode(data)
        assert not isinstance(info.value, SchemaVersionError)
        _one_line(info, f"invalid schema version: got {version}, expected 1 to {SCHEMA_VERSION}")


def test_a_newer_file_says_what_kind_it_is(monkeypatch):
    payload = payload_of(encode_plan(make_plan(3)))
    monkeypatch.setattr(codec, "SCHEMA_VERSION", 5)
    data = reseal(payload)
    monkeypatch.undo()
    with pytest.raises(SchemaVersionError) as info:
        decode_plan(data)
    _one_line(info, "a plan file written by schema version 5", "upgrade cpplan")


def test_file_kind_probes_without_raising():
    data = encode_plan(make_plan(2))
    assert codec.file_kind(data) == codec.KIND_PLAN
    for junk in (b"", b"{}", data[:20], None, "text", 5):
        assert codec.file_kind(junk) is None


# ---------------------------------------------------------------- paths
@pytest.mark.parametrize("path, words", [
    ("a\x00b", "a file path cannot hold a NUL byte"),
    (b"a\x00b", "a file path cannot hold a NUL byte"),
    (None, "cannot read: expected a file path (str, bytes or os.PathLike): got NoneType"),
    (3.5, "cannot read: expected a file path (str, bytes or os.PathLike): got float"),
])
def test_read_input_odd_paths(path, words):
    with pytest.raises(InputFileError) as info:
        read_input(path)
    _one_line(info, words)


@pytest.mark.parametrize("path, words", [
    ("a\x00b", "a file path cannot hold a NUL byte"),
    (None, "cannot write: expected a file path (str, bytes or os.PathLike): got NoneType"),
    (7, "cannot write: expected a file path (str, bytes or os.PathLike): got int"),
])
def test_write_atomic_odd_paths(tmp_path, path, words):
    with pytest.raises(OutputError) as info:
        write_atomic(path, b"")
    _one_line(info, words)
    assert list(tmp_path.iterdir()) == []


def test_write_atomic_takes_bytes_paths_and_refuses_non_bytes_data(tmp_path):
    target = tmp_path / "out.bin"
    write_atomic(os.fsencode(target), b"data")
    assert target.read_bytes() == b"data"
    assert read_input(os.fsencode(target)) == b"data"
    with pytest.raises(OutputError) as info:
        write_atomic(target, "text")
    _one_line(info, str(target), "expected bytes: got str")
    assert target.read_bytes() == b"data" and sorted(tmp_path.iterdir()) == [target]


def test_long_multibyte_names_are_written(tmp_path):
    """A 252-byte name of 4-byte characters (within NAME_MAX): the temp file's name is cut by
    bytes, not characters, and never mid-character."""
    target = tmp_path / ("\U0001f600" * 63)
    assert len(os.fsencode(target.name)) == 252
    write_atomic(target, b"x")
    assert target.read_bytes() == b"x" and sorted(tmp_path.iterdir()) == [target]
    with pytest.raises(OutputError) as info:  # one byte too many: the rename's own error
        write_atomic(tmp_path / ("\U0001f600" * 64), b"x")
    _one_line(info, "File name too long")
    assert sorted(tmp_path.iterdir()) == [target]


def test_temp_name_is_cut_on_a_character_boundary(tmp_path, monkeypatch):
    import tempfile

    seen = []
    real = tempfile.mkstemp

    def spy(**kwargs):
        seen.append(kwargs["prefix"])
        return real(**kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", spy)
    write_atomic(tmp_path / ("\u00e9" * 100), b"x")  # 2-byte characters: 64 bytes = 32 of them
    assert seen == ["." + "\u00e9" * 32 + "."]
    write_atomic(tmp_path / ("a" + "\u65e5" * 60), b"x")  # 1 + 3k bytes: 21 fit in 63
    assert seen[1] == ".a" + "\u65e5" * 21 + "."


# ---------------------------------------------------------------- modes and inputs
@pytest.mark.parametrize("mode", [0o600, 0o640, 0o755, 0o444])
def test_replacing_a_file_keeps_its_mode(tmp_path, mode):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    os.chmod(target, mode)
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == mode


def test_replacing_a_hard_linked_file_leaves_the_other_name(tmp_path):
    """Documented: the replace is a rename, so another name of the old file keeps it."""
    target, other = tmp_path / "out.bin", tmp_path / "other.bin"
    target.write_bytes(b"old")
    os.link(target, other)
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new" and other.read_bytes() == b"old"


def test_an_input_is_never_the_output(tmp_path):
    step = tmp_path / "step.json"
    step.write_bytes(b"{}")
    alias = tmp_path / "alias.json"
    os.link(step, alias)
    for out, inputs in ((step, [step]), (alias, ["x", step]), (tmp_path / "." / "step.json",
                                                                [str(step)])):
        with pytest.raises(OutputError) as info:
            write_atomic(out, b"plan", inputs=inputs)
        _one_line(info, f"refusing to replace {out}: it is an input")
        with pytest.raises(OutputError):
            check_output_target(out, inputs)
    assert step.read_bytes() == b"{}"
    write_atomic(tmp_path / "new.bin", b"x", inputs=[step, None, tmp_path / "missing"])
    assert (tmp_path / "new.bin").read_bytes() == b"x"
