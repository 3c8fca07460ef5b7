"""The prefill indexer's exact top-k as one CUDA kernel: a CTA (1024 threads, or 512 in the
short rows' build) a row, in shared memory (source and the algorithm: ``row_topk.cu``). Per
row a 12-bit histogram pass over its int32 keys finds the bin of the K-th key, a second pass
gathers the keys above the bin and those in it into shared memory (a warp's places taken with
one atomic), histograms of 10 more bits refine the bin (ties by the columns' bits; each level
copies its new bin alone, and a bin of at most 128 is finished by ranking each of its keys
against the others), and the K composites (score descending, column ascending, as the
reference order) are sorted: up to K 2048 by buckets (each key mapped linearly between the
result's smallest and largest, counted, scattered and ranked within its bucket; 10-35% faster
a row than the network or merges), or where a bucket holds more than 64 (ties) and for larger
K by a bitonic network (at K 2048 unrolled, its stages of stride <= 32 in registers and
shuffles), or in the short rows' build by each warp's runs of 128 by the network, then rounds
of merges along each thread's merge path.
About two reads of the row's keys (the second mostly from L2) against the Triton filter path's
threshold, counting, gathering, trim, run sorts and ranks (bench/RESULTS.md). Rows wider than
16384 keys read once: a sample of the row (one key in 16, up to 4096 keys, whole 128-byte
lines) sets a threshold expected to keep K to about 1.3 K keys, one pass gathers those at or
above it (two loads in flight a thread, the lines of the next iteration asked of L2), and the
refinement runs over them (where they are too many or too few, the two passes after it): 20%
faster at 65536 keys a row.

``indexer_select._select`` calls ``select`` for at least ``IndexerTiles.cuda_select_rows``
rows of ``topk <= MAX_TOPK`` where ``unavailable_reason`` is None, with the build
``select_defines`` picks: ``SHORT_ROWS`` (four CTAs an SM) for rows of at most
``IndexerTiles.cuda_select_short_keys`` keys, sorted by merges from runs of 128
(``SHORT_ROWS_MERGE``, unless ``IndexerTiles.cuda_select_merge`` is off); the default for
wider ones.
"""

from __future__ import annotations

import ctypes
import functools
import warnings

import torch

from . import build

MAX_TOPK = 4096  # the result's sort buffer (a power of two >= topk) ...
CAP = 8192  # ... and the K-th key's bin in shared memory (>= MAX_TOPK): 100 KB at MAX_TOPK
SOURCE = "row_topk.cu"
# variants of the kernel (compile-time), timed beside the default by bench/indexer.py
# the two passes over every row (a histogram, then the gather; the form before rows wider than
# 16384 keys took one pass from a sample's threshold; a bench variant)
TWO_PASS = ("CPPLAN_ROW_TOPK_TWO_PASS",)
# the build for short rows (``select_defines``): 512 threads a CTA, 4096 candidates, four CTAs
# an SM; its sort holds four values a thread, so up to SHORT_MAX_TOPK (bench/RESULTS.md)
SHORT_ROWS = ("CPPLAN_ROW_TOPK_BLOCK=512", "CPPLAN_ROW_TOPK_CAP=4096")
SHORT_MAX_TOPK = 2048
# the result sorted by merges instead of the bitonic network (``CPPLAN_ROW_TOPK_MERGE_SORT``);
# the short rows' build takes them from each warp's runs of 128 sorted by the network (9-15%
# faster than the network alone; merges from a thread's 4 lost on short rows: bench/RESULTS.md)
MERGE_SORT = ("CPPLAN_ROW_TOPK_MERGE_SORT",)
SHORT_ROWS_MERGE = (*SHORT_ROWS, *MERGE_SORT, "CPPLAN_ROW_TOPK_MERGE_FROM=128")
# step 3's appends by two ballots a key (the form before the warp scan; a bench variant)
BALLOT_APPEND = ("CPPLAN_ROW_TOPK_BALLOT_APPEND",)
# results of up to 2048 sorted without buckets (the form before: the network or merges alone)
NO_BUCKETS = ("CPPLAN_ROW_TOPK_NO_BUCKET_SORT",)
VARIANTS = {
    "sort in shared memory only": ("CPPLAN_ROW_TOPK_SMEM_SORT",),
    "1024 threads a CTA (the long rows' build)": (),
    "512 threads a CTA": ("CPPLAN_ROW_TOPK_BLOCK=512",),
    "512 threads a CTA, 4096 candidates, the network (the short rows' build before)": SHORT_ROWS,
    "merge sort from a thread's 2, 1024 threads": MERGE_SORT,
    "merge sort from runs of 64, 1024 threads": (*MERGE_SORT, "CPPLAN_ROW_TOPK_MERGE_FROM=64"),
    "merge sort from runs of 128, the short rows' build": SHORT_ROWS_MERGE,
    "merge sort from runs of 32, 512 threads": (*SHORT_ROWS, *MERGE_SORT,
                                                "CPPLAN_ROW_TOPK_MERGE_FROM=32"),
    "merge sort from a thread's 4, 512 threads": (*SHORT_ROWS, *MERGE_SORT),
    "ballot appends (the form before)": BALLOT_APPEND,
    "ballot appends, the short rows' build": (*SHORT_ROWS, *BALLOT_APPEND),
    "ballot appends, the short rows' build, merge sort": (*SHORT_ROWS_MERGE, *BALLOT_APPEND),
    "probe: no sort (the result unordered, not equal)": ("CPPLAN_ROW_TOPK_PROBE_NO_SORT",),
    "probe: no sort, the short rows' build (the result unordered, not equal)": (
        *SHORT_ROWS_MERGE, "CPPLAN_ROW_TOPK_PROBE_NO_SORT"),
    "two passes over the row (the form before), 1024 threads": TWO_PASS,
    "two passes over the row (the form before), the short rows' build": (*SHORT_ROWS_MERGE,
                                                                        *TWO_PASS),
    "sorts without buckets (the form before), 1024 threads": NO_BUCKETS,
    "sorts without buckets (the form before), the short rows' build": (*SHORT_ROWS_MERGE,
                                                                      *NO_BUCKETS),
    "buckets of at most 32, 1024 threads": ("CPPLAN_ROW_TOPK_BUCKET_MAX=32",),
    "buckets of at most 128, 1024 threads": ("CPPLAN_ROW_TOPK_BUCKET_MAX=128",),
    "one pass with one load in flight (the form before), 1024 threads": (
        "CPPLAN_ROW_TOPK_ONE_LOAD",),
    "one pass with one load in flight (the form before), the short rows' build": (
        *SHORT_ROWS_MERGE, "CPPLAN_ROW_TOPK_ONE_LOAD"),
    "buckets by the key's bits also across signs, 1024 threads": (
        "CPPLAN_ROW_TOPK_BUCKET_BY_KEY",),
    "buckets by the key's bits also across signs, the short rows' build": (
        *SHORT_ROWS_MERGE, "CPPLAN_ROW_TOPK_BUCKET_BY_KEY"),
    "bins of at most 64 ranked, the short rows' build": (*SHORT_ROWS_MERGE,
                                                         "CPPLAN_ROW_TOPK_RANK_MAX=64"),
    "bins of at most 256 ranked, the short rows' build": (*SHORT_ROWS_MERGE,
                                                          "CPPLAN_ROW_TOPK_RANK_MAX=256"),
    "no bin ranked (10-bit levels to the end), the short rows' build": (
        *SHORT_ROWS_MERGE, "CPPLAN_ROW_TOPK_RANK_MAX=0"),
    # the one pass's loads, prefetch and sample (bench/RESULTS.md, thirty-third session; nvcc
    # 13.0's sm_90 build spills 92 bytes with four loads a thread)
    "one pass with four loads in flight, the short rows' build": (
        *SHORT_ROWS_MERGE, "CPPLAN_ROW_TOPK_FOUR_LOADS"),
    "one pass prefetching to L2 two iterations ahead, the short rows' build": (
        *SHORT_ROWS_MERGE, "CPPLAN_ROW_TOPK_PREFETCH=2"),
    "one pass without an L2 prefetch, the short rows' build": (
        *SHORT_ROWS_MERGE, "CPPLAN_ROW_TOPK_PREFETCH=0"),
    "a sample of one key in 8, the short rows' build": (
        *SHORT_ROWS_MERGE, "CPPLAN_ROW_TOPK_SAMPLE_RATE=8"),
    "one pass as before (one key in 8 sampled, a margin of 4, no prefetch), the short rows' "
    "build": (*SHORT_ROWS_MERGE, "CPPLAN_ROW_TOPK_SAMPLE_RATE=8", "CPPLAN_ROW_TOPK_SAMPLE_SIGMAS=4",
              "CPPLAN_ROW_TOPK_PREFETCH=0"),
    "a sample's margin of 4 standard deviations (the form before), the short rows' build": (
        *SHORT_ROWS_MERGE, "CPPLAN_ROW_TOPK_SAMPLE_SIGMAS=4"),
    # (not yet timed: bench/RESULTS.md, thirty-third session)
    "the rank within a bucket from pairs of composites, the short rows' build": (
        *SHORT_ROWS_MERGE, "CPPLAN_ROW_TOPK_RANK_PAIRS"),
    "the rank within a bucket from pairs of composites, 1024 threads": (
        "CPPLAN_ROW_TOPK_RANK_PAIRS",),
}


@functools.cache
def _library(arch: str, defines: tuple[str, ...], source: str = SOURCE):
    """(ctypes library, None) or (None, the reason it cannot be had); once a process."""
    try:
        lib = build.load(build.compile_library(source, arch, defines=defines))
    except build.CudaBuildError as e:
        return None, str(e)
    lib.cpplan_row_topk.restype = ctypes.c_int
    lib.cpplan_row_topk.argtypes = [*_ARGTYPES, ctypes.c_void_p]  # and the stream
    lib.cpplan_row_topk_smem.restype = ctypes.c_size_t
    lib.cpplan_row_topk_smem.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.cpplan_row_topk_init.restype = ctypes.c_int
    lib.cpplan_row_topk_init.argtypes = [ctypes.c_size_t]
    lib.cpplan_row_topk_error.restype = ctypes.c_char_p
    lib.cpplan_row_topk_error.argtypes = [ctypes.c_int]
    if hasattr(lib, "cpplan_row_topk_cap"):  # (an earlier source, a bench baseline: CAP)
        lib.cpplan_row_topk_cap.restype = ctypes.c_int
        lib.cpplan_row_topk_cap.argtypes = []
    return lib, None


@functools.cache
def _cap(lib) -> int:
    """The candidates' buffer ``lib`` is launched with: CAP, but in a bench variant (once a
    library: ``select`` asks at every call)."""
    return lib.cpplan_row_topk_cap() if hasattr(lib, "cpplan_row_topk_cap") else CAP


@functools.cache
def _ready(index: int, defines: tuple[str, ...] = (), source: str = SOURCE):
    """The library for GPU ``index`` (built with ``defines``), its kernels allowed their shared
    memory there (once a device), or (None, reason)."""
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        return None, f"needs compute capability 8.0 or newer, got {major}.{minor}"
    lib, why = _library(f"{major}{minor}", defines, source)
    if lib is None:
        return None, why
    cap = _cap(lib)
    smem = lib.cpplan_row_topk_smem(min(MAX_TOPK, cap), cap)
    have = torch.cuda.get_device_properties(index).shared_memory_per_block_optin
    if smem > have:
        return None, f"needs {smem} bytes of shared memory a block, the GPU allows {have}"
    with torch.cuda.device(index):
        rc = lib.cpplan_row_topk_init(smem)
    if rc:
        return None, f"cudaFuncSetAttribute failed: {lib.cpplan_row_topk_error(rc).decode()}"
    return lib, None


def select_defines(L: int, topk: int, short_keys: int, merge: bool = False
                   ) -> tuple[str, ...]:
    """The build that selects rows of width ``L``: up to ``short_keys`` keys the short rows'
    (more rows in flight an SM), its result sorted by merges (``SHORT_ROWS_MERGE``) or with
    ``merge`` off by the network (``SHORT_ROWS``); else the default (1024 threads a CTA)."""
    if L > short_keys or topk > SHORT_MAX_TOPK:
        return ()
    return SHORT_ROWS_MERGE if merge else SHORT_ROWS


def unavailable_reason(device, defines: tuple[str, ...] = ()) -> str | None:
    """None where ``select`` (with ``defines``) runs on ``device``; else one line saying why
    not (no GPU, no nvcc, the build failed: then also a RuntimeWarning once, as the Triton
    select runs instead)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    lib, why = _ready(index, tuple(defines))
    if lib is None and "no nvcc" not in why:
        _warn_once(why)
    return why


@functools.cache
def _warn_once(why: str) -> None:
    warnings.warn(f"the CUDA row top-k is off, the Triton select runs instead: {why}",
                  RuntimeWarning, stacklevel=3)


def select(keys, lens, topk: int, top_s, top_i, *, decode_ids=False, W=1, I=1, rank=0,
           defines: tuple[str, ...] = (), source: str = SOURCE) -> None:
    """Exact top-k of each row of int32 keys ``[R, L]`` (row r: its first lens[r] columns)
    into ``top_s`` float32 / ``top_i`` int32 ``[R, topk]``, every slot written (pads -inf /
    NO_KEY); ids are columns, or with ``decode_ids`` a DCP rank's global token ids
    ``(c // I) * W * I + rank * I + c % I``. Call ``unavailable_reason`` first. ``defines``:
    a variant of the kernel (``VARIANTS``; the bench times them); ``source``: another file of
    the kernel (a path; the bench's baseline, e.g. an earlier commit's)."""
    _check(keys, lens, topk, top_s, top_i, CAP)
    lib, why = _ready(keys.device.index if keys.device.index is not None
                      else torch.cuda.current_device(), tuple(defines), source)
    if lib is None:
        raise RuntimeError(f"row_topk: {why}")
    cap = _cap(lib)
    if cap != CAP:  # a bench variant's
        _check(keys, lens, topk, top_s, top_i, cap)
    with torch.cuda.device(keys.device):
        rc = lib.cpplan_row_topk(*_args(keys, lens, topk, top_s, top_i, cap, decode_ids, W, I,
                                        rank),
                                 torch.cuda.current_stream(keys.device).cuda_stream)
    if rc:
        raise RuntimeError(f"row_topk: the launch failed: {lib.cpplan_row_topk_error(rc).decode()}")


def host_select(keys, lens, topk: int, top_s, top_i, *, cap: int = CAP, block: int = 64,
                decode_ids=False, W=1, I=1, rank=0, defines: tuple[str, ...] = ()) -> None:
    """``select`` with CPU tensors: the same kernel built for the host
    (``build.compile_host``: a CTA's ``block`` threads as fibers, or std::threads with
    CPPLAN_HOST_THREADS; rows in turn; a variant with ``defines``), with ``cap`` candidates; for
    the CPU tests (slow: small rows)."""
    _check(keys, lens, topk, top_s, top_i, cap)
    lib = _host_library(block, tuple(defines))
    if lib.cpplan_row_topk_host(*_args(keys, lens, topk, top_s, top_i, cap, decode_ids, W, I,
                                      rank)):
        raise RuntimeError(f"row_topk on the host: the CTA's {block} threads deadlocked at a "
                           f"barrier (defines {list(defines)}); top_s / top_i may be partly "
                           "written")


_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
             ctypes.c_int]  # the last: rows 16-byte aligned (four keys a load)


def host_paths(block: int = 64, defines: tuple[str, ...] = ()) -> tuple[int, int, int]:
    """The rows wider than the cap ``host_select`` (``block`` threads, ``defines``) took the
    one pass over since its library loaded: (every live key, a sample too small; the sample's
    threshold; falling back to the two passes)."""
    p = _host_library(block, tuple(defines)).cpplan_row_topk_host_paths()
    return p[0], p[1], p[2]


def host_sorts(block: int = 64, defines: tuple[str, ...] = ()) -> tuple[int, int]:
    """The results of at most 2048 ``host_select`` (``block`` threads, ``defines``) sorted
    since its library loaded: (by buckets; falling back from them: a bucket too full)."""
    p = _host_library(block, tuple(defines)).cpplan_row_topk_host_paths()
    return p[3], p[4]


def host_refines(block: int = 64, defines: tuple[str, ...] = ()) -> tuple[int, ...]:
    """Step 4 in ``host_select`` (``block`` threads, ``defines``) since its library loaded:
    (bins finished by ranks, levels that copied the new bin alone, levels that could not, levels
    whose digit left the bin whole)."""
    p = _host_library(block, tuple(defines)).cpplan_row_topk_host_paths()
    return tuple(p[j] for j in range(5, 9))


@functools.cache
def _host_library(block: int, defines: tuple[str, ...]):
    lib = build.load(build.compile_host(SOURCE, block, defines=defines))
    lib.cpplan_row_topk_host.restype = ctypes.c_int
    lib.cpplan_row_topk_host.argtypes = _ARGTYPES
    lib.cpplan_row_topk_host_paths.restype = ctypes.POINTER(ctypes.c_longlong)
    lib.cpplan_row_topk_host_paths.argtypes = []
    return lib


def _args(keys, lens, topk, top_s, top_i, cap, decode_ids, W, I, rank) -> tuple:
    R, L = keys.shape
    ks = 1 << (topk - 1).bit_length()
    vec4 = keys.stride(0) % 4 == 0 and keys.data_ptr() % 16 == 0
    return (keys.data_ptr(), keys.stride(0), lens.data_ptr(), R, L, topk, ks, cap,
            top_s.data_ptr(), top_i.data_ptr(), top_s.stride(0), int(decode_ids), W, I, rank,
            int(vec4))


def _check(keys, lens, topk, top_s, top_i, cap) -> None:
    R = keys.shape[0]
    if not 0 < topk <= min(MAX_TOPK, cap):
        raise ValueError(f"row_topk: topk must be in 1..{min(MAX_TOPK, cap)}, got {topk}")
    if keys.dim() != 2 or keys.dtype != torch.int32 or keys.stride(1) != 1 \
            or lens.dtype != torch.int32 or not lens.is_contiguous() or lens.shape != (R,):
        raise ValueError(f"row_topk: keys int32 [R, L] with unit column stride and lens int32 "
                         f"[R] contiguous expected, got keys {keys.dtype} stride "
                         f"{tuple(keys.stride())}, lens {lens.dtype} {tuple(lens.shape)}")
    if top_s.shape != (R, topk) or top_i.shape != (R, topk) or top_s.stride() != top_i.stride() \
            or top_s.stride(1) != 1 or top_s.dtype != torch.float32 or top_i.dtype != torch.int32:
        raise ValueError(f"row_topk: outputs float32 / int32 [{R}, {topk}] with one row stride "
                         f"expected, got {top_s.dtype} {tuple(top_s.shape)} / {top_i.dtype} "
                         f"{tuple(top_i.shape)}, strides {tuple(top_s.stride())} / "
                         f"{tuple(top_i.stride())}")
    devices = {t.device for t in (keys, lens, top_s, top_i)}
    if len(devices) != 1:
        raise ValueError(f"row_topk: tensors on one device expected, got {sorted(map(str, devices))}")
