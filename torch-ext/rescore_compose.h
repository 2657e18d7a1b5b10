// rescore_topk from a backend's forward, block_topk and decode_keys: the
// candidates as a LIST pair list over the documents, their exact scores, the
// top k of them decoded. The CPU backend's implementation, and the CUDA
// backend's wherever its fused kernel does not apply (rescore_topk.cu).
#pragma once

#include <cstdint>

#include "torch_binding.h"

namespace maxsim {

// The checks every backend makes on rescore_topk's own arguments (the
// forward checks the rest).
inline void check_rescore_args(const at::Tensor& q_start, const at::Tensor& keys, int64_t k) {
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.dim() == 2 && keys.device() == q_start.device(),
              "maxsim: rescore_topk: keys must be int64 [Nq, candidates] on the queries' device");
  TORCH_CHECK(keys.size(0) == q_start.numel(), "maxsim: rescore_topk: keys must have one row per query");
  TORCH_CHECK(k >= 0, "maxsim: rescore_topk: k must be >= 0");
}

// The top k of each row of candidate scores [Nq, kc] with their ids, decoded
// and padded with empty slots to k columns.
inline std::tuple<at::Tensor, at::Tensor> top_k_decoded(BlockTopkFn* topk, DecodeKeysFn* decode, const at::Tensor& s,
                                                        const at::Tensor& ids, int64_t k) {
  at::Tensor top = topk(s, 0, k, ids);
  if (top.size(1) < k)
    top = at::cat({top, at::full({s.size(0), k - top.size(1)}, INT64_MIN, top.options())}, 1);
  return decode(top);
}

inline std::tuple<at::Tensor, at::Tensor> rescore_topk_composed(
    ForwardFn* fwd, BlockTopkFn* topk, DecodeKeysFn* decode, const at::Tensor& q, const at::Tensor& q_start,
    const at::Tensor& q_len, const std::optional<at::Tensor>& q_mask, const at::Tensor& d, const at::Tensor& d_start,
    const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask, const at::Tensor& keys, int64_t lq, int64_t k) {
  check_rescore_args(q_start, keys, k);
  const int64_t Nq = keys.size(0), kc = keys.size(1);
  at::Tensor ids = std::get<1>(decode(keys));
  // Ids past the documents score NaN (as a LIST pair out of range) and keep
  // their key; an empty slot (-1) stays empty.
  const at::Tensor in_range = ids.lt(d_start.numel());
  const at::Tensor pd = at::where(in_range, ids, at::full({}, -1, ids.options())).reshape({-1}).to(at::kInt);
  const at::Tensor pq = at::arange(Nq, keys.options().dtype(at::kInt)).repeat_interleave(kc);
  const at::Tensor s = std::get<0>(
      fwd(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pq, pd, kList, lq, kNoArgmax, /*precision: default*/ 0, false));
  return top_k_decoded(topk, decode, s.view({Nq, kc}), ids, k);
}

}  // namespace maxsim
