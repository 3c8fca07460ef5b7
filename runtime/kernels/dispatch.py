"""One dispatch table for the kernel backends (no ``if backend == ...`` in step code).

``get_kernels(device, backend)`` returns a frozen ``KernelSet``: one callable per op that step
code calls (the executor, the layer passes, the selection; docs/design.md §5.4), each with the
signature and semantics of the same-named function of the reference backend (``reference/``;
read its docstrings for every array's shape and dtype). Ops only tests and the single-device
oracle call (dequantisation, ``lse_merge``, ``indexer_scores`` / ``indexer_topk`` over explicit
key rows, ``topk_reference_order``, ``deinterleave_index_select``) are the reference's
functions, imported from ``reference`` (a backend's own versions from its modules). Attention is a plan / run pair:
``plan_attention(...)`` -> ``AttentionPlan`` once per bound step, then
``sparse_mla_attention(..., plan=plan)`` per layer (``attention_plan.py``).

Backends: ``"reference"`` (plain torch, CPU and CUDA; the CPU default), ``"triton"`` (Triton
kernels, a Gluon decode on Hopper; ops without a Triton kernel fall back to the reference, listed
in ``KernelSet.backend_of``), ``"flashmla"`` (the CUDA default where ``flash_mla`` imports on an
sm_90 device: FlashMLA's attention for the shapes where it wins, Triton for the rest; asking for
it where it cannot run raises ``KernelBackendError`` with the reason). Without FlashMLA, CUDA
defaults to "triton". A backend package imports this
module for ``KernelSet``; this module loads a backend package by name only when asked for it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from cpplan.schemas.errors import CpplanError

from . import reference as ref

BACKENDS = ("reference", "triton", "flashmla")


class KernelBackendError(CpplanError, ValueError):
    """A kernel backend that is unknown or unavailable on this device."""


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """Callables for every op step code calls; see ``reference/`` for each contract."""

    name: str
    quantize_fp8_ds_mla: Callable
    quantize_indexer_k: Callable
    pack_fp8_ds_mla_into: Callable
    pack_indexer_k_into: Callable
    plan_attention: Callable
    sparse_mla_attention: Callable
    sparse_mla_overflow: Callable
    lse_scale: Callable
    remap_to_gathered: Callable
    filter_local_slots: Callable
    merge_topk_candidates: Callable
    merge_local_slots: Callable
    indexer_topk_prefill: Callable
    indexer_topk_decode: Callable
    # op name -> backend that implements it (ops not named here are the set's own backend)
    backend_of: tuple[tuple[str, str], ...] = ()


OP_NAMES = tuple(f.name for f in dataclasses.fields(KernelSet) if f.name not in ("name", "backend_of"))

REFERENCE = KernelSet(name="reference", **{op: getattr(ref, op) for op in OP_NAMES})


def get_kernels(device: str, backend: str | None = None) -> KernelSet:
    """The kernel set for ``device`` ("cpu", "cuda", "cuda:1", ...).

    backend None picks "reference" on CPU and "triton" on CUDA (falling back to "reference" if
    Triton does not import). An explicit backend that cannot run on the device raises
    ``KernelBackendError`` with what was asked and what is available.
    """
    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise KernelBackendError(f"device {device!r}: expected 'cpu' or 'cuda[:n]'")
    if backend is None:
        backend = "reference" if kind == "cpu" else _cuda_default(device)
    if backend == "reference":
        return REFERENCE
    if backend in ("triton", "flashmla"):
        if kind != "cuda":
            raise KernelBackendError(f"backend {backend!r} on device {device!r}: expected a cuda "
                                     "device (the CPU runs the reference; tests use "
                                     "TRITON_INTERPRET=1)")
        if not _triton_available():
            raise KernelBackendError(f"backend {backend!r}: triton does not import here")
        if backend == "triton":
            return importlib.import_module(f"{__package__}.triton").TRITON
        flashmla = importlib.import_module(f"{__package__}.flashmla")
        why = flashmla.attention.unavailable_reason(device)
        if why:
            raise KernelBackendError(f"backend 'flashmla': {why}; use 'triton' or 'reference'")
        return flashmla.FLASHMLA
    raise KernelBackendError(f"backend {backend!r}: expected one of {BACKENDS}")


def _cuda_default(device) -> str:
    """"flashmla" where FlashMLA runs on ``device``, else "triton" (else "reference")."""
    if not _triton_available():
        return "reference"
    flashmla = importlib.import_module(f"{__package__}.flashmla")
    return "flashmla" if flashmla.attention.available(device) else "triton"


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
