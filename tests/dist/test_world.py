"""Spawned gloo worlds (reused across cases): PCP x DCP steps equal the single-device oracle,
the ledger equals the plan every step, divergence stops every rank before any data collective,
a killed rank is named within the timeout.

Tolerance: ranks and oracle pick the same keys (integer indexer inputs: exact scores, reference
order) and read the same dequantised rows; only float32 summation order differs (einsum
blocking, the W-way LSE merge), which moves outputs bounded by 1 by a few ulps (measured
~3e-7). TOLERANCE = 2e-5 leaves 60x margin and is still far below what one wrongly selected or
misplaced key does (order 1e-2 and up).
"""

from __future__ import annotations

import time

import pytest

from cpplan.sim.launch import World
from cpplan.sim.simulate import INJECT_KINDS, TOLERANCE, Inject, SimOptions, rank_main
from cpplan.schemas.errors import PlanMismatchError, RankLostError

TOPOLOGIES = {2: [(2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 2, 4)], 3: [(3, 3, 2)], 4: [(4, 4, 1)]}
STEPS = 10  # covers admissions incl. q = 1, 2, 3, chunked long prompts, several gather chunks


@pytest.fixture(scope="module")
def worlds():
    made = {}

    def get(n: int) -> World:
        if n not in made:
            made[n] = World(n, timeout_s=60)
        return made[n]

    yield get
    for w in made.values():
        w.close()


def _ok_values(results):
    for r in results:
        assert r.ok, f"rank {r.rank}: lost={r.lost} error={r.error!r}\n{r.tb}"
        assert "error" not in r.value, f"rank {r.rank}: {r.value}"
    return [r.value for r in results]


CASES = [(n, pwi, kv) for n, pwis in TOPOLOGIES.items() for pwi in pwis
         for kv in ("fp8_ds_mla", "bf16")]


@pytest.mark.parametrize("world_size,pwi,kv", CASES,
                         ids=[f"P{p}W{w}I{i}-{kv}" for _, (p, w, i), kv in CASES])
def test_steps_match_oracle_and_plan(worlds, world_size, pwi, kv):
    p, w, i = pwi
    opts = SimOptions(pcp=p, dcp=w, interleave=i, kv_cache_dtype=kv, steps=STEPS,
                      layers=1 if kv == "bf16" else 2, progress=False, timeout_s=20)
    values = _ok_values(worlds(world_size).run(rank_main, opts, timeout_s=240))
    s = values[0]
    assert s["steps"] == STEPS
    assert s["max_abs_err"] <= TOLERANCE
    # every step ran the ledger check (debug mode raises CollectiveLedgerError otherwise) and
    # the digest check passed on every step
    assert s["digest_checks"] == STEPS
    assert s["collectives"] > 0
    if w > 1:
        assert s["gather_chunks"] >= STEPS


@pytest.mark.parametrize("world_size,pwi,compact", [(2, (2, 2, 1), True), (3, (3, 3, 2), True),
                                                     (2, (2, 2, 1), 16), (3, (3, 3, 2), 8)])
def test_compacted_dcp_decode_matches_oracle(worlds, world_size, pwi, compact):
    """StepExecutor(dcp_compact=...): each rank's decode attention over its slots packed into
    compact_width(64, W) = 48 / 32 columns (True; rows holding more are rare here) or 16 / 8
    (most rows hold more: the overflow pass runs), plus the overflow pass, equals the
    single-device oracle."""
    p, w, i = pwi
    opts = SimOptions(pcp=p, dcp=w, interleave=i, steps=STEPS, layers=1, progress=False,
                      timeout_s=20, dcp_compact=compact)
    s = _ok_values(worlds(world_size).run(rank_main, opts, timeout_s=240))[0]
    assert s["steps"] == STEPS and s["max_abs_err"] <= TOLERANCE


def test_warmup_runs_on_every_rank_before_the_steps(worlds):
    """cpplan.warmup's synthetic steps are collective steps like any other (digest-checked,
    ledger-checked) on scratch caches: the real steps after them still match the oracle."""
    opts = SimOptions(pcp=2, dcp=2, steps=4, layers=1, progress=False, timeout_s=20, warmup=True)
    s = _ok_values(worlds(2).run(rank_main, opts, timeout_s=240))[0]
    assert s["steps"] == 4 and s["max_abs_err"] <= TOLERANCE
    assert s["digest_checks"] == 4 + 4  # the four warm-up steps, then the four real ones


@pytest.mark.parametrize("exchange", ["auto", "gloo"])  # auto: the shared-memory board here
@pytest.mark.parametrize("kind", INJECT_KINDS)
def test_divergence_stops_every_rank_before_any_collective(worlds, kind, exchange):
    opts = SimOptions(pcp=2, dcp=2, steps=3, layers=1, progress=False, timeout_s=20,
                      inject=Inject(step=2, rank=1, kind=kind), digest_exchange=exchange)
    t0 = time.monotonic()
    results = worlds(2).run(rank_main, opts, timeout_s=120)
    assert time.monotonic() - t0 < 60
    for r in results:
        assert r.ok, r.tb
        rec = r.value
        assert isinstance(rec["error"], PlanMismatchError), rec
        assert rec["step"] == 2 and rec["ledger"] == 0
        # two ranks, two digests: no majority, so neither rank is blamed
        assert "ranks [0] and [1] disagree" in str(rec["error"]), rec["error"]
        assert "step 2" in str(rec["error"]) and "first differing field" in str(rec["error"])


def test_divergence_majority_names_the_odd_rank(worlds):
    opts = SimOptions(pcp=3, dcp=3, interleave=2, steps=2, layers=1, progress=False,
                      timeout_s=20, inject=Inject(step=1, rank=2, kind="q+1"))
    for r in worlds(3).run(rank_main, opts, timeout_s=120):
        assert r.ok, r.tb
        err = r.value["error"]
        assert isinstance(err, PlanMismatchError) and "ranks [2]" in str(err)
        assert "num_scheduled_tokens" in str(err) and r.value["ledger"] == 0


@pytest.mark.parametrize("exchange", ["auto", "gloo"])
@pytest.mark.parametrize("fault", ["exit", "hang"])
def test_killed_rank_is_named_within_timeout(fault, exchange):
    """exit: the process dies (its sockets close; its pid ends); hang: it stays alive and silent
    with its connections open, so only the control timeout can catch it."""
    timeout = 5.0
    opts = SimOptions(pcp=3, dcp=3, steps=4, layers=1, progress=False, timeout_s=timeout,
                      kill=Inject(step=2, rank=1, kind=fault), digest_exchange=exchange)
    # hang: the peers answer after the control timeout while rank 1 still sleeps (2 x the
    # timeout); 1 s later it is declared lost (no answer) and close() ends it, instead of
    # waiting out its sleep. exit: no settle (rank 1's death is the first answer; the peers
    # may take up to timeout + 3 s after it)
    settle = 1.0 if fault == "hang" else None
    with World(3, timeout_s=60) as world:
        t0 = time.monotonic()
        results = world.run(rank_main, opts, timeout_s=120, settle_s=settle)
        took = time.monotonic() - t0
    assert results[1].lost
    for r in (results[0], results[2]):
        assert r.ok, r.tb
        err = r.value["error"]
        assert isinstance(err, RankLostError), err
        assert "ranks [1]" in str(err)
        assert r.value["elapsed_s"] < timeout + 3.0  # the control timeout + the naming grace
        assert r.value["ledger"] == 0
    assert took < 60
