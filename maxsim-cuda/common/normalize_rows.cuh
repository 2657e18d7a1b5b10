// The two row-wise halves of the `normalize` flag (torch_binding.h) that are
// not folded into the MaxSim kernels themselves:
//   * inv_norms: 1 / max(|x_r|, eps) per row (fp32 sum of squares), read by
//     the forward (scores) and the backward (gathered rows);
//   * normalize_grad: the Jacobian of the normalisation on the fp32 row sums
//     g = dL/dx^ the backward kernels produce, rounded once to the input
//     dtype: (g - x^ <x^, g>) / |x| (g / eps under the clamp).
// One warp per row, lanes striding over it (coalesced); inverse norms of
// 16-byte-aligned rows use 8 lanes per row with 16-byte vectors.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "convert.cuh"
#include "dtype_dispatch.cuh"
#include "normalize_rows.h"

namespace maxsim {
namespace cuda_norm {

constexpr float kEps = (float)kNormEps;
constexpr int kWarpsPerBlock = 8;

using cuda_cvt::from_f;
using cuda_cvt::to_f;
using cuda_fwd::warp_sum;

template <class T>
__device__ __forceinline__ float row_sumsq(const T* __restrict__ x, int64_t dim, int lane) {
  float ss = 0.f;
  for (int64_t k = lane; k < dim; k += 32) {
    const float v = to_f<T>(x[k]);
    ss = fmaf(v, v, ss);
  }
  return warp_sum(ss);
}

template <class T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) inv_norms_kernel(const T* __restrict__ x, int64_t rows,
                                                                      int64_t dim, float* __restrict__ inv) {
  pdl_enter();
  const int64_t r = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const float ss = row_sumsq(x + r * dim, dim, lane);
  if (lane == 0) inv[r] = 1.f / fmaxf(sqrtf(ss), kEps);
}

template <class T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    normalize_grad_kernel(const float* __restrict__ g, const T* __restrict__ x, int64_t rows, int64_t dim,
                          T* __restrict__ out) {
  pdl_enter();
  const int64_t r = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const T* xr = x + r * dim;
  const float* gr = g + r * dim;
  const float nrm = sqrtf(row_sumsq(xr, dim, lane));
  const float inv = 1.f / fmaxf(nrm, kEps);
  float c = 0.f;
  if (nrm >= kEps) {
    for (int64_t k = lane; k < dim; k += 32) c = fmaf(to_f<T>(xr[k]) * inv, gr[k], c);
    c = warp_sum(c);
  }
  for (int64_t k = lane; k < dim; k += 32)
    out[r * dim + k] = from_f<T>(inv * (gr[k] - to_f<T>(xr[k]) * inv * c));
}

// 16-byte rows (dim * sizeof(T) % 16 == 0, aligned): 8 lanes per row, each
// loading 16-byte vectors, 4 rows per warp in flight.
template <class T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) inv_norms_vec_kernel(const T* __restrict__ x, int64_t rows,
                                                                          int64_t nvec, float* __restrict__ inv) {
  constexpr int E = 16 / sizeof(T);
  pdl_enter();
  const int64_t r = ((int64_t)blockIdx.x * kWarpsPerBlock * 32 + threadIdx.x) >> 3;
  const int l = threadIdx.x & 7;
  float ss = 0.f;
  if (r < rows) {
    const uint4* xr = reinterpret_cast<const uint4*>(x) + r * nvec;
#pragma unroll 4
    for (int64_t v = l; v < nvec; v += 8) {
      const uint4 u = __ldg(xr + v);
      const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int k = 0; k < E; ++k) {
        const float f = to_f<T>(e[k]);
        ss = fmaf(f, f, ss);
      }
    }
  }
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (r < rows && l == 0) inv[r] = 1.f / fmaxf(sqrtf(ss), kEps);
}

template <class T>
inline void launch_inv_norms(const at::Tensor& x, at::Tensor& inv, cudaStream_t st) {
  const int64_t rows = x.size(0);
  if (rows == 0) return;
  const int64_t bytes = x.size(1) * (int64_t)sizeof(T);
  if (bytes % 16 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0) {
    constexpr int kRowsPerBlock = kWarpsPerBlock * 4;
    launch_pdl(inv_norms_vec_kernel<T>, dim3((unsigned)((rows + kRowsPerBlock - 1) / kRowsPerBlock)),
               dim3(kWarpsPerBlock * 32), 0, st, static_cast<const T*>(x.data_ptr()), rows, bytes / 16,
               inv.data_ptr<float>());
    return;
  }
  launch_pdl(inv_norms_kernel<T>, dim3((unsigned)((rows + kWarpsPerBlock - 1) / kWarpsPerBlock)),
             dim3(kWarpsPerBlock * 32), 0, st, static_cast<const T*>(x.data_ptr()), rows, x.size(1),
             inv.data_ptr<float>());
}

// [rows] fp32 inverse norms of a contiguous [rows, dim] fp32 / fp16 / bf16 tensor.
inline at::Tensor inv_norms(const at::Tensor& x) {
  at::Tensor inv = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  cudaStream_t st = at::cuda::getCurrentCUDAStream();
  dispatch_float_type(x.scalar_type(), [&](auto tag) { launch_inv_norms<decltype(tag)>(x, inv, st); });
  return inv;
}

// out [rows, dim] (x's dtype) from g [rows, dim] fp32 and the rows x.
inline void normalize_grad(const at::Tensor& g, const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), dim = x.size(1);
  if (rows == 0) return;
  cudaStream_t st = at::cuda::getCurrentCUDAStream();
  const unsigned blocks = (unsigned)((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const float* gp = g.data_ptr<float>();
  dispatch_float_type(x.scalar_type(), [&](auto tag) {
    using E = decltype(tag);
    launch_pdl(normalize_grad_kernel<E>, dim3(blocks), dim3(kWarpsPerBlock * 32), 0, st, gp,
               static_cast<const E*>(x.data_ptr()), rows, dim, static_cast<E*>(out.data_ptr()));
  });
}

}  // namespace cuda_norm
}  // namespace maxsim
