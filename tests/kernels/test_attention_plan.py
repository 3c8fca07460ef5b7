"""The attention plans: the Triton backend's choices on fake devices, written out from the
choices the pre-plan code made (``triton_attention.default_config`` / ``_launch_config`` /
``_num_splits`` and ``gluon_attention.default_*`` at commit f16a9d2, read by hand), and plans
run as given against the reference (interpreter, fp16 / fp32 operands)."""

import dataclasses
import os

import pytest
import torch

from cpplan.runtime.kernels import (
    AttentionPlan,
    AttentionPlanError,
    DeviceSpec,
    get_kernels,
)
from cpplan.runtime.kernels import reference as ref
from cpplan.runtime.kernels.triton import plan as tplan

H200 = DeviceSpec(kind="cuda", sm_count=132, capability=(9, 0))
A100 = DeviceSpec(kind="cuda", sm_count=108, capability=(8, 0))
CPU = DeviceSpec(kind="cpu")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
FP8, B16 = "fp8_ds_mla", "bf16"

# (device, T, H, topk, kv_format, rows, q dtype, fused remap) -> (family, splits, fp8_rows,
#  block_h, block_k, warps, stages). Splits are after rounding to whole key blocks per split.
TABLE = [
    # prefill, T 4096, H 128 over a gathered buffer of 65,536 rows
    ((H200, 4096, 128, 2048, B16, 65536, BF16, False), ("triton-heads", 1, "none", 64, 64, 8, 3)),
    ((H200, 4096, 128, 2048, FP8, 65536, BF16, False), ("triton-heads", 1, "dequantise_once", 64, 64, 8, 3)),
    ((H200, 4096, 128, 2048, FP8, 0, BF16, False), ("triton-heads", 1, "in_kernel", 64, 64, 8, 2)),  # rows unknown
    # dequantise-once threshold: T * topk >= 4 * rows
    ((H200, 128, 64, 2048, FP8, 65536, BF16, False), ("triton-heads", 2, "dequantise_once", 64, 64, 8, 3)),
    ((H200, 127, 64, 2048, FP8, 65536, BF16, False), ("triton-heads", 2, "in_kernel", 64, 64, 8, 2)),
    # decode, B 128, H 128 (each row read about once)
    ((H200, 128, 128, 2048, FP8, 1 << 18, BF16, False), ("triton-heads", 1, "in_kernel", 64, 64, 8, 2)),
    # few-head fp8 decode on sm_90: Gluon "small" up to 16 heads, "ring" for 17-32
    ((H200, 256, 16, 2048, FP8, 1 << 18, BF16, False), ("gluon-small", 1, "in_kernel", 16, 64, 4, 3)),
    ((H200, 64, 32, 2048, FP8, 1 << 18, BF16, False), ("gluon-ring", 2, "in_kernel", 32, 64, 8, 2)),
    ((H200, 1, 16, 2048, FP8, 1 << 18, BF16, False), ("gluon-small", 16, "in_kernel", 16, 64, 4, 3)),
    ((H200, 5, 8, 70, FP8, 300, BF16, False), ("gluon-small", 1, "in_kernel", 16, 64, 4, 3)),
    ((H200, 4, 24, 2048, FP8, 1 << 18, BF16, False), ("gluon-ring", 16, "in_kernel", 32, 64, 8, 2)),
    # ... but not with a fused remap, a non-bf16 q, off sm_90, or when rows are dequantised once
    ((H200, 256, 16, 2048, FP8, 1 << 18, BF16, True), ("triton-heads-scaled", 1, "in_kernel", 16, 64, 4, 2)),
    ((A100, 256, 16, 2048, FP8, 1 << 18, BF16, False), ("triton-heads-scaled", 1, "in_kernel", 16, 64, 4, 2)),
    ((H200, 256, 16, 2048, FP8, 65536, BF16, False), ("triton-heads", 1, "dequantise_once", 16, 64, 4, 2)),
    ((H200, 3, 16, 40, FP8, 128, FP32, False), ("triton-heads-scaled", 1, "in_kernel", 16, 64, 4, 2)),
    # ... and at 128 heads too: 16 fp32 heads a program fit the shared memory, 64 do not
    ((H200, 3, 128, 2048, FP8, 1 << 18, FP32, False), ("triton-heads-scaled", 8, "in_kernel", 16, 64, 4, 2)),
    # float32 q over unquantised rows: 32 keys, 1 stage
    ((H200, 3, 16, 40, B16, 128, FP32, False), ("triton-heads", 1, "none", 16, 32, 4, 1)),
    ((H200, 3, 64, 4096, B16, 128, FP32, False), ("triton-heads", 64, "none", 64, 32, 8, 1)),
    # splits: double while T * head blocks < SMs, each split keeping >= 2 key blocks (T > 1)
    ((H200, 8, 64, 2048, FP8, 1 << 18, BF16, False), ("triton-heads", 16, "in_kernel", 64, 64, 8, 2)),
    ((H200, 2, 128, 2048, FP8, 1 << 18, BF16, False), ("triton-heads", 16, "in_kernel", 64, 64, 8, 2)),
    ((A100, 4, 32, 2048, FP8, 1 << 18, BF16, False), ("triton-heads-scaled", 16, "in_kernel", 32, 64, 4, 2)),
    ((H200, 33, 64, 2000, B16, 4096, BF16, False), ("triton-heads", 4, "none", 64, 64, 8, 3)),
    # interpreter (CPU): 1 split, 2 at T 1
    ((CPU, 3, 16, 70, B16, 100, FP16, False), ("triton-heads", 1, "none", 16, 64, 4, 2)),
    ((CPU, 1, 64, 70, FP8, 90, FP16, False), ("triton-heads", 2, "in_kernel", 64, 64, 8, 2)),
    ((CPU, 2, 128, 64, B16, 80, FP16, False), ("triton-heads", 1, "none", 64, 64, 8, 3)),
]

# Changed on purpose, from H200 measurements (bench/kernel_times.py --only plans, 2026-11-30): one
# query token splits down to one key block per split (the pre-plan code kept two: 16 splits at
# topk 2048, most SMs idle) and takes 16 heads per program (fp8 44.2 us vs 78.9 at 64 heads).
TABLE_T1 = [
    ((H200, 1, 128, 2048, FP8, 1 << 18, BF16, False), ("triton-heads", 32, "in_kernel", 16, 64, 4, 2)),
    ((H200, 1, 128, 2048, B16, 1 << 18, BF16, False), ("triton-heads", 32, "none", 16, 64, 4, 2)),
    ((A100, 1, 16, 2048, FP8, 1 << 18, BF16, False), ("triton-heads-scaled", 32, "in_kernel", 16, 64, 4, 2)),
    ((H200, 1, 64, 256, B16, 1024, BF16, False), ("triton-heads", 4, "none", 16, 64, 4, 2)),
]


def _planned(dev, T, H, topk, fmt, rows, qdt, remap, **forced):
    return tplan.plan_attention(num_tokens=T, num_heads=H, topk=topk, kv_format=fmt, num_kv_rows=rows,
                                q_dtype=qdt, device=dev, fused_remap=remap, **forced)


@pytest.fixture
def with_gluon(monkeypatch):
    """Plans on a fake H200 assume a Triton with Gluon whatever this machine's Triton has."""
    monkeypatch.setattr(tplan, "gluon_available", lambda: True)


@pytest.mark.parametrize("case,want", TABLE + TABLE_T1)
def test_triton_plan_table(with_gluon, case, want):
    p = _planned(*case)
    got = (p.family, p.num_splits, p.fp8_rows, p.block_h, p.block_k, p.num_warps, p.num_stages)
    assert p.backend == "triton" and got == want, p.describe()


def test_no_gluon_in_this_triton_means_the_triton_kernels(monkeypatch):
    monkeypatch.setattr(tplan, "gluon_available", lambda: False)
    p = _planned(H200, 256, 16, 2048, FP8, 1 << 18, BF16, False)
    assert (p.family, p.block_k, p.num_warps, p.num_stages) == ("triton-heads-scaled", 64, 4, 2)
    with pytest.raises(AttentionPlanError, match="and a Triton with Gluon"):
        _planned(H200, 256, 16, 2048, FP8, 1 << 18, BF16, False, family="gluon-small")


def test_forced_choices_and_their_launch_numbers(with_gluon):
    """A forced family takes that family's launch numbers; forced splits are rounded to whole
    key blocks (7 splits of 2048 keys = 320 keys each, 7 splits)."""
    p = _planned(H200, 64, 32, 2048, FP8, 1 << 18, BF16, False, family="gluon-small", num_splits=7)
    assert (p.family, p.block_h, p.num_warps, p.num_stages, p.num_splits) == ("gluon-small", 32, 8, 2, 7)
    p = _planned(H200, 128, 128, 2048, FP8, 1 << 18, BF16, False, family="triton-heads-scaled")
    assert (p.family, p.block_k, p.num_warps, p.num_stages, p.fp8_rows) == ("triton-heads-scaled", 64, 8, 2,
                                                                             "in_kernel")
    p = _planned(H200, 4096, 128, 2048, FP8, 65536, BF16, False, fp8_rows="in_kernel")
    assert (p.fp8_rows, p.num_stages) == ("in_kernel", 2)
    assert _planned(H200, 1, 128, 100, B16, 9, BF16, False, num_splits=64).num_splits == 2  # 64-key blocks
    assert tplan.keys_per_split(2048, 7, 64) == 320 and tplan.keys_per_split(0, 1, 64) == 64


def test_split_policy_is_the_small_function_it_says():
    assert tplan.split_policy(2, 2048, 64, 132, 1) == 32  # 64 programs: every split one 64-key block
    assert tplan.split_policy(2, 2048, 64, 132, 2) == 16
    assert tplan.split_policy(200, 2048, 64, 132, 2) == 1  # the grid already covers the SMs
    assert tplan.split_policy(33, 2048, 64, 132, 2) == 4  # 33 * 4 = 132


def test_plan_is_frozen_validated_and_described():
    p = AttentionPlan(backend="triton", family="triton-heads", num_splits=2, fp8_rows="in_kernel",
                      block_h=64, block_k=64, num_warps=8, num_stages=2)
    assert p.describe() == "triton/triton-heads splits=2 fp8_rows=in_kernel h64 k64 w8 s2"
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.num_splits = 3
    with pytest.raises(AttentionPlanError, match="fp8_rows 'twice', expected one of"):
        AttentionPlan(backend="triton", family="triton-heads", fp8_rows="twice")
    with pytest.raises(AttentionPlanError, match="num_splits 0, expected an int >= 1"):
        AttentionPlan(backend="triton", family="triton-heads", num_splits=0)
    r = get_kernels("cpu").plan_attention(num_tokens=3, num_heads=16, topk=8, kv_format=FP8,
                                          num_kv_rows=10, q_dtype=FP32, device="cpu")
    assert r == AttentionPlan(backend="reference", family="reference", fp8_rows="in_kernel")
    assert r.describe() == "reference/reference splits=1 fp8_rows=in_kernel"


def test_reference_runs_its_plan_and_a_remap():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 576, generator=g, dtype=torch.float64)
    kv = torch.randn(4 * 20, 576, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 40, (2, 6), generator=g)
    ids[0, 1] = ref.NO_KEY
    pcu = torch.tensor([3, 5])
    plan = ref.plan_attention(num_tokens=2, num_heads=4, topk=6, kv_format=B16, num_kv_rows=80,
                              q_dtype=q.dtype, device="cpu")
    out, lse = ref.sparse_mla_attention(q, kv, ids, 0.1, plan=plan, remap=(pcu, 20, 4, 1))
    rows = ref.remap_to_gathered(ids, pcu, 20, 4, 1)
    want_o, want_l = ref.sparse_mla_attention(q, kv, rows, 0.1)
    assert torch.equal(out, want_o) and torch.equal(lse, want_l)
    triton_plan = AttentionPlan(backend="triton", family="triton-heads")
    with pytest.raises(AttentionPlanError, match="plan for backend 'triton' given to the 'reference'"):
        ref.sparse_mla_attention(q, kv, rows, 0.1, plan=triton_plan)


INTERP = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [FP16, FP32])
def test_explicit_plans_run_as_given(dtype):
    """Plans built by hand (every family the interpreter runs, splits and launch numbers other
    than the defaults) against the float64 reference on the same rounded operands."""
    from cpplan.runtime.kernels.triton.attention import sparse_mla_attention

    g = torch.Generator().manual_seed(21)
    T, H, topk, N = 2, 20, 70, 150  # topk: a block of 64 and a partial one
    q = torch.randn(T, H, 576, generator=g).to(dtype)
    kv = torch.randn(N, 576, generator=g)
    idx = torch.randint(0, N, (T, topk), generator=g, dtype=torch.int32)
    idx[0, ::3] = ref.NO_KEY
    tol = 3e-3 if dtype == FP16 else 1e-5
    cases = [(B16, "triton-heads", "none", 1), (B16, "triton-heads", "none", 3),
             (FP8, "triton-heads", "in_kernel", 2), (FP8, "triton-heads", "dequantise_once", 1),
             (FP8, "triton-heads-scaled", "in_kernel", 5)]
    for fmt, family, rows_mode, splits in cases:
        buf = ref.quantize_fp8_ds_mla(kv) if fmt == FP8 else kv.to(dtype)
        want_o, want_l = ref.sparse_mla_attention(q.double(), buf.double() if fmt == B16 else buf, idx,
                                                  0.05, fmt)
        for block_h, block_k, warps, stages in ((32, 32, 4, 1), (16, 64, 4, 2)):  # 20 heads: 1 or 2 blocks
            plan = AttentionPlan(backend="triton", family=family, num_splits=splits, fp8_rows=rows_mode,
                                 block_h=block_h, block_k=block_k,
                                 num_warps=warps, num_stages=stages)
            out, lse = sparse_mla_attention(q, buf, idx, 0.05, fmt, plan=plan)
            rel = ((out.double() - want_o).norm() / want_o.norm()).item()
            assert rel < tol, (plan.describe(), rel)
            fin = torch.isfinite(want_l)
            assert torch.equal(torch.isfinite(lse), fin)
            assert (lse[fin].double() - want_l[fin]).abs().max().item() < 1e-3, plan.describe()
