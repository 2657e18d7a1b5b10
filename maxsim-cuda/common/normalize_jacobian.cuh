// The `normalize` flag's x^ = x / max(|x|, eps) in fp32 device code: the
// inverse norm every CUDA kernel scales rows by, and the row's gradient,
// shared by every kernel that applies it (normalize_grad, the backward
// kernels' in-register Jacobian, the fused head's backward). With g = dL/dx^
// the gradient is (g - x^ <x^, g>) / max(|x|, eps): a row under the
// clamp gets g / eps, as torch's clamp_min backward passes nothing to |x|
// there. Callers reduce the row's two sums over their own lanes (a warp, a
// lane group) and apply `grad` per element.
#pragma once

#include <cuda_runtime.h>

#include "normalize_rows.h"  // kNormEpsF

namespace maxsim {

// 1 / max(|x|, eps) from the row's sum of squares.
__device__ __forceinline__ float inv_norm(float sumsq) { return 1.f / fmaxf(sqrtf(sumsq), kNormEpsF); }

struct NormJacobian {
  float inv;  // 1 / max(|x|, eps): x^ = x * inv
  bool live;  // |x| >= eps: the norm depends on x

  // From the row's sum of squares.
  __device__ __forceinline__ explicit NormJacobian(float sumsq)
      : inv(inv_norm(sumsq)), live(sqrtf(sumsq) >= kNormEpsF) {}
  // c of grad from the row's <x^, g>.
  __device__ __forceinline__ float along(float xhat_dot_g) const { return live ? xhat_dot_g : 0.f; }
  // One element: x^ and g of the element, c = along(<x^, g>).
  __device__ __forceinline__ float grad(float xhat, float g, float c) const { return inv * (g - xhat * c); }
};

}  // namespace maxsim
