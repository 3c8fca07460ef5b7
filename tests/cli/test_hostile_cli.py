"""Hostile input and misuse through the command line (FAILURE_BEHAVIOUR.md): every bad input is
one line on stderr and exit 2, never a traceback, a hang, a huge allocation or a stray file.

Most commands run in-process (cpplan.cli.main) for speed; the FIFO, the broken pipe and the
interpreter's final flush need a real process.
"""

import json
import os
import subprocess
import sys

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpplan.schemas import (
    ParallelConfig,
    StepInput,
    decode_plan,
    encode_config_json,
    encode_plan,
    encode_step_json,
)
from tests.cli.inprocess import payload_of, reseal, run_cli
from tests.cli.test_cli import ENV, ROOT
from tests.lane import examples

GOLDEN = ROOT / "tests" / "golden" / "v2"
EXIT_CODES = {0, 1, 2}  # documented for plan / inspect / diff / draw
SECONDS_PER_COMMAND = 20


def assert_clean(result, codes=EXIT_CODES):
    assert result.code in codes, (result.code, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.seconds < SECONDS_PER_COMMAND
    if result.code == 2:
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def one_line_error(result, words):
    assert result.code == 2, (result.code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert words in lines[0], lines[0]


@pytest.fixture()
def step_file(tmp_path):
    path = tmp_path / "step.json"
    path.write_bytes(encode_step_json(StepInput.build(
        3, ["a", "b", "c"], [10, 0, 0], [1, 70, 9], [False, True, True])))
    return path


# ---------------------------------------------------------------- class 4: inputs
def test_fifo_device_and_large_inputs_refused(tmp_path, step_file):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for argv in (["inspect", fifo], ["plan", fifo, "-o", tmp_path / "p.msgpack"],
                 ["plan", step_file, "--config", fifo, "-o", tmp_path / "p.msgpack"],
                 ["diff", fifo, fifo], ["draw", fifo, "-o", tmp_path / "d.png"]):
        one_line_error(run_cli(*argv), "it is a FIFO; expected a regular file")
    one_line_error(run_cli("inspect", "/dev/zero"), "/dev/zero: it is a device")
    big = tmp_path / "big.msgpack"
    with open(big, "wb") as f:
        f.truncate(300 * 2**20)
    one_line_error(run_cli("inspect", big), "file too large: got 314,572,800 bytes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.msgpack", "fifo", "step.json"]


def test_fifo_does_not_hang_a_real_process(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "cpplan", "inspect", str(fifo)], env=ENV,
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "it is a FIFO" in proc.stderr


@pytest.mark.parametrize("flags, words", [
    (["--pcp", "9223372036854775808"], "argument --pcp: expected an integer in [1, 1024]"),
    (["--cudagraph-sizes", "16,1099511627776"], "expected sizes in [1, 2147483647]"),
    (["--cudagraph-sizes", "16,x"], "expected comma-separated integers"),
    (["--max-model-len", "1e9"], "expected an integer"),
    (["--pcp", "2048"], "argument --pcp: expected an integer in [1, 1024]: got 2048"),
    # the range a message names is the range accepted: 0 is not a size
    (["--pcp", "0"], "argument --pcp: expected an integer in [1, 1024]: got 0"),
    (["--dcp", "-1"], "argument --dcp: expected an integer in [1, 1024]: got -1"),
    (["--max-model-len", "0"], "argument --max-model-len: expected an integer in [1, 2147483647]"),
    (["--gather-workspace-tokens", "-1"], "expected an integer in [0, 2147483647]: got -1"),
])
def test_integer_flags_bounded(step_file, tmp_path, flags, words):
    one_line_error(run_cli("plan", step_file, *flags, "-o", tmp_path / "p.msgpack"), words)
    assert not (tmp_path / "p.msgpack").exists()


def test_config_file_with_bad_types_and_duplicate_keys(step_file, tmp_path):
    cfg = tmp_path / "config.json"
    for text, words in ((b'{"pcp_size": 2.5}', "invalid config JSON"),
                        (b'{"kv_cache_dtype": "fp16"}', "invalid config JSON"),
                        (b'{"pcp_size": 2, "pcp_size": 4}', "key 'pcp_size' given twice"),
                        (b'{"cudagraph_token_sizes": [16, 1099511627776]}', "cudagraph")):
        cfg.write_bytes(text)
        one_line_error(run_cli("plan", step_file, "--config", cfg, "-o", tmp_path / "p.mp"),
                       words)
    cfg.write_bytes(b"\xef\xbb\xbf" + encode_config_json(ParallelConfig(pcp_size=2)))
    assert run_cli("plan", step_file, "--config", cfg, "-o", tmp_path / "p.mp").code == 0


# ---------------------------------------------------------------- class 5: outputs
def test_outputs_never_replace_links_devices_or_folders(step_file, tmp_path):
    target = tmp_path / "target"
    link = tmp_path / "link.msgpack"
    link.symlink_to(target)
    for out, words in ((link, "refusing to replace"), ("/dev/null", "it is a device"),
                       (tmp_path, "it is a folder"), (tmp_path / "no/p.msgpack", "does not exist"),
                       (tmp_path / ("n" * 300), "File name too long")):
        one_line_error(run_cli("plan", step_file, "-o", out), words)
        assert ".tmp" not in run_cli("plan", step_file, "-o", out).stderr
    one_line_error(run_cli("draw", step_file, "-o", tmp_path / "link.png", "--dpi", "0"),
                   "argument --dpi: expected an integer in [10, 600]")
    png = tmp_path / "x.png"
    png.symlink_to(target)
    one_line_error(run_cli("draw", step_file, "-o", png), "refusing to replace")
    assert link.is_symlink() and not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.msgpack", "step.json", "x.png"]


def test_draw_writes_atomically_on_a_full_disk(step_file, tmp_path, full_disk):
    one_line_error(run_cli("draw", step_file, "-o", tmp_path / "d.png"),
                   "d.png: No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step.json"]


@pytest.mark.parametrize("argv, code", [
    (["inspect", "tests/golden/v1/requests_300_p2w2.msgpack"], 0),
    (["inspect", "tests/golden/v1/requests_300_p2w2.msgpack", "--json"], 0),
    (["diff", "tests/golden/v1/requests_300_p2w2.msgpack", "tests/golden/v1/mixed_p2w2.msgpack"],
     1),
])
def test_broken_pipe_is_quiet(argv, code):
    """`cpplan ... | head -1`: the command's own exit code, nothing on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "cpplan", *argv], env=ENV, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()  # the reader goes away before the output ends
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code and err == b"", (proc.returncode, err)


# ---------------------------------------------------------------- class 6: terminal
def test_req_ids_with_markup_and_escapes_are_shown_inert(tmp_path):
    ids = ["[/]", "[bold red]x[/]", "\x1b[31mred\x07", "rtl\u202eid", ":smile:"]
    step = tmp_path / "s.json"
    step.write_bytes(encode_step_json(StepInput.build(1, ids, [0] * 5, [1, 2, 3, 4, 5],
                                                      [False, True, True, True, False])))
    result = run_cli("inspect", step, "--pcp", "2", "--dcp", "2")
    assert_clean(result, {0})
    assert "[bold red]x[/]" in result.stdout and "[/]" in result.stdout
    assert "\\x1b[31mred\\x07" in result.stdout and "\\u202e" in result.stdout
    assert ":smile:" in result.stdout
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    other = tmp_path / "o.json"
    other.write_bytes(encode_step_json(StepInput.build(1, ids[:4], [0] * 4, [1, 2, 3, 4],
                                                       [False, True, True, True])))
    diff = run_cli("diff", step, other, "--pcp", "2")
    assert diff.code == 1 and "\x1b" not in diff.stdout
    bad = run_cli("plan", step, "--max-model-len", "2", "-o", tmp_path / "p.mp")
    assert bad.code == 2 and "\x1b" not in bad.stderr


# ---------------------------------------------------------------- class 3: reports bounded
def test_inspect_indices_and_draw_are_bounded(tmp_path, monkeypatch):
    import cpplan.cli.draw_cmd as draw_cmd
    import cpplan.report as report

    plan = GOLDEN / "requests_300_p2w2.msgpack"
    monkeypatch.setattr(report, "MAX_INDICES", 10)
    one_line_error(run_cli("inspect", plan, "--json", "--indices"),
                   "--indices would list")
    monkeypatch.setattr(draw_cmd, "MAX_SPANS", 10)
    one_line_error(run_cli("draw", plan, "-o", tmp_path / "d.png"), "draw shows at most")
    monkeypatch.setattr(draw_cmd, "MAX_SPANS", 50_000)
    monkeypatch.setattr(draw_cmd, "MAX_PIXELS", 1_000_000)
    one_line_error(run_cli("draw", GOLDEN / "mixed_p2w2.msgpack", "-o", tmp_path / "d.png",
                           "--dpi", "600"), "pixels")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- class 7: simulate / replay
@pytest.mark.parametrize("args, words", [
    (["--timeout", "0.1"], "--timeout must be in [1, 86400] seconds"),
    (["--timeout", "inf"], "--timeout must be in [1, 86400] seconds"),
    (["--timeout", "nan"], "--timeout must be > 0"),
    (["--pcp", "1", "--dcp", "1", "--inject-divergence", "1:0"], "needs a world of >= 2"),
    (["--steps", "4", "--inject-divergence", "9:1"], "step must be in [0, 4)"),
    (["--pcp", "9223372036854775808"], "argument --pcp: expected an integer in [1, 1024]"),
])
def test_simulate_arguments_checked_up_front(args, words):
    one_line_error(run_cli("simulate", *args), words)


def test_simulate_record_target_checked_up_front(tmp_path):
    afile = tmp_path / "afile"
    afile.write_bytes(b"")
    one_line_error(run_cli("simulate", "--record", afile), "not a folder")


def test_replay_bad_meta_and_empty_step(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    plan = decode_plan((GOLDEN / "mixed_p2w2.msgpack").read_bytes())
    step = runs / "step-9.msgpack"
    step.write_bytes(encode_plan(plan))
    for meta, words in ((b"{not json", "invalid"), (b'{"seed": "x"}', "seed must be an integer"),
                        (b'{"seed": 1, "seed": 2}', "given twice"),
                        (b'{"seed": true}', "seed must be an integer")):
        (runs / "replay.json").write_bytes(meta)
        one_line_error(run_cli("replay", step), words)
    (runs / "replay.json").unlink()
    os.mkfifo(runs / "replay.json")
    one_line_error(run_cli("replay", step), "it is a FIFO")
    (runs / "replay.json").unlink()
    empty = tmp_path / "empty.json"
    empty.write_bytes(encode_step_json(StepInput.build(4, [], [], [], [])))
    assert run_cli("plan", empty, "-o", tmp_path / "e.msgpack").code == 0
    one_line_error(run_cli("replay", tmp_path / "e.msgpack"), "has no requests")


# ---------------------------------------------------------------- property test
def _mutate(payload, data):
    """Replace one leaf of the payload tree (an int, a bytes array body, a list) with a
    hostile value drawn by hypothesis."""
    node = payload
    for _ in range(6):
        if isinstance(node, dict) and node:
            key = data.draw(st.sampled_from(sorted(node)))
        elif isinstance(node, list) and node:
            key = data.draw(st.integers(0, len(node) - 1))
        else:
            break
        child = node[key]
        if not isinstance(child, (dict, list)) or data.draw(st.booleans()):
            node[key] = _hostile_leaf(child, data)
            return
        node = child


def _hostile_leaf(value, data):
    if isinstance(value, bytes) and value:
        buf = bytearray(value)
        at = data.draw(st.integers(0, len(buf) - 1))
        buf[at] = data.draw(st.sampled_from([0, 1, 2, 7, 0x7F, 0x80, 0xFF]))
        return bytes(buf)
    if isinstance(value, list):
        return data.draw(st.sampled_from([[], value[:1], value * 2]))
    return data.draw(st.sampled_from([-1, 0, 1, 3, 2**31 - 1, 2**31, 2**40, 2**63 - 1,
                                      "[/]", "\x1b[2J", None, 1.5]))


CORPUS = ["mixed_p2w2", "mixed_p4w4", "w1_zero_length_rows_p2", "p1w2_dcp_only"]


@settings(max_examples=examples(40, quick=4), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.sampled_from(CORPUS), st.data())
def test_property_mutated_plan_files_every_command(tmp_path_factory, name, data):
    folder = tmp_path_factory.mktemp("mut")
    payload = payload_of((GOLDEN / f"{name}.msgpack").read_bytes())
    _mutate(payload, data)
    plan_path = folder / "plan.msgpack"
    plan_path.write_bytes(reseal(payload))
    good = GOLDEN / "mixed_p2w2.msgpack"
    for argv in (["inspect", plan_path], ["inspect", plan_path, "--json"],
                 ["diff", plan_path, good], ["draw", plan_path, "-o", folder / "d.png",
                                             "--dpi", "10"]):
        result = run_cli(*argv)
        assert_clean(result)
        if result.code == 0 and argv[-1] == "--json":
            json.loads(result.stdout)
    assert {p.name for p in folder.iterdir()} <= {"plan.msgpack", "d.png"}


requests = st.lists(st.tuples(
    st.text(max_size=6) | st.sampled_from(["[/]", "\x1b[0m", "[bold]b[/]"]),
    st.integers(0, 2000), st.integers(1, 500), st.booleans()), max_size=12,
    unique_by=lambda r: r[0])
configs = st.builds(
    lambda p, same, i, dtype, sizes: {"pcp_size": p, "dcp_size": p if same else 1,
                                      "interleave_size": i, "kv_cache_dtype": dtype,
                                      "cudagraph_token_sizes": sorted(set(sizes))},
    st.integers(1, 4), st.booleans(), st.sampled_from([1, 2, 64]),
    st.sampled_from(["bf16", "fp8_ds_mla"]), st.lists(st.integers(1, 3000), max_size=3))
HOSTILE = [-1, 0, 2**31, 2**40, 2**64 - 1, 1.5, True, "7", None, "fp16", [], {}]


def _spoil(step: dict, config: dict, data) -> None:
    """Half the examples: one field of the step or the config replaced by a hostile value."""
    if not data.draw(st.booleans()):
        return
    value = data.draw(st.sampled_from(HOSTILE))
    if step["requests"] and data.draw(st.booleans()):
        request = data.draw(st.sampled_from(step["requests"]))
        request[data.draw(st.sampled_from(sorted(request)))] = value
    elif data.draw(st.booleans()):
        config[data.draw(st.sampled_from(sorted(config) + ["max_model_len",
                                                           "gather_workspace_tokens"]))] = value
    else:
        step["step_id"] = value


@settings(max_examples=examples(40, quick=4), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(requests, configs, st.integers(0, 2**63 - 1), st.data())
def test_property_generated_steps_and_configs(tmp_path_factory, reqs, config, step_id, data):
    folder = tmp_path_factory.mktemp("gen")
    step = {"step_id": step_id, "requests": [
        {"req_id": r, "num_computed_tokens": c, "num_scheduled_tokens": q, "is_prefilling": p}
        for r, c, q, p in reqs]}
    _spoil(step, config, data)
    (folder / "step.json").write_bytes(json.dumps(step).encode())
    (folder / "config.json").write_bytes(json.dumps(config).encode())
    (folder / "step.msgpack").write_bytes(msgspec.msgpack.encode(step))
    plan = folder / "p.msgpack"
    result = run_cli("plan", folder / "step.json", "--config", folder / "config.json",
                     "-o", plan)
    assert_clean(result)
    assert (result.code == 0) == plan.exists()
    for argv in (["inspect", folder / "step.msgpack", "--config", folder / "config.json"],
                 ["inspect", plan, "--json"], ["diff", plan, folder / "step.json", "--config",
                                               folder / "config.json"]):
        if argv[1] == plan and not plan.exists():
            continue
        assert_clean(run_cli(*argv))
    if result.code == 0:  # what was written reads back and keeps its invariants
        assert decode_plan(plan.read_bytes()).step_id == step["step_id"]
    assert {p.name for p in folder.iterdir()} <= {"step.json", "config.json", "step.msgpack",
                                                  "p.msgpack"}



_SIGTERM_MID_WRITE = r"""
import os, signal, sys, cpplan.schemas.files as files
real = files.os.fdopen
class Handle:
    def __init__(self, h): self.h = h
    def __enter__(self): return self
    def __exit__(self, *a): return self.h.__exit__(*a)
    def write(self, data):  # half the bytes, then SIGTERM, as a kill mid-write
        self.h.write(data[: len(data) // 2]); self.h.flush()
        os.kill(os.getpid(), signal.SIGTERM)
        self.h.write(data[len(data) // 2:])
files.os.fdopen = lambda fd, mode: Handle(real(fd, mode))
from cpplan.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_mid_write_leaves_no_temp_file_and_no_target(tmp_path):
    """SIGTERM while `plan -o` writes: the temp file beside the target is removed, the target
    is not created, exit 130 (the default action used to leave the temp file behind)."""
    import subprocess
    import sys

    out = tmp_path / "out" / "plan.msgpack"
    out.parent.mkdir()
    step = GOLDEN / "mixed_p2w2.step.json"
    proc = subprocess.run([sys.executable, "-c", _SIGTERM_MID_WRITE, "plan", str(step),
                           "--config", str(GOLDEN / "mixed_p2w2.config.json"), "-o", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 130, proc.stderr
    assert "interrupted" in proc.stderr
    assert list(out.parent.iterdir()) == []
