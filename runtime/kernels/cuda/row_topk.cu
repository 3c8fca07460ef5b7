// Exact top-k of rows of int32 keys, one CTA a row, in shared memory (cpplan's prefill select;
// the launcher and the reasoning: row_topk.py beside this file, docs/design.md §4.3).
//
// Keys are the logits kernels' order-preserving int32 keys; INT32_MIN marks "no key". As an
// unsigned u = key ^ 0x80000000 the order is the keys' and "no key" is u = 0. A row r holds its
// first n = min(lens[r], L) columns; the result is the K largest live keys, ordered by key
// descending then column ascending (ties at the K-th key keep the lowest columns), written as
// float32 scores and int32 ids (the column, or its global token id for a DCP rank's decode
// rows), pads (-inf, -1) past the row's live keys.
//
// Per row, over composites (u << 32 | ~column: distinct, and their descending order is the
// reference order), found by their bits from the top (a row wider than cap and kOnePassFrom
// first tries step 0: a sample of the row's lines sets a threshold, one pass gathers the
// keys at or above it into `cand`, and where they hold the K-th composite step 4 runs on
// them, steps 1-3 skipped: one read of the row instead of two):
//   1. a histogram of the top 12 bits over the row (global memory, read once);
//   2. the bin holding the K-th composite; while it holds more than CAP (ties, narrow rows),
//      another pass over the row refines it by the next 10 bits (rare);
//   3. one more pass over the row (mostly from L2) appends the composites above the bin to
//      `sel` and those in it to `cand` (shared memory; a warp reserves its places with one
//      atomic, so no barrier inside the pass and no order kept);
//   4. 10-bit histograms over `cand` refine the bin until it holds exactly the composites still
//      needed (composites are distinct, so this ends by the 64th bit; past the key's 32 bits
//      the column's constant top bits are skipped), moving those above it to `sel` and
//      copying those in it alone to free places of `cand` at each level (the next level reads
//      the bin only), then the bin's own; a bin of at most 128 held alone is finished by
//      ranking each composite against the others (a thread each);
//   5. the K composites sorted and written out. Up to K 2048 by buckets (bucket_sort): each
//      composite's key mapped linearly onto as many buckets as K's power of two (at least the
//      CTA's threads) between the result's smallest and largest (by the key's bits where they have
//      one sign, else by the score), counted, scattered by bucket and each written out at its
//      bucket's start plus its rank within the bucket: a shared atomic and a few compares a
//      composite and seven barriers (against the network's 15 shared-memory stages at K 2048;
//      measured 10-35% faster a row than the network or merges: bench/RESULTS.md). Where a
//      bucket holds more than CPPLAN_ROW_TOPK_BUCKET_MAX (64; ties, keys packed together), and
//      for larger K: a bitonic network (at K 2048 from registers: its stages unrolled, those of
//      stride <= 32 on registers and warp shuffles, the others in shared memory); or, built with
//      CPPLAN_ROW_TOPK_MERGE_SORT (K 2048; the short rows' build), by merges: a thread's own
//      composites sorted in registers (with _MERGE_FROM, each warp's runs of that many by the
//      network's register and shuffle stages), then rounds that merge pairs of sorted runs in
//      shared memory, each thread finding its outputs' start on the merge path by a binary search.
//
// Built with -DCPPLAN_HOST_EMULATION (a C++20 compiler, no CUDA) the same kernel runs on the
// host, a CTA's threads as fibers (host_emulation.h): the CPU tests check it against the
// reference there, with CPPLAN_ROW_TOPK_BLOCK threads a CTA (512 with _CAP 4096: the short
// rows' build). Other defines are the bench's variants (row_topk.VARIANTS):
// CPPLAN_ROW_TOPK_SMEM_SORT (every network stage in shared memory), _MERGE_SORT with or
// without _MERGE_FROM (the merge sort in the 1024-thread build; from a thread's own in the
// 512-thread one), _BALLOT_APPEND (step 3's form before), _TWO_PASS (no step 0), _ONE_LOAD
// (step 0's pass with one load in flight a thread, the form before), _FOUR_LOADS (four),
// _PREFETCH=D (its lines D iterations ahead asked of L2 first; 1, 0: none), _SAMPLE_RATE (one
// key in how many sampled; 16), _SAMPLE_SIGMAS (its margin; 3), _NO_BUCKET_SORT (step 5
// without buckets, the form before), _BUCKET_BY_KEY (buckets by the key's bits also across
// signs), _BUCKET_MAX, _RANK_PAIRS (the rank within a bucket from two composites a shared
// load), _PROBE_NO_SORT (the result left unordered: a timing probe).

#include <cstdint>

#ifdef CPPLAN_HOST_EMULATION
#include "host_emulation.h"
#else
#include <cuda_runtime.h>
#endif

#ifdef CPPLAN_HOST_EMULATION
namespace {
// rows the host build's one pass took with every live key (a sample too small), with the
// sample's threshold, and fell back from; then rows step 5 sorted by buckets, and fell back
// from them; then step 4's bins finished by rank_finish, and its levels that copied the new
// bin alone, that could not, and whose digit left the bin whole (the CPU tests
// check that their cases take each; cpplan_row_topk_host_paths)
long long host_paths[9];
}  // namespace
#endif

#ifndef CPPLAN_ROW_TOPK_BLOCK
#define CPPLAN_ROW_TOPK_BLOCK 1024
#endif

namespace {

constexpr int kBlock = CPPLAN_ROW_TOPK_BLOCK;  // threads a CTA (a multiple of 32, <= 1024)
constexpr int kWarps = kBlock / 32;
constexpr int kFirstBits = 12;              // the first histogram's digit
constexpr int kNextBits = 10;               // every later digit
constexpr int kBins = 1 << kFirstBits;      // the histogram's size ...
constexpr int kNextBins = 1 << kNextBits;   // ... of which later digits use the first 1024
static_assert(kBlock % 32 == 0 && kBlock <= 1024 && kNextBins % kBlock == 0, "CTA size");
constexpr int kMinBlocks = 2048 / kBlock < 16 ? 2048 / kBlock : 16;  // CTAs an SM: 32 registers
#ifndef CPPLAN_ROW_TOPK_CAP
#define CPPLAN_ROW_TOPK_CAP 8192
#endif
constexpr int kCap = CPPLAN_ROW_TOPK_CAP;  // the launcher's `cap` (cpplan_row_topk_cap)
static_assert(kCap < 65536, "step 3 counts a bin's candidates in 16 bits");
// The one pass's sample of a row wider than cap: up to kChunks lines of kChunk keys spread
// evenly over it, at most one key in kSampleRate (sample_threshold): 64 lines at 32768 keys,
// 128 at 65536 (one key in 8 before: 128 lines at both, measured 1-4% slower at 32768 keys and
// as fast at 65536; at most 64 lines: 7-8% slower at 65536; bench/RESULTS.md).
constexpr int kChunk = 32;       // keys a sampled chunk: one 128-byte line
constexpr int kChunks = 128;     // chunks a sample at most: 4096 keys, 16 KB
#ifndef CPPLAN_ROW_TOPK_SAMPLE_RATE
#define CPPLAN_ROW_TOPK_SAMPLE_RATE 16
#endif
constexpr int kSampleRate = CPPLAN_ROW_TOPK_SAMPLE_RATE;
#ifndef CPPLAN_ROW_TOPK_SAMPLE_SIGMAS
#define CPPLAN_ROW_TOPK_SAMPLE_SIGMAS 3
#endif
// The sample's margin past the expected rank of the row's K-th key, in standard deviations
// (4 before: 2% slower at 32768 and 65536 keys; 2: 5% slower at 65536; bench/RESULTS.md).
constexpr float kSampleSigmas = CPPLAN_ROW_TOPK_SAMPLE_SIGMAS;
// The one pass's loads in flight a thread (a variant each: one, the form before; four) and
// how many of its iterations ahead it asks L2 for their lines (0: none, the form before; 1
// measured 1-3% faster at 65536 keys, within 1% at 32768; 2 no faster; bench/RESULTS.md).
#if defined(CPPLAN_ROW_TOPK_ONE_LOAD)
constexpr int kLoads = 1;
#elif defined(CPPLAN_ROW_TOPK_FOUR_LOADS)
constexpr int kLoads = 4;
#else
constexpr int kLoads = 2;
#endif
#ifndef CPPLAN_ROW_TOPK_PREFETCH
#define CPPLAN_ROW_TOPK_PREFETCH 1
#endif
constexpr int kPrefetch = CPPLAN_ROW_TOPK_PREFETCH;
#ifndef CPPLAN_ROW_TOPK_ONE_PASS_FROM
#define CPPLAN_ROW_TOPK_ONE_PASS_FROM 16384
#endif
// Rows wider than this (and than cap) take the one pass from a sample's threshold (measured
// faster at 65536 keys, even at ~30k, slower at 4-8k: bench/RESULTS.md).
constexpr int kOnePassFrom = CPPLAN_ROW_TOPK_ONE_PASS_FROM;
#ifndef CPPLAN_ROW_TOPK_BUCKET_MAX
#define CPPLAN_ROW_TOPK_BUCKET_MAX 64
#endif
// Step 5 sorts a result of up to kSortMaxKS by buckets where none holds more than kBucketMax
// composites (bucket_sort); else, and for larger results, by the network or merges.
constexpr int kSortMaxKS = 2048;
constexpr int kBucketMax = CPPLAN_ROW_TOPK_BUCKET_MAX;
#ifndef CPPLAN_ROW_TOPK_RANK_MAX
#define CPPLAN_ROW_TOPK_RANK_MAX 128
#endif
// Step 4 ranks a bin held alone of at most this many composites (rank_finish; 0: never, the
// bin refined by 10-bit levels to the end; a bench variant).
constexpr int kRankMax = CPPLAN_ROW_TOPK_RANK_MAX < kBlock ? CPPLAN_ROW_TOPK_RANK_MAX : kBlock;
// Shared memory's candidates' area, in composites: step 1's histogram and the sample (past
// it) lie over it too.
__host__ __device__ constexpr int cand_area(int cap) {
  return cap > kBins / 2 + kChunks * kChunk / 2 ? cap : kBins / 2 + kChunks * kChunk / 2;
}

static_assert(cand_area(0) >= kSortMaxKS / 2 + kSortMaxKS, "step 5's buckets lie over cand");

struct Shared {
  int warp[kWarps];
  int found_bin, found_before, found_count;  // find_bin's result
  int n_sel, n_cand;                         // places taken in sel / cand
  unsigned n_pair;                           // step 3's: n_sel | n_cand << 16 (one atomic)
  unsigned umax;                             // the one pass's largest unsigned key
  unsigned sort_hi, sort_lo_inv;             // step 5's largest key and ~ its smallest
  int sort_full;                             // step 5: a bucket over kBucketMax
  int n_next;                                // step 4: places taken by the next bin's copy
};

// Inclusive sum of v over a warp's lanes up to `lane` (five shuffles; every lane calls it).
template <class T>
__device__ __forceinline__ T warp_inclusive_sum(T v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// Exclusive prefix of `v` over the block's threads; `total` the sum. Three barriers; `sh.warp`
// is free again on return.
__device__ __forceinline__ int block_scan(int v, Shared& sh, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int x = warp_inclusive_sum(v, lane);
  if (lane == 31) sh.warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < kWarps ? sh.warp[lane] : 0;
    w = warp_inclusive_sum(w, lane);
    if (lane < kWarps) sh.warp[lane] = w;
  }
  __syncthreads();
  const int before = (warp ? sh.warp[warp - 1] : 0) + x - v;
  total = sh.warp[kWarps - 1];
  __syncthreads();
  return before;
}

// The bin of `hist` (nbins, a multiple of kBlock) holding the need-th largest key counting from
// the top bin: found_bin, found_before (keys in higher bins), found_count (keys in it); `live`
// the keys in all bins. Every thread reads the results from `sh` after the call.
__device__ void find_bin(const uint32_t* hist, int nbins, int need, Shared& sh, int& live) {
  const int per = nbins / kBlock;
  const int top = nbins - 1 - threadIdx.x * per;  // this thread's bins: top, top - 1, ...
  int s = 0;
  for (int j = 0; j < per; ++j) s += hist[top - j];
  const int before = block_scan(s, sh, live);
  if (before < need && need <= before + s) {
    int b = top, c = before;
    while (c + static_cast<int>(hist[b]) < need) c += hist[b--];
    sh.found_bin = b;
    sh.found_before = c;
    sh.found_count = hist[b];
  }
  __syncthreads();
}

// One stage of a bitonic network over sel[0, KS) in shared memory: pairs (i, i + stride),
// descending where i & size is 0; ends with a barrier.
__device__ __forceinline__ void bitonic_stage(uint64_t* sel, int KS, int size, int stride) {
  for (int t = threadIdx.x; t < KS / 2; t += kBlock) {
    const int i = 2 * t - (t & (stride - 1));  // the pair (i, i + stride)
    const int j = i + stride;
    const bool down = (i & size) == 0;  // descending runs first
    const uint64_t x = sel[i], y = sel[j];
    if ((x < y) == down) {
      sel[i] = y;
      sel[j] = x;
    }
  }
  __syncthreads();
}

// x or its partner y in a stage of the network: the larger where `keep_max`. Composites (and
// pads) are distinct, so one comparison decides.
__device__ __forceinline__ uint64_t keep(uint64_t x, uint64_t y, bool keep_max) {
  return (x < y) == keep_max ? y : x;
}

// The stages of stride `stride` down to kLow of a run of `size` over sel[0, KS), in shared
// memory, a barrier after each. (Two stages a round, a thread of the first KS / 4 holding four
// values, measured 12% slower: half the CTA idles; bench/RESULTS.md.)
template <int KS, int kLow>
__device__ __forceinline__ void shared_stages(uint64_t* sel, int size, int stride) {
#pragma unroll
  for (; stride >= kLow; stride >>= 1) bitonic_stage(sel, KS, size, stride);
}

// Sorts sel[0, KS) descending, KS = 2 kBlock, into registers: lane l of warp w ends holding
// places a = 64 w + l and b = a + 32. Every loop unrolled (run sizes and strides known at
// compile time): the stages of stride <= 32 on registers and shuffles (51 of 66 at KS 2048),
// the others in shared memory (`shared_stages`).
template <int KS>
__device__ __forceinline__ void bitonic_sort_registers(uint64_t* sel, uint64_t& a, uint64_t& b) {
  const int lane = threadIdx.x & 31;
  const int ia = (threadIdx.x >> 5) * 64 + lane, ib = ia + 32;
  a = sel[ia];
  b = sel[ib];
#pragma unroll
  for (int size = 2; size <= KS; size <<= 1) {
    if (size >= 128) {
      sel[ia] = a;
      sel[ib] = b;
      __syncthreads();
      shared_stages<KS, 64>(sel, size, size >> 1);
      a = sel[ia];
      b = sel[ib];
    }
    const bool down_a = (ia & size) == 0, down_b = (ib & size) == 0;
    if (size >= 64) {  // stride 32: the thread's own pair, a the lower place
      const uint64_t x = keep(a, b, down_a);
      b = keep(b, a, !down_a);
      a = x;
    }
#pragma unroll
    for (int stride = size >= 64 ? 16 : size >> 1; stride > 0; stride >>= 1) {
      const bool lower = (lane & stride) == 0;  // the lower place keeps the larger in a
      const uint64_t pa = __shfl_xor_sync(0xffffffffu, a, stride);  // descending run
      const uint64_t pb = __shfl_xor_sync(0xffffffffu, b, stride);
      a = keep(a, pa, lower == down_a);
      b = keep(b, pb, lower == down_b);
    }
  }
}

// Sorts sel[0, KS) descending (KS a power of two) by a bitonic network in shared memory, a
// barrier a stage (shapes other than KS = 2 kBlock, and a bench variant).
__device__ void bitonic_sort_shared(uint64_t* sel, int KS) {
  for (int size = 2; size <= KS; size <<= 1)
    for (int stride = size >> 1; stride > 0; stride >>= 1) bitonic_stage(sel, KS, size, stride);
}

// The stages of run size `size` from stride `from` down, on a warp's places held ITEMS a lane
// (lane l: base + r, base = its warp's offset + ITEMS l): strides of ITEMS and up on
// shuffles, smaller ones inside the thread; runs descending where (place & size) == 0, or
// every run with `all_down`. Called with compile-time sizes (unrolled loops).
template <int ITEMS>
__device__ __forceinline__ void register_stages(uint64_t (&e)[ITEMS], int base, int size,
                                                int from, bool all_down) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int stride = from; stride >= ITEMS; stride >>= 1) {  // across lanes
    const bool lower = (lane & (stride / ITEMS)) == 0;
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
      const bool down = all_down || ((base + r) & size) == 0;
      const uint64_t y = __shfl_xor_sync(0xffffffffu, e[r], stride / ITEMS);
      e[r] = keep(e[r], y, lower == down);
    }
  }
#pragma unroll
  for (int stride = from < ITEMS / 2 ? from : ITEMS / 2; stride > 0; stride >>= 1) {  // inside
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
      if (r & stride) continue;
      const bool down = all_down || ((base + r) & size) == 0;
      const uint64_t x = keep(e[r], e[r + stride], down);
      e[r + stride] = keep(e[r + stride], e[r], !down);
      e[r] = x;
    }
  }
}

// The same sort with four values a lane (KS / 4 = kBlock threads), at 512 threads a CTA or
// fewer (the short rows' build at K 2048; at 1024 threads and KS = 2 kBlock, half the CTA
// idle, it measured 35% slower than two values a thread);
// lane l of warp w holds places 128 w + 4 l + r, r < 4, so stages of stride 1 and 2 run inside
// a thread, 4 to 64 on shuffles, 128 and up in shared memory; every loop unrolled.
template <int KS>
__device__ __forceinline__ void bitonic_sort4_registers(uint64_t* sel, uint64_t (&e)[4]) {
  const int t = threadIdx.x;
  const bool mine = t < KS / 4;
  const int base = (t >> 5) * 128 + (t & 31) * 4;
#pragma unroll
  for (int r = 0; r < 4; ++r) e[r] = mine ? sel[base + r] : 0u;
#pragma unroll
  for (int size = 2; size <= KS; size <<= 1) {
    if (size >= 256) {
      if (mine)
#pragma unroll
        for (int r = 0; r < 4; ++r) sel[base + r] = e[r];
      __syncthreads();
      shared_stages<KS, 128>(sel, size, size >> 1);
      if (mine)
#pragma unroll
        for (int r = 0; r < 4; ++r) e[r] = sel[base + r];
    }
    register_stages<4>(e, base, size, size >= 256 ? 64 : size >> 1, false);
  }
}

// A warp's 32 x ITEMS places (lane l holding ITEMS l .. ITEMS l + ITEMS - 1) in runs of UPTO,
// each sorted descending by the bitonic network's stages (the merge sort's first rounds: a
// thread's own at UPTO = ITEMS, each warp's runs of CPPLAN_ROW_TOPK_MERGE_FROM with it).
template <int ITEMS, int UPTO>
__device__ __forceinline__ void warp_bitonic(uint64_t (&e)[ITEMS]) {
  static_assert(UPTO >= ITEMS && UPTO <= 32 * ITEMS, "runs inside a warp's places");
  const int base = (threadIdx.x & 31) * ITEMS;  // (a warp's offset: a multiple of UPTO)
#pragma unroll
  for (int size = 2; size <= UPTO; size <<= 1)
    register_stages<ITEMS>(e, base, size, size >> 1, size == UPTO);
}

// Sorts sel[0, KS) descending by merges, ITEMS = KS / kBlock composites a thread: runs of
// FROM sorted in registers (``warp_bitonic``), then log2(KS / FROM) rounds, each merging pairs of sorted runs: a thread finds
// where its ITEMS outputs start on the pair's merge path (a binary search, log2(run) + 1
// steps) and merges them serially. Between rounds the outputs go back to sel (a warp's own
// rounds, runs inside its 32 x ITEMS places, synchronise the warp only); the last round's
// stay in registers: thread t holds places ITEMS t .. ITEMS t + ITEMS - 1.
template <int KS, int ITEMS, int FROM>
__device__ __forceinline__ void merge_sort_registers(uint64_t* sel, uint64_t (&e)[ITEMS]) {
  static_assert(KS == ITEMS * kBlock, "ITEMS places a thread");
  const int d0 = ITEMS * threadIdx.x;  // the thread's first place
#pragma unroll
  for (int r = 0; r < ITEMS; ++r) e[r] = sel[d0 + r];
  warp_bitonic<ITEMS, FROM>(e);
#pragma unroll
  for (int run = FROM; run < KS; run <<= 1) {
    const bool in_warp = 2 * run <= 32 * ITEMS;
    // write the runs, then merge pairs of them: A = sel[p, p + run), B = the next run
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) sel[d0 + r] = e[r];
    if (in_warp) __syncwarp(); else __syncthreads();
    const uint64_t* A = sel + (d0 & ~(2 * run - 1));
    const uint64_t* B = A + run;
    const int d = d0 & (2 * run - 1);  // outputs of the pair before the thread's
    int lo = d > run ? d - run : 0, hi = d < run ? d : run;  // A's share of them: in [lo, hi]
    while (lo < hi) {  // the first i where A[i] loses to B[d - 1 - i]
      const int mid = (lo + hi) >> 1;
      if (A[mid] > B[d - 1 - mid]) lo = mid + 1; else hi = mid;
    }
    int i = lo, j = d - lo;
    uint64_t a = i < run ? A[i] : 0u, b = j < run ? B[j] : 0u;  // 0: below every composite
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
      const bool take_a = a > b;
      e[r] = take_a ? a : b;
      if (take_a) a = ++i < run ? A[i] : 0u;
      else b = ++j < run ? B[j] : 0u;
    }
    if (in_warp) __syncwarp(); else __syncthreads();  // read before the next round writes
  }
}

template <int VEC>
struct Loads;
template <>
struct Loads<4> {
  __device__ __forceinline__ static void at(const int32_t* p, int c, int n, int32_t (&k)[4]) {
    if (c + 4 <= n) {
      const int4 v = *reinterpret_cast<const int4*>(p + c);
      k[0] = v.x; k[1] = v.y; k[2] = v.z; k[3] = v.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) k[j] = c + j < n ? p[c + j] : INT32_MIN;
    }
  }
};
template <>
struct Loads<1> {
  __device__ __forceinline__ static void at(const int32_t* p, int c, int n, int32_t (&k)[1]) {
    k[0] = c < n ? p[c] : INT32_MIN;
  }
};

__device__ __forceinline__ uint32_t ukey(int32_t k) { return static_cast<uint32_t>(k) ^ 0x80000000u; }

// Asks L2 for the 128-byte line at p (no register holds it; the host build: nothing).
__device__ __forceinline__ void prefetch_l2(const int32_t* p) {
#ifndef CPPLAN_HOST_EMULATION
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

__device__ __forceinline__ uint64_t composite(uint32_t u, int c) {
  return (static_cast<uint64_t>(u) << 32) | (0xffffffffu - static_cast<uint32_t>(c));
}

// Past the key's 32 bits a bin's composites differ only in their column's: ~column of a
// column below 2^k (L <= 2^k) has its top 32 - k bits set, so the refinement skips them.
__device__ __forceinline__ void skip_column_ones(uint64_t& prefix, int& bits, int L) {
  if (bits != 32) return;
  int k = 0;
  while (k < 32 && (1ll << k) < L) ++k;
  prefix = (prefix << (32 - k)) | ((1ull << (32 - k)) - 1ull);
  bits = 64 - k;
}

// Appends v (where `take`) to buf at places reserved from *count, one atomic a warp; every
// lane of the warp calls it.
__device__ __forceinline__ void warp_append(uint64_t* buf, int* count, bool take, uint64_t v) {
  const unsigned m = __ballot_sync(0xffffffffu, take);
  if (m == 0u) return;
  const int lane = threadIdx.x & 31, first = __ffs(m) - 1;
  int base = 0;
  if (lane == first) base = atomicAdd(count, __popc(m));
  base = __shfl_sync(0xffffffffu, base, first);
  if (take) buf[base + __popc(m & ((1u << lane) - 1u))] = v;
}

// warp_append of a lane's VEC values at once: one ballot a value, one atomic a warp.
template <int VEC>
__device__ __forceinline__ void warp_append_vec(uint64_t* buf, int* count, const bool (&take)[VEC],
                                                const uint64_t (&v)[VEC]) {
  const int lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;
  int off[VEC], total = 0;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const unsigned m = __ballot_sync(0xffffffffu, take[j]);
    off[j] = total + __popc(m & below);
    total += __popc(m);
  }
  if (total == 0) return;
  int base = 0;
  if (lane == 0) base = atomicAdd(count, total);
  base = __shfl_sync(0xffffffffu, base, 0);
#pragma unroll
  for (int j = 0; j < VEC; ++j)
    if (take[j]) buf[base + off[j]] = v[j];
}

// Step 3's append of a lane's VEC keys (columns c ..): those above hi_u to sel, those in
// [lo_u, hi_u] to cand (unsigned keys). Each lane counts its two kinds in one word, the warp
// scans the words (five shuffles), one lane takes both lists' places with one atomic on
// sh.n_pair (16 bits each: fewer than KS above, at most kCap in the bin); every lane of the
// warp calls it. (Two ballots a key before: bench/RESULTS.md.)
template <int VEC>
__device__ __forceinline__ void warp_append_scan(uint64_t* sel, uint64_t* cand, Shared& sh,
                                                 const int32_t (&a)[VEC], int c, uint32_t lo_u,
                                                 uint32_t hi_u) {
  const int lane = threadIdx.x & 31;
  uint32_t u[VEC];
  unsigned mine = 0;  // above | in the bin << 16 (at most 32 x VEC each)
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    u[j] = ukey(a[j]);
    mine += u[j] > hi_u ? 1u : (u[j] >= lo_u ? 0x10000u : 0u);
  }
  const unsigned incl = warp_inclusive_sum(mine, lane);
  const unsigned total = __shfl_sync(0xffffffffu, incl, 31);
  if (total == 0u) return;
  unsigned base = 0;
  if (lane == 31) base = atomicAdd(&sh.n_pair, total);
  base = __shfl_sync(0xffffffffu, base, 31) + incl - mine;
  int s = static_cast<int>(base & 0xffffu), e = static_cast<int>(base >> 16);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    if (u[j] > hi_u) sel[s++] = composite(u[j], c + j);
    else if (u[j] >= lo_u) cand[e++] = composite(u[j], c + j);
  }
}

// Whether composite v lies in the bin of its top `bits` bits `prefix` (every composite at 0).
__device__ __forceinline__ bool in_prefix(uint64_t v, uint64_t prefix, int bits) {
  return bits == 0 || (v >> (64 - bits)) == prefix;
}

// A threshold t (an unsigned key) for the one pass over a row of n > cap keys, from a sample
// of it: kChunk-key lines spread evenly (n / (kSampleRate kChunk) of them, at most kChunks),
// their unsigned keys in `sample`, then the sample's `want`-th largest key's 22-bit prefix (a
// 12-bit histogram over `first`, a 10-bit one of its bin over `hist`), `want` the sample's
// expected count above the row's K-th key plus kSampleSigmas (3) standard deviations and 8.
// So the keys at or above t number K to about K (1 + 3 / sqrt(want)) + 8 n / S, mostly; where
// they do not the caller falls back to the two passes. 1 (every live key) where the sample is
// too small. The whole CTA calls it; every thread gets t.
template <int VEC>
__device__ uint32_t sample_threshold(const int32_t* p, int n, int K, uint32_t* sample,
                                     uint32_t* first, uint32_t* hist, Shared& sh) {
  const int chunks = min(kChunks, n / (kSampleRate * kChunk));
  if (chunks == 0) return 1u;
  const int S = chunks * kChunk;
  constexpr int kPer = kChunk / VEC;  // threads a chunk
  for (int i = threadIdx.x; i < chunks * kPer; i += kBlock) {
    const int j = i / kPer, o = (i % kPer) * VEC;
    const int c = static_cast<int>(static_cast<int64_t>(j) * n / chunks) & ~(kChunk - 1);
    int32_t a[VEC];
    Loads<VEC>::at(p, c + o, n, a);
#pragma unroll
    for (int k = 0; k < VEC; ++k) sample[j * kChunk + o + k] = ukey(a[k]);
  }
  for (int b = threadIdx.x; b < kBins; b += kBlock) first[b] = 0;
  for (int b = threadIdx.x; b < kNextBins; b += kBlock) hist[b] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < S; i += kBlock) {
    const uint32_t u = sample[i];
    if (u) atomicAdd(&first[u >> (32 - kFirstBits)], 1u);
  }
  __syncthreads();
  const float expect = static_cast<float>(K) * static_cast<float>(S) / static_cast<float>(n);
  const int want = min(S, static_cast<int>(ceilf(expect + kSampleSigmas * sqrtf(expect))) + 8);
  int live;
  find_bin(first, kBins, want, sh, live);
  if (live < want) return 1u;  // (uniform: `live` is the block's sum)
  const uint32_t b1 = static_cast<uint32_t>(sh.found_bin);
  const int need = want - sh.found_before;
  constexpr int kShift = 32 - kFirstBits - kNextBits;
  for (int i = threadIdx.x; i < S; i += kBlock) {
    const uint32_t u = sample[i];
    if (u && (u >> (32 - kFirstBits)) == b1) atomicAdd(&hist[(u >> kShift) & (kNextBins - 1)], 1u);
  }
  __syncthreads();
  int unused;
  find_bin(hist, kNextBins, need, sh, unused);
  const uint32_t t = (b1 << (32 - kFirstBits)) | (static_cast<uint32_t>(sh.found_bin) << kShift);
  return max(t, 1u);
}

// The one pass's append of a lane's VEC keys (columns c ..): those at or above t to cand, at
// places below cap (the count goes on past it: the caller then falls back), by one scan a
// warp and one atomic; `umax` the lane's largest key so far. Every lane of the warp calls it.
template <int VEC>
__device__ __forceinline__ void warp_append_from(uint64_t* cand, int cap, Shared& sh,
                                                 const int32_t (&a)[VEC], int c, uint32_t t,
                                                 uint32_t& umax) {
  const int lane = threadIdx.x & 31;
  uint32_t u[VEC];
  int mine = 0;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    u[j] = ukey(a[j]);
    mine += u[j] >= t;
    umax = max(umax, u[j]);
  }
  const int incl = warp_inclusive_sum(mine, lane);
  const int total = __shfl_sync(0xffffffffu, incl, 31);
  if (total == 0) return;
  int base = 0;
  if (lane == 31) base = atomicAdd(&sh.n_cand, total);
  int e = __shfl_sync(0xffffffffu, base, 31) + incl - mine;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    if (u[j] >= t) {
      if (e < cap) cand[e] = composite(u[j], c + j);
      ++e;
    }
  }
}

// The same append of a lane's two loads' keys (a: columns ca .., b: cb ..) at once: the lane
// counts both groups' keys at or above t in one word (16 bits each: at most 32 x VEC a warp),
// the warp scans the words once and one lane reserves both groups' places with one atomic;
// each key's store predicated, not branched around. (One scan and one atomic a load before:
// twice the shuffles and atomics, and a branch a key; bench/RESULTS.md.)
template <int VEC>
__device__ __forceinline__ void warp_append_from2(uint64_t* cand, int cap, Shared& sh,
                                                  const int32_t (&a)[VEC], int ca,
                                                  const int32_t (&b)[VEC], int cb, uint32_t t,
                                                  uint32_t& umax) {
  const int lane = threadIdx.x & 31;
  uint32_t ua[VEC], ub[VEC];
  unsigned mine = 0;  // a's count | b's << 16
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    ua[j] = ukey(a[j]);
    ub[j] = ukey(b[j]);
    mine += (ua[j] >= t ? 1u : 0u) + (ub[j] >= t ? 0x10000u : 0u);
    umax = max(umax, max(ua[j], ub[j]));
  }
  const unsigned incl = warp_inclusive_sum(mine, lane);
  const unsigned total = __shfl_sync(0xffffffffu, incl, 31);
  if (total == 0u) return;
  const int na = static_cast<int>(total & 0xffffu);
  int base = 0;
  if (lane == 31) base = atomicAdd(&sh.n_cand, na + static_cast<int>(total >> 16));
  base = __shfl_sync(0xffffffffu, base, 31);
  const unsigned before = incl - mine;
  int ea = base + static_cast<int>(before & 0xffffu);
  int eb = base + na + static_cast<int>(before >> 16);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const bool take = ua[j] >= t;
    if (take && ea < cap) cand[ea] = composite(ua[j], ca + j);
    ea += take ? 1 : 0;
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const bool take = ub[j] >= t;
    if (take && eb < cap) cand[eb] = composite(ub[j], cb + j);
    eb += take ? 1 : 0;
  }
}

// A bin held alone in bin[0, in_bin), in_bin <= kRankMax: each of its composites ranked
// against the others by one thread (composites are distinct; only the warps holding one loop),
// the `need` largest appended to sel: one barrier, against a 10-bit level's seven and more
// (and, before, a warp's finish of a bin of at most 32 after them, each scanning all of
// cand again). The whole CTA calls it.
__device__ void rank_finish(const uint64_t* bin, int in_bin, int need, uint64_t* sel,
                            Shared& sh) {
  if ((threadIdx.x & ~31) < in_bin) {  // (warp-uniform)
    const int t = threadIdx.x;
    const uint64_t x = t < in_bin ? bin[t] : 0u;
    int rank = 0;
    for (int j = 0; j < in_bin; ++j) rank += bin[j] > x;
    warp_append(sel, &sh.n_sel, t < in_bin && rank < need, x);
  }
  __syncthreads();
}

// The score of an unsigned key u (the inverse of the logits kernels' key map).
__device__ __forceinline__ float score_of(uint32_t u) {
  const int32_t key = static_cast<int32_t>(u ^ 0x80000000u);
  return __int_as_float(key < 0 ? key ^ 0x7fffffff : key);
}

// Sorts sel[0, m) descending by buckets and hands each composite to emit(place, composite):
// each composite mapped onto nb buckets (a multiple of kBlock), linearly between the smallest
// and the largest key's bits or score (below; float arithmetic rounds monotonically, so larger
// keys never land in a lower bucket), the largest in bucket 0; the buckets counted (a shared
// atomic a composite, which also gives its place in the bucket), their starts by one scan, the
// composites scattered by bucket to `buf`, and each composite of buf placed by its rank among
// its bucket's (its bucket found again from its key: a thread's places lie close together, so
// the caller's stores stay nearly coalesced). Returns false with sel untouched and nothing
// emitted where a bucket holds more than kBucketMax (ties, keys packed together): the caller
// sorts another way. `count` (nb) and `buf` (m) are free shared memory; sh.sort_hi,
// sort_lo_inv and sort_full 0 on entry. The whole CTA calls it.
template <class Emit>
__device__ bool bucket_sort(const uint64_t* sel, int m, int nb, uint32_t* count, uint64_t* buf,
                            Shared& sh, Emit emit) {
  constexpr int kItems = kSortMaxKS / kBlock > 0 ? kSortMaxKS / kBlock : 1;
  const int tid = threadIdx.x;
  uint32_t lo = 0xffffffffu, hi = 0u;
#pragma unroll
  for (int r = 0; r < kItems; ++r) {
    const int i = tid + r * kBlock;
    if (i < m) {
      const uint32_t u = static_cast<uint32_t>(sel[i] >> 32);
      lo = min(lo, u);
      hi = max(hi, u);
    }
  }
  for (int b = tid; b < nb; b += kBlock) count[b] = 0u;
  uint32_t lo_inv = ~lo;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lo_inv = max(lo_inv, __shfl_xor_sync(0xffffffffu, lo_inv, o));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  if ((tid & 31) == 0) {
    atomicMax(&sh.sort_lo_inv, lo_inv);
    atomicMax(&sh.sort_hi, hi);
  }
  __syncthreads();
  lo = ~sh.sort_lo_inv;
  // keys of one sign: linear in the key's bits (in each exponent, linear in the score: about
  // logarithmic, so scores spread over decades spread over the buckets); of both signs, whose
  // bits leave the exponents of the tiny magnitudes empty between them: linear in the score
#if defined(CPPLAN_ROW_TOPK_BUCKET_BY_KEY)  // a variant: by the key's bits always
  const bool by_key = true;
#else
  const bool by_key = ((lo ^ sh.sort_hi) & 0x80000000u) == 0u;
#endif
  const float low = by_key ? 0.0f : score_of(lo);
  const float range = by_key ? static_cast<float>(sh.sort_hi - lo) + 1.0f
                             : score_of(sh.sort_hi) - low;
  const float scale = static_cast<float>(nb) / range;
  // A place is NaN only where the range is 0 or not finite (0 * inf, inf * 0), where every
  // other place is 0, inf or NaN too: NaN counts as 0 (the last bucket), so the map stays
  // monotone and the ranks order them. The same map twice gives the same bucket.
  const auto bucket_of = [&](uint64_t v) {
    const uint32_t u = static_cast<uint32_t>(v >> 32);
    const float f = (by_key ? static_cast<float>(u - lo) : score_of(u) - low) * scale;
    return nb - 1 - (f >= static_cast<float>(nb - 1) ? nb - 1 : f > 0.0f ? static_cast<int>(f) : 0);
  };
  // each composite's bucket and its place in it in one register (bucket << 16 | place:
  // nb <= 2048, places < m <= 2048)
  int at[kItems];
#pragma unroll
  for (int r = 0; r < kItems; ++r) {
    const int i = tid + r * kBlock;
    if (i < m) {
      const int b = bucket_of(sel[i]);
      at[r] = b << 16 | static_cast<int>(atomicAdd(&count[b], 1u));
    }
  }
  __syncthreads();
  const int per = nb / kBlock;  // a thread's consecutive buckets
  int sum = 0, most = 0;
  for (int j = 0; j < per; ++j) {
    const int c = static_cast<int>(count[tid * per + j]);
    sum += c;
    most = max(most, c);
  }
  int total;
  int start = block_scan(sum, sh, total);
  if (most > kBucketMax) atomicMax(&sh.sort_full, 1);
  for (int j = 0; j < per; ++j) {  // counts -> starts
    const int c = static_cast<int>(count[tid * per + j]);
    count[tid * per + j] = static_cast<uint32_t>(start);
    start += c;
  }
  __syncthreads();
  if (sh.sort_full) return false;
#pragma unroll
  for (int r = 0; r < kItems; ++r) {
    const int i = tid + r * kBlock;
    if (i < m) buf[count[at[r] >> 16] + (at[r] & 0xffff)] = sel[i];
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kItems; ++r) {
    const int j = tid + r * kBlock;
    if (j < m) {
      const uint64_t x = buf[j];
      const int b = bucket_of(x), first = static_cast<int>(count[b]);
      const int end = b + 1 < nb ? static_cast<int>(count[b + 1]) : m;
      int rank = 0;
#if defined(CPPLAN_ROW_TOPK_RANK_PAIRS)  // a variant: two composites a 16-byte shared load
      // (pairs at 16-byte boundaries: buf is 8-byte aligned, off by one composite where KS
      // is 1; members outside [first, end) not counted: buf[first - 1] and buf[end] lie
      // inside cand's area, m <= kSortMaxKS)
      const int skew = static_cast<int>(reinterpret_cast<uintptr_t>(buf) >> 3) & 1;
      for (int i = first - ((first + skew) & 1); i < end; i += 2) {
        const ulonglong2 two = *reinterpret_cast<const ulonglong2*>(buf + i);
        rank += (i >= first && two.x > x ? 1 : 0) + (i + 1 < end && two.y > x ? 1 : 0);
      }
#else
      for (int i = first; i < end; ++i) rank += buf[i] > x;
#endif
      emit(first + rank, x);
    }
  }
  return true;
}

// A row's result: place p < K gets composite v's score and id (p < m), or a pad.
struct Result {
  float* s;
  int32_t* i;
  int K, m, decode_ids, W, I, rank;

  __device__ __forceinline__ void put(int p, uint64_t v) const {
    if (p >= K) return;
    if (p < m) {
      int32_t c = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(v));
      if (decode_ids) c = (c / I) * (W * I) + rank * I + c % I;
      s[p] = score_of(static_cast<uint32_t>(v >> 32));
      i[p] = c;
    } else {
      s[p] = __int_as_float(0xff800000);  // -inf
      i[p] = -1;
    }
  }
};

template <int VEC>
__global__ void __launch_bounds__(kBlock, kMinBlocks)
row_topk_kernel(const int32_t* __restrict__ keys, int64_t stride_k,
                const int32_t* __restrict__ lens, int L, int K, int KS, int cap,
                float* __restrict__ out_s, int32_t* __restrict__ out_i, int64_t stride_o,
                int decode_ids, int W, int I, int rank) {
#ifdef CPPLAN_HOST_EMULATION
  unsigned char* smem_raw = emu::dynamic_smem;
#else
  extern __shared__ __align__(16) unsigned char smem_raw[];
#endif
  uint64_t* sel = reinterpret_cast<uint64_t*>(smem_raw);  // KS: the result's composites
  uint64_t* cand = sel + KS;  // cap: the K-th composite's bin (from step 3)
  uint32_t* first = reinterpret_cast<uint32_t*>(cand);  // kBins: step 1's histogram (over cand)
  uint32_t* hist = reinterpret_cast<uint32_t*>(cand + cand_area(cap));  // kNextBins
  uint32_t* sample = first + kBins;  // the one pass's sample (past the first histogram)
  __shared__ Shared sh;

  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  const int n = max(0, min(lens[row], L));
  const int32_t* p = keys + row * stride_k;
  constexpr int kTile = kBlock * VEC;
  // the bin: composites whose top `bits` bits are `prefix`, in_bin of them, `need` of them
  // still wanted; cand[0, held) holds them (and others); all: every live key is in sel
  uint64_t prefix = 0u;
  int bits = 0, need = 0, in_bin = 0, held = 0;
  bool all = false;

  // 0. a row wider than cap and kOnePassFrom, in one pass: the keys at or above a threshold t
  //    from a sample of the row (sample_threshold) to cand; where those keys are at most cap,
  //    and at least K (or every live key), the K-th composite is among them: the bin is
  //    cand's, from the top bits all its keys share (those of t and of the largest). Else,
  //    and in narrower rows (measured slower in one pass: bench/RESULTS.md), steps 1-3.
#if defined(CPPLAN_ROW_TOPK_TWO_PASS)  // a variant: the two passes only (the form before)
  constexpr bool kOnePass = false;
#else
  constexpr bool kOnePass = true;
#endif
  bool one_pass = false;
  if (kOnePass && n > cap && n > kOnePassFrom) {
    if (tid == 0) {
      sh.n_sel = sh.n_cand = 0;
      sh.umax = 0u;
    }
    const uint32_t t = sample_threshold<VEC>(p, n, K, sample, first, hist, sh);
    __syncthreads();
    uint32_t umax = 0u;
    for (int c0 = 0; c0 < n; c0 += kLoads * kTile) {  // kLoads loads in flight a thread
      const int c = c0 + tid * VEC;
      if constexpr (kPrefetch > 0 && VEC == 4) {  // the lines kPrefetch iterations ahead
        // asked of L2 first, one lane a line (the loads then wait on L2, not DRAM)
        if ((tid & 7) == 0) {
#pragma unroll
          for (int j = 0; j < kLoads; ++j) {
            const int at = c + (kPrefetch * kLoads + j) * kTile;
            if (at < n) prefetch_l2(p + at);
          }
        }
      }
      int32_t v[kLoads][VEC];
#pragma unroll
      for (int j = 0; j < kLoads; ++j) Loads<VEC>::at(p, c + j * kTile, n, v[j]);
      // two loads' keys in one append (warp_append_from2), but with one key a load two
      // appends are fewer instructions, and in the 1024-thread build ptxas then spills 20
      // bytes (4 before) and lengthens other loops (nvcc 13.0 sm_90 SASS)
      if constexpr (kLoads == 1 || VEC == 1 || kBlock > 512) {
#pragma unroll
        for (int j = 0; j < kLoads; ++j)
          warp_append_from(cand, cap, sh, v[j], c + j * kTile, t, umax);
      } else {
#pragma unroll
        for (int j = 0; j < kLoads; j += 2)
          warp_append_from2(cand, cap, sh, v[j], c + j * kTile, v[j + 1], c + (j + 1) * kTile, t,
                            umax);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) umax = max(umax, __shfl_xor_sync(0xffffffffu, umax, o));
    if ((tid & 31) == 0) atomicMax(&sh.umax, umax);
    __syncthreads();
    const int got = sh.n_cand;
    one_pass = got <= cap && (got >= K || t == 1u);
#ifdef CPPLAN_HOST_EMULATION
    if (tid == 0) ++host_paths[t == 1u ? 0 : one_pass ? 1 : 2];
#endif
    if (one_pass) {
      held = in_bin = got;
      need = min(K, got);
      if (got > 0) {
        bits = __clz(static_cast<int>(t ^ sh.umax));  // t <= every key in cand <= umax
        prefix = bits ? static_cast<uint64_t>(t >> (32 - bits)) : 0u;
        skip_column_ones(prefix, bits, L);  // (every key equal)
      }
    }
    __syncthreads();  // (sh read before the fallback resets it)
  }

  if (!one_pass) {  // the two passes: steps 1-3
    // 1. histogram of the top kFirstBits bits of the live keys
    for (int b = tid; b < kBins; b += kBlock) first[b] = 0;
    if (tid == 0) {
      sh.n_sel = sh.n_cand = 0;
      sh.n_pair = 0u;
    }
    __syncthreads();
    for (int c0 = 0; c0 < n; c0 += 2 * kTile) {  // two loads in flight a thread
      int32_t a[VEC], b[VEC];
      Loads<VEC>::at(p, c0 + tid * VEC, n, a);
      Loads<VEC>::at(p, c0 + kTile + tid * VEC, n, b);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const uint32_t ua = ukey(a[j]), ub = ukey(b[j]);
        if (ua) atomicAdd(&first[ua >> (32 - kFirstBits)], 1u);
        if (ub) atomicAdd(&first[ub >> (32 - kFirstBits)], 1u);
      }
    }
    __syncthreads();
    int live;
    find_bin(first, kBins, K, sh, live);
    all = live <= K;  // every live key is in the result
    prefix = all ? 0u : static_cast<uint64_t>(sh.found_bin);
    bits = kFirstBits;
    need = all ? live : K - sh.found_before;
    in_bin = all ? 0 : sh.found_count;

    // 2. a bin too large for `cand`: refined over the row (ties, or keys packed in a narrow range)
    while (!all && in_bin > cap) {
      const int d = min(kNextBits, 64 - bits);
      for (int b = tid; b < kNextBins; b += kBlock) hist[b] = 0;
      __syncthreads();
      for (int c0 = 0; c0 < n; c0 += kTile) {
        int32_t a[VEC];
        const int c = c0 + tid * VEC;
        Loads<VEC>::at(p, c, n, a);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const uint64_t v = composite(ukey(a[j]), c + j);
          if ((v >> 32) && (v >> (64 - bits)) == prefix)
            atomicAdd(&hist[(v >> (64 - bits - d)) & ((1u << d) - 1)], 1u);
        }
      }
      __syncthreads();
      int unused;
      find_bin(hist, kNextBins, need, sh, unused);
      prefix = (prefix << d) | static_cast<uint64_t>(sh.found_bin);
      bits += d;
      need -= sh.found_before;
      in_bin = sh.found_count;
      skip_column_ones(prefix, bits, L);
    }

    // 3. the composites above the bin to sel (fewer than K), those in it to cand (at most cap):
    //    while the bin is a prefix of the key (bits <= 32), or every live key is wanted, by the
    //    keys' unsigned bounds and one scan a warp (warp_append_scan); else by the composites
#if defined(CPPLAN_ROW_TOPK_BALLOT_APPEND)  // a variant: two ballots a key (the form before)
    constexpr bool kScan = false;
#else
    constexpr bool kScan = true;
#endif
    if (kScan && (all || bits <= 32)) {
      // all: every live key (u != 0) above; else the bin is [lo, hi] (lo at least 1: u = 0 is
      // "no key"), hi + 1 wrapping to 0 at the top bin
      const uint32_t lo = all ? 1u : max(static_cast<uint32_t>(prefix) << (32 - bits), 1u);
      const uint32_t hi = all ? 0u : ((static_cast<uint32_t>(prefix) + 1u) << (32 - bits)) - 1u;
      for (int c0 = 0; c0 < n; c0 += kTile) {
        int32_t a[VEC];
        const int c = c0 + tid * VEC;
        Loads<VEC>::at(p, c, n, a);
        warp_append_scan(sel, cand, sh, a, c, lo, hi);
      }
      __syncthreads();
      if (tid == 0) {
        sh.n_sel = static_cast<int>(sh.n_pair & 0xffffu);
        sh.n_cand = static_cast<int>(sh.n_pair >> 16);
      }
    } else {
      for (int c0 = 0; c0 < n; c0 += kTile) {
        int32_t a[VEC];
        const int c = c0 + tid * VEC;
        Loads<VEC>::at(p, c, n, a);
        bool up[VEC], eq[VEC];
        uint64_t v[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const uint32_t u = ukey(a[j]);
          v[j] = composite(u, c + j);
          if (all) {
            up[j] = u != 0u;
            eq[j] = false;
          } else if (bits <= 32) {
            const uint32_t hi = u >> (32 - bits);
            up[j] = u != 0u && hi > static_cast<uint32_t>(prefix);
            eq[j] = u != 0u && hi == static_cast<uint32_t>(prefix);
          } else {
            const uint64_t hi = v[j] >> (64 - bits);
            up[j] = u != 0u && hi > prefix;
            eq[j] = u != 0u && hi == prefix;
          }
        }
        warp_append_vec(sel, &sh.n_sel, up, v);
        warp_append_vec(cand, &sh.n_cand, eq, v);
      }
    }
    __syncthreads();
    held = in_bin;
  }

  // 4. refine the bin inside cand until it holds exactly the composites still needed.
  //    cand[base, base + held) holds the bin (and, where held > in_bin, other composites);
  //    each level copies its new bin alone to free places of cand (below the region, or above
  //    it, where it fits), so that the next level reads the bin only; a level whose digit
  //    leaves the bin whole only extends the prefix. A bin held alone of at most kRankMax is
  //    ranked (rank_finish); one among others (its copy did not fit: rare) refined on, which
  //    ends by the 64th bit (composites are distinct).
  if (!all) {
    const int area = cand_area(cap);
    int base = 0;
    bool finished = false;
    while (in_bin > need) {
      if (held == in_bin && in_bin <= kRankMax) {
        rank_finish(cand + base, in_bin, need, sel, sh);
#ifdef CPPLAN_HOST_EMULATION
        if (tid == 0) ++host_paths[5];
#endif
        finished = true;
        break;
      }
      // (digits stop at the key's end, where skip_column_ones applies)
      const int d = min(kNextBits, bits < 32 ? 32 - bits : 64 - bits);
      const int shift = 64 - bits - d;  // the digit's place
      const uint64_t* region = cand + base;
      for (int b = tid; b < kNextBins; b += kBlock) hist[b] = 0;
      if (tid == 0) sh.n_next = 0;
      __syncthreads();
      for (int i = tid; i < held; i += kBlock) {
        const uint64_t v = region[i];
        if (in_prefix(v, prefix, bits)) atomicAdd(&hist[(v >> shift) & ((1u << d) - 1)], 1u);
      }
      __syncthreads();
      int unused;
      find_bin(hist, kNextBins, need, sh, unused);
      const uint64_t b = sh.found_bin;
      const int next = sh.found_count;
      if (next < in_bin) {  // else the new bin is the bin: nothing above it, none below
        // the new bin's copy: below the region, else above it, else none (ties of many keys)
        const int to = next <= base ? 0 : base + held + next <= area ? area - next : -1;
        for (int i0 = 0; i0 < held; i0 += kBlock) {  // the composites above the new bin
          const int i = i0 + tid;
          const uint64_t v = i < held ? region[i] : 0u;
          const bool mine = i < held && in_prefix(v, prefix, bits);
          const uint64_t digit = (v >> shift) & ((1u << d) - 1);
          warp_append(sel, &sh.n_sel, mine && digit > b, v);
          if (to >= 0) warp_append(cand + to, &sh.n_next, mine && digit == b, v);
        }
        if (to >= 0) {
          base = to;
          held = next;
        }
#ifdef CPPLAN_HOST_EMULATION
        if (tid == 0) ++host_paths[to >= 0 ? 6 : 7];
#endif
      }
#ifdef CPPLAN_HOST_EMULATION
      else if (tid == 0) ++host_paths[8];
#endif
      prefix = (prefix << d) | b;
      bits += d;
      need -= sh.found_before;
      in_bin = next;
      skip_column_ones(prefix, bits, L);
      __syncthreads();
    }
    if (!finished) {
      for (int i0 = 0; i0 < held; i0 += kBlock) {  // the bin's own: all needed
        const int i = i0 + tid;
        const uint64_t v = i < held ? cand[base + i] : 0u;
        warp_append(sel, &sh.n_sel, i < held && in_prefix(v, prefix, bits), v);
      }
      __syncthreads();
    }
  }

  // 5. the result, sorted; pads below every live composite (whose key bits are not 0), and
  //    distinct. The result's pointers are made where it is written, after the sort's
  //    barriers (registers).
  if (tid == 0) {
    sh.sort_hi = sh.sort_lo_inv = 0u;
    sh.sort_full = 0;
  }
  const auto fill_pads = [&] {  // sel[n_sel, KS): the other sorts read all KS
    for (int i = sh.n_sel + tid; i < KS; i += kBlock) sel[i] = static_cast<uint64_t>(KS - i);
    __syncthreads();
  };
#define CPPLAN_RESULT \
  const Result out{out_s + row * stride_o, out_i + row * stride_o, K, sh.n_sel, decode_ids, W, I, rank}
#if defined(CPPLAN_ROW_TOPK_PROBE_NO_SORT)  // a probe (bench only): the result unordered
  fill_pads();
  CPPLAN_RESULT;
  for (int i = tid; i < K; i += kBlock) out.put(i, sel[i]);
#else
#if defined(CPPLAN_ROW_TOPK_SMEM_SORT)  // a variant: every stage in shared memory
  constexpr bool kShared = true;
#else
  constexpr bool kShared = false;
#endif
#if defined(CPPLAN_ROW_TOPK_MERGE_SORT)  // a variant: merges instead of the bitonic network
  constexpr bool kMerge = true;
#else
  constexpr bool kMerge = false;
#endif
  constexpr int kMergeItems = 2048 / kBlock;  // composites a thread in the merge sort
#if defined(CPPLAN_ROW_TOPK_MERGE_FROM)  // runs of this many by the network first
  constexpr int kMergeFrom = CPPLAN_ROW_TOPK_MERGE_FROM;
#else
  constexpr int kMergeFrom = kMergeItems;
#endif
#if defined(CPPLAN_ROW_TOPK_NO_BUCKET_SORT)  // a variant: no buckets (the form before)
  constexpr bool kBuckets = false;
#else
  constexpr bool kBuckets = true;
#endif
  __syncthreads();  // sh.sort_*
  const bool bucketed =
      kBuckets && KS <= kSortMaxKS &&
      bucket_sort(sel, sh.n_sel, max(KS, kBlock), reinterpret_cast<uint32_t*>(cand),
                  cand + kSortMaxKS / 2, sh, [&](int p, uint64_t v) {
                    CPPLAN_RESULT;
                    out.put(p, v);
                  });
#ifdef CPPLAN_HOST_EMULATION
  if (tid == 0 && kBuckets && KS <= kSortMaxKS) ++host_paths[bucketed ? 3 : 4];
#endif
  if (bucketed) {  // the pads
    CPPLAN_RESULT;
    for (int i = sh.n_sel + tid; i < K; i += kBlock) out.put(i, 0u);
    return;
  }
  fill_pads();
  if (kMerge && KS == 2048) {
    uint64_t e[kMergeItems];
    merge_sort_registers<2048, kMergeItems, kMergeFrom>(sel, e);
    CPPLAN_RESULT;
#pragma unroll
    for (int r = 0; r < kMergeItems; ++r) out.put(kMergeItems * tid + r, e[r]);
  } else if (!kShared && KS == 2 * kBlock) {  // two values a thread
    uint64_t a, b;
    bitonic_sort_registers<2 * kBlock>(sel, a, b);
    CPPLAN_RESULT;
    const int ia = (tid >> 5) * 64 + (tid & 31);
    out.put(ia, a);
    out.put(ia + 32, b);
  } else if (!kShared && kBlock <= 512 && KS == 4 * kBlock) {  // four values a thread
    uint64_t e[4];
    bitonic_sort4_registers<4 * kBlock>(sel, e);
    CPPLAN_RESULT;
    const int base = (tid >> 5) * 128 + (tid & 31) * 4;
    if (tid < KS / 4)
#pragma unroll
      for (int r = 0; r < 4; ++r) out.put(base + r, e[r]);
  } else {
    bitonic_sort_shared(sel, KS);
    CPPLAN_RESULT;
    for (int i = tid; i < K; i += kBlock) out.put(i, sel[i]);
  }
#endif
#undef CPPLAN_RESULT
}

size_t smem_bytes(int KS, int cap) {
  return static_cast<size_t>(KS + cand_area(cap)) * sizeof(uint64_t) +
         kNextBins * sizeof(uint32_t);
}

#ifdef CPPLAN_HOST_EMULATION
}  // namespace

// The kernel on the host: rows one after another, a CTA's threads as fibers (std::threads
// with CPPLAN_HOST_THREADS).
extern "C" int cpplan_row_topk_host(const int32_t* keys, int64_t stride_k, const int32_t* lens,
                                    int rows, int L, int K, int KS, int cap, float* out_s,
                                    int32_t* out_i, int64_t stride_o, int decode_ids, int W,
                                    int I, int rank, int vec4) {
  std::vector<uint64_t> smem((smem_bytes(KS, cap) + 7) / 8);
  emu::Cta cta(kBlock, reinterpret_cast<unsigned char*>(smem.data()));
  const bool finished = cta.run(rows, [&] {
    if (vec4)
      row_topk_kernel<4>(keys, stride_k, lens, L, K, KS, cap, out_s, out_i, stride_o,
                         decode_ids, W, I, rank);
    else
      row_topk_kernel<1>(keys, stride_k, lens, L, K, KS, cap, out_s, out_i, stride_o,
                         decode_ids, W, I, rank);
  });
  return finished ? 0 : 1;  // 1: the CTA's threads deadlocked at a barrier
}

// The rows the one pass took since the library loaded: [every live key, the sample's
// threshold, fell back to the two passes], then the rows step 5 sorted by buckets and those
// it fell back from (a bucket over kBucketMax).
extern "C" const long long* cpplan_row_topk_host_paths() { return host_paths; }

#else
template <int VEC>
int launch(const int32_t* keys, int64_t stride_k, const int32_t* lens, int rows, int L, int K,
           int KS, int cap, float* out_s, int32_t* out_i, int64_t stride_o, int decode_ids,
           int W, int I, int rank, cudaStream_t stream) {
  row_topk_kernel<VEC><<<rows, kBlock, smem_bytes(KS, cap), stream>>>(keys, stride_k, lens, L, K, KS, cap,
                                                        out_s, out_i, stride_o, decode_ids, W, I,
                                                        rank);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" {

// The candidates' buffer the launcher passes as `cap` (8192 but in a bench variant).
int cpplan_row_topk_cap() { return kCap; }

// Shared memory a CTA takes for a result of KS (a power of two >= K) and `cap` candidates.
size_t cpplan_row_topk_smem(int KS, int cap) { return smem_bytes(KS, cap); }

// Lets the kernels take up to `smem` bytes of dynamic shared memory on the current device
// (once a device, before the first launch: not a stream operation, so not inside a graph's
// capture); returns a cudaError_t.
int cpplan_row_topk_init(size_t smem) {
  cudaError_t err = cudaFuncSetAttribute(row_topk_kernel<4>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(row_topk_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
  return static_cast<int>(err);
}

// Launches the select on `stream`; returns a cudaError_t (0: launched). The launcher checks
// the arguments (row_topk.py); `vec4`: rows 16-byte aligned (stride and base).
int cpplan_row_topk(const int32_t* keys, int64_t stride_k, const int32_t* lens, int rows, int L,
                    int K, int KS, int cap, float* out_s, int32_t* out_i, int64_t stride_o,
                    int decode_ids, int W, int I, int rank, int vec4, void* stream) {
  if (rows == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  return vec4 ? launch<4>(keys, stride_k, lens, rows, L, K, KS, cap, out_s, out_i, stride_o,
                          decode_ids, W, I, rank, s)
              : launch<1>(keys, stride_k, lens, rows, L, K, KS, cap, out_s, out_i, stride_o,
                          decode_ids, W, I, rank, s);
}

const char* cpplan_row_topk_error(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
#endif  // CPPLAN_HOST_EMULATION
