"""Misuse of the embedding API that once ran on and gave a wrong answer, or a raw error from deep
inside numba / numpy / torch: each is now a typed error whose one line says got / expected.
The reference for "the right answer" where a step does run: the same step on a fresh executor."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from cpplan.api import LayerCache, ParallelConfig, StepExecutor, StepInput, compile
from cpplan.runtime import executor as executor_mod
from cpplan.runtime.arena import ArenaRing
from cpplan.schemas.errors import ConfigError, UsageError

CFG = ParallelConfig(num_heads=8, topk=64, index_num_heads=4, max_model_len=2048,
                     num_layers=1, activation_dtype="float32", hidden_size=4096)


def _executor(cfg=CFG, **kwargs):
    return StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=kwargs.pop("pcp_rank", 0),
                        dcp_rank=kwargs.pop("dcp_rank", 0), comm=None, device="cpu",
                        **{"max_tokens": 64, "max_requests": 8, **kwargs})


def _plan(step_id=1, cfg=CFG):
    return compile(cfg, StepInput.build(step_id, ["a", "b"], [100, 0], [1, 7], [False, True]))


def _inputs(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, 576, generator=g), torch.randn(t, 128, generator=g),
            torch.randn(t, 8, 576, generator=g), torch.randn(t, 4, 128, generator=g),
            torch.randn(t, 4, generator=g).abs())


BT = np.arange(1, 1 + 2 * 8).reshape(2, 8)


@pytest.mark.parametrize("kwargs, words", [
    ({"pcp_rank": 1}, "pcp_rank: got 1; expected 0..0"),
    ({"dcp_rank": 1}, "dcp_rank: got 1; expected 0..0"),
    ({"dcp_rank": -1}, "dcp_rank: got -1"),
    ({"pcp_rank": "0"}, "pcp_rank: got '0'"),
    ({"pcp_rank": 0.0}, "pcp_rank: got 0.0"),
    ({"dcp_rank": True}, "dcp_rank: got True"),
    ({"max_tokens": 0}, "max_tokens: got 0; expected a positive integer"),
    ({"max_tokens": 2.5}, "max_tokens: got 2.5"),
    ({"max_requests": -5}, "max_requests: got -5"),
    ({"arena_depth": 0}, "arena_depth: got 0"),
    ({"max_blocks_per_request": 0}, "max_blocks_per_request: got 0"),
])
def test_executor_refuses_ranks_and_sizes_out_of_range(kwargs, words):
    """A rank outside its group read another rank's rows of the plan (a P = W = 1 step gave
    an output off by 3.75 at dcp_rank 1); sizes of 0 failed only at bind (an IndexError)."""
    with pytest.raises(ConfigError, match=f"StepExecutor {words}"):
        _executor(**kwargs)


def test_executor_takes_numpy_integer_sizes():
    ex = _executor(max_tokens=np.int64(64), pcp_rank=np.int32(0))
    assert ex.max_tokens == 64


@pytest.mark.parametrize("field, value", [("qk_head_dim", 640), ("v_head_dim", 256),
                                          ("index_head_dim", 64)])
def test_executor_refuses_dims_its_kernels_do_not_take(field, value):
    """The planner takes any dims; the kernels and cache formats only 576 / 512 / 128
    (a v_head_dim of 256 was ignored: outputs stayed 512 wide)."""
    import msgspec

    cfg = msgspec.structs.replace(CFG, **{field: value})
    with pytest.raises(ConfigError, match=f"^{field}: got {value}; expected "):
        _executor(cfg)


def test_executor_refuses_an_arena_it_could_not_allocate():
    """A max_model_len of 2**27 sized every request's block table for it: a 16 GiB pinned
    allocation (near 2**31, 256 GiB: a raw allocator error, or the OOM killer)."""
    import msgspec

    cfg = msgspec.structs.replace(CFG, max_model_len=2**27, gather_workspace_tokens=2**27)
    with pytest.raises(ConfigError, match="the step arena would hold .* pass smaller"):
        StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=None, device="cpu")
    # sized for what the engine serves, the same config is fine
    StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=None, device="cpu", max_tokens=64,
                 max_requests=8, max_blocks_per_request=64)


def test_from_groups_refuses_groups_of_another_config():
    """A P = 2 config on groups of a world of 1 failed later, at the first collective, as a
    RankLostError after its timeout."""
    import msgspec

    other = msgspec.structs.replace(CFG, topk=128)
    with pytest.raises(ConfigError, match="from_groups: got groups of .*; expected Groups "
                                          "built for this config"):
        StepExecutor.from_groups(CFG, types.SimpleNamespace(config=other), sm_scale=0.1)
    with pytest.raises(ConfigError, match="from_groups: got dict; expected Groups"):
        StepExecutor.from_groups(CFG, {}, sm_scale=0.1)


def _step(ex, bound, seed=0):
    t = bound.plan.padded_num_tokens
    kv, ik, q, iq, iw = _inputs(t, seed)
    cache = LayerCache.empty(ex.config, 32, "cpu")
    ex.insert(bound, cache, kv, ik)
    return ex.attend(bound, cache, q, iq, iw)


@pytest.mark.parametrize("call", ["insert", "attend", "restore", "finish"])
def test_a_bound_step_belongs_to_its_executor(call):
    """Another executor at the same commit count once took the step as its own: a config of
    another topk gave an output off by 1.48, silently."""
    import msgspec

    ex_a = _executor()
    ex_b = _executor(msgspec.structs.replace(CFG, topk=32))
    bound = ex_a.bind(_plan(), BT)
    ex_b.finish(ex_b.bind(_plan(cfg=ex_b.config), BT))  # ex_b's commit count matches now
    ex_b.bind(_plan(cfg=ex_b.config), BT)
    t = bound.plan.padded_num_tokens
    cache = LayerCache.empty(ex_b.config, 32, "cpu")
    kv, ik, q, iq, iw = _inputs(t)
    calls = {"insert": lambda: ex_b.insert(bound, cache, kv, ik),
             "attend": lambda: ex_b.attend(bound, cache, q, iq, iw),
             "restore": lambda: ex_b.restore(bound, torch.zeros(t, 4096)),
             "finish": lambda: ex_b.finish(bound)}
    with pytest.raises(UsageError, match=f"^step 1: {call} on a step bound by another "
                                         "StepExecutor"):
        calls[call]()
    out = _step(ex_a, bound)  # its own executor still runs it, as a fresh one does
    ex_a.finish(bound)
    fresh = _executor()
    ref = fresh.bind(_plan(), BT)
    assert torch.equal(out, _step(fresh, ref))


@pytest.mark.parametrize("bad", [None, "step", _plan()])
def test_calls_refuse_what_is_not_a_bound_step(bad):
    ex = _executor()
    with pytest.raises(UsageError, match=f"got {type(bad).__name__} where a step was "
                                         "expected; expected the BoundStep that bind"):
        ex.finish(bad)
    with pytest.raises(UsageError, match=f"got {type(bad).__name__}"):
        ex.attend(bad, None, None, None, None)


def test_a_failed_bind_retires_the_step_whose_arena_it_rewrote(monkeypatch):
    """Two steps in flight (arena_depth 2); a third bind fails after writing its tables into
    the first step's arena. The first step used to run on those words, silently (on the CPU
    the arena's words are the step's tables); it is now refused as overwritten."""
    ex = _executor()
    first = ex.bind(_plan(1), BT)
    ex.bind(_plan(2), BT)
    real = executor_mod.build_tables

    def half_written(plan, *args, out=None):
        out[:] = 7  # what a failure part-way through leaves behind
        raise ConfigError("failed part-way")

    monkeypatch.setattr(executor_mod, "build_tables", half_written)
    with pytest.raises(ConfigError, match="failed part-way"):
        ex.bind(_plan(3), BT)
    monkeypatch.setattr(executor_mod, "build_tables", real)
    with pytest.raises(UsageError, match="step 1: insert on a bound step whose tables a later "
                                         "bind has overwritten"):
        _step(ex, first)


def test_arena_acquire_without_commit_releases_the_slot():
    ring = ArenaRing(16, torch.device("cpu"), 2)
    ring.acquire()
    ring.commit(("a",), (4,))
    lease = ring.lease
    assert ring.holds(lease)
    ring.acquire()
    ring.commit(("a",), (4,))
    assert ring.holds(lease)  # depth 2: the first commit's words are intact
    ring.acquire()  # the first commit's slot, rewritten from here on
    assert not ring.holds(lease)


def test_a_step_of_no_requests_runs_as_nothing():
    """compile takes an empty step (an engine's idle iteration); insert then raised a raw
    RuntimeError from a reshape of the empty block tables."""
    ex = _executor()
    plan = compile(CFG, StepInput.build(5, [], [], [], []))
    assert plan.padded_num_tokens == 0 and plan.collectives == ()
    bound = ex.bind(plan, np.zeros((0, 8), np.int64))
    cache = LayerCache.empty(CFG, 4, "cpu")
    before = cache.kv.clone()
    ex.insert(bound, cache, torch.zeros(0, 576), torch.zeros(0, 128))
    out = ex.attend(bound, cache, torch.zeros(0, 8, 576), torch.zeros(0, 4, 128),
                    torch.zeros(0, 4))
    rows = ex.restore(bound, torch.zeros(0, 4096))
    assert out.shape == (0, 8, 512) and rows.shape == (0, 4096)
    assert len(ex.finish(bound)) == 0 and torch.equal(cache.kv, before)
    # and the executor goes on with a real step, as a fresh one does
    bound = ex.bind(_plan(), BT)
    out = _step(ex, bound)
    ex.finish(bound)
    fresh = _executor()
    assert torch.equal(out, _step(fresh, fresh.bind(_plan(), BT)))


@pytest.mark.parametrize("bad", [-1, 0, 1, 2.5, True, "8"])
def test_layer_cache_empty_refuses_bad_block_counts(bad):
    with pytest.raises(ConfigError, match=f"LayerCache.empty num_blocks: got {bad!r}; expected"):
        LayerCache.empty(CFG, bad, "cpu")


@pytest.mark.parametrize("name", ["kv", "index_k"])
def test_a_strided_cache_is_a_tensor_arg_error(name):
    """A transposed cache raised an AssertionError (index_k) or a RuntimeError about strides
    (bf16 kv) from inside a kernel."""
    from cpplan.schemas.errors import TensorArgError

    ex = _executor()
    bound = ex.bind(_plan(), BT)
    cache = LayerCache.empty(CFG, 32, "cpu")
    t = getattr(cache, name)
    setattr(cache, name, t.t().contiguous().t())  # same shape and values, column-major
    t_pad = bound.plan.padded_num_tokens
    with pytest.raises(TensorArgError, match=f"^step 1: insert: cache.{name} has strides "
                                             r"\(1, \d+\); expected a contiguous"):
        ex.insert(bound, cache, torch.zeros(t_pad, 576), torch.zeros(t_pad, 128))


@pytest.mark.parametrize("num_blocks", ["100", 0, 1, 2**70, 2.0])
def test_bind_refuses_bad_num_blocks(num_blocks):
    """A string reached numba (TypingError), 2**70 an OverflowError, 0 gave "expected a block
    in 1..-1" and -1 turned the range check off."""
    from cpplan.schemas.errors import StepInputError

    with pytest.raises(StepInputError, match=f"^step 1: num_blocks: got {num_blocks!r}; "):
        _executor().bind(_plan(), BT, num_blocks)


def test_bind_names_bad_block_tables_as_given():
    from cpplan.schemas.errors import StepInputError

    ex = _executor()
    with pytest.raises(StepInputError, match="^step 1: block_tables must be .* got list numpy "
                                             "cannot read as one"):
        ex.bind(_plan(), [[1, 2, 3], [4]])
    huge = BT.astype(np.uint64)
    huge[0, 0] = np.iinfo(np.uint64).max  # was reported as -1 (its int64 cast)
    with pytest.raises(StepInputError, match=r"block_tables\[0\]\[0\] = 18446744073709551615: "):
        ex.bind(_plan(), huge)


def test_wrong_objects_in_place_of_the_runtime_s_are_typed_errors():
    from cpplan.api import Groups, StepGraphs, warmup
    from cpplan.runtime.verify import DigestCheck

    with pytest.raises(UsageError, match="^warmup: got str; expected a StepExecutor"):
        warmup("x")
    with pytest.raises(UsageError, match=r"^StepGraphs: got \(str, function\); expected"):
        StepGraphs("x", lambda bound: None)
    with pytest.raises(ConfigError, match="^Groups.build: got dict; expected a ParallelConfig"):
        Groups.build({})
    with pytest.raises(ConfigError, match="^verify every_n must be an integer >= 1: got '2'"):
        DigestCheck(None, "sampled", "2")
    with pytest.raises(UsageError, match="^record_plan: got str; expected a StepPlan"):
        from cpplan.api import record_plan

        record_plan("plan", "/tmp")


def test_record_plan_into_a_file_is_an_output_error(tmp_path):
    from cpplan.api import record_plan
    from cpplan.schemas.errors import OutputError

    blocker = tmp_path / "runs"
    blocker.write_bytes(b"")
    with pytest.raises(OutputError, match="^record_plan: cannot create the folder"):
        record_plan(_plan(), str(blocker))
    assert record_plan(_plan(), str(tmp_path / "ok")).endswith("step-1.msgpack")


@pytest.mark.parametrize("max_tokens, runs", [(1, 1), (2, 3), (3, 4)])
def test_warmup_on_a_tiny_executor_runs_what_fits(max_tokens, runs):
    """warmup's docstring says its steps fit the executor; at max_tokens <= 2 one did not (a
    CapacityError naming a synthetic step 9223372036854775806). Counted against the steps
    that compile within max_tokens, checked here one by one."""
    from cpplan.api import warmup
    from cpplan.warmup import warmup_steps

    ex = _executor(max_tokens=max_tokens)
    fit = [s for s in warmup_steps(CFG, max_tokens, 8)
           if compile(CFG, s).padded_num_tokens <= max_tokens]
    assert len(fit) == runs
    assert warmup(ex) == runs


def test_a_paged_3d_kv_cache_is_named_with_the_flat_shape_expected():
    """A vLLM-style [blocks, block_size, 656] cache was told "expected (64, 656)"."""
    from cpplan.schemas.errors import TensorArgError

    ex = _executor()
    bound = ex.bind(_plan(), BT)
    cache = LayerCache.empty(CFG, 32, "cpu")
    cache.kv = cache.kv.view(32, CFG.block_size, -1)
    t = bound.plan.padded_num_tokens
    with pytest.raises(TensorArgError, match=r"cache.kv is \(32, 64, 656\); expected one row a "
                                             r"slot, \[num_blocks \* 64, 656\] \(a paged cache "
                                             r"passes kv.view\(-1, 656\)\)$"):
        ex.insert(bound, cache, torch.zeros(t, 576), torch.zeros(t, 128))


# ---------------------------------------------------------------- issue 31 item 7
@pytest.mark.parametrize("kwargs, words", [
    ({"timeout_s": float("nan")}, "timeout_s: got nan"),
    ({"timeout_s": -1.0}, "timeout_s: got -1.0"),
    ({"timeout_s": "30"}, "timeout_s: got '30'"),
    ({"control_timeout_s": float("nan")}, "control_timeout_s: got nan"),
    ({"control_timeout_s": -5}, "control_timeout_s: got -5"),
    ({"control_timeout_s": 0}, "control_timeout_s: got 0"),
    ({"control_timeout_s": float("inf")}, "control_timeout_s: got inf"),
    ({"control_timeout_s": True}, "control_timeout_s: got True"),
])
@pytest.mark.parametrize("how", ["build", "from_env", "adopt"])
def test_groups_timeouts_nan_negative_or_not_numbers(how, kwargs, words):
    """NaN reached datetime.timedelta (a ValueError from torch's rendezvous), a negative one
    torch's own errors; every constructor now refuses it first, whatever the world's state."""
    from cpplan.runtime.groups import Groups

    build = {"build": lambda: Groups.build(CFG, **kwargs),
             "from_env": lambda: Groups.from_env(CFG, **kwargs),
             "adopt": lambda: Groups.adopt(CFG, pcp_group=None, dcp_group=None,
                                           control_group=None, device="cpu", **kwargs)}[how]
    with pytest.raises(ConfigError, match=f"^Groups.{how} {words}; expected a number of "
                                          r"seconds in \(0, 604800\]$"):
        build()


def test_groups_timeouts_that_are_numbers_pass_the_check():
    from cpplan.runtime.groups import check_timeouts

    for value in (0.5, 30, np.float64(2.0), np.int64(5), 604800):
        check_timeouts("Groups.build", value, value)  # no error
    check_timeouts("Groups.build", None, 30.0)


def test_adopt_outside_a_world_is_a_config_error():
    from cpplan.runtime.groups import Groups

    with pytest.raises(ConfigError, match="^Groups.adopt: torch.distributed is not initialised"):
        Groups.adopt(CFG, pcp_group=None, dcp_group=None, control_group=None, device="cpu")


@pytest.mark.parametrize("exc, words", [
    ("oops", "got str 'oops'"), (None, "got NoneType None"), (ValueError, "got the class "
                                                               "ValueError"), (42, "got int 42")])
def test_refuse_with_a_non_exception(exc, words):
    """`raise exc` of a non-exception was a TypeError from inside refuse; before bind or after."""
    ex = StepExecutor.local(CFG, sm_scale=0.1, max_tokens=64, max_requests=8)
    with pytest.raises(UsageError, match=f"^refuse exc: {words}; expected an exception "):
        ex.refuse(_plan(), exc)
    bound = ex.bind(_plan(2), BT)
    with pytest.raises(UsageError, match=f"^refuse exc: {words}"):
        ex.refuse(bound, exc)
    with pytest.raises(KeyError):  # a real exception is raised again, as documented
        ex.refuse(bound, KeyError("mine"))


@pytest.mark.parametrize("folder", [b"/tmp/cpplan-bytes", None, 3])
def test_record_plan_with_a_bytes_or_non_path_folder(folder, tmp_path):
    from cpplan.api import record_plan

    with pytest.raises(UsageError, match="^record_plan directory: got .*; expected a str path"):
        record_plan(_plan(), folder)
    assert record_plan(_plan(), tmp_path / "as-pathlike").endswith("step-1.msgpack")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_a_cuda_device_on_a_cpu_machine(device):
    """Torch's AssertionError ("Torch not compiled with CUDA enabled") or a pinned-memory
    RuntimeError before."""
    with pytest.raises(ConfigError, match="^LayerCache.empty device: got 'cuda.*no CUDA device"):
        LayerCache.empty(CFG, 4, device)
    with pytest.raises(ConfigError, match="^StepExecutor device: got 'cuda.*no CUDA device"):
        StepExecutor.local(CFG, sm_scale=0.1, device=device)


@pytest.mark.parametrize("device", ["bogus", 3.5, "cpu:x"])
def test_a_device_that_is_no_device_name(device):
    with pytest.raises(ConfigError, match="device: got .*; expected a torch device"):
        LayerCache.empty(CFG, 4, device)
    with pytest.raises(ConfigError, match="device: got .*; expected a torch device"):
        StepExecutor.local(CFG, sm_scale=0.1, device=device)


def _run_step(ex, plan, cache):
    bound = ex.bind(plan, BT)
    kv, ik, q, iq, iw = _inputs(bound.plan.padded_num_tokens)
    ex.insert(bound, cache, kv, ik)
    out = ex.attend(bound, cache, q, iq, iw)
    ex.finish(bound)
    return out


def test_caches_made_under_inference_mode_work_outside_it():
    """LayerCache.empty under torch.inference_mode() made inference tensors, which the step's
    insert (outside that mode) could not write: a raw RuntimeError deep in the kernels. The
    reference: the same step on caches made normally."""
    want = _run_step(StepExecutor.local(CFG, sm_scale=0.1, max_tokens=64, max_requests=8),
                     _plan(), LayerCache.empty(CFG, 32, "cpu"))
    with torch.inference_mode():
        cache = LayerCache.empty(CFG, 32, "cpu")
    assert not cache.kv.is_inference()
    got = _run_step(StepExecutor.local(CFG, sm_scale=0.1, max_tokens=64, max_requests=8),
                    _plan(), cache)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.inference_mode():  # and inside it, too
        got = _run_step(StepExecutor.local(CFG, sm_scale=0.1, max_tokens=64, max_requests=8),
                        _plan(), LayerCache.empty(CFG, 32, "cpu"))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_engine_tensors_made_under_inference_mode_are_named():
    """An engine's own cache tensors made under inference_mode and used outside it: one line."""
    with torch.inference_mode():
        kv = torch.zeros(32 * 64, CFG.kv_bytes_per_token, dtype=torch.uint8)
        index_k = torch.zeros(32, 64 * CFG.index_k_bytes_per_token, dtype=torch.uint8)
    ex = StepExecutor.local(CFG, sm_scale=0.1, max_tokens=64, max_requests=8)
    bound = ex.bind(_plan(), BT)
    kv_new, ik, *_ = _inputs(bound.plan.padded_num_tokens)
    from cpplan.schemas.errors import TensorArgError

    with pytest.raises(TensorArgError, match="insert: cache.kv was made under "
                                             r"torch.inference_mode\(\) and is used outside it"):
        ex.insert(bound, LayerCache(kv, index_k), kv_new, ik)


@pytest.mark.parametrize("value", [float("nan"), -1.0, float("inf"), "5", True])
def test_executor_data_timeout_nan_negative_or_not_a_number(value):
    with pytest.raises(ConfigError, match="^StepExecutor data_timeout_s: got .*; expected a "
                                          "finite number of seconds >= 0$"):
        StepExecutor.local(CFG, sm_scale=0.1, max_tokens=64, max_requests=8,
                           data_timeout_s=value)
    assert StepExecutor.local(CFG, sm_scale=0.1, max_tokens=64, max_requests=8,
                              data_timeout_s=2.5).data_timeout_s == 2.5


def test_attend_before_its_layers_insert_is_refused():
    """attend on a layer before its insert read the cache without the step's own new KV and
    ran on (max error 1.0 on the prefill request; finish passed). The reference: the same
    step, insert then attend, on a fresh executor."""
    ex = StepExecutor.local(CFG, sm_scale=0.1, max_tokens=64, max_requests=8)
    bound = ex.bind(_plan(), BT)
    kv, ik, q, iq, iw = _inputs(bound.plan.padded_num_tokens)
    cache = LayerCache.empty(CFG, 32, "cpu")
    with pytest.raises(UsageError) as err:
        ex.attend(bound, cache, q, iq, iw)
    assert str(err.value) == ("step 1: attend of layer 0 before its insert; expected insert "
                              "then attend for each layer (0 layer(s) inserted so far)")
    ex.insert(bound, cache, kv, ik)  # the refused call left the step where it was
    got = ex.attend(bound, cache, q, iq, iw)
    ex.finish(bound)
    want = _run_step(StepExecutor.local(CFG, sm_scale=0.1, max_tokens=64, max_requests=8),
                     _plan(), LayerCache.empty(CFG, 32, "cpu"))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
