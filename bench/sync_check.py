"""Does an attention call synchronise the host with the GPU? (CUDA; prints one line per case.)

    python bench/sync_check.py

Runs FlashMLA's adapter and cpplan's Triton attention once each (warm-up), then again under
``torch.cuda.set_sync_debug_mode("error")``, for a prefill over bf16 rows and an fp8_ds_mla decode
over a paged cache: a call that synchronises raises there. A sync inside a step's call makes
the host wait for all queued GPU work, so a launch-bound decode step pays host and device time
back to back, and the call cannot be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from cpplan.runtime.kernels import get_kernels
from cpplan.runtime.kernels import reference as ref


def cases():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(64, 128, 576, device="cuda", generator=g).to(torch.bfloat16)
    rows = torch.randn(1 << 16, 576, device="cuda", generator=g)
    idx = torch.randint(0, 1 << 16, (64, 2048), device="cuda", generator=g)
    yield "prefill bf16 rows T64 H128", q, rows.to(torch.bfloat16), idx, "bf16"
    yield "decode fp8 B64 H128", q, ref.quantize_fp8_ds_mla(rows), idx, "fp8_ds_mla"


def main() -> int:
    for backend in ("flashmla", "triton"):
        try:
            ks = get_kernels("cuda", backend)
        except Exception as exc:  # noqa: BLE001 - a bench: report and go on
            print(f"{backend}: unavailable ({exc})")
            continue
        for name, q, kv, idx, fmt in cases():
            plan = ks.plan_attention(num_tokens=q.shape[0], num_heads=q.shape[1],
                                     topk=idx.shape[1], kv_format=fmt, num_kv_rows=kv.shape[0],
                                     q_dtype=q.dtype, device=q.device)
            ks.sparse_mla_attention(q, kv, idx, 576**-0.5, fmt, plan=plan)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                ks.sparse_mla_attention(q, kv, idx, 576**-0.5, fmt, plan=plan)
                verdict = "no sync"
            except RuntimeError as exc:
                verdict = f"SYNCS: {str(exc).splitlines()[0][:120]}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            print(f"{backend:9s} {name:28s} {plan.describe():60s} {verdict}")
    return 0


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/sync_check.py: needs a CUDA GPU")
    raise SystemExit(main())
