// Tensor-core forward kernels instantiated for int8_t (quantized tokens).
#include "forward_mma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_MMA_RUNNERS(int8_t)
}  // namespace cuda_fwd
}  // namespace maxsim
