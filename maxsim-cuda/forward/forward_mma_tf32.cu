// Tensor-core forward kernels instantiated for float (TF32 mma, only when tf32=True).
#include "forward_mma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_MMA_RUNNERS(float)
}  // namespace cuda_fwd
}  // namespace maxsim
