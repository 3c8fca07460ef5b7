"""tests/kernels/conftest.py's fast ``xor_sum`` for the Triton interpreter: a kernel's xor_sum
over every axis (keep_dims or not) and its ``tl.sort`` equal those of the interpreter's own
element-by-element reduction, for every integer width the kernels sort."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1")


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def xor_and_sort(x, xored, ordered, AX: tl.constexpr, KEEP: tl.constexpr):
        v = tl.load(x + tl.arange(0, 16))
        r = tl.xor_sum(tl.reshape(v, [2, 2, 2, 2]), AX, KEEP)
        tl.store(xored + tl.arange(0, 8), tl.reshape(r, [8]))
        tl.store(ordered + tl.arange(0, 16), tl.sort(v, 0, descending=True))

    return xor_and_sort


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_fast_xor_sum_equals_the_interpreters_own(dtype, monkeypatch):
    from triton.runtime import interpreter

    ops = interpreter.ReduceOps
    assert ops._cpplan_xor  # installed by the conftest
    kernel = _kernel()
    g = torch.Generator().manual_seed(5)
    info = torch.iinfo(dtype)
    x = torch.randint(info.min, info.max, (16,), generator=g, dtype=torch.int64).to(dtype)
    for axis in range(4):
        for keep in (False, True):
            got = []
            for loop in (False, True):  # the fast path, then the interpreter's element loop
                if loop:
                    monkeypatch.setattr(ops, "apply_impl", ops.generic_reduce)
                xored, ordered = torch.empty(8, dtype=dtype), torch.empty(16, dtype=dtype)
                kernel[(1,)](x, xored, ordered, AX=axis, KEEP=keep)
                got.append((xored, ordered))
                monkeypatch.undo()
            assert torch.equal(got[0][0], got[1][0]), (axis, keep)
            assert torch.equal(got[0][1], got[1][1])
            assert torch.equal(got[0][1], torch.sort(x, descending=True).values)
