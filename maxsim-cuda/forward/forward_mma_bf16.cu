// Tensor-core forward kernels instantiated for __nv_bfloat16.
#include "forward_mma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_MMA_RUNNERS(__nv_bfloat16)
}  // namespace cuda_fwd
}  // namespace maxsim
