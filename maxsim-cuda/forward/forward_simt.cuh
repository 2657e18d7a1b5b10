// Exact fp32 forward kernel (FFMA, no tensor cores): the default path for
// fp32 inputs, and the fallback for fp16 / bf16 shapes the tensor-core kernel
// cannot take (odd dim, misaligned rows, a query tile too wide for shared
// memory). Inputs of any dtype are converted to fp32 on load; every dot
// product is a plain sequential fp32 FMA chain over k (same rounding as a
// naive fp32 loop). Under `normalize` rows are scaled by their inverse norm
// (p.q_scale / p.d_scale) as they are converted.
//
// CTA: 256 threads, 64 query rows x 64 doc tokens per tile, k chunks of 16
// double-buffered through registers; each thread owns a 4 x 4 block (rows
// ty*4.., tokens tx*4..) and keeps the running (max, argmax) of its 4 rows.
#pragma once

#include <c10/cuda/CUDAException.h>

#include "../common/common.cuh"
#include "../common/convert.cuh"

namespace maxsim {
namespace cuda_fwd {

using plan::kSimtBM;
using plan::kSimtBN;
constexpr int kSimtBK = 16, kSimtNTH = 256;
constexpr int kSimtPitch = 68;  // floats per smem row (16B aligned, fewer conflicts)

using cuda_cvt::to_f;

template <typename T, bool ARG>
__global__ void __launch_bounds__(kSimtNTH, 2) simt_fwd_kernel(FwdParams p, int64_t item0) {
  constexpr int BM = kSimtBM, BN = kSimtBN, BK = kSimtBK, NTH = kSimtNTH;
  __shared__ __align__(16) float As[2][BK][kSimtPitch];
  __shared__ __align__(16) float Bs[2][BK][kSimtPitch];
  __shared__ long long row_src[BM];
  __shared__ unsigned char row_ok[BM];
  __shared__ float rb[BM];
  __shared__ int ri[BM];

  pdl_wait();
  const int tid = threadIdx.x;
  const int tx = tid & 15, ty = tid >> 4;
  const Work w = decode_work<BN>(p, item0 + blockIdx.x);
  build_row_table<BM, NTH>(p, w, row_src, row_ok);
  __syncthreads();

  const int dim = (int)(p.row_bytes / (int64_t)sizeof(T));
  const int kchunks = max(1, (dim + BK - 1) / BK);
  const int ntiles = (w.c1 - w.c0 + BN - 1) / BN;
  const int total = ntiles * kchunks;
  const T* qp = reinterpret_cast<const T*>(p.q);
  const T* dp = reinterpret_cast<const T*>(p.d);
  const bool has_mask = p.d_mask != nullptr;

  // Loader mapping: row lr (0..63), 4 consecutive k (lk .. lk+3).
  const int lr = tid >> 2, lk = (tid & 3) * 4;
  const long long qrow = row_src[lr];
  const bool scaled = p.q_scale != nullptr;
  const float qsc = scaled && qrow >= 0 ? p.q_scale[qrow] : 1.f;

  float best[4];
  int bidx[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    best[i] = neg_inf();
    bidx[i] = -1;
  }

  float ra[4], rbv[4];
  auto load_regs = [&](int it) {
    int j = it / kchunks, kc = it - j * kchunks;
    int k0 = kc * BK + lk;
    int tok = w.c0 + j * BN + lr;
    bool dok = tok < w.c1;
    const T* qr = qp + (qrow >= 0 ? qrow : 0) * (int64_t)dim;
    const T* dr = dp + ((int64_t)w.ds + (dok ? tok : 0)) * dim;
    const float dsc = scaled && dok ? p.d_scale[(int64_t)w.ds + tok] : 1.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int k = k0 + e;
      ra[e] = (qrow >= 0 && k < dim) ? to_f<T>(qr[k]) * qsc : 0.f;
      rbv[e] = (dok && k < dim) ? to_f<T>(dr[k]) * dsc : 0.f;
    }
  };
  auto store_smem = [&](int buf) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      As[buf][lk + e][lr] = ra[e];
      Bs[buf][lk + e][lr] = rbv[e];
    }
  };

  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[i][c] = 0.f;

  if (total > 0) {
    load_regs(0);
    store_smem(0);
    __syncthreads();
    int j = 0, kc = 0;
    for (int it = 0; it < total; ++it) {
      const int buf = it & 1;
      if (it + 1 < total) load_regs(it + 1);
#pragma unroll
      for (int k = 0; k < BK; ++k) {
        float4 a = *reinterpret_cast<const float4*>(&As[buf][k][ty * 4]);
        float4 b = *reinterpret_cast<const float4*>(&Bs[buf][k][tx * 4]);
        float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[i][c] = fmaf(av[i], bv[c], acc[i][c]);
      }
      if (++kc == kchunks) {
        const int n0 = w.c0 + j * BN;
        const bool fast = !has_mask && n0 + BN <= w.c1;
        bool cv[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          int col = n0 + tx * 4 + c;
          cv[c] = fast || (col < w.c1 && (!has_mask || p.d_mask[(int64_t)w.ds + col]));
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            float v = cv[c] ? acc[i][c] : neg_inf();
            if (ARG)
              upd_arg(best[i], bidx[i], v, n0 + tx * 4 + c);
            else
              best[i] = max_nan(best[i], v);
            acc[i][c] = 0.f;
          }
        kc = 0;
        ++j;
      }
      if (it + 1 < total) {
        store_smem(buf ^ 1);
        __syncthreads();
      }
    }
  }

  // Merge across the 16 lanes (tx) sharing rows ty*4 .. ty*4+3.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int o = 1; o <= 8; o <<= 1) {
      float ob = __shfl_xor_sync(0xffffffffu, best[i], o);
      if (ARG) {
        int oi = __shfl_xor_sync(0xffffffffu, bidx[i], o);
        merge_arg(best[i], bidx[i], ob, oi);
      } else {
        best[i] = max_nan(best[i], ob);
      }
    }
    if (tx == 0) {
      rb[ty * 4 + i] = best[i];
      ri[ty * 4 + i] = bidx[i];
    }
  }
  __syncthreads();
  finish_tile<BM, NTH, ARG>(p, w, rb, ri, row_ok);
}

template <typename T>
inline void launch_simt(bool arg, const FwdParams& p, int64_t item0, int64_t nitems, cudaStream_t stream) {
  launch_pdl(arg ? simt_fwd_kernel<T, true> : simt_fwd_kernel<T, false>, dim3((unsigned)nitems), dim3(kSimtNTH), 0,
             stream, p, item0);
}

template <typename T>
inline int occupancy_simt(bool arg) {
  int n = 0;
  if (arg)
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, simt_fwd_kernel<T, true>, kSimtNTH, 0));
  else
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, simt_fwd_kernel<T, false>, kSimtNTH, 0));
  return n;
}

// Defined in forward_simt.cu (one instantiation per dtype).
template <typename T>
void run_simt(bool arg, const FwdParams& p, int64_t item0, int64_t nitems, cudaStream_t stream);
template <typename T>
int occupancy_simt_t(bool arg);

}  // namespace cuda_fwd
}  // namespace maxsim
