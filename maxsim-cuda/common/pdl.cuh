// Programmatic dependent launch (sm_90+): every kernel of the extension is
// launched with programmatic stream serialisation, so the GPU launches it
// (grid set up, CTAs made resident) while the kernel before it in the stream
// is still finishing, and the kernel's first instruction waits for that
// kernel's completion and memory flush. What it saves is the gap between
// two dependent kernels -- a search or training step is a chain of them,
// and a CUDA graph of back-to-back calls pays it per call.
//
// The rule that keeps it exact: a kernel launched by launch_pdl calls
// pdl_wait() before its first global memory access, read or write (until
// then the previous kernel may still be writing this kernel's inputs, or
// reading memory the allocator has recycled into its outputs). pdl_trigger()
// lets the next kernel launch once every CTA of this grid has called it (or
// exited); its CTAs then take free SM slots and wait. Small kernels (select,
// quantise, keys, finalize, norms) trigger at the start. The forward and
// backward grids trigger after their main loop (streaming kernel, several
// waves) or at exit: an early successor of a one-wave grid takes the free
// slots of a partly filled GPU and slows it. Before
// sm_90 both are no-ops and the launch is an ordinary one. MAXSIM_PDL=0 in
// the environment turns the attribute off (ordinary launches everywhere).
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace maxsim {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Both, at the top of a small kernel.
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_trigger();
}

inline bool pdl_on_current_device() {
  static const bool env_on = [] {
    const char* v = std::getenv("MAXSIM_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return env_on && at::cuda::getCurrentDeviceProperties()->major >= 9;
}

template <typename... KArgs, typename... Args>
void launch_pdl(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_on_current_device() ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, std::forward<Args>(args)...));
}

}  // namespace maxsim
