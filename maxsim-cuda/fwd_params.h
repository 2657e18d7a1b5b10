// Host side of FwdParams shared by the forward ops (forward.cu) and the
// search re-score (rescore_topk.cu): the optional token masks as contiguous
// bool tensors, and the token / segment fields.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "common.cuh"

namespace maxsim {
namespace cuda_fwd {

// An optional token mask of `rows` entries as a contiguous bool tensor
// (undefined when absent).
inline at::Tensor token_mask(const std::optional<at::Tensor>& m, int64_t rows, const char* msg) {
  if (!m.has_value() || !m->defined()) return at::Tensor();
  at::Tensor t = m->to(at::kBool).contiguous();
  TORCH_CHECK(t.is_cuda() && t.numel() == rows, msg);
  return t;
}

// Token rows, (start, length) per query and document, masks (qm / dm may be
// undefined), and the sizes derived from them.
inline void set_segments(FwdParams& p, const at::Tensor& q, const at::Tensor& q_start, const at::Tensor& q_len,
                         const at::Tensor& qm, const at::Tensor& d, const at::Tensor& d_start,
                         const at::Tensor& d_len, const at::Tensor& dm) {
  p.q = static_cast<const char*>(q.data_ptr());
  p.d = static_cast<const char*>(d.data_ptr());
  p.q_start = q_start.data_ptr<int>();
  p.q_len = q_len.data_ptr<int>();
  p.q_mask = qm.defined() ? qm.data_ptr<bool>() : nullptr;
  p.d_start = d_start.data_ptr<int>();
  p.d_len = d_len.data_ptr<int>();
  p.d_mask = dm.defined() ? dm.data_ptr<bool>() : nullptr;
  p.Tq = q.size(0);
  p.Td = d.size(0);
  p.row_bytes = q.size(1) * q.element_size();
  p.Nq = q_start.numel();
  p.Nd = d_start.numel();
}

}  // namespace cuda_fwd
}  // namespace maxsim
