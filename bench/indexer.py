"""Indexer benchmark on one GPU: the old per-(query, key block) Triton kernel against the tiled
one (``runtime/kernels/indexer_tiled.py``, the Triton set's default) in the same run, with the
card's bf16 and fp8 matmul ceilings.

    python bench/indexer.py [--quick] [--only prefill,planar,decode,sort,decode-sweep,select-sweep]
                            [--prefill-cases 2048x65536,8192x8192]
                            [--decode-cases 8x131072,64x65536-131072] [--variants filter] [--profile]
                            [--sweep]
                            [--planar-sweep] [--planar-tiles 2:128:4:3,2:64:8:3:128] [--json out.json]
                            [--planar-variants gluon,ws] [--inputs integer|normal] [--deepgemm]
                            [--cuda-baseline FILE] [--ws-tiles 2:3:4:split,4:2:4] [--ws-rounds 3]

Prefill cases: the last T tokens of an N-token context (query i has keys 0 .. N - T + i),
64 heads x 128 dims, topk 2048, one rank. Decode cases: B requests of one context each (and 64
of 2k-6k, as in the decode step; without --quick also 64 of 64k-128k and of 32k-64k, the
long-context step's rows on one GPU and on a P = W = 2 rank), block-planar paged cache (block 64,
shuffled block table). Inputs are integer-valued, so scores are exact and ties
abound; each case checks new == old (ids and scores, order included). Logits FLOPs: 2 * 64 * 128
per (query, key). Medians of ``triton.testing.do_bench``. Each prefill case also times its parts:
the planar fp8 logits and the select (default: the CUDA row top-k where nvcc builds it, the
first line of the prefill output says whether; else the Triton filter path. Variants: the
CUDA kernel's compile-time variants (``row_topk.VARIANTS``; its earlier forms: commits named
in bench/RESULTS.md; ``--cuda-baseline FILE``: the kernel built from another source, e.g. an
earlier commit's), the segment path alone, and radix-only; other ``exact_segments``; the Triton filter path with
``PREFILL_FILTERS``' tunables; each checked equal to the default), the whole indexer with the
Triton select (``PREFILL_WHOLE``), the query quantisation and the plane split alone, and planar
tile choices
(each checked equal to the default tiles' keys; the byte-row prefill kernel they replaced took
6.2-8.9 ms for the first case, bench/RESULTS.md); each decode case times the whole decode
indexer, its logits and its select, eager and replayed from a CUDA graph (``do_bench_cudagraph``:
eager decode figures are host-launch-bound), and select variants (graph; ``DECODE_SELECTS``).
``planar`` times the planar logits tiles alone (``--planar-tiles``; each also with per-thread key
copies instead of TMA copies, the default before), the Gluon logits of bench/variants
(``GLUON_TILES``) and the warp-specialised Gluon logits (``WS_TILES``; ``--planar-variants``);
the prefill cases' "planar logits" part is the default kernel (the warp-specialised one on a
Hopper GPU, ``indexer_tiled.prefill_logits``); ``sort`` times
``tl.sort`` of 4096 values as segments; ``decode-sweep`` the decode tiles
(graph); ``select-sweep`` the select tunables (first prefill case); ``--planar-sweep`` the
planar tiles; ``--sweep`` tile variants of the first prefill case and of the decode cases.
``--deepgemm`` adds an outside anchor to each prefill case: DeepGEMM's ``fp8_mqa_logits`` (and
``torch.topk`` of its logits) on the same fp8 query, keys, scales and weights
(``deepgemm_anchor``; stage its sources with ``bench/deepgemm_stage.sh``, build them with
``bench/deepgemm_build.sh``, then ``PYTHONPATH=/tmp/site``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import time

import torch
import triton
import triton.language as tl
from common import kernel_device_times  # bench/common.py, beside this script
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench, do_bench_cudagraph
from variants import old_indexer  # bench/variants: the first Triton indexer

from cpplan.runtime.kernels import reference as ref
from cpplan.runtime.kernels.cuda import row_topk
from cpplan.runtime.kernels.triton import indexer_tiled as it
from cpplan.runtime.kernels.triton import pack

HI, TOPK, BLOCK = 64, 2048, 64
# more candidate slots than rank_runs runs hold: the filter path does not apply, every row takes
# the segment path (the fallback for rows whose sampled threshold missed)
SEGMENT_PATH = {"filter_cap": 1 << 20, "cuda_select": False}
PREFILL = [(4096, 32768), (2048, 65536), (8192, 8192)]
DECODE = ([(b, ctx) for ctx in (4096, 131072) for b in (1, 8, 64)] + [(64, 6144, 2048)]
          # the long-context decode step's rows: one GPU (64k-128k), a P = W = 2 rank (half)
          + [(64, 131072, 65536), (64, 65536, 32768)])
ROWS: list[dict] = []
FAILS = (CompilationError, OutOfResources, RuntimeError)  # a variant that does not build or run
try:  # ptxas refusing a variant (e.g. too few registers for its accumulators)
    from triton.runtime.errors import PTXASError

    FAILS += (PTXASError,)
except ImportError:
    pass


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def row(name, ms, flops=None, ceil=None, note=""):
    tf = flops / ms / 1e9 if flops else None
    r = {"name": name, "ms": ms, "tflops": tf, "of_ceiling": tf / ceil if tf and ceil else None,
         "note": note}
    ROWS.append(r)
    cols = f"{tf:7.0f} TFLOP/s {r['of_ceiling']:5.0%}" if r["of_ceiling"] else f"{'':21s}"
    print(f"{name:52s} {ms * 1e3:10.1f} us {cols}  {note}", flush=True)
    return r


def ceiling():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    r = row("ceiling: bf16 matmul 8192^3", bench(lambda: a @ b), flops=2 * 8192**3)
    fp8_ceiling(a, b, r["tflops"])
    return r["tflops"]


def fp8_ceiling(a, b, bf16_tflops):
    """The card's fp8 matrix product rate (cuBLAS through ``torch._scaled_mm``, e4m3, unit
    scales, bf16 out) on the same 8192^3 shape: the prefill logits' own anchor (their rows'
    percentages stay against bf16); one line saying why where this torch has no fp8 product."""
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major
        one = torch.ones((), device="cuda")

        def mm():
            return torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        mm()
    except (RuntimeError, AttributeError, TypeError) as e:
        print(f"ceiling: fp8 matmul 8192^3: not available ({_first_line(e)[:100]})", flush=True)
        return None
    r = row("ceiling: fp8 matmul 8192^3 (cuBLAS)", bench(mm), 2 * 8192**3, bf16_tflops,
            "(percent: of the bf16 rate)")
    return r["tflops"]


def _ints(shape, lo, hi, g):
    return torch.randint(lo, hi + 1, shape, device="cuda", generator=g)


INPUTS = "integer"  # --inputs: prefill inputs integer-valued (exact scores, ties) or normal


def prefill_inputs(T, N, seed=0):
    """Integer-valued inputs (exact scores, ties at every threshold: the select's worst case,
    and old == new bit for bit) or, with ``--inputs normal``, normal draws (continuous scores,
    as a model's: the old kernel's may then differ in the last bits, another summation order)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if INPUTS == "normal":
        q = torch.randn((T, HI, 128), device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn((T, HI), device="cuda", generator=g)
        k = ref.quantize_indexer_k(torch.randn((N, 128), device="cuda", generator=g))
    else:
        q = _ints((T, HI, 128), -2, 2, g).to(torch.bfloat16)
        w = _ints((T, HI), -2, 2, g).float()
        k = ref.quantize_indexer_k(_ints((N, 128), -3, 3, g).float())
    key_len = torch.arange(N - T + 1, N + 1, device="cuda")
    pcu = torch.zeros(T, dtype=torch.int64, device="cuda")
    args = (q, w, k, key_len, pcu, N, 1, 1, TOPK)
    return args, 2 * HI * 128 * int(key_len.sum())


def decode_inputs(B, ctx, seed=0, lo=None):
    """B requests of ctx keys each, or (``lo``) of lo..ctx keys (uniform, as in the step)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = ctx // BLOCK
    q = _ints((B, HI, 128), -2, 2, g).to(torch.bfloat16)
    w = _ints((B, HI), -2, 2, g).float()
    packed = ref.quantize_indexer_k(_ints((B * nblk * BLOCK, 128), -3, 3, g).float())
    k = torch.empty(B * nblk, BLOCK * ref.INDEXER_K_BYTES, dtype=torch.uint8, device="cuda")
    ref.scatter_indexer_k(k, torch.arange(B * nblk * BLOCK, device="cuda"), packed)  # block-planar
    bt = torch.randperm(B * nblk, device="cuda", generator=g).int().reshape(B, nblk)
    local_len = torch.full((B,), ctx, device="cuda")
    if lo is not None:
        local_len = torch.randint(lo, ctx + 1, (B,), device="cuda", generator=g)
    args = (q, w, k, local_len, bt, BLOCK, 1, 0, 1, TOPK)
    return args, 2 * HI * 128 * int(local_len.sum())


def same(a, b):
    return torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


def case(name, old_fn, new_fn, args, max_keys, flops, ceil):
    old = old_fn(*args, max_keys=max_keys)
    new = new_fn(*args, max_keys=max_keys)
    ok = same(old, new)
    t_old = bench(lambda: old_fn(*args, max_keys=max_keys))
    t_new = bench(lambda: new_fn(*args, max_keys=max_keys))
    row(f"{name} old", t_old, flops, ceil)
    row(f"{name} new", t_new, flops, ceil, f"x{t_old / t_new:.2f} vs old, new==old: {ok}")
    return ok


def prefill_parts(args, tiles, ceil, flops, label):
    """Times the tiled logits alone (the planar fp8 kernel on the quantised query and the
    planes) and the select alone (one chunk: the whole prefill)."""
    q, w, k, key_len, pcu, N = args[:6]
    keys = torch.empty(q.shape[0], N, dtype=torch.int32, device="cuda")
    top_s, top_i = (torch.empty(q.shape[0], TOPK, device="cuda"),
                    torch.empty(q.shape[0], TOPK, dtype=torch.int32, device="cuda"))
    q8, w8 = pack.quantize_indexer_q(q, w)
    kp, ks = it.split_planes(k)

    def logits():  # the default kernel: the warp-specialised one where it runs
        it.prefill_logits(q8, w8, kp, ks, keys, N, key_len, pcu, N, 1, 1, tiles)

    def select():
        it._select(keys, key_len, TOPK, top_s, top_i, tiles)

    def radix():  # the segment path's radix select alone
        it._select(keys, key_len, TOPK, top_s, top_i,
                   dataclasses.replace(tiles, select_attempts=0, **SEGMENT_PATH))

    parts = [("planar logits", logits, flops), ("select", select, None)]
    if it.ws_logits(q, 1, 1, N, tiles) is not None:  # the query quantised in the Gluon kernel
        parts.append(("logits, the query quantised in the kernel", lambda: it.prefill_logits(
            q, w, kp, ks, keys, N, key_len, pcu, N, 1, 1, tiles, quantise=True), flops))
    lens32 = key_len.int()
    for name, defines in row_topk.VARIANTS.items():  # the CUDA row top-k's variants
        parts.append((f"select CUDA, {name}", lambda d=defines: row_topk.select(
            keys, lens32, TOPK, top_s, top_i, defines=d), None))
    if CUDA_BASELINE:  # --cuda-baseline: another source of the kernel, e.g. an earlier commit's,
        # in the build the default select takes for these rows
        build = row_topk.select_defines(N, TOPK, tiles.cuda_select_short_keys,
                                        tiles.cuda_select_merge)
        kind = "the short rows' build" if build else "the 1024-thread build"
        parts.append((f"select CUDA, baseline {os.path.basename(CUDA_BASELINE)}, {kind}",
                      lambda: row_topk.select(keys, lens32, TOPK, top_s, top_i, defines=build,
                                              source=CUDA_BASELINE), None))
    parts.append(("select Triton filter path (the default before)", lambda: it._select(
        keys, key_len, TOPK, top_s, top_i, dataclasses.replace(tiles, cuda_select=False)), None))
    if label == "parts":
        t = dataclasses.replace(tiles, **SEGMENT_PATH)
        parts.append(("select segment path", lambda t=t: it._select(
            keys, key_len, TOPK, top_s, top_i, t), None))
        parts.append(("select radix only", radix, None))
        for name, kw in PREFILL_FILTERS.items():  # every row through the filter path
            t = dataclasses.replace(tiles, **{"cuda_select": False, **kw})
            parts.append((f"select {name}", lambda t=t: it._select(
                keys, key_len, TOPK, top_s, top_i, t), None))
        for segs in (2, 8):  # the segment path's exact top K, ordered from other segments
            t = dataclasses.replace(tiles, exact_segments=segs, **SEGMENT_PATH)
            parts.append((f"select exact, {segs} segments", lambda t=t: it._select(
                keys, key_len, TOPK, top_s, top_i, t), None))
    if VARIANTS is not None:  # --variants: the default parts and the named ones
        parts = [p for p in parts if p[0] in ("planar logits", "select")
                 or p[0].startswith("select CUDA, baseline")  # asked for by its own flag
                 or any(v in p[0] for v in VARIANTS)]
    want = None
    for part, fn, fl in parts:
        try:
            fn()
            if part == "select":  # every select variant after it is checked against it
                want = (top_s.clone(), top_i.clone())
            note = f"== default select: {same((top_s, top_i), want)}" if want and part != "select" \
                and part.startswith("select") else ""
            row(f"  {label} {part}", bench(fn), fl, ceil, note)
            if PROFILE and part.startswith("select"):
                kernel_table(part, fn)
        except FAILS as e:
            print(f"  {label} {part}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)


# the prefill select through the filter path with these tunables; each checked equal to the
# default select
PREFILL_FILTERS = {
    "filter path": {},
    "filter path, margin 3": {"filter_margin": 3.0},
    "filter path, trim in 4 warps": {"trim_warps": 4},
    "filter path, threshold in 4 warps": {"filter_warps": 4},
    "filter path, untrimmed": {"trim_rows": 1 << 30},
    "filter path, rank chunk 256": {"filter_rank_chunk": 256},
    "filter path, margin 5": {"filter_margin": 5.0},
    "filter path, margin 3.5": {"filter_margin": 3.5},
    "filter path, sample 512": {"filter_sample": 512},
    "filter path, ranks in 8 warps": {"rank_warps": 8},
    "filter path, ranks in 2 warps": {"rank_warps": 2},
    "filter path, rank chunk 1024": {"filter_rank_chunk": 1024},
    "filter path, run sorts in 8 warps": {"filter_sort_warps": 8},
    "filter path, run sorts in 2 warps": {"filter_sort_warps": 2},
    "filter path, chunk 2048 (before)": {"filter_chunk": 2048},
    "filter path, chunk 4096": {"filter_chunk": 4096},
    "filter path, gathering in 8 warps": {"filter_scatter_warps": 8},
    "filter path, gathering in 4 warps (before)": {"filter_scatter_warps": 4},
    "filter path, gathering in 2 warps (before)": {"filter_scatter_warps": 2},
    "filter path, trim in 16 warps": {"trim_warps": 16},
    "filter path, one chunk a counting / gathering program (before)": {"filter_group": 1},
    "filter path, two chunks a counting / gathering program": {"filter_group": 2},
    "filter path, eight chunks a counting / gathering program": {"filter_group": 8},
    "filter path, runs of 1024": {"split_run": 1024},
    "filter path, runs of 1024, run sorts in 8 warps": {"split_run": 1024,
                                                        "filter_sort_warps": 8},
    "filter path, runs of 256": {"split_run": 256},
    "filter path, runs of 2048": {"split_run": 2048, "filter_sort_warps": 8},
    "filter path, ranks launched run-major (before)": {"rank_row_major": False},
    "filter path, trim by radix, 4 bits": {"trim_radix_bits": 4},
    "filter path, trim by radix, 8 bits": {"trim_radix_bits": 8},
    "filter path, trim by radix, 11 bits": {"trim_radix_bits": 11},
    "filter path, candidate slots 32 MB a launch (512 rows at N 32k)": {"filter_budget_bytes": 1 << 25},
    "filter path, candidate slots 64 MB a launch": {"filter_budget_bytes": 1 << 26},
    "filter path, candidate slots 128 MB a launch": {"filter_budget_bytes": 1 << 27},
}
# select variants timed beside the default for decode (each checked equal to the default)
DECODE_SELECTS = {
    "one program per row": {"split_rows": 0},
    "split runs of 1024": {"split_run": 1024},
    "split runs of 256": {"split_run": 256},
    "long rows: second select": {"rank_runs": 1},
    "long rows: 4 segment items per SM (before)": {"programs_per_sm": 4},
    "long rows: segment path only": SEGMENT_PATH,
    "long rows: filter sample 2048": {"filter_sample": 2048},
    "long rows: filter chunk 4096": {"filter_chunk": 4096},
    "long rows: filter trim": {"trim_rows": 0},
    "long rows: filter gathering in 2 warps (before)": {"filter_scatter_warps": 2},
    "long rows: filter threshold in 16 warps": {"filter_warps": 16},
    "long rows: filter chunk 2048, rank chunk 256 (before)": {"filter_chunk": 2048,
                                                              "filter_rank_chunk": 256},
    "split: at most 8 runs, of up to 1024 (before)": {"split_runs": 8, "split_run_max": 1024},
    "ranks launched run-major (before)": {"rank_row_major": False},
}


def gbench(fn):
    """Median of fn replayed from a CUDA graph (no host launch cost)."""
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=100, return_mode="median")


# decode logits tiles (decode_block_k, decode_warps, decode_stages) timed beside the default
LOGITS_TILES = ((128, 4, 4), (64, 4, 4), (64, 4, 3), (256, 8, 3))
VARIANTS = None  # --variants: substrings of the variant names timed (None: every variant)
CUDA_BASELINE = None  # --cuda-baseline: a path to another row_topk.cu, timed beside the default
PROFILE = False  # --profile: device time per kernel (decode: the whole call; prefill: selects)


def kernel_table(label, fn, calls=5):
    """Prints device time per kernel name of one ``fn()`` call, the mean over ``calls`` eager
    calls (``common.kernel_device_times``)."""
    rows = kernel_device_times(fn, calls)
    print(f"  kernels of {label}: {sum(r[2] for r in rows):.1f} us device time a call",
          flush=True)
    for name, n, us in rows:
        print(f"    {name[:60]:60s} x{n:g} {us:8.1f} us", flush=True)


def decode_parts(args, tiles, ceil, flops):
    """Times the tiled decode indexer whole, its logits alone (fp8 products, as the whole
    call) and its select alone (the whole batch), eager and replayed from a CUDA graph (the
    way a decode step runs), then variants of the select (``DECODE_SELECTS``), each checked
    equal."""
    q, w, k, local_len, bt, block, W, rank, I, topk = args
    ctx = int(local_len.max())
    keys = it._keys_buffer(q.shape[0], ctx, q.device)
    top_s, top_i = it._outputs(q.shape[0], topk, q.device)
    splits = it.decode_splits(q.shape[0], ctx, tiles, it._num_sms(q.device))

    # the query as indexer_topk_decode quantises it
    qq, ww = pack.quantize_indexer_q(q, w, torch.float8_e4m3fn if q.is_cuda else q.dtype)

    balanced = it.decode_balanced(q.shape[0], ctx, tiles)

    def logits(bk=it.decode_block_k(q.shape[0], tiles), warps=tiles.decode_warps,
               stages=tiles.decode_stages, per_row=False):
        """The launch the whole call makes (balanced for long rows), or the per-row one."""
        if balanced and not per_row:
            it._logits_balanced(qq, ww, k, keys, local_len, bt, bk=bk, tiles=tiles, B=block)
        else:
            it._logits(qq, ww, k, keys, 2, True, ctx, bk=bk, warps=warps, stages=stages,
                       splits=splits, lens=local_len, bt=bt, B=block)

    def select(t=tiles):
        it._select(keys, local_len, topk, top_s, top_i, t, decode_ids=True, W=W, I=I, rank=rank)

    def whole(t=tiles):
        it.indexer_topk_decode(*args, max_keys=ctx, tiles=t)

    for part, fn, fl in (("whole", whole, flops), ("logits", logits, flops),
                         ("select", select, None)):
        row(f"  parts {part}", bench(fn), fl, ceil)
        row(f"  parts {part}, graph", gbench(fn), fl, ceil)
    for bk, warps, stages in LOGITS_TILES:  # other tiles of the logits alone
        if VARIANTS is None or any(v in "logits tiles" for v in VARIANTS):
            row(f"  parts logits per row, bk {bk} w {warps} s {stages}, graph",
                gbench(lambda: logits(bk, warps, stages, per_row=True)), flops, ceil)
    want = it.indexer_topk_decode(*args, max_keys=ctx)
    if PROFILE:
        kernel_table("whole (default tiles)", whole)
    variants = [(f"select {n}", kw, select, None) for n, kw in DECODE_SELECTS.items()]
    for name, kw, fn, fl in variants:
        if VARIANTS is not None and not any(v in name for v in VARIANTS):
            continue
        t = dataclasses.replace(tiles, **kw)
        try:
            got = it.indexer_topk_decode(*args, max_keys=ctx, tiles=t)
            row(f"  parts {name}, graph", gbench(lambda t=t, fn=fn: fn(t)), fl, ceil,
                f"whole decode == default: {same(got, want)}")
            if PROFILE:
                kernel_table(f"whole, {name}", lambda t=t: whole(t))
        except FAILS as e:
            print(f"  parts {name}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)


@triton.jit
def _sort_rows(x_ptr, out_ptr, SEGS: tl.constexpr, N: tl.constexpr):
    """Sorts one row of SEGS * N values as SEGS independent segments of N (descending)."""
    row = tl.program_id(0).to(tl.int64) * SEGS * N
    off = tl.arange(0, SEGS)[:, None] * N + tl.arange(0, N)[None, :]
    v = tl.load(x_ptr + row + off)
    tl.store(out_ptr + row + off, tl.sort(v, 1, descending=True))


def sort_costs():
    """tl.sort per program, 4096 programs: 4096 values as 1 x 4096, 2 x 2048, 8 x 512 and
    32 x 128 segments (the select's candidate sort), 2048 values as 8 x 256 (what ordering only
    the top 2048 would cost), and 1024 int32 (the threshold sample's sort); int64 and int32."""
    for dtype in (torch.int64, torch.int32):
        for width, shapes in ((4096, (1, 2, 8, 32)), (2048, (8,)), (1024, (1,))):
            x = torch.randint(-2**30, 2**30, (4096, width), device="cuda").to(dtype)
            out = torch.empty_like(x)
            for segs in shapes:
                for warps in (8, 16):
                    fn = lambda x=x, out=out, segs=segs, warps=warps, width=width: (  # noqa: E731
                        _sort_rows[(4096,)](x, out, SEGS=segs, N=width // segs, num_warps=warps))
                    name = f"sort 4096 rows {str(dtype)[6:]} {segs} x {width // segs} w {warps}"
                    try:
                        row(name, bench(fn))
                    except FAILS as e:
                        print(f"{name}: failed ({type(e).__name__})", flush=True)


PLANAR_TILES = [(bq, bk, w, s) for bq in (2, 4) for bk in (64, 128) for w in (4, 8)
                for s in (2, 3, 4)]


def _planar_tiles(text: str) -> list[tuple]:
    """"2:128:4:3,2:64:8:3:128" -> [(2, 128, 4, 3, 0), (2, 64, 8, 3, 128)] (bq:bk:warps:stages
    and an optional register cap)."""
    tiles = []
    for item in text.split(","):
        try:
            v = [int(x) for x in item.split(":")]
            if len(v) not in (4, 5):
                raise ValueError
            tiles.append(tuple(v + [0] * (5 - len(v))))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"planar tile {item!r}: expected BQ:BK:WARPS:STAGES[:MAXNREG], e.g. 2:128:4:3") from None
    return tiles


PLANAR_VARIANTS = ("gluon", "ws")  # --planar-variants: the variant kernels planar_logits times
PLANAR_DEFAULT_TILES = None  # --planar-tiles: the tiles planar_logits times (None: its own list)


def planar_logits(args, ceil, flops, sweep_tiles=False):
    """The query quantisation and the plane split alone, then planar fp8 logits tile choices,
    each checked equal (int32 keys) to the default tiles' keys."""
    q, w, k, key_len, pcu, N = args[:6]
    T = q.shape[0]
    q8, w8 = pack.quantize_indexer_q(q, w)
    tiles = it.IndexerTiles()
    kp, ks = it.split_planes(k)
    want = torch.empty(T, N, dtype=torch.int32, device="cuda")
    got = torch.empty_like(want)
    it._logits_planar(q8, w8, kp, ks, want, N, key_len, pcu, N, 1, 1, bq=tiles.block_q,
                      bk=tiles.block_k, warps=tiles.logits_warps, stages=tiles.logits_stages,
                      maxnreg=tiles.logits_maxnreg)
    valid = torch.arange(N, device="cuda")[None, :] < key_len[:, None]
    row("  quantise q (torch reference)", bench(lambda: ref.quantize_indexer_q(q, w)))
    row("  quantise q (Triton, the default)", bench(lambda: pack.quantize_indexer_q(q, w)))
    row("  split planes (two torch copies)", bench(lambda: it.split_planes(k, kernel=False)))
    row("  split planes (one Triton launch, the default)", bench(lambda: it.split_planes(k)))
    ok = True
    chosen = PLANAR_DEFAULT_TILES or [(tiles.block_q, tiles.block_k, tiles.logits_warps,
                                       tiles.logits_stages, tiles.logits_maxnreg),
                                      (2, 128, 4, 3, 0)]  # the default before 2026-12-01
    tiles_timed = [t + (0,) for t in PLANAR_TILES] if sweep_tiles else chosen
    for (bq, bk, warps, stages, mr), tma in itertools.product(tiles_timed, (True, False)):
        def fn(bq=bq, bk=bk, warps=warps, stages=stages, mr=mr, tma=tma):
            it._logits_planar(q8, w8, kp, ks, got, N, key_len, pcu, N, 1, 1, bq=bq, bk=bk,
                              warps=warps, stages=stages, maxnreg=mr, tma=tma)
        name = f"bq {bq} bk {bk} w {warps} s {stages}{f' regs {mr}' * bool(mr)}"
        name += "" if tma else ", per-thread copies"
        try:
            got.fill_(0)
            fn()
            eq = torch.equal(torch.where(valid, got, 0), torch.where(valid, want, 0))
            ok &= eq
            row(f"  planar fp8 logits {name}", bench(fn), flops, ceil, f"== default tiles: {eq}")
        except FAILS as e:
            print(f"  planar {name}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
    if "gluon" in PLANAR_VARIANTS:
        ok &= gluon_logits(q8, w8, kp, ks, got, want, valid, N, key_len, pcu, ceil, flops)
    if "ws" in PLANAR_VARIANTS:
        ok &= ws_logits(q8, w8, kp, ks, got, want, valid, N, key_len, pcu, ceil, flops)
    return ok


# (queries a CTA, math warpgroups, ring stages, mode) of the warp-specialised logits; mode
# words ("+"-joined on the command line): "pipe": the next product issued before each epilogue;
# "split": the math warpgroups split the queries (queries a warpgroup, tiles of 64 keys);
# "scatter": each quad's sums over heads transposed, a lane scaling and storing one (key,
# query) (block_q 2); "whole": no block cut into parts (the grid's last wave as it falls; the
# default cuts it);
# "probe": the epilogue replaced by a per-column maximum stored nowhere (the products' and the
# pipeline's time, no keys written); "stage" (with split): each math warpgroup copies its own
# queries, under the loader's first key copies; "unroll" (not with pipe): the math loop a
# ring's stages a trip, each stage's barriers fixed at compile time; "arrive": every math
# thread arrives on the free barriers (no barrier of a warpgroup's threads before)
WS_TILES = ((2, 3, 4, "scatter,split,unroll"), (2, 3, 4, "scatter,split"),
            (2, 3, 4, "split,unroll"), (2, 3, 4, "scatter,split,unroll,whole"), (4, 2, 4, ""),
            (2, 2, 4, "pipe"), (2, 3, 4, "probe,split,unroll"),
            (4, 2, 4, "probe"))  # the first: IndexerTiles' default (a test checks)
# each mode word: the launch keyword it sets, its value on and off, and its part of a row's
# name (split's is spelt beside the queries and warpgroups), in the names' order
WS_WORDS = {"split": ("split", True, False, ""),
            "scatter": ("scatter", True, False, "quad sums scattered"),
            "whole": ("last_wave_parts", 1, None, "last wave whole"),
            "stage": ("math_stage", True, False, "queries copied by the math warpgroups"),
            "unroll": ("unroll", True, False, "unrolled"),
            "pipe": ("pipelined", True, False, "pipelined"),
            "arrive": ("thread_arrive", True, False, "every thread arriving"),
            "probe": ("_probe", True, False, "PROBE: no epilogue")}
WS_ROUNDS = 1  # --ws-rounds


def _ws_tiles(text: str) -> tuple[tuple, ...]:
    """"2:2:4:pipe,4:2:4" -> ((2, 2, 4, "pipe"), (4, 2, 4, "")) (queries a CTA or with split a
    warpgroup, math warpgroups, ring stages, and a mode: words of WS_WORDS, "+"-joined)."""
    tiles = []
    for item in text.split(","):
        v = item.split(":")
        try:
            words = sorted(set(v[3].split("+"))) if len(v) == 4 else []
            if len(v) not in (3, 4) or any(x not in WS_WORDS for x in words):
                raise ValueError
            tiles.append((int(v[0]), int(v[1]), int(v[2]), ",".join(words)))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"ws tile {item!r}: expected BQ:NM:STAGES[:MODE], MODE words of "
                f"{'|'.join(WS_WORDS)} joined by +, e.g. 2:3:4:split") from None
    return tuple(tiles)


def _ws_options(bq: int, nm: int, ns: int, mode: str) -> dict:
    """``indexer_logits.launch``'s keyword arguments for a WS_TILES entry."""
    words = set(mode.split(","))
    return {"block_q": bq, "math_warpgroups": nm, "stages": ns,
            **{key: on if word in words else off
               for word, (key, on, off, _) in WS_WORDS.items()}}


def ws_logits(q8, w8, kp, ks, got, want, valid, N, key_len, pcu, ceil, flops):
    """The warp-specialised Gluon logits (runtime/kernels/gluon/indexer_logits.py) at each of
    WS_TILES, checked equal to the Triton kernel's keys, then timed WS_ROUNDS times in turn
    (each row the median of its rounds: a card that slows as it warms weighs on every
    configuration alike); a Triton without Gluon, or a variant that does not build or run,
    prints one line."""
    try:
        from cpplan.runtime.kernels.gluon import indexer_logits as ws
    except ImportError as e:
        print(f"  ws logits: not available ({e})", flush=True)
        return True
    ok = True
    runs = []  # (name, fn, note) of the configurations that ran
    for bq, nm, ns, mode in WS_TILES:
        options = _ws_options(bq, nm, ns, mode)
        probe, split = options["_probe"], options["split"]

        def fn(options=options):
            ws.launch(q8, w8, kp, ks, got, key_len, pcu, N, 1, 1, **options)
        name = (f"  ws fp8 logits bq {bq}{' a warpgroup' * split}, {nm} math warpgroups"
                f"{' splitting queries' * split}, {ns} stages"
                + "".join(f", {label}" for word, (*_, label) in WS_WORDS.items()
                          if label and word in mode.split(",")))
        try:
            got.fill_(0)
            fn()
            eq = torch.equal(torch.where(valid, got, 0), torch.where(valid, want, 0))
            ok &= eq or probe
            runs.append((name, fn, "(keys not written)" if probe else f"== Triton kernel: {eq}"))
        except FAILS + (ValueError,) as e:
            print(f"{name}: failed ({_first_line(e)[:100]})", flush=True)
    times = [[] for _ in runs]
    for _ in range(WS_ROUNDS):
        for (_, fn, _), t in zip(runs, times):
            t.append(bench(fn))
    for (name, _, note), t in zip(runs, times):
        if len(t) > 1:
            note += f"; {len(t)} rounds, {min(t) * 1e3:.1f}-{max(t) * 1e3:.1f} us"
        row(name, statistics.median(t), flops, ceil, note)
    return ok


# (ring stages, unroll, register cap) of the Gluon logits; 168 registers: three programs a SM
GLUON_TILES = ((4, 4, 0), (4, 2, 0), (4, 2, 168), (4, 3, 168), (5, 2, 168))


def gluon_logits(q8, w8, kp, ks, got, want, valid, N, key_len, pcu, ceil, flops):
    """The Gluon prefill logits (bench/variants/gluon_logits.py: products overlapped with
    epilogues; no default path runs them), each checked equal to the default Triton tiles' keys; a Triton without
    Gluon, or a variant that does not build or run, prints one line."""
    try:
        from variants import gluon_logits as gl_logits
    except ImportError as e:
        print(f"  gluon logits: not available ({e})", flush=True)
        return True
    ok = True
    for stages, unroll, regs in GLUON_TILES:
        def fn(stages=stages, unroll=unroll, regs=regs):
            gl_logits.launch(q8, w8, kp, ks, got, N, key_len, pcu, N, 1, 1, stages=stages,
                             unroll=unroll, maxnreg=regs)
        try:
            got.fill_(0)
            fn()
            eq = torch.equal(torch.where(valid, got, 0), torch.where(valid, want, 0))
            ok &= eq
            row(f"  gluon fp8 logits, ring {stages}, unroll {unroll}{f', regs {regs}' * bool(regs)}",
                bench(fn), flops, ceil,
                f"== default tiles: {eq}")
        except FAILS + (ValueError,) as e:
            print(f"  gluon ring {stages} unroll {unroll}: failed ({type(e).__name__}: "
                  f"{str(e)[:80]})", flush=True)
    return ok


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def load_deepgemm():
    """``import deep_gemm`` (``--deepgemm``), or None with one line saying why it failed."""
    import contextlib
    import io

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):  # its own import-time notes, shown on success only
            import deep_gemm
    except Exception as e:  # a build for another torch fails in many ways
        print(f"deepgemm anchor: not available ({_first_line(e)}; bench/deepgemm_stage.sh and "
              "bench/deepgemm_build.sh make it)", flush=True)
        return None
    print(f"{out.getvalue()}deepgemm anchor: deep_gemm {getattr(deep_gemm, '__version__', '?')} "
          f"from {deep_gemm.__file__}", flush=True)
    return deep_gemm


def _row_ms(name):
    """The latest timed row of this name (None if it was not timed)."""
    return next((r["ms"] for r in reversed(ROWS) if r["name"] == name), None)


def deepgemm_anchor(dg, args, ceil, flops, label):
    """DeepGEMM's prefill indexer logits (``deep_gemm.fp8_mqa_logits``) and ``torch.topk`` of
    them on the inputs of cpplan's case ``label``, timed like its rows and checked against
    cpplan's top-k.

    The same fp8 operands, in the layouts both read: the query as cpplan's prefill quantises it
    (``pack.quantize_indexer_q``: q8 ``[T, 64, 128]`` float8_e4m3fn, one power-of-two scale a
    (token, head) folded into the weights, ``w8 [T, 64]`` float32: DeepGEMM's q and weights as
    they are), the keys as cpplan's logits read them (``it.split_planes`` of the packed
    132-byte rows: fp8 ``[N, 128]`` and float32 scales ``[N]``: DeepGEMM's ``kv`` pair), and
    query i's keys ``[0, key_len[i])`` as ``cu_seqlen_ks = 0`` / ``cu_seqlen_ke = key_len``
    (int32). DeepGEMM's score is sum_h w8 * relu(q8 . k8) * scale, cpplan's sum_h w8 *
    relu(q8 . (k8 * scale)): the same value (exact on the integer inputs), so the top-k
    scores must match cpplan's; the ids may differ among tied scores (torch.topk orders ties
    arbitrarily, cpplan by id), so their overlap is reported instead of an equality. Rows: the
    logits kernel alone (``clean_logits=False``: entries outside [ks, ke) left unwritten), with
    its clean kernel (-inf there, what a dense top-k needs), and with ``torch.topk`` (the
    anchor of cpplan's whole ``new`` row, which also quantises q and splits the planes; those
    two are timed apart in ``planar_logits``). FLOPs: the case's (valid (query, key) pairs),
    as in cpplan's rows.
    """
    q, w, k, key_len, pcu, N = args[:6]
    T = q.shape[0]
    q8, w8 = pack.quantize_indexer_q(q, w)
    kp, ks = it.split_planes(k)
    starts = torch.zeros(T, dtype=torch.int32, device="cuda")
    ends = key_len.to(torch.int32).contiguous()

    def logits(clean=True):
        return dg.fp8_mqa_logits(q8, (kp, ks), w8, starts, ends, clean_logits=clean)

    def topk():
        return torch.topk(logits(), TOPK, dim=1)

    try:
        t0 = time.perf_counter()
        logits()  # the first call compiles the kernels (DeepGEMM's JIT, nvcc)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        vals, ids = topk()
        want_s, want_i = it.indexer_topk_prefill(*args, max_keys=N)
        valid = want_i >= 0  # rows with fewer than TOPK keys: -inf pads, no id to match
        same_s = torch.equal(vals, want_s)
        hit = torch.zeros(T, N + 1, dtype=torch.bool, device="cuda")
        hit.scatter_(1, torch.where(valid, want_i.long(), N), True)
        overlap = hit.gather(1, ids)[valid].float().mean().item() if valid.any() else 1.0
        del hit
        t_new, t_logits = _row_ms(f"{label} new"), _row_ms("  parts planar logits")
        diff = (vals - want_s).nan_to_num(0.0).abs().max().item()  # -inf pads: equal, not nan
        row("  deepgemm fp8_mqa_logits, no clean", bench(lambda: logits(False)), flops, ceil,
            f"first call (JIT) {first:.1f} s")
        t = bench(logits)
        row("  deepgemm fp8_mqa_logits", t, flops, ceil,
            f"{t / t_logits:.2f} x cpplan planar logits' time" if t_logits else "")
        t = bench(topk)
        row("  deepgemm fp8_mqa_logits + torch.topk", t, flops, ceil,
            (f"{t / t_new:.2f} x cpplan new's time; " if t_new else "")
            + f"top-k scores == cpplan: {same_s} (max |diff| {diff:.3g}), "
              f"ids overlap {overlap:.4f}")
        del vals, ids
    except FAILS as e:
        print(f"  deepgemm anchor: failed ({_first_line(e)[:120]})", flush=True)


def run_prefill(cases, ceil, kernels, planar_sweep=False, dg=None):
    ok = True
    why = row_topk.unavailable_reason(torch.device("cuda"))
    print(f"CUDA row top-k (the default select of a prefill's rows): {why or 'builds and runs'}",
          flush=True)
    for T, N in cases:
        args, flops = prefill_inputs(T, N)
        label = f"prefill T {T} N {N}"
        ok &= case(label, kernels.indexer_topk_prefill, it.indexer_topk_prefill, args, N, flops,
                   ceil)
        prefill_parts(args, it.IndexerTiles(), ceil, flops, "parts")
        ok &= prefill_whole(args, N, flops, ceil)
        if dg is not None:  # --deepgemm: beside the parts it compares with; reported, not in ok
            deepgemm_anchor(dg, args, ceil, flops, label)
        ok &= planar_logits(args, ceil, flops, planar_sweep)
        del args
    return ok


# whole prefill indexers beside the default (its logits by the Gluon kernel on Hopper); where
# the query is copied and quantised (ws_math_stage, ws_quantise): bench/query_staging.py, by turns
PREFILL_WHOLE = {
    "the query quantised in the Gluon kernel": {"ws_quantise": True},
    "Gluon logits, Triton filter path (the default before)": {"cuda_select": False},
    "Triton logits, filter path": {"logits_ws": False, "cuda_select": False},
}


def prefill_whole(args, N, flops, ceil):
    """The whole prefill indexer at each of PREFILL_WHOLE's tiles (``--variants`` filters by
    name), checked equal to the defaults' results."""
    want = it.indexer_topk_prefill(*args, max_keys=N)
    ok = True
    for name, kw in PREFILL_WHOLE.items():
        if VARIANTS is not None and not any(v in name for v in VARIANTS):
            continue
        tiles = it.IndexerTiles(**kw)
        fn = lambda tiles=tiles: it.indexer_topk_prefill(*args, max_keys=N, tiles=tiles)
        try:
            eq = same(fn(), want)
            ok &= eq
            row(f"  whole, {name}", bench(fn), flops, ceil, f"== defaults: {eq}")
        except FAILS as e:
            print(f"  whole, {name}: failed ({_first_line(e)[:100]})", flush=True)
    return ok


def run_decode(cases, ceil, kernels):
    ok = True
    for B, ctx, *lo in cases:
        args, flops = decode_inputs(B, ctx, lo=lo[0] if lo else None)
        name = f"decode B {B} ctx {lo[0]}-{ctx}" if lo else f"decode B {B} ctx {ctx}"
        ok &= case(name, kernels.indexer_topk_decode, it.indexer_topk_decode, args, ctx, flops,
                   ceil)
        decode_parts(args, it.IndexerTiles(), ceil, flops)
        del args
    return ok


def sweep(ceil):
    args, flops = prefill_inputs(*PREFILL[0])
    base = it.IndexerTiles()
    for bq in (1, 2, 4):
        for bk in (64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    t = dataclasses.replace(base, block_q=bq, block_k=bk, logits_warps=warps,
                                            logits_stages=stages)
                    prefill_parts(args, t, ceil, flops, f"bq {bq} bk {bk} w {warps} s {stages}")
    sweep_select(args, base, ceil)
    del args
    for B, ctx in ((64, 4096), (8, 131072), (1, 131072)):
        sweep_decode(B, ctx, ceil)


SELECT_SWEEP = {"select_sample": (256, 512, 2048), "select_margin": (2.0, 3.0, 4.0),
                "select_block": (2048, 8192), "select_warps": (8, 32),
                "select_programs_per_sm": (2, 8), "exact_segments": (2, 8)}


def sweep_select(args, base, ceil):
    """One segment-path tunable at a time around the defaults (the select alone, first prefill
    case, every row through the segment path)."""
    for name, values in SELECT_SWEEP.items():
        for v in values:
            t = dataclasses.replace(base, **SEGMENT_PATH, **{name: v})
            prefill_parts(args, t, ceil, None, f"select {name} {v}")


def sweep_decode(B, ctx, ceil):
    args, flops = decode_inputs(B, ctx)
    base = it.IndexerTiles()
    for bk in (64, 128):
        for warps in (4, 8):
            for pps in (2, 4, 8, 16):
                t = dataclasses.replace(base, decode_block_k=bk, few_rows=0, decode_warps=warps,
                                        decode_programs_per_sm=pps)
                name = f"decode B {B} ctx {ctx} bk {bk} w {warps} pps {pps}"
                try:
                    row(name, gbench(lambda t=t: it.indexer_topk_decode(*args, max_keys=ctx,
                                                                        tiles=t)), flops, ceil)
                except FAILS as e:
                    print(f"{name}: failed ({type(e).__name__})", flush=True)


def _prefill_cases(text: str) -> list[tuple]:
    """"2048x65536,8192x8192" -> [(2048, 65536), (8192, 8192)] (T queries x N keys)."""
    try:
        cases = [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",")]
    except ValueError:
        cases = []
    if not cases or any(len(c) != 2 or min(c) < 1 or c[0] > c[1] for c in cases):
        raise argparse.ArgumentTypeError(
            f"prefill cases {text!r}: expected TxN,... with 1 <= T <= N, e.g. 2048x65536")
    return cases


def _decode_cases(text: str) -> list[tuple]:
    """"8x131072,64x65536-131072" -> [(8, 131072), (64, 131072, 65536)] (B x context, or
    B x lo-hi: contexts spread over [lo, hi], as DECODE's ranged cases)."""
    cases = []
    for item in text.split(","):
        try:
            b, ctx = item.lower().split("x")
            lo, _, hi = ctx.partition("-")
            cases.append((int(b), int(hi), int(lo)) if hi else (int(b), int(lo)))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"decode case {item!r}: expected BxCTX or BxLO-HI, e.g. 8x131072") from None
    return cases


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="first prefill and two decode cases")
    ap.add_argument("--only", default="prefill,decode")
    ap.add_argument("--sweep", action="store_true", help="tile variants (long)")
    ap.add_argument("--planar-sweep", action="store_true", help="planar fp8 logits tiles")
    ap.add_argument("--planar-tiles", type=_planar_tiles, metavar="BQ:BK:W:S[:REGS],...",
                    help="the planar logits tiles timed (default: the default and one other)")
    ap.add_argument("--planar-variants", default="gluon,ws", metavar="NAME[,NAME]",
                    help="variant logits kernels timed beside the planar tiles: gluon (the "
                         "bench/variants kernel), ws (the warp-specialised one's WS_TILES); '' "
                         "for none")
    ap.add_argument("--ws-tiles", type=_ws_tiles, metavar="BQ:NM:STAGES[:MODE],...",
                    help="the warp-specialised logits' configurations timed (default: WS_TILES)")
    ap.add_argument("--ws-rounds", type=int, default=1, metavar="R",
                    help="time the --ws-tiles configurations R times in turn, each row the "
                         "median of its rounds (default 1)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--prefill-cases", type=_prefill_cases, metavar="TxN[,TxN...]",
                    help="these prefill cases only, e.g. 2048x65536,8192x8192")
    ap.add_argument("--decode-cases", type=_decode_cases, metavar="BxCTX[,BxLO-HI...]",
                    help="these decode cases only, e.g. 8x131072,64x65536-131072")
    ap.add_argument("--variants", metavar="SUB[,SUB...]",
                    help="time only the variants whose name holds one of these "
                         "(e.g. filter,logits tiles); '' for none")
    ap.add_argument("--profile", action="store_true",
                    help="device time per kernel: of the whole decode call (default tiles and "
                         "each timed variant), of each timed prefill select")
    ap.add_argument("--inputs", choices=("integer", "normal"), default="integer",
                    help="prefill inputs: integer-valued (exact, tied scores; the default) or "
                         "normal draws (continuous scores)")
    ap.add_argument("--cuda-baseline", metavar="FILE",
                    help="each prefill case also times the CUDA select built from FILE (in the "
                         "build the default takes for its rows), e.g. an earlier commit's "
                         "(git show REV:runtime/kernels/cuda/row_topk.cu)")
    ap.add_argument("--deepgemm", action="store_true",
                    help="each prefill case also times DeepGEMM's fp8_mqa_logits (+ torch.topk) "
                         "on the same inputs (bench/deepgemm_build.sh builds it; one line and "
                         "no rows if deep_gemm does not import)")
    a = ap.parse_args()
    global VARIANTS, PROFILE, PLANAR_DEFAULT_TILES, PLANAR_VARIANTS, INPUTS, CUDA_BASELINE, \
        WS_TILES, WS_ROUNDS
    WS_TILES = a.ws_tiles or WS_TILES
    if a.ws_rounds < 1:
        ap.error(f"--ws-rounds: got {a.ws_rounds}; expected at least 1")
    WS_ROUNDS = a.ws_rounds
    PLANAR_VARIANTS = tuple(v for v in a.planar_variants.split(",") if v)
    PROFILE = a.profile
    if a.cuda_baseline:
        if not os.path.isfile(a.cuda_baseline):
            ap.error(f"--cuda-baseline: no such file: {a.cuda_baseline}")
        CUDA_BASELINE = os.path.abspath(a.cuda_baseline)
    INPUTS = a.inputs
    PLANAR_DEFAULT_TILES = a.planar_tiles
    if a.variants is not None:
        VARIANTS = [v for v in a.variants.split(",") if v]
    # "old": the per-(query, key block) kernel, the Triton set's indexer until 2026-11-30
    kernels = old_indexer
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    dg = load_deepgemm() if a.deepgemm else None
    ceil = ceiling()
    parts = a.only.split(",")
    ok = True
    if "prefill" in parts:
        cases = a.prefill_cases or (PREFILL[:1] if a.quick else PREFILL)
        ok &= run_prefill(cases, ceil, kernels, a.planar_sweep, dg)
    if "planar" in parts:  # the planar logits tiles alone: --prefill-cases, or the first case
        for T, N in a.prefill_cases or PREFILL[:1]:
            print(f"planar logits T {T} N {N}", flush=True)
            args, flops = prefill_inputs(T, N)
            ok &= planar_logits(args, ceil, flops, a.planar_sweep)
            del args
    if "decode-sweep" in parts:
        for B, ctx in ((64, 4096), (8, 131072), (64, 131072)):
            sweep_decode(B, ctx, ceil)
    if "sort" in parts:
        sort_costs()
    if "select-sweep" in parts:  # one select tunable at a time, first prefill case
        args, _ = prefill_inputs(*PREFILL[0])
        sweep_select(args, it.IndexerTiles(), ceil)
        del args
    if "decode" in parts:
        cases = a.decode_cases or ([(64, 4096), (64, 6144, 2048), (8, 131072)] if a.quick
                                   else DECODE)
        ok &= run_decode(cases, ceil, kernels)
    if a.sweep:
        sweep(ceil)
    print(f"new == old in every case: {ok}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": ROWS, "all_equal": ok}, f, indent=1)


if __name__ == "__main__":
    main()
