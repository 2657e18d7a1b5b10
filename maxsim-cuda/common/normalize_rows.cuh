// The two row-wise halves of the `normalize` flag (torch_binding.h) that are
// not folded into the MaxSim kernels themselves:
//   * inv_norms: 1 / max(|x_r|, eps) per row (fp32 sum of squares), read by
//     the forward (scores) and the backward (gathered rows);
//   * normalize_grad: the Jacobian of the normalisation on the fp32 row sums
//     g = dL/dx^ the backward kernels produce, rounded once to the input
//     dtype: (g - x^ <x^, g>) / |x| (g / eps under the clamp).
// One warp per row, lanes striding over it (coalesced); inverse norms of
// 16-byte-aligned rows use 8 lanes per row with 16-byte vectors. The
// backward's two sides share one launch of each. Their host launches are in
// normalize_rows_launch.cuh, so that a source using only some of these
// kernels (the head's normalisation) does not instantiate the others.
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
#include "normalize_jacobian.cuh"
#include "normalize_rows.h"

namespace maxsim {
namespace cuda_norm {

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

// Two row blocks in one launch (the backward's query and document sides):
// rows [0, rows_a) of a, then the rows of b; either block may be empty.
template <class T>
struct RowPair {
  T* a;
  T* b;
  int64_t rows_a, rows;
  __device__ __forceinline__ T* row(int64_t r, int64_t stride) const {
    return r < rows_a ? a + r * stride : b + (r - rows_a) * stride;
  }
  // Row r's index in an output whose b block starts at b_at.
  __device__ __forceinline__ int64_t out_row(int64_t r, int64_t b_at) const {
    return r < rows_a ? r : b_at + (r - rows_a);
  }
};

template <class T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) inv_norms_kernel(RowPair<const T> x, int64_t dim,
                                                                      float* __restrict__ inv, int64_t inv_b) {
  pdl_enter();
  const int64_t r = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= x.rows) return;
  const float ss = row_sumsq(x.row(r, dim), dim, lane);
  if (lane == 0) inv[x.out_row(r, inv_b)] = inv_norm(ss);
}

// g: the gradients w.r.t. x^ of both blocks, contiguous [x.rows, dim]: the
// backward's fp32 row sums, or (the head's rows) in x's dtype.
template <class T, class G = float>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    normalize_grad_kernel(const G* __restrict__ g, RowPair<const T> x, RowPair<T> out, int64_t dim) {
  pdl_enter();
  const int64_t r = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= x.rows) return;
  const T* xr = x.row(r, dim);
  T* outr = out.row(r, dim);
  const G* gr = g + r * dim;
  const NormJacobian jac(row_sumsq(xr, dim, lane));
  float c = 0.f;
  if (jac.live) {
    for (int64_t k = lane; k < dim; k += 32) c = fmaf(to_f<T>(xr[k]) * jac.inv, to_f<G>(gr[k]), c);
    c = warp_sum(c);
  }
  for (int64_t k = lane; k < dim; k += 32)
    outr[k] = from_f<T>(jac.grad(to_f<T>(xr[k]) * jac.inv, to_f<G>(gr[k]), c));
}

// 16-byte rows (dim * sizeof(T) % 16 == 0, aligned): 8 lanes per row, each
// loading 16-byte vectors, 4 rows per warp in flight.
template <class T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) inv_norms_vec_kernel(RowPair<const T> x, int64_t nvec,
                                                                          float* __restrict__ inv, int64_t inv_b) {
  constexpr int E = 16 / sizeof(T);
  pdl_enter();
  const int64_t r = ((int64_t)blockIdx.x * kWarpsPerBlock * 32 + threadIdx.x) >> 3;
  const int l = threadIdx.x & 7;
  float ss = 0.f;
  if (r < x.rows) {
    const uint4* xr = reinterpret_cast<const uint4*>(x.row(r, nvec * E));
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
  if (r < x.rows && l == 0) inv[x.out_row(r, inv_b)] = inv_norm(ss);
}

inline int64_t rows_of(const at::Tensor& x) { return x.defined() ? x.size(0) : 0; }

template <class T>
RowPair<T> row_pair(const at::Tensor& a, const at::Tensor& b) {
  return {a.defined() ? static_cast<T*>(a.data_ptr()) : nullptr, b.defined() ? static_cast<T*>(b.data_ptr()) : nullptr,
          rows_of(a), rows_of(a) + rows_of(b)};
}

}  // namespace cuda_norm
}  // namespace maxsim
