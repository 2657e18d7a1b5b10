// Per-token int8 / fp8 quantisation on the GPU (contract in
// torch-ext/quantize_rows.h): one warp per row, the row's |max| by a warp
// reduction, then one pass writing the padded values. One launch replaces a
// dozen elementwise ops, which dominated a search call's quantised-query cost.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp8.h>

#include "../common/convert.cuh"
#include "../common/dtype_dispatch.cuh"
#include "../common/pdl.cuh"
#include "quantize_rows.h"
#include "torch_binding.h"

namespace maxsim {
namespace {

template <typename T, bool FP8>
__global__ void quantize_rows_kernel(const T* __restrict__ x, int64_t rows, int64_t d, int64_t dp,
                                     unsigned char* __restrict__ out, float* __restrict__ scales, bool own) {
  pdl_enter();
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = (int64_t)gridDim.x * (blockDim.x >> 5);
  const float qm = quant_rows::qmax(FP8 ? quant_rows::kFp8 : quant_rows::kInt8);
  for (int64_t r = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += nwarps) {
    const T* xr = x + r * d;
    float s;
    if (own) {
      float m = 0.f;
      for (int64_t c = lane; c < d; c += 32) m = quant_rows::amax_step(m, cuda_cvt::to_f(xr[c]));
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = quant_rows::amax_step(m, __shfl_xor_sync(0xffffffffu, m, o));
      s = quant_rows::scale_of(m, qm);
      if (lane == 0) scales[r] = s;
    } else {
      s = scales[r];
    }
    unsigned char* vr = out + r * dp;
    for (int64_t c = lane; c < dp; c += 32) {
      const float y = c < d ? __fdiv_rn(cuda_cvt::to_f(xr[c]), s) : 0.f;
      if constexpr (FP8) {
        vr[c] = (unsigned char)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
      } else {
        vr[c] = (unsigned char)quant_rows::int8_of_rounded(rintf(y));
      }
    }
  }
}

template <typename T>
void launch(const at::Tensor& x, int64_t kind, at::Tensor& values, at::Tensor& scales, bool own) {
  const int64_t T_ = x.size(0);
  const int threads = 256, per_block = threads / 32;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((T_ + per_block - 1) / per_block, (int64_t)sms * 16);
  auto stream = at::cuda::getCurrentCUDAStream();
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  auto* vp = reinterpret_cast<unsigned char*>(values.data_ptr());
  const int64_t d = x.size(1), dp = values.size(1);
  float* sp = scales.data_ptr<float>();
  const auto kern = kind == quant_rows::kFp8 ? quantize_rows_kernel<T, true> : quantize_rows_kernel<T, false>;
  launch_pdl(kern, dim3((unsigned)blocks), dim3(threads), 0, stream, xp, T_, d, dp, vp, sp, own);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x_in, int64_t kind,
                                                 const std::optional<at::Tensor>& given) {
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() == 2 &&
                  (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kHalf ||
                   x_in.scalar_type() == at::kBFloat16),
              "maxsim: quantize takes a float32 / float16 / bfloat16 [T, d] CUDA tensor");
  TORCH_CHECK(kind == quant_rows::kInt8 || kind == quant_rows::kFp8, "maxsim: quantize kind must be 0 (int8) or 1 (fp8)");
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), dp = quant_rows::padded_dim(x.size(1));
  at::Tensor values = at::empty({T, dp}, x.options().dtype(kind == quant_rows::kInt8 ? at::kChar : at::kFloat8_e4m3fn));
  at::Tensor scales = quant_rows::scales_out(x, given);
  const bool own = !given.has_value();
  if (T == 0) return {values, scales};
  dispatch_float_type(x.scalar_type(), [&](auto tag) { launch<decltype(tag)>(x, kind, values, scales, own); });
  return {values, scales};
}

}  // namespace maxsim
