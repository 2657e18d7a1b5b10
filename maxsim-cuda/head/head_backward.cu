// The projection head's training backward from the winners (head.py,
// contract in torch_binding.h), two SIMT kernels around cuBLAS GEMMs:
//   head_winner_grad: one warp per winning token row, the chain rule in one
//     pass (norm, normalisation's Jacobian, the query's and the projected
//     row's gradients) where tensor ops took a dozen fp32 passes;
//   head_scatter_rows: every row of the documents' gradient written once,
//     each the sum of its winners' rows (ballot over the document's winners,
//     ascending, so the order is fixed: deterministic, no atomics, no fill).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../common/common.cuh"
#include "../common/convert.cuh"
#include "../common/dtype_dispatch.cuh"
#include "../common/pdl.cuh"
#include "../common/normalize_jacobian.cuh"
#include "torch_binding.h"

namespace maxsim {
namespace {

using cuda_fwd::warp_sum;

constexpr int kWarps = 8;

// Winner (i, j, k): query i, document (or candidate) j of the chunk, query
// token k; its projected row is unit[(i * c + j) * Lq + k].
struct Winners {
  const int* idx;  // [Nq, c, Lq] token within the document, -1: none
  int64_t s0, s1, s2;
  int64_t Nq, c, Lq;
  __device__ __forceinline__ int token(int64_t i, int64_t j, int64_t k) const { return idx[i * s0 + j * s1 + k * s2]; }
};

// VPL values a lane: dims lane + 32 v (d_out <= 32 VPL).
template <typename T, int VPL>
__global__ void __launch_bounds__(kWarps * 32) winner_grad_kernel(
    const T* __restrict__ unit, const float* __restrict__ q, const float* __restrict__ grad, int64_t g0, int64_t g1,
    Winners win, int d_out, int64_t per, bool normalize, float* __restrict__ dq_part, T* __restrict__ dp,
    float* __restrict__ db_part) {
  pdl_wait();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t chunks = (win.c + per - 1) / per;
  const int64_t i = blockIdx.x / chunks, jc = blockIdx.x % chunks;
  const int64_t j0 = jc * per, j1 = min(win.c, j0 + per);
  float db[VPL] = {};
  for (int64_t k = warp; k < win.Lq; k += kWarps) {
    float qv[VPL], dq[VPL] = {};
#pragma unroll
    for (int v = 0; v < VPL; ++v) {
      const int e = lane + 32 * v;
      qv[v] = e < d_out ? q[(i * win.Lq + k) * d_out + e] : 0.f;
    }
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t row = ((i * win.c + j) * win.Lq + k) * d_out;
      if (win.token(i, j, k) < 0) {  // no winner: contributes exact zeros
        if (dp != nullptr)
#pragma unroll
          for (int v = 0; v < VPL; ++v)
            if (lane + 32 * v < d_out) dp[row + lane + 32 * v] = cuda_cvt::from_f<T>(0.f);
        continue;
      }
      const float w = grad[i * g0 + j * g1];
      float u[VPL];
#pragma unroll
      for (int v = 0; v < VPL; ++v) {
        const int e = lane + 32 * v;
        u[v] = e < d_out ? cuda_cvt::to_f(unit[row + e]) : 0.f;
      }
      NormJacobian jac(1.f);  // the identity unless normalize
      if (normalize) {  // rows as the forward scored them
        float ss = 0.f;
#pragma unroll
        for (int v = 0; v < VPL; ++v) ss += u[v] * u[v];
        jac = NormJacobian(warp_sum(ss));
#pragma unroll
        for (int v = 0; v < VPL; ++v) u[v] *= jac.inv;
      }
#pragma unroll
      for (int v = 0; v < VPL; ++v) dq[v] += w * u[v];
      if (dp == nullptr) continue;
      float g[VPL];
#pragma unroll
      for (int v = 0; v < VPL; ++v) g[v] = w * qv[v];
      if (normalize) {  // the Jacobian of x / max(|x|, eps)
        float along = 0.f;
#pragma unroll
        for (int v = 0; v < VPL; ++v) along = fmaf(u[v], g[v], along);
        along = jac.along(warp_sum(along));
#pragma unroll
        for (int v = 0; v < VPL; ++v) g[v] = jac.grad(u[v], g[v], along);
      }
#pragma unroll
      for (int v = 0; v < VPL; ++v) {
        const int e = lane + 32 * v;
        if (e < d_out) dp[row + e] = cuda_cvt::from_f<T>(g[v]);
        db[v] += g[v];
      }
    }
    float* out = dq_part + ((jc * win.Nq + i) * win.Lq + k) * d_out;
#pragma unroll
    for (int v = 0; v < VPL; ++v)
      if (lane + 32 * v < d_out) out[lane + 32 * v] = dq[v];
  }
  if (db_part == nullptr) return;
  // The block's bias gradient, its warps summed in a fixed order.
  __shared__ float part[kWarps][32 * VPL];
#pragma unroll
  for (int v = 0; v < VPL; ++v) part[warp][lane + 32 * v] = db[v];
  __syncthreads();
  for (int e = threadIdx.x; e < d_out; e += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += part[w][e];
    db_part[(int64_t)blockIdx.x * d_out + e] = s;
  }
}

// out[e] = the sum over p of part[p, e], in a fixed order (p mod kSumSplit,
// then ascending): the blocks' partial dq and db, two jobs in one launch.
struct PartialSum {
  const float* part;
  int64_t n, cols;
  float* out;
};
constexpr int kSumCols = 32, kSumSplit = 8;

__global__ void __launch_bounds__(kSumCols* kSumSplit) sum_partials_kernel(PartialSum a, PartialSum b) {
  pdl_wait();
  const int64_t tiles_a = (a.cols + kSumCols - 1) / kSumCols;
  const bool first = blockIdx.x < tiles_a;
  const PartialSum job = first ? a : b;
  const int64_t e = (first ? blockIdx.x : blockIdx.x - tiles_a) * kSumCols + threadIdx.x;
  float s = 0.f;
  if (e < job.cols)
    for (int64_t p = threadIdx.y; p < job.n; p += kSumSplit) s += job.part[p * job.cols + e];
  __shared__ float split[kSumSplit][kSumCols];
  split[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && e < job.cols) {
    float t = 0.f;
#pragma unroll
    for (int y = 0; y < kSumSplit; ++y) t += split[y][threadIdx.x];
    job.out[e] = t;
  }
}

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

constexpr int kRowsPerBlock = 32;

// out[doc, t] = sum of rows[winner] over the document's winners on token t,
// in ascending winner order; zeros where none. A document's winners: every
// (i, k) of document j (shared documents) or the k of candidate (i, j).
template <typename T, int VEC>
__global__ void __launch_bounds__(kWarps * 32) scatter_rows_kernel(const T* __restrict__ rows, Winners win, int64_t Ld,
                                                                   int64_t width, bool per_query, T* __restrict__ out) {
  pdl_wait();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t tiles = (Ld + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t doc = blockIdx.x / tiles, t0 = blockIdx.x % tiles * kRowsPerBlock;
  const int64_t qi = per_query ? doc / win.c : 0, j = per_query ? doc % win.c : doc;
  const int Lq = (int)win.Lq, S = (int)(per_query ? win.Lq : win.Nq * win.Lq);  // < 2^31 (host check)
  for (int64_t t = t0 + warp; t < min(Ld, t0 + kRowsPerBlock); t += kWarps) {
    T* dst = out + (doc * Ld + t) * width;
    for (int64_t base = 0; base < width; base += 32 * VEC) {  // warp-uniform: the ballot needs every lane
      const int64_t c0 = base + (int64_t)lane * VEC;
      const bool in = c0 < width;
      float acc[VEC] = {};
      for (int s0 = 0; s0 < S; s0 += 32) {
        const int s = s0 + lane;
        int64_t row = 0;
        bool hit = false;
        if (s < S) {
          const int64_t i = per_query ? qi : s / Lq;
          const int k = per_query ? s : s % Lq;
          row = (i * win.c + j) * Lq + k;
          hit = win.token(i, j, k) == t;
        }
        for (unsigned m = __ballot_sync(0xffffffffu, hit); m; m &= m - 1) {
          const int64_t r = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
          if (!in) continue;
          const Pack<T, VEC> x = *reinterpret_cast<const Pack<T, VEC>*>(rows + r * width + c0);
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[e] += cuda_cvt::to_f(x.v[e]);
        }
      }
      Pack<T, VEC> y;
#pragma unroll
      for (int e = 0; e < VEC; ++e) y.v[e] = cuda_cvt::from_f<T>(acc[e]);
      if (in) *reinterpret_cast<Pack<T, VEC>*>(dst + c0) = y;
    }
  }
}

Winners winners_of(const at::Tensor& idx) {
  return {idx.data_ptr<int>(), idx.stride(0), idx.stride(1), idx.stride(2), idx.size(0), idx.size(1), idx.size(2)};
}

void check_winners(const at::Tensor& idx, const char* op) {
  MAXSIM_CHECK(idx.is_cuda() && idx.dim() == 3 && idx.scalar_type() == at::kInt,
               "maxsim: %s: idx must be an int32 [Nq, c, Lq] CUDA tensor", op);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> head_winner_grad_cuda(const at::Tensor& unit_in, const at::Tensor& q_in,
                                                                     const at::Tensor& grad_in, const at::Tensor& idx,
                                                                     bool normalize, bool need_dp) {
  check_winners(idx, "head_winner_grad");
  const int64_t Nq = idx.size(0), c = idx.size(1), Lq = idx.size(2), d_out = q_in.size(-1);
  TORCH_CHECK(q_in.dim() == 3 && q_in.size(0) == Nq && q_in.size(1) == Lq && unit_in.dim() == 4 &&
                  unit_in.sizes() == at::IntArrayRef({Nq, c, Lq, d_out}) && grad_in.dim() == 2 &&
                  grad_in.size(0) == Nq && grad_in.size(1) == c,
              "maxsim: head_winner_grad: unit [Nq, c, Lq, d_out], q [Nq, Lq, d_out], grad [Nq, c], idx [Nq, c, Lq]");
  const auto dt = unit_in.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16) && q_in.scalar_type() == at::kFloat,
              "maxsim: head_winner_grad: unit float32 / float16 / bfloat16, q float32");
  MAXSIM_CHECK(d_out <= 1024, "maxsim: head_winner_grad: d_out at most 1024, got %lld", (long long)d_out);
  TORCH_CHECK(unit_in.device() == idx.device() && q_in.device() == idx.device() && grad_in.device() == idx.device(),
              "maxsim: head_winner_grad: tensors on one CUDA device");
  c10::cuda::CUDAGuard guard(idx.device());
  const at::Tensor unit = unit_in.contiguous(), q = q_in.contiguous(), grad = grad_in.to(at::kFloat);
  const auto f32 = q.options();
  at::Tensor dp = need_dp ? at::empty(unit.sizes(), unit.options()) : unit.new_empty({0});
  if (Nq * c * Lq * d_out == 0) {
    return {at::zeros(q.sizes(), f32), dp, need_dp ? at::zeros({d_out}, f32) : at::empty({0}, f32)};
  }
  // Enough blocks to fill the GPU: each takes one query's tokens over a run
  // of its documents; the partial dq of the runs are summed in order.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t runs = std::min<int64_t>(c, std::max<int64_t>(1, (4 * sms + Nq - 1) / Nq));
  const int64_t per = (c + runs - 1) / runs, chunks = (c + per - 1) / per, blocks = Nq * chunks;
  MAXSIM_CHECK(blocks < ((int64_t)1 << 31), "maxsim: head_winner_grad: too many queries (%lld)", (long long)Nq);
  at::Tensor dq_part = at::empty({chunks, Nq, Lq, d_out}, f32);
  at::Tensor db_part = need_dp ? at::empty({blocks, d_out}, f32) : at::empty({0}, f32);
  dispatch_float_type(dt, [&](auto tok) {
    using T = decltype(tok);
    auto kern = d_out <= 128 ? winner_grad_kernel<T, 4> : d_out <= 256 ? winner_grad_kernel<T, 8>
                                                                         : winner_grad_kernel<T, 32>;
    launch_pdl(kern, dim3((unsigned)blocks), dim3(kWarps * 32), 0, at::cuda::getCurrentCUDAStream(),
               reinterpret_cast<const T*>(unit.data_ptr()), q.data_ptr<float>(),
               grad.data_ptr<float>(), grad.stride(0), grad.stride(1), winners_of(idx), (int)d_out, per, normalize,
               dq_part.data_ptr<float>(), need_dp ? reinterpret_cast<T*>(dp.data_ptr()) : nullptr,
               need_dp ? db_part.data_ptr<float>() : nullptr);
  });
  at::Tensor dq = at::empty(q.sizes(), f32), db = at::empty({need_dp ? d_out : 0}, f32);
  const PartialSum dq_sum{dq_part.data_ptr<float>(), chunks, dq.numel(), dq.data_ptr<float>()};
  const PartialSum db_sum{db_part.data_ptr<float>(), blocks, db.numel(), db.data_ptr<float>()};
  const int64_t tiles = (dq.numel() + kSumCols - 1) / kSumCols + (db.numel() + kSumCols - 1) / kSumCols;
  launch_pdl(sum_partials_kernel, dim3((unsigned)tiles), dim3(kSumCols, kSumSplit), 0,
             at::cuda::getCurrentCUDAStream(), dq_sum, db_sum);
  return {dq, dp, db};
}

at::Tensor head_scatter_rows_cuda(const at::Tensor& rows_in, const at::Tensor& idx, int64_t Ld, bool per_query) {
  check_winners(idx, "head_scatter_rows");
  const int64_t Nq = idx.size(0), c = idx.size(1), Lq = idx.size(2);
  TORCH_CHECK(rows_in.dim() == 4 && rows_in.size(0) == Nq && rows_in.size(1) == c && rows_in.size(2) == Lq && Ld >= 0,
              "maxsim: head_scatter_rows: rows [Nq, c, Lq, width], idx [Nq, c, Lq]");
  const auto dt = rows_in.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              "maxsim: head_scatter_rows: rows float32 / float16 / bfloat16");
  TORCH_CHECK(rows_in.device() == idx.device(), "maxsim: head_scatter_rows: tensors on one CUDA device");
  c10::cuda::CUDAGuard guard(idx.device());
  const at::Tensor rows = rows_in.contiguous();
  const int64_t width = rows.size(3), docs = per_query ? Nq * c : c;
  at::Tensor out = per_query ? at::empty({Nq, c, Ld, width}, rows.options()) : at::empty({c, Ld, width}, rows.options());
  if (out.numel() == 0) return out;
  if (Nq * Lq == 0) return out.zero_();
  const int64_t blocks = docs * ((Ld + kRowsPerBlock - 1) / kRowsPerBlock);
  MAXSIM_CHECK(blocks < ((int64_t)1 << 31) && Nq * Lq < ((int64_t)1 << 31),
               "maxsim: head_scatter_rows: too many rows (%lld) or winners (%lld)", (long long)(docs * Ld),
               (long long)(Nq * Lq));
  dispatch_float_type(rows.scalar_type(), [&](auto tok) {
    using T = decltype(tok);
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = width % kVec == 0 && aligned_to(rows.data_ptr(), 16) && aligned_to(out.data_ptr(), 16);
    launch_pdl(vec ? scatter_rows_kernel<T, kVec> : scatter_rows_kernel<T, 1>, dim3((unsigned)blocks),
               dim3(kWarps * 32), 0, at::cuda::getCurrentCUDAStream(), reinterpret_cast<const T*>(rows.data_ptr()),
               winners_of(idx), Ld, width, per_query, reinterpret_cast<T*>(out.data_ptr()));
  });
  return out;
}

}  // namespace maxsim
