"""The CLI's edges an audit found loose (docs/design.md §6.10): flags that would be silently
ignored, outputs over the command's own inputs, file versions, unencodable output, missing
optional packages, and error lines that name their file. In-process (cpplan.cli.main), fast."""

import contextlib
import io
import json
import os
import stat
import sys

import msgspec
import pytest
import xxhash

import cpplan.cli.plan_cmd as plan_cmd
from cpplan.cli import main
from cpplan.schemas import ParallelConfig, StepInput, codec, decode_plan, encode_config_json, encode_step_json
from tests.cli.inprocess import payload_of, reseal, run_cli


def one_line_error(result, words):
    assert result.code == 2, (result.code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert words in lines[0], lines[0]


def _step(n: int = 3, step_id: int = 3) -> StepInput:
    ids = [f"r{i}" for i in range(n)]
    return StepInput.build(step_id, ids, [10 * i for i in range(n)], [1 + 37 * i for i in range(n)],
                           [i > 0 for i in range(n)])


@pytest.fixture()
def files(tmp_path):
    """A step file and its plans at P = W = 2 and P = W = 4."""
    step = tmp_path / "step.json"
    step.write_bytes(encode_step_json(_step(12)))
    for p in (2, 4):
        out = tmp_path / f"p{p}.msgpack"
        assert run_cli("plan", step, "--pcp", p, "--dcp", p, "-o", out).code == 0
    return tmp_path


def _listing(folder):
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------- 1: flags a plan ignores
@pytest.mark.parametrize("argv, words", [
    (["inspect", "{p2}", "--pcp", "4", "--dcp", "4"],
     "--pcp, --dcp apply to step files only: {p2} is a plan file"),
    (["inspect", "{p2}", "--config", "/nonexistent.json"], "--config applies to step files only"),
    (["inspect", "{p2}", "--json", "--interleave", "2"], "--interleave applies to step files"),
    (["diff", "{p2}", "{p4}", "--dcp", "2"], "{p2} and {p4} are plan files"),
    (["draw", "{p2}", "-o", "{d}/d.png", "--kv-cache-dtype", "bf16"],
     "--kv-cache-dtype applies to step files only"),
])
def test_config_flags_with_only_plan_files_are_refused(files, argv, words):
    names = {"p2": files / "p2.msgpack", "p4": files / "p4.msgpack", "d": files}
    before = _listing(files)
    one_line_error(run_cli(*[a.format(**names) for a in argv]), words.format(**names))
    assert _listing(files) == before


def test_config_flags_still_apply_to_the_step_of_a_diff(files):
    result = run_cli("diff", files / "p2.msgpack", files / "step.json", "--pcp", "2", "--dcp", "2")
    assert result.code == 0 and "plans are equal" in result.stdout, result.stderr


def test_indices_without_json_is_refused(files):
    one_line_error(run_cli("inspect", files / "p2.msgpack", "--indices"), "add --json")
    result = run_cli("inspect", files / "p2.msgpack", "--indices", "--json")
    assert result.code == 0 and "deinterleave" in json.loads(result.stdout)["gather_chunks"][0]


# ---------------------------------------------------------------- 2: diff across P
def test_diff_names_ranks_present_in_one_plan_only(files):
    p2, p4 = files / "p2.msgpack", files / "p4.msgpack"
    forward = run_cli("diff", p2, p4)
    assert forward.code == 1, forward.stderr
    lines = forward.stdout.splitlines()
    plan4 = decode_plan(p4.read_bytes())
    for rank in (2, 3):  # P = 2 has ranks 0 and 1 only
        assert any(line.startswith(f"rank {rank}: only in B") for line in lines), forward.stdout
        assert f"{plan4.num_tokens[rank]} tokens" in forward.stdout
    backward = run_cli("diff", p4, p2)
    assert "rank 2: only in A" in backward.stdout and "rank 3: only in A" in backward.stdout
    assert "only in" not in run_cli("diff", p2, p2).stdout


# ---------------------------------------------------------------- 3: -o onto an input
def test_output_never_replaces_an_input(files):
    step, config = files / "step.json", files / "config.json"
    config.write_bytes(encode_config_json(ParallelConfig(pcp_size=2, dcp_size=2)))
    hard = files / "hard.json"
    os.link(step, hard)
    png_plan = files / "plan.png"  # a plan file named like a picture: draw's input and output
    png_plan.write_bytes((files / "p2.msgpack").read_bytes())
    saved = {p: p.read_bytes() for p in files.iterdir()}
    for argv in (["plan", step, "-o", step], ["plan", step, "--config", config, "-o", config],
                 ["plan", step, "-o", hard], ["plan", files / "." / "step.json", "-o", step],
                 ["draw", png_plan, "-o", png_plan]):
        one_line_error(run_cli(*argv), f"refusing to replace {argv[-1]}: it is an input")
    assert {p: p.read_bytes() for p in files.iterdir()} == saved  # nothing replaced or left


# ---------------------------------------------------------------- 4: schema versions
@pytest.mark.parametrize("version", [0, -1, -(2**40)])
def test_schema_versions_below_one_are_refused(tmp_path, files, monkeypatch, version):
    monkeypatch.setattr(codec, "SCHEMA_VERSION", version)
    bad = tmp_path / "old.msgpack"
    bad.write_bytes(reseal(payload_of((files / "p2.msgpack").read_bytes())))
    monkeypatch.undo()
    one_line_error(run_cli("inspect", bad),
                   f"{bad}: invalid schema version: got {version}, expected 1 to {codec.SCHEMA_VERSION}")


def test_inspect_prints_the_files_schema_version(files, monkeypatch):
    """A file of version 2 read by a cpplan that reads 2: the report says 2, the file's."""
    monkeypatch.setattr(codec, "SCHEMA_VERSION", 2)
    v2 = files / "v2.msgpack"
    v2.write_bytes(reseal(payload_of((files / "p2.msgpack").read_bytes())))
    assert codec.read_envelope(v2.read_bytes()).schema_version == 2
    text = run_cli("inspect", v2)
    assert text.code == 0 and "schema v2" in text.stdout.splitlines()[0], text.stderr
    assert json.loads(run_cli("inspect", v2, "--json").stdout)["schema_version"] == 2


# ---------------------------------------------------------------- 6: unencodable stdout
def _run_ascii(*argv):
    """`cpplan ARGV` with stdout and stderr in strict ASCII (PYTHONIOENCODING=ascii)."""
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="strict",
                                 write_through=True) for _ in range(2))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except BaseException as exc:  # noqa: BLE001 - what the user would see
            err.buffer.write(f"Traceback: {exc!r}".encode("ascii", "backslashreplace"))
            code = 99
    return code, out.buffer.getvalue().decode("ascii"), err.buffer.getvalue().decode("ascii")


def test_non_ascii_text_on_an_ascii_terminal_is_escaped(tmp_path):
    step = tmp_path / "s.json"
    step.write_bytes(encode_step_json(StepInput.build(1, ["café→日本"], [0], [3], [True])))
    plan = tmp_path / "p.msgpack"
    assert run_cli("plan", step, "-o", plan).code == 0
    code, out, err = _run_ascii("inspect", plan)
    assert code == 0 and "caf\\xe9\\u2192\\u65e5\\u672c" in out, err
    other = tmp_path / "o.json"
    other.write_bytes(encode_step_json(StepInput.build(1, ["r0"], [0], [3], [True])))
    code, out, err = _run_ascii("diff", plan, other)
    assert code == 1 and "request 'caf\\xe9\\u2192\\u65e5\\u672c': removed" in out, err
    code, out, err = _run_ascii("inspect", tmp_path / "é.msgpack")
    assert code == 2 and "\\xe9.msgpack: No such file or directory" in err, err


# ---------------------------------------------------------------- 7: optional packages
def _block(monkeypatch, top: str) -> None:
    """``import top`` (and its submodules, imported or not) fails as if not installed."""
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")] + [top]:
        monkeypatch.setitem(sys.modules, name, None)


def test_missing_rich_is_one_line_and_json_needs_no_rich(files, monkeypatch):
    _block(monkeypatch, "rich")
    result = run_cli("inspect", files / "p2.msgpack")
    one_line_error(result, 'cpplan inspect: error: needs rich, which is not installed: '
                           'pip install "torch==2.13.0" -e ".[runtime,cli,hf]" (the README\'s '
                           'install)')
    assert result.stdout == ""
    assert run_cli("inspect", files / "p2.msgpack", "--json").code == 0


def test_missing_matplotlib_is_one_line_and_writes_nothing(files, monkeypatch):
    _block(monkeypatch, "matplotlib")
    before = _listing(files)
    one_line_error(run_cli("draw", files / "p2.msgpack", "-o", files / "d.png"),
                   'cpplan draw: error: needs matplotlib, which is not installed: '
                   'pip install "torch==2.13.0" -e ".[runtime,cli,hf]" (the README\'s install)')
    assert _listing(files) == before


@pytest.mark.parametrize("module, words", [
    ("torch", 'needs torch, which is not installed: pip install "torch==2.13.0" -e '
              '".[runtime,cli,hf]" (the README\'s install)'),
    ("numba", "needs numba, which is not installed: reinstall cpplan"),
])
def test_a_command_needing_a_missing_package_is_one_line(files, monkeypatch, module, words):
    def run(args):
        __import__(module)

    _block(monkeypatch, module)
    monkeypatch.setattr(plan_cmd, "run", run)
    one_line_error(run_cli("plan", files / "step.json", "-o", files / "x.msgpack"), words)


# ---------------------------------------------------------------- 10: errors name the file
def test_decoding_errors_name_their_file(files):
    empty = files / "empty.json"
    empty.write_bytes(b"")
    one_line_error(run_cli("plan", files / "step.json", "--config", empty, "-o", files / "o.mp"),
                   f"{empty}: not a cpplan file: got only 0 bytes")
    one_line_error(run_cli("plan", empty, "-o", files / "o.mp"), f"{empty}: not a cpplan file")
    good = (files / "p2.msgpack").read_bytes()
    fingerprint = files / "fp.msgpack"
    env = codec.read_envelope(good)
    body = msgspec.msgpack.encode(msgspec.structs.replace(env, config_fingerprint="00"))
    fingerprint.write_bytes(body + xxhash.xxh3_128_digest(body))
    one_line_error(run_cli("inspect", fingerprint),
                   f"{fingerprint}: config fingerprint does not match the plan's config")
    assert not (files / "o.mp").exists()


def test_a_newer_plan_is_called_a_plan(files, monkeypatch):
    monkeypatch.setattr(codec, "SCHEMA_VERSION", 7)
    newer = files / "new.msgpack"
    newer.write_bytes(reseal(payload_of((files / "p2.msgpack").read_bytes())))
    monkeypatch.undo()
    for argv in (["inspect", newer], ["diff", files / "p2.msgpack", newer],
                 ["draw", newer, "-o", files / "d.png"]):
        result = run_cli(*argv)
        one_line_error(result, f"{newer}: a plan file written by schema version 7")
        assert "neither" not in result.stderr and "upgrade cpplan" in result.stderr


# ---------------------------------------------------------------- 11: '-' is not stdin
@pytest.mark.parametrize("argv, words", [
    (["plan", "{step}", "-o", "-"], "argument -o/--output: '-' (stdin/stdout) is not supported"),
    (["inspect", "-"], "argument PLAN: '-' (stdin/stdout) is not supported"),
    (["diff", "{p2}", "-"], "argument B: '-'"),
    (["draw", "-", "-o", "{d}/d.png"], "argument PLAN: '-'"),
    (["plan", "{step}", "--config", "-", "-o", "{d}/o.mp"], "argument --config: '-'"),
])
def test_dash_is_refused_not_taken_as_a_file(files, argv, words, monkeypatch):
    monkeypatch.chdir(files)
    names = {"step": files / "step.json", "p2": files / "p2.msgpack", "d": files}
    before = _listing(files)
    one_line_error(run_cli(*[a.format(**names) for a in argv]), words)
    assert _listing(files) == before


@pytest.mark.parametrize("command", ["plan", "inspect", "diff", "draw"])
def test_help_says_dash_is_not_stdin(command):
    result = run_cli(command, "--help")
    assert result.code == 0 and "'-' (stdin/stdout) is not supported" in result.stdout


# ---------------------------------------------------------------- 5: through the CLI
def test_plan_over_an_existing_output_keeps_its_mode(files):
    out = files / "p2.msgpack"
    os.chmod(out, 0o600)
    assert run_cli("plan", files / "step.json", "--pcp", "4", "--dcp", "4", "-o", out).code == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert decode_plan(out.read_bytes()).config.pcp_size == 4
