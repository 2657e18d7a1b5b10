// Hopper wgmma forward kernels instantiated for int8_t tokens with per-token
// scales (forward_quant; sm_90a body, a stub on other architectures).
#include "forward_wgmma.cuh"

namespace maxsim {
namespace cuda_fwd {
MAXSIM_DEFINE_WGMMA_RUNNERS(int8_t)
}  // namespace cuda_fwd
}  // namespace maxsim
