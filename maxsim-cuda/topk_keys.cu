// Search helpers: (score, document id) packed into int64 keys ordered by
// "higher score, then lower id" (see torch-ext/maxsim/retrieval.py), so an
// exact, deterministic top-k is one torch topk over unique keys, and blocks,
// streams and ranks merge by another topk. One kernel each way instead of a
// dozen elementwise ops.
// block_topk selects in two steps when k is small: each 4096-score chunk of
// a row is encoded and bitonic-sorted in shared memory by one CTA, which keeps
// its best k; one topk over those candidates finishes. A torch topk
// over all n int64 keys is a multi-pass radix select (~0.1 ms for 10k keys
// on H100, more than a 10k-doc int8 scan).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "search_keys.h"
#include "torch_binding.h"

namespace maxsim {
namespace {

__global__ void encode_keys_kernel(const float* __restrict__ s, int64_t* __restrict__ out, int64_t total, int64_t n,
                                   int64_t id0) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < total) out[i] = search_keys::encode(s[i], id0 + i % n);
}

constexpr int kTopkChunk = 4096, kTopkThreads = 1024;

// One CTA per (row, chunk): keys of scores[row, chunk * 4096 ...] (padding =
// INT64_MIN, below every real key), sorted descending; the first kk go out.
__global__ void __launch_bounds__(kTopkThreads) chunk_topk_kernel(const float* __restrict__ s, int64_t n, int64_t id0,
                                                                  int nchunks, int kk, int64_t* __restrict__ out) {
  __shared__ int64_t keys[kTopkChunk];
  const int64_t row = blockIdx.x / nchunks;
  const int chunk = blockIdx.x - (int)(row * nchunks);
  const int64_t base = (int64_t)chunk * kTopkChunk;
  const float* sr = s + row * n;
  for (int i = threadIdx.x; i < kTopkChunk; i += kTopkThreads) {
    const int64_t c = base + i;
    keys[i] = c < n ? search_keys::encode(sr[c], id0 + c) : INT64_MIN;
  }
  for (int size = 2; size <= kTopkChunk; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
#pragma unroll
      for (int t = threadIdx.x; t < kTopkChunk / 2; t += kTopkThreads) {
        const int i = 2 * t - (t & (stride - 1)), j = i + stride;  // i has bit `stride` clear
        const bool desc = (i & size) == 0;  // the last merge (size = chunk) is all descending
        const int64_t a = keys[i], b = keys[j];
        if ((a < b) == desc) {
          keys[i] = b;
          keys[j] = a;
        }
      }
    }
  }
  __syncthreads();
  int64_t* o = out + (int64_t)blockIdx.x * kk;
  for (int i = threadIdx.x; i < kk; i += kTopkThreads) o[i] = keys[i];
}

__global__ void decode_keys_kernel(const int64_t* __restrict__ k, float* __restrict__ s, int64_t* __restrict__ ids,
                                   int64_t total) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < total) search_keys::decode(k[i], s[i], ids[i]);
}

}  // namespace

at::Tensor block_topk_cuda(const at::Tensor& scores, int64_t id0, int64_t k) {
  TORCH_CHECK(scores.is_cuda() && scores.scalar_type() == at::kFloat && scores.dim() == 2,
              "maxsim: block_topk takes fp32 [rows, n] CUDA scores");
  TORCH_CHECK(k >= 0 && id0 >= 0 && id0 + scores.size(1) < search_keys::kLow, "maxsim: block_topk: bad k / id range");
  c10::cuda::CUDAGuard guard(scores.device());
  const at::Tensor s = scores.contiguous();
  const int64_t R = s.size(0), n = s.size(1);
  const int64_t kk = std::min<int64_t>(k, n);
  auto stream = at::cuda::getCurrentCUDAStream();
  if (kk < 1024 && R > 0 && n > 0) {
    // Each chunk keeps kk (< 1024 < chunk size) candidates; one chunk is the answer.
    const int64_t nchunks = (n + kTopkChunk - 1) / kTopkChunk;
    at::Tensor cand = at::empty({R, nchunks * kk}, s.options().dtype(at::kLong));
    if (kk > 0) {
      chunk_topk_kernel<<<(unsigned)(R * nchunks), kTopkThreads, 0, stream>>>(s.data_ptr<float>(), n, id0,
                                                                              (int)nchunks, (int)kk,
                                                                              cand.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (nchunks == 1 || kk == 0) return cand;
    return std::get<0>(at::topk(cand, kk, 1, /*largest=*/true, /*sorted=*/true));
  }
  at::Tensor keys = at::empty(s.sizes(), s.options().dtype(at::kLong));
  const int64_t total = s.numel();
  if (total > 0) {
    encode_keys_kernel<<<(unsigned)((total + 255) / 256), 256, 0, stream>>>(
        s.data_ptr<float>(), keys.data_ptr<int64_t>(), total, n, id0);
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
