"""The tiled indexer (logits as a tiled product, sampled-threshold top-k) against the torch reference.

Inputs are integer-valued (q, weights, fp8 keys with power-of-two scales), so every score is
exact in float32 and float64 and ties abound: results must equal the reference bit for bit,
order on ties included. ``interp`` runs the interpreter (fp16/fp32 operands: its bf16 dot is
wrong) at small shapes and small tiles; ``cuda`` (marked gpu) runs bf16 at full shapes.
"""

import os

import pytest
import torch

from cpplan.runtime.kernels import reference as ref
from tests.kernels.caches import block_planar

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERP
ENVS = [
    pytest.param("interp", marks=pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]),
]


def _it():
    from cpplan.runtime.kernels.triton import indexer_tiled

    return indexer_tiled


def _tiles(env, **kw):
    it = _it()
    if env == "interp":  # small tiles: several key blocks and select steps per row; rows
        # longer than the candidate cap, so the sampled threshold is exercised
        kw = {"block_k": 32, "decode_block_k": 32, "few_rows_block_k": 16, "select_block": 64,
              "select_cap": 64,
              "select_sample": 64, "split_run": 64, "rank_chunk": 32, "filter_rank_chunk": 32, "rank_runs": 4, **kw}
    return it.IndexerTiles(**kw)


def _dev(env):
    return "cuda" if env == "cuda" else "cpu"


def _inputs(env, T, Hi, N, seed, dtype=None):
    dev = _dev(env)
    dtype = dtype or (torch.bfloat16 if env == "cuda" else torch.float32)
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (T, Hi, 128), generator=g).to(dtype).to(dev)
    w = torch.randint(-2, 3, (T, Hi), generator=g).float().to(dev)
    k = ref.quantize_indexer_k(torch.randint(-3, 4, (N, 128), generator=g).float()).to(dev)
    return q, w, k


def _check(got, want):
    s, ids = got
    ws, wids = want
    assert torch.equal(ids.cpu(), wids.cpu())
    assert torch.equal(s.cpu().double(), ws.cpu().double())


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scores_rows(env, dtype):
    it = _it()
    if env == "cuda":
        dtype = torch.bfloat16
    q, w, k = _inputs(env, 3, 5, 50, 6, dtype)
    rows = torch.randint(-1, 50, (3, 200), generator=torch.Generator().manual_seed(1)).to(q.device)
    s = it.indexer_scores(q, w, k, rows, tiles=_tiles(env))
    want = ref.indexer_scores(q.cpu().double(), w.cpu(), k.cpu(), rows.cpu())
    assert torch.equal(s.cpu().double(), want)
    ids = torch.randperm(200, generator=torch.Generator().manual_seed(2)).repeat(3, 1).to(q.device)
    _check(it.indexer_topk(q, w, k, rows, ids, 37, tiles=_tiles(env)),
           ref.indexer_topk(q.cpu().double(), w.cpu(), k.cpu(), rows.cpu(), ids.cpu(), 37))


def _prefill_case(env, T, PT, topk, W, seed, nreq):
    """Random causal bounds (padded rows, rows shorter than topk), nreq requests in the chunk."""
    dev = _dev(env)
    g = torch.Generator().manual_seed(seed)
    key_len = torch.randint(1, PT // nreq, (T,), generator=g)
    key_len[0] = 0
    key_len[-1] = min(topk // 2, PT // nreq - 1)
    req = torch.sort(torch.randint(0, nreq, (T,), generator=g)).values
    pcu = req * (PT // nreq)
    return key_len.to(dev), pcu.to(dev)


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("W,I", [(1, 1), (2, 1), (2, 64)])
@pytest.mark.parametrize("block_q,nreq,sms", [(2, 1, 2), (4, 3, 0), (2, 2, 8)])
def test_prefill(env, W, I, block_q, nreq, sms):
    it = _it()
    T, Hi, PT, topk = (9, 4, 240, 24) if env == "interp" else (256, 64, 8192, 2048)
    q, w, k = _inputs(env, T, Hi, W * PT, 7)
    key_len, pcu = _prefill_case(env, T, PT, topk, W, 3, nreq)
    tiles = _tiles(env, block_q=block_q, programs_per_sm=sms)
    budget = 4 * PT * 4  # several query chunks
    got = it.indexer_topk_prefill(q, w, k, key_len, pcu, PT, W, I, topk, max_keys=PT,
                                  logits_budget_bytes=budget, tiles=tiles)
    _check(got, ref.indexer_topk_prefill(q.cpu().double(), w.cpu(), k.cpu(), key_len.cpu(),
                                         pcu.cpu(), PT, W, I, topk, max_keys=PT))


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("backend", ["tiled", "reference"])
def test_prefill_out_rows_of_a_larger_buffer(env, backend):
    """``out=``: the top-k lands in the given views (rows of a buffer that holds other rows
    before them, as the executor's decode rows), equal to the returned tensors of a call
    without it; the other rows are untouched; a wrong out is a ValueError."""
    it = _it()
    T, Hi, PT, topk = (9, 4, 240, 24) if env == "interp" else (64, 64, 4096, 2048)
    q, w, k = _inputs(env, T, Hi, PT, 11)
    key_len, pcu = _prefill_case(env, T, PT, topk, 1, 5, 2)
    if backend == "reference":
        q, w, k, key_len, pcu = (x.cpu() for x in (q.double(), w, k, key_len, pcu))
    fn = {"tiled": lambda **kw: it.indexer_topk_prefill(*args, tiles=_tiles(env), **kw),
          "reference": lambda **kw: ref.indexer_topk_prefill(*args, **kw)}[backend]
    args = (q, w, k, key_len, pcu, PT, 1, 1, topk)
    want = fn(max_keys=PT)
    lead = 3
    buf = (torch.full((lead + T, topk), 7.5, device=q.device),
           torch.full((lead + T, topk), 77, dtype=torch.int32, device=q.device))
    got = fn(max_keys=PT, out=(buf[0][lead:], buf[1][lead:]))
    assert got[0].data_ptr() == buf[0][lead:].data_ptr()
    _check((buf[0][lead:], buf[1][lead:]), want)
    assert (buf[0][:lead] == 7.5).all() and (buf[1][:lead] == 77).all()
    for bad in [(buf[0][lead + 1:], buf[1][lead + 1:]), (buf[1][lead:], buf[1][lead:]), buf[0]]:
        with pytest.raises(ValueError, match="indexer_topk_prefill out"):
            fn(max_keys=PT, out=bad)


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("W,rank,I", [(1, 0, 1), (4, 2, 1), (2, 1, 64)])
@pytest.mark.parametrize("sms", [0, 8])
@pytest.mark.parametrize("filt", [False, True], ids=["split", "filter"])
@pytest.mark.parametrize("balanced", [False, True], ids=["per-row", "balanced"])
def test_decode(env, W, rank, I, sms, filt, balanced):
    """Logits on fp8 tensor cores on CUDA (the interpreter multiplies the same fp8 values in
    fp16). split: the default tiles (short rows: the split path). filter: rows long enough for
    segments, through the filter path, global ids mapped alike. balanced: the logits'
    balanced launch (the batch's key tiles split evenly over programs; rows of every length,
    one with no key, straddle the programs)."""
    it = _it()
    dev = _dev(env)
    T, Hi, B, topk, nblk = (3, 4, 16, 16, 12) if env == "interp" else (64, 64, 64, 2048, 128)
    q, w, k = _inputs(env, T, Hi, 2 * T * nblk * B, 8, torch.float16 if env == "interp" else None)
    g = torch.Generator().manual_seed(3)
    bt = torch.stack([torch.randperm(2 * T * nblk, generator=g)[:nblk] for _ in range(T)]).int()
    local_len = torch.randint(1, nblk * B, (T,), generator=g)
    local_len[-1] = 5  # fewer keys than topk
    if filt:
        local_len[0] = nblk * B  # rows long enough for segments, hence for the filter path
    if balanced and T > 2:
        local_len[1] = 0  # a row without keys: no tiles in the balanced launch
    bt, local_len = bt.to(dev), local_len.to(dev)
    filt_kw = ({"filter_chunk": 32, "filter_cap": 64, "filter_sample": 64, "filter_margin": 2.0,
                "split_rows": 0} if filt else {})
    if balanced:  # sms 0 -> the interpreter's 4 "SMs" at 3 programs: 12 programs, 3 rows
        filt_kw["decode_balanced_keys"] = 1
    k = block_planar(k, B)
    got = it.indexer_topk_decode(q, w, k, local_len, bt, B, W, rank, I, topk,
                                 tiles=_tiles(env, programs_per_sm=sms, **filt_kw))
    _check(got, ref.indexer_topk_decode(q.cpu().double(), w.cpu(), k.cpu(), local_len.cpu(),
                                        bt.cpu(), B, W, rank, I, topk))


@pytest.mark.parametrize("env", ENVS)
def test_query_is_quantised_like_the_reference(env):
    """q integers in [-40, 40]: fp8 (4 significant bits) rounds the larger ones, so an indexer
    that skipped ``quantize_indexer_q`` would disagree; every score stays exact (all values are
    small integers times powers of two), so prefill and decode must equal the reference."""
    it = _it()
    dev = _dev(env)
    T, Hi, PT, topk, B = (6, 4, 160, 20, 16) if env == "interp" else (128, 64, 4096, 2048, 64)
    q, w, k = _inputs(env, T, Hi, PT, 9)
    q = torch.randint(-40, 41, q.shape, generator=torch.Generator().manual_seed(9)).to(q)
    q8, w8 = ref.quantize_indexer_q(q.cpu(), w.cpu())
    assert not torch.equal(q8.double() * (w8 / w.cpu()).double()[..., None], q.cpu().double())
    key_len = torch.arange(PT - T + 1, PT + 1, device=dev)
    pcu = torch.zeros(T, dtype=torch.int64, device=dev)
    tiles = _tiles(env)
    _check(it.indexer_topk_prefill(q, w, k, key_len, pcu, PT, 1, 1, topk, max_keys=PT, tiles=tiles),
           ref.indexer_topk_prefill(q.cpu(), w.cpu(), k.cpu(), key_len.cpu(), pcu.cpu(), PT, 1, 1,
                                    topk, max_keys=PT))
    bt = torch.randperm(PT // B, generator=torch.Generator().manual_seed(1)).int()
    bt = bt[None, :].repeat(T, 1).to(dev)
    local_len = torch.full((T,), PT - 3, device=dev)
    k = block_planar(k, B)
    _check(it.indexer_topk_decode(q, w, k, local_len, bt, B, 1, 0, 1, topk, tiles=tiles),
           ref.indexer_topk_decode(q.cpu(), w.cpu(), k.cpu(), local_len.cpu(), bt.cpu(), B, 1, 0,
                                   1, topk))


def triton_next_pow2(n):
    return 1 << (n - 1).bit_length()


def _select_scores(kind, R, L, g):
    if kind == "ties":  # few distinct values: the threshold lands inside a run of equal scores
        return torch.randint(-3, 4, (R, L), generator=g).float()
    if kind == "equal":
        return torch.full((R, L), 2.5)
    if kind == "signs":  # -0.0 / +0.0 tie; infinities; values sharing high bits
        s = torch.randn(R, L, generator=g) * 1e-3
        s[:, ::7] = -0.0
        s[:, 3::11] = 0.0
        s[:, 5::13] = float("inf")
        s[:, 6::17] = float("-inf")
        return s
    return torch.randn(R, L, generator=g) * torch.logspace(-30, 30, L)[None, :]


# The segment path (``select_kernel``): a sampled threshold (one program per row / one persistent
# program / segments + ranks of their runs / segments + a second select), retries (a threshold
# sampled too high), the in-kernel radix fallback (attempts exhausted), radix only; the
# candidates' order: "candidates" "all" (select_cap = K: every candidate ordered, by one sort or
# a merge sort from segments) or "exact" (select_cap = 2 K: the exact top K kept first, then
# ordered); unset: the interpreter orders all (its select_cap 64 = K), CUDA keeps the exact top
# K. These variants route every row past the filter path (SEGMENTS_ONLY). The split path: rows
# sorted as runs of L / 8 or L / 2 keys by R x runs programs, placed by ranks. The filter path
# ("filter*"): a sampled row threshold, candidates gathered by chunks, then runs + ranks,
# trimmed to K first where there are more than trim_rows rows ("filter-untrimmed": not);
# "filter-batches": rows in batches of two; "filter-auto-cap": the slots from the row width;
# "filter-group": three chunks a counting / gathering program, the last program's two;
# "filter-short-rows": one-item rows (a prefill's); the segment path for the rows it misses
# (ties past its cap; a threshold sampled too high: "filter-missed").
SEGMENTS_ONLY = {"filter_cap": 1 << 20}  # more slots than rank_runs runs: no filter path
FILTER = {"programs_per_sm": 8, "radix_bits": 8, "filter_chunk": 64, "filter_cap": 128,
          "filter_sample": 256, "filter_margin": 3.0, "trim_rows": 0}
SELECT_VARIANTS = {
    "split": {"split_rows": 1 << 20, "split_run": 8, "split_warps": 8, "rank_runs": 8},
    "split-two-runs": {"split_rows": 1 << 20, "split_run": 2},
    "one-sort": {"programs_per_sm": 0, "sort_segments": 1, "candidates": "all"},
    "one-sort-segments": {"programs_per_sm": 8, "sort_segments": 1, "radix_bits": 8,
                          "candidates": "all"},
    "ranked": {"programs_per_sm": 0, "sort_segments": 2, "candidates": "all"},
    "ranked-segments": {"programs_per_sm": 8, "sort_segments": 2, "radix_bits": 8,
                        "candidates": "all"},
    "sampled": {"programs_per_sm": 0},
    "persistent": {"programs_per_sm": 0, "select_programs_per_sm": 0},
    "segments": {"programs_per_sm": 8, "radix_bits": 8},
    "segments-reselect": {"programs_per_sm": 8, "radix_bits": 8, "rank_runs": 1},
    "retry": {"programs_per_sm": 0, "select_margin": -6.0, "select_sample": 128},
    "fallback": {"programs_per_sm": 8, "select_margin": -9.0, "select_attempts": 1},
    "radix": {"programs_per_sm": 0, "select_attempts": 0, "radix_bits": 8},
    "exact": {"programs_per_sm": 0, "candidates": "exact"},
    "exact-one-sort": {"programs_per_sm": 0, "candidates": "exact", "exact_segments": 1},
    "exact-segments": {"programs_per_sm": 8, "candidates": "exact", "radix_bits": 8},
    "exact-fallback": {"programs_per_sm": 8, "candidates": "exact", "select_margin": -9.0,
                       "select_attempts": 1},
    "filter": FILTER,
    "filter-batches": {**FILTER, "filter_budget_bytes": 2 * 128 * 8},
    "filter-ranks-run-major": {**FILTER, "rank_row_major": False, "filter_rank_chunk": 16},
    "filter-trim-radix": {**FILTER, "trim_radix_bits": 4},
    "split-ranks-run-major": {"split_rows": 1 << 20, "split_run": 8, "rank_runs": 8,
                              "rank_row_major": False, "rank_chunk": 32},
    "filter-untrimmed": {**FILTER, "trim_rows": 1 << 20},
    "filter-auto-cap": {**FILTER, "filter_cap": 0, "trim_rows": 16},
    "filter-group": {**FILTER, "filter_group": 3, "filter_group_programs": 0},
    "filter-short-rows": {**FILTER, "programs_per_sm": 0, "radix_bits": 11},
    "filter-missed": {**FILTER, "filter_chunk": 128, "filter_sample": 64, "filter_margin": -9.0,
                      "trim_rows": 16},
}


SELECT_KINDS = ("ties", "equal", "signs", "spread")


def _mixed_select_scores(R, L, g):
    """Row r of kind ``SELECT_KINDS[r % 4]``: one launch meets every kind, each on a row of
    its own (a row's top-k depends on that row alone)."""
    rows = [_select_scores(kind, R, L, g) for kind in SELECT_KINDS]
    return torch.stack([rows[r % len(rows)][r] for r in range(R)])


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("variant", list(SELECT_VARIANTS))
def test_select(env, variant):
    """Each variant over rows of every kind: an empty row, one of fewer keys than topk, rows
    of random lengths, and a full row of each kind last."""
    if env == "cuda" and variant == "split-two-runs":
        # runs of L / 2 = 32768 keys: a tl.sort that no default launches (runs are at most
        # split_run_max = 512 keys) and that ran past a 300 s test timeout on the H200
        pytest.skip("runs of 32768 keys: interpreter shapes only")
    it = _it()
    R, L, topk = (8, 700, 40) if env == "interp" else (64, 40000, 2048)
    g = torch.Generator().manual_seed(11)
    scores = _mixed_select_scores(R, L, g)
    lens = torch.randint(0, L + 1, (R,), generator=g)
    lens[0], lens[1], lens[-len(SELECT_KINDS):] = 0, topk - 1, L
    pos = torch.arange(L)[None, :].expand(R, L)
    ids = torch.where(pos < lens[:, None], pos, ref.NO_KEY)
    want = ref.topk_reference_order(scores.double(), ids, topk)
    dev = _dev(env)
    kw = {"split_rows": 0, **({} if variant.startswith("filter") else SEGMENTS_ONLY),
          **SELECT_VARIANTS[variant]}
    if "split_run" in kw:  # the variant's number of runs: runs of L / split_run keys
        kw["split_run"] = triton_next_pow2(L) // kw["split_run"]
    if "candidates" in kw:  # candidates gathered: K (all ordered) or 2 K (the top K kept)
        kw["select_cap"] = {"all": 1, "exact": 2}[kw.pop("candidates")] * triton_next_pow2(topk)
    got = it.select_topk(scores.to(dev), lens.to(dev), topk, tiles=_tiles(env, **kw))
    _check(got, want)


@pytest.mark.parametrize("env", ENVS)
def test_prefill_all_equal_scores(env):
    """q = 0: every score is 0, the top-k is the lowest ids of each row in order."""
    it = _it()
    T, PT, topk = (4, 100, 30) if env == "interp" else (64, 8192, 2048)
    q, w, k = _inputs(env, T, 4, PT, 5)
    key_len = torch.tensor([PT, topk, topk - 3, 1] * (T // 4), device=q.device)
    pcu = torch.zeros(T, dtype=torch.int64, device=q.device)
    s, ids = it.indexer_topk_prefill(q * 0, w, k, key_len, pcu, PT, 1, 1, topk, tiles=_tiles(env))
    pos = torch.arange(topk, device=q.device)[None, :]
    want = torch.where(pos < key_len[:, None].clamp_max(topk), pos, ref.NO_KEY).int()
    assert torch.equal(ids, want)
    assert torch.equal(s == 0, want >= 0) and torch.isneginf(s[want < 0]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_prefill_full_shape():
    """Full shape, realistic causal bounds (the last T of N tokens): equal to the reference."""
    it = _it()
    T, N, topk = 1024, 8192, 2048
    q, w, k = _inputs("cuda", T, 64, N, 9)
    key_len = torch.arange(N - T + 1, N + 1, device="cuda")
    pcu = torch.zeros(T, dtype=torch.int64, device="cuda")
    got = it.indexer_topk_prefill(q, w, k, key_len, pcu, N, 1, 1, topk, max_keys=N)
    _check(got, ref.indexer_topk_prefill(q.float(), w, k, key_len, pcu, N, 1, 1, topk, max_keys=N))


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("R", [1, 67, 3001])
def test_split_planes_kernel(env, R):
    """The one-launch split of packed keys into planes equals the two planes read off the
    packed bytes (values: bytes 0-127 as fp8; scales: bytes 128-131 as float32) for every key,
    across the kernel's blocks (3001 keys: 99,033 words, 49 blocks, the last partial); a
    strided view (not flat) takes the copies and gives the same."""
    it = _it()
    g = torch.Generator().manual_seed(R)
    packed = ref.quantize_indexer_k(torch.randn(R, 128, generator=g) * 100).to(_dev(env))
    vals, scales = it.split_planes(packed, kernel=True)
    raw = packed.cpu().numpy()
    want_vals = torch.from_numpy(raw[:, :128].copy())
    want_scales = torch.from_numpy(raw[:, 128:].copy().view("<f4").reshape(-1))
    assert vals.dtype == torch.float8_e4m3fn and vals.shape == (R, 128)
    assert torch.equal(vals.cpu().view(torch.uint8), want_vals)
    assert torch.equal(scales.cpu(), want_scales) and scales.shape == (R,)
    wide = torch.zeros(R, 2 * 132, dtype=torch.uint8, device=packed.device)
    wide[:, :132] = packed
    v2, s2 = it.split_planes(wide[:, :132], kernel=True)
    assert torch.equal(v2.cpu().view(torch.uint8), want_vals) and torch.equal(s2.cpu(), want_scales)


@pytest.mark.parametrize("env", ENVS)
def test_zero_queries(env):
    """No query (a rank whose step has no token of that kind): [0, topk] results from every
    backend, without max_keys (no reduction over an empty tensor)."""
    dev = _dev(env)
    q, w, k = _inputs(env, 0, 4, 128, 1)
    none, bt = torch.zeros(0, dtype=torch.int64, device=dev), torch.zeros(0, 2, dtype=torch.int32,
                                                                             device=dev)
    for mod in (_it(), ref):
        s, ids = mod.indexer_topk_decode(q, w, block_planar(k, 64), none, bt, 64, 1, 0, 1, 16)
        assert s.shape == ids.shape == (0, 16)
        s, ids = mod.indexer_topk_prefill(q, w, k, none, none, 128, 1, 1, 16)
        assert s.shape == ids.shape == (0, 16)


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("distinct", [False, True])
@pytest.mark.parametrize("three_q,radix", [(False, 0), (True, 0), (False, 4), (True, 8)])
def test_filter_trim_keeps_the_exact_top_k(env, distinct, three_q, radix):
    """filter_trim_kernel alone against a sort: rows of candidates (int64 composites whose
    high 32 bits are the key, in position order) of at most K (left alone), of at most 3 CAP /
    8 (three_q: bisected over CAP / 4 + CAP / 8 slots, two tensors), of at most CAP / 2
    (bisected over half the slots) and of more, with ties at the K-th key; a trimmed row keeps
    its K largest keys, the lowest positions first among those equal to the K-th, in position
    order, and its count becomes K; over tied or distinct keys; the K-th key by bisection or
    (radix) by histogram passes of 4 / 8 bits."""
    import numpy as np

    from cpplan.runtime.kernels.triton import indexer_select_jit as sjit

    K, CAP = 24, 128
    rng = np.random.default_rng(5)
    counts = [0, 10, K, K + 1, 33, 40, 3 * CAP // 8, 3 * CAP // 8 + 1, CAP // 2, CAP // 2 + 1,
              100, CAP]
    cand = np.full((len(counts), CAP), np.iinfo(np.int64).min, dtype=np.int64)
    for r, n in enumerate(counts):  # few distinct keys, some negative: ties at the threshold
        keys = (rng.permutation(n).astype(np.int64) - n // 3) * 7919 if distinct else \
            rng.integers(-6, 7, n, dtype=np.int64) * 1000003
        cand[r, :n] = (keys << 32) | np.arange(n, dtype=np.int64)
    dev = _dev(env)
    got = torch.from_numpy(cand.copy()).to(dev)
    lens = torch.tensor(counts, dtype=torch.int32, device=dev)
    sjit.filter_trim_kernel[(len(counts),)](got, lens, got.stride(0), K, CAP=CAP, BLK=32,
                                            THREE_Q=three_q, RADIX=radix)
    got, lens = got.cpu().numpy(), lens.cpu().tolist()
    for r, n in enumerate(counts):
        row = cand[r, :n]
        if n <= K:
            assert lens[r] == n and np.array_equal(got[r], cand[r])
            continue
        order = sorted(range(n), key=lambda i: (-(row[i] >> 32), i))  # key desc, position asc
        want = row[np.sort(np.array(order[:K]))]
        assert lens[r] == K and np.array_equal(got[r, :K], want), (r, n)


@pytest.mark.parametrize("env", ENVS)
def test_filter_threshold_is_the_sorted_samples_key(env):
    """filter_threshold_kernel (the sample's key at the threshold rank, by bisection) against
    the sorted sample in torch, row by row: a strided sample of S keys (position i * n // S),
    sorted descending, its key at rank m + margin * sqrt(m) + 1 (m = K * S / n, float32,
    truncated, at most S - 1); rows of at most min(CAP, 2K) keys get the threshold below
    every key. Ties, negative keys, short rows, distinct keys."""
    from cpplan.runtime.kernels.triton import indexer_select_jit as sjit

    dev = _dev(env)
    R, N, K, S, CAP, margin = 12, 3000, 40, 256, 64, 3.0
    g = torch.Generator().manual_seed(3)
    keys = (torch.randint(-50, 50, (R, N), generator=g) * 7919).to(torch.int32)
    keys[3] = 5  # one key everywhere
    keys[4:8] = torch.randperm(4 * N, generator=g).reshape(4, N).to(torch.int32) - N  # distinct
    lens = torch.randint(0, N + 1, (R,), generator=g).to(torch.int32)
    lens[0], lens[1], lens[2] = 0, 2 * K, N
    got = torch.zeros(R, dtype=torch.int32, device=dev)
    sjit.filter_threshold_kernel[(R,)](keys.to(dev), lens.to(dev), got, keys.stride(0), N, K,
                                       margin, CAP=CAP, S=S)
    sampled = 0
    for r in range(R):
        n = int(lens[r])
        want = [-2147483647]
        if n > min(CAP, 2 * K):
            smp = torch.sort(keys[r, (torch.arange(S) * n) // S], descending=True).values
            m = torch.tensor(K * S, dtype=torch.float32) / torch.tensor(n, dtype=torch.float32)
            rank = float(m + margin * torch.sqrt(m))
            # a rank within rounding of an integer may truncate either way on the device
            ranks = {int(max(x, -1.0)) + 1 for x in (rank, rank - 1e-4, rank + 1e-4)}
            want = [max(int(smp[min(i, S - 1)]), -2147483647) for i in ranks]
            sampled += 1
        assert int(got[r]) in want, (r, n, int(got[r]), want)
    assert sampled >= R - 2  # all rows but the empty and the 2K-key one


@pytest.mark.parametrize("L", [4096, 32768, 131072])
def test_filter_slots_hold_the_sampled_candidates(L):
    """``filter_slots`` against the filter path's threshold simulated in numpy: a strided
    sample of S keys, sorted descending, the key at sample rank m + margin * sqrt(m) + 1
    (m = K * S / n), every key at or above it a candidate (rows of at most min(slots, 2K) keys
    take all). On 256 random rows (normal, heavy-tailed, integer-valued with ties) the slots
    hold every row's candidates and each row's candidates hold its top K, so no row falls back
    to the segment path, at the defaults."""
    import numpy as np

    it = _it()
    tiles = it.IndexerTiles()
    K, S, margin = 2048, tiles.filter_sample, tiles.filter_margin
    slots = it.filter_slots(L, K, tiles)
    assert slots >= K and slots & (slots - 1) == 0
    rng = np.random.default_rng(L)
    rows = [rng.standard_normal(L), rng.standard_t(2, L), rng.integers(-40, 40, L)]
    for r in range(256):
        x = rows[r % 3] if r < 3 else rng.permutation(rows[r % 3])
        n = int(rng.integers(1, L + 1)) if r % 4 == 3 else L  # some shorter rows
        x = x[:n]
        if n <= min(slots, 2 * K):
            count = n
        else:
            smp = np.sort(x[(np.arange(S) * n) // S])[::-1]
            m = K * S / n
            idx = min(int(max(m + margin * np.sqrt(m), -1.0)) + 1, S - 1)
            count = int((x >= smp[idx]).sum())
        assert min(K, n) <= count <= slots, (L, n, count, slots)


def test_bench_indexer_case_arguments(monkeypatch):
    """bench/indexer.py's --planar-tiles and --decode-cases: their values, and one argparse
    error line (got / expected) for a bad item; its variant tables name IndexerTiles fields."""
    import argparse
    import dataclasses
    import importlib.util
    import sys
    from pathlib import Path

    bench_dir = Path(__file__).resolve().parents[2] / "bench"
    monkeypatch.syspath_prepend(str(bench_dir))  # its ``common`` import
    spec = importlib.util.spec_from_file_location("bench_indexer", bench_dir / "indexer.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_indexer", mod)
    spec.loader.exec_module(mod)
    assert mod._planar_tiles("2:128:8:3:128,2:64:4:3") == [(2, 128, 8, 3, 128), (2, 64, 4, 3, 0)]
    assert mod._decode_cases("8x131072,64x65536-131072") == [(8, 131072), (64, 131072, 65536)]
    assert mod._ws_tiles("4:2:4,2:2:6:probe+pipe,2:3:4:split") == (
        (4, 2, 4, ""), (2, 2, 6, "pipe,probe"), (2, 3, 4, "split"))
    # the first ws row times the default: its launch options are IndexerTiles' own
    default = _it().IndexerTiles().ws_launch_options()
    first = mod._ws_options(*mod.WS_TILES[0])
    assert {k: first[k] for k in default} == default
    assert mod._ws_options(2, 3, 4, "probe,split") == {
        "block_q": 2, "math_warpgroups": 3, "stages": 4, "pipelined": False, "split": True,
        "scatter": False, "last_wave_parts": None, "_probe": True, "math_stage": False,
        "unroll": False, "thread_arrive": False}
    fields = {f.name for f in dataclasses.fields(_it().IndexerTiles)}  # no typo costs a GPU run
    for table in (mod.PREFILL_FILTERS, mod.DECODE_SELECTS, {"segment path": mod.SEGMENT_PATH}):
        for name, kw in table.items():
            assert set(kw) <= fields, (name, set(kw) - fields)
    for parse, bad, said in ((mod._planar_tiles, "2:128:8", "expected BQ:BK:WARPS:STAGES"),
                             (mod._planar_tiles, "2:x:8:3", "planar tile '2:x:8:3'"),
                             (mod._decode_cases, "8by4096", "expected BxCTX"),
                             (mod._ws_tiles, "4:2", "expected BQ:NM:STAGES"),
                             (mod._ws_tiles, "4:2:4:fast", "ws tile '4:2:4:fast'"),
                             (mod._ws_tiles, "4:2:4:pipe+", r"ws tile '4:2:4:pipe\+'")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            parse(bad)


@pytest.mark.slow
def test_select_kernels_compile_for_sm90(tmp_path):
    """bench/sm90_compile.py: every launch of the select's kernels that its paths make under
    the interpreter (split, segments, filter with either trim and either rank order, long
    rows) compiles for sm_90 offline (no GPU): the interpreter runs a kernel's Python only, so
    a GPU-only compile error (a module-level int used without ``tl.constexpr``) would pass
    every other CPU test."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.compiler")
    root = Path(__file__).resolve().parents[2]
    script = str(root / "bench" / "sm90_compile.py")
    launches = str(tmp_path / "launches.json")
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    rec = subprocess.run([sys.executable, script, "record", launches], capture_output=True,
                         text=True, env=env, cwd=root, timeout=300)
    assert rec.returncode == 0, rec.stderr[-2000:]
    assert "launches of 7 kernels recorded" in rec.stdout, rec.stdout
    env.pop("TRITON_INTERPRET")
    out = subprocess.run([sys.executable, script, "compile", launches], capture_output=True,
                         text=True, env=env, cwd=root, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "FAILED" not in out.stdout and " launches compiled for sm_90" in out.stdout, out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("copies", [False, True])
def test_planar_logits_compile_for_sm90(copies):
    """``bench/sass.py`` (an offline sm_90 compile, no interpreter) of the Triton prefill
    logits kernel at its default tiles, with TMA key tiles or per-thread copies: the
    interpreter tests multiply fp8 values in fp16, so only this compiles the fp8 tensor-core
    path on the CPU; its key loop holds fp8 wgmma products (QGMMA) within the register cap."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.compiler")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, str(root / "bench" / "sass.py"),
                          *(["--copies"] if copies else [])], capture_output=True, text=True,
                         env=env, cwd=root, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    regs = re.search(r"registers (\d+)", out.stdout)
    loop = re.search(r"key loop: (\d+) instructions a thread a trip: (.*)", out.stdout)
    assert regs and int(regs.group(1)) <= 128, out.stdout
    assert loop and " QGMMA" in loop.group(2), out.stdout
