// Hopper wgmma forward kernels instantiated for __nv_bfloat16 (sm_90a body; a stub on
// other architectures).
#include "forward_wgmma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_WGMMA_RUNNERS(__nv_bfloat16)

bool wgmma_built() { return wg_encode_fn() != nullptr && wg_kernel_ready<__nv_bfloat16, 1, false, kScNone>(); }
}  // namespace cuda_fwd
}  // namespace maxsim
