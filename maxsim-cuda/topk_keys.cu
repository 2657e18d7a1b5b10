// Search helpers: (score, document id) packed into int64 keys ordered by
// "higher score, then lower id" (see torch-ext/maxsim/retrieval.py), so an
// exact, deterministic top-k is one torch topk over unique keys, and blocks,
// streams and ranks merge by another topk. One kernel each way instead of a
// dozen elementwise ops.
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
  at::Tensor keys = at::empty(s.sizes(), s.options().dtype(at::kLong));
  const int64_t total = s.numel();
  if (total > 0) {
    encode_keys_kernel<<<(unsigned)((total + 255) / 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        s.data_ptr<float>(), keys.data_ptr<int64_t>(), total, s.size(1), id0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t kk = std::min<int64_t>(k, s.size(1));
  if (kk == s.size(1)) return std::get<0>(at::sort(keys, 1, /*descending=*/true));
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
