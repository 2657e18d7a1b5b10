// Per-token symmetric quantisation shared by the CPU and CUDA `quantize` op
// (contract in torch-ext/maxsim/retrieval.py, quantize_tokens): row r of
// x [T, d] becomes values [T, dp] (dp = d rounded up to 16, zero-padded) and
// scales[r] = amax_r / qmax (1 for an all-zero row, or one holding NaN), with
// values = round-to-nearest-even(x / scale) (int8: clamped to +-127, NaN -> 0;
// fp8 e4m3: saturating to +-448). Given scales replace amax_r / qmax; the
// rounding is the same.
#pragma once

#if defined(__CUDACC__)
#define MAXSIM_QHD __host__ __device__
#else
#define MAXSIM_QHD
#endif

namespace maxsim {
namespace quant_rows {

enum Kind : long { kInt8 = 0, kFp8 = 1 };

MAXSIM_QHD inline float qmax(long kind) { return kind == kInt8 ? 127.f : 448.f; }
MAXSIM_QHD inline long padded_dim(long d) { return (d + 15) / 16 * 16; }
// NaN-propagating |x| max (a NaN row gets scale 1, as torch.where(amax > 0, ...) gives).
MAXSIM_QHD inline float amax_step(float m, float x) {
  const float a = x < 0.f ? -x : x;
  return (m != m || a != a) ? a + m : (a > m ? a : m);
}
MAXSIM_QHD inline float scale_of(float amax, float qmax_v) { return amax > 0.f ? amax / qmax_v : 1.f; }
// Already rounded to an integer value: clamp and map NaN to 0.
MAXSIM_QHD inline signed char int8_of_rounded(float y) {
  if (y != y) return 0;
  y = y < -127.f ? -127.f : (y > 127.f ? 127.f : y);
  return (signed char)(int)y;
}

}  // namespace quant_rows
}  // namespace maxsim

#include <ATen/ATen.h>

#include <optional>

#include "check.h"

namespace maxsim {
namespace quant_rows {
// The op's scales output: a checked copy of the given scales (fp32 [T] on
// x's device), or an empty [T] tensor for the kernel to fill.
inline at::Tensor scales_out(const at::Tensor& x, const std::optional<at::Tensor>& given) {
  if (!given.has_value()) return at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  const at::Tensor& s = *given;
  MAXSIM_CHECK(s.scalar_type() == at::kFloat, "maxsim: quantize scales must be float32");
  MAXSIM_CHECK(s.dim() == 1 && s.size(0) == x.size(0), "maxsim: quantize scales must be [T] with T = x.shape[0] = %lld",
               (long long)x.size(0));
  TORCH_CHECK(s.device() == x.device(), "maxsim: quantize scales must be on x's device");
  return s.contiguous().clone();
}
}  // namespace quant_rows
}  // namespace maxsim
