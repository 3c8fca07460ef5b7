"""Jitted body of the Gluon prefill indexer logits (sm_90): products overlapped with epilogues.

Same contract and int32 keys as ``runtime/kernels/triton/indexer_logits_jit.logits_planar_kernel``
(fp8 key planes, the fp8-quantised query, ReLU, head weights, the sum over heads, the per-key
scale). Why Gluon: in the Triton kernel each ``wgmma`` is waited on right after it is issued,
so a program's tensor cores idle through its epilogue and its CUDA cores through its products.
Here the schedule is written out (on the H200 it is still slower than the Triton kernel:
bench/RESULTS.md, "The Gluon prefill logits, first run"):

- key tiles of BK keys are copied with ``cp.async`` (16 bytes a copy) into a ring of NS slots
  of shared memory, swizzled for the products;
- per tile, one product of both queries of the block (BQ 2), ``K [BK, 128] @ [Q_0; Q_1]^T
  [128, 2 HP]`` (one product per query reads each key tile twice from shared memory), is
  issued asynchronously; the program then waits only for the previous tile's product and runs
  its epilogue while the new one is on the tensor cores (two tiles of accumulators live), U tiles an iteration of straight-line code (U - 1 of U epilogues
  overlapped: a product in flight across iterations made ptxas serialise every ``wgmma``);
- a block of queries across a request boundary (rare) takes one pass per query, as in the
  Triton kernel.

One warpgroup (4 warps) a program; HP <= 64 (the launcher checks). Launched by
``gluon_logits.py``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

try:  # step-varying ints and index pointers unspecialised (bench/jit_variants.py)
    _jit_unspecialised = gluon.jit(do_not_specialize=["len_ptr", "pcu_ptr", "T", "L", "PT"])
except TypeError:  # a Triton whose gluon.jit takes no do_not_specialize
    _jit_unspecialised = gluon.jit


@gluon.jit
def _prefill_rows(c, pcu, PT, W: gl.constexpr, I: gl.constexpr):
    """Logical key position c of a request whose region starts at pcu -> its gathered row."""
    g = c // I
    return (g % W) * PT + pcu + (g // W) * I + c % I


@gluon.jit
def _issue_tile(kp_ptr, ring, slot, kb, hi, pq, PT, W: gl.constexpr, I: gl.constexpr,
                LD: gl.constexpr, BK: gl.constexpr):
    """cp.async the key rows of positions kb .. kb + BK (rows past hi: row 0, a real row whose
    scores are never stored) into ring slot ``slot``."""
    c = kb + gl.arange(0, BK, layout=gl.SliceLayout(1, LD))
    rows = gl.where(c < hi, _prefill_rows(c, pq, PT, W, I), 0)
    d = gl.arange(0, 128, layout=gl.SliceLayout(0, LD))
    async_copy.async_copy_global_to_shared(ring.index(slot),
                                           kp_ptr + rows.to(gl.int64)[:, None] * 128 + d[None, :])


@gluon.jit
def _store_keys(out_ptr, row, c, s, n, go):
    """Order-preserving int32 keys of scores s at positions c of output row ``row`` (c < n)."""
    bits = s.to(gl.int32, bitcast=True)
    gl.store(out_ptr + row + c, gl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), mask=(c < n) & go)


@gluon.jit
def _step(kp_ptr, ring, q_smem, zero, j, hi, pq, PT, W: gl.constexpr, I: gl.constexpr,
          LD: gl.constexpr, BK: gl.constexpr, NS: gl.constexpr):
    """Tile j's one product of both queries ``K [BK, 128] @ [Q_0; Q_1]^T [128, 2 HP]``,
    issued asynchronously once its keys have landed; first the copy of tile j + NS - 2 into
    the slot of tile j - 2 (whose product was waited for)."""
    _issue_tile(kp_ptr, ring, (j + NS - 2) % NS, (j + NS - 2) * BK, hi, pq, PT, W, I, LD, BK)
    async_copy.commit_group()
    async_copy.wait_group(NS - 2)  # tile j has landed
    fence_async_shared()
    gl.thread_barrier()
    return warpgroup_mma(ring.index(j % NS), q_smem.permute((1, 0)), zero, use_acc=False,
                         is_async=True)


@gluon.jit
def _epilogue(acc, w, j, hi, pq, PT, ks_ptr, out_ptr, r0, r1, n0, n1, go0, go1,
              W: gl.constexpr, I: gl.constexpr, BK: gl.constexpr, HP: gl.constexpr):
    """Tile j's int32 keys of both queries from their finished product [BK, 2 HP]: ReLU, head
    weights, the sum over each query's HP heads (within a thread and a quad), the key's scale
    (a positive power of two: exact after the sum)."""
    s = gl.sum(gl.reshape(gl.maximum(acc, 0.0) * w[None, :], [BK, 2, HP]), 2)
    s0, s1 = gl.split(s)
    KEY: gl.constexpr = s0.type.layout
    c = j * BK + gl.arange(0, BK, layout=KEY)
    kvalid = c < hi
    rows = gl.where(kvalid, _prefill_rows(c, pq, PT, W, I), 0)
    scale = gl.load(ks_ptr + rows, mask=kvalid, other=0.0)
    _store_keys(out_ptr, r0, c, s0 * scale, n0, go0)
    _store_keys(out_ptr, r1, c, s1 * scale, n1, go1)


# One program's whole schedule (queries in, the ring prologue, the overlapped loop) is the
# kernel: over 50 lines on purpose.
@_jit_unspecialised
def gluon_logits_fwd(q_ptr, w_ptr, kp_ptr, ks_ptr, out_ptr, len_ptr, pcu_ptr,
                     stride_qt, stride_qh, stride_wt, stride_ot, T, HI, L, PT,
                     W: gl.constexpr, I: gl.constexpr, HP: gl.constexpr, BK: gl.constexpr,
                     NS: gl.constexpr, U: gl.constexpr):
    LD: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # 16-byte copies
    QL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 2 * HP, 32])
    COL: gl.constexpr = gl.SliceLayout(0, MMA)  # query x head columns

    # the last query blocks first (a prefill's later queries have the most keys)
    j0 = (gl.num_programs(0) - 1 - gl.program_id(0)) * 2
    ring = gl.allocate_shared_memory(gl.float8e4nv, [NS, BK, 128],
                                     gl.NVMMASharedLayout.get_default_for([BK, 128], gl.float8e4nv))
    q_smem = gl.allocate_shared_memory(
        gl.float8e4nv, [2 * HP, 128], gl.NVMMASharedLayout.get_default_for([2 * HP, 128],
                                                                            gl.float8e4nv))
    r = gl.arange(0, 2 * HP, layout=gl.SliceLayout(1, QL))
    dq = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
    jr = j0 + r // HP
    hr = r % HP
    # both queries' fp8 rows into shared memory, query 0's heads then query 1's (padded heads
    # and queries past T: 0), and their weights in the accumulator's column layout
    q = gl.load(q_ptr + jr.to(gl.int64)[:, None] * stride_qt + hr[:, None] * stride_qh
                + dq[None, :], mask=((hr < HI) & (jr < T))[:, None], other=0.0)
    q_smem.store(q)
    rw = gl.arange(0, 2 * HP, layout=COL)
    jw = j0 + rw // HP
    hw = rw % HP
    w = gl.load(w_ptr + jw.to(gl.int64) * stride_wt + hw, mask=(hw < HI) & (jw < T), other=0.0)
    ok0 = j0 < T
    ok1 = j0 + 1 < T
    n0 = gl.where(ok0, gl.load(len_ptr + j0, mask=ok0, other=0).to(gl.int32), 0)
    n1 = gl.where(ok1, gl.load(len_ptr + j0 + 1, mask=ok1, other=0).to(gl.int32), 0)
    p0 = gl.load(pcu_ptr + j0, mask=ok0, other=0).to(gl.int64)
    p1 = gl.load(pcu_ptr + j0 + 1, mask=ok1, other=0).to(gl.int64)
    hi = gl.maximum(n0, n1)
    shared = (n1 == 0) | (n0 == 0) | (p0 == p1)  # one request's keys serve both queries
    r0 = j0.to(gl.int64) * stride_ot
    r1 = (j0 + 1).to(gl.int64) * stride_ot
    fence_async_shared()
    gl.thread_barrier()
    zero = gl.zeros([BK, 2 * HP], gl.float32, layout=MMA)
    num_tiles = gl.cdiv(hi, BK)
    for qi in range(gl.where(shared, 1, 2)):
        # pass qi's key rows: the block's request (shared), else query qi's own
        pq = gl.where(shared, gl.where(n0 > 0, p0, p1), gl.where(qi == 0, p0, p1))
        go0 = shared | (qi == 0)
        go1 = shared | (qi == 1)
        for t in gl.static_range(NS - 2):  # prologue: the first NS - 2 tiles' copies
            _issue_tile(kp_ptr, ring, t, t * BK, hi, pq, PT, W, I, LD, BK)
            async_copy.commit_group()
        # U tiles an iteration, straight-line: tile u + 1's product is issued before tile u's
        # epilogue and runs under it (U - 1 of U epilogues overlapped). No product is in flight
        # across iterations: ptxas serialises every wgmma when one is (offline sm_90 compile).
        # Tiles past the last are multiplied (rows clamped) and never stored.
        for i in range(0, num_tiles, U):
            cur = _step(kp_ptr, ring, q_smem, zero, i, hi, pq, PT, W, I, LD, BK, NS)
            for u in gl.static_range(U):
                if u < U - 1:
                    nxt = _step(kp_ptr, ring, q_smem, zero, i + u + 1, hi, pq, PT, W, I,
                                LD, BK, NS)
                    cur = warpgroup_mma_wait(num_outstanding=1, deps=(cur,))
                else:
                    cur = warpgroup_mma_wait(num_outstanding=0, deps=(cur,))
                _epilogue(cur, w, i + u, hi, pq, PT, ks_ptr, out_ptr, r0, r1, n0, n1, go0, go1,
                          W, I, BK, HP)
                if u < U - 1:
                    cur = nxt
        async_copy.wait_group(0)
        gl.thread_barrier()  # every warp is done with the ring before the next pass refills it
