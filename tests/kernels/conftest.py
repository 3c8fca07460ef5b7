"""Kernel tests: on a machine without CUDA the Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before any ``triton.jit`` decorator runs, hence here, at collection.
GPU tests carry ``@pytest.mark.gpu`` and skip themselves when CUDA is absent.

The interpreter runs a reduction whose combine function it does not know element by element in
Python; ``tl.sort`` (a bitonic network) takes one ``xor_sum`` per compare-and-swap stage, so
most of an interpreted sort was that loop (e.g. 15 s of a 19 s select case). Here the
interpreter's ``xor_sum`` is numpy's exact integer XOR reduction over the same axis (the same
values and dtype: XOR is associative and commutative), everything else as Triton ships it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fast_interpreted_xor_sum() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    reduce_ops = interpreter.ReduceOps
    if getattr(reduce_ops, "_cpplan_xor", False):
        return
    slow = reduce_ops.apply_impl

    def apply_impl(self, input):
        if self.combine_fn is tl.standard._xor_combine and self.axis is not None \
                and len(input) == 1:
            data = input[0].handle.data
            return self.to_tensor(np.bitwise_xor.reduce(data, axis=self.axis,
                                                        keepdims=self.keep_dims),
                                  input[0].dtype)
        return slow(self, input)

    reduce_ops.apply_impl = apply_impl
    reduce_ops._cpplan_xor = True


if os.environ.get("TRITON_INTERPRET") == "1":
    _fast_interpreted_xor_sum()
