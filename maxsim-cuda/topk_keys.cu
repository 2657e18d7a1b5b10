// Search helpers: (score, document id) packed into int64 keys ordered by
// "higher score, then lower id" (see torch-ext/maxsim/retrieval.py), so an
// exact, deterministic top-k is one torch topk over unique keys, and blocks,
// streams and ranks merge by another topk. One kernel each way instead of a
// dozen elementwise ops.
// block_topk, k < 1024: each CTA takes a chunk of up to 12288 keys into
// registers and finds its top k by a radix select on the key bits, most
// significant byte first (a 256-bin histogram per pass, stopping as soon as
// the k-th key's byte prefix is unique, so usually 3-4 passes), then
// bitonic-sorts those k in shared memory. Rows longer than a chunk repeat
// the select over the chunks' winners. A torch topk over 10k int64 keys is a
// multi-pass radix select of several launches (~0.1 ms on H100, more than a
// 10k-doc int8 scan); a full bitonic sort of each chunk was ~0.07 ms.
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

constexpr int kSelThreads = 512, kSelPer = 24, kSelChunk = kSelThreads * kSelPer, kSelMaxK = 1024;

// Top kk (<= kSelMaxK) of one chunk (blockIdx.x = row * nchunks + chunk) of
// n values per row: scores (KEYS = false; encoded here with ids id0 + column,
// or ids[row, column]) or keys (padding = INT64_MIN, below every real key).
// Writes kk keys, sorted descending, at out + blockIdx.x * kk.
template <bool KEYS>
__global__ void __launch_bounds__(kSelThreads)
    select_topk_kernel(const void* __restrict__ in, const int64_t* __restrict__ ids, int64_t n, int64_t id0,
                       int nchunks, int kk, int64_t* __restrict__ out) {
  __shared__ int hist[256];
  __shared__ unsigned long long sel[kSelMaxK];
  __shared__ int bcast[3];  // chosen byte, keys still needed, done
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t row = blockIdx.x / nchunks;
  const int64_t base = (int64_t)(blockIdx.x - row * nchunks) * kSelChunk;
  constexpr unsigned long long kSign = 0x8000000000000000ull;  // signed key -> unsigned order
  unsigned long long u[kSelPer];
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
  }
  unsigned long long prefix = 0;
  int need = kk, shift = 64;
  while (shift > 0) {
    shift -= 8;
    for (int i = tid; i < 256; i += kSelThreads) hist[i] = 0;
    __syncthreads();
    const int hs = shift + 8;  // bits above this byte must equal the prefix's
#pragma unroll
    for (int e = 0; e < kSelPer; ++e) {
      const bool live = hs == 64 || (u[e] >> hs) == (prefix >> hs);
      if (__any_sync(0xffffffffu, live)) {  // most keys drop out after a pass or two
        const int b = live ? (int)((u[e] >> shift) & 255) : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, b);
        if (live && lane == __ffs(peers) - 1) atomicAdd(&hist[b], __popc(peers));
      }
    }
    __syncthreads();
    if (warp == 0) {
      // Lane l holds bins 255 - 8l .. 248 - 8l (high bins first).
      int h[8], tot = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        h[i] = hist[255 - 8 * lane - i];
        tot += h[i];
      }
      int incl = tot;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      int above = incl - tot;  // keys in higher bins than this lane's
      if (above < need && need <= incl) {  // the need-th key's bin is here
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if (above < need && need <= above + h[i]) {
            bcast[0] = 255 - 8 * lane - i;
            bcast[1] = need - above;
            bcast[2] = h[i] == need - above;
          }
          above += h[i];
        }
      }
    }
    __syncthreads();
    prefix |= (unsigned long long)bcast[0] << shift;
    need = bcast[1];
    const bool done = bcast[2];
    __syncthreads();  // bcast / hist are rewritten by the next pass
    if (done) break;
  }
  // Selected: the keys above the final prefix (kk - need of them), then
  // `need` of those equal to it (all of them when the prefix ended unique;
  // otherwise the remaining ones are equal keys, e.g. padding, all alike).
  int* count = hist;
  if (tid == 0) *count = 0;
  const int P = kk <= 1 ? 1 : 1 << (32 - __clz(kk - 1));  // sort size, power of two
  for (int i = tid; i < P; i += kSelThreads) sel[i] = 0;
  const unsigned long long cut = prefix >> shift;
  __syncthreads();
#pragma unroll
  for (int e = 0; e < kSelPer; ++e)
    if ((u[e] >> shift) > cut) sel[atomicAdd(count, 1)] = u[e];
  __syncthreads();
#pragma unroll
  for (int e = 0; e < kSelPer; ++e) {
    if ((u[e] >> shift) == cut) {
      const int slot = atomicAdd(count, 1);
      if (slot < kk) sel[slot] = u[e];
    }
  }
  for (int size = 2; size <= P; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      for (int t = tid; t < P / 2; t += kSelThreads) {
        const int i = 2 * t - (t & (stride - 1)), j = i + stride;
        const bool desc = (i & size) == 0;
        const unsigned long long a = sel[i], b = sel[j];
        if ((a < b) == desc) {
          sel[i] = b;
          sel[j] = a;
        }
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
