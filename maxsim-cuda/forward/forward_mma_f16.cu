// Tensor-core forward kernels instantiated for __half.
#include "forward_mma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_MMA_RUNNERS(__half)
}  // namespace cuda_fwd
}  // namespace maxsim
