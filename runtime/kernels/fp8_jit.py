"""Jitted fp8 helpers that the Triton and the Gluon kernel bodies share: the power-of-two
scales from float32 bits (``triton/pack_jit``'s quantisation and ``gluon/indexer_logits_jit``'s
in-kernel query quantisation, so both pick the same scale) and the e4m3 rounding in integer
arithmetic (the Triton bodies, which the interpreter also runs; the Gluon kernel converts in
hardware, the same round-to-nearest-even). Elementwise on whatever layout they are given; the
one kernels module a ``*_jit`` module may import (tests/kernels/test_layout.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pow2(e):
    """2**e as float32 for int32 e in [-126, 127] (normal range), from the bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3_bits(y):
    """float32 -> fp8 e4m3fn bits (uint8), round to nearest even, saturating at 448.

    Written out in integer arithmetic rather than ``.to(tl.float8e4nv)`` because Triton's
    interpreter rounds that cast wrongly (31.0 -> 16.0); one code path for the GPU and the
    interpreter keeps the CPU tests meaningful.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normal e4m3 (|y| >= 2**-6): drop 20 mantissa bits with round-to-nearest-even
    lsb = (a >> 20) & 1
    code_n = ((a + 0x7FFFF + lsb) >> 20) - (120 << 3)
    # subnormal e4m3: multiples of 2**-9, RNE through the float32 add-and-subtract trick
    mag = a.to(tl.float32, bitcast=True)
    code_s = ((mag * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a >= (121 << 23), code_n, code_s)
    code = tl.minimum(code, 0x7E)
    return (code | sign).to(tl.uint8)


@triton.jit
def group_exponent(amax):
    """``reference.fp8_scale_exponent`` from the float32 bits: ceil(log2(max(amax, 2**-126)
    / 448)) as int32."""
    bits = tl.maximum(amax, 1.1754943508222875e-38).to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def scale_by_pow2(x, ne):
    """x * 2**ne, exact, in two power-of-two steps (no factor outside the normal range)."""
    a = ne // 2
    return x * pow2(a) * pow2(ne - a)


@triton.jit
def scale_bits(e):
    """float32 bits of 2**e (subnormal below 2**-126)."""
    return tl.where(e >= -126, (e + 127) << 23, 1 << tl.maximum(e + 149, 0))
