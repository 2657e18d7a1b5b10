// Top kk (< kMaxK) of one chunk of a row of search keys (see search_keys.h),
// one CTA per (row, chunk): blockIdx.x = row * nchunks + chunk, chunks of
// `chunk` of the n values per row, scores (KEYS = false; encoded here with
// ids id0 + column, or ids[row, column]) or keys. Writes kk keys, sorted
// descending, at out + blockIdx.x * kk (INT64_MIN, the empty slot, past the
// chunk's real keys).
//
// Keys are unsigned-ordered (u = key ^ sign; u = 0: empty slot, ignored).
// A range [lo, hi] is cut into 2048 bins by (u - lo) >> shift (monotone in
// u); one pass counts the bins and a scan finds the bin of the need-th key.
// select_kernel (k <= kSmallK): a first pass over the threads' maxima (one
// each) bounds the need-th key from below, and only the keys at or above
// that bound become candidates (all keys if over 2048); if more than
// max(64, 1.5 k) candidates remain, passes over them narrow the range to the
// need-th key's bin (11 bits each) until the keys from it up fit; those are
// sorted, exact ids breaking ties.
//
// The kernel is one SM's latency, and its time grows with its static code: every phase runs once per warp, so
// fully unrolled per-key code runs at instruction-fetch speed. Hence the
// keys live in shared memory (dynamic, 12 bytes per key: staged scores or
// ids, then the keys in place) and every phase is a rolled loop over them;
// the scores arrive by cp.async (the loop issues every copy without waiting
// on any). Cross-warp reductions and scans are repeated by every warp rather
// than paying a second barrier, and a small winner set is ranked by counting
// (each key compares against all others, a few threads per key) instead of
// a bitonic network of log^2 barrier-separated stages.
#pragma once

#include <cstdint>

#include "../common/common.cuh"  // cp.async wrappers, pdl_enter
#include "search_keys.h"

namespace maxsim {
namespace topk_select {

constexpr int kMaxK = 1024;
constexpr int kBinBits = 11, kBins = 1 << kBinBits;
constexpr int kCap = 2048;  // keys the final sort takes
constexpr int kSmallK = 256;       // select_kernel up to this k, select_wide_kernel above
constexpr int kChunk = 12 * 1024;  // keys per select_kernel CTA (fewer where shared memory is smaller)
constexpr unsigned long long kSign = 0x8000000000000000ull;  // signed key -> unsigned order
constexpr int kBatch = 8;  // rounds of keys loaded at once per thread

__device__ __forceinline__ unsigned long long shfl_xor_u64(unsigned long long v, int m) {
  const unsigned lo = __shfl_xor_sync(0xffffffffu, (unsigned)v, m);
  const unsigned hi = __shfl_xor_sync(0xffffffffu, (unsigned)(v >> 32), m);
  return ((unsigned long long)hi << 32) | lo;
}

// Warp-wide min, max and sum, left in every lane.
__device__ __forceinline__ void warp_min_max_sum(unsigned long long& mn, unsigned long long& mx, int& cnt) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    mn = min(mn, shfl_xor_u64(mn, o));
    mx = max(mx, shfl_xor_u64(mx, o));
    cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
  }
}

__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// One histogram pass over the values u in [lo, hi] (u = 0: none), bins of
// width 2^shift, into a zeroed hist: the bin holding the need-th largest
// value, the values in higher bins, those in the bin. Three barriers; the
// shared state a pass writes was last read before the previous pass' last
// barrier, so passes follow each other without more.
// v: the values (u = 0: none), thread t holding v[t], v[t + T], ... < v + m
// (OWN: one value per thread, v[0] private to it).
template <int T, bool OWN>
__device__ __forceinline__ void bin_pass(const unsigned long long* v, int m, unsigned long long lo,
                                         unsigned long long hi, int shift, int need, int* hist, int* wsum, int* bcast,
                                         int& bin, int& above, int& inbin) {
  constexpr int W = T / 32, BPT = kBins / T;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Loads batched ahead of the atomics (which the compiler may not reorder
  // them across): one shared-memory latency per batch, not per round.
  constexpr int kB = OWN ? 1 : kBatch;
  const int rounds = OWN ? 1 : (m + T - 1) / T;
  for (int r0 = 0; r0 < rounds; r0 += kB) {  // whole warps: the shuffles below
    unsigned long long x[kB];
#pragma unroll
    for (int j = 0; j < kB; ++j) {
      const int i = (r0 + j) * T + tid;
      x[j] = OWN ? v[0] : i < m ? v[i] : 0;
    }
#pragma unroll
    for (int j = 0; j < kB; ++j) {
      const unsigned long long u = x[j];
      // Values of a warp often share a bin (a range stretched by NaN / -inf
      // outliers): lane 0's bin gets one add for all its sharers.
      const bool inr = u >= lo && u <= hi && u != 0;
      const int b = inr ? (int)((u - lo) >> shift) : -1;
      const int lead = __shfl_sync(0xffffffffu, b, 0);
      const unsigned same = __ballot_sync(0xffffffffu, inr && b == lead);
      if (lane == 0 && same) atomicAdd(&hist[lead], __popc(same));
      if (inr && b != lead) atomicAdd(&hist[b], 1);
    }
  }
  __syncthreads();
  // Thread t owns bins B-1-BPT t ... B-BPT (t+1) (highest first); its
  // exclusive prefix over threads = values in higher bins.
  int h[BPT], mine = 0;
#pragma unroll
  for (int b = 0; b < BPT; ++b) {
    h[b] = hist[kBins - 1 - BPT * tid - b];
    mine += h[b];
  }
  const int incl = warp_inclusive_scan(mine, lane);
  if (lane == 31) wsum[warp] = incl;
  __syncthreads();
  const int w = lane < W ? wsum[lane] : 0;
  const int wi = warp_inclusive_scan(w, lane);
  int run = __shfl_sync(0xffffffffu, wi - w, warp) + incl - mine;
#pragma unroll
  for (int b = 0; b < BPT; ++b) {
    if (run < need && need <= run + h[b]) {
      bcast[0] = kBins - 1 - BPT * tid - b;
      bcast[1] = run;
      bcast[2] = h[b];
    }
    run += h[b];
  }
  __syncthreads();
  bin = bcast[0];
  above = bcast[1];
  inbin = bcast[2];
}

__device__ __forceinline__ int bin_shift(unsigned long long span) {
  return span == 0 ? 0 : max(0, 64 - __clzll(span) - kBinBits);
}

// After a pass found the need-th key in `bin` (above: keys in higher bins,
// inbin: keys in it): true, with the cut at the bin's low edge, when the
// keys from there up fit `cap` or the bin is one value (exact_cut: equal
// keys, repeated explicit ids, need capping); else narrows [lo, hi] to the
// bin for another pass.
__device__ __forceinline__ bool narrow(int bin, int above, int inbin, int shift, int cap, unsigned long long& lo,
                                       unsigned long long& hi, int& above_range, int& need, unsigned long long& cut,
                                       bool& exact_cut) {
  const unsigned long long blo = lo + ((unsigned long long)bin << shift);
  const bool done = above_range + above + inbin <= cap || shift == 0;
  need -= above;
  if (done) {
    cut = blo;
    exact_cut = shift == 0;
    return true;
  }
  above_range += above;
  if (hi - blo > (1ull << shift) - 1) hi = blo + ((1ull << shift) - 1);  // no overflow
  lo = blo;
  return false;
}

// Block-wide min / max / sum. EVERY: each warp reduces the W warp partials
// itself (one barrier); else warp 0 does and broadcasts them (two barriers,
// fewer live registers: the register-resident select_wide_kernel spills
// with EVERY).
template <int W, bool EVERY = true>
__device__ __forceinline__ void block_min_max_sum(unsigned long long& mn, unsigned long long& mx, int& cnt,
                                                  unsigned long long (*red)[W], int* wsum) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  warp_min_max_sum(mn, mx, cnt);
  if (lane == 0) {
    red[0][warp] = mn;
    red[1][warp] = mx;
    wsum[warp] = cnt;
  }
  __syncthreads();
  if (EVERY || warp == 0) {
    mn = lane < W ? red[0][lane] : ~0ull;
    mx = lane < W ? red[1][lane] : 0;
    cnt = lane < W ? wsum[lane] : 0;
    warp_min_max_sum(mn, mx, cnt);
  }
  if (!EVERY) {
    if (warp == 0 && lane == 0) {  // warp 0's reads are behind its shuffles
      red[0][0] = mn;
      red[1][0] = mx;
      wsum[0] = cnt;
    }
    __syncthreads();
    mn = red[0][0];
    mx = red[1][0];
    cnt = wsum[0];
  }
}

// Descending bitonic sort of one value per lane (no barriers).
__device__ __forceinline__ unsigned long long warp_sort_desc(unsigned long long x, int lane) {
#pragma unroll
  for (int size = 2; size <= 32; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      const unsigned long long y = shfl_xor_u64(x, stride);
      const bool keep_max = ((lane & stride) == 0) == ((lane & size) == 0 || size == 32);
      x = keep_max ? max(x, y) : min(x, y);
    }
  }
  return x;
}

// The top kk of the c keys in s (unsigned-ordered, unique but for capped
// equal ones), written to o best first, INT64_MIN past c. Few keys: ranks
// by counting. More: warps sort runs of 32 in registers, and a key's rank
// is its place in its run plus, per other run, the keys ahead of it there
// (a 6-step binary search). Either way no barrier-separated network stages.
template <int T>
__device__ __forceinline__ void sort_out(unsigned long long* s, int c, int kk, int64_t* o) {
  const int tid = threadIdx.x, lane = tid & 31;
  int P = 32;
  while (P < c) P <<= 1;
  if (P <= T && P * P <= 128 * T) {
    // Few keys: rank by counting, tpk threads per key each comparing against
    // every tpk-th key (independent loads, no dependent chains);
    // consecutive sub-lanes read consecutive words (no bank conflicts).
    const int tpk = min(32, T / P);
    const int i = tid / tpk, sub = tid - i * tpk;
    if (i < P) {  // whole warps: P tpk is a multiple of 32
      const unsigned long long x = i < c ? s[i] : 0;
      int rank = 0;
      for (int j = sub; j < c; j += tpk) {
        const unsigned long long y = s[j];
        rank += y > x || (y == x && j < i);
      }
      for (int d = tpk >> 1; d > 0; d >>= 1) rank += __shfl_xor_sync(0xffffffffu, rank, d);
      if (sub == 0 && i < c && rank < kk) o[rank] = (int64_t)(x ^ kSign);
    }
    for (int r = c + tid; r < kk; r += T) o[r] = INT64_MIN;
    return;
  }
  const int rounds = (c + T - 1) / T;
  for (int r = 0; r < rounds; ++r) {  // whole warps: the shuffles
    const int i = r * T + tid;
    const unsigned long long x = warp_sort_desc(i < c ? s[i] : 0, lane);
    if (i < c) s[i] = x;  // zero padding sorts last, past c
  }
  __syncthreads();
  const int nruns = (c + 31) / 32;
  for (int i = tid; i < c; i += T) {
    const unsigned long long x = s[i];
    const int mine = i >> 5;
    int rank = i & 31;
    for (int q = 0; q < nruns; ++q) {
      if (q == mine) continue;
      const unsigned long long* run = s + 32 * q;
      const int len = min(32, c - 32 * q);
      const bool before = q < mine;  // equal keys of earlier runs rank ahead
      int pos = 0;
#pragma unroll
      for (int step = 16; step > 0; step >>= 1) {
        if (pos + step <= len) {
          const unsigned long long y = run[pos + step - 1];
          if (before ? y >= x : y > x) pos += step;
        }
      }
      if (pos < len) {
        const unsigned long long y = run[pos];
        pos += before ? y >= x : y > x;
      }
      rank += pos;
    }
    if (rank < kk) o[rank] = (int64_t)(x ^ kSign);
  }
  for (int r = c + tid; r < kk; r += T) o[r] = INT64_MIN;
}

// Shared bytes per key of a chunk (dynamic: the keys, the staged scores).
constexpr int kBytesPerKey = 12;

template <int T, bool KEYS>
__global__ void __launch_bounds__(T)
    select_kernel(const void* __restrict__ in, const int64_t* __restrict__ ids, int64_t n, int64_t id0,
                  int nchunks, int chunk, int kk, int64_t* __restrict__ out) {
  static_assert(T % 32 == 0 && T <= 1024 && kBins % T == 0, "threads");
  pdl_enter();
  constexpr int W = T / 32;
  extern __shared__ __align__(16) unsigned char smem[];
  // Two histograms (two passes without re-zeroing), then the selected keys
  // in the same bytes: the last pass' histogram reads end at its barrier.
  __shared__ unsigned long long cand[kCap], sel[kCap];
  static_assert(sizeof(sel) == 2 * kBins * sizeof(int), "histograms alias sel");
  int(*hist)[kBins] = reinterpret_cast<int(*)[kBins]>(sel);
  __shared__ unsigned long long red[2][W];
  __shared__ int wsum[W];
  __shared__ int bcast[3];  // bin, keys above it, keys in it
  __shared__ int count[2];
  const int tid = threadIdx.x, lane = tid & 31;
  const unsigned below = (1u << lane) - 1;
  const int64_t row = blockIdx.x / nchunks;
  const int64_t base = (int64_t)(blockIdx.x - row * nchunks) * chunk;
  const int m = (int)(n - base < chunk ? n - base : (int64_t)chunk);  // keys of this chunk
  unsigned long long* key = reinterpret_cast<unsigned long long*>(smem);  // [chunk]: ids / keys, then keys
  float* score = reinterpret_cast<float*>(smem + 8 * (size_t)chunk);     // [chunk]
  int64_t* o = out + (int64_t)blockIdx.x * kk;
  if constexpr (KEYS) {
    const int64_t* p = static_cast<const int64_t*>(in) + row * n + base;
    for (int i = tid; i < m; i += T) cuda_fwd::cp_async<8>(cuda_fwd::smem_u32(key + i), p + i, true);
  } else {
    const float* p = static_cast<const float*>(in) + row * n + base;
    for (int i = tid; i < m; i += T) cuda_fwd::cp_async<4>(cuda_fwd::smem_u32(score + i), p + i, true);
    if (ids)
      for (int i = tid; i < m; i += T)
        cuda_fwd::cp_async<8>(cuda_fwd::smem_u32(key + i), ids + row * n + base + i, true);
  }
  cuda_fwd::cp_async_commit();
  // Zeroed meanwhile, ordered by the first barrier below.
  for (int i = tid; i < 2 * kBins; i += T) hist[0][i] = 0;
  if (tid < 2) count[tid] = 0;
  cuda_fwd::cp_async_wait_all();
  // Each thread reads only what it copied until the first barrier.

  // A key's score rank + 1 (0: no key), 32 bits: the cheap first look.
  auto rank_of = [&](int i) -> unsigned long long {
    if constexpr (KEYS) {
      const int64_t k = (int64_t)key[i];
      return k == INT64_MIN ? 0 : (unsigned long long)((uint32_t)(k >> 32) ^ 0x80000000u) + 1;
    } else {
      if (ids && (int64_t)key[i] < 0) return 0;
      return (unsigned long long)((uint32_t)search_keys::order(score[i]) ^ 0x80000000u) + 1;
    }
  };
  auto encoded = [&](int i) -> unsigned long long {
    if constexpr (KEYS)
      return key[i] ^ kSign;
    else
      return (unsigned long long)search_keys::encode_id(score[i], ids ? (int64_t)key[i] : id0 + base + i) ^ kSign;
  };
  unsigned long long tmax = 0;
  int live = 0;
  for (int i = tid; i < m; i += T) {  // no stores: the compiler pipelines the loads
    const unsigned long long r = rank_of(i);
    tmax = max(tmax, r);
    live += r != 0;
  }
  // Block: the least / largest thread maximum, keys, threads holding any
  // (packed: keys < 2^16 per chunk, threads <= 1024).
  unsigned long long mnm = tmax ? tmax : ~0ull, mxm = tmax;
  int packed = live + ((tmax != 0) << 16);
  block_min_max_sum<W>(mnm, mxm, packed, red, wsum);
  live = packed & 0xffff;
  const int nthr = packed >> 16;
  const int need0 = min(kk, live);
  if (need0 == 0) {
    for (int r = tid; r < kk; r += T) o[r] = INT64_MIN;
    return;
  }

  // The need-th largest of the threads' maxima bounds the need-th key from
  // below (need distinct keys reach it): one histogram of T maxima leaves
  // as candidates only the keys of its bin or above (random scores: ~k + k
  // m / T^2 of them), the only ones encoded and passed on.
  unsigned long long cut0 = 1;
  if (need0 <= nthr) {
    const int shift = bin_shift(mxm - mnm);
    int bin, above, inbin;
    bin_pass<T, true>(&tmax, 1, mnm, mxm, shift, need0, hist[0], wsum, bcast, bin, above, inbin);
    cut0 = mnm + ((unsigned long long)bin << shift);
  }
  const int rounds = (m + T - 1) / T;
  for (int r0 = 0; r0 < rounds; r0 += kBatch) {  // whole warps: the votes
    unsigned long long rk[kBatch];  // loaded ahead of the candidate stores
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = (r0 + j) * T + tid;
      rk[j] = i < m ? rank_of(i) : 0;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const bool take = rk[j] >= cut0 && rk[j] != 0;
      const unsigned b = __ballot_sync(0xffffffffu, take);
      if (b) {  // few rounds have any: one reservation for the warp's
        int slot = 0;
        if (lane == 0) slot = atomicAdd(&count[0], __popc(b));
        slot = __shfl_sync(0xffffffffu, slot, 0) + __popc(b & below);
        if (take && slot < kCap) cand[slot] = encoded((r0 + j) * T + tid);
      }
    }
  }
  __syncthreads();
  int c = count[0];
  unsigned long long* v = cand;
  if (c > kCap) {  // ties at the bound, or an adversarial layout: every key
    for (int i = tid; i < m; i += T) key[i] = encoded(i);  // in place, own slots
    __syncthreads();
    v = key;
    c = m;
  }

  // Exact select among the c candidates v (keys; 0: none): sorted whole
  // when few, else binned passes down to at most `cap` of them.
  const int cap = max(64, kk + kk / 2);
  if (c > cap) {
    unsigned long long lo = ~0ull, hi = 0;
    int unused = 0;
    for (int i = tid; i < c; i += T) {
      if (v[i] != 0) {
        lo = min(lo, v[i]);
        hi = max(hi, v[i]);
      }
    }
    block_min_max_sum<W>(lo, hi, unused, red, wsum);
    int need = need0;             // keys still to take from [lo, hi]
    int above_range = 0;          // keys above hi, all taken
    unsigned long long cut = lo;  // take every key >= cut (those == cut: `need` of them when exact)
    bool exact_cut = false;
    for (int pass = 1;; ++pass) {
      const int shift = bin_shift(hi - lo);
      int* hp = hist[pass & 1];
      if (pass >= 2) {  // zeroed at the start for the first two passes
        for (int i = tid; i < kBins; i += T) hp[i] = 0;
        __syncthreads();
      }
      int bin, above, inbin;
      bin_pass<T, false>(v, c, lo, hi, shift, need, hp, wsum, bcast, bin, above, inbin);
      if (narrow(bin, above, inbin, shift, cap, lo, hi, above_range, need, cut, exact_cut)) break;
    }
    // Gather: keys > cut, then (exact cut) `need` of those == cut, else all >= cut.
    const int vr = (c + T - 1) / T;
    for (int r0 = 0; r0 < vr; r0 += kBatch) {
      unsigned long long x[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = (r0 + j) * T + tid;
        x[j] = i < c ? v[i] : 0;
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const bool take = x[j] != 0 && (exact_cut ? x[j] > cut : x[j] >= cut);
        const unsigned b = __ballot_sync(0xffffffffu, take);
        if (b) {
          int slot = 0;
          if (lane == 0) slot = atomicAdd(&count[1], __popc(b));
          slot = __shfl_sync(0xffffffffu, slot, 0) + __popc(b & below);
          if (take) sel[slot] = x[j];  // at most cap <= kCap of them
        }
      }
    }
    if (exact_cut) {
      __syncthreads();  // every key > cut has its slot before the capped ones
      for (int i = tid; i < c; i += T) {
        if (v[i] != 0 && v[i] == cut) {
          const int at = atomicAdd(&count[1], 1);
          if (at < kCap) sel[at] = v[i];
        }
      }
    }
    __syncthreads();
    v = sel;
    c = min(count[1], kCap);
  }
  sort_out<T>(v, c, kk, o);
}


// kk > kSmallK: the earlier form of the same select, keys in registers
// (1024 threads x 12 per chunk), one histogram pass over every key, then a
// bitonic sort of up to 2048 winners. Its fixed per-phase cost is higher
// (above), but for wide selects its register-resident passes and network
// sort are faster than the shared-memory passes and the run-merge ranks.
// Its single pass takes the keys from the bin up when at most
// max(256, 2 k) of them, chunks of <= 256 live keys skip it.
constexpr int kWideThreads = 1024, kWidePer = 12, kWideChunk = kWideThreads * kWidePer;

template <bool KEYS>
__global__ void __launch_bounds__(kWideThreads)
    select_wide_kernel(const void* __restrict__ in, const int64_t* __restrict__ ids, int64_t n, int64_t id0,
                       int nchunks, int kk, int64_t* __restrict__ out) {
  pdl_enter();
  __shared__ int hist[kBins];
  __shared__ unsigned long long sel[kCap];
  __shared__ unsigned long long red[2][32];
  __shared__ int wsum[32];
  __shared__ int bcast[4];  // bin, keys above it, keys in it, count
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t row = blockIdx.x / nchunks;
  const int64_t base = (int64_t)(blockIdx.x - row * nchunks) * kWideChunk;
  unsigned long long u[kWidePer];
  unsigned long long mn = ~0ull, mx = 0;
#pragma unroll
  for (int e = 0; e < kWidePer; ++e) {
    const int64_t c = base + e * kWideThreads + tid;
    int64_t key = INT64_MIN;
    if (c < n) {
      if constexpr (KEYS)
        key = static_cast<const int64_t*>(in)[row * n + c];
      else
        key = search_keys::encode_id(static_cast<const float*>(in)[row * n + c], ids ? ids[row * n + c] : id0 + c);
    }
    u[e] = (unsigned long long)key ^ kSign;
    if (u[e] != 0) {
      mn = min(mn, u[e]);
      mx = max(mx, u[e]);
    }
  }
  // Block min / max of the real keys and their count.
  int cnt = 0;
#pragma unroll
  for (int e = 0; e < kWidePer; ++e) cnt += u[e] != 0;
  block_min_max_sum<32, false>(mn, mx, cnt, red, wsum);
  unsigned long long lo = mn, hi = mx;
  const int live = cnt;
  int need = min(kk, live);  // keys still to take from [lo, hi]
  int pk = 1;
  while (pk < kk) pk <<= 1;
  // Fewer keys to sort beat fewer passes: a pass costs ~5 barriers, the
  // sort of 2048 keys 30 more stages than that of 256.
  const int cap = max(256, 2 * pk);
  int above_range = 0;       // keys above hi, all taken
  unsigned long long cut = lo;  // take every key >= cut (those == cut: `need` of them when shift == 0)
  int shift = 0;
  bool exact_cut = false;
  if (need > 0 && live > cap) {
    while (true) {
      const unsigned long long span = hi - lo;
      shift = span == 0 ? 0 : max(0, 64 - __clzll(span) - kBinBits);
      hist[tid] = 0;
      hist[tid + kWideThreads] = 0;
      __syncthreads();
#pragma unroll
      for (int e = 0; e < kWidePer; ++e) {
        // Keys of a warp often share a bin (a first range stretched by NaN /
        // -inf outliers): lane 0's bin gets one add for all its sharers.
        const bool in = u[e] >= lo && u[e] <= hi && u[e] != 0;
        const int bin = in ? (int)((u[e] - lo) >> shift) : -1;
        const int lead = __shfl_sync(0xffffffffu, bin, 0);
        const unsigned same = __ballot_sync(0xffffffffu, in && bin == lead);
        if (lane == 0 && same) atomicAdd(&hist[lead], __popc(same));
        if (in && bin != lead) atomicAdd(&hist[bin], 1);
      }
      __syncthreads();
      // Thread t owns bins B-1-2t, B-2-2t (highest first); exclusive prefix
      // over threads = keys in higher bins.
      const int b0 = kBins - 1 - 2 * tid, h0 = hist[b0], h1 = hist[b0 - 1];
      int incl = h0 + h1;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      if (lane == 31) wsum[warp] = incl;
      __syncthreads();
      if (warp == 0) {
        int w = wsum[lane], wi = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int y = __shfl_up_sync(0xffffffffu, wi, o);
          if (lane >= o) wi += y;
        }
        wsum[lane] = wi - w;  // exclusive
      }
      __syncthreads();
      const int excl = wsum[warp] + incl - (h0 + h1);
      if (excl < need && need <= excl + h0) {
        bcast[0] = b0;
        bcast[1] = excl;
        bcast[2] = h0;
      } else if (excl + h0 < need && need <= excl + h0 + h1) {
        bcast[0] = b0 - 1;
        bcast[1] = excl + h0;
        bcast[2] = h1;
      }
      __syncthreads();
      const int bin = bcast[0], above = bcast[1], inbin = bcast[2];
      __syncthreads();  // bcast / hist / wsum are rewritten by the next pass
      if (narrow(bin, above, inbin, shift, cap, lo, hi, above_range, need, cut, exact_cut)) break;
    }
  } else if (need > 0) {
    cut = lo;  // every real key fits the sort
  }
  // Gather: keys > cut, then (exact cut) `need` of those == cut, else all >= cut.
  int* count = &bcast[3];
  __syncthreads();
  if (tid == 0) *count = 0;
  const int total = need <= 0 ? 0 : min(kCap, live);
  int P = pk;
  for (int i = tid; i < kCap; i += kWideThreads) sel[i] = 0;
  __syncthreads();
  if (total > 0) {
#pragma unroll
    for (int e = 0; e < kWidePer; ++e) {
      const bool take = u[e] != 0 && (exact_cut ? u[e] > cut : u[e] >= cut);
      const unsigned m = __ballot_sync(0xffffffffu, take);
      int slot0 = 0;
      if (lane == 0 && m) slot0 = atomicAdd(count, __popc(m));
      slot0 = __shfl_sync(0xffffffffu, slot0, 0);
      if (take) sel[slot0 + __popc(m & ((1u << lane) - 1))] = u[e];
    }
    if (exact_cut) {
      __syncthreads();
#pragma unroll
      for (int e = 0; e < kWidePer; ++e) {
        if (u[e] != 0 && u[e] == cut) {
          const int slot = atomicAdd(count, 1);
          if (slot < kCap) sel[slot] = u[e];
        }
      }
    }
  }
  __syncthreads();
  const int got = min(*count, kCap);
  while (P < got) P <<= 1;
  // Bitonic sort, thread t on pair t (P / 2 <= kWideThreads), run by the
  // whole warps that hold pairs only (a named barrier over them; the other
  // warps issued every stage's loop and barrier for nothing: ncu showed the
  // kernel bound by issue latency). At strides <= 32 warp w only touches
  // elements [64 w, 64 w + 64): a warp barrier is enough between two such
  // stages.
  const int nsort = max(32, P / 2);
  if (tid < nsort) {
    for (int size = 2; size <= P; size <<= 1) {
      for (int stride = size >> 1; stride > 0; stride >>= 1) {
        if (tid < P / 2) {
          const int i = 2 * tid - (tid & (stride - 1)), j = i + stride;
          const bool desc = (i & size) == 0;
          const unsigned long long a = sel[i], b = sel[j];
          if ((a < b) == desc) {
            sel[i] = b;
            sel[j] = a;
          }
        }
        const int next = stride > 1 ? stride >> 1 : size;  // next stage's stride
        if (stride > 32 || next > 32)
          asm volatile("bar.sync 1, %0;" ::"r"(nsort) : "memory");
        else
          __syncwarp();
      }
    }
  }
  __syncthreads();
  int64_t* o = out + (int64_t)blockIdx.x * kk;
  for (int i = tid; i < kk; i += kWideThreads) o[i] = (int64_t)(sel[i] ^ kSign);
}

}  // namespace topk_select
}  // namespace maxsim
