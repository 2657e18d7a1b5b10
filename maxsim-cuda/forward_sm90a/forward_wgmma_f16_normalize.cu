// Hopper wgmma forward kernels for __half tokens with per-token scales: the
// inverse row norms of `normalize` (sm_90a body, a stub elsewhere).
#include "forward_wgmma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_WGMMA_SCALED_RUNNERS(__half)
}  // namespace cuda_fwd
}  // namespace maxsim
