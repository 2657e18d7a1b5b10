// Per-token int8 / fp8 quantisation on the CPU (contract in
// torch-ext/quantize_rows.h).
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cmath>

#include "quantize_rows.h"
#include "torch_binding.h"

namespace maxsim {

std::tuple<at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& x_in, int64_t kind,
                                                const std::optional<at::Tensor>& given) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2 &&
                  (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kHalf ||
                   x_in.scalar_type() == at::kBFloat16),
              "maxsim: quantize takes a float32 / float16 / bfloat16 [T, d] CPU tensor");
  TORCH_CHECK(kind == quant_rows::kInt8 || kind == quant_rows::kFp8, "maxsim: quantize kind must be 0 (int8) or 1 (fp8)");
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), d = x.size(1), dp = quant_rows::padded_dim(d);
  at::Tensor values = at::empty({T, dp}, x.options().dtype(kind == quant_rows::kInt8 ? at::kChar : at::kFloat8_e4m3fn));
  at::Tensor scales = quant_rows::scales_out(x, given);
  const bool own = !given.has_value();
  const float qm = quant_rows::qmax(kind);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "maxsim_quantize_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    float* sp = scales.data_ptr<float>();
    unsigned char* vp = reinterpret_cast<unsigned char*>(values.data_ptr());
    at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, d)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* xr = xp + r * d;
        float s;
        if (own) {
          float m = 0.f;
          for (int64_t c = 0; c < d; ++c) m = quant_rows::amax_step(m, static_cast<float>(xr[c]));
          s = sp[r] = quant_rows::scale_of(m, qm);
        } else {
          s = sp[r];
        }
        unsigned char* vr = vp + r * dp;
        for (int64_t c = 0; c < dp; ++c) {
          const float y = c < d ? static_cast<float>(xr[c]) / s : 0.f;
          if (kind == quant_rows::kInt8) {
            vr[c] = static_cast<unsigned char>(quant_rows::int8_of_rounded(std::nearbyint(y)));
          } else {
            const float ys = y != y ? y : std::fmin(std::fmax(y, -qm), qm);  // saturate at the fp8 max
            vr[c] = c10::Float8_e4m3fn(ys).x;
          }
        }
      }
    });
  });
  return {values, scales};
}

}  // namespace maxsim
