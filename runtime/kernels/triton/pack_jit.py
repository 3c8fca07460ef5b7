"""Jitted bodies of the fp8 packing and the one-pass dequantisation (launched by ``pack.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..fp8_jit import group_exponent, scale_bits, scale_by_pow2, to_e4m3_bits


@triton.jit(do_not_specialize=["T"])
def quantize_q_fp8(q_ptr, w_ptr, q8_ptr, w8_ptr, T, stride_qt, stride_qh, stride_wt, HI,
                   BT: tl.constexpr, HP: tl.constexpr):
    """BT tokens' indexer queries ``[HI, 128]`` -> fp8 e4m3 values (one power-of-two scale per
    head), as bytes or in q8's wider dtype, and the weights times the scale
    (``reference.quantize_indexer_q``, bit for bit)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.arange(0, HP)
    m = (t < T)[:, None] & (h < HI)[None, :]
    tq = t.to(tl.int64)[:, None, None] * stride_qt + h[None, :, None] * stride_qh
    d = tl.arange(0, 128)[None, None, :]
    x = tl.load(q_ptr + tq + d, mask=m[:, :, None], other=0.0).to(tl.float32)
    e = group_exponent(tl.max(tl.abs(x), 2))  # [BT, HP]
    f8 = to_e4m3_bits(scale_by_pow2(x, -e[:, :, None]))
    q8 = t.to(tl.int64)[:, None, None] * (HI * 128) + h[None, :, None] * 128
    if q8_ptr.dtype.element_ty != tl.uint8:  # the fp8 values in a wider dtype (exact)
        f8 = f8.to(tl.float8e4nv, bitcast=True).to(q8_ptr.dtype.element_ty)
    tl.store(q8_ptr + q8 + d, f8, mask=m[:, :, None])
    w = tl.load(w_ptr + t.to(tl.int64)[:, None] * stride_wt + h[None, :], mask=m, other=0.0)
    scale = scale_bits(e).to(tl.float32, bitcast=True)
    tl.store(w8_ptr + t.to(tl.int64)[:, None] * HI + h[None, :], w.to(tl.float32) * scale, mask=m)


@triton.jit
def pack_fp8(x_ptr, slots_ptr, cache_ptr, stride_x, stride_c,
              GROUPS: tl.constexpr, HAS_ROPE: tl.constexpr, PLANAR_BLOCK: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    if slot >= 0:
        x = tl.load(x_ptr + i.to(tl.int64) * stride_x + tl.arange(0, GROUPS * 128)).to(tl.float32)
        xg = tl.reshape(x, (GROUPS, 128))
        e = group_exponent(tl.max(tl.abs(xg), 1))
        f8 = to_e4m3_bits(scale_by_pow2(xg, -e[:, None]))
        if PLANAR_BLOCK > 0:  # block-planar indexer K cache (GROUPS 1): values, then scales
            base = cache_ptr + (slot // PLANAR_BLOCK) * stride_c
            row = base + (slot % PLANAR_BLOCK) * 128
            scale_ptr = base + PLANAR_BLOCK * 128 + (slot % PLANAR_BLOCK) * 4
        else:  # packed rows
            row = cache_ptr + slot * stride_c
            scale_ptr = row + GROUPS * 128
        tl.store(row + tl.arange(0, GROUPS * 128), tl.reshape(f8, (GROUPS * 128,)))
        # scale 2**e as float32 bits; subnormal below 2**-126
        tl.store(scale_ptr.to(tl.pointer_type(tl.int32)) + tl.arange(0, GROUPS), scale_bits(e))
        if HAS_ROPE:
            r = tl.load(x_ptr + i.to(tl.int64) * stride_x + GROUPS * 128 + tl.arange(0, 64))
            # bf16 RNE from the bits (the interpreter's float32 -> bf16 cast truncates)
            rb = r.to(tl.float32).to(tl.int32, bitcast=True)
            rb = (rb + 0x7FFF + ((rb >> 16) & 1)) >> 16
            rope_ptr = (row + GROUPS * 128 + 4 * GROUPS).to(tl.pointer_type(tl.int16))
            tl.store(rope_ptr + tl.arange(0, 64), rb.to(tl.int16))


@triton.jit(do_not_specialize=["n"])
def unpack_fp8_ds_mla(packed_ptr, out_ptr, n, stride_p, stride_o, BLOCK_R: tl.constexpr):
    """Rows ``[BLOCK_R, 656]`` uint8 -> ``[BLOCK_R, 576]`` out dtype: fp8 value x its group's
    power-of-two scale (exact in float32), RoPE bf16 as stored."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m = (r < n)[:, None]
    src = packed_ptr + r.to(tl.int64)[:, None] * stride_p
    dst = out_ptr + r.to(tl.int64)[:, None] * stride_o
    raw = tl.load(src + tl.arange(0, 512)[None, :], mask=m, other=0)
    vals = tl.reshape(raw.to(tl.float8e4nv, bitcast=True).to(tl.float32), (BLOCK_R, 4, 128))
    scale = tl.load((src + 512).to(tl.pointer_type(tl.float32)) + tl.arange(0, 4)[None, :], mask=m, other=0.0)
    lat = tl.reshape(vals * scale[:, :, None], (BLOCK_R, 512))
    tl.store(dst + tl.arange(0, 512)[None, :], lat.to(out_ptr.dtype.element_ty), mask=m)
    rope = tl.load((src + 528).to(tl.pointer_type(tl.bfloat16)) + tl.arange(0, 64)[None, :], mask=m, other=0.0)
    tl.store(dst + 512 + tl.arange(0, 64)[None, :], rope.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def split_planes_kernel(src, vals, scales, n_words, BLOCK: tl.constexpr):
    """Packed indexer keys (33 int32 words a key: 32 of fp8 values, then the float32 scale's
    bits) into the two planes, ``vals`` 32 words a key and ``scales`` one: the source read
    flat (coalesced), each word stored to its plane."""
    w = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = w < n_words
    x = tl.load(src + w, mask=live)
    r = w // 33
    c = w - r * 33
    tl.store(vals + r * 32 + c, x, mask=live & (c < 32))
    tl.store(scales + r, x, mask=live & (c == 32))
