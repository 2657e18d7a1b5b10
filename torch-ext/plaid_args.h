// Argument checks of the plaid_* ops, shared by the CPU and CUDA backends.
#pragma once

#include <ATen/ATen.h>

#include "check.h"
#include "plaid_codec.h"

namespace maxsim {
namespace plaid {

struct Shapes {
  int64_t nq, lq, dim, nd, pairs, n_centroids, tokens, packed;
};

inline void check_segments(const at::Tensor& d_start, const at::Tensor& d_len, const at::Device dev) {
  TORCH_CHECK(d_start.scalar_type() == at::kInt && d_len.scalar_type() == at::kInt && d_start.dim() == 1 &&
                  d_len.sizes() == d_start.sizes() && d_start.device() == dev && d_len.device() == dev,
              "maxsim: plaid d_start / d_len must be int32 [Nd] on the codes' device");
}

// plaid_approx's score table: fp32, fp16 or bf16 [Nq, C, Lq].
inline void check_score_table(const at::Tensor& qcs) {
  const at::ScalarType t = qcs.scalar_type();
  TORCH_CHECK(qcs.dim() == 3 && (t == at::kFloat || t == at::kHalf || t == at::kBFloat16),
              "maxsim: plaid_approx qcs must be float32, float16 or bfloat16 [Nq, C, Lq]");
}

// plaid_approx's centroid mask: uint8 [Nq, C] on qcs' device.
inline void check_keep(const std::optional<at::Tensor>& keep, const at::Tensor& qcs) {
  if (!keep.has_value()) return;
  TORCH_CHECK(keep->scalar_type() == at::kByte && keep->dim() == 2 && keep->size(0) == qcs.size(0) &&
                  keep->size(1) == qcs.size(1) && keep->device() == qcs.device(),
              "maxsim: plaid_approx keep must be uint8 [Nq, C] on qcs' device");
}

inline Shapes check_forward(const at::Tensor& q, const at::Tensor& codes, const at::Tensor& residuals,
                            const at::Tensor& centroids, const at::Tensor& bucket_weights, const at::Tensor& d_start,
                            const at::Tensor& d_len, const std::optional<at::Tensor>& pair_q, int64_t nbits) {
  MAXSIM_CHECK(nbits == 2 || nbits == 4 || nbits == 8, "maxsim: plaid nbits must be 2, 4 or 8, got %lld",
               (long long)nbits);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.size(2) > 0,
              "maxsim: plaid q must be float32 [Nq, Lq, d], d >= 1");
  const at::Device dev = q.device();
  TORCH_CHECK(codes.dim() == 1 && codes.scalar_type() == at::kInt && codes.device() == dev,
              "maxsim: plaid codes must be int32 [T] on q's device");
  TORCH_CHECK(residuals.dim() == 2 && residuals.scalar_type() == at::kByte && residuals.device() == dev &&
                  residuals.size(0) == codes.size(0),
              "maxsim: plaid residuals must be uint8 [T, P] on q's device");
  TORCH_CHECK(centroids.dim() == 2 && centroids.scalar_type() == at::kFloat && centroids.device() == dev &&
                  centroids.size(1) == q.size(2),
              "maxsim: plaid centroids must be float32 [C, d] on q's device");
  MAXSIM_CHECK(bucket_weights.dim() == 1 && bucket_weights.scalar_type() == at::kFloat &&
                   bucket_weights.device() == dev && bucket_weights.size(0) == (int64_t(1) << nbits),
               "maxsim: plaid bucket_weights must be float32 [%d] on q's device", 1 << (int)nbits);
  MAXSIM_CHECK(residuals.size(1) == packed_bytes(q.size(2), nbits),
               "maxsim: plaid residuals have %lld bytes per token, expected ceil(d * nbits / 8) = %lld",
               (long long)residuals.size(1), (long long)packed_bytes(q.size(2), nbits));
  check_segments(d_start, d_len, dev);
  if (pair_q.has_value())
    TORCH_CHECK(pair_q->scalar_type() == at::kInt && pair_q->sizes() == d_start.sizes() && pair_q->device() == dev,
                "maxsim: plaid pair_q must be int32 [Nd] on q's device");
  const int64_t nd = d_start.size(0);
  return {q.size(0), q.size(1), q.size(2), nd, pair_q.has_value() ? nd : q.size(0) * nd,
          centroids.size(0), codes.size(0), residuals.size(1)};
}

}  // namespace plaid
}  // namespace maxsim
