// PLAID / ColBERTv2 compressed documents on the GPU (contract in
// torch-ext/torch_binding.h, codec in torch-ext/plaid_codec.h).
//
// plaid_forward decompresses a tile of 32 document tokens into shared memory
// (fp32, the reference's bits), then every warp scores 8 of them against 32
// query tokens (one per lane) with float4 shared loads: the query row is
// padded so the lanes' rows fall on distinct banks, the document rows are
// broadcast. Decompressed tokens never reach global memory; one block per
// (query, document) pair, so the compressed bytes are read once per pair.
// plaid_approx gives each pair a warp: the lanes load 32 codes at once and
// shuffle them, each lane keeping the running max of one query token.
// plaid_backward gives each (query, query token) a warp over the features,
// re-decompressing each document's winning token.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <type_traits>

#include "../common/smem_opt_in.h"
#include "plaid_args.h"
#include "torch_binding.h"

namespace maxsim {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 32;                     // document tokens per tile
constexpr int kPerWarp = kTile / kWarps;      // tokens each warp scores
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

template <int NBITS>
__global__ void __launch_bounds__(kThreads) plaid_forward_kernel(
    const float* __restrict__ q, Codec cd, const float* __restrict__ bw, const int32_t* __restrict__ d_start,
    const int32_t* __restrict__ d_len, const int32_t* __restrict__ pair_q, int64_t nq, int64_t lq, int64_t nd,
    int dp, bool normalize, float* __restrict__ scores, int32_t* __restrict__ argmax) {
  extern __shared__ __align__(16) float smem[];
  const int qstride = dp + 4;
  float* qs = smem;                          // [32][dp + 4]
  float* ds = qs + 32 * qstride;             // [kTile][dp]
  float* bws = ds + kTile * dp;              // [256]
  float* red_m = bws + 256;                  // [kWarps][32]
  int* red_a = reinterpret_cast<int*>(red_m + kWarps * 32);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
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
  const float* qi = q + i * lq * cd.dim;
  float score = 0.f;
  for (int64_t s0 = 0; s0 < lq; s0 += 32) {
    __syncthreads();  // qs / red of the previous chunk fully read
    for (int idx = tid; idx < 32 * dp; idx += kThreads) {
      const int s = idx / dp, f = idx % dp;
      qs[s * qstride + f] = s0 + s < lq && f < cd.dim ? qi[(s0 + s) * cd.dim + f] : 0.f;
    }
    float m = -INFINITY;
    int arg = -1;
    for (int64_t t0 = 0; t0 < len; t0 += kTile) {
      __syncthreads();  // ds of the previous tile fully read
      // (t, f) walks the tile row-major, kThreads elements a step, without divisions
      for (int t = tid / dp, f = tid % dp; t < kTile;) {
        float v = 0.f;
        if (t0 + t < len && f < cd.dim) {
          const int64_t row = start + t0 + t;
          const int32_t c = plaid::clamp_code(cd.codes[row], cd.n_centroids);
          v = cd.cent[(int64_t)c * cd.dim + f] + bws[plaid::bucket_of<NBITS>(cd.res + row * cd.packed, f)];
        }
        ds[t * dp + f] = v;
        for (f += kThreads; f >= dp; f -= dp) ++t;
      }
      __syncthreads();
      const float* mine = ds + warp * kPerWarp * dp;
      float scale[kPerWarp];
#pragma unroll
      for (int k = 0; k < kPerWarp; ++k) {
        scale[k] = 1.f;
        if (normalize) {
          float ss = 0.f;
          for (int f = lane; f < dp; f += 32) ss += mine[k * dp + f] * mine[k * dp + f];
          scale[k] = 1.f / fmaxf(sqrtf(warp_sum(ss)), 1e-12f);
        }
      }
      float acc[kPerWarp] = {};
      const float* qrow = qs + lane * qstride;
      for (int f = 0; f < dp; f += 4) {
        const float4 a = *reinterpret_cast<const float4*>(qrow + f);
#pragma unroll
        for (int k = 0; k < kPerWarp; ++k) {
          const float4 b = *reinterpret_cast<const float4*>(mine + k * dp + f);
          acc[k] = fmaf(a.x, b.x, acc[k]);
          acc[k] = fmaf(a.y, b.y, acc[k]);
          acc[k] = fmaf(a.z, b.z, acc[k]);
          acc[k] = fmaf(a.w, b.w, acc[k]);
        }
      }
#pragma unroll
      for (int k = 0; k < kPerWarp; ++k) {
        const int64_t t = t0 + warp * kPerWarp + k;
        const float v = acc[k] * scale[k];
        if (t < len && v > m) m = v, arg = (int)t;
      }
    }
    red_m[warp * 32 + lane] = m;
    red_a[warp * 32 + lane] = arg;
    __syncthreads();
    if (warp == 0) {
      float best = -INFINITY;
      int barg = -1;
      for (int w = 0; w < kWarps; ++w) {
        const float v = red_m[w * 32 + lane];
        const int a = red_a[w * 32 + lane];
        if (a >= 0 && (barg < 0 || v > best || (v == best && a < barg))) best = v, barg = a;
      }
      const bool valid = s0 + lane < lq;
      score += warp_sum(valid && barg >= 0 ? best : 0.f);
      if (argmax && valid) argmax[p * lq + s0 + lane] = barg;
    }
  }
  if (tid == 0) scores[p] = score;
}

__global__ void plaid_approx_kernel(const float* __restrict__ qcs, const int32_t* __restrict__ codes,
                                    const int32_t* __restrict__ d_start, const int32_t* __restrict__ d_len,
                                    const uint8_t* __restrict__ keep, int64_t n_centroids, int64_t lq, int64_t nd,
                                    int64_t pairs, int64_t tokens, float* __restrict__ out) {
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
  const float* qi = qcs + i * n_centroids * lq;
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
          if (valid) m = fmaxf(m, qi[c * lq + s]);
        }
      }
      score += warp_sum(valid && any ? m : 0.f);
      continue;
    }
    for (int64_t t0 = 0; t0 < len; t0 += 32) {
      const int cnt = len - t0 < 32 ? (int)(len - t0) : 32;
      const int32_t mine = lane < cnt ? plaid::clamp_code(codes[start + t0 + lane], n_centroids) : 0;
      int j = 0;
      for (; j + 4 <= cnt; j += 4) {
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int32_t c = __shfl_sync(0xffffffffu, mine, j + u);
          v[u] = valid ? qi[c * lq + s] : -INFINITY;
        }
        m = fmaxf(m, fmaxf(fmaxf(v[0], v[1]), fmaxf(v[2], v[3])));
      }
      for (; j < cnt; ++j) {
        const int32_t c = __shfl_sync(0xffffffffu, mine, j);
        if (valid) m = fmaxf(m, qi[c * lq + s]);
      }
    }
    score += warp_sum(valid && any ? m : 0.f);
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
    if (normalize) g *= 1.f / fmaxf(sqrtf(warp_sum(ss)), 1e-12f);
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
  TORCH_CHECK(qcs_in.is_cuda() && qcs_in.dim() == 3 && qcs_in.scalar_type() == at::kFloat,
              "maxsim: plaid_approx qcs must be float32 [Nq, C, Lq]");
  TORCH_CHECK(codes_in.dim() == 1 && codes_in.scalar_type() == at::kInt && codes_in.device() == qcs_in.device(),
              "maxsim: plaid_approx codes must be int32 [T] on qcs' device");
  plaid::check_segments(st_in, ln_in, qcs_in.device());
  plaid::check_keep(keep_in, qcs_in);
  c10::cuda::CUDAGuard guard(qcs_in.device());
  const at::Tensor qcs = qcs_in.contiguous(), codes = codes_in.contiguous();
  const at::Tensor keep = keep_in ? keep_in->contiguous() : at::Tensor();
  const at::Tensor st = st_in.contiguous(), ln = ln_in.contiguous();
  const int64_t nq = qcs.size(0), nd = st.size(0), pairs = nq * nd;
  at::Tensor out = at::empty({nq, nd}, qcs.options());
  if (pairs == 0) return out;
  const int threads = 256, per_block = threads / 32;
  plaid_approx_kernel<<<(unsigned)((pairs + per_block - 1) / per_block), threads, 0,
                        at::cuda::getCurrentCUDAStream()>>>(
      qcs.data_ptr<float>(), codes.data_ptr<int32_t>(), st.data_ptr<int32_t>(), ln.data_ptr<int32_t>(),
      keep_in ? keep.data_ptr<uint8_t>() : nullptr, qcs.size(1), qcs.size(2), nd, pairs, codes.size(0),
      out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  const size_t smem = sizeof(float) * (32 * (dp + 4) + kTile * dp + 256 + 2 * kWarps * 32);
  with_nbits(nbits, [&](auto nb) {
    constexpr int NBITS = decltype(nb)::value;
    static int opted[kSmemOptInDevices] = {};
    opt_in_dynamic_smem(plaid_forward_kernel<NBITS>, smem, opted);
    plaid_forward_kernel<NBITS><<<(unsigned)sh.pairs, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<float>(), codec_of(codes, res, cent), bw.data_ptr<float>(), st.data_ptr<int32_t>(),
        ln.data_ptr<int32_t>(), pair_q.has_value() ? pq.data_ptr<int32_t>() : nullptr, sh.nq, sh.lq, sh.nd, dp,
        normalize, scores.data_ptr<float>(), want_argmax ? argmax.data_ptr<int32_t>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
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
