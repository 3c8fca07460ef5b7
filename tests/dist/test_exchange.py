"""The digest exchange (runtime/exchange.py): the shared-memory board and the gloo all-gather
hand every rank every rank's row, exchange after exchange, under skewed arrival; a torn or
stale slot is never taken; a dead peer ends the wait at once and a silent one at the timeout;
ranks that cannot share a board fall back to gloo (auto) or refuse (shm), leaving nothing in
/dev/shm.

The reference for the rows is the job's own formula for what rank r sends at exchange i,
computed independently on every rank."""

from __future__ import annotations

import mmap
import os
import random
import subprocess
import sys
import time

import pytest
import xxhash

from cpplan.runtime import exchange as xch
from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.errors import ConfigError
from cpplan.sim.launch import World

ROUNDS = 300


def _row(rank: int, i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"{rank}/{i}".encode()) + bytes([(rank + i) % 256])


def _groups(ctx):
    from cpplan.runtime.groups import Groups

    cfg = ParallelConfig(pcp_size=ctx.world_size, dcp_size=ctx.world_size)
    return Groups.build(cfg, store=ctx.store, control_timeout_s=20.0)


def _exchange_rounds(ctx, kind: str):
    g = _groups(ctx)
    ex = xch.open_exchange(g, kind)
    rng = random.Random(ctx.rank)
    bad = []
    for i in range(ROUNDS):
        if rng.random() < 0.3:  # arrive late by up to 2 ms: the others poll, then sleep
            time.sleep(rng.random() * 2e-3)
        rows = ex.start(_row(ctx.rank, i)).wait(20.0)
        if rows != [_row(r, i) for r in range(ctx.world_size)]:
            bad.append(i)
    ex.close()
    return ex.kind, bad


def _outstanding_rounds(ctx, ahead: int):
    """Every rank starts ``ahead`` exchanges before it waits for the first (bound steps in
    flight), rank 1 late, then keeps that distance: rows must still meet."""
    g = _groups(ctx)
    ex = xch.open_exchange(g, "shm")
    pending, bad = [], []
    for i in range(60 + ahead):
        if i < 60:
            if ctx.rank == 1 and i % 7 == 0:
                time.sleep(2e-3)
            pending.append((i, ex.start(_row(ctx.rank, i))))
        if len(pending) > ahead or i >= 60:
            j, p = pending.pop(0)
            if p.wait(20.0) != [_row(r, j) for r in range(ctx.world_size)]:
                bad.append(j)
    ex.close()
    return bad


@pytest.fixture(scope="module")
def world3():
    with World(3, timeout_s=60) as w:
        yield w


@pytest.mark.parametrize("kind,want", [("auto", "shm"), ("shm", "shm"), ("gloo", "gloo")])
def test_every_rank_gets_every_row_under_skew(world3, kind, want):
    before = _leftovers()
    for r in world3.run(_exchange_rounds, kind, timeout_s=120):
        assert r.ok, r.tb
        got_kind, bad = r.value
        assert got_kind == want and bad == [], (r.rank, got_kind, bad[:5])
    assert _leftovers() == before  # the board was unlinked once mapped


def _leftovers() -> set[str]:
    return {n for n in os.listdir(xch.SHM_DIR) if n.startswith("cpplan-digest-")}


def _no_board_on_rank_1(ctx, kind: str):
    g = _groups(ctx)
    original = xch.mmap.mmap  # the mmap module's own: the worker outlives this job
    if ctx.rank == 1:
        def refuse(*a, **k):
            raise OSError("not this host's memory")

        xch.mmap.mmap = refuse
    try:
        ex = xch.open_exchange(g, kind)
    except ConfigError as exc:
        return "ConfigError", str(exc)
    finally:
        xch.mmap.mmap = original
    rows = ex.start(_row(ctx.rank, 0)).wait(20.0)
    return ex.kind, rows == [_row(r, 0) for r in range(ctx.world_size)]


def test_ranks_without_a_shared_board_fall_back_or_refuse(world3):
    before = _leftovers()
    for r in world3.run(_no_board_on_rank_1, "auto", timeout_s=120):
        assert r.ok, r.tb
        assert r.value == ("gloo", True), r.value
    for r in world3.run(_no_board_on_rank_1, "shm", timeout_s=120):
        assert r.ok, r.tb
        kind, msg = r.value
        assert kind == "ConfigError" and "expected all ranks of the control group on one host" \
            in msg, r.value
    assert _leftovers() == before


# ---------------------------------------------------------------------------- one process
def _board(size: int, pids: list[int], check_pids: bool = True) -> xch.SharedMemoryExchange:
    nbytes = size * (xch.HEADER_BYTES + xch.ROWS * xch.SLOT_BYTES)
    return xch.SharedMemoryExchange(mmap.mmap(-1, nbytes), 0, size, pids, check_pids)


def _write(ex, rank: int, count: int, row: bytes, good_hash: bool = True) -> None:
    body = count.to_bytes(8, "little") + row
    h = xxhash.xxh64_digest(body if good_hash else body + b"x")
    at = ex._slot(count % xch.ROWS, rank)
    ex.board[at: at + len(body) + 8] = body + h


def test_a_torn_or_stale_slot_is_not_taken():
    ex = _board(2, [os.getpid()] * 2)
    n = 5 + xch.ROWS
    row = _row(1, n)
    assert ex.read(n, 1, len(row)) is None  # nothing written yet
    _write(ex, 1, n, row, good_hash=False)  # torn: the hash does not match the bytes read
    assert ex.read(n, 1, len(row)) is None
    _write(ex, 1, n - xch.ROWS, row)  # stale: the same row of slots ROWS exchanges ago
    assert ex.read(n, 1, len(row)) is None
    _write(ex, 1, n, row)
    assert ex.read(n, 1, len(row)) == row


def test_a_dead_peer_ends_the_wait_at_once_a_silent_one_at_the_timeout():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: its pid no longer exists
    ex = _board(2, [os.getpid(), proc.pid])
    t0 = time.monotonic()
    with pytest.raises(xch.ExchangeTimeout) as info:
        ex.start(_row(0, 0)).wait(30.0)
    assert time.monotonic() - t0 < 2.0
    assert info.value.ranks == [1] and info.value.gone
    assert "ranks [1] exited" in str(info.value)

    ex = _board(3, [os.getpid()] * 3)  # alive (our own pid) but silent
    _write(ex, 2, 1, _row(2, 0))  # rank 2 answered, rank 1 never does
    t0 = time.monotonic()
    with pytest.raises(xch.ExchangeTimeout) as info:
        ex.start(_row(0, 0)).wait(0.3)
    took = time.monotonic() - t0
    assert 0.3 <= took < 2.0, took
    assert info.value.ranks == [1] and not info.value.gone
    assert "within 0.3 s" in str(info.value)


def test_a_zombie_counts_as_gone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while xch._process_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # exited, not yet reaped: state Z in /proc
    assert not xch._process_alive(proc.pid)
    assert xch._process_alive(os.getpid())
    proc.wait()


def test_unknown_kind_is_a_config_error():
    with pytest.raises(ConfigError, match="expected one of"):
        xch.open_exchange(None, "nccl")


def test_exchanges_outstanding_up_to_the_arena_bound(world3):
    for r in world3.run(_outstanding_rounds, xch.ROWS - 2, timeout_s=120):
        assert r.ok, r.tb
        assert r.value == [], r.value


def test_arena_depth_beyond_the_board_is_refused():
    from cpplan.runtime.executor import StepExecutor
    from cpplan.schemas.config import ParallelConfig

    with pytest.raises(ConfigError, match=f"arena_depth: got {xch.ROWS - 1}, expected at most"):
        StepExecutor(ParallelConfig(), sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=None, device="cpu",
                     arena_depth=xch.ROWS - 1)


def _lost_before_the_row_is_reread(ctx):
    """Rank 1 stops taking part after exchange 1 (it never awaits it); rank 0 keeps binding:
    when its slot would be rewritten it waits for rank 1's acknowledgement and, rank 1 being
    silent, gets a RankLostError from the check's start (bind) naming it, not a hang."""
    from cpplan.planner.compile import compile as compile_plan
    from cpplan.runtime.faults import FaultBoard
    from cpplan.runtime.verify import DigestCheck
    from cpplan.schemas.errors import RankLostError
    from cpplan.schemas.step import StepInput

    g = _groups(ctx)
    g.control_timeout_s = 1.0
    check = DigestCheck(g, "every", board=FaultBoard(g), exchange="shm")
    plan = compile_plan(g.config, StepInput.build(1, ["a"], [10], [1], [False]))
    first = check.start(plan)
    if ctx.rank == 1:
        time.sleep(6)  # silent: never awaits exchange 1, never starts another
        return "silent"
    first.wait()
    try:
        for _ in range(xch.ROWS):
            check.start(plan)  # rank 0 alone: its slot for #1 is still unread by rank 1
    except RankLostError as exc:
        return str(exc)
    return "no error"


def test_a_rank_that_never_reads_ends_the_writer_s_wait_with_rank_lost():
    with World(2, timeout_s=60) as w:
        res = w.run(_lost_before_the_row_is_reread, timeout_s=60)
    assert res[1].ok and res[1].value == "silent", res[1]
    assert res[0].ok, res[0].tb
    assert "ranks [1]" in res[0].value and "digest check" in res[0].value, res[0].value


def test_more_checks_outstanding_than_the_board_holds_is_a_usage_error():
    from cpplan.schemas.errors import UsageError

    ex = _board(1, [os.getpid()])
    pending = [ex.start(_row(0, i)) for i in range(xch.ROWS)]
    with pytest.raises(UsageError, match=f"expected at most {xch.ROWS - 1} outstanding"):
        ex.start(_row(0, xch.ROWS))
    assert pending[0].wait(1.0) == [_row(0, 0)]  # awaiting the oldest makes room
    assert ex.start(_row(0, xch.ROWS)).wait(1.0) == [_row(0, xch.ROWS)]


def _adopt_without_control(ctx):
    import torch.distributed as dist

    from cpplan.runtime.groups import Groups

    cfg = ParallelConfig(pcp_size=ctx.world_size, dcp_size=ctx.world_size)
    data = dist.new_group(list(range(ctx.world_size)))
    try:
        Groups.adopt(cfg, pcp_group=data, dcp_group=data, control_group=None, device="cpu",
                     store=ctx.store)
    except ConfigError as exc:
        return str(exc)
    return None


def test_adopt_refuses_a_world_without_a_control_group(world3):
    """Groups without a control group could run no digest check: the build refuses (it used
    to build, and a divergent rank then entered the data collectives)."""
    for r in world3.run(_adopt_without_control, timeout_s=60):
        assert r.ok, r.tb
        assert "control_group: got None for a world of 3 ranks" in r.value


@pytest.fixture(scope="module")
def world2():
    with World(2, timeout_s=60) as w:
        yield w


def _build_with(ctx, settings: dict, skip_rank: int | None = None):
    """Every rank builds an executor with its own ``settings[rank]`` (``skip_rank`` builds
    none: it failed before from_groups); returns (error type, message) or None."""
    from cpplan.runtime.executor import StepExecutor
    from cpplan.runtime.groups import Groups

    cfg = ParallelConfig(pcp_size=2, dcp_size=2, num_heads=8, topk=16, index_num_heads=4,
                         max_model_len=1024, **settings[ctx.rank].pop("config", {}))
    groups = Groups.build(cfg, store=ctx.store, control_timeout_s=3.0)
    if ctx.rank == skip_rank:
        time.sleep(5.0)  # alive, silent: its peer's set-up must end at the control timeout
        return None
    try:
        ex = StepExecutor.from_groups(cfg, groups, sm_scale=0.1, max_tokens=64,
                                      max_requests=4, **settings[ctx.rank])
    except Exception as exc:  # noqa: BLE001 - the test compares the typed error
        return type(exc).__name__, str(exc)
    ex.check.close()
    return None


@pytest.mark.parametrize("settings,words", [
    ([{"digest_exchange": "shm"}, {"digest_exchange": "gloo"}], "ranks [1] were built with"),
    ([{"verify": "every"}, {"verify": "off"}], "ranks [1] were built with"),
    ([{}, {"config": {"gather_workspace_tokens": 4096}}], "another config or other options"),
], ids=["exchange", "verify", "config"])
def test_executors_built_differently_are_refused_on_every_rank(world2, settings, words):
    """Ranks that set up different exchanges (or one none) used to meet in mismatched
    collectives (gloo's raw timeout or abort) and leave the board in /dev/shm."""
    before = _leftovers()
    for r in world2.run(_build_with, settings, timeout_s=60):
        assert r.ok, r.tb
        assert r.value is not None and r.value[0] == "ConfigError" and words in r.value[1]
    assert _leftovers() == before


def test_a_peer_that_never_builds_is_a_rank_lost_error_and_nothing_leaks(world2):
    before = _leftovers()
    results = world2.run(_build_with, [{}, {}], 1, timeout_s=60)
    assert results[0].ok and results[0].value[0] == "RankLostError", results[0]
    assert "did not take part within the control timeout (3 s)" in results[0].value[1]
    assert _leftovers() == before


def _diverge(ctx, how: str, exchange: str, at: int):
    """Groups built ``how``, an executor with verify='every' and ``exchange``; rank 1 compiles
    another step ``at`` (one more token). Returns (step, error type, collectives issued in
    that step) on each rank, or None if nothing was raised."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from cpplan.api import LayerCache, StepExecutor, StepInput, compile
    from cpplan.runtime.groups import Groups

    cfg = ParallelConfig(pcp_size=2, num_heads=8, topk=16, index_num_heads=4, num_layers=1,
                         hidden_size=64, activation_dtype="float32", max_model_len=512)
    if how == "build":
        groups = Groups.build(cfg, store=ctx.store, control_timeout_s=10.0)
    elif how == "from_env":
        groups = Groups.from_env(cfg, control_timeout_s=10.0)
    else:
        ranks = list(range(ctx.world_size))
        data, control = dist.new_group(ranks), dist.new_group(ranks, backend="gloo")
        groups = Groups.adopt(cfg, pcp_group=data, dcp_group=None, control_group=control,
                              device="cpu", store=ctx.store if how == "adopt" else None,
                              control_timeout_s=10.0)
    ex = StepExecutor.from_groups(cfg, groups, sm_scale=0.1, verify="every",
                                  digest_exchange=exchange, max_tokens=128, max_requests=4)
    cache = LayerCache.empty(cfg, 8, "cpu")
    for step_id in range(4):
        q = 20 + step_id + (1 if step_id == at and ctx.rank == 1 else 0)
        plan = compile(cfg, StepInput.build(step_id, [f"s{step_id}"], [0], [q], [True]))
        bound = ex.bind(plan, np.array([[1]], np.int32), 8)
        t = plan.padded_num_tokens
        try:
            ex.insert(bound, cache, torch.zeros(t, 576), torch.zeros(t, 128))
            ex.attend(bound, cache, torch.zeros(t, 8, 576), torch.zeros(t, 4, 128),
                      torch.zeros(t, 4))
            ex.restore(bound, torch.zeros(t, 64))
            ex.finish(bound)
        except Exception as exc:  # noqa: BLE001 - compared by the test
            return step_id, type(exc).__name__, len(bound.ledger)
    ex.check.close()
    return None


@pytest.mark.parametrize("how", ["build", "from_env", "adopt", "adopt-no-store"])
@pytest.mark.parametrize("exchange", ["auto", "shm", "gloo"])
def test_every_way_of_building_runs_the_check_on_every_step(world2, how, exchange):
    """The digest promise, over every public way of building groups and every exchange: the
    divergent step stops both ranks with PlanMismatchError before any data collective (the
    one way that could not run a check, adopt without a control group, is refused at
    construction: test_adopt_refuses_a_world_without_a_control_group)."""
    at = 1 + (len(how) + len(exchange)) % 3  # the divergent step varies over the cases
    for r in world2.run(_diverge, how, exchange, at, timeout_s=120):
        assert r.ok, r.tb
        assert r.value == (at, "PlanMismatchError", 0), (r.rank, r.value)
