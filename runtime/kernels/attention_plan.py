"""The attention plan: which kernel runs a sparse-MLA attention call, chosen once per bound step.

Like FlashInfer's ``plan()`` / ``run()``: ``KernelSet.plan_attention(...)`` looks at the shape of
the work (tokens, heads, top-k, KV format, rows, q dtype) and the device, and returns a frozen
``AttentionPlan``; ``KernelSet.sparse_mla_attention(..., plan=plan)`` then runs it without
deciding anything again. The plan is pure host data (no tensors), so a step planned at bind runs
every layer with the same plan. ``plan.backend`` names the ``KernelSet`` that runs it: a backend
that overlays another (FlashMLA over Triton) hands plans that are not its own to the one named.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from cpplan.schemas.errors import CpplanError

KV_FORMATS = ("bf16", "fp8_ds_mla")
# How fp8_ds_mla rows reach the products: "in_kernel" (dequantised, or scaled, by the attention
# kernel at every reference), "dequantise_once" (the whole buffer to the q dtype in one pass
# first, then the kernel for unquantised rows); "none" for bf16 rows.
FP8_ROWS = ("in_kernel", "dequantise_once", "none")


class AttentionPlanError(CpplanError, ValueError):
    """An attention plan (or a forced choice in one) that cannot run on these operands here."""


def check_kv_format(kv_format: str) -> None:
    if kv_format not in KV_FORMATS:
        raise AttentionPlanError(f"kv_format {kv_format!r}, expected 'bf16' or 'fp8_ds_mla'")


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """How one backend runs ``sparse_mla_attention`` for a shape of work.

    backend: the ``KernelSet`` name that runs it ("reference", "triton", "flashmla").
    family: the kernel within it: "reference"; Triton: "triton-heads" (heads on the rows of the
    products, fp8 rows dequantised in registers), "triton-heads-scaled" (fp8 rows, group scales
    applied to the score / probability tiles), "gluon-small" / "gluon-ring" (the Gluon few-head
    fp8 decode on sm_90); other backends name their own.
    num_splits: top-k splits (programs per query token and head block); > 1 writes float32
    partials that an LSE merge combines. fp8_rows: one of ``FP8_ROWS``.
    block_h: heads per program (Gluon: the padded head count); block_k: keys per step;
    num_warps, num_stages: launch numbers (Gluon ring: blocks in flight). 0 = not used.
    """

    backend: str
    family: str
    num_splits: int = 1
    fp8_rows: str = "none"
    block_h: int = 0
    block_k: int = 0
    num_warps: int = 0
    num_stages: int = 0

    def __post_init__(self):
        if self.fp8_rows not in FP8_ROWS:
            raise AttentionPlanError(f"fp8_rows {self.fp8_rows!r}, expected one of {FP8_ROWS}")
        if not (isinstance(self.num_splits, int) and self.num_splits >= 1):
            raise AttentionPlanError(f"num_splits {self.num_splits!r}, expected an int >= 1")

    def describe(self) -> str:
        """One line for logs and bench tables, e.g.
        ``triton/triton-heads splits=1 fp8_rows=none h64 k64 w8 s3``."""
        s = f"{self.backend}/{self.family} splits={self.num_splits} fp8_rows={self.fp8_rows}"
        if self.block_k:
            s += f" h{self.block_h} k{self.block_k} w{self.num_warps} s{self.num_stages}"
        return s


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """What a plan needs to know of the device: kind ("cpu" / "cuda"), SM count, compute
    capability. Tests pass one directly in place of a device (a fake H200: 132 SMs, (9, 0))."""

    kind: str
    sm_count: int = 0
    capability: tuple[int, int] = (0, 0)


def device_spec(device) -> DeviceSpec:
    """``device`` (a ``DeviceSpec``, ``torch.device`` or string) as a ``DeviceSpec``; a CUDA
    device's properties are read once per device index and cached (no sync)."""
    if isinstance(device, DeviceSpec):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        return DeviceSpec(kind=dev.type)
    return _cuda_spec(torch.cuda.current_device() if dev.index is None else dev.index)


@functools.cache
def _cuda_spec(index: int) -> DeviceSpec:
    props = torch.cuda.get_device_properties(index)
    return DeviceSpec(kind="cuda", sm_count=props.multi_processor_count,
                      capability=(props.major, props.minor))
