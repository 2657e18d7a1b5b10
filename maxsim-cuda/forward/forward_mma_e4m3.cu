// Tensor-core forward kernels instantiated for __nv_fp8_e4m3 (quantized tokens).
#include "forward_mma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_MMA_RUNNERS(__nv_fp8_e4m3)
}  // namespace cuda_fwd
}  // namespace maxsim
