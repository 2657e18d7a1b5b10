// Search helpers: (score, document id) packed into int64 keys ordered by
// "higher score, then lower id" (see torch-ext/maxsim/retrieval.py), so an
// exact, deterministic top-k is one torch topk over unique keys, and blocks,
// streams and ranks merge by another topk. One kernel each way instead of a
// dozen elementwise ops.
// block_topk, k < 1024: each CTA (1024 threads) takes a chunk of up to
// 12288 keys into registers and selects its top k (see select_topk_kernel);
// rows longer than a chunk repeat the select over the chunks' winners. A
// torch topk over 10k int64 keys is a multi-pass radix select of several
// launches (~0.1 ms on H100, more than a 10k-doc int8 scan).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "search_keys.h"
#include "torch_binding.h"

namespace maxsim {
namespace {

__global__ void encode_keys_kernel(const float* __restrict__ s, const int64_t* __restrict__ ids,
                                   int64_t* __restrict__ out, int64_t total, int64_t n, int64_t id0) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < total) out[i] = search_keys::encode_id(s[i], ids ? ids[i] : id0 + i % n);
}

constexpr int kSelThreads = 1024, kSelPer = 12, kSelChunk = kSelThreads * kSelPer, kSelMaxK = 1024;
constexpr int kSelBinBits = 11, kSelBins = 1 << kSelBinBits;  // 2 bins per thread
constexpr int kSelCap = 2048;                                  // keys the final sort takes

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

// Top kk (< kSelMaxK) of one chunk (blockIdx.x = row * nchunks + chunk) of
// n values per row: scores (KEYS = false; encoded here with ids id0 + column,
// or ids[row, column]) or keys. Writes kk keys, sorted descending, at out +
// blockIdx.x * kk (INT64_MIN, the empty slot, past the chunk's real keys).
//
// Keys are unsigned-ordered (u = key ^ sign; u = 0: empty slot, ignored).
// The live range [lo, hi] starts at the chunk's min / max and is cut into
// 2048 bins by (u - lo) >> shift (monotone in u); one pass counts the bins,
// a block scan finds the bin of the need-th key, and if at most max(256,
// 2 k) keys lie in that bin or above they are gathered and bitonic-sorted,
// exact ids breaking ties. Otherwise the range narrows to that bin and the
// pass repeats (11 more bits each time; one pass is the usual case for
// scores). Chunks of at most 256 live keys skip the histogram.
// One pass replaces the 3-4 byte passes plus per-byte barriers of a fixed
// 8-bit radix select (20 us for 10k scores on H100 with 512 threads).
template <bool KEYS>
__global__ void __launch_bounds__(kSelThreads)
    select_topk_kernel(const void* __restrict__ in, const int64_t* __restrict__ ids, int64_t n, int64_t id0,
                       int nchunks, int kk, int64_t* __restrict__ out) {
  __shared__ int hist[kSelBins];
  __shared__ unsigned long long sel[kSelCap];
  __shared__ unsigned long long red[2][32];
  __shared__ int wsum[32];
  __shared__ int bcast[4];  // bin, keys above it, keys in it, count
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t row = blockIdx.x / nchunks;
  const int64_t base = (int64_t)(blockIdx.x - row * nchunks) * kSelChunk;
  constexpr unsigned long long kSign = 0x8000000000000000ull;  // signed key -> unsigned order
  unsigned long long u[kSelPer];
  unsigned long long mn = ~0ull, mx = 0;
#pragma unroll
  for (int e = 0; e < kSelPer; ++e) {
    const int64_t c = base + e * kSelThreads + tid;
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
  for (int e = 0; e < kSelPer; ++e) cnt += u[e] != 0;
  warp_min_max_sum(mn, mx, cnt);
  if (lane == 0) {
    red[0][warp] = mn;
    red[1][warp] = mx;
    wsum[warp] = cnt;
  }
  __syncthreads();
  if (warp == 0) {
    mn = red[0][lane];
    mx = red[1][lane];
    cnt = wsum[lane];
    warp_min_max_sum(mn, mx, cnt);
    if (lane == 0) {
      red[0][0] = mn;
      red[1][0] = mx;
      bcast[3] = cnt;
    }
  }
  __syncthreads();
  unsigned long long lo = red[0][0], hi = red[1][0];
  const int live = bcast[3];
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
      shift = span == 0 ? 0 : max(0, 64 - __clzll(span) - kSelBinBits);
      hist[tid] = 0;
      hist[tid + kSelThreads] = 0;
      __syncthreads();
#pragma unroll
      for (int e = 0; e < kSelPer; ++e) {
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
      const int b0 = kSelBins - 1 - 2 * tid, h0 = hist[b0], h1 = hist[b0 - 1];
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
      const unsigned long long blo = lo + ((unsigned long long)bin << shift);
      if (above_range + above + inbin <= cap || shift == 0) {
        cut = blo;
        exact_cut = shift == 0;  // one value: equal keys (repeated explicit ids) need capping
        need -= above;
        break;
      }
      above_range += above;
      need -= above;
      if (hi - blo > (1ull << shift) - 1) hi = blo + ((1ull << shift) - 1);  // no overflow
      lo = blo;
    }
  } else if (need > 0) {
    cut = lo;  // every real key fits the sort
  }
  // Gather: keys > cut, then (exact cut) `need` of those == cut, else all >= cut.
  int* count = &bcast[3];
  __syncthreads();
  if (tid == 0) *count = 0;
  const int total = need <= 0 ? 0 : min(kSelCap, live);
  int P = pk;
  for (int i = tid; i < kSelCap; i += kSelThreads) sel[i] = 0;
  __syncthreads();
  if (total > 0) {
#pragma unroll
    for (int e = 0; e < kSelPer; ++e) {
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
      for (int e = 0; e < kSelPer; ++e) {
        if (u[e] != 0 && u[e] == cut) {
          const int slot = atomicAdd(count, 1);
          if (slot < kSelCap) sel[slot] = u[e];
        }
      }
    }
  }
  __syncthreads();
  const int got = min(*count, kSelCap);
  while (P < got) P <<= 1;
  // Bitonic sort, thread t on pair t (P / 2 <= kSelThreads), run by the
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
  for (int i = tid; i < kk; i += kSelThreads) o[i] = (int64_t)(sel[i] ^ kSign);
}

__global__ void decode_keys_kernel(const int64_t* __restrict__ k, float* __restrict__ s, int64_t* __restrict__ ids,
                                   int64_t total) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < total) search_keys::decode(k[i], s[i], ids[i]);
}

}  // namespace

at::Tensor block_topk_cuda(const at::Tensor& scores, int64_t id0, int64_t k, const c10::optional<at::Tensor>& ids) {
  TORCH_CHECK(scores.is_cuda() && scores.scalar_type() == at::kFloat && scores.dim() == 2,
              "maxsim: block_topk takes fp32 [rows, n] CUDA scores");
  TORCH_CHECK(k >= 0 && id0 >= 0 && id0 + scores.size(1) < search_keys::kLow, "maxsim: block_topk: bad k / id range");
  TORCH_CHECK(!ids || (ids->device() == scores.device() && ids->scalar_type() == at::kLong &&
                       ids->sizes() == scores.sizes()),
              "maxsim: block_topk: ids must be int64 with the scores' shape and device");
  c10::cuda::CUDAGuard guard(scores.device());
  const at::Tensor s = scores.contiguous();
  const at::Tensor idt = ids ? ids->contiguous() : at::Tensor();
  const int64_t* ip = ids ? idt.data_ptr<int64_t>() : nullptr;
  const int64_t R = s.size(0), n = s.size(1);
  const int64_t kk = std::min<int64_t>(k, n);
  auto stream = at::cuda::getCurrentCUDAStream();
  if (kk < kSelMaxK && R > 0 && n > 0) {
    at::Tensor cur = at::empty({R, 0}, s.options().dtype(at::kLong));
    if (kk == 0) return cur;
    // Chunks of the scores, then rounds over the chunks' winners until one
    // chunk per row remains (sizes known here: no host sync).
    int64_t m = n;
    bool keys = false;
    while (true) {
      const int64_t nchunks = (m + kSelChunk - 1) / kSelChunk;
      at::Tensor next = at::empty({R, nchunks * kk}, s.options().dtype(at::kLong));
      const void* src = keys ? (const void*)cur.data_ptr<int64_t>() : (const void*)s.data_ptr<float>();
      if (keys)
        select_topk_kernel<true><<<(unsigned)(R * nchunks), kSelThreads, 0, stream>>>(
            src, nullptr, m, id0, (int)nchunks, (int)kk, next.data_ptr<int64_t>());
      else
        select_topk_kernel<false><<<(unsigned)(R * nchunks), kSelThreads, 0, stream>>>(
            src, ip, m, id0, (int)nchunks, (int)kk, next.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      cur = next;
      keys = true;
      m = nchunks * kk;
      if (nchunks == 1) return cur;
    }
  }
  at::Tensor keys = at::empty(s.sizes(), s.options().dtype(at::kLong));
  const int64_t total = s.numel();
  if (total > 0) {
    encode_keys_kernel<<<(unsigned)((total + 255) / 256), 256, 0, stream>>>(
        s.data_ptr<float>(), ip, keys.data_ptr<int64_t>(), total, n, id0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (kk == n) return std::get<0>(at::sort(keys, 1, /*descending=*/true));
  return std::get<0>(at::topk(keys, kk, 1, /*largest=*/true, /*sorted=*/true));
}

std::tuple<at::Tensor, at::Tensor> decode_keys_cuda(const at::Tensor& keys) {
  TORCH_CHECK(keys.is_cuda() && keys.scalar_type() == at::kLong, "maxsim: decode_keys takes int64 CUDA keys");
  c10::cuda::CUDAGuard guard(keys.device());
  const at::Tensor k = keys.contiguous();
  at::Tensor s = at::empty(k.sizes(), k.options().dtype(at::kFloat));
  at::Tensor ids = at::empty(k.sizes(), k.options());
  const int64_t total = k.numel();
  if (total > 0) {
    decode_keys_kernel<<<(unsigned)((total + 255) / 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        k.data_ptr<int64_t>(), s.data_ptr<float>(), ids.data_ptr<int64_t>(), total);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {s, ids};
}

}  // namespace maxsim
