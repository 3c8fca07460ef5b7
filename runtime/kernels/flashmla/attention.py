"""FlashMLA (``sgl-flash-mla``, Hopper) behind cpplan's ``sparse_mla_attention`` contract.

Contract: ``reference.sparse_mla_attention`` (out ``[T, H, 512]`` q.dtype, lse ``[T, H]`` float32
natural log, ``-inf`` and out 0 for a row with no key). Three paths, all ``use_legacy=True`` (the
SM90 kernels live in the wheel's legacy extension):

- bf16 rows ``[N, 576]`` -> ``flash_mla_sparse_fwd`` (any N; an index < 0 or >= N is no key).
- fp8_ds_mla rows read by few tokens (``fp8_kernel``: "decode") -> ``flash_mla_with_kvcache``
  with ``kv_format="V32"``: cpplan's 656-byte rows (512 fp8 | 4 fp32 scales | 64 bf16 RoPE) are
  V3.2's layout, so the flat ``[N, 656]`` buffer is viewed as pages ``[N/64, 64, 1, 656]`` (N must
  be a multiple of 64: FlashMLA takes only 64-slot pages) and the indices are its slots.
- fp8_ds_mla rows read many times ("prefill": a gathered chunk) -> dequantised once to bf16 by
  the Triton dequantiser, then ``flash_mla_sparse_fwd``.

What the adapter converts (FlashMLA's conventions, from its interface and its reference tests):
heads: FlashMLA takes 64 or 128 query heads; fewer are padded with zero q rows up to 64 (or 128)
and sliced off, so H 16 costs what H 64 costs (the zero rows still run every product).
Indices: int32 ``[T, 1, topk]``; the decode kernel treats only exactly -1 as no key and does no
bounds check, so every negative becomes -1; topk is padded with -1 to a multiple of 64 (the
kernels' key block, ``topk mod B_TOPK must be 0``). LSE: FlashMLA's is natural log (prefill
with ``return_log2_lse`` left None; decode always) but +inf for a row with no key, and decode's
is laid out ``[B, H, s_q]``: converted to ``[T, H]`` with -inf there, and out is zeroed on those
rows (enforced rather than trusted: for decode by a masked store of those rows only,
``finish_decode``; for prefill the kernel's own zeroes, tested). Decode scheduling metadata: the
``FlashMLASchedMeta`` from ``get_mla_metadata`` is filled by its first decode call and may be
reused only while every shape (batch, s_q, heads, page size, topk) stays the same and
``topk_length`` is unchanged (not used here); ``decode_schedule`` keeps one per shape. The first
call with a new shape computes it (allocates): warm every shape before CUDA-graph capture.

Which backend runs (``choose``; the H200 measurements behind each row, same inputs both
sides: bench/RESULTS.md, "Attention: FlashMLA against cpplan's Triton/Gluon", and
``bench/attention.py``, which has a case for each row, the derived ones included):

=============================  ==========================================  ========
case                           why                                         choice
=============================  ==========================================  ========
prefill bf16, H 64 / 128       about 2x faster than Triton                 flashmla
prefill bf16, H < 64           padding to 64 heads eats the gain           triton
prefill, T x H/64 < 128        its grid does not split the top-k: < 1 wave triton
decode fp8, H 64 / 128         about 2x faster than Triton                 flashmla
decode fp8, H < 64             Triton's Gluon few-head decode wins         triton
decode fp8, one token          the adapter's launches outweigh the kernel  triton
fp8, T*topk < 4N, pages        the decode kernel: decode rows              per H
fp8, otherwise                 dequantise once + prefill rows              per H, T
fp8, that and T*topk < N       dequantising dominates                      triton
=============================  ==========================================  ========

fp8 rows: the decode kernel against dequantise-once plus the bf16 kernel breaks even near 4
references per row, the same threshold as Triton's ``DEQUANTISE_ONCE_REUSE``. Shapes between
measured ones follow their neighbours (decode at any batch with H >= 64, prefill at H 65..127
padded to 128). fp16/fp32 q and H > 128 always run Triton.
Each decode token is its own FlashMLA batch entry (B = T, s_q = 1), so the metadata is per
number of decode tokens: an attention plan made once per step should call ``decode_schedule``.
"""

from __future__ import annotations

import collections
import functools

import torch

from ..dispatch import KernelBackendError
from ..reference.formats import D_QK, D_V, FP8_DS_MLA_BYTES, NO_KEY

PAGE = 64  # FlashMLA's only page size ("page_block_size must be 64")
TOPK_GRANULE = 64  # the kernels' key block: topk must be a multiple of it
HEAD_SIZES = (64, 128)  # "h_q == 64 || h_q == 128"
# the thresholds of the table above (bench/attention.py; figures: bench/RESULTS.md)
MIN_HEADS_DECODE = 64  # fewer heads: Triton's Gluon few-head decode, padding would cost more
MIN_DECODE_TOKENS = 2  # one decode token: the adapter's launches outweigh the kernel's gain
MIN_HEADS_PREFILL = 64  # fewer heads: padding to 64 eats the gain
MIN_PREFILL_PROGRAMS = 128  # the prefill grid is T x H/64, no split over the top-k
DECODE_KERNEL_MAX_REUSE = 4  # fp8 rows referenced < 4x each on average: the fp8 decode kernel
FP8_PREFILL_MIN_REUSE = 1  # fp8 prefill via dequantise-once only when every row is read >= 1x
_SCHEDULES = 64  # decode metadata entries kept (one per decode shape)


# --------------------------------------------------------------------------------------------
# availability and the pure decision
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _import() -> tuple[object | None, str]:
    """(flash_mla module or None, why not). Its import dlopens CUDA extensions: a CPU torch or a
    torch ABI other than the wheel's fails with OSError, not ImportError."""
    try:
        import flash_mla
    except (ImportError, OSError, RuntimeError) as e:
        return None, f"flash_mla does not import: {type(e).__name__}: {e}"
    if not flash_mla.has_legacy():
        return None, "flash_mla has no legacy (SM90) extension in this build"
    return flash_mla, ""


@functools.lru_cache(maxsize=16)
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def unavailable_reason(device: torch.device | str | None = None) -> str:
    """Why FlashMLA cannot run on ``device`` (default: the current CUDA device); "" if it can."""
    mod, why = _import()
    if mod is None:
        return why
    if not torch.cuda.is_available():
        return "no CUDA device"
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        return f"device {dev}: FlashMLA runs on CUDA only"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if not _device_ok(index):
        return f"device {dev} is sm_{''.join(map(str, torch.cuda.get_device_capability(index)))}, expected sm_90"
    return ""


def available(device: torch.device | str | None = None) -> bool:
    """flash_mla imports (with its SM90 kernels) and ``device`` is an sm_90 GPU."""
    return unavailable_reason(device) == ""


def padded_heads(num_heads: int) -> int | None:
    """The head count FlashMLA runs for ``num_heads`` query heads (64 or 128), None if > 128."""
    return next((h for h in HEAD_SIZES if 1 <= num_heads <= h), None)


def fp8_kernel(num_tokens: int, topk: int, num_kv_rows: int) -> str:
    """Which FlashMLA kernel reads fp8_ds_mla rows: "decode" (reads fp8 rows in the kernel; needs
    whole 64-row pages) while rows are referenced fewer than ``DECODE_KERNEL_MAX_REUSE`` times on
    average, else "prefill" (dequantise the buffer once, then the bf16 kernel)."""
    low_reuse = num_tokens * topk < DECODE_KERNEL_MAX_REUSE * num_kv_rows
    return "decode" if low_reuse and num_kv_rows % PAGE == 0 else "prefill"


def supported(num_heads: int, kv_format: str, q_dtype, num_kv_rows: int, decode: bool) -> bool:
    """Whether FlashMLA can run the call at all: bf16 q, 1..128 heads (padded to 64 / 128);
    ``decode`` (the fp8 kernel) needs fp8_ds_mla rows in whole 64-slot pages, the prefill
    kernel takes bf16 rows or fp8_ds_mla rows (dequantised first)."""
    if q_dtype != torch.bfloat16 or padded_heads(num_heads) is None or num_kv_rows < 1:
        return False
    if decode:
        return kv_format == "fp8_ds_mla" and num_kv_rows % PAGE == 0
    return kv_format in ("bf16", "fp8_ds_mla")


def choose(num_tokens: int, num_heads: int, topk: int, kv_format: str, num_kv_rows: int,
           q_dtype) -> str:
    """The backend ("flashmla" or "triton") for one attention call, from the table in the module docstring.
    Pure: shapes and dtypes only, no device query."""
    if num_tokens < 1 or topk < 1:
        return "triton"
    if kv_format == "fp8_ds_mla" and fp8_kernel(num_tokens, topk, num_kv_rows) == "decode":
        ok = (supported(num_heads, kv_format, q_dtype, num_kv_rows, True)
              and num_heads >= MIN_HEADS_DECODE and num_tokens >= MIN_DECODE_TOKENS)
        return "flashmla" if ok else "triton"
    if not supported(num_heads, kv_format, q_dtype, num_kv_rows, False) or num_heads < MIN_HEADS_PREFILL:
        return "triton"
    fills = num_tokens * (padded_heads(num_heads) // 64) >= MIN_PREFILL_PROGRAMS
    reused = kv_format == "bf16" or num_tokens * topk >= FP8_PREFILL_MIN_REUSE * num_kv_rows
    return "flashmla" if fills and reused else "triton"


# --------------------------------------------------------------------------------------------
# conversions (pure torch, any device)
# --------------------------------------------------------------------------------------------
def pad_heads(q: torch.Tensor, heads: int) -> torch.Tensor:
    """``q [T, H, 576]`` -> contiguous ``[T, heads, 576]``, rows H.. zero (their outputs are
    sliced off). A copy of q whenever H < heads; none when q is already contiguous and H == heads."""
    T, H, D = q.shape
    if H == heads:
        return q.contiguous()
    out = q.new_zeros(T, heads, D)
    out[:, :H] = q
    return out


def flashmla_indices(indices: torch.Tensor, granule: int = TOPK_GRANULE) -> torch.Tensor:
    """cpplan ``[T, topk]`` (rows or slots, NO_KEY = -1 = none, the only negative value cpplan's
    index kernels write) -> FlashMLA ``[T, 1, topk']`` int32, topk' = topk padded with -1 to a
    multiple of ``granule``. One conversion pass (a cast) where topk is already a multiple."""
    T, topk = indices.shape
    pad = -topk % granule
    if not pad:
        return indices.to(torch.int32).reshape(T, 1, topk)
    idx = indices.new_full((T, topk + pad), NO_KEY, dtype=torch.int32)
    idx[:, :topk] = indices
    return idx.reshape(T, 1, topk + pad)


def finish(out: torch.Tensor, lse: torch.Tensor, num_heads: int,
           kernel_zeroes_empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's ``out [T, Hp, 512]`` and natural-log ``lse [T, Hp]`` (+inf: no key) -> cpplan's
    ``(out [T, H, 512], lse [T, H] float32)``: padded heads dropped, -inf on rows with no key,
    out 0 there. ``kernel_zeroes_empty``: the kernel already writes 0 on such rows (the sparse
    prefill kernel does: tests/kernels/test_flashmla.py, raw conventions), so out is not passed
    over again (a full read + write of out)."""
    lse = lse[:, :num_heads].float()
    empty = torch.isposinf(lse)
    out = out[:, :num_heads]
    if not kernel_zeroes_empty:
        out = out.masked_fill(empty[..., None], 0)
    return out, lse.masked_fill(empty, float("-inf"))


def finish_decode(out: torch.Tensor, lse: torch.Tensor, num_heads: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``finish`` for the decode kernel's ``out [T, Hp, 512]`` / ``lse [T, Hp]`` float32
    (contiguous): one Triton launch that converts lse and zeroes out only on rows with no key,
    where ``finish`` passes over all of out (a copy kernel a layer, plus three small ones).
    Elsewhere (CPU tensors, other layouts): ``finish``."""
    T, Hp, _ = out.shape
    if not (out.is_cuda and out.is_contiguous() and lse.is_contiguous()
            and lse.dtype == torch.float32 and tuple(lse.shape) == (T, Hp)):
        return finish(out, lse, num_heads)
    return _finish_decode_launch(out, lse, num_heads)


def _finish_decode_launch(out, lse, num_heads):
    """``finish_decode``'s launch (also run by the interpreter tests on CPU tensors)."""
    import triton  # only where this path runs: the module itself needs torch only

    from .finish_jit import finish_decode_kernel

    T, Hp, DV = out.shape
    lse_out = torch.empty(T, num_heads, dtype=torch.float32, device=lse.device)
    rows = T * num_heads
    if rows:
        block = 64
        finish_decode_kernel[(triton.cdiv(rows, block),)](out, lse, lse_out, rows, H=num_heads,
                                                          HP=Hp, DV=DV, BLOCK=block, num_warps=4)
    return out[:, :num_heads], lse_out


# --------------------------------------------------------------------------------------------
# the adapter
# --------------------------------------------------------------------------------------------
_SCHEDULE_CACHE: collections.OrderedDict = collections.OrderedDict()


def decode_schedule(batch: int, heads: int, topk: int, device: torch.device):
    """The ``FlashMLASchedMeta`` for one decode shape (batch, padded heads, padded topk), kept
    and reused: legal because FlashMLA's metadata depends only on the shapes it checks and on
    ``topk_length`` (never passed here). Least recently used beyond ``_SCHEDULES`` shapes go."""
    key = (device.index, batch, heads, topk)
    meta = _SCHEDULE_CACHE.pop(key, None)
    if meta is None:
        meta = _require().get_mla_metadata()[0]
    _SCHEDULE_CACHE[key] = meta
    while len(_SCHEDULE_CACHE) > _SCHEDULES:
        _SCHEDULE_CACHE.popitem(last=False)
    return meta


def _require():
    mod, why = _import()
    if mod is None:
        raise KernelBackendError(f"backend 'flashmla': {why}; install with pip install 'cpplan[flashmla]'")
    return mod


def _dequantise(kv: torch.Tensor) -> torch.Tensor:
    # Triton is imported only when this path runs (the module itself needs torch only).
    from ..triton.pack import dequantize_fp8_ds_mla

    return dequantize_fp8_ds_mla(kv, torch.bfloat16)


def _check(q, kv, indices, kv_format) -> None:
    T, H, D = q.shape
    width, dtype = (FP8_DS_MLA_BYTES, torch.uint8) if kv_format == "fp8_ds_mla" else (D_QK, torch.bfloat16)
    if kv_format not in ("bf16", "fp8_ds_mla"):
        raise KernelBackendError(f"kv_format {kv_format!r}: expected 'bf16' or 'fp8_ds_mla'")
    if D != D_QK or q.dtype != torch.bfloat16 or padded_heads(H) is None or not q.is_cuda:
        raise KernelBackendError(f"FlashMLA q: got {tuple(q.shape)} {q.dtype} on {q.device}, "
                                 f"expected [T, 1..128, {D_QK}] bfloat16 on CUDA")
    if kv.dim() != 2 or kv.shape[1] != width or kv.dtype != dtype or kv.stride(1) != 1:
        raise KernelBackendError(f"FlashMLA {kv_format} kv: got {tuple(kv.shape)} {kv.dtype} strides "
                                 f"{kv.stride()}, expected [N, {width}] {dtype} with unit stride")
    if indices.dim() != 2 or indices.shape[0] != T or indices.shape[1] < 1:
        raise KernelBackendError(f"FlashMLA indices: got {tuple(indices.shape)}, expected [{T}, topk >= 1]")


def sparse_mla_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                         kv_format: str = "bf16", *, fp8_kernel_choice: str = "auto"):
    """FlashMLA ``sparse_mla_attention`` (always FlashMLA; the package's ``plan_attention`` decides when).
    Contract: ``reference.sparse_mla_attention``; kv ``[N, 576]`` bf16 or ``[N, 656]`` uint8
    (a paged ``[blocks, 64, 656]`` cache is flattened). fp8_kernel_choice: "auto"
    (``fp8_kernel``), "decode" or "prefill" (benchmarks and tests)."""
    if kv.dim() == 3:
        kv = kv.reshape(-1, kv.shape[-1])
    _check(q, kv, indices, kv_format)
    fm = _require()
    T, H, _ = q.shape
    if T == 0:
        return q.new_empty(0, H, D_V), torch.empty(0, H, dtype=torch.float32, device=q.device)
    qp = pad_heads(q, padded_heads(H))
    idx = flashmla_indices(indices)
    kernel = "prefill" if kv_format == "bf16" else fp8_kernel_choice
    if kernel == "auto":
        kernel = fp8_kernel(T, indices.shape[1], kv.shape[0])
    if kernel == "decode":
        out, lse = _decode(fm, qp, kv, idx, sm_scale)
        return finish_decode(out, lse, H)
    if kernel != "prefill":
        raise KernelBackendError(f"fp8_kernel_choice {fp8_kernel_choice!r}: expected 'auto', 'decode' or 'prefill'")
    rows = _dequantise(kv) if kv_format == "fp8_ds_mla" else kv.contiguous()
    out, _max_logits, lse = fm.flash_mla_sparse_fwd(qp, rows.unsqueeze(1), idx, sm_scale, d_v=D_V,
                                                    use_legacy=True)
    return finish(out, lse, H, kernel_zeroes_empty=True)


def _decode(fm, qp, kv, idx, sm_scale):
    """The fp8 decode kernel over kv viewed as 64-slot pages; every token its own batch entry."""
    if kv.shape[0] % PAGE or not kv.is_contiguous():
        raise KernelBackendError(f"FlashMLA decode kv: got {tuple(kv.shape)} strides {kv.stride()}, "
                                 f"expected contiguous rows, a multiple of {PAGE}")
    T, Hp, _ = qp.shape
    meta = decode_schedule(T, Hp, idx.shape[-1], qp.device)
    out, lse = fm.flash_mla_with_kvcache(
        qp.unsqueeze(1), kv.view(-1, PAGE, 1, FP8_DS_MLA_BYTES), None, None, D_V, meta,
        softmax_scale=sm_scale, is_fp8_kvcache=True, indices=idx, use_legacy=True, kv_format="V32")
    # out [B, 1, Hp, 512] and lse [B, Hp, 1]: with s_q 1 both reshape to tokens x heads
    return out.reshape(T, Hp, D_V), lse.reshape(T, Hp)


def route(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, kv_format: str) -> str:
    """``choose`` on a call's tensors, plus what only the tensors tell: the device, kv's dtype and
    layout. Host-side metadata only, no sync."""
    rows = kv.reshape(-1, kv.shape[-1]) if kv.dim() == 3 else kv
    fmt_ok = ((kv_format == "bf16" and rows.dtype == torch.bfloat16)
              or (kv_format == "fp8_ds_mla" and rows.dtype == torch.uint8))
    if (not fmt_ok or q.dim() != 3 or q.shape[-1] != D_QK or indices.dim() != 2 or not q.is_cuda
            or rows.dim() != 2 or rows.stride(-1) != 1):
        return "triton"
    if kv_format == "fp8_ds_mla" and not rows.is_contiguous():
        return "triton"
    pick = choose(q.shape[0], q.shape[1], indices.shape[1], kv_format, rows.shape[0], q.dtype)
    return pick if pick == "triton" or available(q.device) else "triton"
