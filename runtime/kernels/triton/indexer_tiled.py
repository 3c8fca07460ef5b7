"""The Triton indexer: logits as a matrix product over tiles of queries and keys, then an exact
top-k from a sampled threshold (no sort of every key). Entry points, arguments and results as
the reference's (``reference/indexer.py``; docs/design.md §4.3, §3.6); jitted bodies in
``indexer_logits_jit`` and ``indexer_select_jit``. Figures behind the defaults:
bench/RESULTS.md (``bench/indexer.py``, ``bench/decode_logits.py``, ``bench/step_gpu.py``).

The query is quantised first (``pack.quantize_indexer_q``: fp8 with one power-of-two scale per
head, folded into the weights), as in every backend; where the prefill's logits take the Gluon
kernel and ``IndexerTiles.ws_quantise`` is set, its CTAs quantise their queries as they load
them instead, the same bits without the launch.

Logits. Prefill (``prefill_logits``): on a Hopper GPU, for chunks at least ``ws_min_keys``
wide whose gather layout makes every 64 keys one run of rows, the warp-specialised Gluon kernel
(``..gluon.indexer_logits``: a TMA loader warpgroup, three math warpgroups of 2 queries each
multiplying every 64-key tile; the grid's last partial wave cut into parts of key tiles);
elsewhere ``logits_planar_kernel``: the gathered keys split into two planes (fp8 values
``[R, 128]`` in 128-byte rows, float32 scales ``[R]``: ``split_planes``); a program owns
``block_q`` consecutive queries and per ``block_k`` keys computes ``K @ Q^T`` on fp8 tensor
cores, each key tile read once for its queries (one TMA copy where the tile is one run of
rows, ``tma_tiles``); a block across a request boundary takes one pass per query; query
blocks run last first (a causal prefill's later queries have the most keys). Decode and
explicit rows (``logits_kernel``): the key tile is the A operand, the queries x heads the B
operand; decode reads the block-planar paged cache (reference/formats.py)
with 16-byte loads, fp8 products on CUDA, a request's keys split over programs
(``decode_splits``: at most one wave of ``decode_programs_per_sm`` x SMs); rows of at least
``decode_balanced_keys`` take the balanced launch (``logits_balanced_kernel``: the batch's key
tiles laid end to end and split evenly over one wave, whatever the rows' lengths). The
epilogues (ReLU, head weights, the sum over heads, the per-key power-of-two scale) reduce
inside the MMA layout. Scores are written as order-preserving int32 keys.

Top-k: ``indexer_select`` (the split, filter and segment paths). Every path writes every output
slot (pads -inf / NO_KEY), so outputs need no fill.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..reference.formats import INDEXER_K_BYTES, NO_KEY
from ..reference.indexer import topk_out
from . import indexer_logits_jit as ljit
from . import pack
from .indexer_select import (  # noqa: F401 (filter_slots re-exported: tests use it here)
    _num_sms,
    _outputs,
    _select,
    filter_slots,
    score_keys,
)
from .pack_jit import split_planes_kernel

LOGITS_BUDGET_BYTES = 1 << 29  # int32 keys of a prefill chunk: 4096 queries x 32k keys
_DOT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@dataclasses.dataclass(frozen=True)
class IndexerTiles:
    """Launch shapes of the indexer: tiles, warps, stages, register caps, programs per SM,
    sample sizes and row-shape thresholds (results do not depend on them, but for the logits
    kernel's choice, ``logits_ws`` / ``ws_min_keys`` / ``ws_scatter``: which of a sum's first
    two products is rounded before its fused add can differ, so can the last bit of a
    continuous score; bench/indexer.py --sweep varies them; the
    defaults' figures: bench/RESULTS.md)."""

    # prefill logits: the warp-specialised Gluon kernel on Hopper (``ws_*``), else Triton's
    logits_ws: bool = True  # the Gluon kernel where it applies (``prefill_logits``)
    ws_block_q: int = 2  # queries a math warpgroup (N = block_q * padded heads: <= 128 at
    # 3 or 4 math warpgroups, 256 at 2; wider heads take the Triton kernel)
    ws_math_warpgroups: int = 3  # each block_q queries of the CTA's, tiles of 64 keys ...
    ws_split: bool = True  # ... or (False) each 64 keys of a tile, all block_q queries
    ws_stages: int = 4  # key tiles in the ring
    ws_scatter: bool = True  # block_q 2: each quad's head sums transposed, a lane stores one
    ws_quantise: bool = False  # the prefill's query quantised in the Gluon kernel's prologue
    # (no ``quantize_indexer_q`` launch; the same fp8 values and weights, bit for bit; by the
    # loader's warpgroup alone before the partitions, or with ws_math_stage by each math
    # warpgroup: 1-2% slower at T 4096 x N 32768 on an H100, bench/RESULTS.md, thirty-sixth
    # session)
    ws_math_stage: bool = False  # with ws_split: each math warpgroup copies (and with
    # ws_quantise quantises) its own queries under the loader's first key copies; within the
    # noise at T 4096 x N 32768, with ws_quantise 2.9% faster at T 8192 x N 8192 (H100,
    # bench/query_staging.py; bench/RESULTS.md, thirty-sixth session)
    ws_unroll: bool = True  # the math warpgroups' loop a ring's stages a trip (the stages'
    # barriers and descriptors fixed at compile time: 180 instructions a thread a tile offline
    # against 189); whole indexer 1.3-3.4% faster on one H100 (bench/query_staging.py;
    # bench/RESULTS.md, thirty-seventh and thirty-eighth sessions)
    ws_thread_arrive: bool = False  # every math thread arrives on a ring stage's free
    # barrier, no barrier of the warpgroup's threads before (one named barrier a tile fewer);
    # off: the whole indexer 0.2-0.8% slower on one H100 (bench/query_staging.py;
    # bench/RESULTS.md, fortieth session)
    ws_min_keys: int = 4096  # narrower chunks take Triton's (with the quad sums scattered the
    # Gluon kernel is 5% faster at T 8192 x N 8192, and the 32k step's first chunks gain)
    block_q: int = 2  # Triton's: queries per program (N = block_q * padded heads)
    block_k: int = 64  # keys per product (M)
    logits_warps: int = 4
    logits_stages: int = 3
    logits_maxnreg: int = 128  # registers a thread capped (0: none): four 4-warp programs a SM
    # decode logits
    decode_block_k: int = 128
    few_rows: int = 16  # batches of at most this many rows use few_rows_block_k
    few_rows_block_k: int = 64
    decode_warps: int = 4
    decode_stages: int = 3
    decode_maxnreg: int = 0  # registers a thread capped (0: none)
    decode_programs_per_sm: int = 4  # the per-row launch: programs a SM, rounded down a row
    decode_balanced_keys: int = 16384  # the balanced launch for rows this wide (0: never) ...
    decode_balanced_rows: int = 2  # ... and at least this many rows
    decode_balanced_stages: int = 5  # its pipeline stages (two key tiles in flight)
    decode_balanced_programs_per_sm: int = 3
    decode_balanced_maxnreg: int = 168  # three 4-warp programs a SM without spills (sm_90)
    # the CUDA row kernel (``..cuda.row_topk``, built by nvcc on first use where one is found)
    cuda_select: bool = True  # batches of at least cuda_select_rows rows (a prefill chunk's)
    cuda_select_rows: int = 256
    cuda_select_short_keys: int = 65536  # rows at most this wide: the short rows' build ...
    cuda_select_merge: bool = True  # ... its result sorted by merges (else by the network)
    # segment path (select_kernel)
    select_block: int = 8192  # keys a scan step (< 2**16)
    select_warps: int = 16
    select_sample: int = 1024  # keys sampled a row for the threshold (power of two)
    select_margin: float = 5.0  # sample ranks past the expected one, in standard deviations
    select_cap: int = 4096  # candidates gathered a row (a power of two)
    select_attempts: int = 3  # gathering passes before the radix select; 0: radix only
    select_programs_per_sm: int = 4  # persistent programs a SM
    radix_bits: int = 11  # radix histogram bins 2**radix_bits; ceil(32 / bits) passes
    programs_per_sm: int = 1  # long rows: about this many (row, segment) items a SM
    sort_segments: int = 8  # all CAP candidates ordered (K >= CAP): merge sort from segments
    exact_segments: int = 4  # the kept top K ordered: merge sort from this many segments
    # split path, and the runs and ranks the filter path shares
    split_rows: int = 512  # at most this many rows of <= split_run_max * rank_runs keys
    split_run: int = 512  # keys; a run is the least power of two >= split_run that gives at
    split_run_max: int = 512  # most split_runs runs a row, capped at split_run_max
    split_runs: int = 16
    rank_runs: int = 16  # most runs merged by ranks
    rank_chunk: int = 256  # composites placed a rank program
    rank_warps: int = 4
    rank_row_major: bool = True  # a row's rank programs launched together (its outputs
    # written while in L2), not every row's programs of one run together
    split_warps: int = 4  # run-sort programs
    # filter path
    filter_chunk: int = 1024  # keys a counting / gathering chunk
    filter_group: int = 4  # chunks a counting / gathering program at most (fewer programs
    # past a causal row's end) ...
    filter_group_programs: int = 16  # ... while that leaves at least this many programs a SM
    filter_rank_chunk: int = 512  # composites placed a rank program
    filter_cap: int = 0  # candidate slots a row (a power of two >= topk); 0: ``filter_slots``
    filter_warps: int = 8  # the threshold program of a row
    filter_scatter_warps: int = 1  # gathering programs
    filter_sort_warps: int = 4  # run sorts
    trim_rows: int = 16  # rows' exact top K kept before the run sorts for more rows than this
    trim_warps: int = 8
    trim_radix_bits: int = 0  # the trim's K-th key: 0 bisection; b > 0 histogram passes of b
    # bits (a variant not yet timed on a GPU: bench/indexer.py "trim by radix")
    filter_budget_bytes: int = 1 << 28  # candidate slots of one launch (rows in batches)
    filter_sample: int = 1024  # keys sampled a row for its threshold, taken at the sample
    filter_margin: float = 4.0  # rank m + margin * sqrt(m), m = topk x samples / keys

    def ws_launch_options(self) -> dict:
        """The warp-specialised logits' ``launch`` keywords these tiles give (the quad sums
        scattered where a math warpgroup takes 2 queries, the only shape that allows it)."""
        return {"block_q": self.ws_block_q, "math_warpgroups": self.ws_math_warpgroups,
                "stages": self.ws_stages, "split": self.ws_split,
                "scatter": self.ws_scatter and self.ws_block_q == 2,
                "math_stage": self.ws_math_stage and self.ws_split,
                "unroll": self.ws_unroll, "thread_arrive": self.ws_thread_arrive}


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
    """Programs per decode row of the logits launch: ``decode_programs_per_sm`` x SMs in all,
    rounded down a row (one wave, not a wave and a sliver); at most one per key block."""
    per_row = max(1, tiles.decode_programs_per_sm * sms // T)
    return max(1, min(triton.cdiv(L, decode_block_k(T, tiles)), per_row))


def split_planes(k_packed: torch.Tensor, *, kernel: bool | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed indexer keys ``[R, 132]`` uint8 -> (fp8 values ``[R, 128]`` float8_e4m3fn, scales
    ``[R]`` float32): the planar layout of the fp8 logits kernel (264 B per key). kernel: one
    Triton launch (``pack_jit.split_planes_kernel``; default on CUDA, for packed rows that are
    contiguous and 4-byte aligned), else two torch copies (strided; at 32k keys on an H100,
    10.4 us of device time against the launch's 3.3, bench/RESULTS.md)."""
    R = k_packed.shape[0]
    flat = (k_packed.dim() == 2 and k_packed.shape[1] == INDEXER_K_BYTES
            and k_packed.is_contiguous() and k_packed.data_ptr() % 4 == 0)
    if (k_packed.is_cuda if kernel is None else kernel) and flat and R:
        vals = torch.empty(R, 128, dtype=torch.uint8, device=k_packed.device)
        scales = torch.empty(R, dtype=torch.float32, device=k_packed.device)
        words = R * (INDEXER_K_BYTES // 4)
        block = 2048
        split_planes_kernel[(triton.cdiv(words, block),)](
            k_packed.view(torch.int32), vals.view(torch.int32), scales.view(torch.int32), words,
            BLOCK=block, num_warps=4)
        return vals.view(torch.float8_e4m3fn), scales
    vals = k_packed[:, :128].contiguous().view(torch.float8_e4m3fn)
    return vals, k_packed[:, 128:].contiguous().view(torch.float32).reshape(-1)


def tma_tiles(W: int, I: int, bk: int) -> bool:
    """Whether the prefill logits read their key tiles by TMA copies: each tile of ``bk`` key
    positions must be one run of consecutive plane rows (one rank, or interleaves that ``bk``
    divides); other gather layouts take per-thread copies."""
    return W == 1 or I % bk == 0


def _logits_planar(q, weights, kp, ks, out, L, lens, pcu, PT, W, I, *, bq, bk, warps, stages,
                   dot=None, maxnreg=0, tma=None):
    """Prefill int32 keys ``out [T, L]`` from the planes; q float8_e4m3fn (fp8 products) or,
    with ``dot`` fp16 / fp32 (the interpreter), any float q holding fp8 values. maxnreg: a
    register cap per thread (0: the compiler's choice). tma: key tiles by TMA copies (None:
    where ``tma_tiles`` allows; False: per-thread copies, as bench/indexer.py compares)."""
    T, HI, _ = q.shape
    dot = dot or (tl.float8e4nv if q.dtype == torch.float8_e4m3fn else _DOT[q.dtype])
    if q.numel() == 0:
        return
    tma = tma_tiles(W, I, bk) if tma is None else tma
    if tma and not tma_tiles(W, I, bk):
        raise ValueError(f"TMA key tiles: got {W} ranks at interleave {I} with {bk}-key tiles; "
                         f"expected one rank or an interleave that the tile divides")
    grid = (1, triton.cdiv(T, bq))
    hp = max(16, triton.next_power_of_2(HI))  # the cap fits tiles of <= 128 query-head columns
    ljit.logits_planar_kernel[grid](
        q, weights, TensorDescriptor.from_tensor(kp, [bk, 128]) if tma else kp, ks, out, lens,
        pcu, q.stride(0), q.stride(1), weights.stride(0), out.stride(0), T, HI, L, PT,
        triton.cdiv(L, bk) * bk, W=W, I=I, BQ=bq, HP=hp, BK=bk, DOT_DTYPE=dot,
        PRECISION="ieee" if dot == tl.float32 else "tf32", TMA=tma, num_warps=warps,
        num_stages=stages,
        **({"maxnreg": maxnreg} if maxnreg and q.is_cuda and bq * hp <= 128 else {}))


@functools.cache
def _ws_device(index: int) -> bool:
    """Whether CUDA device ``index`` is a Hopper (sm_90) and this Triton has the Gluon API of
    the warp-specialised logits."""
    if torch.cuda.get_device_capability(index)[0] != 9:
        return False
    try:
        from ..gluon import indexer_logits  # noqa: F401
    except ImportError:
        return False
    return True


def ws_logits(q, W: int, I: int, L: int, tiles: IndexerTiles):
    """The warp-specialised logits' launcher module where it runs these prefill logits (a CUDA
    Hopper device, ``tiles.logits_ws``, a chunk at least ``ws_min_keys`` wide, a gather layout
    of 64-key runs), else None."""
    if not (tiles.logits_ws and L >= tiles.ws_min_keys and q.is_cuda
            and _ws_device(q.device.index or 0)):
        return None
    from ..gluon import indexer_logits

    ok = indexer_logits.supported(W, I, q.shape[1], tiles.ws_block_q, tiles.ws_math_warpgroups)
    return indexer_logits if ok else None


def prefill_logits(q8, w8, kp, ks, out, L, lens, pcu, PT, W, I, tiles: IndexerTiles,
                   quantise: bool = False):
    """Prefill int32 keys ``out [T, L]`` (``_logits_planar``'s contract) by the warp-specialised
    Gluon kernel where ``ws_logits`` allows, else by the Triton kernel. quantise: q8 and w8 are
    the unquantised query and weights, which the Gluon kernel quantises as it loads them (only
    where it runs)."""
    ws = ws_logits(q8, W, I, L, tiles)
    if ws is not None:
        ws.launch(q8, w8, kp, ks, out, lens, pcu, PT, W, I, quantise=quantise,
                  **tiles.ws_launch_options())
        return
    if quantise:
        raise ValueError(f"prefill logits, quantise: got W {W}, interleave {I}, {L} keys, "
                         f"{q8.shape[1]} heads on {q8.device}; expected a chunk the Gluon "
                         f"kernel takes (ws_logits), the only one that quantises the query")
    _logits_planar(q8, w8, kp, ks, out, L, lens, pcu, PT, W, I, bq=tiles.block_q,
                   bk=tiles.block_k, warps=tiles.logits_warps, stages=tiles.logits_stages,
                   maxnreg=tiles.logits_maxnreg)


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


def _query(q, weights, dtype=None, *, quantise: bool = True):
    """The fp8 indexer query (``reference.quantize_indexer_q``; one launch): q8 as
    float8_e4m3fn or its values in ``dtype`` (default q's), and the weights times the scales;
    quantise False: q and weights, copied only where their last stride is not 1, for a kernel
    that quantises them itself."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    return pack.quantize_indexer_q(q, weights, dtype=dtype or q.dtype) if quantise else (q, weights)


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
    # the Gluon kernel quantises each CTA's queries as it loads them, else one launch first
    in_kernel = tiles.ws_quantise and ws_logits(q, dcp_size, interleave, L, tiles) is not None
    q8, w8 = _query(q, weights, torch.float8_e4m3fn if gpu else None, quantise=not in_kernel)
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
        prefill_logits(q8[t0:t1], w8[t0:t1], kp, ks, keys[: t1 - t0], L, key_len[t0:t1],
                       region_pcu[t0:t1], padded_local_total, dcp_size, interleave, tiles,
                       quantise=in_kernel)
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
    q, weights = _query(q, weights, torch.float8_e4m3fn if q.is_cuda else None)
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
