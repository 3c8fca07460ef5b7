"""`cpplan simulate` and bench/step_gpu.py as ranks of a real torchrun world (gloo, CPU).

torchrun itself exits 1 when any rank fails and lists each failed rank's exit code in its
report ("exitcode  : 3"); the ranks' own exit codes are read from that report.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIM_KEYS = {"steps", "tokens", "max_abs_err", "collectives", "digest_checks", "ok"}


def torchrun(nproc: int, *args, timeout: float = 120.0,
             monitor_s: float = 0.1) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), "--monitor-interval", str(monitor_s),
                           *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def rank_exit_codes(stderr: str) -> list[int]:
    """Per-rank exit codes from torchrun's failure report ("exitcode  : 3 (pid: ...)")."""
    return [int(c) for c in re.findall(r"exitcode\s+:\s*(-?\d+)", stderr)]


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_simulate_as_torchrun_ranks_matches_oracle():
    proc = torchrun(2, "-m", "cpplan", "simulate", "--steps", 4, "--json")
    assert proc.returncode == 0, proc.stderr
    s = last_json(proc.stdout)
    assert SIM_KEYS <= set(s)
    assert s["ok"] is True and s["steps"] == 4 and s["digest_checks"] == 4
    assert s["collectives"] > 0 and s["max_abs_err"] <= s["tolerance"]
    assert len(proc.stdout.strip().splitlines()) == 1  # rank 0 alone prints
    assert "(gloo, torchrun)" in proc.stderr and "step   3/4" in proc.stderr


def test_simulate_torchrun_divergence_exits_3_on_every_rank():
    # torchrun ends the other ranks once it sees one fail: polling every 2 s lets every rank
    # reach its own exit code first, so the report shows each one
    proc = torchrun(2, "-m", "cpplan", "simulate", "--steps", 3, "--json",
                    "--inject-divergence", "1:1:reorder", monitor_s=2)
    assert proc.returncode != 0
    for rank in (0, 1):  # each rank says the two ranks disagree, before any data collective
        assert re.search(rf"rank {rank} at step 1 \(ledger 0 collectives.*PlanMismatchError.*"
                         r"ranks \[0\] and \[1\] disagree", proc.stderr), proc.stderr
    assert sorted(rank_exit_codes(proc.stderr)) == [3, 3], proc.stderr
    out = last_json(proc.stdout)
    assert out["ok"] is False and out["exit_code"] == 3 and out["rank"] == 0


def test_simulate_torchrun_world_size_mismatch_exits_2_in_one_line():
    proc = torchrun(1, "-m", "cpplan", "simulate", "--pcp", 2, "--dcp", 2)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "cpplan simulate: error" in ln]
    assert len(lines) == 1 and "needs max(P, W) = 2" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr.split("cpplan simulate: error")[0]
    assert rank_exit_codes(proc.stderr) == [2]


def _bench_module(monkeypatch):
    spec = importlib.util.spec_from_file_location("step_gpu", ROOT / "bench" / "step_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "step_gpu", mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


BENCH_KEYS = {"per_layer_ms", "phases", "step_ms", "digest_us", "exchange_ms", "bind_host_ms",
              "instrumented_ms"}


def test_bench_step_gpu_tiny_world_1(capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    bench = _bench_module(monkeypatch)
    assert bench.main(["--tiny", "--repeat", "1", "--layers", "1", "--json"]) == 0
    out = last_json(capsys.readouterr().out)
    assert BENCH_KEYS <= set(out) and out["world"] == 1 and out["exchange_ms"] is None
    assert len(out["per_layer_ms"]) == 1 and out["per_layer_ms"][0][out["phases"].index(
        "attention")] > 0


def test_bench_step_gpu_indexer_tiles(capsys, monkeypatch):
    """--indexer-tiles: IndexerTiles fields of their own types; a bad field or value, or a
    kernel set without the tiled indexer, is one error line, not a traceback."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    bench = _bench_module(monkeypatch)
    assert bench._indexer_tiles("split_rows=0,programs_per_sm=4,filter_margin=2.5") == {
        "split_rows": 0, "programs_per_sm": 4, "filter_margin": 2.5}
    for bad, said in (("nope=1", "one of IndexerTiles' fields: got 'nope=1'"),
                      ("programs_per_sm=x", "programs_per_sm expects int: got 'x'"),
                      ("split_rows", "FIELD=VALUE")):
        with pytest.raises(SystemExit):
            bench.parse_args(["--tiny", "--indexer-tiles", bad])
        assert said in capsys.readouterr().err
    assert bench.main(["--tiny", "--repeat", "1", "--layers", "1",
                       "--indexer-tiles", "split_rows=0"]) == 2  # CPU: the reference set
    err = capsys.readouterr().err
    assert "--indexer-tiles applies to the Triton kernel set's tiled indexer" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("pw", [2])
def test_bench_step_gpu_tiny_under_torchrun(pw):
    proc = torchrun(pw, "bench/step_gpu.py", "--tiny", "--pcp", pw, "--dcp", pw,
                    "--repeat", 1, "--layers", 1, "--json")
    assert proc.returncode == 0, proc.stderr
    out = last_json(proc.stdout)
    assert out["world"] == pw and out["exchange_ms"] > 0
    phases = dict(zip(out["phases"], out["per_layer_ms"][0]))
    assert phases["gather"] > 0 and phases["merge"] > 0 and phases["insert"] > 0
