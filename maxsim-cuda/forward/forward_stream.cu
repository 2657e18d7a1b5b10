// Register-streaming forward kernels (forward_stream.cuh): fp16 / bf16 and
// 8-bit tokens with per-token scales.
#include <ATen/cuda/CUDAContext.h>

#include "forward_stream.cuh"

namespace maxsim {
namespace cuda_fwd {
#define MAXSIM_STREAM_INSTANCE(T)                                                        \
  template <>                                                                          \
  void run_stream<T>(const plan::StreamPlan& s, const FwdParams& p, cudaStream_t st) { \
    launch_stream<T>(s, p, st);                                                        \
  }                                                                                    \
  template <>                                                                          \
  int stream_blocks<T>(const plan::StreamPlan& s) {                                    \
    return stream_kernel_blocks<T>(s);                                                 \
  }
MAXSIM_STREAM_INSTANCE(__half)
MAXSIM_STREAM_INSTANCE(__nv_bfloat16)
MAXSIM_STREAM_INSTANCE(int8_t)
MAXSIM_STREAM_INSTANCE(__nv_fp8_e4m3)
#undef MAXSIM_STREAM_INSTANCE
}  // namespace cuda_fwd
}  // namespace maxsim
