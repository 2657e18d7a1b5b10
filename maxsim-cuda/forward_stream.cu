// Register-streaming forward kernels (forward_stream.cuh) for fp16, bf16 and int8.
#include <ATen/cuda/CUDAContext.h>

#include "forward_stream.cuh"

namespace maxsim {
namespace cuda_fwd {
template <>
void run_stream<__half>(const FwdParams& p, cudaStream_t st) {
  run_stream_impl<__half>(p, st);
}
template <>
void run_stream<__nv_bfloat16>(const FwdParams& p, cudaStream_t st) {
  run_stream_impl<__nv_bfloat16>(p, st);
}
template <>
void run_stream<int8_t>(const FwdParams& p, cudaStream_t st) {
  run_stream_impl<int8_t>(p, st);
}
}  // namespace cuda_fwd
}  // namespace maxsim
