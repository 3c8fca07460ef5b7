"""The decode indexer's logits against the bandwidth they need, on one GPU.

A decode row's logits read each of its keys once (128 fp8 values + a float32 scale: 132 bytes,
block-planar paged cache) and write a 4-byte score, so the launch is bandwidth-bound: at
64 rows x 128k keys it moves 1.14 GB. This bench times, replayed from CUDA graphs
(``do_bench_cudagraph`` medians), for each case:

- ``read, contiguous``: a Triton kernel that only reads the same number of bytes from one
  contiguous buffer (16-byte vectors, xor-reduced): the ceiling for reading them at all;
- ``read, paged``: the same split of work and the same block-table gather as the logits launch
  (cache blocks through the table, values and scales), keys xor-reduced, no products: the
  ceiling for this access pattern;
- ``logits``: the per-row launch ``indexer_tiled._logits`` (MODE 2: each row's keys split into
  equal programs) with the default tiles and with each
  ``(block_k, warps, stages, programs per SM[, register cap])`` of ``--tiles``, and the
  balanced launch (``_logits_balanced``: the batch's key tiles split evenly over the programs)
  with its default tunables and ``BALANCED``'s; every variant's keys are checked equal to the
  default's.

Figures are TB/s of bytes read and written (keys x 136), and the ratio against the paged read of
the same run.

    python bench/decode_logits.py [--cases 64x131072,64x65536-131072,8x131072,64x32768-65536]
                                  [--tiles 128:4:3:4,128:4:5:4:120,...]
                                  [--layout shuffled|in-a-row|both] [--timer graph|profiler|both]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from cpplan.runtime.kernels import reference as ref
from cpplan.runtime.kernels.triton import indexer_tiled as it

HI, BLOCK, KEY_BYTES = 64, 64, 132
CASES = "64x131072,64x65536-131072,8x131072,64x32768-65536"
BALANCED = {"": {}, ", 2 programs/SM, no cap": {"decode_balanced_programs_per_sm": 2,
                                                 "decode_balanced_maxnreg": 0},
            ", 4 programs/SM, 128 registers": {"decode_balanced_programs_per_sm": 4,
                                               "decode_balanced_maxnreg": 128},
            ", 3 stages": {"decode_balanced_stages": 3}}
TILES = ("128:4:3:4,128:4:4:4,128:4:5:4,128:8:5:4,128:4:5:2,128:4:5:3,128:4:5:6,"
         "64:4:5:4,64:4:5:8,256:8:3:4,256:8:5:2,256:8:5:3")


@triton.jit
def read_contiguous(x_ptr, out_ptr, n_vec, PER_PROG: tl.constexpr, V: tl.constexpr):
    """Xor of this program's PER_PROG 16-byte vectors (int32 x 4)."""
    pid = tl.program_id(0)
    acc = tl.zeros([V, 4], dtype=tl.int32)
    base = pid.to(tl.int64) * PER_PROG
    for i in range(0, PER_PROG, V):
        v = base + i + tl.arange(0, V)
        acc ^= tl.load(x_ptr + v[:, None] * 4 + tl.arange(0, 4)[None, :], mask=(v < n_vec)[:, None],
                       other=0)
    tl.store(out_ptr + pid, tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit(do_not_specialize=["KEYS_PER_SPLIT"])
def read_paged(k_ptr, len_ptr, bt_ptr, out_ptr, stride_bt, KEYS_PER_SPLIT, BK: tl.constexpr,
               BLOCK: tl.constexpr):
    """The logits launch's reads (MODE 2: a row's keys through its block table, values as 16-byte
    vectors and scales), xor-reduced instead of scored."""
    split, j = tl.program_id(0), tl.program_id(1)
    n = tl.load(len_ptr + j).to(tl.int32)
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(n, lo + KEYS_PER_SPLIT)
    acc = tl.zeros([BK, 32], dtype=tl.int32)
    sacc = tl.zeros([BK], dtype=tl.int32)
    d = tl.arange(0, 32)
    for kb in range(lo, hi, BK):
        c = kb + tl.arange(0, BK)
        kvalid = c < hi
        blk = tl.load(bt_ptr + j.to(tl.int64) * stride_bt + c // BLOCK, mask=kvalid, other=0)
        base = blk.to(tl.int64) * (BLOCK * 132)
        o = c % BLOCK
        vals = (k_ptr + base + o.to(tl.int64) * 128).to(tl.pointer_type(tl.int32))
        acc ^= tl.load(vals[:, None] + d[None, :])
        sacc ^= tl.load((k_ptr + base + BLOCK * 128 + o * 4).to(tl.pointer_type(tl.int32)),
                        mask=kvalid, other=0)
    tl.store(out_ptr + j * tl.num_programs(0) + split,
             tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor) ^ tl.reduce(sacc, 0, _xor))


def inputs(B: int, ctx: int, lo: int | None, seed: int = 0, shuffled: bool = True):
    """B rows of ctx keys (or lo..ctx), integer-valued keys in a block-planar cache whose blocks
    a row reads in a random order (``shuffled``) or in a row."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = ctx // BLOCK
    q = torch.randint(-2, 3, (B, HI, 128), generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randint(-2, 3, (B, HI), generator=g, device="cuda").float()
    vals = torch.randint(-3, 4, (B * nblk * BLOCK, 128), generator=g, device="cuda").float()
    k = torch.empty(B * nblk, BLOCK * KEY_BYTES, dtype=torch.uint8, device="cuda")
    ref.scatter_indexer_k(k, torch.arange(B * nblk * BLOCK, device="cuda"),
                          ref.quantize_indexer_k(vals))
    bt = (torch.randperm(B * nblk, device="cuda", generator=g) if shuffled
          else torch.arange(B * nblk, device="cuda")).int().reshape(B, nblk)
    lens = torch.full((B,), ctx, device="cuda")
    if lo is not None:
        lens = torch.randint(lo, ctx + 1, (B,), device="cuda", generator=g)
    q8, w8 = it._query(q, w, torch.float8_e4m3fn)
    return q8, w8, k, lens, bt


def logits_fn(q8, w8, k, lens, bt, L, tiles: it.IndexerTiles):
    keys = it._keys_buffer(q8.shape[0], L, q8.device)
    bk = it.decode_block_k(q8.shape[0], tiles)
    splits = it.decode_splits(q8.shape[0], L, tiles, it._num_sms(q8.device))

    def run():
        it._logits(q8, w8, k, keys, 2, True, L, bk=bk, warps=tiles.decode_warps,
                   stages=tiles.decode_stages, splits=splits, lens=lens, bt=bt, B=BLOCK,
                   maxnreg=tiles.decode_maxnreg)
    return run, keys, splits


def balanced_fn(q8, w8, k, lens, bt, L, tiles: it.IndexerTiles):
    """The balanced launch (``indexer_tiled._logits_balanced``) as a call; ``.keys`` its output."""
    keys = it._keys_buffer(q8.shape[0], L, q8.device)

    def run():
        it._logits_balanced(q8, w8, k, keys, lens, bt, bk=tiles.decode_block_k, tiles=tiles,
                            B=BLOCK)
    run.keys = keys
    return run


def _valid(keys, lens):
    cols = torch.arange(keys.shape[1], device=keys.device)
    return torch.where(cols[None, :] < lens[:, None], keys, 0)


def _timer(kind: str):
    """ms of fn: the median replayed from a CUDA graph, or the mean over 20 eager calls of its
    kernels' torch.profiler device time (``common.kernel_device_times``)."""
    if kind == "graph":
        return lambda fn: do_bench_cudagraph(fn, rep=100, return_mode="median")

    def profiled(fn):
        from common import kernel_device_times  # bench/common.py, beside this script

        for _ in range(3):
            fn()
        return sum(us for _, _, us in kernel_device_times(fn, 20)) / 1e3
    return profiled


def run_case(B, ctx, lo, tile_list, shuffled=True, timer="graph"):
    q8, w8, k, lens, bt = inputs(B, ctx, lo, shuffled=shuffled)
    bench_ms = _timer(timer)
    keys_total = int(lens.sum())
    moved = keys_total * (KEY_BYTES + 4)
    base = it.IndexerTiles()
    label = f"{B} x {lo // 1024}k-{ctx // 1024}k" if lo else f"{B} x {ctx // 1024}k"
    label += ("" if shuffled else ", blocks in a row") + ("" if timer == "graph" else ", profiler")

    def line(name, ms, paged_ms=None, note=""):
        ratio = f"{ms / paged_ms:.2f}" if paged_ms else ""
        print(f"| {label} | {name} | {ms * 1e3:.1f} | {moved / ms / 1e9:.2f} | {ratio} | {note} |",
              flush=True)

    n_vec = keys_total * KEY_BYTES // 16
    flat = torch.empty(n_vec * 16, dtype=torch.uint8, device="cuda")
    sms = it._num_sms(q8.device)
    progs = 4 * sms
    per = triton.cdiv(triton.cdiv(n_vec, progs), 512) * 512
    sink = torch.empty(triton.cdiv(n_vec, per), dtype=torch.int32, device="cuda")
    t_flat = bench_ms(lambda: read_contiguous[(sink.numel(),)](
        flat.view(torch.int32), sink, n_vec, PER_PROG=per, V=512, num_warps=4))
    line("read, contiguous (same bytes)", t_flat)
    run, want, splits = logits_fn(q8, w8, k, lens, bt, ctx, base)
    per_split = triton.cdiv(triton.cdiv(ctx, splits), 128) * 128
    psink = torch.empty(B * triton.cdiv(ctx, per_split), dtype=torch.int32, device="cuda")
    t_paged = bench_ms(lambda: read_paged[(triton.cdiv(ctx, per_split), B)](
        k, lens, bt, psink, bt.stride(0), per_split, BK=128, BLOCK=BLOCK, num_warps=4,
        num_stages=3))
    line("read, paged (the logits' pattern)", t_paged, t_paged)
    run()
    want = _valid(want, lens).clone()
    t0 = bench_ms(run)
    line(f"logits per row, default tiles ({base.decode_block_k}:{base.decode_warps}:{base.decode_stages}:"
         f"{base.decode_programs_per_sm})", t0, t_paged)
    for name, kw in BALANCED.items():  # the balanced launch: tiles split evenly over programs
        t = dataclasses.replace(base, decode_balanced_keys=1, decode_balanced_rows=1, **kw)
        fn = balanced_fn(q8, w8, k, lens, bt, ctx, t)
        fn()
        ok = torch.equal(_valid(fn.keys, lens), want)
        line(f"logits balanced{name}", bench_ms(fn), t_paged, f"keys == default: {ok}")
    for bk, warps, stages, pps, *regs in tile_list:  # the per-row launch
        t = dataclasses.replace(base, decode_block_k=bk, few_rows=0, decode_warps=warps,
                                decode_stages=stages, decode_programs_per_sm=pps,
                                decode_maxnreg=regs[0] if regs else 0)
        name = f"logits per row {bk}:{warps}:{stages}:{pps}" + (f":{regs[0]}" if regs else "")
        try:
            fn, got, _ = logits_fn(q8, w8, k, lens, bt, ctx, t)
            fn()
            ok = torch.equal(_valid(got, lens), want)
            line(name, bench_ms(fn), t_paged,
                 f"keys == default: {ok}")
        except Exception as e:  # noqa: BLE001 (a tile that does not build here: report, go on)
            print(f"| {label} | {name} | failed: {type(e).__name__} | | | |", flush=True)


def _cases(text: str):
    out = []
    for item in text.split(","):
        b, ctx = item.lower().split("x")
        lo, _, hi = ctx.partition("-")
        out.append((int(b), int(hi), int(lo)) if hi else (int(b), int(lo), None))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--tiles", default=TILES, help="BK:WARPS:STAGES:PROGRAMS_PER_SM[:REGS],...")
    ap.add_argument("--layout", choices=("shuffled", "in-a-row", "both"), default="shuffled",
                    help="the cache blocks a row reads: in a random order (a long-running "
                         "server's cache) or in a row (a fresh one)")
    ap.add_argument("--timer", choices=("graph", "profiler", "both"), default="graph")
    a = ap.parse_args(argv)
    tiles = [tuple(int(x) for x in t.split(":")) for t in a.tiles.split(",") if t]
    print("| case | kernel | us | TB/s (keys x 136 B) | / paged read | check |")
    print("|---|---|---:|---:|---:|---|")
    layouts = {"shuffled": [True], "in-a-row": [False], "both": [True, False]}[a.layout]
    timers = ["graph", "profiler"] if a.timer == "both" else [a.timer]
    for B, ctx, lo in _cases(a.cases):
        for shuffled in layouts:
            for timer in timers:
                run_case(B, ctx, lo, tiles, shuffled, timer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
