"""Per-step tables and bind, tested directly on CPU against a token-by-token derivation.

The reference below walks every token of every row with the sharding rule written out
(owner = (t // I) % W, local = (t // (W I)) I + t % I, counted by brute force), independently of
``schemas/sharding.py``, ``runtime/segments.py`` and ``runtime/tables.py``; the plan's row arrays are its only input from
the code under test (the planner is checked against its own reference in tests/planner).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
import torch.utils._python_dispatch

from cpplan.planner import compile as compile_plan
from cpplan.runtime.arena import arena_words
from cpplan.runtime.executor import DUMMY_SLOT, LayerCache, StepExecutor
from cpplan.runtime.segments import build_tables, check_block_tables
from cpplan.schemas import (
    CapacityError,
    ConfigError,
    ParallelConfig,
    StepInput,
    StepInputError,
    TensorArgError,
    UsageError,
)
from cpplan.schemas.arrays import Array
from cpplan.schemas.errors import PlanFormatError

BLOCK = 64


def _config(p, w, i):
    return ParallelConfig(pcp_size=p, dcp_size=w, interleave_size=i, num_heads=8, topk=64,
                          index_num_heads=4, max_model_len=2048, gather_workspace_tokens=0,
                          block_size=BLOCK, activation_dtype="float32", num_layers=1,
                          hidden_size=8 * 512)


def _step(seed: int) -> StepInput:
    rng = np.random.default_rng(seed)
    n = 9
    pre = rng.random(n) < 0.5
    c = rng.integers(0, 1500, n)
    q = np.where(pre, rng.integers(1, 400, n), 1)
    return StepInput.build(seed, [f"r{k}" for k in range(n)], c, q, pre)


def _owner(t, w, i):
    return (t // i) % w


def _local(t, w, i):
    return (t // (w * i)) * i + t % i


def _held(extent, rank, w, i):
    return sum(1 for t in range(extent) if _owner(t, w, i) == rank)


def _block_tables(n, max_blocks, seed):
    rng = np.random.default_rng(seed)
    return (rng.permutation(n * max_blocks) + 1).reshape(n, max_blocks).astype(np.int64)


def _slot(bt, req, local):
    return int(bt[req, local // BLOCK]) * BLOCK + local % BLOCK


def _rank_tokens(plan, p):
    """[(token, request, position, written)] of PCP rank p, walking rows."""
    out = []
    c = plan.num_computed_tokens.np()
    for r in range(plan.num_rows):
        req = int(plan.row_request.np()[r])
        start = int(plan.row_token_start.np()[p][r])
        off = int(plan.row_query_offset.np()[p][r])
        for k in range(int(plan.row_num_tokens.np()[p][r])):
            out.append((start + k, req, int(c[req]) + off + k, bool(plan.row_kv_write.np()[p][r])))
    return out


def _naive(plan, p, w_rank, bt):
    cfg = plan.config
    w, i = cfg.dcp_size, cfg.interleave_size
    t_pad, nd = plan.padded_num_tokens, plan.num_decode_tokens
    ref = {k: np.zeros(t_pad, np.int64) for k in ("token_req", "token_pos", "key_len",
                                                   "local_len")}

    def insert(tokens, lo, hi):
        out = np.full(hi - lo, DUMMY_SLOT, np.int64)
        for tok, req, pos, wr in tokens:
            if lo <= tok < hi and wr and _owner(pos, w, i) == w_rank:
                out[tok - lo] = _slot(bt, req, _local(pos, w, i))
        return out

    mine = _rank_tokens(plan, p)
    for tok, req, pos, _ in mine:
        ref["token_req"][tok], ref["token_pos"][tok], ref["key_len"][tok] = req, pos, pos + 1
        ref["local_len"][tok] = _held(pos + 1, w_rank, w, i)
    ref["insert_dec"] = insert(mine, 0, nd)
    if any(c.name == "kv_insert" for c in plan.collectives):
        ref["insert_pre"] = np.concatenate([insert(_rank_tokens(plan, q), nd, t_pad)
                                            for q in range(cfg.pcp_size)])
    else:
        ref["insert_pre"] = insert(mine, nd, t_pad)
    extents = plan.extent()
    srcs = []
    for ch in (plan.gather_chunks if w > 1 else ()):
        src = []
        for req in ch.requests.np():
            pad = _held(int(extents[req]), 0, w, i)  # rank 0 holds the most
            held = _held(int(extents[req]), w_rank, w, i)
            src += [_slot(bt, int(req), loc) if loc < held else DUMMY_SLOT for loc in range(pad)]
        srcs.append(np.array(src, np.int64))
    return ref, srcs


def _naive_restore(plan):
    """Row of the rank-major [P * T] buffer holding each query token, global order; a
    replicated token is taken from the lowest rank holding it."""
    where = {}
    for p in range(plan.config.pcp_size):
        for tok, req, pos, _ in _rank_tokens(plan, p):
            where.setdefault((req, pos), p * plan.padded_num_tokens + tok)
    return np.array([where[key] for key in sorted(where)], np.int64)


CASES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 2, 4), (3, 3, 2), (4, 4, 1)]


@pytest.mark.parametrize("p_size,w_size,inter", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_build_tables_matches_a_token_walk(p_size, w_size, inter, seed):
    cfg = _config(p_size, w_size, inter)
    plan = compile_plan(cfg, _step(seed))
    max_blocks = -(-cfg.shard_rows(cfg.max_model_len) // BLOCK)
    bt = _block_tables(plan.num_requests, max_blocks, seed)
    for rank in range(cfg.world_size):
        p, w = (rank if p_size > 1 else 0), (rank if w_size > 1 else 0)
        host = build_tables(plan, p, w, bt, DUMMY_SLOT)
        ref, srcs = _naive(plan, p, w, bt)
        for name, want in ref.items():
            np.testing.assert_array_equal(host.arrays[name], want, err_msg=f"{name} rank {rank}")
        np.testing.assert_array_equal(host.arrays["restore_index"], _naive_restore(plan))
        assert host.meta.chunk_rows == tuple(len(s) for s in srcs)
        assert host.meta.num_decode_tokens == plan.num_decode_tokens


class _NoComm:
    """Bind runs no collective; a transport that fails loudly if one is attempted."""

    def size(self, group):
        raise AssertionError("bind issued a collective")

    all_gather = all_reduce_sum = size


def _executor(cfg, rank):
    p, w = (rank if cfg.pcp_size > 1 else 0), (rank if cfg.dcp_size > 1 else 0)
    return StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=p, dcp_rank=w, comm=_NoComm(), device="cpu",
                        max_tokens=2048, max_requests=64)


@pytest.mark.parametrize("p_size,w_size,inter", [(2, 2, 1), (3, 3, 2), (1, 2, 4)])
def test_bind_exposes_typed_tables_equal_to_the_walk(p_size, w_size, inter):
    cfg = _config(p_size, w_size, inter)
    plan = compile_plan(cfg, _step(3))
    max_blocks = -(-cfg.shard_rows(cfg.max_model_len) // BLOCK)
    bt = _block_tables(plan.num_requests, max_blocks, 3)
    for rank in range(cfg.world_size):
        bound = _executor(cfg, rank).bind(plan, bt)
        p, w = (rank if p_size > 1 else 0), (rank if w_size > 1 else 0)
        ref, srcs = _naive(plan, p, w, bt)
        t = bound.tables
        for name, want in ref.items():
            np.testing.assert_array_equal(getattr(t, name).numpy(), want, err_msg=name)
        # only the columns this rank touches travel: the most blocks a request holds here
        width = max(1, -(-int(plan.dcp_local_lens.np()[:, w].max()) // BLOCK))
        assert width < bt.shape[1]
        assert torch.equal(t.block_tables, torch.from_numpy(bt[:, :width]))
        assert len(t.gather) == len(srcs)
        for chunk, want in zip(t.gather, srcs):
            np.testing.assert_array_equal(chunk.src.numpy(), want)
            assert chunk.num_rows == len(want)
        assert len(bound.ledger) == 0


@pytest.fixture
def bound_case():
    cfg = _config(2, 2, 1)
    plan = compile_plan(cfg, _step(5))
    max_blocks = -(-cfg.shard_rows(cfg.max_model_len) // BLOCK)
    return cfg, plan, _block_tables(plan.num_requests, max_blocks, 5)


@pytest.mark.parametrize("mangle,match", [
    (lambda bt: bt[:-1], r"block_tables must be \[num_requests=9, max_blocks\]: got shape \[8,"),
    (lambda bt: np.concatenate([bt, bt]), r"got shape \[18,"),
    (lambda bt: bt.T, r"got shape \["),
    (lambda bt: bt.reshape(-1), r"got shape \[\d+\]"),
    (lambda bt: bt.astype(np.float64), "must hold integers"),
])
def test_bind_refuses_block_tables_of_the_wrong_shape_or_type(bound_case, mangle, match):
    cfg, plan, bt = bound_case
    with pytest.raises(StepInputError, match=match):
        _executor(cfg, 0).bind(plan, mangle(bt))


def test_bind_refuses_the_reserved_block_and_out_of_range_blocks(bound_case):
    cfg, plan, bt = bound_case
    held = plan.dcp_local_lens.np()[:, 0]
    req = int(np.argmax(held))
    zero = bt.copy()
    zero[req, 0] = 0
    with pytest.raises(StepInputError, match=rf"block_tables\[{req}\]\[0\] = 0: expected"):
        _executor(cfg, 0).bind(plan, zero)
    with pytest.raises(StepInputError, match=r"expected a block in 1\.\.99"):
        _executor(cfg, 0).bind(plan, bt, num_blocks=100)
    # entries past what the step touches are the engine's padding: any value is fine there
    padded = bt.copy()
    need = -(-held // BLOCK)
    padded[np.arange(bt.shape[1])[None, :] >= need[:, None]] = 0
    _, top = check_block_tables(plan, 0, padded, int(bt.max()) + 1)
    touched = [int(padded[i, j]) for i in range(len(need)) for j in range(int(need[i]))]
    assert top == max(touched, default=0)


def test_bind_refuses_too_narrow_tables_with_the_numbers(bound_case):
    cfg, plan, bt = bound_case
    with pytest.raises(CapacityError, match="block table too narrow: request"):
        _executor(cfg, 0).bind(plan, bt[:, :1])


def test_bind_refuses_a_plan_for_another_config(bound_case):
    cfg, plan, bt = bound_case
    other = _config(2, 2, 2)
    with pytest.raises(ConfigError, match="compiled for another config"):
        _executor(other, 0).bind(plan, bt)


# ------------------------------------------------------------------ device expansion
@pytest.mark.parametrize("p_size,w_size,inter", [(1, 1, 1), (2, 2, 1), (3, 3, 2)])
def test_a_nonzero_dummy_slot_marks_exactly_the_unwritten_rows(p_size, w_size, inter):
    cfg = _config(p_size, w_size, inter)
    plan = compile_plan(cfg, _step(4))
    bt = _block_tables(plan.num_requests, -(-cfg.shard_rows(cfg.max_model_len) // BLOCK), 4)
    for rank in range(cfg.world_size):
        p, w = (rank if p_size > 1 else 0), (rank if w_size > 1 else 0)
        got = build_tables(plan, p, w, bt, 7).arrays
        ref, srcs = _naive(plan, p, w, bt)  # real slots are >= BLOCK: DUMMY_SLOT only marks
        for name in ("insert_dec", "insert_pre"):
            want = np.where(ref[name] == DUMMY_SLOT, 7, ref[name])
            np.testing.assert_array_equal(got[name], want, err_msg=name)
        for c, src in enumerate(srcs):
            np.testing.assert_array_equal(got[f"gather_src[{c}]"],
                                          np.where(src == DUMMY_SLOT, 7, src))


class _OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ATen calls that may launch a kernel (views excluded)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ret = func._schema.returns
        self.count += not (ret and ret[0].alias_info is not None
                           and not ret[0].alias_info.is_write)
        return func(*args, **(kwargs or {}))


def _step_of(n: int, prefills: int) -> StepInput:
    c = 37 * np.arange(n) % 1500
    q = np.where(np.arange(n) < prefills, 150, 1)
    return StepInput.build(0, [f"r{k}" for k in range(n)], c, q, np.arange(n) < prefills)


@pytest.mark.parametrize("p_size,w_size,inter", [(1, 1, 1), (2, 2, 1), (2, 2, 4)])
def test_bind_issues_the_same_device_ops_whatever_the_requests_and_chunks(p_size, w_size, inter):
    """Bind itself issues no device op (on CUDA: the one H2D copy); the expansion at first use
    issues a fixed number, whatever the requests and gather chunks."""
    cfg = _config(p_size, w_size, inter)
    max_blocks = -(-cfg.shard_rows(cfg.max_model_len) // BLOCK)
    counts = set()
    for n, prefills in ((3, 1), (9, 4), (40, 12)):  # 1 to several gather chunks
        plan = compile_plan(cfg, _step_of(n, prefills))
        ex = _executor(cfg, 0)
        bt = _block_tables(plan.num_requests, max_blocks, 0)
        ex.bind(plan, bt).tables  # the cached arange
        with _OpCount() as ops:
            bound = ex.bind(plan, bt)
        assert ops.count == 0
        with _OpCount() as ops:
            bound.tables
        counts.add(ops.count)
        assert w_size == 1 or len(plan.gather_chunks) >= 1
    assert len(counts) == 1 and counts.pop() <= 25


def _walk_equal(bound, plan, p, w, bt):
    ref, srcs = _naive(plan, p, w, bt)
    t = bound.tables
    if bound.meta.graph_key is not None:  # every padded token a decode (the graph layout)
        ref["insert_dec"] = np.concatenate([ref["insert_dec"], ref.pop("insert_pre")])
    for name, want in ref.items():
        np.testing.assert_array_equal(getattr(t, name).numpy()[: want.size], want, err_msg=name)
    for chunk, want in zip(t.gather, srcs):
        np.testing.assert_array_equal(chunk.src.numpy(), want)


@pytest.mark.parametrize("graphs", [(), (16, 32, 64)])
def test_a_bound_step_keeps_its_tables_until_its_arena_comes_round_again(graphs):
    """Bind writes its words into the next arena of the ring (depth 2) and reuses the views of
    an (arena, sizes) pair: a step bound earlier expands its own tables as long as fewer than
    ``depth`` binds followed, and a rebind of the same static layout reads the new words."""
    cfg = msgspec.structs.replace(_config(2, 2, 1), cudagraph_token_sizes=graphs)
    max_blocks = -(-cfg.shard_rows(cfg.max_model_len) // BLOCK)
    plans = [compile_plan(cfg, _decode_step(seed, 5)) for seed in (1, 2, 3)]
    tables = [_block_tables(p.num_requests, max_blocks, seed) for seed, p in enumerate(plans)]
    ex = _executor(cfg, 1)
    first = ex.bind(plans[0], tables[0])
    second = ex.bind(plans[1], tables[1])
    _walk_equal(first, plans[0], 1, 1, tables[0])  # expanded after the next bind
    third = ex.bind(plans[2], tables[2])  # first's arena again
    _walk_equal(second, plans[1], 1, 1, tables[1])
    _walk_equal(third, plans[2], 1, 1, tables[2])
    if graphs:  # static layout: the same views, the new words
        assert third.views is first.views


def test_bind_refuses_an_arena_too_small_with_the_numbers():
    cfg = _config(2, 2, 1)
    plan = compile_plan(cfg, _step(5))
    bt = _block_tables(plan.num_requests, -(-cfg.shard_rows(cfg.max_model_len) // BLOCK), 5)
    ex = StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=_NoComm(), device="cpu",
                      max_tokens=2048, max_requests=1)
    with pytest.raises(CapacityError, match=r"step 5 needs [\d,]+ arena words, capacity "
                       r"[\d,]+ \(largest table"):
        ex.bind(plan, bt)
    assert ex.arena.next == 0  # nothing committed


@pytest.mark.parametrize("convert", [
    lambda bt: bt.astype(np.int32),
    lambda bt: bt.astype(np.uint16),
    lambda bt: np.asfortranarray(bt),
    lambda bt: np.repeat(bt, 2, axis=1)[:, ::2],  # strided view
    lambda bt: bt.tolist(),
])
def test_bind_takes_block_tables_of_any_integer_type_and_layout(bound_case, convert):
    cfg, plan, bt = bound_case
    for rank in range(cfg.world_size):
        _walk_equal(_executor(cfg, rank).bind(plan, convert(bt)), plan, rank, rank, bt)


def test_arena_words_bounds_every_bind():
    for p_size, w_size, inter in CASES:
        cfg = _config(p_size, w_size, inter)
        max_blocks = -(-cfg.shard_rows(cfg.max_model_len) // BLOCK)
        for n, prefills in ((1, 0), (1, 1), (9, 9), (40, 12), (64, 64)):
            plan = compile_plan(cfg, _step_of(n, prefills))
            bt = _block_tables(n, max_blocks, 0)
            host = build_tables(plan, p_size - 1, w_size - 1, bt, DUMMY_SLOT)
            need = sum(a.size for a in host.params.values())
            assert need <= arena_words(plan.padded_num_tokens, n, max_blocks, p_size, w_size)


def test_build_tables_refuses_rows_out_of_token_order():
    cfg = _config(2, 2, 1)
    plan = compile_plan(cfg, _step(0))
    start = plan.row_token_start.np().copy()
    start[0] = start[0][::-1]
    bad = msgspec.structs.replace(plan, row_token_start=Array.of(start, "<i4"))
    bt = _block_tables(plan.num_requests, 64, 0)
    with pytest.raises(PlanFormatError, match="not in token order"):
        build_tables(bad, 0, 0, bt, DUMMY_SLOT)


def _decode_step(seed: int, n: int) -> StepInput:
    """Decodes only, some of several tokens (speculative decoding), contexts up to 1.5k."""
    rng = np.random.default_rng(seed)
    return StepInput.build(seed, [f"d{k}" for k in range(n)], rng.integers(0, 1500, n),
                           rng.integers(1, 4, n), [False] * n)


@pytest.mark.parametrize("p_size,w_size,inter", CASES)
@pytest.mark.parametrize("seed,n", [(0, 1), (1, 5), (2, 11), (3, 16)])
def test_graph_layout_is_the_token_walk_padded(p_size, w_size, inter, seed, n):
    """A graph-replayable plan's tables (static shapes, docs/design.md §5.6) are the walk's,
    with every padded token a decode that writes the dummy slot, block tables padded to
    [T, key blocks] and the restore index padded to P * T."""
    cfg = msgspec.structs.replace(_config(p_size, w_size, inter),
                                  cudagraph_token_sizes=(16, 32, 64))
    plan = compile_plan(cfg, _decode_step(seed, n))
    assert plan.graph_replayable
    t_pad = plan.padded_num_tokens
    max_blocks = -(-cfg.shard_rows(cfg.max_model_len) // BLOCK)
    bt = _block_tables(plan.num_requests, max_blocks, seed)
    longest = int(plan.dcp_local_lens.np().max())
    blocks = 1 << (max(1, -(-longest // BLOCK)) - 1).bit_length()
    for rank in range(cfg.world_size):
        p, w = (rank if p_size > 1 else 0), (rank if w_size > 1 else 0)
        host = build_tables(plan, p, w, bt, DUMMY_SLOT)
        got, (ref, _) = host.arrays, _naive(plan, p, w, bt)
        for name in ("token_req", "token_pos", "key_len", "local_len"):
            np.testing.assert_array_equal(got[name], ref[name], err_msg=f"{name} rank {rank}")
        walk = np.concatenate([ref["insert_dec"], ref["insert_pre"]])
        np.testing.assert_array_equal(got["insert_dec"], walk, err_msg=f"insert rank {rank}")
        assert got["insert_pre"].size == 0
        restore = _naive_restore(plan)
        np.testing.assert_array_equal(got["restore_index"][: restore.size], restore)
        assert got["restore_index"].size == p_size * t_pad
        assert not got["restore_index"][restore.size:].any()
        m = host.meta
        assert m.graph_key == (t_pad, blocks)
        assert m.num_decode_tokens == t_pad and m.decode_width == blocks * BLOCK
        assert m.local_range == (0, t_pad, blocks * BLOCK)
        padded_bt = got["block_tables"].reshape(t_pad, blocks)
        width = min(blocks, max_blocks)
        np.testing.assert_array_equal(padded_bt[: plan.num_requests, :width], bt[:, :width])
        assert not padded_bt[plan.num_requests:].any()


def test_a_bound_step_is_refused_once_its_arena_is_reused_or_after_finish():
    """arena_depth binds later the arena holds another step's tables: using the old bound step
    would silently read them, so every executor call refuses it (got / expected); a finished
    step is refused too. Up to arena_depth bound steps may be in flight."""
    cfg = _config(1, 1, 1)
    plan = compile_plan(cfg, _step(3))
    bt = _block_tables(plan.num_requests, -(-cfg.shard_rows(cfg.max_model_len) // BLOCK), 3)
    ex = StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=_NoComm(), device="cpu",
                      max_tokens=2048, max_requests=64, debug=False)
    first, second = ex.bind(plan, bt), ex.bind(plan, bt)
    ex.finish(second)  # two in flight at depth 2: both usable
    with pytest.raises(UsageError, match=r"^step 3: attend after finish\(\); expected a new "):
        ex.attend(second, None, None, None, None)
    with pytest.raises(UsageError, match="finish after finish"):
        ex.finish(second)
    third = ex.bind(plan, bt)  # takes the first's arena while the first is still unfinished
    with pytest.raises(UsageError, match=r"^step 3: insert on a bound step whose tables a later "
                       r"bind has overwritten \(arena_depth 2\); expected at most 2 bound"):
        ex.insert(first, None, None, None)
    with pytest.raises(UsageError, match="restore on a bound step whose tables"):
        ex.restore(first, torch.zeros(1, 1))
    ex.finish(third)
    _walk_equal(third, plan, 0, 0, bt)  # the live step's tables are its own


def _args(T):
    """Well-formed insert / attend / restore tensors of the _config(1, 1, 1) model."""
    return {"kv_new": torch.zeros(T, 576), "index_k_new": torch.zeros(T, 128),
            "q": torch.zeros(T, 8, 576), "index_q": torch.zeros(T, 4, 128),
            "index_w": torch.zeros(T, 4), "hidden": torch.zeros(T, 4096)}


# (call, argument, a wrong version of it given T, what the message must say)
MISUSE = [  # {T}: the step's rows; {Tm}, {Tp}: one fewer, one more
    ("insert", "kv_new", lambda T: torch.zeros(T - 1, 576), r"kv_new is \({Tm}, 576\) float32"),
    ("insert", "kv_new", lambda T: torch.zeros(T, 512), r"kv_new is \({T}, 512\)"),
    ("insert", "index_k_new", lambda T: torch.zeros(T, 64), r"index_k_new is \({T}, 64\)"),
    ("attend", "q", lambda T: torch.zeros(T + 1, 8, 576), r"q is \({Tp}, 8, 576\)"),
    ("attend", "q", lambda T: torch.zeros(T, 4, 576), r"q is \({T}, 4, 576\)"),
    ("attend", "q", lambda T: torch.zeros(T, 8, 576, dtype=torch.int64),
     r"q is \({T}, 8, 576\) int64 on cpu; expected \({T}, 8, 576\) float32 on cpu$"),
    # not the activation dtype: the output (q's dtype) is what decode_out all-reduces, and a
    # rank whose dtype differs from its peers' crashed gloo
    ("attend", "q", lambda T: torch.zeros(T, 8, 576, dtype=torch.bfloat16),
     r"q is \({T}, 8, 576\) bfloat16 on cpu; expected \({T}, 8, 576\) float32 on cpu$"),
    ("attend", "q", lambda T: torch.zeros(T, 8, 576, dtype=torch.float64),
     r"q is \({T}, 8, 576\) float64 on cpu; expected"),
    ("attend", "index_q", lambda T: torch.zeros(T, 2, 128), r"index_q is \({T}, 2, 128\)"),
    ("attend", "index_w", lambda T: torch.zeros(T, 2), r"index_w is \({T}, 2\)"),
    ("attend", "index_w", lambda T: None, "index_w is NoneType; expected"),
    ("restore", "hidden", lambda T: torch.zeros(T - 1, 4096), r"hidden is \({Tm}, 4096\)"),
    ("restore", "hidden", lambda T: torch.zeros(T, 17),  # the config's hidden_size is 4096
     r"hidden is \({T}, 17\) float32 on cpu; expected \({T}, 4096\) float32 on cpu$"),
    ("restore", "hidden", lambda T: torch.zeros(T, 4096, 1), r"hidden is \({T}, 4096, 1\)"),
    ("restore", "hidden", lambda T: torch.zeros(T, 4096, dtype=torch.float16),
     r"hidden is \({T}, 4096\) float16 on cpu; expected \({T}, 4096\) float32"),
]


@pytest.mark.parametrize("call,arg,bad,match", MISUSE)
def test_runtime_calls_refuse_tensors_that_do_not_fit_the_step(call, arg, bad, match):
    """A wrong row or head count used to run: fewer rows gave fewer outputs, fewer heads a
    different selection, silently. Each is a TensorArgError naming got and expected."""
    cfg = _config(1, 1, 1)
    plan = compile_plan(cfg, _step(3))
    T = plan.padded_num_tokens
    bt = _block_tables(plan.num_requests, -(-cfg.shard_rows(cfg.max_model_len) // BLOCK), 3)
    ex = StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=_NoComm(), device="cpu",
                      max_tokens=2048, max_requests=64)
    bound = ex.bind(plan, bt)
    cache = LayerCache.empty(cfg, int(bt.max()) + 1, "cpu")
    a = _args(T)
    a[arg] = bad(T)
    pattern = match.replace("{Tm}", str(T - 1)).replace("{Tp}", str(T + 1)).replace("{T}", str(T))
    with pytest.raises(TensorArgError, match=f"^step 3: {call}: {pattern}"):
        if call == "insert":
            ex.insert(bound, cache, a["kv_new"], a["index_k_new"])
        elif call == "attend":
            ex.attend(bound, cache, a["q"], a["index_q"], a["index_w"])
        else:
            ex.restore(bound, a["hidden"])


def test_runtime_calls_refuse_caches_that_do_not_fit():
    """A cache of the other KV format, an indexer K cache of packed rows (not block-planar),
    or too few blocks for the step's block tables (an out-of-range write faults a GPU):
    TensorArgError before any kernel runs."""
    cfg = _config(1, 1, 1)
    plan = compile_plan(cfg, _step(3))
    bt = _block_tables(plan.num_requests, -(-cfg.shard_rows(cfg.max_model_len) // BLOCK), 3)
    ex = StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=_NoComm(), device="cpu",
                      max_tokens=2048, max_requests=64)
    bound = ex.bind(plan, bt)
    a = _args(plan.padded_num_tokens)
    other = LayerCache.empty(ParallelConfig(**{**msgspec.structs.asdict(cfg),
                                              "kv_cache_dtype": "bf16"}), 100, "cpu")
    with pytest.raises(TensorArgError, match=r"cache.kv \(fp8_ds_mla\) is \(6400, 1152\) "
                       r"uint8 on cpu; expected \(6400, 656\) uint8"):
        ex.attend(bound, other, a["q"], a["index_q"], a["index_w"])
    packed = LayerCache(other.kv.new_zeros(6400, 656), other.kv.new_zeros(6400, 132))
    with pytest.raises(TensorArgError, match=r"cache.index_k \(block-planar\) is \(6400, 132\) "
                       rf"uint8 on cpu; expected \(100, {BLOCK * 132}\) uint8"):
        ex.insert(bound, packed, a["kv_new"], a["index_k_new"])  # rows of the packed layout
    top = max(int(bt[i, j]) for i, n in enumerate(plan.dcp_local_lens.np()[:, 0])
              for j in range(-(-int(n) // BLOCK)))
    small = LayerCache.empty(cfg, top, "cpu")  # blocks 0 .. top - 1: one short
    with pytest.raises(TensorArgError, match=rf"the caches hold {top * BLOCK:,} rows \({top} "
                       rf"blocks\); expected at least {(top + 1) * BLOCK:,}: the step's block "
                       rf"tables reach block {top} "):
        ex.insert(bound, small, a["kv_new"], a["index_k_new"])
    ex.insert(bound, LayerCache.empty(cfg, top + 1, "cpu"), a["kv_new"], a["index_k_new"])


@pytest.mark.parametrize("p_size,w_size", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_a_sampled_graph_step_fits_an_arena_sized_to_it(p_size, w_size):
    """A graph-replayable step packs its static layout and then the sampled rows' indices;
    an executor sized exactly to the graph size (``max_tokens`` = ``max_requests`` = G, long
    contexts so the ``[G, 2^k]`` block tables dominate) must hold both: bind on every rank,
    and the words committed (the tables' and the sampled indices') within ``arena_words``."""
    for g in (1, 2, 4, 8):
        cfg = msgspec.structs.replace(_config(p_size, w_size, 1), cudagraph_token_sizes=(g,),
                                      max_model_len=16416, gather_workspace_tokens=0)
        max_blocks = -(-cfg.shard_rows(cfg.max_model_len) // BLOCK)
        step = StepInput.build(g, [f"r{k}" for k in range(g)], [16384 + k for k in range(g)],
                               [1] * g, [False] * g, is_sampled=[True] * g)
        plan = compile_plan(cfg, step)
        assert plan.graph_replayable and plan.sampled_source is not None
        bt = _block_tables(g, max_blocks, g)
        for rank in range(cfg.world_size):
            p, w = (rank if p_size > 1 else 0), (rank if w_size > 1 else 0)
            ex = StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=p, dcp_rank=w, comm=_NoComm(),
                              device="cpu", max_tokens=g, max_requests=g)
            bound = ex.bind(plan, bt)
            used = sum(v.numel() for v in bound.views.values())
            assert used <= arena_words(g, g, max_blocks, p_size, w_size, (g,))
