"""Jitted body of the warp-specialised prefill indexer logits (Gluon, sm_90).

Same contract as ``triton/indexer_logits_jit.logits_planar_kernel`` (fp8 key planes, the
fp8-quantised query, ReLU, head weights, the sum over each query's heads, the per-key
power-of-two scale; docs/design.md §4.3), the same int32 keys wherever the sums are exact
(which of a thread's first two products the compiler rounds before its fused add can differ
between the kernels and epilogues, so can a continuous score's last bit). In the Triton
kernel each 4-warp program reads its own key tiles and multiplies them by a B operand of two
queries (N 128). Here, one CTA a SM at a time:

- a loader warpgroup (one thread issues) copies key tiles of ``NM x 64`` keys by TMA (one box
  of 64 rows per math warpgroup) into a ring of ``NS`` stages, each stage an mbarrier "ready"
  (the copies' bytes) and an mbarrier "free" (one arrive per math warpgroup once its product
  has read it);
- ``NM`` math warpgroups each take their 64 keys of every tile: one product
  ``K [64, 128] @ Q^T [128, BQ x HP]`` of all ``BQ`` queries of the block (N up to 256; the B
  operand, the block's queries, stays in shared memory for the whole loop), waited on, then
  the epilogue in registers (ReLU, weights, the sum over heads within a thread and a quad,
  the scale loaded a tile ahead) stored straight from the accumulator's layout; the
  warpgroups run out of phase, one's epilogue under another's product;
- ``EPI`` 2 (BQ 2, ``IndexerTiles.ws_scatter``, the default): a quad's four lanes hold the
  same two keys x two queries, each lane its own columns' partial sums; instead of all four
  reducing all four (8 shuffles and adds, then four stores a thread of which three masked),
  the partials go through a warp's 512 bytes of shared memory transposed (``QUAD_T``: one
  store, one ldmatrix) and each lane adds up one (key, query), scales and stores it: 50
  instructions a thread a tile fewer (ReLU and the weighted sums are 128 of the 180 that
  ``bench/sass.py --ws --unroll`` counts in the default's math loop);
- ``SPLIT`` (the default of ``indexer_tiled.IndexerTiles``, 3 x 2 queries): the math
  warpgroups split the CTA's queries instead of its keys: ``NM x BQ`` queries a CTA, tiles of
  one box of 64 keys that every math warpgroup multiplies by its own BQ queries (its slice of
  the B operands), the free barrier counting NM arrivals as before;
- the grid's last partial wave cut: the first F CTAs take a block each (the longest first),
  the blocks left P CTAs each, a P-th of their key tiles each (the launcher's
  ``last_wave_split``), so that a chunk does not end on a nearly empty wave;
- register budget: the math warpgroups take ``MATH_REGS`` registers a thread, the loader what
  is left (``gl.warp_specialize``'s ``setmaxnreg``; the launcher caps the kernel so that they
  add up);
- ``QUANT``: the CTA's queries arrive unquantised and are quantised as they are copied into
  shared memory, a block's rows (query, head) at a time (the maximum over each row, its
  power-of-two exponent, the fp8 values by the hardware's round-to-nearest-even conversion;
  no spills at any shape's register cap), each row's weight times its scale kept in shared
  memory for the math warpgroups: what ``triton/pack_jit.quantize_q_fp8`` writes, bit for
  bit, without that launch;
- ``STAGE`` (with SPLIT): each math warpgroup copies (with QUANT quantises) its own queries as
  it starts, then waits on its partition's named barrier, under the loader's first key copies;
  without it the loader's warpgroup copies every block's rows before the partitions start.
  Neither QUANT nor STAGE is a clear gain at T 4096 x N 32768 (bench/RESULTS.md, "thirty-sixth
  session"): the copy is not where the kernel's time goes.
- ``UNROLL`` (the waited pass): a trip of NS tiles, one a ring stage, in straight-line code, so
  each stage's barriers and shared-memory descriptors are compile-time constants instead of
  computed from the ring's count every tile (the tiles before the pass's first stage 0 and
  after its last whole trip one at a time; ``IndexerTiles.ws_unroll``, on by default).
  Offline (Triton 3.6, ``bench/sass.py --ws``) the loop a tile a trip takes 189 instructions a
  thread a tile, UNROLL's 180 (132 of them the ReLU, weights, sums and scale); the whole
  indexer 1.3-3.4% faster on one H100 (bench/RESULTS.md, "thirty-eighth session").
- ``TARRIVE``: a math warpgroup frees a ring stage by an arrive of each of its threads
  (``cp.async.mbarrier.arrive.noinc``: nothing in flight, so at once; the free barriers count
  128 a math warpgroup) instead of ``mbarrier.arrive``'s thread 0 after a barrier of the
  warpgroup's 128 threads: one named barrier a tile fewer (``IndexerTiles.ws_thread_arrive``,
  off: no faster on one H100, the whole indexer 0.2-0.8% slower; bench/RESULTS.md, "fortieth
  session").

Measured on the H200 (bench/RESULTS.md, "the warp-specialised Gluon prefill logits", "the
math warpgroups split the queries" and "the quad sums scattered"): with the epilogue replaced
by a column maximum the schedule runs at 1350 TFLOP/s-eq, so the tensor cores idle a fifth to
a third of the time even then. 3 x 2 split queries, last wave cut, quad sums scattered: T 4096
x N 32768 in 1728 us (1193 TFLOP/s-eq; all-reduced 1902, 2 x 4 queries splitting keys with a
whole last wave 1972). ``PIPE`` (two accumulators of 128 columns, the next product issued
before each epilogue; the loop shaped so that ptxas keeps the wgmmas asynchronous) is 14%
faster than waiting at 2 queries a CTA but still 4% slower than 4 (bench/RESULTS.md,
"twenty-third session").

A block across a request boundary (rare) takes one pass per query, as in the Triton kernel;
tiles past a query's keys are multiplied (TMA reads rows past the plane as 0) and never
stored. Tiles must be runs of consecutive plane rows: one rank, or an interleave that 64
divides (the launcher checks). Launched by ``indexer_logits.py``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..fp8_jit import group_exponent, scale_bits, scale_by_pow2

# a TMA copy into shared memory: ``async_load`` in Triton 3.9, ``async_copy_global_to_shared``
# before (3.6, the GPU image's)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# a barrier of the CTA's threads: ``thread_barrier`` in Triton 3.6, ``barrier`` in 3.9
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
QL = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))  # a warpgroup's
# copy of query rows: 16 bytes of fp8 (32 of bf16) a load
SUB = gl.constexpr(64)  # keys a math warpgroup multiplies a tile: the M of one wgmma
# EPI 2's layout of a tile's [64 keys, 2 queries, 4] partial sums over heads after the
# transpose within each quad: a thread's 4 registers hold the 4 partials of one (key, query),
# whose accumulator columns the quad's lanes held; lane bit 0 picks the key of the pair
# (k, k + 8) a thread held, lane bit 1 the query; lanes 4 x 8 and the 4 warps the key as in the
# wgmma accumulator (rows 16 w + l // 4 and + 8)
QUAD_T = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2]],
    lane_bases=[[8, 0, 0], [0, 1, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 2, 4]))


@gluon.jit
def _prefill_rows(c, pcu, PT, W: gl.constexpr, I: gl.constexpr):
    """Plane row of key position c of a request whose region starts at pcu (the gather
    chunk's remap, as ``triton/indexer_logits_jit._prefill_rows``)."""
    g = c // I
    return (g % W) * PT + pcu + (g // W) * I + c % I


@gluon.jit
def _pass_start(qi, pcu_ptr, j0, T, p_lo, shared):
    """Region start of pass qi: the block's request (shared), else query qi's own."""
    own = gl.load(pcu_ptr + j0 + qi, mask=j0 + qi < T, other=0).to(gl.int64)
    return gl.where(shared, p_lo, own)


@gluon.jit
def _loader(kdesc, ring, ready, free, pcu_ptr, j0, T, PT, t_lo, t_hi, p_lo, shared,
            W: gl.constexpr, I: gl.constexpr, CQ: gl.constexpr, NB: gl.constexpr,
            NS: gl.constexpr):
    """The CTA's first warpgroup (one thread issues the copies): every tile's NB boxes of 64
    key rows into ring stage ``it % NS`` once the math warpgroups have freed it (the first NS
    stages are free from the start): the CTA's tiles t_lo .. t_hi - 1; CQ: the CTA's queries
    (a pass each where they are not one request's)."""
    it = 0
    for qi in range(gl.where(shared, 1, CQ)):
        pq = _pass_start(qi, pcu_ptr, j0, T, p_lo, shared)
        for t in range(t_lo, t_hi):
            s = it % NS
            mbarrier.wait(free.index(s), ((it // NS) & 1) ^ 1)
            mbarrier.expect(ready.index(s), NB * kdesc.block_type.nbytes)
            for m in gl.static_range(NB):
                r = _prefill_rows(t * (NB * SUB) + m * SUB, pq, PT, W, I)
                _tma_load(kdesc, [r.to(gl.int32), 0], ready.index(s), ring.index(s * NB + m))
            it += 1


@gluon.jit
def _product(ring, ready, q_smem, zero, it, NB: gl.constexpr, NS: gl.constexpr,
             BX: gl.constexpr):
    """Issue (asynchronously) the product of ring tile ``it``'s box BX (64 keys) with the
    warpgroup's queries ``q_smem``, once the tile has landed."""
    s = it % NS
    mbarrier.wait(ready.index(s), (it // NS) & 1)
    return warpgroup_mma(ring.index(s * NB + BX), q_smem.permute((1, 0)), zero, use_acc=False,
                         is_async=True)


@gluon.jit
def _release(bar, TARRIVE: gl.constexpr):
    """A math warpgroup done reading a ring stage (its product waited on): one arrive by the
    warpgroup's thread 0 after a barrier of its 128 threads (``mbarrier.arrive``'s lowering),
    or with TARRIVE an arrive by every thread and no barrier (``cp.async.mbarrier.arrive
    .noinc``: none of these threads has a copy in flight, so it arrives at once; the free
    barriers then count 128 arrivals a math warpgroup)."""
    if TARRIVE:
        async_copy.mbarrier_arrive(bar, increment_count=False)
    else:
        mbarrier.arrive(bar, count=1)


@gluon.jit
def _scales(ks_ptr, c, hi, pq, PT, W: gl.constexpr, I: gl.constexpr):
    """The float32 scales of key positions c (0 past hi)."""
    live = c < hi
    return gl.load(ks_ptr + gl.where(live, _prefill_rows(c, pq, PT, W, I), 0), mask=live,
                   other=0.0)


@gluon.jit
def _finish(acc, w, scale, c, n, mine, optr, BQ: gl.constexpr, HP: gl.constexpr,
            EPI: gl.constexpr):
    """A finished product's int32 keys stored: ReLU, head weights, the sum over each query's
    heads (within a thread, then a quad), the key's scale (a positive power of two: exact after
    the sum), the order-preserving bits. EPI 2 (BQ 2): the quad's partial sums transposed
    (``QUAD_T``), each lane finishing one (key, query). EPI 0 (a probe of the products' bound,
    wrong keys): a per-column maximum computed, stored nowhere."""
    if EPI == 2:  # the quad's sums scattered: a lane stores one (key, query) of four
        x = gl.reshape(gl.maximum(acc, 0.0) * w[None, :], [acc.shape[0], BQ, HP // 8, 4, 2])
        x = gl.reshape(gl.permute(x, [0, 1, 3, 2, 4]), [acc.shape[0], BQ, 4, HP // 4])
        # a thread's partial sums (its columns in order), then each quad's transposed
        x = gl.convert_layout(gl.sum(x, 3), QUAD_T)
        # (p0 + p2) + (p1 + p3), the butterfly's order (xor 2, then xor 1)
        x = gl.sum(gl.sum(gl.reshape(x, [acc.shape[0], BQ, 2, 2]), 2), 2)
        bits = (x * scale[:, None]).to(gl.int32, bitcast=True)
        keys = gl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        gl.store(optr + c[:, None], keys, mask=(c[:, None] < n[None, :]) & mine[None, :])
    elif EPI:
        x = gl.sum(gl.reshape(gl.maximum(acc, 0.0) * w[None, :], [acc.shape[0], BQ, HP]), 2)
        bits = (x * scale[:, None]).to(gl.int32, bitcast=True)
        keys = gl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        gl.store(optr + c[:, None], keys, mask=(c[:, None] < n[None, :]) & mine[None, :])
    else:  # stored where a maximum equals a value no product takes: never, not provably
        x = gl.max(gl.reshape(acc, [acc.shape[0], BQ, HP]), 2)
        gl.store(optr + c[:, None], x.to(gl.int32, bitcast=True), mask=x == 0.123456789)


@gluon.jit
def _stage_queries(q_ptr, w_ptr, q_dst, w_dst, j, T, HI, stride_qt, stride_qh, stride_wt,
                   BQ: gl.constexpr, HP: gl.constexpr, QUANT: gl.constexpr):
    """Queries j .. j + BQ - 1 into ``q_dst [BQ x HP, 128]`` (query-major; padded heads and
    queries past T: 0) by one warpgroup; with QUANT the unquantised rows quantised on the way
    (each row's maximum, its power-of-two exponent, the hardware's round-to-nearest-even fp8)
    and each row's weight times its scale into ``w_dst [BQ x HP]``, as
    ``triton/pack_jit.quantize_q_fp8`` writes them."""
    N: gl.constexpr = BQ * HP
    r = gl.arange(0, N, layout=gl.SliceLayout(1, QL))
    d = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
    jr = j + r // HP
    hr = r % HP
    live = (hr < HI) & (jr < T)
    q = gl.load(q_ptr + jr.to(gl.int64)[:, None] * stride_qt + hr[:, None] * stride_qh
                + d[None, :], mask=live[:, None], other=0.0)
    if QUANT:  # the fp8 values and the weight times 2**e (pack_jit.quantize_q_fp8's)
        x = q.to(gl.float32)
        e = group_exponent(gl.max(gl.abs(x), 1))
        q = scale_by_pow2(x, -e[:, None]).to(gl.float8e4nv)
        wr = gl.load(w_ptr + jr.to(gl.int64) * stride_wt + hr, mask=live, other=0.0)
        w_dst.store(wr.to(gl.float32) * scale_bits(e).to(gl.float32, bitcast=True))
    q_dst.store(q)


@gluon.jit
def _math(q_ptr, q_smem, w_smem, ring, ready, free, w_ptr, ks_ptr, out_ptr, len_ptr, pcu_ptr, j0,
          T, HI, PT, stride_qt, stride_qh, stride_wt, stride_ot, hi, t_lo, t_hi, p_lo, shared,
          W: gl.constexpr, I: gl.constexpr, BQ: gl.constexpr, HP: gl.constexpr,
          NM: gl.constexpr, NS: gl.constexpr, EPI: gl.constexpr, PIPE: gl.constexpr,
          SPLIT: gl.constexpr, QUANT: gl.constexpr, STAGE: gl.constexpr, UNROLL: gl.constexpr,
          TARRIVE: gl.constexpr, WG: gl.constexpr):
    """Math warpgroup WG: keys WG x 64 .. WG x 64 + 63 of every tile and all BQ queries, or
    with SPLIT all 64 keys of every tile and queries WG x BQ .. WG x BQ + BQ - 1; a pass a
    request (``_pass_waited``, or with PIPE ``_pass_pipelined``). Its head weights from
    ``w_ptr``, or with QUANT the prologue's (scales folded in) from ``w_smem``."""
    N: gl.constexpr = BQ * HP
    NB: gl.constexpr = 1 if SPLIT else NM  # boxes a tile
    BX: gl.constexpr = 0 if SPLIT else WG  # the warpgroup's box
    Q0: gl.constexpr = WG * BQ if SPLIT else 0  # its first query in the CTA
    CQ: gl.constexpr = NM * BQ if SPLIT else BQ  # the CTA's queries
    q_mine = q_smem.index(WG if SPLIT else 0)
    if STAGE:  # its own queries into its B operand, while the loader's first copies fly
        _stage_queries(q_ptr, w_ptr, q_mine, w_smem.index(WG), j0 + Q0, T, HI, stride_qt,
                       stride_qh, stride_wt, BQ, HP, QUANT)
        fence_async_shared()  # the stores, seen by the products' async proxy ...
        _cta_barrier()  # ... once all 4 warps made them (in a partition: its named barrier)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, N, 32])
    zero = gl.zeros([SUB, N], gl.float32, layout=MMA)
    # the layout of a tile's [64, BQ] scores (the products summed over heads)
    S_L: gl.constexpr = gl.sum(gl.sum(gl.reshape(gl.zeros([SUB, BQ, 4], gl.float32,
                                                          layout=QUAD_T),
                                                 [SUB, BQ, 2, 2]), 2), 2).type.layout \
        if EPI == 2 else gl.sum(gl.reshape(zero, [SUB, BQ, HP]), 2).type.layout
    KEY: gl.constexpr = gl.SliceLayout(1, S_L)
    LQ: gl.constexpr = gl.SliceLayout(0, S_L)
    if QUANT:
        w = w_smem.index(WG if SPLIT else 0).load(gl.SliceLayout(0, MMA))
    else:
        rw = gl.arange(0, N, layout=gl.SliceLayout(0, MMA))
        jw = j0 + Q0 + rw // HP
        hw = rw % HP
        w = gl.load(w_ptr + jw.to(gl.int64) * stride_wt + hw, mask=(hw < HI) & (jw < T),
                    other=0.0)
    jb = Q0 + gl.arange(0, BQ, layout=LQ)  # the warpgroup's queries in the CTA
    n = gl.load(len_ptr + j0 + jb, mask=j0 + jb < T, other=0).to(gl.int32)
    optr = out_ptr + (j0 + jb).to(gl.int64)[None, :] * stride_ot
    k0 = BX * SUB + gl.arange(0, SUB, layout=KEY)
    it = 0
    for qi in range(gl.where(shared, 1, CQ)):
        pq = _pass_start(qi, pcu_ptr, j0, T, p_lo, shared)
        mine = (jb == qi) | shared  # the pass's queries: all if shared
        if PIPE:
            it = _pass_pipelined(ring, ready, free, q_mine, zero, w, ks_ptr, optr, n, mine, k0,
                                 t_lo, t_hi, it, pq, hi, PT, W, I, BQ, HP, NB, NS, EPI, BX,
                                 TARRIVE)
        else:
            it = _pass_waited(ring, ready, free, q_mine, zero, w, ks_ptr, optr, n, mine, k0,
                              t_lo, t_hi, it, pq, hi, PT, W, I, BQ, HP, NB, NS, EPI, BX, UNROLL,
                              TARRIVE)


@gluon.jit
def _tile_waited(ring, ready, free, q_smem, zero, w, ks_ptr, optr, n, mine, c, s, ph, scale, pq,
                 hi, PT, W: gl.constexpr, I: gl.constexpr, BQ: gl.constexpr, HP: gl.constexpr,
                 NB: gl.constexpr, EPI: gl.constexpr, BX: gl.constexpr, TARRIVE: gl.constexpr):
    """One tile of a waited pass (keys c, ring stage s at phase ph): the product issued once
    the tile has landed, the next tile's scales loaded under it, the product waited on, the
    stage freed, the epilogue; returns the next tile's scales. s is a constexpr in an unrolled
    trip (the stage's descriptors and barriers then fixed at compile time)."""
    mbarrier.wait(ready.index(s), ph)
    acc = warpgroup_mma(ring.index(s * NB + BX), q_smem.permute((1, 0)), zero, use_acc=False,
                        is_async=True)
    scale_nxt = _scales(ks_ptr, c + NB * SUB, hi, pq, PT, W, I)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    _release(free.index(s), TARRIVE)
    _finish(acc, w, scale, c, n, mine, optr, BQ, HP, EPI)
    return scale_nxt


@gluon.jit
def _pass_waited(ring, ready, free, q_smem, zero, w, ks_ptr, optr, n, mine, k0, t_lo, t_hi, it,
                 pq, hi, PT, W: gl.constexpr, I: gl.constexpr, BQ: gl.constexpr,
                 HP: gl.constexpr, NB: gl.constexpr, NS: gl.constexpr, EPI: gl.constexpr,
                 BX: gl.constexpr, UNROLL: gl.constexpr, TARRIVE: gl.constexpr):
    """One pass of a math warpgroup over its keys of tiles t_lo .. t_hi - 1, each product
    waited on before its epilogue (the next tile's scales loaded under it); returns the ring's
    count past the pass. UNROLL: the tiles from the first at ring stage 0 on run NS a trip,
    stage by stage in straight-line code (no stage or phase arithmetic a tile; the tiles
    before and after it one at a time)."""
    scale = _scales(ks_ptr, t_lo * (NB * SUB) + k0, hi, pq, PT, W, I)
    c = t_lo * (NB * SUB) + k0
    # one at a time: with UNROLL the tiles up to ring stage 0, else all of them
    head = gl.minimum((NS - it % NS) % NS, t_hi - t_lo) if UNROLL else t_hi - t_lo
    for _ in range(head):
        scale = _tile_waited(ring, ready, free, q_smem, zero, w, ks_ptr, optr, n, mine, c,
                             it % NS, (it // NS) & 1, scale, pq, hi, PT, W, I, BQ, HP, NB, EPI,
                             BX, TARRIVE)
        c = c + NB * SUB
        it += 1
    if UNROLL:  # whole trips of NS tiles from stage 0, then the rest
        for _ in range((t_hi - t_lo - head) // NS):
            ph = (it // NS) & 1
            for s in gl.static_range(NS):
                scale = _tile_waited(ring, ready, free, q_smem, zero, w, ks_ptr, optr, n, mine,
                                     c, s, ph, scale, pq, hi, PT, W, I, BQ, HP, NB, EPI, BX,
                                     TARRIVE)
                c = c + NB * SUB
            it += NS
        for _ in range((t_hi - t_lo - head) % NS):
            scale = _tile_waited(ring, ready, free, q_smem, zero, w, ks_ptr, optr, n, mine, c,
                                 it % NS, (it // NS) & 1, scale, pq, hi, PT, W, I, BQ, HP, NB,
                                 EPI, BX, TARRIVE)
            c = c + NB * SUB
            it += 1
    return it


@gluon.jit
def _pass_pipelined(ring, ready, free, q_smem, zero, w, ks_ptr, optr, n, mine, k0, t_lo, t_hi,
                    it, pq, hi, PT, W: gl.constexpr, I: gl.constexpr, BQ: gl.constexpr,
                    HP: gl.constexpr, NB: gl.constexpr, NS: gl.constexpr, EPI: gl.constexpr,
                    BX: gl.constexpr, TARRIVE: gl.constexpr):
    """The same pass with two accumulators: four tiles a trip, each product but the trip's
    last issued before the epilogue of the one before it; then the rest one at a time. No
    product in flight crosses the loop's back edge: reading an accumulator that did (even
    after the wait that retires it) makes ptxas serialise every wgmma of the kernel (C7514,
    "non wgmma instructions reading accumulator registers")."""
    c = t_lo * (NB * SUB) + k0
    tiles = t_hi - t_lo
    for _ in range(tiles // 4):
        a = _product(ring, ready, q_smem, zero, it, NB, NS, BX)
        sa = _scales(ks_ptr, c, hi, pq, PT, W, I)
        b = _product(ring, ready, q_smem, zero, it + 1, NB, NS, BX)
        sb = _scales(ks_ptr, c + NB * SUB, hi, pq, PT, W, I)
        a = warpgroup_mma_wait(num_outstanding=1, deps=(a,))
        _release(free.index(it % NS), TARRIVE)
        _finish(a, w, sa, c, n, mine, optr, BQ, HP, EPI)
        a = _product(ring, ready, q_smem, zero, it + 2, NB, NS, BX)
        sa = _scales(ks_ptr, c + 2 * NB * SUB, hi, pq, PT, W, I)
        b = warpgroup_mma_wait(num_outstanding=1, deps=(b,))
        _release(free.index((it + 1) % NS), TARRIVE)
        _finish(b, w, sb, c + NB * SUB, n, mine, optr, BQ, HP, EPI)
        b = _product(ring, ready, q_smem, zero, it + 3, NB, NS, BX)
        sb = _scales(ks_ptr, c + 3 * NB * SUB, hi, pq, PT, W, I)
        a = warpgroup_mma_wait(num_outstanding=1, deps=(a,))
        _release(free.index((it + 2) % NS), TARRIVE)
        _finish(a, w, sa, c + 2 * NB * SUB, n, mine, optr, BQ, HP, EPI)
        b = warpgroup_mma_wait(num_outstanding=0, deps=(b,))
        _release(free.index((it + 3) % NS), TARRIVE)
        _finish(b, w, sb, c + 3 * NB * SUB, n, mine, optr, BQ, HP, EPI)
        c = c + 4 * NB * SUB
        it += 4
    for _ in range(tiles // 4 * 4, tiles):
        a = _product(ring, ready, q_smem, zero, it, NB, NS, BX)
        sa = _scales(ks_ptr, c, hi, pq, PT, W, I)
        a = warpgroup_mma_wait(num_outstanding=0, deps=(a,))
        _release(free.index(it % NS), TARRIVE)
        _finish(a, w, sa, c, n, mine, optr, BQ, HP, EPI)
        c = c + NB * SUB
        it += 1
    return it


@gluon.jit(do_not_specialize=["len_ptr", "pcu_ptr", "T", "PT", "F", "P"])
def ws_logits_kernel(q_ptr, w_ptr, kdesc, ks_ptr, out_ptr, len_ptr, pcu_ptr,
                     stride_qt, stride_qh, stride_wt, stride_ot, T, HI, PT, F, P,
                     W: gl.constexpr, I: gl.constexpr, BQ: gl.constexpr, HP: gl.constexpr,
                     NM: gl.constexpr, NS: gl.constexpr, MATH_REGS: gl.constexpr,
                     CQP: gl.constexpr, EPI: gl.constexpr = True, PIPE: gl.constexpr = False,
                     SPLIT: gl.constexpr = False, QUANT: gl.constexpr = False,
                     STAGE: gl.constexpr = False, UNROLL: gl.constexpr = False,
                     TARRIVE: gl.constexpr = False):
    """One CTA a block of BQ queries, or with SPLIT NM x BQ (the last blocks first: a
    prefill's later queries have the most keys, longest processing time first). kdesc: a TMA
    descriptor over the value plane ``[R, 128]`` fp8 with boxes of ``[64, 128]``; CQP: the
    CTA's queries rounded up to a power of two. QUANT: q and w are the unquantised query (any
    float dtype) and head weights, quantised here as ``triton/pack.quantize_indexer_q`` does
    (fp8 e4m3 with one power-of-two scale per (query, head), folded into the weight), bit for
    bit; else q is that fp8 query and w the weights with the scales folded in. STAGE (SPLIT
    only): each math warpgroup copies its own queries as it starts, under the loader's first
    key copies, instead of the loader's warpgroup copying them all before the partitions."""
    gl.static_assert(SPLIT or not STAGE, "STAGE: the math warpgroups own their queries (SPLIT)")
    gl.static_assert(not (PIPE and UNROLL), "UNROLL: the waited pass only")
    N: gl.constexpr = BQ * HP  # a product's columns
    NB: gl.constexpr = 1 if SPLIT else NM  # boxes of 64 keys a tile
    CQ: gl.constexpr = NM * BQ if SPLIT else BQ  # the CTA's queries
    # CTAs 0 .. F - 1: the F last blocks whole (the longest keys first); then P CTAs a block,
    # each a P-th of its key tiles: the grid's last wave split so that it ends sooner
    pid = gl.program_id(0)
    past = gl.maximum(pid - F, 0)
    in_parts = pid >= F
    j0 = gl.where(in_parts, gl.cdiv(T, CQ) - 1 - F - past // P, gl.cdiv(T, CQ) - 1 - pid) * CQ
    part = gl.where(in_parts, past % P, 0)
    nparts = gl.where(in_parts, P, 1)
    # the CTA's queries, query-major (padded heads and queries past T: 0), as the B operands
    # (one a math warpgroup with SPLIT), copied N rows at a time
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [CQ // BQ, N, 128],
                                       gl.NVMMASharedLayout.get_default_for([N, 128],
                                                                            gl.float8e4nv))
    # with QUANT, the weights times the scales, a math warpgroup's N columns a row
    w_smem = gl.allocate_shared_memory(gl.float32, [CQ // BQ, N],
                                       gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if not STAGE:  # the loader's warpgroup copies every block's rows, one block at a time
        for g in gl.static_range(CQ // BQ):
            _stage_queries(q_ptr, w_ptr, q_smem.index(g), w_smem.index(g), j0 + g * BQ, T, HI,
                           stride_qt, stride_qh, stride_wt, BQ, HP, QUANT)
            if g + 1 < CQ // BQ:  # one block's copy in registers at a time
                _cta_barrier()
    ring = gl.allocate_shared_memory(gl.float8e4nv, [NS * NB, SUB, 128], kdesc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=NM * 128 if TARRIVE else NM)
    fence_async_shared()
    jq = j0 + gl.arange(0, CQP, layout=gl.SliceLayout(1, QL))
    live = (jq < T) & (jq < j0 + CQ)
    n = gl.load(len_ptr + jq, mask=live, other=0).to(gl.int32)
    pcu = gl.load(pcu_ptr + jq, mask=live, other=0).to(gl.int64)
    hi = gl.max(n, 0)  # the block's keys: its longest query's
    p_lo = gl.min(gl.where(n > 0, pcu, 9223372036854775807), 0)
    shared = gl.max(gl.where(n > 0, pcu, -1), 0) <= p_lo  # one request's keys serve every query
    tiles = gl.cdiv(hi, NB * SUB)  # the block's; the CTA's: its part of them
    per = gl.cdiv(tiles, nparts)
    t_lo = part * per
    t_hi = gl.minimum(tiles, t_lo + per)
    # the loader is the default partition (its warps are the CTA's first warpgroup), the math
    # warpgroups are workers. Each partition's arguments are written out: in Triton 3.6 a
    # tuple held in a variable, or built by concatenation, turns its constexprs into tensors.
    if NM == 2:
        gl.warp_specialize([
            (_loader, (kdesc, ring, ready, free, pcu_ptr, j0, T, PT, t_lo, t_hi, p_lo, shared, W,
                       I, CQ, NB, NS)),
            (_math, (q_ptr, q_smem, w_smem, ring, ready, free, w_ptr, ks_ptr, out_ptr, len_ptr,
                     pcu_ptr, j0, T, HI, PT, stride_qt, stride_qh, stride_wt, stride_ot, hi,
                     t_lo, t_hi, p_lo, shared, W, I, BQ, HP, NM, NS, EPI, PIPE, SPLIT, QUANT,
                     STAGE, UNROLL, TARRIVE, 0)),
            (_math, (q_ptr, q_smem, w_smem, ring, ready, free, w_ptr, ks_ptr, out_ptr, len_ptr,
                     pcu_ptr, j0, T, HI, PT, stride_qt, stride_qh, stride_wt, stride_ot, hi,
                     t_lo, t_hi, p_lo, shared, W, I, BQ, HP, NM, NS, EPI, PIPE, SPLIT, QUANT,
                     STAGE, UNROLL, TARRIVE, 1)),
        ], [4, 4], [MATH_REGS, MATH_REGS])
    elif NM == 3:
        gl.warp_specialize([
            (_loader, (kdesc, ring, ready, free, pcu_ptr, j0, T, PT, t_lo, t_hi, p_lo, shared, W,
                       I, CQ, NB, NS)),
            (_math, (q_ptr, q_smem, w_smem, ring, ready, free, w_ptr, ks_ptr, out_ptr, len_ptr,
                     pcu_ptr, j0, T, HI, PT, stride_qt, stride_qh, stride_wt, stride_ot, hi,
                     t_lo, t_hi, p_lo, shared, W, I, BQ, HP, NM, NS, EPI, PIPE, SPLIT, QUANT,
                     STAGE, UNROLL, TARRIVE, 0)),
            (_math, (q_ptr, q_smem, w_smem, ring, ready, free, w_ptr, ks_ptr, out_ptr, len_ptr,
                     pcu_ptr, j0, T, HI, PT, stride_qt, stride_qh, stride_wt, stride_ot, hi,
                     t_lo, t_hi, p_lo, shared, W, I, BQ, HP, NM, NS, EPI, PIPE, SPLIT, QUANT,
                     STAGE, UNROLL, TARRIVE, 1)),
            (_math, (q_ptr, q_smem, w_smem, ring, ready, free, w_ptr, ks_ptr, out_ptr, len_ptr,
                     pcu_ptr, j0, T, HI, PT, stride_qt, stride_qh, stride_wt, stride_ot, hi,
                     t_lo, t_hi, p_lo, shared, W, I, BQ, HP, NM, NS, EPI, PIPE, SPLIT, QUANT,
                     STAGE, UNROLL, TARRIVE, 2)),
        ], [4, 4, 4], [MATH_REGS, MATH_REGS, MATH_REGS])
    else:
        gl.static_assert(NM == 4, "NM: 2, 3 or 4 math warpgroups")
        gl.warp_specialize([
            (_loader, (kdesc, ring, ready, free, pcu_ptr, j0, T, PT, t_lo, t_hi, p_lo, shared, W,
                       I, CQ, NB, NS)),
            (_math, (q_ptr, q_smem, w_smem, ring, ready, free, w_ptr, ks_ptr, out_ptr, len_ptr,
                     pcu_ptr, j0, T, HI, PT, stride_qt, stride_qh, stride_wt, stride_ot, hi,
                     t_lo, t_hi, p_lo, shared, W, I, BQ, HP, NM, NS, EPI, PIPE, SPLIT, QUANT,
                     STAGE, UNROLL, TARRIVE, 0)),
            (_math, (q_ptr, q_smem, w_smem, ring, ready, free, w_ptr, ks_ptr, out_ptr, len_ptr,
                     pcu_ptr, j0, T, HI, PT, stride_qt, stride_qh, stride_wt, stride_ot, hi,
                     t_lo, t_hi, p_lo, shared, W, I, BQ, HP, NM, NS, EPI, PIPE, SPLIT, QUANT,
                     STAGE, UNROLL, TARRIVE, 1)),
            (_math, (q_ptr, q_smem, w_smem, ring, ready, free, w_ptr, ks_ptr, out_ptr, len_ptr,
                     pcu_ptr, j0, T, HI, PT, stride_qt, stride_qh, stride_wt, stride_ot, hi,
                     t_lo, t_hi, p_lo, shared, W, I, BQ, HP, NM, NS, EPI, PIPE, SPLIT, QUANT,
                     STAGE, UNROLL, TARRIVE, 2)),
            (_math, (q_ptr, q_smem, w_smem, ring, ready, free, w_ptr, ks_ptr, out_ptr, len_ptr,
                     pcu_ptr, j0, T, HI, PT, stride_qt, stride_qh, stride_wt, stride_ot, hi,
                     t_lo, t_hi, p_lo, shared, W, I, BQ, HP, NM, NS, EPI, PIPE, SPLIT, QUANT,
                     STAGE, UNROLL, TARRIVE, 3)),
        ], [4, 4, 4, 4], [MATH_REGS, MATH_REGS, MATH_REGS, MATH_REGS])
