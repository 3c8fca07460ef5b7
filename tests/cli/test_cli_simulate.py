"""`cpplan simulate` and `cpplan replay` through a real subprocess: JSON contract, exit codes,
record -> replay -> inspect round trip."""

import json

import pytest

from tests.cli.test_cli import assert_one_line_error, cpplan

SIM_KEYS = {"steps", "tokens", "max_abs_err", "collectives", "digest_checks", "ok"}


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_simulate_json_record_replay_inspect(tmp_path):
    runs = tmp_path / "runs"
    proc = cpplan("simulate", "--steps", 6, "--json", "--record", runs)
    assert proc.returncode == 0, proc.stderr
    summary = _last_json(proc.stdout)
    assert SIM_KEYS <= set(summary)
    assert summary["ok"] is True and summary["steps"] == 6
    assert summary["digest_checks"] == 6 and summary["collectives"] > 0
    assert summary["max_abs_err"] <= summary["tolerance"]
    assert "step   5/6" in proc.stderr  # progress on stderr
    recorded = sorted(runs.glob("step-*.msgpack"))
    assert len(recorded) == 6
    replay = cpplan("replay", recorded[-1])
    assert replay.returncode == 0, replay.stderr
    inspect = cpplan("inspect", recorded[-1], "--json")
    assert json.loads(inspect.stdout)["step_id"] == 5


def test_simulate_divergence_exits_3_naming_the_rank():
    proc = cpplan("simulate", "--steps", 4, "--inject-divergence", "2:1:q+1", "--json")
    assert proc.returncode == 3, proc.stderr
    assert "ranks [0] and [1] disagree" in proc.stderr and "at step 2" in proc.stderr
    assert "(ledger 0 collectives" in proc.stderr  # stopped before any data collective
    assert _last_json(proc.stdout)["ok"] is False


@pytest.mark.parametrize("args, words", [
    (["--pcp", "2", "--dcp", "3"], "unsupported topology"),
    (["--inject-divergence", "x:1"], "STEP:RANK"),
    (["--backend", "nccl"], "GPU"),
    (["--kv-cache-dtype", "fp16"], "invalid choice"),
    (["--steps", "4", "--inject-divergence", "4:1"], "step must be in [0, 4)"),
    (["--timeout", "-1"], "--timeout must be > 0"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_simulate_bad_input_exit_2(args, words):
    assert_one_line_error(cpplan("simulate", *args), 2, words)


def test_replay_bad_input(tmp_path):
    assert_one_line_error(cpplan("replay", tmp_path / "nope.msgpack"), 2,
                          "No such file or directory")
    assert_one_line_error(cpplan("replay", "tests/golden/v1/mixed_p2w2.step.json"), 2,
                          "the file is JSON, not a cpplan msgpack file")
    # a plan whose restore width is not the simulation model's: refused up front
    assert_one_line_error(cpplan("replay", "tests/golden/v1/mixed_p2w2.msgpack"), 2,
                          "hidden_size must be num_layers * num_heads * v_head_dim")


def test_simulate_and_replay_help_have_examples():
    for command in ("simulate", "replay"):
        proc = cpplan(command, "--help")
        assert proc.returncode == 0 and "example" in proc.stdout.lower()


def test_simulate_with_graph_sizes_pads_decode_steps_and_matches_the_oracle(tmp_path):
    """--graphs: decode-only steps become graph-replayable (every padded token a decode, T-row
    decode collectives); on the CPU they run eagerly with the graph's static shapes, and a
    recorded one replays against the oracle."""
    runs = tmp_path / "runs"
    proc = cpplan("simulate", "--graphs", "--json", "--record", runs)
    assert proc.returncode == 0, proc.stderr
    summary = _last_json(proc.stdout)
    assert summary["ok"] is True and summary["max_abs_err"] <= summary["tolerance"]
    assert summary["graph_steps"] >= 1 and summary["replayed"] == 0  # no CUDA here
    last = runs / f"step-{summary['steps'] - 1}.msgpack"
    report = json.loads(cpplan("inspect", last, "--json").stdout)
    assert report["cudagraph_size"] > 0
    assert cpplan("replay", last).returncode == 0
