// PLAID / ColBERTv2 compressed documents on the GPU (contract in
// torch-ext/torch_binding.h, codec in torch-ext/plaid_codec.h).
//
// plaid_forward: one block per (query, document) pair decompresses tiles of
// 64 document tokens into shared memory, feature-major (fp32, the
// reference's bits, never written out), and scores them against 32 query
// tokens as a register-tiled SIMT product (4 x 4 per thread). plaid_approx
// gives each pair a warp: 16 bytes a lane, so 4 tokens' score rows a load
// from an fp32 table and 8 from a 16-bit one; with a centroid mask, a lane
// per query token over the kept tokens. plaid_backward gives each (query,
// query token) a warp over the features, re-decompressing each document's
// winning token.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <type_traits>

#include "../common/convert.cuh"
#include "../common/dtype_dispatch.cuh"
#include "../common/smem_opt_in.h"
#include "../common/normalize_jacobian.cuh"
#include "plaid_args.h"
#include "torch_binding.h"

namespace maxsim {
namespace {

constexpr int kThreads = 128;
constexpr int kQTile = 32;                    // query tokens per chunk
constexpr int kDTile = 64;                    // document tokens per tile
// Row stride of the feature-major tile: = 4 mod 8, so the decompression's
// transposed stores (lane pairs on a token, 16 tokens a warp) hit 32
// distinct banks, and rows stay 16-byte aligned for the float4 reads.
constexpr int kDStride = kDTile + 4;
constexpr int kLoadBatch = 8;                 // feature groups a thread loads before using them
constexpr int kMaxDim = 512;                  // shared memory and the backward's registers
constexpr int kBwdSlots = kMaxDim / 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct Codec {
  const int32_t* __restrict__ codes;
  const uint8_t* __restrict__ res;
  const float* __restrict__ cent;
  int64_t dim, packed, n_centroids, tokens;
};

// A document's token range; len -1 when it leaves [0, tokens) (scores NaN).
__device__ __forceinline__ void doc_range(const int32_t* st, const int32_t* ln, int64_t n, int64_t tokens,
                                          int64_t& s, int64_t& l) {
  s = st[n];
  l = ln[n] > 0 ? ln[n] : 0;
  if (s < 0 || s + l > tokens) l = -1;
}

// The 4 features [4g, 4g + 4) of one compressed token, as the reference
// decompresses them (one fp32 add each; 0 past dim). WIDE: dim % 4 == 0 and
// the tables aligned, so a float4 of the centroid and one load of the
// residual bits; otherwise feature by feature.
template <int NBITS, bool WIDE>
struct Group {
  float4 c;
  uint32_t bits;  // bucket of feature 4g + i in bits [i * NBITS, (i + 1) * NBITS)

  __device__ __forceinline__ void load(const float* __restrict__ crow, const uint8_t* __restrict__ rrow, int g,
                                       int dim) {
    const int f = 4 * g;
    if constexpr (WIDE) {
      c = __ldg(reinterpret_cast<const float4*>(crow + f));
      if constexpr (NBITS == 2) bits = __ldg(rrow + g);
      else if constexpr (NBITS == 4) bits = __ldg(reinterpret_cast<const uint16_t*>(rrow) + g);
      else bits = __ldg(reinterpret_cast<const uint32_t*>(rrow) + g);
    } else {
      float v[4];
      bits = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[i] = f + i < dim ? __ldg(crow + f + i) : 0.f;
        if (f + i < dim) bits |= (uint32_t)plaid::bucket_of<NBITS>(rrow, f + i) << (i * NBITS);
      }
      c = make_float4(v[0], v[1], v[2], v[3]);
    }
  }

  __device__ __forceinline__ float at(int i, int g, int dim, const float* bws) const {
    const float ci = i == 0 ? c.x : i == 1 ? c.y : i == 2 ? c.z : c.w;
    const float v = ci + bws[(bits >> (i * NBITS)) & ((1u << NBITS) - 1)];
    if constexpr (WIDE) return v;
    return 4 * g + i < dim ? v : 0.f;
  }
};

// One block per (query, document) pair. Per chunk of 32 query tokens and
// tile of 64 document tokens: the block decompresses the tile into shared
// memory feature-major ([f][token], fp32, the reference's bits; each thread
// one token's feature groups of one parity, so a lane pair reads a whole
// 32-byte sector of the centroid row), then every thread accumulates a 4x4
// block of query tokens x document tokens with one float4 of each per
// feature (16 FMAs per two shared loads; the query row is a broadcast),
// keeping the running max / argmax of its 4 query tokens in registers.
// Several blocks per SM overlap one's decompression with another's FMAs.
template <int NBITS, bool WIDE>
__global__ void __launch_bounds__(kThreads, 4) plaid_forward_kernel(
    const float* __restrict__ q, Codec cd, const float* __restrict__ bw, const int32_t* __restrict__ d_start,
    const int32_t* __restrict__ d_len, const int32_t* __restrict__ pair_q, int64_t nq, int64_t lq, int64_t nd,
    int dp, bool normalize, float* __restrict__ scores, int32_t* __restrict__ argmax) {
  extern __shared__ __align__(16) float smem[];
  float* qs = smem;                          // [dp][kQTile], feature-major
  float* ds = qs + dp * kQTile;              // [dp][kDStride], feature-major
  float* scale = ds + dp * kDStride;         // [kDTile]: 1 / |token|
  float* bws = scale + kDTile;               // [256]
  float* red = bws + 256;                    // [kThreads / 16]
  const int tid = threadIdx.x;
  const int64_t p = blockIdx.x;
  const int64_t n = pair_q ? p : p % nd;
  const int64_t i = pair_q ? pair_q[p] : p / nd;
  int64_t start, len;
  doc_range(d_start, d_len, n, cd.tokens, start, len);
  if (i < 0 || i >= nq) len = -1;
  if (len < 0) {
    if (tid == 0) scores[p] = __int_as_float(0x7fc00000);
    if (argmax)
      for (int64_t s = tid; s < lq; s += kThreads) argmax[p * lq + s] = -1;
    return;
  }
  for (int b = tid; b < (1 << NBITS); b += kThreads) bws[b] = bw[b];
  const int dim = (int)cd.dim, groups = dp / 4;
  const float* qi = q + i * lq * cd.dim;
  // compute roles: 8 x 16 threads, 4 query tokens x 4 document tokens each
  const int tq = tid >> 4, td = tid & 15;
  // decompression roles: token tid / 2, feature groups of parity tid % 2
  const int dt = tid >> 1, par = tid & 1;
  float score = 0.f;
  for (int64_t s0 = 0; s0 < lq; s0 += kQTile) {
    __syncthreads();  // qs / red of the previous chunk fully read
    for (int idx = tid; idx < kQTile * dp; idx += kThreads) {
      const int s = idx % kQTile, f = idx / kQTile;
      qs[idx] = s0 + s < lq && f < dim ? qi[(s0 + s) * cd.dim + f] : 0.f;
    }
    float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int arg[4] = {-1, -1, -1, -1};
    for (int64_t t0 = 0; t0 < len; t0 += kDTile) {
      __syncthreads();  // ds / scale of the previous tile fully read
      {
        const bool live = t0 + dt < len;
        const int64_t row = start + t0 + dt;
        const int32_t code = live ? plaid::clamp_code(cd.codes[row], cd.n_centroids) : 0;
        const float* crow = cd.cent + (int64_t)code * cd.dim;
        const uint8_t* rrow = cd.res + (live ? row : 0) * cd.packed;
        float ss = 0.f;
        for (int g0 = par; g0 < groups; g0 += 2 * kLoadBatch) {
          Group<NBITS, WIDE> gr[kLoadBatch];
#pragma unroll
          for (int u = 0; u < kLoadBatch; ++u) {
            const int g = g0 + 2 * u;
            if (live && g < groups) gr[u].load(crow, rrow, g, dim);
          }
#pragma unroll
          for (int u = 0; u < kLoadBatch; ++u) {
            const int g = g0 + 2 * u;
            if (g < groups) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const float v = live ? gr[u].at(e, g, dim, bws) : 0.f;
                ss = fmaf(v, v, ss);
                ds[(4 * g + e) * kDStride + dt] = v;
              }
            }
          }
        }
        ss += __shfl_xor_sync(0xffffffffu, ss, 1);
        if (par == 0) scale[dt] = normalize ? inv_norm(ss) : 1.f;
      }
      __syncthreads();
      float acc[4][4] = {};
      const float* qp = qs + 4 * tq;
      const float* dpt = ds + 4 * td;
#pragma unroll 4
      for (int k = 0; k < dim; ++k) {
        const float4 a = *reinterpret_cast<const float4*>(qp + k * kQTile);
        const float4 b = *reinterpret_cast<const float4*>(dpt + k * kDStride);
        const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[r][c] = fmaf(av[r], bv[c], acc[r][c]);
      }
      const float4 sc4 = *reinterpret_cast<const float4*>(scale + 4 * td);
      const float sc[4] = {sc4.x, sc4.y, sc4.z, sc4.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t t = t0 + 4 * td + c;  // increasing: the first of equal maxima wins
        if (t < len) {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const float v = acc[r][c] * sc[c];
            if (v > m[r]) m[r] = v, arg[r] = (int)t;
          }
        }
      }
    }
    // the 16 threads of a query-token group: best value, lowest token on ties
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float ov = __shfl_xor_sync(0xffffffffu, m[r], o);
        const int oa = __shfl_xor_sync(0xffffffffu, arg[r], o);
        if (oa >= 0 && (arg[r] < 0 || ov > m[r] || (ov == m[r] && oa < arg[r]))) m[r] = ov, arg[r] = oa;
      }
    }
    if (td == 0) {
      float part = 0.f;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int64_t s = s0 + 4 * tq + r;
        if (s < lq) {
          part += arg[r] >= 0 ? m[r] : 0.f;
          if (argmax) argmax[p * lq + s] = arg[r];
        }
      }
      red[tq] = part;
    }
    __syncthreads();
    if (tid == 0)
      for (int w = 0; w < kThreads / 16; ++w) score += red[w];
  }
  if (tid == 0) scores[p] = score;
}

// Loads a warp keeps in flight per batch (each gathers 16 bytes a lane): on
// the H200 2 and 8 measured 5-8 % slower for fp32 tables (fewer in flight;
// fewer warps for the registers).
constexpr int kApproxBatch = 4;

// One score of a T table (fp32 / fp16 / bf16) as fp32, exactly.
template <typename T>
__device__ __forceinline__ float load1(const T* p) {
  return cuda_cvt::to_f(__ldg(p));
}

// The scan's gather geometry for a T table: a lane reads 16 bytes, kVec
// query tokens, so a row of 32 query tokens takes kLanesPerRow lanes and
// one warp load gathers kRowsPerLoad tokens' rows (4 for fp32, 8 for
// 16-bit tables, whose rows are half the bytes).
template <typename T>
struct ApproxGeometry {
  static constexpr int kVec = 16 / (int)sizeof(T);
  static constexpr int kLanesPerRow = 32 / kVec;
  static constexpr int kRowsPerLoad = 32 / kLanesPerRow;
};

// kVec consecutive scores as fp32: one 16-byte load (VEC: the row segment
// is 16-byte aligned and inside the row), else guarded scalar loads.
template <typename T, bool VEC>
__device__ __forceinline__ void load_scores(const T* p, int64_t avail, float (&v)[ApproxGeometry<T>::kVec]) {
  constexpr int kVec = ApproxGeometry<T>::kVec;
  if constexpr (VEC) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    const T* x = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = cuda_cvt::to_f(x[k]);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = k < avail ? load1(p + k) : -INFINITY;
  }
}

// One warp per pair. Without a centroid mask a warp gathers kRowsPerLoad
// tokens' score rows per load: lane = kLanesPerRow r + g reads query tokens
// kVec g .. kVec g + kVec - 1 of token slot r's row (VEC: Lq % kVec == 0
// and the table 16-byte aligned); the slots' maxima are merged at the end.
// Maxima of the widened scores are the widened maxima, and sums stay fp32.
template <typename T, bool VEC>
__global__ void plaid_approx_kernel(const T* __restrict__ qcs, const int32_t* __restrict__ codes,
                                    const int32_t* __restrict__ d_start, const int32_t* __restrict__ d_len,
                                    const uint8_t* __restrict__ keep, int64_t n_centroids, int64_t lq, int64_t nd,
                                    int64_t pairs, int64_t tokens, float* __restrict__ out) {
  using G = ApproxGeometry<T>;
  const int lane = threadIdx.x & 31;
  const int64_t p = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (p >= pairs) return;
  const int64_t i = p / nd, n = p % nd;
  int64_t start, len;
  doc_range(d_start, d_len, n, tokens, start, len);
  if (len < 0 || (len > 0 && n_centroids == 0)) {
    if (lane == 0) out[p] = __int_as_float(0x7fc00000);
    return;
  }
  const T* qi = qcs + i * n_centroids * lq;
  const uint8_t* ki = keep ? keep + i * n_centroids : nullptr;
  float score = 0.f;
  for (int64_t s0 = 0; s0 < lq; s0 += 32) {
    const int64_t s = s0 + lane;
    const bool valid = s < lq;
    float m = -INFINITY;
    bool any = len > 0;
    if (ki) {
      // Centroid pruning: the lanes test their own token's centroid, and the
      // warp gathers the score rows of the kept tokens only.
      any = false;
      for (int64_t t0 = 0; t0 < len; t0 += 32) {
        const int cnt = len - t0 < 32 ? (int)(len - t0) : 32;
        const int32_t mine = lane < cnt ? plaid::clamp_code(codes[start + t0 + lane], n_centroids) : 0;
        unsigned live = __ballot_sync(0xffffffffu, lane < cnt && ki[mine] != 0);
        any = any || live != 0u;
        while (live) {
          const int j = __ffs(live) - 1;
          live &= live - 1u;
          const int32_t c = __shfl_sync(0xffffffffu, mine, j);
          if (valid) m = fmaxf(m, load1(qi + c * lq + s));
        }
      }
      score += warp_sum(valid && any ? m : 0.f);
      continue;
    }
    const int r = lane / G::kLanesPerRow;
    const int64_t sb = s0 + G::kVec * (lane % G::kLanesPerRow);
    float mx[G::kVec];
#pragma unroll
    for (int k = 0; k < G::kVec; ++k) mx[k] = -INFINITY;
    for (int64_t t0 = 0; t0 < len; t0 += 32) {
      const int cnt = len - t0 < 32 ? (int)(len - t0) : 32;
      const int32_t mine = lane < cnt ? plaid::clamp_code(codes[start + t0 + lane], n_centroids) : 0;
      for (int j = 0; j < cnt; j += G::kRowsPerLoad * kApproxBatch) {
        float v[kApproxBatch][G::kVec];
#pragma unroll
        for (int u = 0; u < kApproxBatch; ++u) {
          const int tt = j + G::kRowsPerLoad * u + r;
          const int32_t c = __shfl_sync(0xffffffffu, mine, tt & 31);
#pragma unroll
          for (int k = 0; k < G::kVec; ++k) v[u][k] = -INFINITY;
          if (tt < cnt && sb < lq) load_scores<T, VEC>(qi + (int64_t)c * lq + sb, lq - sb, v[u]);
        }
#pragma unroll
        for (int u = 0; u < kApproxBatch; ++u)
#pragma unroll
          for (int k = 0; k < G::kVec; ++k) mx[k] = fmaxf(mx[k], v[u][k]);
      }
    }
    float part = 0.f;
#pragma unroll
    for (int k = 0; k < G::kVec; ++k) {
#pragma unroll
      for (int o = G::kLanesPerRow; o < 32; o <<= 1) mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], o));
      if (r == 0 && len > 0 && sb + k < lq) part += mx[k];
    }
    score += warp_sum(part);
  }
  if (lane == 0) out[p] = score;
}

template <int NBITS>
__global__ void plaid_backward_kernel(const float* __restrict__ grad, Codec cd, const float* __restrict__ bw,
                                      const int32_t* __restrict__ d_start, const int32_t* __restrict__ d_len,
                                      const int32_t* __restrict__ argmax, int64_t rows, int64_t lq, int64_t nd,
                                      bool normalize, float* __restrict__ dq) {
  const int lane = threadIdx.x & 31;
  const int64_t r = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int64_t i = r / lq, s = r % lq;
  float acc[kBwdSlots] = {};
  for (int64_t n = 0; n < nd; ++n) {
    const int32_t t = argmax[(i * nd + n) * lq + s];
    int64_t start, len;
    doc_range(d_start, d_len, n, cd.tokens, start, len);
    if (t < 0 || t >= len) continue;
    const int64_t row = start + t;
    const float* c = cd.cent + (int64_t)plaid::clamp_code(cd.codes[row], cd.n_centroids) * cd.dim;
    const uint8_t* rb = cd.res + row * cd.packed;
    float v[kBwdSlots];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < kBwdSlots; ++j) {
      const int64_t f = lane + 32 * j;
      v[j] = f < cd.dim ? c[f] + bw[plaid::bucket_of<NBITS>(rb, (int)f)] : 0.f;
      ss += v[j] * v[j];
    }
    float g = grad[i * nd + n];
    if (normalize) g *= inv_norm(warp_sum(ss));
#pragma unroll
    for (int j = 0; j < kBwdSlots; ++j) acc[j] = fmaf(g, v[j], acc[j]);
  }
#pragma unroll
  for (int j = 0; j < kBwdSlots; ++j) {
    const int64_t f = lane + 32 * j;
    if (f < cd.dim) dq[r * cd.dim + f] = acc[j];
  }
}

// kernel<2>, kernel<4> or kernel<8> by nbits (checked to be one of them).
template <typename Fn>
void with_nbits(int64_t nbits, Fn&& fn) {
  if (nbits == 2)
    fn(std::integral_constant<int, 2>{});
  else if (nbits == 4)
    fn(std::integral_constant<int, 4>{});
  else
    fn(std::integral_constant<int, 8>{});
}

Codec codec_of(const at::Tensor& codes, const at::Tensor& res, const at::Tensor& cent) {
  return {codes.data_ptr<int32_t>(), res.data_ptr<uint8_t>(), cent.data_ptr<float>(), cent.size(1), res.size(1),
          cent.size(0), codes.size(0)};
}

}  // namespace

at::Tensor plaid_approx_cuda(const at::Tensor& qcs_in, const at::Tensor& codes_in, const at::Tensor& st_in,
                             const at::Tensor& ln_in, const std::optional<at::Tensor>& keep_in) {
  TORCH_CHECK(qcs_in.is_cuda(), "maxsim: plaid_approx_cuda takes CUDA tensors");
  plaid::check_score_table(qcs_in);
  TORCH_CHECK(codes_in.dim() == 1 && codes_in.scalar_type() == at::kInt && codes_in.device() == qcs_in.device(),
              "maxsim: plaid_approx codes must be int32 [T] on qcs' device");
  plaid::check_segments(st_in, ln_in, qcs_in.device());
  plaid::check_keep(keep_in, qcs_in);
  c10::cuda::CUDAGuard guard(qcs_in.device());
  const at::Tensor qcs = qcs_in.contiguous(), codes = codes_in.contiguous();
  const at::Tensor keep = keep_in ? keep_in->contiguous() : at::Tensor();
  const at::Tensor st = st_in.contiguous(), ln = ln_in.contiguous();
  const int64_t nq = qcs.size(0), nd = st.size(0), pairs = nq * nd;
  at::Tensor out = at::empty({nq, nd}, qcs.options().dtype(at::kFloat));
  if (pairs == 0) return out;
  const int threads = 256, per_block = threads / 32;
  const unsigned blocks = (unsigned)((pairs + per_block - 1) / per_block);
  const int64_t n_centroids = qcs.size(1), lq = qcs.size(2), tokens = codes.size(0);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_float_type(qcs.scalar_type(), [&](auto t) {
    using T = decltype(t);
    const bool vec = lq % ApproxGeometry<T>::kVec == 0 && aligned_to(qcs.data_ptr(), 16);
    const auto kernel = vec ? plaid_approx_kernel<T, true> : plaid_approx_kernel<T, false>;
    kernel<<<blocks, threads, 0, stream>>>(
        static_cast<const T*>(qcs.data_ptr()), codes.data_ptr<int32_t>(), st.data_ptr<int32_t>(),
        ln.data_ptr<int32_t>(), keep_in ? keep.data_ptr<uint8_t>() : nullptr, n_centroids, lq, nd, pairs, tokens,
        out.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> plaid_forward_cuda(const at::Tensor& q_in, const at::Tensor& codes_in,
                                                      const at::Tensor& res_in, const at::Tensor& cent_in,
                                                      const at::Tensor& bw_in, const at::Tensor& st_in,
                                                      const at::Tensor& ln_in, const std::optional<at::Tensor>& pair_q,
                                                      int64_t nbits, bool normalize, bool want_argmax) {
  TORCH_CHECK(q_in.is_cuda(), "maxsim: plaid_forward_cuda takes CUDA tensors");
  const plaid::Shapes sh = plaid::check_forward(q_in, codes_in, res_in, cent_in, bw_in, st_in, ln_in, pair_q, nbits);
  MAXSIM_CHECK(sh.dim <= kMaxDim, "maxsim: plaid on CUDA supports d <= %d, got %lld", kMaxDim, (long long)sh.dim);
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous(), codes = codes_in.contiguous(), res = res_in.contiguous();
  const at::Tensor cent = cent_in.contiguous(), bw = bw_in.contiguous(), st = st_in.contiguous(),
                   ln = ln_in.contiguous();
  const at::Tensor pq = pair_q.has_value() ? pair_q->contiguous() : at::Tensor();
  at::Tensor scores = pair_q.has_value() ? at::empty({sh.nd}, q.options()) : at::empty({sh.nq, sh.nd}, q.options());
  at::Tensor argmax = want_argmax ? (pair_q.has_value() ? at::empty({sh.nd, sh.lq}, q.options().dtype(at::kInt))
                                                         : at::empty({sh.nq, sh.nd, sh.lq}, q.options().dtype(at::kInt)))
                                  : at::empty({0}, q.options().dtype(at::kInt));
  if (sh.pairs == 0) return {scores, argmax};
  MAXSIM_CHECK(sh.pairs < (int64_t(1) << 31), "maxsim: plaid_forward scores at most 2^31 - 1 pairs per call, got %lld",
               (long long)sh.pairs);
  const int dp = (int)((sh.dim + 3) / 4 * 4);
  const size_t smem = sizeof(float) * (dp * kQTile + dp * kDStride + kDTile + 256 + kThreads / 16);
  const bool wide = sh.dim % 4 == 0 && aligned_to(cent.data_ptr(), 16) && aligned_to(res.data_ptr(), nbits / 2);
  with_nbits(nbits, [&](auto nb) {
    constexpr int NBITS = decltype(nb)::value;
    const auto launch = [&](auto wide_c) {  // a closure per WIDE: its own opt-in state
      constexpr auto kernel = plaid_forward_kernel<NBITS, decltype(wide_c)::value>;
      static int opted[kSmemOptInDevices] = {};
      opt_in_dynamic_smem(kernel, smem, opted);
      kernel<<<(unsigned)sh.pairs, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
          q.data_ptr<float>(), codec_of(codes, res, cent), bw.data_ptr<float>(), st.data_ptr<int32_t>(),
          ln.data_ptr<int32_t>(), pair_q.has_value() ? pq.data_ptr<int32_t>() : nullptr, sh.nq, sh.lq, sh.nd, dp,
          normalize, scores.data_ptr<float>(), want_argmax ? argmax.data_ptr<int32_t>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (wide)
      launch(std::true_type{});
    else
      launch(std::false_type{});
  });
  return {scores, argmax};
}

at::Tensor plaid_backward_cuda(const at::Tensor& grad_in, const at::Tensor& q_in, const at::Tensor& codes_in,
                               const at::Tensor& res_in, const at::Tensor& cent_in, const at::Tensor& bw_in,
                               const at::Tensor& st_in, const at::Tensor& ln_in, const at::Tensor& argmax_in,
                               int64_t nbits, bool normalize) {
  TORCH_CHECK(q_in.is_cuda(), "maxsim: plaid_backward_cuda takes CUDA tensors");
  const plaid::Shapes sh = plaid::check_forward(q_in, codes_in, res_in, cent_in, bw_in, st_in, ln_in, {}, nbits);
  MAXSIM_CHECK(sh.dim <= kMaxDim, "maxsim: plaid on CUDA supports d <= %d, got %lld", kMaxDim, (long long)sh.dim);
  TORCH_CHECK(grad_in.scalar_type() == at::kFloat && grad_in.sizes() == at::IntArrayRef({sh.nq, sh.nd}) &&
                  grad_in.device() == q_in.device(),
              "maxsim: plaid_backward grad must be float32 [Nq, Nd]");
  TORCH_CHECK(argmax_in.scalar_type() == at::kInt && argmax_in.sizes() == at::IntArrayRef({sh.nq, sh.nd, sh.lq}) &&
                  argmax_in.device() == q_in.device(),
              "maxsim: plaid_backward argmax must be int32 [Nq, Nd, Lq]");
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor grad = grad_in.contiguous(), argmax = argmax_in.contiguous(), codes = codes_in.contiguous();
  const at::Tensor res = res_in.contiguous(), cent = cent_in.contiguous(), bw = bw_in.contiguous();
  const at::Tensor st = st_in.contiguous(), ln = ln_in.contiguous();
  at::Tensor dq = at::empty({sh.nq, sh.lq, sh.dim}, q_in.options());
  const int64_t rows = sh.nq * sh.lq;
  if (rows == 0 || sh.dim == 0) return dq.zero_();
  const int threads = 128, per_block = threads / 32;
  with_nbits(nbits, [&](auto nb) {
    plaid_backward_kernel<decltype(nb)::value><<<(unsigned)((rows + per_block - 1) / per_block), threads, 0,
                                                 at::cuda::getCurrentCUDAStream()>>>(
        grad.data_ptr<float>(), codec_of(codes, res, cent), bw.data_ptr<float>(), st.data_ptr<int32_t>(),
        ln.data_ptr<int32_t>(), argmax.data_ptr<int32_t>(), rows, sh.lq, sh.nd, normalize, dq.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dq;
}

}  // namespace maxsim
