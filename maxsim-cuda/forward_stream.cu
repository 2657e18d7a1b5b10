// Register-streaming forward kernels (forward_stream.cuh) for fp16 and bf16.
#include <ATen/cuda/CUDAContext.h>

#include "forward_stream.cuh"

namespace maxsim {
namespace cuda_fwd {
template <>
void run_stream<__half>(const FwdParams& p, int64_t dim, cudaStream_t st) {
  run_stream_impl<__half>(p, dim, st);
}
template <>
void run_stream<__nv_bfloat16>(const FwdParams& p, int64_t dim, cudaStream_t st) {
  run_stream_impl<__nv_bfloat16>(p, dim, st);
}
}  // namespace cuda_fwd
}  // namespace maxsim
