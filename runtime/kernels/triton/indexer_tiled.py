"""Tiled Triton indexer: logits as a matrix product over blocks of queries and keys, then an
exact top-k from a sampled threshold (no sort of every key). Same entry points, arguments and results as
``indexer`` (contracts: ``reference/indexer.py``); bodies in ``indexer_logits_jit`` and
``indexer_select_jit``.

The query is quantised first (``pack.quantize_indexer_q``: fp8 with one power-of-two scale per
head, folded into the weights; docs/design.md §4.3), as in every backend.

Prefill logits (``indexer_logits_jit.logits_planar_kernel``). The gathered keys are split into
two planes (fp8 values ``[R, 128]`` with 128-byte aligned rows, float32 scales ``[R]``:
``split_planes``, 18 us for 32k keys), and per block of BK keys a program owning BQ consecutive queries computes
``K [BK, 128] @ Q^T [128, BQ * HP]`` with fp8 operands (HP = heads padded to a power of two, 64
for the model), each key tile read once for BQ queries. One key loop serves both the usual
block (its queries one request's: one key tile for all) and a block across a request boundary
(one pass per query): a second loop had its own pipeline buffers, and 115 KB of shared memory
kept the kernel at one program per SM. Query blocks run last first (a prefill's later queries
have the most keys: the longest programs start first). H200, T 4096 x N 32768
(``bench/indexer.py --only planar``): 2.19-2.21 ms, 935 TFLOP/s of logits (BQ 2, BK 64, 4 warps
capped at 128 registers: four programs a SM; the cap applies to tiles of at most 128
query-head columns), 2.23-2.25 ms for BK 128 in 8 warps under the same cap, 2.35 ms for BK 128
in 4 warps uncapped; the byte-row kernel below takes 6.23 ms (4 warps; 8.90 at 8) on the same
quantised inputs; the int32 keys are equal. Within a program each product is waited on as
soon as it is issued, so its epilogue never overlaps its products. The opt-in Gluon kernel
(``logits_gluon``, ``gluon/logits_jit.py``) issues the next tile's products before this
tile's epilogue; on the H200 it is correct but slower (2.41 ms).

Decode and explicit-row logits (``indexer_logits_jit.logits_kernel``) read the packed 132-byte
rows of the paged cache (not 16-byte aligned: at most 4-byte vectors). The key tile is the A
operand; the queries x heads tile, loaded once per program, the B operand. On CUDA the decode
multiplies the fp8 key bytes by the fp8 query on fp8 tensor cores (``decode_fp8``; else the
keys are converted to the query's dtype, which holds the fp8 query's values: the same products).
Decode queries each own their keys (BQ 1, N = 64): memory-bound, so the keys of a request are
split over programs (at most ``decode_programs_per_sm`` x SMs programs in all:
``decode_splits``; one launch for the whole batch), BK 128, reading the block-planar paged
cache (reference/formats.py) with 16-byte loads. H200, replayed from a CUDA graph
(``bench/indexer.py --only decode``): 64 x 4k logits 14.9 us (26.7 from packed 132-byte rows,
which allow only 4-byte loads; 48.8 with bf16 products), 8 x 128k 62.5 (94.7), 64 x 64k-128k
331 (563); BK 64 is faster at 64 x 4k and 8 x 128k (12.0, 53.5 us) but slower at 64 x 2k-6k
and 64 x 64k-128k (17.3, 379 us). Long rows (``decode_balanced_keys``, two or more of them) take
the balanced launch instead (``logits_balanced_kernel``): the batch's key tiles laid end to
end and split evenly over one wave of programs, whatever the rows' lengths, two key tiles in
flight each (5 stages). The per-row split's time depends on the mix of lengths (a second wave
of long programs for some batches: 64 x 64k-128k 328 us for one draw of lengths, 259 for
another); the balanced launch took 240 us for the first (the paged read of the same bytes:
225; ``bench/decode_logits.py``), and in the 64 x 64k-128k decode step 873 us a step against
1060 (``bench/step_gpu.py --prompt 0 --graphs --context 65536:131072 --trace 2``).

Both epilogues (ReLU, head weights, the sum over each query's heads, the per-key power-of-two
scale) reduce along N, which in the MMA accumulator layout is mostly within a thread plus a quad
shuffle. Causal bounds: a program stops at its block's largest key_len; keys past a query's own
bound are not written. Queries of a block that belong to different requests (a different
region_pcu; rare) take one pass over the key tiles per query.

Top-k. Scores are written as order-preserving int32 keys (a row cannot hold both signed zeros:
-0.0 needs every weight of the row negative, and then no score is +0.0). Persistent programs
(``select_programs_per_sm`` x SMs) walk the (row, segment) items; each keeps CAP + KP int64 of
scratch. Per item: (1) a strided sample of S keys, sorted, gives a threshold thr at the sample
rank ``m + margin * sqrt(m)``, m = K * S / n (rows of n <= CAP keys skip this: thr takes every
key); (2) ONE pass over the row writes the composites ``key << 32 | (2**32 - 1 - position)`` of
the keys > thr (up to CAP) and of the first K keys == thr in position order (the only equal ones
that can win, so massive ties cost K slots, not all of them), counting both; (3) if fewer than
min(K, valid keys) were >= thr or more than CAP were > thr, the pass is retried at the sample rank
that the observed density puts at (K + CAP) / 2 keys (``select_attempts`` passes in all), then
the radix select (``ceil(32 / radix_bits)`` ``tl.histogram`` passes: exact threshold, lowest
positions among equals) runs for that item only, in the same kernel (no host sync); (4) with
``select_exact`` (the default, when KP < CAP), the exact top K of the candidates are kept first
(``_keep_top``: the K-th largest key by bisection over the live keys' range, 32 block-wide
counts at most, then the keys above it and the first of those equal to it, which the gathering
left in position order), and only those KP slots are ordered, by a merge sort from
``exact_segments`` (default 4) sorted segments as below. H200, T 4096 x N 32768: select 2.23
ms against 3.01 ordering all CAP candidates, results equal; 2.15 ms with 8192-key scan steps
(``select_block``; the whole indexer 4.71 ms; prefill rows take the filter path below now).
Otherwise (5) a sort of
the CAP composites (score descending, id ascending) and the first K are written; or, with
``sort_segments`` > 1 (default 8), the CAP composites are sorted as that many segments, then
merged pairwise in log2(segments) rounds in the scratch, each element placed by its index plus
a binary search in the partner run: a merge sort whose first level is ``tl.sort`` (which, for
4096 int64 per program and 4096 programs, costs 2.42 ms as one sort, 1.06 ms as 8 x 512,
0.31 ms as 32 x 128: ``bench/indexer.py --only sort``). H200, the whole select of T 4096 x
N 32768 (``bench/indexer.py --quick``): 3.40 ms with one sort, 3.01 ms from 8 segments, 3.32
ms from 32 (of which 1.06 ms the segment sorts, about 1 ms the merge rounds; the sample's
sort of 1024 int32 costs 0.09 ms over 4096 rows). Bytes per row: the sample (S sectors of 32 B)
plus one read of the row's 4-byte keys plus <= CAP + K composite writes and reads. H200, T4096 x N32768
(randn or integer scores, exact, one sort): 3.9 ms with S 2048 and 8 warps, 3.5 ms with S 1024
(16 warps: -5%); radix only (``select_attempts=0``) 16.1 ms. The sorts
dominate, not the bytes (CAP 8192: 7.2 ms; S 4096: 5.2 ms): ``tl.sort`` of 4096 int64 costs
about 0.1 ms per program. Long rows with few rows (decode at long context) are split into
segments: each selects its own top-K composites (a sorted run of KP), then the row's top-K are
placed by ranks over the runs (``rank_runs_kernel``, below; or, past ``rank_runs`` runs, a
second launch of the select over the ``segments x KP`` candidates).

Few short rows (decode at short context: at most ``split_rows`` rows of at most
``split_run_max`` x ``rank_runs`` keys) take the split path, which spreads each row over many
programs: ``sort_runs_kernel`` sorts runs of composites (R x runs programs; a run is the least
power of two >= ``split_run`` that gives at most ``split_runs`` runs, capped at
``split_run_max``), then ``rank_runs_kernel`` places each composite by the count of composites
ahead of it in every run of its row that holds keys (binary searches, independent across runs;
earlier runs win ties) and writes those placed before K: a one-round merge. Its cost grows with
runs x runs per row: in the 64-decode step (contexts 2k-6k, 16 runs of 512 then) the ranks took
46 us a layer and the run sorts 15 (``bench/step_gpu.py --trace``), hence no search of runs
past a row's end; with that, 16 runs of 512 beat 8 runs of up to 1024 (whose sorts cost more):
the 64-decode 2k-6k select 45.8 against 52.3 us, equal at 64 x 4k (28.3 / 28.4). H200,
replayed from a CUDA graph: the 64 x 4k select 27.9 us against 70.6 us with one program per
row; the 8 x 128k select 119.7 us with ranks against 176.5 us with a second select launch.
The split path writes its own pads (``sort_runs_kernel``), so its outputs need no fill.

The filter path (``long_filter``, the default, for long rows and, with ``filter_short_rows``,
a prefill's rows too): the segment path above costs one item's latency (sample sort, scan,
bisection, ordering of K) however short the segment, and one heavy program per row. The filter
path spreads each step over many light programs: ``filter_threshold_kernel`` (one program a
row: ``filter_sample`` keys, the threshold at the sample rank m + ``filter_margin`` x sqrt(m);
rows of at most min(slots, 2K) keys take every key), ``filter_count_kernel`` (per
``filter_chunk`` keys, the keys at or above the threshold and the live keys), then
``filter_scatter_kernel`` (from the row's counts: whether the threshold holds the top K, i.e.
at least min(K, live keys) and at most the row's slots, ``filter_slots``; if so the chunk's
composites go after the earlier chunks', in position order), ``filter_trim_kernel`` (more
than ``trim_rows`` rows: a row's exact top K kept in place, by bisection on int32 keys), then
the split path's run sorts (in place) and ranks with composites in; a trimmed row holds at
most K composites, so only the runs that can hold them are launched. Counting and gathering
programs take ``filter_group`` chunks each where rows are many: a causal prefill chunk's rows
end early in its launch width, and programs past a row's end return at once. Rows whose
threshold missed get no candidates and are selected by the segment path, which skips the
others (``HAS_SKIP``: a program reads its rows' flags first, so the launch costs about 2 us
when every row was selected); ``sort_runs_kernel`` has written every row's pads. The
threshold and the trim find a rank's key by bisection (``_kth_largest``: no sort of the
sample; a row with at most half its slots filled bisects over half of them, at most 3/8 over
3/8). The ranks do not search a composite's own run (its index there is its count). H200, T
4096 x N 32768 (``bench/indexer.py --quick --only prefill --profile``): select 1.16 ms
against 2.15 by segments (gathering 266 us, ranks 243, run sorts 207, trim 199, counting
130, threshold 88) and 1.29 ms a session earlier (gathering in 2 warps 365, ranks searching
every run 262, all slots' runs launched: sorts 230); whole indexer (logits + select) 3.35
ms; without the trim 1.60 ms (ranks 640, sorts 346, before the changes above); one gathering
pass with atomic reservations instead of counting first cost 850 us; ``torch.sort`` of the
slots 5.5 ms. Runs of 1024 composites (two a trimmed row) cost more than four of 512: sorts
342-475 us, ranks 148. The 32k-prompt step (``bench/step_gpu.py``), a layer's indexer: 19.0
ms (logits 9.3-10.4 of it, the clock falling as the step runs). Decode, replayed: 8 x 128k
select 47 us (97 by segments).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from . import indexer_logits_jit as ljit
from . import indexer_select_jit as sjit
from . import pack
from ..reference.formats import INDEXER_K_BYTES, NO_KEY
from ..reference.indexer import topk_out

LOGITS_BUDGET_BYTES = 1 << 29  # int32 keys of a prefill chunk: 4096 queries x 32k keys
_DOT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@dataclasses.dataclass(frozen=True)
class IndexerTiles:
    """Launch parameters (the bench's ``--sweep`` varies them; results do not depend on them)."""

    block_q: int = 2  # prefill queries per logits program (N = block_q * padded heads)
    block_k: int = 64  # prefill keys per product (M)
    logits_warps: int = 4
    logits_stages: int = 3
    logits_maxnreg: int = 128  # prefill logits: registers per thread capped (0: no cap); 4
    # warps at 128: four programs per SM. H200, T 4096 x N 32768: 2.20 ms against 2.23-2.25
    # for 128-key tiles in 8 warps (two programs per SM)
    decode_block_k: int = 128
    few_rows: int = 16  # decode batches of at most this many rows use few_rows_block_k
    few_rows_block_k: int = 64  # (8 x 128k logits 53.5 us against 62.5 at 128; 64 rows of
    # 2k-6k or 64k-128k are slower at 64: 17.3 / 379 against 14.5 / 331)
    decode_warps: int = 4
    decode_stages: int = 3
    decode_maxnreg: int = 0  # decode logits: registers per thread capped (0: no cap)
    decode_balanced_keys: int = 16384  # decode logits over at least this many keys a row
    # (the launch's width) and decode_balanced_rows rows: the balanced launch, the batch's key
    # tiles split evenly over the programs (0: never). H200, 64 x 64k-128k: 240 us against 328
    # (shuffled table, bench/decode_logits.py); in the step 873 against 1060 us a step
    decode_balanced_rows: int = 2  # (one row of 128k: 9.6 us against 7.2 per row)
    decode_balanced_stages: int = 5  # ... its pipeline stages (5: two key tiles in flight)
    decode_balanced_programs_per_sm: int = 3  # ... its programs a SM
    decode_balanced_maxnreg: int = 168  # ... its registers a thread capped: 3 programs of 4
    # warps fit a SM (uncapped: 175 registers, 2 programs; sm_90 at 168: no spill)
    select_block: int = 8192  # keys per select step (< 2**16; 8192: 2.15 ms against 2.23 at 4096)
    select_warps: int = 16
    select_sample: int = 1024  # keys sampled per row for the threshold (power of two)
    select_margin: float = 5.0  # sample ranks past the expected one, in standard deviations
    select_cap: int = 4096  # candidates gathered per row (a power of two; all ordered unless
    # select_exact keeps the top K of them first)
    select_attempts: int = 3  # gathering passes before the radix fallback; 0: radix only
    select_programs_per_sm: int = 4  # persistent select programs per SM
    radix_bits: int = 11  # fallback histogram bins 2**radix_bits; ceil(32 / bits) passes
    programs_per_sm: int = 1  # long-row select: about this many (row, segment) items per SM
    # (64 rows of 64k-128k: 204 us at 1 against 287 at 4, fewer runs to rank; 8 x 128k equal)
    decode_programs_per_sm: int = 4  # decode logits: programs per SM
    whole_waves: bool = True  # decode logits: at most decode_programs_per_sm x SMs programs (splits
    # rounded down), not one wave and a sliver (rounded up)
    decode_fp8: bool = True  # decode logits on fp8 tensor cores (CUDA; else fp8 values in bf16)
    sort_segments: int = 8  # candidates ordered by one sort (1) or a merge sort from segments
    select_exact: bool = True  # keep the exact top K of the candidates, then order only those
    exact_segments: int = 4  # ... by a merge sort from this many segments (1: one sort)
    split_rows: int = 512  # split path: at most this many rows of <= split_run_max * rank_runs
    split_run: int = 512  # keys; a run is the least power of two >= split_run that gives at
    split_run_max: int = 512  # most split_runs runs a row, capped at split_run_max
    split_runs: int = 16
    rank_runs: int = 16  # most runs merged by ranks (split path; long rows' second stage)
    rank_chunk: int = 256  # composites placed per rank program
    rank_warps: int = 4
    split_warps: int = 4  # sort_runs programs
    long_filter: bool = True  # the filter path first for rows longer than one select item
    # (the split path's rows excepted): keys above a sampled row threshold gathered by many
    # programs, then ordered as split-path runs; the segment path selects only the rows whose
    # threshold missed. H200, graph: select 8 x 128k 45.4 us against 96.7 by segments
    filter_short_rows: bool = True  # ... and rows one select item handles (a prefill's). H200:
    # T 4096 x N 32768 select 1.16 ms against 2.15 by segments (bench/RESULTS.md, 2026-12-01
    # ninth session)
    filter_chunk: int = 1024  # keys per gathering program (T 4096 x N 32768: 372 us
    # against 394 at 2048 and 610 at 4096)
    filter_group: int = 4  # chunks a counting / gathering program at most (fewer programs
    # past a causal row's end). H200, 32k step: counting 2.48 ms a step against 3.57 at 1;
    # T 4096 x N 32768 (full rows) unchanged
    filter_group_programs: int = 16  # ... while that leaves at least this many programs a SM
    filter_rank_chunk: int = 512  # composites placed per rank program of the filter path
    # (T 4096 x N 32768: ranks 281 against 317 us at 256)
    filter_cap: int = 0  # candidate slots per row (a power of two >= topk; runs of
    # split_run, at most rank_runs of them); 0: from the widest row (``filter_slots``)
    filter_warps: int = 8  # the threshold program of a row (sorts the sample)
    filter_bisect: bool = True  # ... finds the sample's key at the threshold rank by
    # bisection instead of sorting the sample (the same key). H200, T 4096 x N 32768: 88
    # against 167 us
    filter_scatter_warps: int = 1  # gathering programs (1024-key chunks, T 4096 x N 32768:
    # 266 us against 365 in 2 warps, 372 in 4 and 473 in 8)
    filter_sort_warps: int = 4  # run sorts of the filter path (T 4096 x N 32768: select
    # 1337 us against 1362 in 2 warps and 1355 in 8)
    filter_trim: bool = True  # rows with more than topk candidates keep their exact top K
    # before the run sorts and ranks (fewer runs to sort and search), for more than
    # trim_rows rows. H200, T 4096 x N 32768: select 1.34 ms against 1.60 untrimmed (ranks
    # 281 against 640 us); 8 x 128k (graph) 55.1 against 47.6 us, so few rows are not trimmed
    trim_rows: int = 16
    trim_warps: int = 8  # (T 4096 x N 32768: trim 205 us against 301 in 16 warps)
    trim_halved: bool = True  # rows of at most half the slots trimmed over half of them
    # (T 4096 x N 32768: trim 205 against 261 us)
    trim_three_quarters: bool = True  # ... and rows of at most 3/8 of them over 3/8 (T
    # 4096 x N 32768: trim 200 against 205 us; continuous scores 186 against 189)
    bisect_exit: bool = False  # the threshold's and the trim's bisections stop at a point
    # with exactly the rank's count at or above it (fires on continuous scores only). T 4096
    # x N 32768: trim 266 against 205 us on the bench's tied integer scores, 198.8 against
    # 189.2 on continuous ones; the 32k step 20.26 ms a layer against 20.07 / 19.97
    filter_budget_bytes: int = 1 << 28  # candidate slots of one launch (rows in batches)
    filter_fused_count: bool = False  # the threshold program counts its row too (no counting
    # launch). H200, T 4096 x N 32768, with the sorted-sample threshold: select 1531.6 against
    # 1531.0 us (threshold 301 against 167 + counting 130)
    filter_sample: int = 1024  # keys sampled per row for its threshold, taken at the sample
    filter_margin: float = 4.0  # rank m + margin * sqrt(m): at 128k keys and topk 2048 about
    # 4100 candidates expected (m 16), inside the cap and above topk. H200, graph: select 8 x
    # 128k 45.4 us against 54.8 with 2048 samples, 64 x 64k-128k 100.1 / 110.7


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _logits(q, weights, k, out, mode, out_keys, L, *, bk, warps, stages, splits=1, rows=None,
            lens=None, bt=None, B=1, maxnreg=0):
    """Byte-row logits, one query per program: MODE 0 over explicit packed rows (float32
    scores), MODE 2 over the block-planar paged cache through the block table (int32 keys;
    B tokens a block). q float8_e4m3fn: fp8 products; else q's dtype holding the fp8 query's
    values."""
    T, HI, _ = q.shape
    dummy = out
    rows_, lens_, bt_ = (x if x is not None else dummy for x in (rows, lens, bt))
    per_split = triton.cdiv(triton.cdiv(L, splits), bk) * bk
    grid = (triton.cdiv(L, per_split), T)
    ljit.logits_kernel[grid](
        q, weights, k, out, rows_, lens_, bt_,
        q.stride(0), q.stride(1), weights.stride(0), out.stride(0),
        rows.stride(0) if rows is not None else 0, bt.stride(0) if bt is not None else 0,
        T, HI, L, per_split, MODE=mode, OUT_KEYS=out_keys, BQ=1,
        HP=max(16, triton.next_power_of_2(HI)), BK=bk, BLOCK=B if mode == 2 else 1,
        DOT_DTYPE=tl.float8e4nv if q.dtype == torch.float8_e4m3fn else _DOT[q.dtype],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps,
        num_stages=stages, **({"maxnreg": maxnreg} if maxnreg and q.is_cuda else {}))


def _logits_balanced(q, weights, k, out, lens, bt, *, bk, tiles, B):
    """MODE 2's int32 keys from ``ljit.logits_balanced_kernel``: the rows' BK-key tiles laid end
    to end (prefix sums by ``tile_offsets_kernel``, on the device) and split evenly over
    ``decode_balanced_programs_per_sm`` x SMs programs, so a batch of mixed lengths leaves no
    second wave of long programs (bench/decode_logits.py)."""
    T, HI, _ = q.shape
    cum = torch.empty(T + 1, dtype=torch.int32, device=q.device)
    ljit.tile_offsets_kernel[(1,)](lens, cum, T, BK=bk, CHUNK=1024, num_warps=4)
    programs = tiles.decode_balanced_programs_per_sm * _num_sms(q.device)
    ljit.logits_balanced_kernel[(programs,)](
        q, weights, k, out, lens, bt, cum, q.stride(0), q.stride(1), weights.stride(0),
        out.stride(0), bt.stride(0), T, HI, HP=max(16, triton.next_power_of_2(HI)), BK=bk,
        DOT_DTYPE=tl.float8e4nv if q.dtype == torch.float8_e4m3fn else _DOT[q.dtype],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", BLOCK=B,
        num_warps=tiles.decode_warps, num_stages=tiles.decode_balanced_stages,
        **({"maxnreg": tiles.decode_balanced_maxnreg}
           if tiles.decode_balanced_maxnreg and q.is_cuda else {}))


def decode_balanced(T: int, L: int, tiles: IndexerTiles) -> bool:
    """Whether the decode logits of T rows over a width of L keys take the balanced launch."""
    return bool(tiles.decode_balanced_keys) and L >= tiles.decode_balanced_keys \
        and T >= tiles.decode_balanced_rows


def decode_block_k(T: int, tiles: IndexerTiles) -> int:
    """Keys per product of the decode logits for T rows."""
    return tiles.few_rows_block_k if T <= tiles.few_rows else tiles.decode_block_k


def decode_splits(T: int, L: int, tiles: IndexerTiles, sms: int) -> int:
    """Programs per decode row of the logits launch: about ``decode_programs_per_sm`` x SMs in all,
    rounded down (``whole_waves``: 64 rows x 8 = 512 programs fill the 528 slots of 132 SMs
    once, where rounding up gave 64 x 9 = 576, a second wave of 48) or up; at most one per
    key block."""
    slots = tiles.decode_programs_per_sm * sms
    per_row = max(1, slots // T) if tiles.whole_waves else triton.cdiv(slots, T)
    return max(1, min(triton.cdiv(L, decode_block_k(T, tiles)), per_row))


def split_planes(k_packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed indexer keys ``[R, 132]`` uint8 -> (fp8 values ``[R, 128]`` float8_e4m3fn, scales
    ``[R]`` float32): the planar layout of the fp8 logits kernel (two copies, 264 B per key)."""
    vals = k_packed[:, :128].contiguous().view(torch.float8_e4m3fn)
    return vals, k_packed[:, 128:].contiguous().view(torch.float32).reshape(-1)


def _logits_planar(q, weights, kp, ks, out, L, lens, pcu, PT, W, I, *, bq, bk, warps, stages,
                   dot=None, maxnreg=0):
    """Prefill int32 keys ``out [T, L]`` from the planes; q float8_e4m3fn (fp8 products) or,
    with ``dot`` fp16 / fp32 (the interpreter), any float q holding fp8 values. maxnreg: a
    register cap per thread (0: the compiler's choice)."""
    T, HI, _ = q.shape
    dot = dot or (tl.float8e4nv if q.dtype == torch.float8_e4m3fn else _DOT[q.dtype])
    if q.numel() == 0:
        return
    grid = (1, triton.cdiv(T, bq))
    hp = max(16, triton.next_power_of_2(HI))  # the cap fits tiles of <= 128 query-head columns
    ljit.logits_planar_kernel[grid](
        q, weights, kp, ks, out, lens, pcu, q.stride(0), q.stride(1), weights.stride(0),
        out.stride(0), T, HI, L, PT, triton.cdiv(L, bk) * bk, W=W, I=I, BQ=bq,
        HP=hp, BK=bk, DOT_DTYPE=dot,
        PRECISION="ieee" if dot == tl.float32 else "tf32", num_warps=warps, num_stages=stages,
        **({"maxnreg": maxnreg} if maxnreg and q.is_cuda and bq * hp <= 128 else {}))


def _select(keys, lens, topk, top_s, top_i, tiles, *, decode_ids=False, W=1, I=1, rank=0):
    """Exact top-k of each row of int32 keys ``[R, L]`` (row r: its first lens[r] columns)
    into ``top_s`` / ``top_i``, every slot written (pads -inf / NO_KEY): the outputs need no
    fill. The split and filter paths write the pads in their run sorts; the others, whose
    ranks write only the live slots, have the outputs filled first."""
    R, L = keys.shape
    kp = triton.next_power_of_2(topk)
    ids = {"RANK": rank, "W": W, "I": I, "DECODE_IDS": decode_ids}
    split = _split_shape(R, L, tiles)
    if split:  # few short rows: split path
        run, runs = split
        sorted_runs = torch.empty(R, runs * run, dtype=torch.int64, device=keys.device)
        sjit.sort_runs_kernel[(R, runs)](keys, lens, sorted_runs, top_s, top_i, keys.stride(0),
                                         sorted_runs.stride(0), top_s.stride(0), L, topk,
                                         HAS_LEN=True, SEG=run, COMPOSITE_IN=False,
                                         num_warps=tiles.split_warps)
        _rank_launch(sorted_runs, top_s, top_i, topk, run, runs, tiles, ids, lens=lens, n=L)
        return
    sms = _num_sms(keys.device)
    segs = max(1, min(triton.cdiv(tiles.programs_per_sm * sms, R), L // (4 * kp)))
    seg_len = triton.cdiv(triton.cdiv(L, segs), tiles.select_block) * tiles.select_block
    segs = triton.cdiv(L, seg_len)
    common = {**ids, "KP": kp,
              "CAP": triton.next_power_of_2(max(tiles.select_cap, kp)),
              "S": triton.next_power_of_2(max(tiles.select_sample, 16)),
              "ATTEMPTS": tiles.select_attempts if tiles.select_sample else 0,
              "BLOCK": min(tiles.select_block, 1 << 15), "BITS": tiles.radix_bits,
              "num_warps": tiles.select_warps}
    cap = common["CAP"]
    segs_sort = min(triton.next_power_of_2(max(tiles.sort_segments, 1)), cap // 16)
    segs_k = min(triton.next_power_of_2(max(tiles.exact_segments, 1)), max(1, kp // 16))
    common.update(SORT_SEGS=segs_sort, LOG_SEG=(cap // segs_sort).bit_length() - 1,
                  LOG_SEGS=segs_sort.bit_length() - 1, EXACT=tiles.select_exact and kp < cap,
                  SORT_SEGS_K=segs_k, LOG_SEG_K=(kp // segs_k).bit_length() - 1,
                  LOG_SEGS_K=segs_k.bit_length() - 1)
    runs = triton.next_power_of_2(segs)
    skip = None
    if (segs > 1 or tiles.filter_short_rows) and tiles.long_filter and runs <= tiles.rank_runs:
        # the filter path selects the rows it can (and writes every row's pads); the segment
        # path below only the others
        skip = _filter_launch(keys, lens, topk, top_s, top_i, tiles, ids)
    if skip is None:
        top_s.fill_(float("-inf"))
        top_i.fill_(NO_KEY)
    if segs == 1:
        _select_launch(keys, lens, keys, top_s, top_i, L, L, 1, topk, tiles, sms, True, False,
                       common, skip=skip)
        return
    # long rows: each segment's sorted top-K composites (a run of KP), then the row's top-K of
    # the runs: by ranks (runs padded to a power of two) or a second select over them
    cand = torch.full((R, runs * kp), sjit.NO_COMPOSITE, dtype=torch.int64, device=keys.device)
    _select_launch(keys, lens, cand, top_s, top_i, L, seg_len, segs, topk, tiles, sms, True, False,
                   common, final=False, skip=skip)
    if runs <= tiles.rank_runs:
        # a row's runs past its end (segments of no key) are not searched
        _rank_launch(cand, top_s, top_i, topk, kp, runs, tiles, ids, skip=skip, lens=lens, n=L,
                     run_keys=seg_len)
        return
    n = segs * kp
    _select_launch(cand, lens, cand, top_s, top_i, n, n, 1, topk, tiles, sms, False, True, common)


def _split_shape(R: int, L: int, tiles: IndexerTiles) -> tuple[int, int] | None:
    """(run, runs) of the split path for R rows of L keys, or None where it does not apply."""
    run = max(triton.next_power_of_2(tiles.split_run),
              min(triton.next_power_of_2(triton.cdiv(L, max(1, tiles.split_runs))),
                  triton.next_power_of_2(tiles.split_run_max)))
    runs = triton.next_power_of_2(triton.cdiv(L, run))
    return (run, runs) if R <= tiles.split_rows and runs <= tiles.rank_runs else None


def _rank_launch(sorted_runs, top_s, top_i, topk, run, runs, tiles, ids, *, lens=None, n=0,
                 skip=None, run_keys=None, chunk=0):
    """Top-k of each row's ``runs`` sorted runs of ``run`` composites, placed by ranks; with
    ``lens``, runs past a row's first min(lens[r], n) keys are pads, not searched; rows whose
    ``skip`` flag is set are left alone. ``chunk``: composites a program (0: rank_chunk)."""
    chunk = min(run, triton.next_power_of_2(chunk or tiles.rank_chunk))
    grid = (sorted_runs.shape[0], runs, run // chunk)
    sjit.rank_runs_kernel[grid](sorted_runs, lens if lens is not None else sorted_runs,
                                skip if skip is not None else sorted_runs, top_s, top_i,
                                sorted_runs.stride(0), top_s.stride(0), n, runs,
                                run if run_keys is None else run_keys, topk,
                                HAS_LEN=lens is not None, SEG=run, LOG_SEG=run.bit_length() - 1,
                                RUNS=triton.next_power_of_2(tiles.rank_runs), CHUNK=chunk,
                                HAS_SKIP=skip is not None, num_warps=tiles.rank_warps, **ids)


def _select_launch(src, lens, dst, top_s, top_i, n, seg_len, segs, topk, tiles, sms, has_len,
                   composite, common, *, final=True, skip=None):
    items = src.shape[0] * segs
    # after the filter path (skip flags) most programs read their flags and end: one wave
    # (a 16-warp program fills a SM's registers: no fewer programs at a time either way)
    progs = max(1, min(items, (1 if skip is not None else tiles.select_programs_per_sm) * sms))
    buf = torch.empty(progs, common["CAP"] + common["KP"], dtype=torch.int64, device=src.device)
    sjit.select_kernel[(progs,)](src, lens, skip if skip is not None else lens, buf, dst, top_s,
                                top_i, src.stride(0), dst.stride(0), top_s.stride(0), n, seg_len,
                                segs, items, topk, common["RANK"], float(tiles.select_margin),
                                HAS_LEN=has_len, HAS_SKIP=skip is not None,
                                COMPOSITE_IN=composite, FINAL=final,
                                **{k: v for k, v in common.items() if k != "RANK"})


def filter_slots(L: int, topk: int, tiles: IndexerTiles) -> int:
    """Candidate slots per row of the filter path: ``filter_cap``, or (0) the least power of
    two >= 1.5 x the candidates a row of L keys is expected to pass, topk + margin x
    sqrt(topk x L / S) + L / S for S samples (the threshold's sample rank m + margin x sqrt(m),
    m = topk x S / L; shorter rows pass fewer): 8192 slots at L 32k (3104 expected) and at
    128k (4224); with 1.25 x (4096 at 32k) the rows that overflowed cost the segment path 129
    us at T 4096 x N 32768, against 22 (H200)."""
    if tiles.filter_cap:
        return triton.next_power_of_2(max(tiles.filter_cap, topk))
    S = triton.next_power_of_2(max(tiles.filter_sample, 16))
    want = topk + tiles.filter_margin * math.sqrt(topk * L / S) + L / S
    return triton.next_power_of_2(max(topk, int(1.5 * want)))


def _filter_launch(keys, lens, topk, top_s, top_i, tiles, ids) -> torch.Tensor:
    """The filter path: every row's keys at or above a sampled threshold (one program a row),
    counted by ``filter_chunk``-key chunks, then gathered in position order into the row's
    candidate slots (``filter_slots``; ``filter_scatter_kernel``), then sorted in place as runs
    and placed by ranks as the split path does; all output pads written. Rows go in batches
    whose slots fit ``filter_budget_bytes``. A row whose threshold missed (fewer than min(K,
    live keys) or more than the slots above it) gets no candidates. Returns the rows' ok flags ``[R]`` int32, the skip flags of the segment path
    that then selects the other rows; None (nothing launched) where the candidates would make
    more runs than ``rank_runs``."""
    R, L = keys.shape
    ch = triton.next_power_of_2(tiles.filter_chunk)
    C = triton.cdiv(L, ch)
    cap = filter_slots(L, topk, tiles)
    run = min(triton.next_power_of_2(tiles.split_run), cap)
    if cap // run > tiles.rank_runs:
        return None
    dev = keys.device
    # rows in batches whose candidate slots fit filter_budget_bytes (a chunk of short prefill
    # rows would otherwise take twice its logits' bytes: 32768 rows x 4096 slots x 8 B)
    batch = min(R, max(1, tiles.filter_budget_bytes // (8 * cap)))
    ok = torch.empty(R, dtype=torch.int32, device=dev)
    thr = torch.empty(batch, dtype=torch.int32, device=dev)
    cnt_buf = torch.empty(2 * batch * C, dtype=torch.int32, device=dev)
    cand = torch.empty(batch, cap, dtype=torch.int64, device=dev)
    cand_len = torch.empty(batch, dtype=torch.int32, device=dev)
    trim = tiles.filter_trim and R > tiles.trim_rows
    # a trimmed row holds at most topk candidates: the run sorts and ranks launch only the
    # runs that can hold them, not the slots' (8192 slots at L 32k: 4 runs of 512, not 16)
    runs = min(cap // run, triton.cdiv(topk, run)) if trim else cap // run
    sms = _num_sms(dev)
    for r0 in range(0, R, batch):
        n = min(R, r0 + batch) - r0
        # chunks a counting / gathering program: filter_group where that leaves at least
        # filter_group_programs a SM (a prefill's rows), else 1 (a few long decode rows);
        # two values at most, so two compiles of each kernel
        g = tiles.filter_group
        if g < 1 or n * C < g * tiles.filter_group_programs * sms:
            g = 1
        cg = triton.cdiv(C, g)
        k, ln, s, i = keys[r0:r0 + n], lens[r0:r0 + n], top_s[r0:r0 + n], top_i[r0:r0 + n]
        cnt = cnt_buf[:2 * n * C].view(2, n, C)
        sjit.filter_threshold_kernel[(n,)](k, ln, thr, cnt, k.stride(0), L, topk,
                                           float(tiles.filter_margin), C, CAP=cap,
                                           S=triton.next_power_of_2(max(tiles.filter_sample, 16)),
                                           COUNT=tiles.filter_fused_count, CH=ch,
                                           BISECT=tiles.filter_bisect,
                                           EXIT=tiles.bisect_exit,
                                           num_warps=tiles.filter_warps)
        if not tiles.filter_fused_count:
            sjit.filter_count_kernel[(n, cg)](k, ln, thr, cnt, k.stride(0), L, C, CH=ch, G=g,
                                              num_warps=tiles.split_warps)
        sjit.filter_scatter_kernel[(n, cg)](k, ln, thr, cnt, cand, cand_len, ok[r0:r0 + n],
                                            k.stride(0), cand.stride(0), L, topk, C, CAP=cap,
                                            CH=ch, CB=triton.next_power_of_2(C), G=g,
                                            num_warps=tiles.filter_scatter_warps)
        if trim:
            sjit.filter_trim_kernel[(n,)](cand, cand_len, cand.stride(0), topk, CAP=cap,
                                          BLK=min(cap, 1024), HALF=tiles.trim_halved,
                                          EXIT=tiles.bisect_exit,
                                          # (tensors of CAP / 4 and CAP / 8 slots)
                                          THREE_Q=tiles.trim_three_quarters and cap >= 64,
                                          num_warps=tiles.trim_warps)
        # in place: each run's program reads its run before it writes it back sorted
        sjit.sort_runs_kernel[(n, runs)](cand, cand_len, cand, s, i, cand.stride(0),
                                         cand.stride(0), s.stride(0), cap, topk,
                                         HAS_LEN=True, SEG=run, COMPOSITE_IN=True,
                                         num_warps=tiles.filter_sort_warps)
        _rank_launch(cand[:n], s, i, topk, run, runs, tiles, ids, lens=cand_len, n=cap,
                     chunk=tiles.filter_rank_chunk)
    return ok


def score_keys(scores: torch.Tensor) -> torch.Tensor:
    """float32 scores -> the kernels' order-preserving int32 keys (-0.0 as +0.0)."""
    bits = torch.where(scores == 0, 0.0, scores.float()).view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def select_topk(scores, lens, topk: int, *, tiles: IndexerTiles | None = None):
    """The select alone: top-k of ``scores [R, L]`` float32 over each row's first ``lens[r]``
    columns, in the reference order with ids = column positions. Returns ``(top_scores [R, topk]
    float32, top_ids [R, topk] int32)``, NO_KEY / -inf pads (for tests and the bench)."""
    R, L = scores.shape
    live = bool(R and L and topk)
    top_s, top_i = _outputs(R, topk, scores.device, fill=not live)
    if live:
        _select(score_keys(scores), lens.contiguous(), topk, top_s, top_i, tiles or IndexerTiles())
    return top_s, top_i


def _keys_buffer(rows: int, L: int, device) -> torch.Tensor:
    """int32 keys ``[rows, L]`` whose row stride is L rounded up to 16: the kernels specialise
    on that stride, so one compile serves every L (bench/jit_variants.py)."""
    return torch.empty(rows, -(-L // 16) * 16, dtype=torch.int32, device=device)[:, :L]


def _outputs(T, topk, device, *, fill=True):
    """(scores, ids) ``[T, topk]``: filled with the pads (-inf, NO_KEY), or left empty for
    ``_select``, which writes every slot."""
    if not fill:
        return (torch.empty((T, topk), dtype=torch.float32, device=device),
                torch.empty((T, topk), dtype=torch.int32, device=device))
    top_s = torch.full((T, topk), float("-inf"), dtype=torch.float32, device=device)
    top_i = torch.full((T, topk), NO_KEY, dtype=torch.int32, device=device)
    return top_s, top_i


def _query(q, weights, dtype=None):
    """The fp8 indexer query (``reference.quantize_indexer_q``; one launch): q8 as
    float8_e4m3fn or its values in ``dtype`` (default q's), and the weights times the scales."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    return pack.quantize_indexer_q(q, weights, dtype=dtype or q.dtype)


def indexer_scores(q, weights, k_packed, key_rows, *, tiles: IndexerTiles | None = None):
    """Tiled ``indexer_scores``: float32 scores ``[T, L]``, -inf where key_rows is NO_KEY."""
    tiles = tiles or IndexerTiles()
    q, weights = _query(q, weights)
    T, L = key_rows.shape
    out = torch.empty(T, L, dtype=torch.float32, device=q.device)
    if T and L:
        _logits(q, weights, k_packed, out, 0, False, L, bk=tiles.decode_block_k,
                warps=tiles.decode_warps, stages=tiles.decode_stages, rows=key_rows.contiguous())
    return out


def indexer_topk(q, weights, k_packed, key_rows, key_ids, topk: int, *,
                 tiles: IndexerTiles | None = None):
    """Tiled scores + the reference order over explicit (key_rows, key_ids).

    key_ids need not follow the rows' order, so the exact order comes from
    ``topk_reference_order`` (this source serves tests and tools, not the step).
    """
    from ..reference.indexer import topk_reference_order

    ids = torch.where(key_rows >= 0, key_ids.long(), NO_KEY)
    return topk_reference_order(indexer_scores(q, weights, k_packed, key_rows, tiles=tiles), ids,
                                topk)


def indexer_topk_prefill(q, weights, k_gathered, key_len, region_pcu, padded_local_total: int,
                         dcp_size: int, interleave: int, topk: int, *, max_keys: int | None = None,
                         logits_budget_bytes: int = LOGITS_BUDGET_BYTES,
                         tiles: IndexerTiles | None = None, out=None):
    """Tiled ``indexer_topk_prefill`` (contract in ``reference/indexer.py``); scores float32.

    max_keys: the widest key_len (from the plan; default ``max(key_len)``, which syncs).
    Queries run in chunks whose int32 keys fit ``logits_budget_bytes``.
    """
    tiles = tiles or IndexerTiles()
    T = q.shape[0]
    L = (int(key_len.max()) if T else 0) if max_keys is None else max_keys
    if out is not None:
        out = topk_out(out, T, topk, q.device)
    if T == 0 or L == 0 or topk == 0:
        if out is None:
            return _outputs(T, topk, q.device)
        out[0].fill_(float("-inf"))
        out[1].fill_(NO_KEY)
        return out
    # every row goes through _select, which writes every slot
    top_s, top_i = out if out is not None else _outputs(T, topk, q.device, fill=False)
    # fp8 products on the GPU; the interpreter multiplies the same fp8 values in q's dtype
    gpu = q.is_cuda
    q8, w8 = _query(q, weights, torch.float8_e4m3fn if gpu else None)
    kp, ks = split_planes(k_gathered)
    if not gpu:
        kp = kp.view(torch.uint8)  # the interpreter takes no fp8 tensor: bytes, cast in-kernel
    key_len, region_pcu = key_len.contiguous(), region_pcu.contiguous()
    step = max(1, logits_budget_bytes // (4 * L))
    keys = _keys_buffer(min(step, T), L, q.device)
    # the last chunk first: a causal prefill's later queries have the most keys, so the
    # longest launches are queued first and the host runs ahead of the device sooner
    for t0 in reversed(range(0, T, step)):
        t1 = min(T, t0 + step)
        _logits_planar(q8[t0:t1], w8[t0:t1], kp, ks, keys[: t1 - t0], L, key_len[t0:t1],
                       region_pcu[t0:t1], padded_local_total, dcp_size, interleave,
                       bq=tiles.block_q, bk=tiles.block_k, warps=tiles.logits_warps,
                       stages=tiles.logits_stages, maxnreg=tiles.logits_maxnreg)
        _select(keys[: t1 - t0], key_len[t0:t1], topk, top_s[t0:t1], top_i[t0:t1], tiles)
    return top_s, top_i


def indexer_topk_decode(q, weights, k_cache, local_len, block_table, block_size: int,
                        dcp_size: int, dcp_rank: int, interleave: int, topk: int, *,
                        max_keys: int | None = None, tiles: IndexerTiles | None = None):
    """Tiled ``indexer_topk_decode``: the rank's local top-k as (score, global id) candidates
    from the block-planar cache ``k_cache [num_blocks, block_size * 132]``.

    One logits launch for the whole batch (keys split over about ``decode_programs_per_sm`` x SMs
    programs) and one or two select launches; no host work per request.
    """
    tiles = tiles or IndexerTiles()
    T = q.shape[0]
    L = (int(local_len.max()) if T else 0) if max_keys is None else max_keys
    if T == 0 or L == 0 or topk == 0:
        return _outputs(T, topk, q.device)
    top_s, top_i = _outputs(T, topk, q.device, fill=False)
    q, weights = _query(q, weights, torch.float8_e4m3fn if tiles.decode_fp8 and q.is_cuda else None)
    assert k_cache.dim() == 2 and k_cache.shape[1] == block_size * INDEXER_K_BYTES, \
        (k_cache.shape, block_size)
    local_len, block_table = local_len.contiguous(), block_table.contiguous()
    keys = _keys_buffer(T, L, q.device)
    bk = decode_block_k(T, tiles)
    if decode_balanced(T, L, tiles):
        _logits_balanced(q, weights, k_cache, keys, local_len, block_table, bk=bk, tiles=tiles,
                         B=block_size)
    else:
        splits = decode_splits(T, L, tiles, _num_sms(q.device))
        _logits(q, weights, k_cache, keys, 2, True, L, bk=bk, warps=tiles.decode_warps,
                stages=tiles.decode_stages, splits=splits, lens=local_len, bt=block_table,
                B=block_size, maxnreg=tiles.decode_maxnreg)
    _select(keys, local_len, topk, top_s, top_i, tiles, decode_ids=True, W=dcp_size, I=interleave,
            rank=dcp_rank)
    return top_s, top_i
