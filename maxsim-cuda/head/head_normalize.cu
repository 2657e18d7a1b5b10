// The projection head's row normalisation in training (head.py's
// _NormalizedRows, contract in torch_binding.h): one kernel each way where
// F.normalize's autograd takes about a dozen elementwise and reduction
// passes. One warp per row, lanes striding over it; the norm, the scaling
// and the Jacobian in fp32 (normalize_jacobian.cuh), each result rounded
// once to the rows' dtype.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../common/convert.cuh"
#include "../common/dtype_dispatch.cuh"
#include "../common/normalize_jacobian.cuh"
#include "../common/normalize_rows.cuh"
#include "../common/pdl.cuh"
#include "check.h"
#include "torch_binding.h"

namespace maxsim {
namespace {

using cuda_norm::kWarpsPerBlock;

template <class T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    normalized_rows_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t dim) {
  pdl_enter();
  const int64_t r = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const T* xr = x + r * dim;
  T* yr = y + r * dim;
  const float inv = inv_norm(cuda_norm::row_sumsq(xr, dim, lane));
  for (int64_t k = lane; k < dim; k += 32) yr[k] = cuda_cvt::from_f<T>(cuda_cvt::to_f<T>(xr[k]) * inv);
}

void check_rows(const at::Tensor& x, const char* op) {
  const auto dt = x.scalar_type();
  MAXSIM_CHECK(x.is_cuda() && x.dim() == 2 && (dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16),
               "maxsim: %s: rows must be a 2-D float32 / float16 / bfloat16 CUDA tensor", op);
}

unsigned row_blocks(int64_t rows) { return (unsigned)((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

}  // namespace

at::Tensor head_normalize_cuda(const at::Tensor& x_in) {
  check_rows(x_in, "head_normalize");
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t rows = x.size(0), dim = x.size(1);
  if (rows == 0) return y;
  dispatch_float_type(x.scalar_type(), [&](auto tok) {
    using T = decltype(tok);
    launch_pdl(normalized_rows_kernel<T>, dim3(row_blocks(rows)), dim3(kWarpsPerBlock * 32), 0,
               at::cuda::getCurrentCUDAStream(), reinterpret_cast<const T*>(x.data_ptr()),
               reinterpret_cast<T*>(y.data_ptr()), rows, dim);
  });
  return y;
}

at::Tensor head_normalize_backward_cuda(const at::Tensor& grad_in, const at::Tensor& x_in) {
  check_rows(x_in, "head_normalize_backward");
  TORCH_CHECK(grad_in.sizes() == x_in.sizes() && grad_in.scalar_type() == x_in.scalar_type() &&
                  grad_in.device() == x_in.device(),
              "maxsim: head_normalize_backward: grad must match the rows (shape, dtype, device)");
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), g = grad_in.contiguous();
  at::Tensor dx = at::empty_like(x);
  const int64_t rows = x.size(0);
  if (rows == 0) return dx;
  dispatch_float_type(x.scalar_type(), [&](auto tok) {
    using T = decltype(tok);
    launch_pdl(cuda_norm::normalize_grad_kernel<T, T>, dim3(row_blocks(rows)), dim3(kWarpsPerBlock * 32), 0,
               at::cuda::getCurrentCUDAStream(), reinterpret_cast<const T*>(g.data_ptr()),
               cuda_norm::row_pair<const T>(x, at::Tensor()), cuda_norm::row_pair<T>(dx, at::Tensor()), x.size(1));
  });
  return dx;
}

}  // namespace maxsim
