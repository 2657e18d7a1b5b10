// Tensor-core forward kernels for __half tokens with per-token scales: the
// inverse row norms of `normalize`, folded into the scores.
#include "forward_mma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_MMA_SCALED_RUNNERS(__half)
}  // namespace cuda_fwd
}  // namespace maxsim
