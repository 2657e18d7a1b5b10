// Hopper wgmma forward kernels instantiated for __nv_bfloat16 (sm_90a body; a stub on
// other architectures).
#include "forward_wgmma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_WGMMA_RUNNERS(__nv_bfloat16)
}  // namespace cuda_fwd
}  // namespace maxsim
