"""The attention phase of one step against its attention kernels timed alone (issue 12).

    python bench/attention_alone.py [--prompt 32768] [--decodes 64] [--kernels flashmla]

Runs the step of ``bench/step_gpu.py`` (same work, same flags) once with a kernel set that
records every ``sparse_mla_attention`` call of layer 0 (operands and plan), then times with
``triton.testing.do_bench`` (medians) for each call: the op as the executor calls it (adapter
or Triton launcher included) and, for a FlashMLA plan, FlashMLA's own kernel on inputs converted
beforehand (padded heads, int32 indices, bf16 rows: what the adapter feeds it). The phase time
per layer comes from ``bench/step_gpu.py``'s instrumented run in the same process; the ratio
phase / kernels-alone is what issue 12 asks to keep within 1.10.
"""

from __future__ import annotations

import dataclasses
import sys

import step_gpu as sg  # bench/step_gpu.py, beside this file
import torch
from triton.testing import do_bench

from cpplan.runtime.kernels.flashmla import attention as fa


def record_calls(r) -> list[tuple]:
    """(args, kwargs) of every attention call of one plain step, in order."""
    calls, inner = [], r.ex.kernels

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return inner.sparse_mla_attention(*args, **kwargs)

    r.ex.kernels = dataclasses.replace(inner, sparse_mla_attention=recording)
    try:
        sg.run_step(r, sg._NoLog())
    finally:
        r.ex.kernels = inner
    return calls[: len(calls) // r.config.num_layers]


def raw_flashmla(args, kwargs):
    """A zero-argument call of FlashMLA's kernel alone on pre-converted inputs (None if the
    plan is not FlashMLA's)."""
    q, kv, idx, sm_scale = args[:4]
    fmt = args[4] if len(args) > 4 else kwargs.get("kv_format", "bf16")
    plan = kwargs["plan"]
    if plan.backend != "flashmla":
        return None
    fm = fa._require()
    qp, ip = fa.pad_heads(q, fa.padded_heads(q.shape[1])), fa.flashmla_indices(idx)
    if plan.family == "flashmla-decode":
        meta = fa.decode_schedule(q.shape[0], qp.shape[1], ip.shape[-1], q.device)
        pages = kv.reshape(-1, fa.PAGE, 1, kv.shape[-1])
        return lambda: fm.flash_mla_with_kvcache(
            qp.unsqueeze(1), pages, None, None, 512, meta, softmax_scale=sm_scale,
            is_fp8_kvcache=True, indices=ip, use_legacy=True, kv_format="V32")
    rows = (fa._dequantise(kv) if fmt == "fp8_ds_mla" else kv).unsqueeze(1)
    return lambda: fm.flash_mla_sparse_fwd(qp, rows, ip, sm_scale, d_v=512, use_legacy=True)


def main(argv=None) -> int:
    args, dims = sg.parse_args(argv)
    groups, _ = sg.make_groups(args, dims)
    r = sg.setup_rank(args, dims, groups)
    res = sg.measure(r, args.repeat)
    phase = float(res["per_layer_ms"][:, sg.PHASES.index("attention")].mean())
    print(f"attention phase (instrumented step, mean per layer): {phase:.3f} ms")
    print("| call | plan | op ms | kernel alone ms |\n|---|---|---:|---:|")
    op_total = raw_total = 0.0
    for k, (a, kw) in enumerate(record_calls(r)):
        op = do_bench(lambda: r.ex.kernels.sparse_mla_attention(*a, **kw))
        raw_fn = raw_flashmla(a, kw)
        raw = do_bench(raw_fn) if raw_fn is not None else float("nan")
        op_total += op
        raw_total += raw if raw_fn is not None else op
        print(f"| {k} T{a[0].shape[0]} H{a[0].shape[1]} | {kw['plan'].describe()} | {op:.3f} | "
              f"{raw:.3f} |")
    print(f"sum of ops {op_total:.3f} ms; kernels alone {raw_total:.3f} ms; phase / kernels "
          f"alone {phase / raw_total:.3f}")
    return 0


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    sys.exit(main())
