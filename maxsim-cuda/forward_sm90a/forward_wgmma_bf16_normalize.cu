// Hopper wgmma forward kernels for __nv_bfloat16 tokens with per-token scales: the
// inverse row norms of `normalize` (sm_90a body, a stub elsewhere).
#include "forward_wgmma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_WGMMA_SCALED_RUNNERS(__nv_bfloat16)
}  // namespace cuda_fwd
}  // namespace maxsim
