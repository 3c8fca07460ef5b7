"""The FlashMLA backend: pure parts on the CPU, the adapter against the torch reference on an H200.

CPU (CI): ``choose`` / ``fp8_kernel`` / ``supported`` against the table in the module docstring,
and the conversions (head padding, index conversion, LSE / empty-row conversion) against
hand-written expectations; the kernel set falls back where FlashMLA cannot run.
GPU (``gpu`` mark; skipped with the reason where flash_mla does not import or the device is not
sm_90): every path (bf16 rows, fp8 rows dequantised once, the fp8 decode kernel over pages) at
H 16/32/64/128 against ``reference.sparse_mla_attention`` in float32 on the same rounded inputs.
Tolerance: norm-relative 1e-2 on out. FlashMLA rounds P to bf16 before P . V and writes bf16
(unit roundoff 2^-8 = 3.9e-3 each, errors of random sign: a norm-relative error of a few 1e-3);
fp8 rows are dequantised exactly (power-of-two scales). lse: absolute 1e-3 (fp32 softmax
statistics over bf16 products; only the summation order differs).
"""

import math
import os

import pytest
import torch

from cpplan.runtime.kernels import reference as ref
from cpplan.runtime.kernels.dispatch import OP_NAMES, KernelBackendError
from cpplan.runtime.kernels.flashmla import attention as fm

BF16, F16 = torch.bfloat16, torch.float16
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
K = 2048


# --------------------------------------------------------------------------------------------
# CPU: the pure parts
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, want", [
    # the measured cases (module docstring table)
    ((4096, 128, K, "bf16", 65536, BF16), "flashmla"),
    ((4096, 64, K, "bf16", 65536, BF16), "flashmla"),
    ((128, 128, K, "fp8_ds_mla", 1 << 18, BF16), "flashmla"),
    ((256, 64, K, "fp8_ds_mla", 1 << 18, BF16), "flashmla"),
    ((64, 32, K, "fp8_ds_mla", 1 << 18, BF16), "triton"),  # Gluon 89 vs adapter 134.5 us
    ((64, 64, K, "fp8_ds_mla", 1 << 18, BF16), "flashmla"),
    ((256, 16, K, "fp8_ds_mla", 1 << 18, BF16), "triton"),
    ((1, 128, K, "fp8_ds_mla", 1 << 18, BF16), "triton"),  # 52.4 vs 65.7 us via the adapter
    ((2, 128, K, "fp8_ds_mla", 1 << 18, BF16), "flashmla"),
    # derived rules
    ((4096, 32, K, "bf16", 65536, BF16), "triton"),  # padding to 64 eats the gain
    ((4096, 16, K, "bf16", 65536, BF16), "triton"),
    ((4096, 96, K, "bf16", 65536, BF16), "flashmla"),  # padded to 128
    ((63, 128, K, "bf16", 65536, BF16), "triton"),  # 63 x 2 programs of 64 heads
    ((64, 128, K, "bf16", 65536, BF16), "flashmla"),  # 128 programs: 107.6 vs 188.9 us
    ((127, 64, K, "bf16", 65536, BF16), "triton"),
    ((128, 64, K, "bf16", 65536, BF16), "flashmla"),
    ((1, 128, K, "bf16", 1 << 18, BF16), "triton"),  # bf16-cache decode: one program per head group
    ((4096, 128, K, "fp8_ds_mla", 65536, BF16), "flashmla"),  # reuse 128: dequantise once
    ((4096, 16, K, "fp8_ds_mla", 65536, BF16), "triton"),
    ((10, 128, K, "fp8_ds_mla", 100_001, BF16), "triton"),  # not pages and reuse 0.2: no dequant
    # never FlashMLA
    ((4096, 128, K, "bf16", 65536, F16), "triton"),
    ((4096, 128, K, "bf16", 65536, torch.float32), "triton"),
    ((4096, 256, K, "bf16", 65536, BF16), "triton"),
    ((0, 128, K, "fp8_ds_mla", 1 << 18, BF16), "triton"),
    ((128, 128, 0, "fp8_ds_mla", 1 << 18, BF16), "triton"),
    ((128, 128, K, "int8", 1 << 18, BF16), "triton"),
])
def test_choose_table(args, want):
    assert fm.choose(*args) == want


def test_choose_fp8_rows_by_layout_and_reuse():
    # 66 tokens x 2048 = 135,168 references. Rows not in whole pages: the decode kernel cannot
    # view them, and dequantise-once needs every row read at least once on average.
    assert fm.choose(66, 128, K, "fp8_ds_mla", 64001, BF16) == "flashmla"  # 2.1 refs per row
    assert fm.choose(66, 128, K, "fp8_ds_mla", 200_001, BF16) == "triton"  # 0.68 refs per row
    assert fm.choose(63, 128, K, "fp8_ds_mla", 64001, BF16) == "triton"  # 126 programs
    # the same 0.68 refs per row in whole pages: the fp8 decode kernel, no dequantisation
    assert fm.choose(66, 128, K, "fp8_ds_mla", 200_000, BF16) == "flashmla"


@pytest.mark.parametrize("T, topk, N, want", [
    (128, K, 1 << 18, "decode"),  # reuse 1
    (511, K, 1 << 18, "decode"),  # reuse 3.99
    (512, K, 1 << 18, "prefill"),  # reuse 4
    (4096, K, 65536, "prefill"),
    (1, K, 1000, "prefill"),  # not whole pages
    (1, K, 1024, "decode"),
])
def test_fp8_kernel(T, topk, N, want):
    assert fm.fp8_kernel(T, topk, N) == want


@pytest.mark.parametrize("args, want", [
    ((128, "fp8_ds_mla", BF16, 1 << 18, True), True),
    ((16, "fp8_ds_mla", BF16, 1 << 18, True), True),  # padded to 64
    ((128, "fp8_ds_mla", BF16, 1000, True), False),  # not whole pages
    ((128, "bf16", BF16, 1 << 18, True), False),  # the decode kernel reads fp8 only
    ((128, "bf16", BF16, 1000, False), True),
    ((128, "fp8_ds_mla", BF16, 1000, False), True),
    ((129, "bf16", BF16, 1000, False), False),
    ((0, "bf16", BF16, 1000, False), False),
    ((64, "bf16", F16, 1000, False), False),
    ((64, "bf16", BF16, 0, False), False),
])
def test_supported(args, want):
    assert fm.supported(*args) is want


@pytest.mark.parametrize("H, want", [(1, 64), (16, 64), (32, 64), (64, 64), (65, 128), (128, 128),
                                     (129, None), (0, None)])
def test_padded_heads(H, want):
    assert fm.padded_heads(H) == want


def test_pad_heads_zero_rows():
    q = torch.arange(2 * 3 * 576, dtype=torch.float32).reshape(2, 3, 576).to(BF16)
    p = fm.pad_heads(q, 64)
    assert p.shape == (2, 64, 576) and p.is_contiguous() and p.dtype == BF16
    assert torch.equal(p[:, :3], q) and not p[:, 3:].any()
    same = torch.zeros(2, 64, 576, dtype=BF16)
    assert fm.pad_heads(same, 64).data_ptr() == same.data_ptr()  # no copy when nothing to pad


def test_flashmla_indices():
    # cpplan's index kernels write NO_KEY (-1) as their only negative value
    idx = torch.tensor([[3, -1, 7], [-1, 0, 2]], dtype=torch.int64)
    got = fm.flashmla_indices(idx, granule=4)
    want = torch.tensor([[[3, -1, 7, -1]], [[-1, 0, 2, -1]]], dtype=torch.int32)
    assert got.dtype == torch.int32 and got.is_contiguous() and torch.equal(got, want)
    full = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    assert torch.equal(fm.flashmla_indices(full, granule=4), full.reshape(1, 1, 4))
    assert fm.flashmla_indices(torch.zeros(5, 2048, dtype=torch.int32)).shape == (5, 1, 2048)
    assert fm.flashmla_indices(torch.zeros(5, 100, dtype=torch.int32)).shape == (5, 1, 128)


def test_finish_converts_lse_and_empty_rows():
    out = torch.ones(2, 64, 512, dtype=BF16)
    lse = torch.full((2, 64), 1.5)
    lse[1, 2] = math.inf  # FlashMLA: row (token 1, head 2) has no key
    lse[0, 10] = math.inf  # a padded head: dropped
    o, l = fm.finish(out, lse, 3)
    assert o.shape == (2, 3, 512) and o.is_contiguous() and l.shape == (2, 3) and l.dtype == torch.float32
    want_l = torch.tensor([[1.5, 1.5, 1.5], [1.5, 1.5, -math.inf]])
    assert torch.equal(l, want_l)
    assert not o[1, 2].any() and (o[0] == 1).all() and (o[1, :2] == 1).all()


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (the GPU path: the replays)")
@pytest.mark.parametrize("empty_rows", [[], [(1, 2), (0, 0)]])
def test_finish_decode_kernel_equals_finish(empty_rows):
    """The decode conversion's kernel (masked zero stores on rows with no key only) gives what
    ``finish`` (a full pass over out) gives: lse -inf there, out 0 there, the rest untouched."""
    g = torch.Generator().manual_seed(len(empty_rows))
    out = torch.randn(3, 64, 512, generator=g).to(BF16)
    lse = torch.randn(3, 64, generator=g)
    for t, h in empty_rows:
        lse[t, h] = math.inf
    lse[2, 40] = math.inf  # a padded head: dropped by both
    want_o, want_l = fm.finish(out.clone(), lse.clone(), 3)
    o, l = fm._finish_decode_launch(out, lse, 3)
    assert torch.equal(l, want_l) and torch.equal(o, want_o)


def test_flashmla_set_plans_triton_where_flashmla_cannot_run():
    from cpplan.runtime.kernels import DeviceSpec
    from cpplan.runtime.kernels.flashmla import FLASHMLA
    from cpplan.runtime.kernels.triton import TRITON

    assert FLASHMLA.name == "flashmla"
    owner = dict(FLASHMLA.backend_of)
    own = {"sparse_mla_attention", "plan_attention"}
    assert own.isdisjoint(owner) and set(owner) == set(OP_NAMES) - own
    assert FLASHMLA.quantize_fp8_ds_mla is TRITON.quantize_fp8_ds_mla
    kw = dict(num_tokens=8, num_heads=64, topk=2048, kv_format="fp8_ds_mla",
              num_kv_rows=1 << 16, q_dtype=BF16)
    assert FLASHMLA.plan_attention(device="cpu", **kw) == TRITON.plan_attention(device="cpu", **kw)
    a100 = DeviceSpec("cuda", 108, (8, 0))
    assert FLASHMLA.plan_attention(device=a100, **kw).backend == "triton"
    h200 = DeviceSpec("cuda", 132, (9, 0))
    fused = FLASHMLA.plan_attention(device=h200, fused_remap=True, **kw)
    assert fused.backend == "triton"  # FlashMLA takes plain rows only
    plan = FLASHMLA.plan_attention(device=h200, **kw)
    if not fm.available():  # flash_mla does not import here: Triton's plan, same as Triton's
        assert plan == TRITON.plan_attention(device=h200, **kw)
    else:
        assert plan.backend == "flashmla" and plan.family == "flashmla-decode"


def test_adapter_refuses_what_flashmla_cannot_run():
    q = torch.zeros(2, 64, 576, dtype=BF16)
    kv = torch.zeros(10, 576, dtype=BF16)
    idx = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(KernelBackendError, match="expected .T, 1..128, 576. bfloat16 on CUDA"):
        fm.sparse_mla_attention(q, kv, idx, 0.1, "bf16")
    with pytest.raises(KernelBackendError, match="kv_format 'fp16'"):
        fm.sparse_mla_attention(q, kv, idx, 0.1, "fp16")


# --------------------------------------------------------------------------------------------
# GPU: FlashMLA against the reference
# --------------------------------------------------------------------------------------------
_WHY = fm.unavailable_reason()
needs_flashmla = pytest.mark.skipif(_WHY != "", reason=f"FlashMLA cannot run here: {_WHY}")
HEADS = [16, 32, 64, 128]


def _case(T, H, topk, N, fmt, seed):
    """q bf16, kv rows (bf16 or fp8_ds_mla), indices with 20% NO_KEY, token 0 with no key at all,
    token 1 reading the last rows of the buffer."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, 576, device="cuda", generator=g).to(BF16)
    raw = torch.randn(N, 576, device="cuda", generator=g)
    kv = ref.quantize_fp8_ds_mla(raw) if fmt == "fp8_ds_mla" else raw.to(BF16)
    idx = torch.randint(0, N, (T, topk), device="cuda", generator=g, dtype=torch.int32)
    idx[torch.rand(T, topk, device="cuda", generator=g) < 0.2] = ref.NO_KEY
    idx[0] = ref.NO_KEY
    idx[1, : min(topk, N)] = torch.arange(N - min(topk, N), N, device="cuda", dtype=torch.int32)
    return q, kv, idx


def _check(q, kv, idx, fmt, out, lse):
    sm = 576**-0.5
    want_o, want_l = ref.sparse_mla_attention(q.float(), kv, idx, sm, fmt)
    assert out.dtype == BF16 and out.shape == want_o.shape and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(want_l)
    assert empty[0].all() and not empty[1:].any()  # the case's one empty token
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    assert torch.isfinite(lse[~empty]).all()
    rel = ((out.double() - want_o.double()).norm() / want_o.double().norm()).item()
    assert rel < 1e-2, rel
    assert (lse[~empty] - want_l[~empty]).abs().max().item() < 1e-3


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("topk", [K, 100])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_prefill_path(fmt, topk, H):
    q, kv, idx = _case(70, H, topk, 3001, fmt, seed=H + topk)
    out, lse = fm.sparse_mla_attention(q, kv, idx, 576**-0.5, fmt, fp8_kernel_choice="prefill")
    _check(q, kv, idx, fmt, out, lse)


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("topk", [K, 100])
def test_decode_path(topk, H):
    q, kv, idx = _case(33, H, topk, 64 * 80, "fp8_ds_mla", seed=7 * H + topk)
    out, lse = fm.sparse_mla_attention(q, kv, idx, 576**-0.5, "fp8_ds_mla", fp8_kernel_choice="decode")
    _check(q, kv, idx, "fp8_ds_mla", out, lse)
    # a paged cache [blocks, 64, 656] is the same buffer
    out3, lse3 = fm.sparse_mla_attention(q, kv.view(-1, 64, 656), idx, 576**-0.5, "fp8_ds_mla",
                                         fp8_kernel_choice="decode")
    assert torch.equal(out3, out) and torch.equal(lse3, lse)


@pytest.mark.gpu
@needs_flashmla
def test_decode_schedule_reused_per_shape():
    fm._SCHEDULE_CACHE.clear()
    q, kv, idx = _case(17, 64, K, 64 * 64, "fp8_ds_mla", seed=1)
    fm.sparse_mla_attention(q, kv, idx, 576**-0.5, "fp8_ds_mla", fp8_kernel_choice="decode")
    meta = fm.decode_schedule(17, 64, K, q.device)
    assert len(fm._SCHEDULE_CACHE) == 1 and meta.have_initialized
    q2, kv2, idx2 = _case(17, 64, K, 64 * 64, "fp8_ds_mla", seed=2)  # same shape, new data
    out, lse = fm.sparse_mla_attention(q2, kv2, idx2, 576**-0.5, "fp8_ds_mla", fp8_kernel_choice="decode")
    assert fm.decode_schedule(17, 64, K, q.device) is meta and len(fm._SCHEDULE_CACHE) == 1
    _check(q2, kv2, idx2, "fp8_ds_mla", out, lse)
    q3, kv3, idx3 = _case(5, 64, K, 64 * 64, "fp8_ds_mla", seed=3)  # another batch: its own entry
    fm.sparse_mla_attention(q3, kv3, idx3, 576**-0.5, "fp8_ds_mla", fp8_kernel_choice="decode")
    assert len(fm._SCHEDULE_CACHE) == 2


@pytest.mark.gpu
@needs_flashmla
def test_raw_flashmla_conventions():
    """What the adapter converts, seen on the kernel itself: natural-log LSE, +inf and out 0 for a
    token with no key. If this fails, ``finish`` converts the wrong thing."""
    flash_mla = fm._import()[0]
    q, kv, idx = _case(8, 64, K, 1000, "bf16", seed=5)
    out, _, lse = flash_mla.flash_mla_sparse_fwd(q, kv.unsqueeze(1), fm.flashmla_indices(idx),
                                                 576**-0.5, d_v=512, use_legacy=True)
    want_o, want_l = ref.sparse_mla_attention(q.float(), kv, idx, 576**-0.5, "bf16")
    assert torch.isposinf(lse[0]).all() and (out[0] == 0).all()
    assert (lse[1:] - want_l[1:]).abs().max().item() < 1e-3
    assert ((out[1:].double() - want_o[1:]).norm() / want_o[1:].norm()).item() < 1e-2


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize("B, H, want", [(8, 64, "flashmla"), (8, 16, "triton")])
def test_kernel_set_on_gpu(B, H, want):
    from cpplan.runtime.kernels import get_kernels

    ks = get_kernels("cuda", "flashmla")
    q, kv, idx = _case(B, H, K, 1 << 16, "fp8_ds_mla", seed=B * H)
    plan = ks.plan_attention(num_tokens=B, num_heads=H, topk=idx.shape[1],
                             kv_format="fp8_ds_mla", num_kv_rows=kv.shape[0], q_dtype=q.dtype,
                             device=q.device)
    assert plan.backend == want
    out, lse = ks.sparse_mla_attention(q, kv, idx, 576**-0.5, "fp8_ds_mla", plan=plan)
    _check(q, kv, idx, "fp8_ds_mla", out, lse)




# --------------------------------------------------------------------------------------------
# GPU: a bound step through the FlashMLA kernel set, against the oracle (replay)
# --------------------------------------------------------------------------------------------
# bf16 activations round q and every output to bf16 on every path; the replay tests of
# tests/runtime/test_gpu.py measured 2e-3 .. 6e-3 and allow 2e-2 (3x margin, far below what one
# misplaced key does)
REPLAY_BF16_TOLERANCE = 2e-2


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize("pwi", [(1, 1, 1), (2, 2, 1)])
@pytest.mark.parametrize("kv", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager-step", "graph-replayable"])
def test_replay_through_flashmla_matches_the_oracle(pwi, kv, graph):
    """64 heads (FlashMLA's smallest), bf16 q: 4 decodes and a 256-token prompt, where the kernel
    set plans FlashMLA for the decode pass (fp8) and the prefill pass; or (graph-replayable) 130
    decodes padded to a graph size of 136, where the padded tokens, which have no key, go through
    FlashMLA too (130 rows: the bf16-row decode goes to FlashMLA from 128 rows of 64 heads). The restored outputs equal the single-device oracle."""
    import dataclasses

    import msgspec

    from cpplan.planner.compile import compile as compile_plan
    from cpplan.runtime.kernels import get_kernels
    from cpplan.schemas import ParallelConfig, StepInput
    from cpplan.sim.replay import replay_plan
    from cpplan.sim.simulate import SimOptions, preset_config

    p, w, i = pwi
    base = msgspec.structs.asdict(preset_config(SimOptions(pcp=p, dcp=w, interleave=i,
                                                           kv_cache_dtype=kv, layers=1)))
    cfg = ParallelConfig(**{**base, "num_heads": 64, "hidden_size": 64 * 512, "topk": 128,
                            "activation_dtype": "bfloat16",
                            "cudagraph_token_sizes": (8, 136) if graph else ()})
    if graph:  # 130 decodes: enough rows that the bf16-row decode is planned on FlashMLA too
        ctx = [90 + (37 * r) % 211 for r in range(130)]
        step = StepInput.build(3, [f"d{i}" for i in range(130)], ctx, [1] * 130, [False] * 130)
    else:
        step = StepInput.build(3, ["a", "b", "c", "d", "e"], [300, 200, 257, 129, 0],
                               [1, 1, 1, 1, 256], [False, False, False, False, True])
    plans, inner = [], get_kernels("cuda", "flashmla")

    def recording(**kwargs):
        plans.append(inner.plan_attention(**kwargs))
        return plans[-1]

    kernels = dataclasses.replace(inner, plan_attention=recording)
    plan = compile_plan(cfg, step)
    assert plan.graph_replayable == graph
    result = replay_plan(plan, seed=2, device="cuda", kernels=kernels)
    assert any(pl.backend == "flashmla" for pl in plans), [pl.describe() for pl in plans]
    assert result.max_abs_err <= REPLAY_BF16_TOLERANCE
