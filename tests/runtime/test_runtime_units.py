"""Runtime unit tests: collective compat, ledger check, LSE merge, arena ring, divergence
naming, no-sync static check (each against a simple reference). Replay against the oracle:
tests/sim."""

from __future__ import annotations

import ast
import datetime
import pathlib
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist

import cpplan.runtime
import cpplan.sim
from cpplan.planner.compile import compile as compile_plan
from cpplan.runtime import collectives as coll
from cpplan.runtime.arena import ArenaRing
from cpplan.runtime.kernels.reference import lse_merge_weight
from cpplan.runtime.verify import divergent_ranks, first_difference
from cpplan.schemas import CapacityError, CollectiveLedgerError, StepInput
from cpplan.sim.simulate import SimOptions, perturb, preset_config

RUNTIME = pathlib.Path(cpplan.runtime.__file__).resolve().parent
SIM = pathlib.Path(cpplan.sim.__file__).resolve().parent
# modules whose code runs inside a step (bind excepted: host numpy by design); the harness's
# model and input generator run inside the simulated step too
STEP_MODULES = (RUNTIME / "executor.py", RUNTIME / "passes.py", RUNTIME / "bound.py",
                RUNTIME / "selection.py", RUNTIME / "collectives.py", RUNTIME / "arena.py",
                RUNTIME / "faults.py",
                SIM / "model.py", SIM / "coords.py")
FORBIDDEN = {"item", "cpu", "tolist", "synchronize"}
NAMED_WAIT = "wait_arena_free"


def _config(p=2, w=2, i=1, kv="fp8_ds_mla", layers=1):
    return preset_config(SimOptions(pcp=p, dcp=w, interleave=i, kv_cache_dtype=kv,
                                    layers=layers))


def _step():
    return StepInput.build(4, ["a", "b", "c", "d", "e"], [100, 0, 160, 0, 5],
                           [1, 3, 40, 200, 1], [False, True, True, True, False])


# ------------------------------------------------------------------ collectives
@pytest.fixture(scope="module")
def solo_world():
    with tempfile.NamedTemporaryFile() as f:
        store = dist.FileStore(f.name, 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        yield
        dist.destroy_process_group()


def test_all_gather_compat_runs_without_deprecation_warning(solo_world):
    inp = torch.arange(6, dtype=torch.uint8).reshape(3, 2)
    out = torch.empty_like(inp)
    coll.all_gather_tensor(out, inp)  # warnings are errors in this suite
    assert torch.equal(out, inp)
    want = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    assert coll._ALL_GATHER is want


def test_ledger_check_names_the_first_difference():
    plan = compile_plan(_config(), _step())
    ledger = coll.Ledger()
    for e in coll.expected_ledger(plan):
        ledger.record(e.name, e.op, e.group, e.dtype, e.shape)
    coll.check_ledger(plan, ledger, rank=0)
    ledger.entries[2] = coll.LedgerEntry("kv_gather[0]", "all_gather", "dcp", "uint8", (1, 656))
    with pytest.raises(CollectiveLedgerError, match="collective #2"):
        coll.check_ledger(plan, ledger, rank=0)
    ledger.entries.pop()
    with pytest.raises(CollectiveLedgerError):
        coll.check_ledger(plan, ledger, rank=0)


def test_expected_ledger_repeats_per_layer_entries():
    plan = compile_plan(_config(layers=3), _step())
    per_layer = [c for c in plan.collectives if c.per_layer]
    seq = coll.expected_ledger(plan)
    assert len(seq) == 3 * len(per_layer) + 1 and seq[-1].name == "restore"


# ------------------------------------------------------------------ LSE merge
def test_lse_merge_weight_is_exact_and_nan_free():
    torch.manual_seed(0)
    w_size, nd, h, n = 3, 4, 2, 7
    scores = torch.randn(w_size, nd, h, n, dtype=torch.float64)
    scores[1, 0] = float("-inf")  # rank 1 owns no key for row 0
    scores[:, 1] = float("-inf")  # row 1 has no key anywhere
    values = torch.randn(w_size, n, 5, dtype=torch.float64)
    lse = torch.logsumexp(scores, dim=-1)
    parts = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    outs = torch.einsum("wthk,wkd->wthd", parts, values)
    merged = sum(lse_merge_weight(lse, r).double()[..., None] * outs[r] for r in range(w_size))
    full = torch.cat(list(scores), dim=-1)
    ref = torch.einsum("thk,kd->thd", torch.nan_to_num(torch.softmax(full, -1), nan=0.0),
                       torch.cat(list(values), dim=0))
    assert not torch.isnan(merged).any()
    assert torch.allclose(merged, ref, atol=1e-6)  # weights are float32
    assert torch.all(merged[1] == 0)


# ------------------------------------------------------------------ arena
def test_arena_ring_packs_and_refuses_overflow_with_numbers():
    ring = ArenaRing(16, torch.device("cpu"), depth=2)
    v1 = ring.pack({"a": np.arange(5), "b": np.arange(3) + 10}, step_id=1)
    assert v1["a"].tolist() == [0, 1, 2, 3, 4] and v1["b"].tolist() == [10, 11, 12]
    v2 = ring.pack({"a": np.arange(4) + 7}, step_id=2)
    assert v1["a"].tolist() == [0, 1, 2, 3, 4]  # the other arena: step 1's views still intact
    assert v2["a"].tolist() == [7, 8, 9, 10]
    with pytest.raises(CapacityError, match="needs 17 arena words, capacity 16"):
        ring.pack({"big": np.zeros(17, np.int64)}, step_id=3)


# ------------------------------------------------------------------ verify helpers
@pytest.mark.parametrize("digests,bad", [
    ([b"a", b"b"], [1]), ([b"a", b"a", b"b"], [2]), ([b"b", b"a", b"a"], [0]),
    ([b"a", b"b", b"b", b"a"], [1, 2]), ([b"a", b"b", b"c"], [1, 2]),
])
def test_divergent_ranks_majority_then_rank0(digests, bad):
    assert divergent_ranks(digests)[0] == bad


@pytest.mark.parametrize("kind,field", [("reorder", "req_ids[0]"), ("q+1",
                         "num_scheduled_tokens[0]"), ("drop", "req_ids (length"),
                         ("config", "config.gather_workspace_tokens"), ("step-id", "step_id")])
def test_first_difference_names_the_field(kind, field):
    cfg = _config()
    step = _step()
    other_step, other_cfg = perturb(step, cfg, kind)
    diff = first_difference(compile_plan(other_cfg, other_step), compile_plan(cfg, step))
    assert diff.startswith(field), diff


# ------------------------------------------------------------------ static no-sync check
def _forbidden_calls(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    bad = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else func
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) \
                    and child.func.attr in FORBIDDEN and func != NAMED_WAIT:
                bad.append(f"{path.name}:{child.lineno} .{child.func.attr}() in {func}")
            visit(child, name)

    visit(tree, "<module>")
    return bad


def test_step_code_has_no_host_sync():
    found = [b for m in STEP_MODULES for b in _forbidden_calls(m)]
    assert found == []


def test_static_check_catches_a_sync(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("def f(t):\n    return t.sum().item()\n"
                   "def wait_arena_free(e):\n    e.synchronize()\n")
    assert _forbidden_calls(src) == ["x.py:2 .item() in f"]


# ------------------------------------------------------------------ warm-up
@pytest.mark.parametrize("max_tokens,max_requests,graphs", [
    (8192, 1024, ()), (64, 16, (8, 16, 32, 64, 128)), (16, 1, (4, 8)), (300, 4, (256, 512))])
def test_warmup_steps_fit_the_executor(max_tokens, max_requests, graphs):
    """The synthetic steps compile for the config and fit the executor's capacities (tokens per
    rank after padding, requests), whatever the graph sizes; one-request executors get only
    one-request steps."""
    from cpplan.planner.compile import compile as compile_plan
    from cpplan.schemas import ParallelConfig
    from cpplan.warmup import warmup_steps

    cfg = ParallelConfig(pcp_size=2, dcp_size=2, num_heads=8, topk=64, index_num_heads=4,
                         max_model_len=1024, block_size=64, activation_dtype="float32",
                         num_layers=1, hidden_size=8 * 512, cudagraph_token_sizes=graphs)
    steps = warmup_steps(cfg, max_tokens, max_requests)
    assert len(steps) == (4 if max_requests >= 2 else 2)
    for step in steps:
        plan = compile_plan(cfg, step)
        assert plan.padded_num_tokens <= max_tokens and plan.num_requests <= max_requests


@pytest.mark.parametrize("mml,dcp", [(1024, 2), (16385, 1), (20000, 1), (131072, 2), (40000, 4)])
def test_warmup_has_long_decode_rows_where_the_config_allows_them(mml, dcp):
    """Rows of LONG_DECODE_KEYS keys a rank take other indexer variants: the warm-up has two such
    decodes (or as long as max_model_len allows) exactly when max_model_len exceeds that, and
    the threshold is the Triton set's balanced-logits one."""
    from cpplan.planner.compile import compile as compile_plan
    from cpplan.runtime.kernels.triton.indexer_tiled import IndexerTiles
    from cpplan.schemas import ParallelConfig
    from cpplan.warmup import LONG_DECODE_KEYS, warmup_steps

    assert LONG_DECODE_KEYS == IndexerTiles().decode_balanced_keys
    cfg = ParallelConfig(pcp_size=dcp, dcp_size=dcp, num_heads=8, topk=64, index_num_heads=4,
                         max_model_len=mml, block_size=64, activation_dtype="float32",
                         num_layers=1, hidden_size=8 * 512)
    steps = warmup_steps(cfg, 8192, 64)
    longest = max(int(s.num_computed_tokens.np().max()) for s in steps)
    if mml - 1 > LONG_DECODE_KEYS:
        assert len(steps) == 5 and longest == min(mml - 1, LONG_DECODE_KEYS * dcp)
        plan = compile_plan(cfg, steps[-1])
        local = plan.dcp_local_lens.np().max()
        assert local >= min(LONG_DECODE_KEYS, (mml - 1) // dcp)
    else:
        assert len(steps) == 4 and longest < LONG_DECODE_KEYS


@pytest.mark.parametrize("w,i,want", [(2, 1, 48), (2, 2, 64), (1, 1, 64), (3, 1, 32)])
def test_dcp_compact_auto_packs_where_keys_alternate_token_by_token(w, i, want):
    """dcp_compact="auto" (the default): the decode pass's index width is compact_width(topk,
    W) where W > 1 and interleave_size == 1, topk (the masked pass) otherwise."""
    from cpplan.runtime.executor import StepExecutor

    cfg = _config(p=max(w, 2), w=w, i=i)  # topk 64
    ex = StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=None, device="cpu")
    assert ex.decode_width == want
    assert StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=None, device="cpu",
                        dcp_compact=False).decode_width == 64


def test_dcp_compact_unknown_value_is_a_config_error():
    from cpplan.runtime.executor import StepExecutor
    from cpplan.schemas.errors import ConfigError

    with pytest.raises(ConfigError, match=r"dcp_compact: got 'yes', expected 'auto'"):
        StepExecutor(_config(p=2, w=2), sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=None, device="cpu",
                     dcp_compact="yes")


@pytest.mark.parametrize("bad", [0, -3, 65])
def test_dcp_compact_width_out_of_range_is_a_config_error(bad):
    from cpplan.runtime.executor import StepExecutor
    from cpplan.schemas.errors import ConfigError

    cfg = _config(p=2, w=2)  # topk 64
    with pytest.raises(ConfigError, match=r"dcp_compact width: got -?\d+, expected 1\.\.64"):
        StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=None, device="cpu", dcp_compact=bad)
