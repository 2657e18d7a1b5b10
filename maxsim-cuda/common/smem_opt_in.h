// Dynamic shared memory beyond the default 48 KB needs a per-kernel,
// per-device opt-in (cudaFuncSetAttribute). One helper for every launcher:
// the attribute is raised monotonically and set once per new size, so the
// hot path pays one cudaGetDevice.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstddef>

namespace maxsim {

constexpr int kSmemOptInDevices = 64;

// `set_bytes`: the caller's static state for this kernel, one slot per
// device (devices past the table opt in on every call).
template <typename Kernel>
inline void opt_in_dynamic_smem(Kernel kernel, size_t smem, int (&set_bytes)[kSmemOptInDevices]) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < kSmemOptInDevices && (int)smem <= set_bytes[dev]) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  if (dev < kSmemOptInDevices) set_bytes[dev] = (int)smem;
}

}  // namespace maxsim
