"""Two-rank NCCL worlds on two GPUs (skipped with fewer): ``cpplan simulate --backend nccl``
against the oracle for each supported two-rank topology and both KV dtypes, with CUDA-graph
replay of the decode-only steps (their decode collectives captured inside the graphs), and an
injected divergence stopping both ranks before any data collective."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NVSHMEM_DISABLE_NVLS": "1"}

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def simulate(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cpplan", "simulate", "--backend", "nccl",
                           "--json", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=ENV)


@pytest.mark.parametrize("args", [
    ("--pcp", 2, "--dcp", 2),
    ("--pcp", 2, "--dcp", 2, "--interleave", 64, "--kv-cache-dtype", "bf16"),
    ("--pcp", 2, "--dcp", 2, "--interleave", 64),
    ("--pcp", 2, "--dcp", 2, "--kv-cache-dtype", "bf16"),
    ("--pcp", 2, "--dcp", 1),
    ("--pcp", 1, "--dcp", 2),
], ids=["p2w2", "p2w2i64-bf16", "p2w2i64", "p2w2-bf16", "p2w1", "p1w2"])
def test_simulate_over_nccl_with_graph_replay_matches_the_oracle(args):
    proc = simulate(*args, "--graphs", "--steps", 40)
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["ok"] is True and s["max_abs_err"] <= s["tolerance"]
    assert s["graph_steps"] >= 2 and s["replayed"] >= 1, s  # some decode steps were replayed


def test_injected_divergence_over_nccl_stops_both_ranks_before_any_data_collective():
    proc = simulate("--steps", 6, "--inject-divergence", "3:1:reorder")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "(ledger 0 collectives" in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"] is False
