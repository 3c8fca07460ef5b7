"""The warp-specialised Gluon prefill logits (``runtime/kernels/gluon/indexer_logits.py``).

On a Hopper GPU: its int32 keys against the Triton planar kernel's and against the float64
reference scores (integer-valued inputs: every score exact, so equal bit for bit), over request
boundaries inside a block, padded heads, a query count that is not a multiple of the block,
DCP gathers with interleaves of 64 and 128, every knob value. On the CPU: which layouts it
takes, its one-line error, and (where this Triton can) an offline sm_90 compile of its main
configurations: no spills, the products m64n{N}k32 on fp8, setmaxnreg to the math budget.
"""

import os
import re
import subprocess

import pytest
import torch

from cpplan.runtime.kernels import reference as ref

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9

# (queries, heads, keys a rank, ranks, interleave, requests): one request (every block shared;
# T odd), request boundaries inside blocks, 4 heads padded to 16, DCP interleaves of one box,
# 32 heads over four ranks
SHAPES = [(257, 64, 4096, 1, 1, 1), (130, 64, 2048, 1, 1, 5), (67, 4, 1024, 1, 1, 2),
          (96, 64, 2048, 2, 64, 3), (64, 32, 2048, 4, 128, 1)]


def _gluon():
    try:
        from cpplan.runtime.kernels.gluon import indexer_logits
    except ImportError as e:  # a Triton without Gluon
        pytest.skip(f"no Gluon in this Triton: {e}")
    return indexer_logits


def _case(T, HI, PT, W, nreq, seed):
    """Integer-valued q / weights / keys (exact scores), causal bounds with some rows empty or
    short, nreq requests in the chunk (region starts pcu), W ranks' regions of PT rows."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (T, HI, 128), generator=g).to(torch.bfloat16).cuda()
    w = torch.randint(-2, 3, (T, HI), generator=g).float().cuda()
    k = ref.quantize_indexer_k(torch.randint(-3, 4, (W * PT, 128), generator=g).float()).cuda()
    key_len = torch.randint(1, PT // nreq, (T,), generator=g)
    key_len[0] = 0
    pcu = torch.sort(torch.randint(0, nreq, (T,), generator=g)).values * (PT // nreq)
    return q, w, k, key_len.cuda(), pcu.cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("T,HI,PT,W,I,nreq", [
    (257, 64, 4096, 1, 1, 1),     # one request: every block shared; T odd
    (130, 64, 2048, 1, 1, 5),     # request boundaries inside blocks: one pass a query
    (67, 4, 1024, 1, 1, 2),       # 4 heads padded to 16
    (96, 64, 2048, 2, 64, 3),     # DCP: interleaves of one box
    (64, 32, 2048, 4, 128, 1),    # 32 heads, four ranks
])
@pytest.mark.parametrize("bq,nm,ns,pipe,split,parts", [
    (4, 2, 4, False, False, None), (2, 2, 2, False, False, None),
    (2, 4, 5, False, False, None), (1, 4, 3, False, False, None),
    (2, 2, 4, True, False, None), (1, 2, 3, True, False, None),
    # the math warpgroups split the queries: 6, 8, 3 queries a CTA
    (2, 3, 4, False, True, None), (4, 2, 3, False, True, None), (1, 3, 2, False, True, None),
    (2, 4, 4, False, True, None), (2, 2, 4, True, True, None),
    # the last wave's blocks whole, or cut into 3 / 8 / 5 parts of their key tiles (the
    # shapes' blocks are fewer than an H200's SMs: every block is cut)
    (4, 2, 4, False, False, 1), (4, 2, 4, False, False, 3), (2, 3, 4, False, True, 8),
    (2, 2, 4, True, False, 5)])
def test_ws_logits_equal_the_triton_kernel_and_the_reference(T, HI, PT, W, I, nreq, bq, nm, ns,
                                                             pipe, split, parts):
    _check_ws(T, HI, PT, W, I, nreq, block_q=bq, math_warpgroups=nm, stages=ns, pipelined=pipe,
              split=split, last_wave_parts=parts)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("T,HI,PT,W,I,nreq", SHAPES)
@pytest.mark.parametrize("nm,ns,pipe,split,parts", [
    (3, 4, False, True, None), (3, 4, False, True, 8), (2, 4, False, False, None),
    (2, 3, True, False, None), (4, 4, False, True, 1)])
def test_ws_logits_scatter_equal_the_triton_kernel_and_the_reference(T, HI, PT, W, I, nreq, nm,
                                                                     ns, pipe, split, parts):
    """The quad sums scattered (block_q 2), in every mode."""
    _check_ws(T, HI, PT, W, I, nreq, block_q=2, math_warpgroups=nm, stages=ns, pipelined=pipe,
              split=split, scatter=True, last_wave_parts=parts)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("T,HI,PT,W,I,nreq", SHAPES)
@pytest.mark.parametrize("bq,nm,ns,scatter,parts", [
    (2, 3, 4, True, None), (2, 3, 4, True, 8), (4, 2, 3, False, None), (1, 3, 2, False, None),
    (2, 4, 4, False, 1)])
def test_ws_logits_math_stage_equal_the_triton_kernel_and_the_reference(T, HI, PT, W, I, nreq,
                                                                        bq, nm, ns, scatter,
                                                                        parts):
    """Each math warpgroup copying its own queries (``math_stage``, queries split), in every
    split shape: the same keys as the Triton kernel and the reference."""
    _check_ws(T, HI, PT, W, I, nreq, block_q=bq, math_warpgroups=nm, stages=ns, split=True,
              scatter=scatter, last_wave_parts=parts, math_stage=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("T,HI,PT,W,I,nreq", SHAPES)
@pytest.mark.parametrize("bq,nm,ns,split,scatter,parts", [
    (2, 3, 4, True, True, None), (2, 3, 4, True, True, 8), (2, 3, 3, True, True, None),
    (4, 2, 4, False, False, None), (1, 3, 2, True, False, 5), (2, 4, 5, False, False, 1)])
def test_ws_logits_unroll_equal_the_triton_kernel_and_the_reference(T, HI, PT, W, I, nreq, bq, nm,
                                                                    ns, split, scatter, parts):
    """The waited pass unrolled by the ring's stages (the tiles before its first stage 0 and
    after its last whole trip one at a time: request boundaries start passes anywhere in the
    ring): the same keys as the Triton kernel and the reference, in split and key-split shapes,
    rings of 2 to 5 stages, cuts of the last wave."""
    _check_ws(T, HI, PT, W, I, nreq, block_q=bq, math_warpgroups=nm, stages=ns, split=split,
              scatter=scatter, last_wave_parts=parts, unroll=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("T,HI,PT,W,I,nreq", SHAPES)
@pytest.mark.parametrize("bq,nm,ns,pipe,split,scatter,unroll", [
    (2, 3, 4, False, True, True, True), (2, 3, 3, False, True, True, False),
    (4, 2, 4, False, False, False, True), (2, 2, 4, True, False, False, False)])
def test_ws_logits_thread_arrive_equal_the_triton_kernel_and_the_reference(T, HI, PT, W, I, nreq,
                                                                          bq, nm, ns, pipe, split,
                                                                          scatter, unroll):
    """Every math thread arriving on the free barriers (their count 128 a math warpgroup):
    the same keys as the Triton kernel and the reference, waited (unrolled or not) and
    pipelined, splitting queries or keys."""
    _check_ws(T, HI, PT, W, I, nreq, block_q=bq, math_warpgroups=nm, stages=ns,
              pipelined=pipe, split=split, scatter=scatter, unroll=unroll, thread_arrive=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
def test_ws_logits_scatter_sums_normal_inputs():
    """Normal inputs (sums rounded): the scattered epilogue's scores within rounding of the
    all-reduced one's (the same additions in the same order, but which of a thread's first
    two products the compiler rounds before its fused add differs between them: up to a few
    units in the last place), and of the float64 reference's."""
    from cpplan.runtime.kernels.triton import indexer_tiled as it
    from cpplan.runtime.kernels.triton import pack

    ws = _gluon()
    T, HI, PT = 300, 64, 4096
    g = torch.Generator().manual_seed(11)
    q = torch.randn(T, HI, 128, generator=g).to(torch.bfloat16).cuda()
    w = torch.randn(T, HI, generator=g).cuda()
    k = ref.quantize_indexer_k(torch.randn(PT, 128, generator=g)).cuda()
    key_len = torch.randint(1, PT + 1, (T,), generator=g).cuda()
    pcu = torch.zeros(T, dtype=torch.int64, device="cuda")
    q8, w8 = pack.quantize_indexer_q(q, w)
    kp, ks = it.split_planes(k)
    valid = torch.arange(PT, device="cuda")[None, :] < key_len[:, None]
    scores = []
    for scatter in (False, True):
        out = torch.zeros((T, PT), dtype=torch.int32, device="cuda")
        ws.launch(q8, w8, kp, ks, out, key_len, pcu, PT, 1, 1, block_q=2, math_warpgroups=3,
                  split=True, scatter=scatter)
        scores.append(torch.where(out < 0, out ^ 0x7FFFFFFF, out).view(torch.float32)[valid])
    rows, _ = ref.prefill_key_rows(key_len.cpu(), pcu.cpu(), PT, 1, 1, PT)
    want = ref.indexer_scores(q.cpu().double(), w.cpu(), k.cpu(), rows)[valid.cpu()]
    big = want.abs().max().item()
    assert big > 0
    a, b = scores[0].cpu().double(), scores[1].cpu().double()
    assert (a - b).abs().max().item() <= 1e-5 * big
    assert (b - want).abs().max().item() <= 1e-3 * big
    assert (a != b).float().mean().item() < 0.5  # most keys bit for bit


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("T,HI,PT,W,I,nreq", [
    (257, 64, 4096, 1, 1, 1), (130, 64, 2048, 1, 1, 5), (67, 4, 1024, 1, 1, 2),
    (96, 64, 2048, 2, 64, 3)])
@pytest.mark.parametrize("bq,nm,split,scatter,dtype,stage", [
    (2, 3, True, True, torch.bfloat16, False), (4, 2, False, False, torch.bfloat16, False),
    (2, 3, True, True, torch.float32, False), (2, 2, False, False, torch.float16, False),
    (2, 3, True, True, torch.bfloat16, True), (4, 2, True, False, torch.float16, True)])
def test_ws_logits_quantise_in_the_kernel_equals_the_quantised_launch(T, HI, PT, W, I, nreq,
                                                                     bq, nm, split, scatter,
                                                                     dtype, stage):
    """``quantise=True`` (the unquantised query and weights, quantised in each CTA's
    prologue) writes the same int32 keys, bit for bit, as the launch given
    ``pack.quantize_indexer_q``'s fp8 query and scaled weights, on normal draws whose heads
    span magnitudes from 2**-30 to 2**20 (2**-8 to 2**8 in float16: scales far from 1, fp8
    subnormals) and a zero head each; quantised by the loader's warpgroup or (``stage``) by
    each math warpgroup; nothing past a row's keys written."""
    from cpplan.runtime.kernels.triton import indexer_tiled as it
    from cpplan.runtime.kernels.triton import pack

    ws = _gluon()
    g = torch.Generator().manual_seed(T + HI + nm)
    lo, hi = (-8, 8) if dtype == torch.float16 else (-30, 20)  # float16: finite, normal
    mag = 2.0 ** torch.randint(lo, hi + 1, (T, HI, 1), generator=g)
    mag[:, :1] = 0.0  # a zero head: the smallest scale
    q = (torch.randn(T, HI, 128, generator=g) * mag).to(dtype).cuda()
    w = torch.randn(T, HI, generator=g).cuda()
    k = ref.quantize_indexer_k(torch.randn(W * PT, 128, generator=g)).cuda()
    _, _, _, key_len, pcu = _case(T, HI, PT, W, nreq, seed=T + HI + W)
    q8, w8 = pack.quantize_indexer_q(q, w)
    kp, ks = it.split_planes(k)
    opts = dict(block_q=bq, math_warpgroups=nm, split=split, scatter=scatter)
    got = torch.full((T, PT), 0x5A5A5A5A, dtype=torch.int32, device="cuda")  # poison
    want = torch.full_like(got, 0x5A5A5A5A)
    ws.launch(q, w, kp, ks, got, key_len, pcu, PT, W, I, quantise=True, math_stage=stage, **opts)
    ws.launch(q8, w8, kp, ks, want, key_len, pcu, PT, W, I, **opts)
    valid = torch.arange(PT, device="cuda")[None, :] < key_len[:, None]
    assert torch.equal(got[valid], want[valid])
    assert (got[~valid] == 0x5A5A5A5A).all()
    assert (want[valid] != 0).any()  # scores that are not all zero


def test_ws_logits_quantise_refuses_a_quantised_query():
    """``quantise=True`` takes the unquantised query: an fp8 one, or a strided last dim, is
    refused with one line (before any device work)."""
    ws = _gluon()
    w = torch.zeros(4, 64)
    with pytest.raises(ValueError, match=r"quantise: got q torch.float8_e4m3fn.*expected an "
                                         r"unquantised float query"):
        ws.launch(torch.zeros(4, 64, 128).to(torch.float8_e4m3fn), w, None, None, None, None,
                  None, 16, 1, 1, block_q=2, math_warpgroups=3, split=True, quantise=True)
    with pytest.raises(ValueError, match=r"strides \(1, 4, 256\)"):
        ws.launch(torch.zeros(128, 64, 4).permute(2, 1, 0), w, None, None, None, None, None, 16,
                  1, 1, block_q=2, math_warpgroups=3, split=True, quantise=True)


def test_prefill_logits_quantise_needs_the_gluon_kernel():
    """``prefill_logits(quantise=True)`` where the Gluon kernel does not run (here: a CPU
    tensor) is refused with one line: the Triton kernel takes only the quantised query."""
    from cpplan.runtime.kernels.triton import indexer_tiled as it

    q, w = torch.zeros(4, 64, 128), torch.zeros(4, 64)
    with pytest.raises(ValueError, match=r"quantise: got W 1, interleave 1, 8192 keys, 64 heads "
                                         r"on cpu; expected a chunk the Gluon kernel takes"):
        it.prefill_logits(q, w, None, None, None, 8192, None, None, 8192, 1, 1,
                          it.IndexerTiles(), quantise=True)


def _check_ws(T, HI, PT, W, I, nreq, **launch):
    """The ws kernel's keys (``launch``'s knobs) equal the Triton planar kernel's and the
    float64 reference's, nothing written past a row's keys."""
    from cpplan.runtime.kernels.triton import indexer_tiled as it
    from cpplan.runtime.kernels.triton import pack

    ws = _gluon()
    if not ws.supported(W, I, HI, launch["block_q"], launch["math_warpgroups"]):
        pytest.skip("layout outside the kernel")
    q, w, k, key_len, pcu = _case(T, HI, PT, W, nreq, seed=T + HI + W)
    q8, w8 = pack.quantize_indexer_q(q, w)
    kp, ks = it.split_planes(k)
    got = torch.full((T, PT), 0x5A5A5A5A, dtype=torch.int32, device="cuda")  # poison
    want = torch.full_like(got, 0x5A5A5A5A)
    ws.launch(q8, w8, kp, ks, got, key_len, pcu, PT, W, I, **launch)
    it._logits_planar(q8, w8, kp, ks, want, PT, key_len, pcu, PT, W, I, bq=2, bk=64, warps=4,
                      stages=3, tma=False)
    valid = torch.arange(PT, device="cuda")[None, :] < key_len[:, None]
    assert torch.equal(got[valid], want[valid])
    assert (got[~valid] == 0x5A5A5A5A).all()  # nothing past a row's keys written
    # against the reference's float64 scores of the same keys (its own remap of the gather),
    # compared as floats (a sum of -0.0 terms is -0.0 in both, whose keys differ by one)
    rows, _ = ref.prefill_key_rows(key_len.cpu(), pcu.cpu(), PT, W, I, PT)
    s = ref.indexer_scores(q.cpu().double(), w.cpu(), k.cpu(), rows)
    scores = torch.where(got < 0, got ^ 0x7FFFFFFF, got).view(torch.float32).cpu()
    assert torch.equal(scores[valid.cpu()].double(), s[valid.cpu()])


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
def test_prefill_indexer_takes_the_ws_logits_and_equals_the_reference():
    """The whole prefill indexer with the Gluon logits (the query quantised in the kernel or
    before it) and with the Triton logits: each equals the reference bit for bit."""
    from cpplan.runtime.kernels.triton import indexer_tiled as it

    T, HI, N, topk = 512, 64, 8192, 2048
    q, w, k, _, _ = _case(T, HI, N, 1, 1, seed=5)
    key_len = torch.arange(N - T + 1, N + 1, device="cuda")
    pcu = torch.zeros(T, dtype=torch.int64, device="cuda")
    on = it.IndexerTiles(ws_min_keys=N)
    assert it.ws_logits(q, 1, 1, N, on) is not None
    assert it.ws_logits(q, 1, 1, N - 1, on) is None and it.ws_logits(q, 2, 1, N, on) is None
    want = ref.indexer_topk_prefill(q.float(), w, k, key_len, pcu, N, 1, 1, topk, max_keys=N)
    # the query quantised by its own launch (the default), in the Gluon kernel (by the loader's
    # warpgroup or by each math warpgroup, as it copies the fp8 query too), or Triton's
    for tiles in (on, it.IndexerTiles(ws_min_keys=N, ws_quantise=True),
                  it.IndexerTiles(ws_min_keys=N, ws_math_stage=True),
                  it.IndexerTiles(ws_min_keys=N, ws_quantise=True, ws_math_stage=True),
                  it.IndexerTiles(ws_min_keys=N, ws_unroll=False),
                  it.IndexerTiles(logits_ws=False)):
        s, ids = it.indexer_topk_prefill(q, w, k, key_len, pcu, N, 1, 1, topk, max_keys=N,
                                         tiles=tiles)
        assert torch.equal(ids.cpu(), want[1].cpu()) and torch.equal(s.cpu(), want[0].cpu())


def _makespan(lengths, sms):
    """Greedy list scheduling (each CTA, in order, to the SM free first): the last end."""
    import heapq

    free = [0] * sms
    for x in lengths:
        heapq.heappush(free, heapq.heappop(free) + x)
    return max(free)


@pytest.mark.parametrize("sms", [132, 4, 7])
def test_last_wave_split_ends_soonest(sms):
    """``last_wave_split`` against a brute force: every part count 1..8 of the blocks past the
    last whole wave scheduled greedily (blocks of equal work, parts of 1/p); the chosen
    count's makespan is the least (the fewest parts on a tie), and none where it is 1."""
    from fractions import Fraction

    ws = _gluon()
    for blocks in list(range(1, 3 * sms + 2)) + [683, 1024, 2048]:
        rest = blocks % sms
        spans = {p: _makespan([Fraction(1)] * (blocks - rest) + [Fraction(1, p)] * (rest * p),
                              sms) for p in range(1, 9)}
        best = min(spans, key=lambda p: (spans[p], p))
        whole, parts = ws.last_wave_split(blocks, sms)
        assert (whole, parts) == ((blocks, 1) if best == 1 else (blocks - rest, best)), blocks
        assert ws.last_wave_split(blocks, sms, 1) == (blocks, 1)
        if rest:
            assert ws.last_wave_split(blocks, sms, 3) == (blocks - rest, 3)


def test_tiles_give_the_launch_its_knobs():
    """``IndexerTiles.ws_launch_options``: the tiles' knobs as ``launch``'s keywords, the
    quad sums scattered only at 2 queries a math warpgroup and the math warpgroups copying
    their own queries only where they split them (``launch`` refuses other shapes)."""
    from cpplan.runtime.kernels.triton import indexer_tiled as it

    ws = _gluon()
    opts = it.IndexerTiles().ws_launch_options()
    assert opts == {"block_q": 2, "math_warpgroups": 3, "stages": 4, "split": True,
                    "scatter": True, "math_stage": False, "unroll": True,
                    "thread_arrive": False}
    assert set(opts) <= set(ws.launch.__kwdefaults__)
    wide = it.IndexerTiles(ws_block_q=4, ws_math_warpgroups=2, ws_split=False,
                           ws_math_stage=True)
    assert wide.ws_launch_options()["scatter"] is False
    assert wide.ws_launch_options()["math_stage"] is False  # only where the queries are split


def test_ws_logits_layouts_and_refusals():
    ws = _gluon()
    assert ws.supported(1, 1, 64, 4) and ws.supported(2, 64, 64, 4) and ws.supported(4, 128, 64, 2)
    assert not ws.supported(2, 1, 64, 4)       # interleave 1: a box spans four ranks' rows
    assert not ws.supported(2, 32, 64, 4)      # half a box a rank
    assert not ws.supported(1, 1, 128, 4)      # 512 columns
    assert ws.supported(1, 1, 128, 2)          # 256
    q8 = torch.zeros(4, 64, 128)
    with pytest.raises(ValueError, match=r"got W 2, interleave 1.*expected one rank"):
        ws.launch(q8, None, None, None, None, None, None, 16, 2, 1)
    with pytest.raises(ValueError, match="5 math warpgroups"):
        ws.launch(q8, None, None, None, None, None, None, 16, 1, 1, block_q=1,
                  math_warpgroups=5)
    with pytest.raises(ValueError, match="128 at 3 or 4 math warpgroups"):  # 256 columns
        ws.launch(q8, None, None, None, None, None, None, 16, 1, 1, math_warpgroups=3)
    with pytest.raises(ValueError, match="pipelined: got 2 math warpgroups, 256 columns"):
        ws.launch(q8, None, None, None, None, None, None, 16, 1, 1, pipelined=True)
    with pytest.raises(ValueError, match="pipelined: got 4 math warpgroups"):
        ws.launch(q8, None, None, None, None, None, None, 16, 1, 1, block_q=2,
                  math_warpgroups=4, pipelined=True)
    with pytest.raises(ValueError, match="scatter: got block_q 4"):
        ws.launch(q8, None, None, None, None, None, None, 16, 1, 1, scatter=True)
    with pytest.raises(ValueError, match=">= 2 stages"):
        ws.launch(q8, None, None, None, None, None, None, 16, 1, 1, stages=1)
    with pytest.raises(ValueError, match=r"math_stage: got split False; expected split"):
        ws.launch(q8, None, None, None, None, None, None, 16, 1, 1, math_stage=True)
    with pytest.raises(ValueError, match=r"got pipelined and unroll; expected unroll with the "
                                         r"waited pass only"):
        ws.launch(q8, None, None, None, None, None, None, 16, 1, 1, block_q=2, pipelined=True,
                  unroll=True)


def _sass_ws(*flags: str) -> str:
    """``bench/sass.py --ws`` with these flags (an offline sm_90 compile with this Triton, in a
    process without the interpreter): its stdout; skipped where Triton has no Gluon."""
    import sys
    from pathlib import Path

    _gluon()
    try:
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"no Gluon AST source in this Triton: {e}")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns while it is unset
    out = subprocess.run([sys.executable, str(root / "bench" / "sass.py"), "--ws", *flags],
                         capture_output=True, text=True, env=env, cwd=root, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("bq,nm,no_spill,pipe,split,scatter,quant,stage", [
    (4, 2, True, False, False, False, False, False), (2, 4, False, False, False, False, False, False),
    (2, 2, True, True, False, False, False, False), (2, 3, True, False, True, False, False, False),
    (2, 3, True, False, True, True, False, False), (2, 3, True, False, True, True, True, False),
    (2, 3, True, False, True, True, True, True)])
def test_ws_logits_compile_for_sm90_without_spills(bq, nm, no_spill, pipe, split, scatter,
                                                   quant, stage):
    """``bench/sass.py --ws`` (an offline sm_90 compile with this Triton; a process without
    the interpreter): the products m64n{64 bq}k32 on fp8, the math warpgroups raised to their
    register budget and, for the default configuration, no spill in the math loop (at 4 math
    warpgroups of 112 registers Triton 3.9 leaves one reload in it, 3.6 none) and for three
    warpgroups splitting the queries. Pipelined, some waits leave a product in flight: ptxas
    did not serialise the wgmmas. With the query quantised in the prologue (the default
    configuration's launch), no spill anywhere in the kernel, also where each math warpgroup
    quantises its own queries (``--math-stage``)."""
    ws = _gluon()
    text = _sass_ws("--bq", str(bq), "--math-warpgroups", str(nm), *["--pipelined"] * pipe,
                    *["--split"] * split, *["--scatter"] * scatter, *["--quant"] * quant,
                    *["--math-stage"] * stage)
    assert f"products m64n{64 * bq}k32;" in text, text
    assert f"inc {ws._REGISTERS[nm][1]}" in text, text
    waits = re.search(r"wgmma waits: (\d+) for all products but one, (\d+) for all", text)
    assert waits and (int(waits.group(1)) > 0) == pipe, text
    loop = re.search(r"math loop: ([\d.]+) instructions a thread a tile: (.*)", text)
    assert loop and float(loop.group(1)) > 0, text
    if no_spill:
        assert " LDL" not in loop.group(2) and " STL" not in loop.group(2), text
    if quant:
        assert "query quantised in the kernel" in text and "spill instructions 0," in text, text
    assert ("queries copied by the math warpgroups" in text) == stage, text


@pytest.mark.slow
def test_ws_logits_unroll_takes_fewer_instructions_a_tile():
    """``bench/sass.py --ws`` at the default configuration (3 x 2 split queries, quad sums
    scattered) compiled for sm_90 offline as it is and unrolled by the ring's stages: no
    spills either way, and the unrolled math loop takes fewer instructions a thread a tile
    (the stage and phase arithmetic a tile is what it removes)."""
    per_tile = {}
    for flags in ((), ("--unroll",)):
        text = _sass_ws("--bq", "2", "--math-warpgroups", "3", "--split", "--scatter", *flags)
        assert "spill instructions 0," in text, text
        loop = re.search(r"math loop: ([\d.]+) instructions a thread a tile", text)
        assert loop, text
        per_tile[flags] = float(loop.group(1))
    assert per_tile[("--unroll",)] < per_tile[()], per_tile
