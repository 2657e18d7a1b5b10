// Search helpers on the CPU: the same int64 (score, id) keys as the CUDA
// kernels in maxsim-cuda/topk_keys.cu (contract in retrieval.py).
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "torch_binding.h"

namespace maxsim {
namespace {
constexpr int64_t kLow = 0xFFFFFFFFll;
constexpr int32_t kNanOrder = INT32_MIN;
}  // namespace

at::Tensor block_topk_cpu(const at::Tensor& scores, int64_t id0, int64_t k) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.dim() == 2,
              "maxsim: block_topk takes fp32 [rows, n] CPU scores");
  TORCH_CHECK(k >= 0 && id0 >= 0 && id0 + scores.size(1) < kLow, "maxsim: block_topk: bad k / id range");
  const at::Tensor s = scores.contiguous();
  at::Tensor keys = at::empty(s.sizes(), s.options().dtype(at::kLong));
  const float* sp = s.data_ptr<float>();
  int64_t* kp = keys.data_ptr<int64_t>();
  const int64_t n = s.size(1);
  at::parallel_for(0, s.numel(), 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float v = sp[i] + 0.0f;
      int32_t bits;
      std::memcpy(&bits, &v, 4);
      int32_t order = bits >= 0 ? bits : (bits ^ 0x7FFFFFFF);
      if (std::isnan(v)) order = kNanOrder;
      kp[i] = (int64_t)order * (kLow + 1) + (kLow - (id0 + i % n));
    }
  });
  const int64_t kk = std::min<int64_t>(k, n);
  if (kk == n) return std::get<0>(at::sort(keys, 1, /*descending=*/true));
  return std::get<0>(at::topk(keys, kk, 1, /*largest=*/true, /*sorted=*/true));
}

std::tuple<at::Tensor, at::Tensor> decode_keys_cpu(const at::Tensor& keys) {
  TORCH_CHECK(keys.device().is_cpu() && keys.scalar_type() == at::kLong, "maxsim: decode_keys takes int64 CPU keys");
  const at::Tensor k = keys.contiguous();
  at::Tensor s = at::empty(k.sizes(), k.options().dtype(at::kFloat));
  at::Tensor ids = at::empty(k.sizes(), k.options());
  const int64_t* kp = k.data_ptr<int64_t>();
  float* sp = s.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < k.numel(); ++i) {
    if (kp[i] == INT64_MIN) {
      sp[i] = -INFINITY;
      ip[i] = -1;
      continue;
    }
    int32_t order = (int32_t)(kp[i] >> 32);
    ip[i] = kLow - (kp[i] & kLow);
    int32_t bits = order >= 0 ? order : (order ^ 0x7FFFFFFF);
    float v;
    std::memcpy(&v, &bits, 4);
    sp[i] = order == kNanOrder ? NAN : v;
  }
  return {s, ids};
}

}  // namespace maxsim
