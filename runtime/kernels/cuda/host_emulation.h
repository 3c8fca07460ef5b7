// The CUDA names a kernel of this folder uses, for running one CTA on the host (C++20, no
// CUDA): each CUDA thread a std::thread, __syncthreads a std::barrier of the CTA, a warp's
// shuffles through a buffer between two barriers of its 32 threads, shared variables static
// (one CTA at a time), atomics the compiler's. Slow (a barrier wakes every thread), exact in
// what it checks: the kernel's logic on small rows, in the CPU tests (build.compile_host).
#pragma once

#include <algorithm>
#include <barrier>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static

struct int4 {
  int x, y, z, w;
};
struct alignas(16) ulonglong2 {
  unsigned long long x, y;
};

namespace emu {

struct Index {
  unsigned x = 0;
};

inline thread_local Index thread_index, block_index;
inline unsigned char* dynamic_smem = nullptr;
inline std::barrier<>* cta_barrier = nullptr;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline std::vector<uint64_t> shuffle;

// One CTA of `threads` threads, run over `blocks` block indices one after another.
struct Cta {
  int threads;
  Cta(int threads_, unsigned char* smem) : threads(threads_) {
    dynamic_smem = smem;
    shuffle.assign(threads, 0);
    warp_barriers.clear();
    for (int w = 0; w < threads / 32; ++w) warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
  }
  void run(int blocks, const std::function<void()>& body) {
    std::barrier<> cta(threads);
    cta_barrier = &cta;
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        thread_index.x = t;
        for (int b = 0; b < blocks; ++b) {
          block_index.x = b;
          body();
          cta.arrive_and_wait();  // the next block reuses the shared variables
        }
      });
    }
    for (auto& th : pool) th.join();
    cta_barrier = nullptr;
  }
};

}  // namespace emu

#define threadIdx emu::thread_index
#define blockIdx emu::block_index

inline void __syncthreads() { emu::cta_barrier->arrive_and_wait(); }

// A warp's exchange: every lane publishes x, reads lane `from(lane)`'s (its own where that is
// outside the warp), all 32 lanes between two barriers.
template <typename T, typename From>
inline T warp_exchange(T x, From from) {
  const int t = threadIdx.x, lane = t & 31;
  auto& warp = *emu::warp_barriers[t >> 5];
  emu::shuffle[t] = static_cast<uint64_t>(x);
  warp.arrive_and_wait();
  const int src = from(lane);
  const T y = src >= 0 && src < 32 ? static_cast<T>(emu::shuffle[t - lane + src]) : x;
  warp.arrive_and_wait();
  return y;
}

template <typename T>
inline T __shfl_up_sync(unsigned, T x, int offset) {
  return warp_exchange(x, [offset](int lane) { return lane - offset; });
}

template <typename T>
inline T __shfl_xor_sync(unsigned, T x, int mask) {
  return warp_exchange(x, [mask](int lane) { return lane ^ mask; });
}

template <typename T>
inline T __shfl_sync(unsigned, T x, int src) {
  return warp_exchange(x, [src](int) { return src; });
}

// Bit i: lane i's predicate (every lane publishes its own; lanes read all 32)
inline unsigned __ballot_sync(unsigned, bool pred) {
  const int t = threadIdx.x, lane = t & 31;
  auto& warp = *emu::warp_barriers[t >> 5];
  emu::shuffle[t] = pred ? 1u : 0u;
  warp.arrive_and_wait();
  unsigned m = 0;
  for (int l = 0; l < 32; ++l) m |= static_cast<unsigned>(emu::shuffle[t - lane + l]) << l;
  warp.arrive_and_wait();
  return m;
}

inline void __syncwarp() { emu::warp_barriers[threadIdx.x >> 5]->arrive_and_wait(); }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }

template <typename T>
inline T atomicAdd(T* p, T v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}

template <typename T>
inline T atomicMax(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,
                                                 __ATOMIC_RELAXED)) {
  }
  return old;
}

inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }

inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

using std::max;
using std::min;
