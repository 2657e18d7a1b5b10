// Tensor-core forward kernels for float tokens, split 3xTF32 (the default
// precision of fp32 inputs: within ~1e-7 of fp32 products).
#include "forward_mma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_MMA_RUNNERS(Tf32x3)
}  // namespace cuda_fwd
}  // namespace maxsim
