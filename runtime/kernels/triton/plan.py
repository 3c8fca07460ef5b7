"""The Triton backend's attention plan: kernel family, top-k splits and launch numbers.

Pure host arithmetic on the shape of the work and a ``DeviceSpec`` (no tensor, no sync). The
numbers are the H200 tuning measured by bench/kernel_times.py (bench/RESULTS.md, "Kernels on the
H200" and after); changing one is a measurement, not a guess. Choices, in order:

1. fp8_ds_mla rows referenced ``DEQUANTISE_ONCE_REUSE`` times or more on average
   (``T * topk >= REUSE * rows``: a prefill over a gathered buffer) are dequantised once, then
   read by the kernel for unquantised rows; otherwise fp8 rows are read in the kernel.
2. fp8 rows read in the kernel by bf16 q with at most 32 heads on sm_90, no fused remap, and a
   Triton with Gluon: the Gluon decode ("gluon-small" up to 16 heads, "gluon-ring" 17-32).
3. Otherwise the heads kernel: 16-64 heads per program; at <= 32 heads fp8 rows use the
   scaled-tile variant; 3 pipeline stages for bf16 rows at 64 heads, 2 for fp8.
4. Splits of the top-k until the programs cover the SMs (``split_policy``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..attention_plan import (
    AttentionPlan,
    AttentionPlanError,
    check_kv_format,
    device_spec,
)

HEADS_FAMILIES = ("triton-heads", "triton-heads-scaled")
GLUON_FAMILIES = ("gluon-small", "gluon-ring")
FAMILIES = HEADS_FAMILIES + GLUON_FAMILIES
# families that read fp8 rows as stored (a dequantised buffer cannot feed them)
_FP8_IN_KERNEL_FAMILIES = ("triton-heads-scaled",) + GLUON_FAMILIES

# in-kernel fp8 reads against one dequantising pass break even near 4 references per row
# (bench/kernel_times.py --only reuse; bench/RESULTS.md, "Kernels, third pass")
DEQUANTISE_ONCE_REUSE = 4
GLUON_BLOCK_K = 64  # the M of the Gluon kernels' wgmma products


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def heads_block(num_heads: int, operand_bytes: int = 2, fp8_in_kernel: bool = False) -> int:
    """Heads per program of the heads kernels: next power of two, clamped to [16, 64] (8-32
    heads per rank pay for 16-32 rows of the products, not 64). float32 q over fp8 rows read
    in the kernel: 16, the block that fits beside two stages of fp8 key tiles and their
    dequantised copies (64 fp32 heads asked 337,408 B of shared memory on the H200, whose
    limit is 232,448 B; 32 would ask about 263 KB)."""
    cap = 16 if operand_bytes >= 4 and fp8_in_kernel else 64
    return max(16, min(cap, _next_pow2(num_heads)))


def heads_launch(fp8_in_kernel: bool, num_heads: int, operand_bytes: int) -> tuple[str, int, int, int]:
    """(family, block_k, num_warps, num_stages) of the heads kernels (bench/kernel_times.py --only sweep).

    float32 q over unquantised rows (exact "ieee" products, the oracle replays) halves the key
    block and drops pipelining: 64 fp32 rows of 576 in two stages need 258 KB of shared memory,
    above the H200's 227 KB. Keys-major layouts, register prefetch, bf16 dequantisation,
    evict-first loads and warp specialisation never won (bench/RESULTS.md; bench/variants)."""
    block_h = heads_block(num_heads, operand_bytes, fp8_in_kernel)
    if operand_bytes >= 4 and not fp8_in_kernel:
        return "triton-heads", 32, 4 if block_h <= 32 else 8, 1
    if block_h <= 32:
        return ("triton-heads-scaled" if fp8_in_kernel else "triton-heads"), 64, 4, 2
    # bf16 rows: 3 stages beat 2 at T 4096, H 128 (bench/kernel_times.py --only sweep)
    return "triton-heads", 64, 8, 2 if fp8_in_kernel else 3


def split_policy(programs: int, topk: int, block_k: int, sm_count: int, min_blocks_per_split: int) -> int:
    """Top-k splits: double while ``programs * splits`` leaves SMs idle and every split keeps at
    least ``min_blocks_per_split`` key blocks (more splits than SMs cost more than they gain)."""
    splits = 1
    while programs * splits < sm_count and 2 * splits * block_k * min_blocks_per_split <= topk:
        splits *= 2
    return splits


# One query token of 64+ heads (bf16 q): 16 heads per program, 4 warps, 2 stages, 32 splits of
# one 64-key block, faster than 64 heads per program for fp8 and bf16 rows; two tokens keep 64
# heads per program (bench/kernel_times.py --only plans; bench/RESULTS.md, "Single-token decode
# plans").
SINGLE_TOKEN_BLOCK_H = 16


def heads_splits(num_tokens: int, num_heads: int, topk: int, block_k: int, spec,
                 block_h: int | None = None) -> int:
    """Splits of the heads kernels. One query token (T = 1) may go down to one key block per
    split (programs = head blocks only: with two blocks per split a 128-head decode filled 32 of
    132 SMs); other T keep two. CPU (the interpreter): 1, or 2 at T 1."""
    if spec.kind != "cuda":
        return 1 if num_tokens > 1 else max(1, min(2, _cdiv(topk, block_k)))
    programs = num_tokens * _cdiv(num_heads, block_h or heads_block(num_heads))
    return split_policy(programs, topk, block_k, spec.sm_count, 1 if num_tokens == 1 else 2)


def gluon_heads(num_heads: int) -> int:
    """The Gluon kernels' padded head count HP (the N of their products)."""
    return max(16, _next_pow2(num_heads))


def gluon_launch(num_heads: int) -> tuple[str, int, int]:
    """(family, num_warps, num_stages) of the Gluon decode (timed at B 256 H 16 / B 64 H 32:
    bench/RESULTS.md, "Kernels, third pass"): "small" at up to 16 heads, in 4 warps (two small
    CTAs fit a SM at 4 warps only); "ring" above, in 8 (the two warpgroups split the heads).
    Ring depth: 3 blocks of 41 KB at 16 heads (213 KB), 2 at 32 (3 would take 233 KB of the
    227)."""
    hp = gluon_heads(num_heads)
    return ("gluon-small" if hp <= 16 else "gluon-ring"), (4 if hp <= 16 else 8), (3 if hp <= 16 else 2)


def gluon_splits(num_tokens: int, topk: int, family: str, spec) -> int:
    """No more programs than run at once (one "ring" or two "small" CTAs per SM): more splits
    were slower at B 64 H 32 and B 256 H 16 (bench/RESULTS.md, "Kernels, third pass")."""
    per_sm = 2 if family == "gluon-small" else 1
    return max(1, min(per_sm * spec.sm_count // max(num_tokens, 1), _cdiv(topk, 2 * GLUON_BLOCK_K)))


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton has the Gluon API the decode kernels use (tested: 3.6)."""
    try:
        from ..gluon import decode  # noqa: F401
    except ImportError:
        return False
    return True


def gluon_supported(spec, kv_format: str, q_dtype, num_heads: int, fused_remap: bool) -> bool:
    return (spec.kind == "cuda" and spec.capability[0] == 9 and kv_format == "fp8_ds_mla"
            and q_dtype == torch.bfloat16 and num_heads <= 32 and not fused_remap and gluon_available())


def keys_per_split(topk: int, num_splits: int, block_k: int) -> int:
    """Top-k slots per split: whole key blocks, so only the last split can be short."""
    return max(1, _cdiv(_cdiv(topk, max(1, num_splits)), block_k)) * block_k


def plan_attention(*, num_tokens: int, num_heads: int, topk: int, kv_format: str, num_kv_rows: int,
                   q_dtype, device, fused_remap: bool = False, family: str | None = None,
                   fp8_rows: str | None = None, num_splits: int | None = None) -> AttentionPlan:
    """The Triton plan for ``num_tokens`` query tokens of ``num_heads`` heads, each reading
    ``topk`` slots of a buffer of ``num_kv_rows`` rows (0 = unknown: no dequantise-once) in
    ``kv_format``, with q in ``q_dtype`` (bf16 on the GPU; fp16 / fp32 in the interpreter) on
    ``device`` (or a ``DeviceSpec``); ``fused_remap``: indices are remapped in the kernel.

    Forced choices for benchmarks and tests (None: chosen as the module docstring says):
    ``family`` (one of ``FAMILIES``; launch numbers follow it), ``fp8_rows``, ``num_splits``.
    Raw launch numbers are changed with ``dataclasses.replace`` on the result. A forced choice
    that cannot run here raises ``AttentionPlanError``.
    """
    check_kv_format(kv_format)
    if family is not None and family not in FAMILIES:
        raise AttentionPlanError(f"family {family!r}, expected one of {FAMILIES}")
    spec = device_spec(device)
    fp8 = kv_format == "fp8_ds_mla"
    rows_mode = _fp8_rows(fp8, family, fp8_rows, num_tokens * topk, num_kv_rows)
    gluon_ok = rows_mode == "in_kernel" and gluon_supported(spec, kv_format, q_dtype, num_heads, fused_remap)
    if family is None and gluon_ok:
        family = gluon_launch(num_heads)[0]  # few-head fp8 decode: 1.5-1.9x the Triton kernels
    if family in GLUON_FAMILIES:
        if not gluon_ok:
            raise AttentionPlanError(
                f"family {family!r}: needs CUDA sm_90, fp8_ds_mla rows read in the kernel, bf16 q, "
                "<= 32 heads, no fused remap and a Triton with Gluon (tested: 3.6)")
        _, warps, stages = gluon_launch(num_heads)
        plan = AttentionPlan(backend="triton", family=family, fp8_rows=rows_mode,
                             block_h=gluon_heads(num_heads), block_k=GLUON_BLOCK_K, num_warps=warps,
                             num_stages=stages, num_splits=gluon_splits(num_tokens, topk, family, spec))
    else:
        fp8_in_kernel = rows_mode == "in_kernel"
        auto_family, block_k, warps, stages = heads_launch(fp8_in_kernel, num_heads, q_dtype.itemsize)
        if family == "triton-heads-scaled" and not fp8_in_kernel:
            raise AttentionPlanError("family 'triton-heads-scaled': needs fp8_ds_mla rows read in the "
                                     f"kernel, got kv_format {kv_format!r} with fp8_rows {rows_mode!r}")
        block_h = heads_block(num_heads, q_dtype.itemsize, fp8_in_kernel)
        if (family is None and spec.kind == "cuda" and num_tokens == 1 and block_h > SINGLE_TOKEN_BLOCK_H
                and q_dtype.itemsize == 2):
            block_h, warps, stages = SINGLE_TOKEN_BLOCK_H, 4, 2  # one token: heads over programs
        plan = AttentionPlan(backend="triton", family=family or auto_family, fp8_rows=rows_mode,
                             block_h=block_h, block_k=block_k, num_warps=warps, num_stages=stages,
                             num_splits=heads_splits(num_tokens, num_heads, topk, block_k, spec,
                                                     block_h))
    splits = plan.num_splits if num_splits is None else num_splits
    if not (isinstance(splits, int) and splits >= 1):
        raise AttentionPlanError(f"num_splits {splits!r}, expected an int >= 1")
    # whole key blocks per split: the count the kernels will actually launch
    return dataclasses.replace(plan, num_splits=max(1, _cdiv(topk, keys_per_split(topk, splits, plan.block_k))))


def _fp8_rows(fp8: bool, family: str | None, forced: str | None, references: int, num_kv_rows: int) -> str:
    if not fp8:
        if forced not in (None, "none"):
            raise AttentionPlanError(f"fp8_rows {forced!r} for kv_format 'bf16': expected 'none'")
        return "none"
    if forced is None:
        if family in _FP8_IN_KERNEL_FAMILIES:
            return "in_kernel"
        reuse = num_kv_rows and references >= DEQUANTISE_ONCE_REUSE * num_kv_rows
        return "dequantise_once" if reuse else "in_kernel"
    if forced not in ("in_kernel", "dequantise_once"):
        raise AttentionPlanError(f"fp8_rows {forced!r} for kv_format 'fp8_ds_mla': expected "
                                 "'in_kernel' or 'dequantise_once'")
    if forced == "dequantise_once" and family in _FP8_IN_KERNEL_FAMILIES:
        raise AttentionPlanError(f"family {family!r} reads fp8 rows in the kernel: fp8_rows "
                                 "'dequantise_once' cannot feed it")
    return forced
