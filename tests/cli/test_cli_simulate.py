"""`cpplan simulate` and `cpplan replay` through a real subprocess: JSON contract, exit codes,
record -> replay -> inspect round trip. Arguments refused up front run in-process
(cpplan.cli.main: the same code, without a new interpreter and its imports per case), one of
them through a real process too.

A simulate spawns one process per rank (about 4 s of CPU each to start): the default P = W = 2
world's run is shared by the tests that read it (``graphs_run``), and the tests of what one
rank's failure or divergence does to its peer run P = 2, W = 1 (two ranks, the preset
workload depends on P only); tests/dist covers the P x W topologies."""

import dataclasses
import json
import time

import pytest

from tests.cli.inprocess import run_cli
from tests.cli.test_cli import assert_one_line_error, cpplan

SIM_KEYS = {"steps", "tokens", "max_abs_err", "collectives", "digest_checks", "ok"}


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def graphs_run(tmp_path_factory):
    """One default simulate (P = W = 2, 24 steps, 2 layers) with --graphs, recorded: the JSON
    contract and the record -> replay -> inspect round trip of an eager step, and the padded
    graph-replayable decode steps, read from the same run."""
    runs = tmp_path_factory.mktemp("simulate") / "runs"
    proc = cpplan("simulate", "--graphs", "--json", "--record", runs)
    assert proc.returncode == 0, proc.stderr
    return proc, runs


def test_simulate_json_record_replay_inspect(graphs_run):
    proc, runs = graphs_run
    summary = _last_json(proc.stdout)
    assert SIM_KEYS <= set(summary)
    n = summary["steps"]
    assert summary["ok"] is True and n == 24
    assert summary["digest_checks"] == n and summary["collectives"] > 0
    assert summary["max_abs_err"] <= summary["tolerance"]
    assert f"step {n - 1:3d}/{n}" in proc.stderr  # progress on stderr
    recorded = sorted(runs.glob("step-*.msgpack"), key=lambda p: int(p.stem.split("-")[1]))
    assert len(recorded) == n
    first = recorded[0]  # a prefill step (the graphs test replays the last, a decode-only one)
    inspect = cpplan("inspect", first, "--json")
    assert json.loads(inspect.stdout)["step_id"] == 0
    replay = cpplan("replay", first)
    assert replay.returncode == 0, replay.stderr


def test_simulate_divergence_exits_3_naming_the_rank():
    proc = cpplan("simulate", "--pcp", 2, "--dcp", 1, "--steps", 4, "--inject-divergence",
                  "2:1:q+1", "--json")
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
    (["--steps", "0"], "--steps: expected an integer in [1, 1000000]: got 0"),
    (["--sm-scale", "0"], "--sm-scale: got 0.0; expected a finite positive number"),
    (["--sm-scale", "nan"], "--sm-scale: got nan"),
    (["--sm-scale", "inf"], "--sm-scale: got inf"),
    (["--indexer-pattern", "SF"], "expected letters F and S starting with F"),
    (["--indexer-pattern", "FX"], "expected letters F and S"),
])
def test_simulate_bad_input_exit_2(args, words):
    assert_one_line_error(_in_process("simulate", *args), 2, words)


def test_simulate_bad_input_exit_2_in_a_real_process():
    """The user's view of one of the refusals above: a process that exits 2 with one line."""
    assert_one_line_error(cpplan("simulate", "--pcp", "2", "--dcp", "3"), 2,
                          "unsupported topology")


def _in_process(*argv):
    """``cpplan ARGV`` through cpplan.cli.main in this process, as the subprocess result's
    fields (returncode, stdout, stderr) that assert_one_line_error reads."""
    result = run_cli(*argv)
    result.returncode = result.code
    return result


@pytest.mark.parametrize("args, words", [
    (["--inject-divergence", ""], "must be STEP:RANK[:KIND]: got ''"),
    (["--inject-divergence", "2:1", "--verify", "off"], "needs --verify every: got --verify off"),
    (["--inject-divergence", "2:1", "--verify", "sampled"], "needs --verify every"),
    (["--pcp", "128", "--dcp", "128"], "spawns 128 processes here"),
])
def test_simulate_refuses_options_that_would_do_nothing_or_abort(args, words, tmp_path):
    """An empty --inject-divergence was ignored; with the digest check off or sampled, the
    injected rank ran another plan than its peers (gloo aborted the rank: exit 4); a spawned
    world of 128 ranks would take about 50 GB here. None leaves a --record folder behind."""
    record = tmp_path / "deep" / "new"
    assert_one_line_error(_in_process("simulate", *args, "--record", record), 2, words)
    assert not (tmp_path / "deep").exists()


@pytest.mark.parametrize("inject, steps, words", [
    ("45:1", 60, "45:1:q+1: the workload ends after 32 steps, so nothing would be injected; "
                 "expected a STEP below 32"),
    ("30:1:reorder", 31, "step 30 has 1 request(s), so 'reorder' changes nothing"),
])
def test_simulate_injection_that_never_happens_is_refused_up_front(inject, steps, words):
    """The default preset's workload ends after 32 steps, and reordering a one-request step
    changes nothing: a dry run of the scheduler refuses both before any rank starts (exit 2,
    one line; they used to run every step first)."""
    assert_one_line_error(_in_process("simulate", "--pcp", 2, "--dcp", 1, "--steps", steps,
                                      "--layers", 1, "--inject-divergence", inject), 2, words)


def test_the_dry_run_sees_the_steps_the_ranks_run():
    """``check_inject``'s dry run and a rank's loop schedule the same steps: the last step
    the dry run accepts is the last one the workload runs."""
    from cpplan.sim import simulate as sim

    opts = sim.SimOptions(pcp=2, dcp=1, steps=60, layers=1)
    config = sim.preset_config(opts)
    sched, ran = sim.preset_scheduler(config, opts), 0
    while sched.schedule(ran) is not None:
        sched.complete()
        ran += 1
    assert ran == 32
    sim.check_inject(config, dataclasses.replace(opts, inject=sim.Inject(ran - 1, 1)))
    with pytest.raises(sim.ConfigError, match=f"ends after {ran} steps"):
        sim.check_inject(config, dataclasses.replace(opts, inject=sim.Inject(ran, 1)))


def test_simulate_record_write_failure_stops_every_rank_at_once(tmp_path):
    """A recording that cannot be written (here a symlink where the step file goes) was an
    OutputError on rank 0 while rank 1 waited out --timeout at the next step's digest check
    and was reported lost (exit 4). Rank 0 now refuses the step: rank 1 hears of it there."""
    record = tmp_path / "runs"
    record.mkdir()
    (record / "step-1.msgpack").symlink_to(tmp_path / "elsewhere")
    t0 = time.monotonic()
    proc = cpplan("simulate", "--pcp", 2, "--dcp", 1, "--steps", 3, "--layers", 1, "--record",
                  record, "--timeout", 20)
    assert proc.returncode == 2, proc.stderr
    assert "rank 0 at step 1" in proc.stderr and "OutputError" in proc.stderr
    assert "rank 1 at step 1" in proc.stderr and "PeerFailedError: rank 0 failed" in proc.stderr
    assert time.monotonic() - t0 < 20  # not the timeout
    assert (record / "step-0.msgpack").is_file()  # the steps before it are recorded


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


def test_simulate_with_graph_sizes_pads_decode_steps_and_matches_the_oracle(graphs_run):
    """--graphs: decode-only steps become graph-replayable (every padded token a decode, T-row
    decode collectives); on the CPU they run eagerly with the graph's static shapes, and a
    recorded one replays against the oracle."""
    proc, runs = graphs_run
    summary = _last_json(proc.stdout)
    assert summary["ok"] is True and summary["max_abs_err"] <= summary["tolerance"]
    assert summary["graph_steps"] >= 1 and summary["replayed"] == 0  # no CUDA here
    last = runs / f"step-{summary['steps'] - 1}.msgpack"
    report = json.loads(cpplan("inspect", last, "--json").stdout)
    assert report["cudagraph_size"] > 0
    assert cpplan("replay", last).returncode == 0


def test_simulate_shared_layers_sampled_rows_and_a_model_scale_match_the_oracle(tmp_path):
    """P = W = 2 gloo ranks: shared indexer layers, steps naming their sampled rows and a
    model's scale, against the oracle (which uses the same scale and selects a shared layer's
    keys with its source's inputs); a recorded step replays at the recorded scale."""
    runs = tmp_path / "runs"
    proc = cpplan("simulate", "--layers", "3", "--indexer-pattern", "FS", "--sampled-rows",
                  "--sm-scale", "0.0625", "--steps", "6", "--json", "--record", runs)
    assert proc.returncode == 0, proc.stderr
    summary = _last_json(proc.stdout)
    assert summary["ok"] is True and summary["max_abs_err"] <= summary["tolerance"]
    report = json.loads(cpplan("inspect", runs / "step-5.msgpack", "--json").stdout)
    assert report["config"]["indexer_sources"] == [0, 0, 2]
    names = {c["name"] for c in report["collectives"]}
    assert "sampled" in report and "restore" not in names  # never the full restore
    assert ("restore_sampled" in names) == bool(report["sampled"]["requests"])
    assert json.loads((runs / "replay.json").read_text())["sm_scale"] == 0.0625
    assert cpplan("replay", runs / "step-5.msgpack").returncode == 0
