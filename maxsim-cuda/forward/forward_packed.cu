// Packed short-document forward kernels (forward_packed.cuh): fp16 / bf16.
#include <ATen/cuda/CUDAContext.h>

#include "forward_packed.cuh"

namespace maxsim {
namespace cuda_fwd {
#define MAXSIM_PACKED_INSTANCE(T)                                                                           \
  template <>                                                                                             \
  void run_packed<T>(const plan::PackedPlan& pk, bool arg, const FwdParams& p, int64_t item0, int64_t n, \
                     cudaStream_t st) {                                                                   \
    launch_packed<T>(pk, arg, p, item0, n, st);                                                           \
  }                                                                                                       \
  template <>                                                                                             \
  int packed_blocks<T>(int ks, bool arg) {                                                                \
    return packed_kernel_blocks<T>(ks, arg);                                                              \
  }
MAXSIM_PACKED_INSTANCE(__half)
MAXSIM_PACKED_INSTANCE(__nv_bfloat16)
#undef MAXSIM_PACKED_INSTANCE
}  // namespace cuda_fwd
}  // namespace maxsim
