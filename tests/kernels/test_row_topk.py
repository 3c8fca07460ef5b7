"""The CUDA row top-k (runtime/kernels/cuda/row_topk.cu) against the reference order
(``reference.topk_reference_order``: a stable sort of float64 scores), and its build.

GPU cases: ties (few distinct values), one value, signed zeros and infinities, values spread
over 60 decades, keys packed under one 12-bit prefix (the bin of the K-th key larger than the
shared-memory candidates: refined over the row), rows of no key, fewer live keys than K, odd
row strides (scalar loads), K not a power of two, K = 1 and K = MAX_TOPK, a DCP rank's decode
ids, a CUDA graph replay. On the CPU the same kernel source built for the host
(``row_topk.host_select``: a CTA's threads as fibers, small CTAs and candidate caps so
that every refinement runs on small rows, and one case in the GPU's shape), and the build's
cache and one-line errors (nvcc's where installed).
"""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest
import torch

from cpplan.runtime.kernels import reference as ref
from cpplan.runtime.kernels.cuda import build, row_topk
from cpplan.runtime.kernels.triton.indexer_select import score_keys
from tests.kernels.test_indexer_tiled import _select_scores

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
# the host build of the kernel needs a C++20 compiler ($CXX, g++ or c++)
needs_cxx = pytest.mark.skipif(not (os.environ.get("CXX") or shutil.which("g++")
                                    or shutil.which("c++")), reason="needs a C++ compiler")


def _scores(kind, R, L, g):
    """The select tests' kinds (ties, equal, signs, spread), and keys under one 12-bit prefix
    (1.0 .. 1.0 + 2**-4): more than CAP keys in the K-th key's first bin."""
    if kind == "narrow":
        return 1.0 + torch.randint(0, 1 << 19, (R, L), generator=g).float() * 2.0 ** -23
    if kind == "normal":
        return torch.randn(R, L, generator=g)
    return _select_scores(kind, R, L, g)


def _case(kind, R, L, topk, seed, *, dev="cuda", stride=None, W=1, I=1, rank=0,
          decode_ids=False, lens=None):
    g = torch.Generator().manual_seed(seed)
    scores = _scores(kind, R, L, g)
    if lens is None:
        lens = torch.randint(0, L + 1, (R,), generator=g)
        # a full row, then fewer keys than K (shared memory holds the full row's results),
        # then none, random, full
        lens[0], lens[1 % R], lens[2 % R], lens[-1] = L, max(0, topk - 1), 0, L
    else:
        lens = torch.tensor(lens)
    pos = torch.arange(L)[None, :].expand(R, L)
    ids = torch.where(pos < lens[:, None], pos, ref.NO_KEY)
    if decode_ids:
        ids = torch.where(ids >= 0, (ids // I) * W * I + rank * I + ids % I, ref.NO_KEY)
    want = ref.topk_reference_order(scores.double(), ids, topk)
    buf = torch.empty(R, stride or L, dtype=torch.int32, device=dev)
    keys = buf[:, :L]
    keys.copy_(score_keys(scores.to(dev)))
    return keys, lens.int().to(dev), want


def _run(keys, lens, topk, *, host=None, defines=(), **kw):
    """The kernel on the GPU, or with ``host`` = (CTA threads, candidate cap) on the host."""
    R = keys.shape[0]
    top_s = torch.empty(R, topk, device=keys.device)
    top_i = torch.empty(R, topk, dtype=torch.int32, device=keys.device)
    if host:
        row_topk.host_select(keys, lens, topk, top_s, top_i, block=host[0], cap=host[1],
                             defines=defines, **kw)
    else:
        row_topk.select(keys, lens, topk, top_s, top_i, **kw)
    return top_s, top_i


def _check(got, want):
    s, ids = got
    ws, wids = want
    assert torch.equal(ids.cpu(), wids.cpu().int())
    assert torch.equal(s.cpu().double(), ws.cpu().double())


KINDS = ["ties", "equal", "signs", "spread", "narrow"]
# variants of the one pass alone (rows wider than 16384 keys; test_row_topk_one_pass_variants_...),
# one define each beside the short rows' build's (their combinations are not built again)
ONE_PASS_VARIANTS = [v for v, d in row_topk.VARIANTS.items()
                     if len(d) == len(row_topk.SHORT_ROWS_MERGE) + 1 and d[-1].startswith((
                         "CPPLAN_ROW_TOPK_FOUR_LOADS", "CPPLAN_ROW_TOPK_PREFETCH",
                         "CPPLAN_ROW_TOPK_SAMPLE_RATE", "CPPLAN_ROW_TOPK_SAMPLE_SIGMAS"))]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("R,L,topk,stride", [
    (64, 40000, 2048, None), (48, 9001, 100, 9001), (16, 70000, 2048, 70001), (8, 5000, 1, None),
    (8, 20000, 4096, None), (32, 2048, 2048, None)],
    ids=["prefill", "odd-stride-k100", "wide-unaligned", "k1", "k4096", "len-eq-k"])
@pytest.mark.gpu
@needs_cuda
def test_row_topk_equals_reference(kind, R, L, topk, stride):
    assert row_topk.unavailable_reason(torch.device("cuda")) is None
    keys, lens, want = _case(kind, R, L, topk, 7, stride=stride)
    _check(_run(keys, lens, topk), want)


# On the host: small CTAs and candidate caps, so every refinement runs on small rows (the cap
# below a row's K-th bin: refined over the row; ties past the cap: one key value, its first
# columns); one case in the GPU's shape (1024 threads, cap 8192, K 2048).
HOST_SHAPES = {
    "k100-cap512": (4, 3000, 100, None, (64, 512)),
    "odd-stride-cap128": (3, 2001, 64, 2003, (64, 128)),
    "k1-one-warp": (2, 5000, 1, None, (32, 64)),
    "len-eq-k": (3, 512, 512, None, (64, 512)),
}


@needs_cxx
@pytest.mark.parametrize("one_pass", [False, True], ids=["two-passes", "one-pass"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", list(HOST_SHAPES))
def test_row_topk_on_the_host_equals_reference(kind, shape, one_pass):
    """With ``one_pass`` every row wider than the cap takes the one pass from a sample (its
    threshold kept, or too many keys at or above it, or too few: the two passes after it)."""
    R, L, topk, stride, host = HOST_SHAPES[shape]
    keys, lens, want = _case(kind, R, L, topk, 3, dev="cpu", stride=stride)
    defines = ("CPPLAN_ROW_TOPK_ONE_PASS_FROM=0",) if one_pass else ()
    _check(_run(keys, lens, topk, host=host, defines=defines), want)


@needs_cxx
@pytest.mark.parametrize("variant", ["default", *(
    v for v, d in row_topk.VARIANTS.items()
    if d and v not in ONE_PASS_VARIANTS and "CPPLAN_ROW_TOPK_RANK_PAIRS" not in d)])
def test_row_topk_on_the_host_in_the_gpu_shape(variant):
    """1024 threads, cap 8192, K 2048 (the sort's register form), and each bench variant but
    the one pass's (its rows are narrower) and the bucket rank's (normal scores:
    test_row_topk_rank_pairs_on_the_host; the no-sort probe: the same set of results,
    unordered)."""
    defines = row_topk.VARIANTS.get(variant, ())
    # full rows before rows of fewer live keys than K (pads in the sort, stale candidates of
    # the row before in shared memory), then a row of one key
    keys, lens, want = _case("ties", 5, 6000, 2048, 4, dev="cpu",
                             lens=[6000, 1000, 6000, 1500, 1])
    cap = next((int(d.split("=")[1]) for d in defines if d.startswith("CPPLAN_ROW_TOPK_CAP=")),
               row_topk.CAP)  # a variant's own cap, as row_topk.select passes it
    s, i = _run(keys, lens, 2048, host=(1024, cap), defines=defines)
    if "PROBE" in " ".join(defines):  # the same (id, score) pairs, in any order
        for r in range(i.shape[0]):
            assert sorted(zip(i[r].tolist(), s[r].tolist())) == \
                sorted(zip(want[1][r].tolist(), want[0][r].tolist()))
    else:
        _check((s, i), want)


@needs_cxx
@pytest.mark.parametrize("shape", ["gpu", "k100-cap512"])
def test_row_topk_with_os_threads_equals_reference(shape):
    """The emulation's other mode, -DCPPLAN_HOST_THREADS (a CTA's threads as std::threads the OS
    interleaves, where a missing barrier may show), on the default build, between two runs of
    the fibers' build in the same process (each library keeps its own emulation state)."""
    if shape == "gpu":
        keys, lens, want = _case("ties", 5, 6000, 2048, 4, dev="cpu",
                                 lens=[6000, 1000, 6000, 1500, 1])
        topk, host = 2048, (1024, row_topk.CAP)
    else:
        R, L, topk, _, host = HOST_SHAPES[shape]
        keys, lens, want = _case("narrow", R, L, topk, 3, dev="cpu")
    for defines in [(), ("CPPLAN_HOST_THREADS",), ()]:
        _check(_run(keys, lens, topk, host=host, defines=defines), want)


@needs_cxx
@pytest.mark.parametrize("kind,path", [("spread", 1), ("narrow", 1), ("equal", 2)])
def test_row_topk_one_pass_on_the_host(kind, path):
    """The default build in the GPU's shape (1024 threads, cap 8192, K 2048): rows wider than
    the cap and 16384 keys sampled and their keys at or above the sample's threshold gathered in one pass
    (spread; narrow: every key under one 12-bit prefix), or, more keys than the cap at or above
    it (one value), the two passes after it; narrower rows in two passes. The host build
    counts the wide rows each way took (``row_topk.host_paths``)."""
    keys, lens, want = _case(kind, 3, 17000, 2048, 5, dev="cpu", lens=[17000, 16500, 3000])
    before = row_topk.host_paths(1024)
    _check(_run(keys, lens, 2048, host=(1024, row_topk.CAP)), want)
    took = [a - b for a, b in zip(row_topk.host_paths(1024), before)]
    assert took == [0, 2 if path == 1 else 0, 2 if path == 2 else 0]


@needs_cxx
@pytest.mark.parametrize("kind", ["normal", "ties"])
@pytest.mark.parametrize("variant", ONE_PASS_VARIANTS)
def test_row_topk_one_pass_variants_on_the_host(variant, kind):
    """The one pass's bench variants (four loads a thread, prefetches, the sample's rate and
    margin) in their build (512 threads, cap 4096): rows wider than 16384 keys, the last loads
    of each past the row's end, equal to the reference; continuous scores take the one pass in
    every row (``row_topk.host_paths``)."""
    defines = row_topk.VARIANTS[variant]
    keys, lens, want = _case(kind, 3, 20000, 2048, 6, dev="cpu", lens=[20000, 17001, 18433])
    before = row_topk.host_paths(512, defines)
    _check(_run(keys, lens, 2048, host=(512, 4096), defines=defines), want)
    took = [a - b for a, b in zip(row_topk.host_paths(512, defines), before)]
    assert sum(took) == 3 and (kind != "normal" or took[1] == 3), took


@needs_cxx
@pytest.mark.parametrize("build", ["long", "short"])
@pytest.mark.parametrize("kind,bucketed", [("normal", 3), ("narrow", 3), ("spread", 2),
                                           ("ties", 0), ("equal", 0)])
def test_row_topk_sorts_on_the_host(kind, bucketed, build):
    """Step 5 in the GPU's builds (1024 threads, cap 8192; the short rows': 512, 4096, merges):
    the results of rows of 6000, 6000 and 3000 keys sorted by buckets (normal: the third's of
    both signs, by the score; narrow: under one 12-bit prefix; spread over 60 decades: the full
    rows' positive, by the key's bits) or by the network or merges (a bucket over its bound:
    ties; spread's third, of both signs); the host build counts the rows each way took
    (``row_topk.host_sorts``)."""
    block, cap, defines = (1024, row_topk.CAP, ()) if build == "long" else \
        (512, 4096, row_topk.SHORT_ROWS_MERGE)
    keys, lens, want = _case(kind, 3, 6000, 2048, 6, dev="cpu", lens=[6000, 6000, 3000])
    before = row_topk.host_sorts(block, defines)
    _check(_run(keys, lens, 2048, host=(block, cap), defines=defines), want)
    took = [a - b for a, b in zip(row_topk.host_sorts(block, defines), before)]
    assert took == [bucketed, 3 - bucketed]


@needs_cxx
@pytest.mark.parametrize("build", ["long", "short"])
@pytest.mark.parametrize("topk", [2048, 1])
def test_row_topk_rank_pairs_on_the_host(build, topk):
    """The bench variant that ranks a composite within its bucket from pairs of composites
    (16-byte loads from the boundary at or below the bucket's first): rows of normal scores
    sorted by buckets, equal to the reference; at K 1 the buckets' buffer lies one composite
    off a 16-byte boundary."""
    block, cap, defines = (1024, row_topk.CAP, ()) if build == "long" else \
        (512, 4096, row_topk.SHORT_ROWS_MERGE)
    defines = (*defines, "CPPLAN_ROW_TOPK_RANK_PAIRS")
    keys, lens, want = _case("normal", 3, 6000, topk, 6, dev="cpu", lens=[6000, 5999, 3000])
    before = row_topk.host_sorts(block, defines)
    _check(_run(keys, lens, topk, host=(block, cap), defines=defines), want)
    took = [a - b for a, b in zip(row_topk.host_sorts(block, defines), before)]
    assert took == [3, 0]


def _two_ties(L: int, g) -> torch.Tensor:
    """A row's scores for step 4's paths at K 2048: 100 distinct large scores, 2000 copies of A
    and 1000 of B (A > B; the same 12-bit prefix, different next 10 bits), the rest below, all
    at shuffled columns. The K-th key is an A: its 12-bit bin holds 3000 candidates, of which
    the next level's bin keeps 2000 (in the short rows' build, 3000 + 2000 more than the 4096
    places: no copy); the key's last bits leave it whole; the columns' bits split it."""
    a, b = 1.0 + 2.0 ** -4, 1.0 + 2.0 ** -5
    s = torch.cat([100.0 + torch.arange(100.0), torch.full((2000,), a), torch.full((1000,), b),
                   torch.rand(L - 3100, generator=g) * 0.5])
    return s[torch.randperm(L, generator=g)]


@needs_cxx
@pytest.mark.parametrize("build", ["long", "short"])
def test_row_topk_refinement_on_the_host(build):
    """Step 4 in the GPU's builds (row_topk.host_refines): each level copies its new bin alone
    to free candidates' places (in the short rows' build the first cannot: the bin refined
    among the others), a level whose digit keeps the whole bin (the tied key's last bits), and
    a small bin finished by ranks; the rows of 6000 keys, two-tie ones and normal ones."""
    block, cap, defines = (1024, row_topk.CAP, ()) if build == "long" else \
        (512, 4096, row_topk.SHORT_ROWS_MERGE)
    g = torch.Generator().manual_seed(8)
    L, topk = 6000, 2048
    scores = torch.stack([_two_ties(L, g), _two_ties(L, g), torch.randn(L, generator=g)])
    lens = torch.full((3,), L)
    ids = torch.arange(L)[None, :].expand(3, L)
    want = ref.topk_reference_order(scores.double(), ids, topk)
    keys = score_keys(scores).contiguous()
    before = row_topk.host_refines(block, defines)
    _check(_run(keys, lens.int(), topk, host=(block, cap), defines=defines), want)
    ranked, copied, not_copied, whole = (a - b for a, b in
                                          zip(row_topk.host_refines(block, defines), before))
    assert ranked >= 1 and copied >= 2 and whole == 2  # (the two-tie rows' A: one level each)
    assert not_copied == (2 if build == "short" else 0)


@needs_cxx
def test_row_topk_on_the_host_decode_ids():
    kw = {"decode_ids": True, "W": 4, "I": 64, "rank": 3}
    keys, lens, want = _case("spread", 3, 3000, 200, 2, dev="cpu", **kw)
    _check(_run(keys, lens, 200, host=(64, 512), **kw), want)


@pytest.mark.gpu
@needs_cuda
def test_row_topk_decode_ids_and_graph():
    keys, lens, want = _case("ties", 40, 12000, 2048, 3, W=2, I=64, rank=1, decode_ids=True)
    kw = {"decode_ids": True, "W": 2, "I": 64, "rank": 1}
    _check(_run(keys, lens, 2048, **kw), want)
    top_s = torch.empty(40, 2048, device="cuda")
    top_i = torch.empty(40, 2048, dtype=torch.int32, device="cuda")
    row_topk.select(keys, lens, 2048, top_s, top_i, **kw)  # warm, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        row_topk.select(keys, lens, 2048, top_s, top_i, **kw)
    top_s.zero_()
    top_i.zero_()
    graph.replay()
    torch.cuda.synchronize()
    _check((top_s, top_i), want)


@pytest.mark.gpu
@needs_cuda
def test_prefill_select_takes_the_cuda_rows():
    """``select_topk`` (the tiled indexer's select) routes enough rows to the CUDA kernel and
    gives the reference's answer either way."""
    from cpplan.runtime.kernels.triton import indexer_tiled as it

    g = torch.Generator().manual_seed(5)
    R, L, topk = 300, 8192, 2048
    scores = torch.randint(-40, 41, (R, L), generator=g).float()
    lens = torch.randint(1, L + 1, (R,), generator=g)
    pos = torch.arange(L)[None, :].expand(R, L)
    want = ref.topk_reference_order(scores.double(),
                                    torch.where(pos < lens[:, None], pos, ref.NO_KEY), topk)
    on = it.IndexerTiles(cuda_select_rows=256)
    from cpplan.runtime.kernels.triton.indexer_select import cuda_rows

    assert cuda_rows(R, topk, torch.device("cuda"), on)
    # rows of 8192 keys take the short rows' build, wider ones (and K past 2048) the default
    assert row_topk.select_defines(L, topk, on.cuda_select_short_keys) == row_topk.SHORT_ROWS
    assert row_topk.select_defines(L, topk, on.cuda_select_short_keys, True) \
        == row_topk.SHORT_ROWS_MERGE
    assert row_topk.select_defines(L, topk, L - 1) == ()
    assert row_topk.select_defines(L, 4096, on.cuda_select_short_keys) == ()
    assert not cuda_rows(R, topk, torch.device("cuda"), it.IndexerTiles(cuda_select=False))
    for tiles in (on, it.IndexerTiles(cuda_select_short_keys=0),
                  it.IndexerTiles(cuda_select_merge=False), it.IndexerTiles(cuda_select=False)):
        _check(it.select_topk(scores.cuda(), lens.cuda(), topk, tiles=tiles), want)


def test_select_defines_picks_the_build():
    """Rows up to the short rows' width (and K up to 2048) take the short rows' build, sorted
    by merges or by the network; wider rows, or a larger K, the default build."""
    short = row_topk.SHORT_ROWS
    assert row_topk.select_defines(32768, 2048, 32768) == short
    assert row_topk.select_defines(4096, 2048, 32768, True) == row_topk.SHORT_ROWS_MERGE
    assert set(short) < set(row_topk.SHORT_ROWS_MERGE)
    assert row_topk.select_defines(32769, 2048, 32768, True) == ()
    assert row_topk.select_defines(4096, 4096, 32768, True) == ()


@pytest.mark.gpu
@needs_cuda
def test_row_topk_bad_arguments():
    keys = torch.zeros(4, 64, dtype=torch.int32, device="cuda")
    lens = torch.full((4,), 64, dtype=torch.int32, device="cuda")
    s, i = torch.empty(4, 8, device="cuda"), torch.empty(4, 8, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="topk must be in 1..4096, got 5000"):
        row_topk.select(keys, lens, 5000, s, i)
    with pytest.raises(ValueError, match="keys int32"):
        row_topk.select(keys.float(), lens, 8, s, i)
    with pytest.raises(ValueError, match=r"outputs float32 / int32 \[4, 8\]"):
        row_topk.select(keys, lens, 8, s[:, :4], i)


def test_unavailable_on_cpu():
    assert row_topk.unavailable_reason(torch.device("cpu")) == "needs a CUDA device, got cpu"


def test_build_without_nvcc_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with pytest.raises(build.CudaBuildError, match="^no nvcc"):
        build.compile_library(row_topk.SOURCE, "90", out_dir=tmp_path)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_nvcc_named_by_the_environment_first(tmp_path, monkeypatch):
    fake = tmp_path / "my-nvcc"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CPPLAN_NVCC", str(fake))
    assert build.find_nvcc() == str(fake)
    monkeypatch.setenv("CPPLAN_CUDA_CACHE", str(tmp_path / "cache"))
    assert build.cache_dir() == tmp_path / "cache"


def test_build_failure_is_one_line(tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'row_topk.cu(3): error: something' >&2\nexit 2\n")
    fake.chmod(0o755)
    with pytest.raises(build.CudaBuildError) as e:
        build.compile_library(row_topk.SOURCE, "90", nvcc=str(fake), out_dir=tmp_path / "c")
    msg = str(e.value)
    assert "\n" not in msg and "failed (exit 2)" in msg and "error: something" in msg
    assert not list((tmp_path / "c").iterdir())  # no half-written library left


@pytest.mark.skipif(build.find_nvcc() is None, reason="needs nvcc")
def test_build_compiles_and_caches(tmp_path):
    """nvcc builds the library for sm_90 (no GPU needed), exporting the launcher; a second
    call finds the cached file instead of compiling again."""
    lib = build.compile_library(row_topk.SOURCE, "90", out_dir=tmp_path)
    mtime = lib.stat().st_mtime_ns
    assert build.compile_library(row_topk.SOURCE, "90", out_dir=tmp_path) == lib
    assert lib.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]
    so = ctypes.CDLL(str(lib))
    so.cpplan_row_topk_smem.restype = ctypes.c_size_t
    so.cpplan_row_topk_smem.argtypes = [ctypes.c_int, ctypes.c_int]
    # the result's and the candidates' composites, the 10-bit histogram (step 1's 12-bit one
    # and the one pass's sample, up to 4096 keys, lie over the candidates: 4096 composites at
    # least)
    assert so.cpplan_row_topk_smem(4096, 8192) == (4096 + 8192) * 8 + 1024 * 4
    assert so.cpplan_row_topk_smem(2048, 4096) == (2048 + 4096) * 8 + 1024 * 4
    assert so.cpplan_row_topk_smem(2048, 64) == (2048 + 4096) * 8 + 1024 * 4
    so.cpplan_row_topk_cap.restype = ctypes.c_int
    assert so.cpplan_row_topk_cap() == row_topk.CAP
