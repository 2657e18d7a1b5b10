// The row L2 normalisation of the `normalize` flag (torch_binding.h), in
// ATen ops: the composite form for a backend whose
// kernels do not fold the norms in (Metal): normalised fp32 copies in, the
// Jacobian applied to fp32 row sums out. CPU and CUDA fuse both halves into
// their kernels and only share the constant; forward_train's inverse norms
// on the backends without a kernel for them.
#pragma once

#include <ATen/ATen.h>

namespace maxsim {

constexpr double kNormEps = 1e-12;  // F.normalize's default
constexpr float kNormEpsF = (float)kNormEps;  // the same, for fp32 kernels

// x_r / max(|x_r|, eps), fp32 (fp64 for fp64 rows).
inline at::Tensor normalized_rows(const at::Tensor& x) {
  const at::Tensor xf = x.scalar_type() == at::kDouble ? x : x.to(at::kFloat);
  return xf * at::linalg_vector_norm(xf, 2, at::IntArrayRef{1}, true).clamp_min(kNormEps).reciprocal();
}

// Gradient w.r.t. x of the loss whose gradient w.r.t. x^ = x / max(|x|, eps)
// is g (fp32 or fp64 rows): (g - x^ <x^, g>) / |x|, or g / eps for a row under
// the clamp. Returned in `dtype`.
inline at::Tensor normalize_backward(const at::Tensor& g, const at::Tensor& x, at::ScalarType dtype) {
  const at::Tensor xf = x.to(g.scalar_type());
  const at::Tensor norm = at::linalg_vector_norm(xf, 2, at::IntArrayRef{1}, true);
  const at::Tensor inv = norm.clamp_min(kNormEps).reciprocal();
  const at::Tensor xh = xf * inv;
  const at::Tensor c = (xh * g).sum(1, true) * (norm >= kNormEps).to(g.scalar_type());
  return ((g - xh * c) * inv).to(dtype);
}

// Where d's rows start in a buffer of inverse norms of q's rows then d's
// (forward_train's, torch_binding.h, and the CUDA kernels'): a multiple of
// 4 floats, so that d's block is 16-byte aligned for the wgmma kernels' TMA.
inline int64_t inv_norms_d_start(int64_t q_rows) { return (q_rows + 3) & ~int64_t(3); }

// forward_train's inverse norms (torch_binding.h, ForwardTrainFn) in ATen
// ops: 1 / max(|q_r|, eps) at r, d's rows from inv_norms_d_start, fp32.
inline at::Tensor inverse_norms(const at::Tensor& q, const at::Tensor& d) {
  const auto inv = [](const at::Tensor& x) {
    return at::linalg_vector_norm(x.to(at::kFloat), 2, at::IntArrayRef{-1}, false)
        .reshape({-1})
        .clamp_min(kNormEps)
        .reciprocal();
  };
  const at::Tensor iq = inv(q), id = inv(d);
  const int64_t b_at = inv_norms_d_start(iq.numel());
  at::Tensor out = at::zeros({b_at + id.numel()}, q.options().dtype(at::kFloat));
  out.narrow(0, 0, iq.numel()).copy_(iq);
  out.narrow(0, b_at, id.numel()).copy_(id);
  return out;
}

}  // namespace maxsim
