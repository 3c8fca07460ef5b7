"""Every CLI command and error path, through a real subprocess (the user's view); the table
of bad inputs in-process, one of them through a real process too."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cpplan.schemas import (
    ParallelConfig,
    StepInput,
    codec,
    decode_plan,
    encode_config,
    encode_config_json,
    encode_step,
    encode_step_json,
)
from tests.cli.inprocess import run_cli
from tests.golden.regen import golden_dir

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = golden_dir()
ENV = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")


def cpplan(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "cpplan", *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=cwd or ROOT, env=ENV)


def assert_one_line_error(proc, code=2, words=""):
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert words in lines[0], lines[0]


@pytest.fixture(scope="module")
def step_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "step.json"
    step = StepInput.build(3, ["a", "b", "c", "d"], [100, 0, 0, 50], [1, 164, 3, 40],
                           [False, True, True, True])
    path.write_bytes(encode_step_json(step))
    return path


def test_plan_prints_digest_and_is_byte_stable(step_json, tmp_path):
    out1, out2 = tmp_path / "a.msgpack", tmp_path / "b.msgpack"
    p1 = cpplan("plan", step_json, "--pcp", 2, "--dcp", 2, "--max-model-len", 1000, "-o", out1)
    p2 = cpplan("plan", step_json, "--pcp", 2, "--dcp", 2, "--max-model-len", 1000, "-o", out2)
    assert p1.returncode == 0 and p2.returncode == 0, p1.stderr + p2.stderr
    assert out1.read_bytes() == out2.read_bytes()
    assert p1.stdout.strip() == codec.digest(decode_plan(out1.read_bytes())).hex()


def test_plan_from_msgpack_step_and_config_file(step_json, tmp_path):
    from cpplan.schemas import decode_step

    step_mp = tmp_path / "step.msgpack"
    step_mp.write_bytes(encode_step(decode_step(step_json.read_bytes())))
    cfg = tmp_path / "config.msgpack"
    cfg.write_bytes(encode_config(ParallelConfig(pcp_size=2, dcp_size=2, max_model_len=1000)))
    out = tmp_path / "p.msgpack"
    assert cpplan("plan", step_mp, "--config", cfg, "-o", out).returncode == 0
    ref = tmp_path / "ref.msgpack"
    cpplan("plan", step_json, "--pcp", 2, "--dcp", 2, "--max-model-len", 1000, "-o", ref)
    assert out.read_bytes() == ref.read_bytes()


def test_inspect_text_report_has_every_section():
    proc = cpplan("inspect", GOLDEN / "mixed_p2w2.msgpack")
    assert proc.returncode == 0, proc.stderr
    for words in ("digest", "requests (24)", "PCP rank 0:", "PCP rank 1:", "gather chunks",
                  "collectives", "kv_gather[0]", "cost per layer", "imbalance",
                  "workspace per rank"):
        assert words in proc.stdout, words
    assert "\x1b[" not in proc.stdout  # plain text when piped


def test_inspect_text_caps_long_tables():
    proc = cpplan("inspect", GOLDEN / "requests_300_p2w2.msgpack")
    assert proc.returncode == 0, proc.stderr
    assert "... 236 more requests (--json shows all)" in proc.stdout
    assert "more rows (--json shows all)" in proc.stdout


def test_inspect_rank_filter():
    proc = cpplan("inspect", GOLDEN / "mixed_p4w4.msgpack", "--rank", 2)
    assert proc.returncode == 0 and "PCP rank 2:" in proc.stdout
    assert "PCP rank 0:" not in proc.stdout
    assert_one_line_error(cpplan("inspect", GOLDEN / "mixed_p4w4.msgpack", "--rank", 4),
                          words="--rank must be in [0, 4)")


REQUIRED = {
    "": {"digest", "schema_version", "step_id", "config", "requests", "ranks", "gather_chunks",
         "collectives"},
    "config": {"pcp_size", "dcp_size", "interleave_size", "max_model_len",
               "gather_workspace_tokens", "cudagraph_token_sizes"},
    "requests": {"index", "req_id", "num_computed_tokens", "num_scheduled_tokens",
                 "is_prefilling", "mode", "extent", "dcp_shard_rows"},
    "ranks": {"rank", "num_tokens", "padded_num_tokens", "rows"},
    "rows": {"request", "query_offset", "num_tokens"},
    "gather_chunks": {"requests", "padded_local_total", "total", "padded_local_cu",
                      "global_cu"},
    "collectives": {"name", "op", "group", "dtype", "shape", "bytes", "per_layer"},
}


@pytest.mark.parametrize("name", ["mixed_p4w4", "w1_zero_length_rows_p2", "p1w2_dcp_only"])
def test_inspect_json_keys_and_golden(name):
    proc = cpplan("inspect", GOLDEN / f"{name}.msgpack", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == json.loads((GOLDEN / f"{name}.inspect.json").read_text())
    assert REQUIRED[""] <= set(report)
    assert REQUIRED["config"] <= set(report["config"])
    for r in report["requests"]:
        assert REQUIRED["requests"] <= set(r)
    cfg = report["config"]
    assert len(report["ranks"]) == cfg["pcp_size"]
    for rank in report["ranks"]:
        assert REQUIRED["ranks"] <= set(rank)
        assert len(rank["rows"]) == len(report["ranks"][0]["rows"])  # zero-length rows kept
        for row in rank["rows"]:
            assert REQUIRED["rows"] <= set(row)
    if cfg["dcp_size"] == 1:
        assert report["gather_chunks"] == []
        assert all(r["dcp_shard_rows"] == r["extent"] for r in report["requests"])
    for c in report["gather_chunks"]:
        assert REQUIRED["gather_chunks"] <= set(c)
        assert len(c["padded_local_cu"]) == len(c["requests"]) + 1
    for c in report["collectives"]:
        assert REQUIRED["collectives"] <= set(c)


def test_inspect_indices_is_the_deinterleave(tmp_path):
    """The worked example of docs/design.md §3.5: extents [164, 3], P = W = 2, I = 1."""
    step = StepInput.build(0, ["x", "y"], [0, 0], [164, 3], [True, True])
    path = tmp_path / "s.json"
    path.write_bytes(encode_step_json(step))
    proc = cpplan("inspect", path, "--pcp", 2, "--dcp", 2, "--max-model-len", 1000, "--json",
                  "--indices")
    chunk = json.loads(proc.stdout)["gather_chunks"][0]
    assert chunk["padded_local_cu"] == [0, 82, 84] and chunk["padded_local_total"] == 84
    assert chunk["deinterleave"][:6] == [0, 84, 1, 85, 2, 86]
    assert chunk["deinterleave"][164:167] == [82, 166, 83]


def test_inspect_compiles_step_on_the_fly(step_json):
    proc = cpplan("inspect", step_json, "--pcp", 2, "--dcp", 2, "--max-model-len", 1000,
                  "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["step_id"] == 3


def test_diff_equal_different_and_error(tmp_path):
    a = GOLDEN / "mixed_p4w4.msgpack"
    same = cpplan("diff", a, a)
    assert same.returncode == 0 and "equal" in same.stdout
    step = GOLDEN / "mixed_p4w4.step.json"
    other = cpplan("diff", a, step, "--pcp", 4, "--dcp", 4, "--interleave", 16,
                   "--max-model-len", 200000)
    assert other.returncode == 1
    assert "config: interleave_size 1 -> 16" in other.stdout
    assert "digest:" in other.stdout and "collective kv_gather[0]" in other.stdout
    assert_one_line_error(cpplan("diff", a, tmp_path / "missing.msgpack"),
                          words="No such file or directory")


def test_diff_names_mode_changes(tmp_path):
    cfg = ParallelConfig(pcp_size=2, dcp_size=2, max_model_len=1000)
    (tmp_path / "c.json").write_bytes(encode_config_json(cfg))
    for name, q in (("a", 9), ("b", 10)):
        step = StepInput.build(1, ["r0"], [0], [q], [True])
        (tmp_path / f"{name}.json").write_bytes(encode_step_json(step))
    proc = cpplan("diff", tmp_path / "a.json", tmp_path / "b.json", "--config", tmp_path / "c.json")
    assert proc.returncode == 1
    assert "request 'r0': mode replicated -> split" in proc.stdout


def test_draw_png_size_and_lanes(tmp_path):
    from matplotlib.image import imread

    out = tmp_path / "plan.png"
    proc = cpplan("draw", GOLDEN / "mixed_p4w4.msgpack", "-o", out)
    assert proc.returncode == 0, proc.stderr
    image = imread(out)
    height, width = image.shape[:2]
    assert 1200 <= width <= 1600 and height > 400  # 12 in at 120 dpi, tight bounding box
    # count lanes: tall coloured bands crossing a vertical line through the plot's left part
    # (the thin purple gather-chunk brackets are a few pixels high and do not count)
    column = image[:, width // 5, :3]
    coloured = np.abs(column - column.mean(axis=1, keepdims=True)).sum(axis=1) > 0.15
    edges = np.flatnonzero(np.diff(np.concatenate(([0], coloured.astype(int), [0]))))
    heights = edges[1::2] - edges[::2]
    assert np.count_nonzero(heights >= 30) == 4, heights


def test_draw_refuses_non_png():
    assert_one_line_error(cpplan("draw", GOLDEN / "mixed_p4w4.msgpack", "-o", "x.jpg"),
                          words="must be a .png")


@pytest.mark.parametrize("command", ["plan", "inspect", "diff", "draw"])
def test_help_has_an_example(command):
    proc = cpplan(command, "--help")
    assert proc.returncode == 0 and "example" in proc.stdout and "cpplan " + command in proc.stdout


def _not_a_plan(tmp_path):
    path = tmp_path / "junk.msgpack"
    path.write_bytes(b"\x00garbage" * 10)
    return path


def _newer_schema(tmp_path):
    import msgspec
    import xxhash

    plan = decode_plan((GOLDEN / "mixed_p2w2.msgpack").read_bytes())
    payload = codec.plan_payload(plan)
    env = codec.Envelope(codec.KIND_PLAN, codec.SCHEMA_VERSION + 1, "9.0.0",
                         codec.config_fingerprint(plan.config), payload,
                         xxhash.xxh3_128_digest(payload))
    body = msgspec.msgpack.encode(env)
    path = tmp_path / "new.msgpack"
    path.write_bytes(body + xxhash.xxh3_128_digest(body))
    return path


def _config_file(tmp_path):
    path = tmp_path / "config.msgpack"
    path.write_bytes(encode_config(ParallelConfig()))
    return path


@pytest.mark.parametrize("make, args, words", [
    (None, ["inspect", "missing.msgpack"], "No such file or directory"),
    (_not_a_plan, ["inspect", "{f}"], "neither a plan nor a step file"),
    (_config_file, ["inspect", "{f}"], "neither a plan nor a step file"),
    (_newer_schema, ["inspect", "{f}"], f"schema version {codec.SCHEMA_VERSION + 1}"),
    (None, ["inspect", "tests/golden/v1/mixed_p2w2.step.json", "--pcp", "2", "--dcp", "3"],
     "unsupported topology"),
    (None, ["plan", "tests/golden/v1/mixed_p2w2.step.json", "--pcp", "x", "-o", "o.msgpack"],
     "expected an integer"),
    (None, ["plan", "tests/golden/v1/mixed_p2w2.step.json", "--cudagraph-sizes", "8,a", "-o",
            "o.msgpack"], "comma-separated integers"),
    (None, ["plan", "tests/golden/v1/mixed_p2w2.step.json", "--pcp", "2", "--config",
            "tests/golden/v1/mixed_p2w2.config.json", "-o", "o.msgpack"], "not both"),
    (None, ["plan", "tests/golden/v1/mixed_p2w2.step.json", "--max-model-len", "100", "-o",
            "o.msgpack"], "max_model_len"),
    (None, ["diff", "tests/golden/v1/mixed_p2w2.msgpack"], "required"),
    (None, ["nosuchcommand"], "invalid choice"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, monkeypatch, make, args, words):
    """In-process (cpplan.cli.main, from the repository root as the real process below): the
    same refusals without an interpreter's start-up per case."""
    f = make(tmp_path) if make else None
    monkeypatch.chdir(ROOT)
    result = run_cli(*[a.format(f=f) for a in args])
    result.returncode = result.code  # the field assert_one_line_error reads
    assert_one_line_error(result, 2, words)
    assert not (ROOT / "o.msgpack").exists()  # nothing half written


def test_bad_input_is_one_line_exit_2_in_a_real_process(tmp_path):
    assert_one_line_error(cpplan("inspect", _newer_schema(tmp_path), cwd=ROOT), 2,
                          f"schema version {codec.SCHEMA_VERSION + 1}")


def test_plan_output_not_written_on_error(tmp_path):
    out = tmp_path / "p.msgpack"
    bad = tmp_path / "bad.json"
    bad.write_text('{"step_id": 1, "requests": [{"req_id": "a"}]}')
    assert_one_line_error(cpplan("plan", bad, "-o", out), words="invalid step JSON")
    assert not out.exists()
