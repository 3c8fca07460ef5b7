"""Failures on one rank, seen from the others (spawned gloo worlds, two ranks on the CPU).

- A rank that raises locally (bind, insert, attend) announces it on the control plane: its peer
  stops with PeerFailedError naming the rank and its error, within the control timeout (it
  would otherwise block in its next collective until the 120 s data timeout).
- ``cpplan simulate`` ends in bounded time when a rank dies or is stopped, with one line per
  rank and no traceback; interrupting or killing the parent leaves no worker traceback.

Short timeouts keep the module under a minute.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cpplan.cli import simulate_cmd
from cpplan.runtime.faults import one_line
from cpplan.schemas.errors import (CollectiveLedgerError, PeerFailedError, RankLostError,
                                   StepInputError)
from cpplan.sim.launch import World
from cpplan.sim.simulate import Inject, SimOptions, rank_main

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 5.0  # the control timeout of the cases here; the data timeout stays at 120 s
# the lost-rank cases wait it out twice (the peers' wait, then the settle time for the rest):
# 3 s, as tests/dist/test_exchange.py's worlds, keeps that wait short
LOST_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def world2():
    """One two-rank world for the local-failure and mid-step cases: a failure ends the job on
    both ranks, never the world (each job builds its own groups); about 4 s of CPU a rank to
    start, once instead of per case."""
    with World(2, timeout_s=60) as world:
        yield world


@pytest.mark.parametrize("where,verify,rank", [
    ("bind", "every", 1), ("bind", "off", 1), ("insert", "every", 1), ("attend", "every", 1),
    ("skip-attend", "every", 1), ("insert", "every", 0), ("attend", "every", 0),
    ("restore", "every", 1), ("restore", "every", 0)])
def test_local_failure_stops_the_peer_naming_the_rank(world2, where, verify, rank):
    shm = {n for n in os.listdir("/dev/shm") if n.startswith("cpplan-digest-")}
    opts = SimOptions(pcp=2, dcp=2, steps=3, layers=1, progress=False, timeout_s=TIMEOUT,
                      verify=verify, fail=Inject(step=2, rank=rank, kind=where))
    t0 = time.monotonic()
    results = world2.run(rank_main, opts, timeout_s=120)
    took = time.monotonic() - t0
    assert all(r.ok for r in results), [(r.rank, r.lost, r.tb) for r in results]
    values = [r.value for r in results]
    failed, peer = values[rank], values[1 - rank]
    assert {n for n in os.listdir("/dev/shm") if n.startswith("cpplan-digest-")} <= shm
    own = failed["error"]
    if where == "bind":
        assert isinstance(own, StepInputError) and "block_tables[0][0]" in str(own)
    elif where == "skip-attend":  # its restore was caught before it was issued: gloo aborted
        assert isinstance(own, CollectiveLedgerError) and "would issue" in str(own)
        assert "name='restore'" in str(own) and str(own).endswith("not issued")
    elif where == "restore":  # a hidden of the wrong width, refused before the all-gather
        assert "restore: hidden is" in str(own) and failed["step"] == 2
    else:  # the malformed tensor fails inside the executor (kernel shape check or einsum)
        assert "576" in str(own) and failed["step"] == 2
    err = peer["error"]
    assert isinstance(err, PeerFailedError), err
    assert err.rank == rank and err.detail == one_line(own)
    assert f"rank {rank} failed in step 2" in str(err) and one_line(own) in str(err)
    assert peer["step"] == 2 and peer["elapsed_s"] < 2.0  # not the data timeout
    if where == "bind" and verify == "every":
        assert peer["ledger"] == 0  # stopped at the digest check, before any data collective
    assert took < 60


def _simulate(opts, capfd) -> tuple[int, float, list[str]]:
    t0 = time.monotonic()
    code = simulate_cmd._launch(opts, 2, as_json=False)
    took = time.monotonic() - t0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    return code, took, [ln for ln in err.splitlines() if ln.startswith("rank ")]


@pytest.mark.parametrize("kind", ["stop", "exit"])
def test_lost_rank_ends_simulate_in_bounded_time(kind, capfd):
    """stop: the rank SIGSTOPs itself (alive, silent); exit: its process dies. Before, a stopped
    rank kept `cpplan simulate` running for ~10 minutes."""
    opts = SimOptions(pcp=2, dcp=2, steps=4, layers=1, progress=False, timeout_s=LOST_TIMEOUT,
                      kill=Inject(step=1, rank=1, kind=kind))
    code, took, lines = _simulate(opts, capfd)
    assert code == RankLostError.exit_code
    assert len(lines) == 2, lines  # one line per rank
    assert lines[0].startswith("rank 0 at step 1") and "RankLostError: ranks [1]" in lines[0]
    want = "no answer" if kind == "stop" else "exited with code 17"
    assert lines[1].startswith("rank 1: RankLostError: rank 1 lost") and want in lines[1]
    # spawn + one step + the control timeout + the naming grace + the settle time for the rest
    assert took < 2 * LOST_TIMEOUT + 15, took


def test_simulate_names_the_failed_rank_and_exits_with_its_code(capfd):
    opts = SimOptions(pcp=2, dcp=2, steps=3, layers=1, progress=False, timeout_s=TIMEOUT,
                      fail=Inject(step=1, rank=0, kind="bind"))
    code, _, lines = _simulate(opts, capfd)
    assert code == StepInputError.exit_code  # the root cause's code, not the peer's 4
    assert "StepInputError" in lines[0] and "PeerFailedError: rank 0 failed" in lines[1]


def _start(*args) -> tuple[subprocess.Popen, list[str], threading.Event]:
    """`cpplan simulate` in the background; stderr lines collected until EOF (every writer,
    workers included, has closed it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "cpplan", "simulate", *args], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    lines, eof = [], threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
        eof.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 60
    while not any("step   1/" in ln for ln in lines) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any("step   1/" in ln for ln in lines), "".join(lines)
    return proc, lines, eof


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_stopping_the_parent_leaves_no_worker_traceback(how):
    proc, lines, eof = _start("--steps", "200", "--layers", "1")
    proc.send_signal(getattr(signal, how))
    assert eof.wait(20), "workers still hold stderr 20 s after the parent was stopped"
    proc.wait(10)
    proc.stderr.close()
    text = "".join(lines)
    assert "Traceback" not in text and "BrokenPipe" not in text, text
    if how == "SIGTERM":
        assert proc.returncode == 130 and "cpplan simulate: interrupted" in text


def _fail_mid_step(ctx, by_bound: bool):
    """Both ranks bind a prefill step (P = 2: kv_insert each layer); rank 1 inserts layer 0,
    then its engine fails and calls refuse; rank 0 goes on into layer 1's kv_insert. Returns
    (error type, message, seconds from rank 0's layer-1 insert to its error) or rank 1's."""
    import numpy as np
    import torch

    from cpplan.api import Groups, LayerCache, ParallelConfig, StepExecutor, StepInput, compile

    cfg = ParallelConfig(pcp_size=2, num_heads=8, topk=16, index_num_heads=4, num_layers=2,
                         hidden_size=64, activation_dtype="float32", max_model_len=512)
    groups = Groups.build(cfg, store=ctx.store, control_timeout_s=20.0)
    assert groups.timeout_s == 80.0  # the data timeout follows the control timeout
    ex = StepExecutor.from_groups(cfg, groups, sm_scale=0.1, max_tokens=128, max_requests=4)
    plan = compile(cfg, StepInput.build(0, ["a"], [0], [40], [True]))
    bound = ex.bind(plan, np.array([[1]], np.int32), 4)
    t = plan.padded_num_tokens
    caches = [LayerCache.empty(cfg, 4, "cpu") for _ in range(2)]
    ex.insert(bound, caches[0], torch.zeros(t, 576), torch.zeros(t, 128))
    if ctx.rank == 1:
        try:
            ex.refuse(bound if by_bound else plan, MemoryError("no memory for layer 1"))
        except MemoryError as exc:
            return "MemoryError", str(exc), 0.0
        return None
    t0 = time.monotonic()
    try:
        ex.insert(bound, caches[1], torch.zeros(t, 576), torch.zeros(t, 128))
    except Exception as exc:  # noqa: BLE001 - compared by the test
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None


@pytest.mark.parametrize("by_bound", [False, True], ids=["plan", "bound"])
def test_a_failure_mid_step_reaches_the_peer_within_a_second(world2, by_bound):
    """refuse after bind (the engine failed between its own calls): the peer in the next
    collective raises PeerFailedError naming rank 1 within 2 s (it used to wait out the data
    timeout and get RankLostError, and refuse blamed the healthy rank)."""
    r0, r1 = world2.run(_fail_mid_step, by_bound, timeout_s=120)
    assert r0.ok and r1.ok, (r0.tb, r1.tb)
    assert r1.value[:2] == ("MemoryError", "no memory for layer 1")
    kind, message, seconds = r0.value
    assert kind == "PeerFailedError" and "rank 1" in message and "no memory" in message
    assert seconds < 2.0
