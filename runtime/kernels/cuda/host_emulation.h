// The CUDA names a kernel of this folder uses, for running one CTA on the host (C++20, no
// CUDA), for the CPU tests (build.compile_host): the kernel's logic on small rows, checked
// exactly. A CTA's threads are fibers of one OS thread by default (ucontext): each runs until it
// waits at a barrier, then the next one does, in the order of their indices; __syncthreads is a
// barrier of the CTA, a warp's shuffles go through a buffer between two barriers of its 32
// threads, shared variables are static (one CTA at a time), atomics the compiler's. The order
// is fixed, so a run repeats exactly. With -DCPPLAN_HOST_THREADS each CUDA thread is a
// std::thread and the barriers std::barriers instead: the threads interleave as the OS
// schedules them (a race may show), at about ten times the cost (a barrier wakes every thread).
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
#ifdef CPPLAN_HOST_THREADS
#include <barrier>
#include <thread>
#else
#include <ucontext.h>
#endif

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

// Internal linkage: inline variables are otherwise one object a process (GNU unique symbols),
// shared by every build of a kernel that loads, whatever its defines.
namespace emu {
namespace {

struct Index {
  unsigned x = 0;
};

inline unsigned char* dynamic_smem = nullptr;
inline std::vector<uint64_t> shuffle;

#ifdef CPPLAN_HOST_THREADS
inline thread_local Index thread_index, block_index;
using Barrier = std::barrier<>;
#else
inline Index thread_index, block_index;  // the running fiber's (one OS thread runs them all)

// The fibers of the CTA being run, `current` the running one.
struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  unsigned block = 0;
  bool done = false;
};
inline std::vector<Fiber>* fibers = nullptr;
inline int current = 0;
inline int live = 0;
inline ucontext_t caller;
// switches since a fiber last arrived at a barrier or finished: past `live`, every fiber left
// waits at a barrier that none of them can complete (a deadlock: Cta::run returns false)
inline int idle_switches = 0;
inline bool deadlocked = false;

// Switches to the next fiber that has not finished (in index order, wrapping), or back to the
// caller of Cta::run when none is left; `finished`: the running fiber does not come back.
inline void switch_fiber(bool finished) {
  auto& fs = *fibers;
  const int n = static_cast<int>(fs.size()), from = current;
  fs[from].block = block_index.x;
  if (finished) {
    fs[from].done = true;
    idle_switches = 0;
    if (--live == 0) setcontext(&caller);
  } else if (++idle_switches > live) {
    deadlocked = true;
    setcontext(&caller);  // the waiting fibers are abandoned where they wait
  }
  int next = from;
  do next = (next + 1) % n;
  while (fs[next].done);
  if (next == from) return;
  current = next;
  thread_index.x = static_cast<unsigned>(next);
  block_index.x = fs[next].block;
  if (finished)
    setcontext(&fs[next].context);
  else
    swapcontext(&fs[from].context, &fs[next].context);
}

// A barrier of `count` fibers: the last to arrive moves the phase on; the others yield until it
// has.
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  void arrive_and_wait() {
    const unsigned long phase = phase_;
    idle_switches = 0;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++phase_;
      return;
    }
    while (phase_ == phase) switch_fiber(false);
  }

 private:
  int count_, arrived_ = 0;
  unsigned long phase_ = 0;
};
#endif

inline Barrier* cta_barrier = nullptr;
inline std::vector<std::unique_ptr<Barrier>> warp_barriers;

// One thread's part of a launch: `body` for each block index in turn.
inline void run_blocks(int blocks, const std::function<void()>& body) {
  for (int b = 0; b < blocks; ++b) {
    block_index.x = static_cast<unsigned>(b);
    body();
    cta_barrier->arrive_and_wait();  // the next block reuses the shared variables
  }
}

#ifndef CPPLAN_HOST_THREADS
inline constexpr size_t kFiberStack = 256 * 1024;  // bytes; pages are touched only as used
inline const std::function<void()>* fiber_body = nullptr;
inline int fiber_blocks = 0;

inline void fiber_main() {
  run_blocks(fiber_blocks, *fiber_body);
  switch_fiber(true);
}
#endif

// One CTA of `threads` threads, run over `blocks` block indices one after another; run()
// returns false where the threads deadlocked at a barrier (fibers only; std::threads hang).
struct Cta {
  int threads;
  Cta(int threads_, unsigned char* smem) : threads(threads_) {
    dynamic_smem = smem;
    shuffle.assign(threads, 0);
    warp_barriers.clear();
    for (int w = 0; w < threads / 32; ++w) warp_barriers.push_back(std::make_unique<Barrier>(32));
  }
#ifdef CPPLAN_HOST_THREADS
  bool run(int blocks, const std::function<void()>& body) {
    Barrier cta(threads);
    cta_barrier = &cta;
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        thread_index.x = t;
        run_blocks(blocks, body);
      });
    }
    for (auto& th : pool) th.join();
    cta_barrier = nullptr;
    return true;
  }
#else
  bool run(int blocks, const std::function<void()>& body) {
    if (blocks <= 0 || threads <= 0) return true;
    Barrier cta(threads);
    cta_barrier = &cta;
    std::vector<Fiber> fs(threads);
    for (auto& f : fs) {
      f.stack.reset(new char[kFiberStack]);
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack.get();
      f.context.uc_stack.ss_size = kFiberStack;
      f.context.uc_link = nullptr;
      makecontext(&f.context, fiber_main, 0);
    }
    fibers = &fs;
    fiber_body = &body;
    fiber_blocks = blocks;
    current = 0;
    live = threads;
    idle_switches = 0;
    deadlocked = false;
    thread_index.x = 0;
    block_index.x = 0;
    swapcontext(&caller, &fs[0].context);  // back when every fiber has finished, or none can
    fibers = nullptr;
    fiber_body = nullptr;
    cta_barrier = nullptr;
    return !deadlocked;
  }
#endif
};

}  // namespace
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
