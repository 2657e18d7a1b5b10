// Hopper wgmma forward kernels instantiated for __half (sm_90a body; a stub on
// other architectures).
#include "forward_wgmma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_WGMMA_RUNNERS(__half)
}  // namespace cuda_fwd
}  // namespace maxsim
