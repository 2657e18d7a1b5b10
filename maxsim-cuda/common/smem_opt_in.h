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

// Whether `kernel` is usable on the current device: this build has its
// sm_90a body (otherwise an empty stub, without static shared memory) and
// its dynamic shared memory `smem` is opted in. Checked once per device;
// `state`: the caller's static slots for this kernel (0 unknown, 1 ready,
// -1 unavailable; devices past the table: unavailable).
template <typename Kernel>
inline bool sm90a_kernel_ready(Kernel kernel, size_t smem, int (&state)[kSmemOptInDevices]) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= kSmemOptInDevices) return false;
  if (state[dev] == 0) {
    cudaFuncAttributes attr{};
    bool ok = cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.sharedSizeBytes > 0;
    if (ok) ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
    state[dev] = ok ? 1 : -1;
  }
  return state[dev] == 1;
}

}  // namespace maxsim
