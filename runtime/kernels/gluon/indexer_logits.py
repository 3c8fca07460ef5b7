"""Launcher of the warp-specialised prefill indexer logits (body in ``indexer_logits_jit.py``;
sm_90, a Triton with Gluon: importing this module fails with ImportError on one without).

``indexer_tiled.prefill_logits`` calls it on a Hopper GPU where ``supported`` holds and the
chunk is at least ``IndexerTiles.ws_min_keys`` wide, and the Triton kernel elsewhere (the
interpreter, other GPUs, narrow chunks, gather layouts whose 64-key boxes are not runs of rows).
Figures: bench/RESULTS.md (``python3 bench/indexer.py --only planar --planar-variants ws``).
"""

from __future__ import annotations

import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import indexer_logits_jit as ljit

BOX = 64  # key rows a TMA box: the M of one math warpgroup's product
MAX_COLUMNS = 256  # block_q x padded heads: the N of one wgmma
# (kernel register cap, registers of a math warpgroup) by math warpgroups: the CTA's warpgroups
# (the loader's and the math ones) share the 64K registers; the loader keeps what is left
_REGISTERS = {2: (168, 240), 3: (128, 152), 4: (96, 112)}


def padded_heads(num_heads: int) -> int:
    """Heads padded to a power of two >= 16 (the product's columns of one query)."""
    return max(16, triton.next_power_of_2(num_heads))


def supported(W: int, I: int, num_heads: int, block_q: int, math_warpgroups: int = 2) -> bool:
    """Whether the kernel takes this layout: every 64-key box one run of plane rows (one rank,
    or an interleave that 64 divides) and product columns that the math warpgroups' registers
    hold (256 at 2, 128 at 3 or 4)."""
    return (W == 1 or I % BOX == 0) and _columns_fit(block_q * padded_heads(num_heads),
                                                     math_warpgroups)


def _columns_fit(columns: int, math_warpgroups: int) -> bool:
    """Whether a math warpgroup's registers hold its accumulator: 256 columns (128 float32 a
    thread) at 2 math warpgroups (240 registers a thread), 128 at 3 or 4 (152, 112)."""
    return columns <= MAX_COLUMNS // (1 if math_warpgroups == 2 else 2)


def launch(q8, weights, kp, ks, out, lens, pcu, PT: int, W: int, I: int, *, block_q: int = 4,
           math_warpgroups: int = 2, stages: int = 4, pipelined: bool = False,
           split: bool = False, scatter: bool = False, last_wave_parts: int | None = None,
           quantise: bool = False, math_stage: bool = False, unroll: bool = False,
           thread_arrive: bool = False, _probe: bool = False) -> None:
    """Prefill int32 keys ``out [T, >= max lens]`` (``indexer_tiled._logits_planar``'s
    contract): q8 ``[T, HI, 128]`` float8_e4m3fn, weights ``[T, HI]`` float32 (the query's
    scales folded in), the key planes ``kp [R, 128]`` float8_e4m3fn (contiguous) and ``ks [R]``
    float32, key_len ``lens [T]``, region starts ``pcu [T]`` int64; all on one CUDA device.
    Only the first lens[t] columns of row t are written. block_q queries a CTA, tiles of
    ``math_warpgroups`` x 64 keys, ``stages`` tiles in the ring; ``pipelined``: a math
    warpgroup issues its next product before an epilogue (two accumulators: at most 128
    columns, 2 math warpgroups); ``split``: the math warpgroups split the CTA's queries
    instead of its keys (block_q each, math_warpgroups x block_q a CTA, tiles of 64 keys that
    every warpgroup multiplies); ``scatter`` (block_q 2): each quad's sums over heads
    transposed through shared memory and finished in registers, so that a thread scales and
    stores one (key, query) instead of all four lanes holding four. The blocks that would make
    the grid's last, partial wave are cut into ``last_wave_parts`` CTAs each (a part of the key
    tiles each; None: the count ``last_wave_split`` picks for this device's SMs, 1: none).
    ``quantise``: q8 is the unquantised query ``[T, HI, 128]`` (a float dtype, unit last
    stride) and weights the raw head weights ``[T, HI]``; each CTA quantises its queries as it
    loads them, as ``triton.pack.quantize_indexer_q`` would (the same fp8 values and weights
    times scales, bit for bit), so no quantisation launch precedes this one. ``math_stage``
    (``split`` only): each math warpgroup copies (and with ``quantise`` quantises) its own
    queries into shared memory as it starts, under the loader's first key copies, instead of
    the loader's warpgroup copying the CTA's queries before the partitions start. ``unroll``
    (not ``pipelined``): the math warpgroups' loop runs ``stages`` tiles a trip, each ring
    stage's barriers and descriptors fixed at compile time, instead of computed a tile.
    ``thread_arrive``: each math thread arrives on a ring stage's free barrier once its
    product is waited on, instead of thread 0 after a barrier of the warpgroup's 128 threads.
    ``_probe`` (bench only): the epilogue left out, so the time is the products' and the
    pipeline's (keys not written)."""
    T, HI, _ = q8.shape
    columns = block_q * padded_heads(HI)
    if not supported(W, I, HI, block_q, math_warpgroups) or math_warpgroups not in _REGISTERS \
            or stages < 2:
        raise ValueError(f"warp-specialised logits: got W {W}, interleave {I}, {HI} heads, "
                         f"block_q {block_q}, {math_warpgroups} math warpgroups, {stages} "
                         f"stages; expected one rank or an interleave that {BOX} divides, 2 to "
                         f"4 math warpgroups, block_q x padded heads <= {MAX_COLUMNS} (128 at 3 "
                         f"or 4 math warpgroups), >= 2 stages")
    if scatter and block_q != 2:
        raise ValueError(f"warp-specialised logits, scatter: got block_q {block_q}; expected 2 "
                         f"(a quad's four lanes: two keys x two queries)")
    if pipelined and (math_warpgroups != 2 or columns > MAX_COLUMNS // 2):
        raise ValueError(f"warp-specialised logits, pipelined: got {math_warpgroups} math "
                         f"warpgroups, {columns} columns (block_q {block_q}); expected 2 math "
                         f"warpgroups and at most {MAX_COLUMNS // 2} columns (two accumulators "
                         f"a thread)")
    if quantise and (not q8.dtype.is_floating_point or q8.element_size() < 2
                     or q8.stride(-1) != 1 or weights.stride(-1) != 1):
        raise ValueError(f"warp-specialised logits, quantise: got q {q8.dtype} strides "
                         f"{tuple(q8.stride())}, weights strides {tuple(weights.stride())}; "
                         f"expected an unquantised float query and weights of unit last stride")
    if math_stage and not split:
        raise ValueError(f"warp-specialised logits, math_stage: got split {split}; expected "
                         f"split (each math warpgroup owns the queries it copies)")
    if pipelined and unroll:
        raise ValueError("warp-specialised logits: got pipelined and unroll; expected unroll "
                         "with the waited pass only")
    if T == 0:
        return
    layout = gl.NVMMASharedLayout.get_default_for([BOX, 128], gl.float8e4nv)
    kdesc = TensorDescriptor.from_tensor(kp, [BOX, 128], layout)
    cap, regs = _REGISTERS[math_warpgroups]
    cta_queries = block_q * (math_warpgroups if split else 1)
    blocks = triton.cdiv(T, cta_queries)
    whole, parts = last_wave_split(blocks, _sms(q8.device), last_wave_parts)
    ljit.ws_logits_kernel[(whole + (blocks - whole) * parts,)](
        q8, weights, kdesc, ks, out, lens, pcu, q8.stride(0), q8.stride(1), weights.stride(0),
        out.stride(0), T, HI, PT, whole, parts, W=W, I=I, BQ=block_q, HP=padded_heads(HI),
        NM=math_warpgroups, NS=stages, MATH_REGS=regs, EPI=0 if _probe else 2 if scatter else 1,
        PIPE=pipelined, SPLIT=split, QUANT=quantise, STAGE=math_stage, UNROLL=unroll,
        TARRIVE=thread_arrive, CQP=triton.next_power_of_2(cta_queries), num_warps=4,
        maxnreg=cap)


def last_wave_split(blocks: int, sms: int, parts: int | None = None,
                    max_parts: int = 8) -> tuple[int, int]:
    """(whole, parts): the first ``whole`` CTAs take a block each (the longest first), the
    other ``blocks - whole`` blocks ``parts`` CTAs each. One CTA a SM, blocks of about equal
    work: the blocks past the last whole wave (or all, if fewer than the SMs) are cut into
    the count of parts (at most ``max_parts``) whose waves end soonest, ceil(rest x p / SMs)
    / p of a block's time (the fewest parts on a tie); none where the waves are whole.
    ``parts`` given: that many (1: no cut)."""
    rest = blocks % sms
    if parts is None:
        parts = min(range(1, max_parts + 1), key=lambda p: (-(-rest * p // sms) / p, p))
    if rest == 0 or parts <= 1:
        return blocks, 1
    return blocks - rest, parts


def _sms(device) -> int:
    """Streaming multiprocessors of a CUDA device (torch keeps its properties)."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count
