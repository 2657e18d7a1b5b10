// Tensor-core forward kernels for __nv_bfloat16 tokens with per-token scales: the
// inverse row norms of `normalize`, folded into the scores.
#include "forward_mma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_MMA_SCALED_RUNNERS(__nv_bfloat16)
}  // namespace cuda_fwd
}  // namespace maxsim
