// Host launches of the normalisation kernels (normalize_rows.cuh): the
// forward's and the backward's inverse norms, and the backward's Jacobian
// pass over fp32 row sums.
#pragma once

#include "normalize_rows.cuh"

namespace maxsim {
namespace cuda_norm {

inline bool rows_aligned16(const at::Tensor& x) { return !x.defined() || aligned_to(x.data_ptr(), 16); }

// Inverse norms of two row blocks in one buffer; b's block starts at
// inv_norms_d_start (normalize_rows.h).
struct InvNorms {
  at::Tensor buf;
  float* a = nullptr;
  float* b = nullptr;
};

// fp32 inverse norms of the rows of a and of b: contiguous [rows, dim]
// fp32 / fp16 / bf16 tensors of one dtype and dim, either one optional.
inline InvNorms inv_norms(const at::Tensor& a, const at::Tensor& b = at::Tensor()) {
  const at::Tensor& any = a.defined() ? a : b;
  const int64_t rows = rows_of(a) + rows_of(b), dim = any.size(1);
  const int64_t b_at = inv_norms_d_start(rows_of(a));
  InvNorms inv;
  inv.buf = at::empty({b_at + rows_of(b)}, any.options().dtype(at::kFloat));
  inv.a = inv.buf.data_ptr<float>();
  inv.b = inv.a + b_at;
  if (rows == 0) return inv;
  cudaStream_t st = at::cuda::getCurrentCUDAStream();
  dispatch_float_type(any.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const RowPair<const T> x = row_pair<const T>(a, b);
    const int64_t bytes = dim * (int64_t)sizeof(T);
    if (bytes % 16 == 0 && rows_aligned16(a) && rows_aligned16(b)) {
      constexpr int kRowsPerBlock = kWarpsPerBlock * 4;
      launch_pdl(inv_norms_vec_kernel<T>, dim3((unsigned)((rows + kRowsPerBlock - 1) / kRowsPerBlock)),
                 dim3(kWarpsPerBlock * 32), 0, st, x, bytes / 16, inv.a, b_at);
    } else {
      launch_pdl(inv_norms_kernel<T>, dim3((unsigned)((rows + kWarpsPerBlock - 1) / kWarpsPerBlock)),
                 dim3(kWarpsPerBlock * 32), 0, st, x, dim, inv.a, b_at);
    }
  });
  return inv;
}

// forward_train's inverse norms of q's Tq rows then d's Td rows (the layout
// of inv_norms(q, d), torch_binding.h), or an empty InvNorms where they are
// absent or of another size.
inline InvNorms saved_inv_norms(const std::optional<at::Tensor>& saved, int64_t Tq, int64_t Td, at::Device dev) {
  InvNorms inv;
  const int64_t b_at = inv_norms_d_start(Tq);
  if (!saved.has_value() || !saved->defined() || saved->scalar_type() != at::kFloat || saved->dim() != 1 ||
      saved->numel() != b_at + Td || saved->device() != dev || !saved->is_contiguous())
    return inv;
  inv.buf = *saved;
  inv.a = inv.buf.data_ptr<float>();
  inv.b = inv.a + b_at;
  return inv;
}

// out_a / out_b (their x's dtype) from g [rows(x_a) + rows(x_b), dim] fp32
// and the rows x_a then x_b, in one launch; a block whose x is undefined is
// skipped.
inline void normalize_grad(const at::Tensor& g, const at::Tensor& x_a, at::Tensor& out_a, const at::Tensor& x_b,
                           at::Tensor& out_b) {
  const int64_t rows = rows_of(x_a) + rows_of(x_b);
  if (rows == 0) return;
  const at::Tensor& any = x_a.defined() ? x_a : x_b;
  cudaStream_t st = at::cuda::getCurrentCUDAStream();
  const unsigned blocks = (unsigned)((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  dispatch_float_type(any.scalar_type(), [&](auto tag) {
    using E = decltype(tag);
    launch_pdl(normalize_grad_kernel<E>, dim3(blocks), dim3(kWarpsPerBlock * 32), 0, st, g.data_ptr<float>(),
               row_pair<const E>(x_a, x_b), row_pair<E>(x_a.defined() ? out_a : at::Tensor(),
                                                        x_b.defined() ? out_b : at::Tensor()),
               any.size(1));
  });
}

}  // namespace cuda_norm
}  // namespace maxsim
