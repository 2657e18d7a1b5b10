// Tensor-core forward kernels for float tokens, plain TF32 (precision="tf32").
#include "forward_mma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_MMA_RUNNERS(float)
}  // namespace cuda_fwd
}  // namespace maxsim
