// The PLAID / ColBERTv2 residual codec shared by the CPU and CUDA kernels
// (ops plaid_approx, plaid_forward, plaid_backward; contract in
// torch_binding.h, Python side in maxsim/plaid.py).
//
// Token t of a compressed corpus is codes[t] (int32, a centroid; a code
// outside [0, C) reads centroid 0) and residuals[t, :] (uint8, P =
// ceil(d * nbits / 8) bytes). Feature f's bucket is bits [s, s + nbits) of
// byte f / (8 / nbits), s = (f % (8 / nbits)) * nbits: the lowest bits hold
// the first feature of a byte. The decompressed feature is the fp32 sum
//   centroids[c, f] + bucket_weights[bucket]
// (one rounding, so every implementation produces the same bits).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MAXSIM_HD __host__ __device__ __forceinline__
#else
#define MAXSIM_HD inline
#endif

namespace maxsim {
namespace plaid {

MAXSIM_HD int64_t packed_bytes(int64_t d, int64_t nbits) { return (d * nbits + 7) / 8; }

MAXSIM_HD int bucket_of(const uint8_t* row, int64_t f, int nbits) {
  const int per_byte = 8 / nbits;
  const int shift = (int)(f % per_byte) * nbits;
  return (row[f / per_byte] >> shift) & ((1 << nbits) - 1);
}

// The same with nbits known at compile time (shifts, no divisions).
template <int NBITS>
MAXSIM_HD int bucket_of(const uint8_t* row, int f) {
  constexpr int kPerByte = 8 / NBITS;
  return (row[f / kPerByte] >> ((f % kPerByte) * NBITS)) & ((1 << NBITS) - 1);
}

MAXSIM_HD int32_t clamp_code(int32_t c, int64_t n_centroids) {
  return c >= 0 && c < n_centroids ? c : 0;
}

}  // namespace plaid
}  // namespace maxsim
