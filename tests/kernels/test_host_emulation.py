"""runtime/kernels/cuda/host_emulation.h on its own: a small kernel (a warp's shuffles and
ballot, a shared atomic, the CTA's barriers, several blocks) built for the host in both of its
modes (fibers, the default; std::threads with CPPLAN_HOST_THREADS) against sums written in
Python, and a barrier that some threads never reach reported as a deadlock by the fibers
instead of a hang."""

from __future__ import annotations

import ctypes
import os
import shutil

import numpy as np
import pytest

from cpplan.runtime.kernels.cuda import build

pytestmark = pytest.mark.skipif(not (os.environ.get("CXX") or shutil.which("g++")
                                     or shutil.which("c++")), reason="needs a C++ compiler")

# Each block: the sum of its threads' values plus 1000 for each odd one, from the warps' sums
# (shuffles) and odd counts (ballots) added into a shared total. Thread `skip` (if >= 0) does
# not reach its warp's barrier.
SOURCE = r"""
#include "host_emulation.h"

namespace {
void reduce(const int* x, int n, int* out, int skip) {
  __shared__ int total;
  const int t = threadIdx.x, b = blockIdx.x;
  if (t == 0) total = 0;
  __syncthreads();
  const int own = x[b * n + t];
  int v = own;
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  const unsigned odd = __ballot_sync(0xffffffffu, (own & 1) != 0);
  if ((t & 31) == 0) atomicAdd(&total, v + 1000 * __popc(odd));
  if (t != skip) __syncwarp();
  __syncthreads();
  if (t == 0) out[b] = total;
}
}  // namespace

extern "C" int emu_reduce(const int* x, int n, int blocks, int* out, int skip) {
  emu::Cta cta(n, nullptr);
  return cta.run(blocks, [&] { reduce(x, n, out, skip); }) ? 0 : 1;
}
"""


def _library(tmp_path, n, defines=()):
    src = tmp_path / "emu_reduce.cu"
    src.write_text(SOURCE)
    lib = build.load(build.compile_host(str(src), n, defines=defines, out_dir=tmp_path))
    lib.emu_reduce.restype = ctypes.c_int
    lib.emu_reduce.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_int]
    return lib


def _reduce(lib, x, skip=-1):
    blocks, n = x.shape
    out = np.full(blocks, -1, dtype=np.int32)
    rc = lib.emu_reduce(x.ctypes.data, n, blocks, out.ctypes.data, skip)
    return rc, out


@pytest.mark.parametrize("defines", [(), ("CPPLAN_HOST_THREADS",)], ids=["fibers", "threads"])
@pytest.mark.parametrize("n", [32, 128])
def test_a_cta_s_warps_and_barriers_give_the_sums(tmp_path, defines, n):
    x = np.random.default_rng(n).integers(-50, 50, size=(3, n), dtype=np.int32)
    rc, out = _reduce(_library(tmp_path, n, defines), x)
    want = x.sum(axis=1) + 1000 * (x % 2 != 0).sum(axis=1)
    assert rc == 0
    assert out.tolist() == want.tolist()


def test_fibers_report_a_barrier_some_threads_never_reach(tmp_path):
    """Thread 5 skips its warp's barrier: the warp's other 31 wait on it forever. The fibers'
    run returns (rc 1) instead of hanging, the blocks after it not run; the same library then
    runs a good launch."""
    lib = _library(tmp_path, 64)
    x = np.ones((2, 64), dtype=np.int32)
    rc, out = _reduce(lib, x, skip=5)
    assert rc == 1
    assert out.tolist() == [-1, -1]
    rc, out = _reduce(lib, x)
    assert (rc, out.tolist()) == (0, [64 + 64000] * 2)
