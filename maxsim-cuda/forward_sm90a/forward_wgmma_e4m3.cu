// Hopper wgmma forward kernels instantiated for fp8 e4m3 tokens with
// per-token scales (forward_quant scores; sm_90a body, a stub on other
// architectures).
#include "forward_wgmma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_WGMMA_RUNNERS(__nv_fp8_e4m3)
}  // namespace cuda_fwd
}  // namespace maxsim
