// Search helpers on the CPU: the same int64 (score, id) keys as the CUDA
// kernels in maxsim-cuda/topk_keys.cu (contract in retrieval.py).
#include <ATen/Parallel.h>

#include "rescore_compose.h"
#include "search_keys.h"
#include "torch_binding.h"

namespace maxsim {

at::Tensor block_topk_cpu(const at::Tensor& scores, int64_t id0, int64_t k, const c10::optional<at::Tensor>& ids) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.dim() == 2,
              "maxsim: block_topk takes fp32 [rows, n] CPU scores");
  TORCH_CHECK(k >= 0 && id0 >= 0 && id0 + scores.size(1) < search_keys::kLow, "maxsim: block_topk: bad k / id range");
  TORCH_CHECK(!ids || (ids->device().is_cpu() && ids->scalar_type() == at::kLong && ids->sizes() == scores.sizes()),
              "maxsim: block_topk: ids must be int64 with the scores' shape and device");
  const at::Tensor s = scores.contiguous();
  const at::Tensor idt = ids ? ids->contiguous() : at::Tensor();
  const int64_t* ip = ids ? idt.data_ptr<int64_t>() : nullptr;
  at::Tensor keys = at::empty(s.sizes(), s.options().dtype(at::kLong));
  const float* sp = s.data_ptr<float>();
  int64_t* kp = keys.data_ptr<int64_t>();
  const int64_t n = s.size(1);
  at::parallel_for(0, s.numel(), 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) kp[i] = search_keys::encode_id(sp[i], ip ? ip[i] : id0 + i % n);
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
  for (int64_t i = 0; i < k.numel(); ++i) search_keys::decode(kp[i], sp[i], ip[i]);
  return {s, ids};
}

std::tuple<at::Tensor, at::Tensor> rescore_topk_cpu(const at::Tensor& q, const at::Tensor& q_start,
                                                    const at::Tensor& q_len, const std::optional<at::Tensor>& q_mask,
                                                    const at::Tensor& d, const at::Tensor& d_start,
                                                    const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
                                                    const at::Tensor& keys, int64_t lq, int64_t k) {
  return rescore_topk_composed(&forward_cpu, &block_topk_cpu, &decode_keys_cpu, q, q_start, q_len, q_mask, d, d_start,
                               d_len, d_mask, keys, lq, k);
}

}  // namespace maxsim
