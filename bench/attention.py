"""FlashMLA against cpplan's Triton/Gluon ``sparse_mla_attention`` on one GPU, same inputs.

    python bench/attention.py [--json out.json] [--only decode,H16,...] [--quick] [--graph]

Cases: the measurements behind ``choose`` (the table in runtime/kernels/flashmla.py), then the
ones marked "to settle" for its derived rules (prefill at H 32/16, fp8 prefill dequantised once,
bf16-cache decode, the fp8 decode kernel against dequantise-once at 4 references per row).
Columns: FlashMLA through the adapter (head padding, index conversion, LSE conversion, zeroed
empty rows included) and the raw kernel call on pre-converted inputs, Triton (``get_kernels(
"cuda", "triton")``: Gluon where it applies), Triton / FlashMLA, TFLOP/s of the adapter
(2 * T * H * topk * (576 + 512), unpadded H), ``choose()``, and the largest differences of out
and of finite lse between the two. Medians of ``triton.testing.do_bench``.
Inputs as bench/kernel_times.py: prefill tokens share 64 random index rows (neighbours share keys),
decode queries each read their own rows. ``--graph`` adds, for T <= 256, both
backends timed by ``triton.testing.do_bench_cudagraph`` (the call captured in a CUDA graph and
replayed: launch overheads gone, as in a graph-replayed decode step). flash_mla must import (``pip install --no-deps
sgl-flash-mla`` or the unpacked wheel on PYTHONPATH); if it does not, FlashMLA columns are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

SM = 576**-0.5
K = 2048
# name, T, H, topk, N, kv_format, distinct rows per query, fp8 kernel, (FlashMLA us, Triton us)
# measured on the H200 (issue 12; None: not measured yet, "to settle")
CASES = [
    ("prefill bf16 T4096 H128", 4096, 128, K, 65536, "bf16", False, "auto", (4410, 9470)),
    ("prefill bf16 T4096 H64", 4096, 64, K, 65536, "bf16", False, "auto", (2310, 4850)),
    ("decode fp8 B128 H128", 128, 128, K, 1 << 18, "fp8_ds_mla", True, "auto", (180, 393)),
    ("decode fp8 B256 H64", 256, 64, K, 1 << 18, "fp8_ds_mla", True, "auto", (227, 395)),
    ("decode fp8 B64 H32", 64, 32, K, 1 << 18, "fp8_ds_mla", True, "auto", (80, 159)),
    ("decode fp8 B256 H16", 256, 16, K, 1 << 18, "fp8_ds_mla", True, "auto", (226, 221)),
    ("decode fp8 B1 H128", 1, 128, K, 1 << 18, "fp8_ds_mla", True, "auto", (26.8, 135)),
    ("to settle: prefill bf16 T4096 H32", 4096, 32, K, 65536, "bf16", False, "auto", None),
    ("to settle: prefill bf16 T4096 H16", 4096, 16, K, 65536, "bf16", False, "auto", None),
    ("to settle: prefill fp8 T4096 H128 (dequantise once)", 4096, 128, K, 65536, "fp8_ds_mla", False,
     "prefill", None),
    ("to settle: prefill fp8 T256 H128 N65536 (dequantise once)", 256, 128, K, 65536, "fp8_ds_mla",
     False, "prefill", None),
    ("to settle: bf16-cache decode B1 H128", 1, 128, K, 1 << 18, "bf16", True, "auto", None),
    ("to settle: bf16-cache decode B64 H128", 64, 128, K, 1 << 18, "bf16", True, "auto", None),
    ("to settle: fp8 T512 H128 reuse 4, decode kernel", 512, 128, K, 1 << 18, "fp8_ds_mla", True,
     "decode", None),
    ("to settle: fp8 T512 H128 reuse 4, dequantise once", 512, 128, K, 1 << 18, "fp8_ds_mla", True,
     "prefill", None),
    ("to settle: decode fp8 B64 H16", 64, 16, K, 1 << 18, "fp8_ds_mla", True, "auto", None),
]


def inputs(ks, T, H, topk, N, fmt, distinct, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, 576, device="cuda", generator=g).to(torch.bfloat16)
    raw = torch.randn(N, 576, device="cuda", generator=g)
    kv = ks.quantize_fp8_ds_mla(raw) if fmt == "fp8_ds_mla" else raw.to(torch.bfloat16)
    del raw
    if distinct:
        perm = torch.randperm(N, device="cuda", generator=g)[:topk]
        shift = torch.randint(0, N, (T, 1), device="cuda", generator=g)
        return q, kv, ((perm[None, :] + shift) % N).int().contiguous()
    rows = torch.stack([torch.randperm(N, device="cuda", generator=g)[:topk] for _ in range(min(T, 64))])
    return q, kv, rows.repeat(-(-T // rows.shape[0]), 1)[:T].int().contiguous()


def raw_call(fm, flash_mla, q, kv, idx, fmt, kernel):
    """The FlashMLA kernel alone, on inputs converted once up front (the adapter's overhead is
    the difference)."""
    T, H, _ = q.shape
    qp, ip = fm.pad_heads(q, fm.padded_heads(H)), fm.flashmla_indices(idx)
    if fmt == "fp8_ds_mla" and kernel == "decode":
        meta = fm.decode_schedule(T, qp.shape[1], ip.shape[-1], q.device)
        pages = kv.view(-1, fm.PAGE, 1, kv.shape[1])
        q4 = qp.unsqueeze(1)
        return lambda: flash_mla.flash_mla_with_kvcache(
            q4, pages, None, None, 512, meta, softmax_scale=SM, is_fp8_kvcache=True, indices=ip,
            use_legacy=True, kv_format="V32")
    rows = (fm._dequantise(kv) if fmt == "fp8_ds_mla" else kv).unsqueeze(1)
    return lambda: flash_mla.flash_mla_sparse_fwd(qp, rows, ip, SM, d_v=512, use_legacy=True)


def run_case(case, ks, fm, flash_mla, rep_ms, graph=False):
    from triton.testing import do_bench, do_bench_cudagraph

    name, T, H, topk, N, fmt, distinct, kernel, measured = case
    bench = lambda fn: do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3
    q, kv, idx = inputs(ks, T, H, topk, N, fmt, distinct, seed=T + H)
    r = {"case": name, "T": T, "H": H, "topk": topk, "N": N, "kv_format": fmt,
         "choose": fm.choose(T, H, topk, fmt, N, q.dtype), "measured_us": measured}
    if fmt == "fp8_ds_mla":
        r["fp8_kernel"] = fm.fp8_kernel(T, topk, N) if kernel == "auto" else kernel
    t_out, t_lse = ks.sparse_mla_attention(q, kv, idx, SM, fmt)
    r["triton_us"] = bench(lambda: ks.sparse_mla_attention(q, kv, idx, SM, fmt))
    if flash_mla is not None:
        f_out, f_lse = fm.sparse_mla_attention(q, kv, idx, SM, fmt, fp8_kernel_choice=kernel)
        r["flashmla_us"] = bench(lambda: fm.sparse_mla_attention(q, kv, idx, SM, fmt, fp8_kernel_choice=kernel))
        r["raw_us"] = bench(raw_call(fm, flash_mla, q, kv, idx, fmt, r.get("fp8_kernel", "prefill")))
        r["ratio"] = r["triton_us"] / r["flashmla_us"]
        r["tflops"] = 2 * T * H * topk * (576 + 512) / (r["flashmla_us"] * 1e-6) / 1e12
        r["max_abs_diff_out"] = (f_out.float() - t_out.float()).abs().max().item()
        fin = torch.isfinite(t_lse)
        r["max_abs_diff_lse"] = (f_lse[fin] - t_lse[fin]).abs().max().item() if fin.any() else 0.0
        r["same_empty_rows"] = bool(torch.equal(torch.isfinite(f_lse), fin))
    if graph and T <= 256:
        in_graph = lambda fn: do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3
        r["triton_graph_us"] = in_graph(lambda: ks.sparse_mla_attention(q, kv, idx, SM, fmt))
        if flash_mla is not None:
            r["flashmla_graph_us"] = in_graph(
                lambda: fm.sparse_mla_attention(q, kv, idx, SM, fmt, fp8_kernel_choice=kernel))
    return r


def fmt_row(r):
    f = lambda k, spec: format(r[k], spec) if r.get(k) is not None else "-"
    m = r.get("measured_us")
    meas = f"{m[0]:g} / {m[1]:g}" if m else "-"
    return (f"| {r['case']} | {f('flashmla_us', '.1f')} | {f('raw_us', '.1f')} | {f('triton_us', '.1f')} | "
            f"{f('ratio', '.2f')} | {f('tflops', '.0f')} | {r.get('choose', '-')} | "
            f"{f('max_abs_diff_out', '.2e')} | {meas} | {f('flashmla_graph_us', '.1f')} | "
            f"{f('triton_graph_us', '.1f')} | {r.get('error', '')} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    ap.add_argument("--quick", action="store_true", help="shorter timing runs")
    ap.add_argument("--graph", action="store_true", help="also time T <= 256 in a CUDA graph")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA GPU (none visible)", file=sys.stderr)
        return 2
    from cpplan.runtime.kernels import get_kernels
    from cpplan.runtime.kernels.flashmla import attention as fm

    ks = get_kernels("cuda", "triton")
    why = fm.unavailable_reason()
    flash_mla = fm._import()[0] if not why else None
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"flash_mla {getattr(flash_mla, '__version__', '-')}")
    if why:
        print(f"# FlashMLA columns skipped: {why}")
    wanted = [s for s in a.only.split(",") if s]
    rows = []
    print("| case | FlashMLA us | raw kernel us | Triton us | Triton/FlashMLA | TFLOP/s | choose() | "
          "max abs diff out | issue 12 us (FlashMLA / Triton) | FlashMLA graph us | Triton graph us "
          "| note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        if wanted and not any(w in case[0] for w in wanted):
            continue
        try:
            r = run_case(case, ks, fm, flash_mla, rep_ms=60 if a.quick else 300, graph=a.graph)
        # one failing case (OOM, a kernel refusing a shape) is a row of the table, not the end
        except Exception as e:  # noqa: BLE001
            r = {"case": case[0], "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
        rows.append(r)
        print(fmt_row(r), flush=True)
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
