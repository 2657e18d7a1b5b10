// Tensor-core forward kernels for float tokens under `normalize`, split
// 3xTF32 (inverse row norms folded into the scores as per-token scales).
#include "forward_mma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_MMA_SCALED_RUNNERS(Tf32x3)
}  // namespace cuda_fwd
}  // namespace maxsim
