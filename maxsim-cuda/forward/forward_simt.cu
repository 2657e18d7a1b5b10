// Exact SIMT forward kernels instantiated for every dtype (fp32 default path,
// fp16 / bf16 fallback).
#include "forward_simt.cuh"

namespace maxsim {
namespace cuda_fwd {

#define MAXSIM_DEFINE_SIMT_RUNNERS(T)                                                               \
  template <>                                                                                       \
  void run_simt<T>(bool arg, const FwdParams& p, int64_t item0, int64_t nitems, cudaStream_t stream) { \
    launch_simt<T>(arg, p, item0, nitems, stream);                                                  \
  }                                                                                                 \
  template <>                                                                                       \
  int occupancy_simt_t<T>(bool arg) {                                                               \
    return occupancy_simt<T>(arg);                                                                  \
  }

MAXSIM_DEFINE_SIMT_RUNNERS(float)
MAXSIM_DEFINE_SIMT_RUNNERS(__half)
MAXSIM_DEFINE_SIMT_RUNNERS(__nv_bfloat16)

}  // namespace cuda_fwd
}  // namespace maxsim
