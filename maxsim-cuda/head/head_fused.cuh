// Fused MaxSim through a projection head (sm_90a: wgmma + TMA), the forward
// of maxsim_from_hidden for inference:
//   score[q, n] = sum over valid query tokens i of max over valid document
//   tokens j of <Q[q, i], round(normalize(H[n, j] @ W^T + b))>
// with the projected token rounded to the 16-bit dtype before the dot
// product and fp32 accumulation everywhere, without writing the projected
// documents to global memory. Scope: fp16 / bf16, d_out == 128, d_model a
// multiple of 64, Nq * Lq <= 64 query tokens in all (one wgmma N of 64).
//
// Persistent kernel, one CTA per SM (384 threads), each CTA walking tiles of
// BM = 128 MT rows (MT = 2 by default, 1 with MAXSIM_HEAD_BM=128) of the flat
// hidden rows [Nd * Ld, d_model] with a stride of gridDim.x:
//   * warp 8 (producer, one lane): per 64-column k block of a tile, one TMA of
//     the H tile [BM rows x 128 B] and one of the W tile [128 (d_out) rows x
//     128 B] (both 128B-swizzled, K-major; rows past Nd * Ld zero-filled) into
//     a HeadCfg::STAGES-deep ring guarded by full / empty mbarriers. W is read
//     again (from L2) for every tile: at 192 KB (d_model 768) it cannot stay
//     resident beside the ring; a tile of 256 rows reads it once per 256 rows
//     of H instead of once per 128.
//   * warpgroups 0 and 1 (consumers): each owns MT of the tile's 64-row
//     blocks (2 m + wg, m < MT).
//     1. projection: per block a chain of d_model / 16 wgmma m64n128k16 (A =
//        H rows, B = W, both from shared memory) into D [64 x 128] fp32
//        registers (the chains of a k block are one commit group);
//     then, block by block:
//     2. epilogue in registers: + bias, the row's sum of squares (a quad's 4
//        lanes hold one row: two shuffles), times 1 / max(|x|, 1e-12), rounded
//        to T and repacked as wgmma A fragments (the m64nNk16 accumulator
//        layout of 16-bit values is the A-register layout);
//     3. scores: S^T [64 tokens x 64 query tokens] = D (A, registers) x Q^T
//        (B: the query tokens [64 rows x 128], loaded once per CTA, rows past
//        Nq * Lq zero), 8 wgmma m64n64k16;
//     4. S^T (rows past Nd * Ld or masked out: -inf) goes to a per-warpgroup
//        shared tile; the warpgroup's threads take (document segment of the 64
//        rows, query token[, part of the segment's rows]) items, reduce them
//        with a NaN-propagating max and merge each into the running maxima
//        maxbuf [Nd, Nq * Lq] with an atomic max on an order-preserving
//        integer encoding (documents straddle tiles and CTAs).
// head_finalize_kernel then sums each query's valid tokens' maxima (-inf,
// i.e. no valid document token, adds 0) into scores [Nq, Nd].
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include "../common/convert.cuh"
#include "../common/pdl.cuh"
#include "../forward_sm90a/forward_stream_wg.cuh"  // WgMmaSs (both operands from shared memory)
#include "../forward_sm90a/forward_wgmma.cuh"     // WgMma (RS), wg_desc, mbarrier / TMA helpers

namespace maxsim {
namespace head {

using cuda_cvt::to_f;
using cuda_fwd::max_nan;
using cuda_fwd::neg_inf;

constexpr int kHeadThreads = 384;  // 2 consumer warpgroups + the producer's warpgroup
constexpr int kHeadDout = 128;     // projected width (wgmma N of the projection)
constexpr int kHeadNQ = 64;        // query tokens per CTA (wgmma N of the scores)
constexpr int kHeadSStride = 72;   // floats per row of the S^T tile (64 + 8: fewer bank conflicts)
constexpr int kHeadQBytes = 2 * kHeadNQ * 128;          // query tokens, 2 k blocks
constexpr int kHeadSBytes = 2 * 64 * kHeadSStride * 4;  // S^T of both warpgroups (64 rows each)

// MT: 64-row blocks per consumer warpgroup and tile (tiles of BM = 128 MT
// hidden rows). Each tile reads all of W again (from L2), so MT = 2 halves
// that traffic (W is as many bytes as 128 rows of H) at the cost of a
// second accumulator tile per thread and a shallower ring.
template <int MT>
struct HeadCfg {
  static constexpr int BM = 128 * MT;
  static constexpr int H_BYTES = BM * 128;               // H k block [BM rows x 128 B]
  static constexpr int STAGE_BYTES = H_BYTES + kHeadDout * 128;  // + W k block [128 rows x 128 B]
  static constexpr int STAGES = MT == 1 ? 5 : 3;         // k blocks in flight
  static constexpr int SMEM = STAGES * STAGE_BYTES + kHeadQBytes + kHeadSBytes + 1024;  // + alignment
};

// The running maxima as unsigned integers of the same order as the floats:
// NaN above everything, -inf (no valid token yet) the initial value.
constexpr uint32_t kHeadNegInfKey = 0x007FFFFFu;  // ~0xff800000
__device__ __forceinline__ uint32_t head_key(float v) {
  const uint32_t b = __float_as_uint(v);
  return v != v ? 0xffffffffu : (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float head_unkey(uint32_t k) {
  return k == 0xffffffffu ? __uint_as_float(0x7fffffffu)
                          : __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

struct HeadParams {
  const void* q;                // [nqv, 128] query tokens (16-byte aligned)
  const void* bias;             // [128] or null
  const unsigned char* d_mask;  // [T] (flat [Nd, Ld]) or null
  uint32_t* maxbuf;             // [Nd, nqv] encoded running maxima
  int64_t T;                    // hidden rows, Nd * Ld
  int64_t ntiles;               // ceil(T / BM)
  int Ld;                       // tokens per document (>= 1)
  int nqv;                      // query tokens, Nq * Lq (1 .. 64)
  int nkb;                      // 64-column k blocks of d_model
  int normalize;
};

template <typename T>
__device__ __forceinline__ uint32_t head_pack(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t head_pack<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t head_pack<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Steps 2-4 for one 64-row block of a consumer warpgroup: acc holds its
// projected rows (acc[4 j + 2 h + e]: row 16 wq + g8 + 8 h of the block,
// column 8 j + 2 c4 + e), t0 its first hidden row.
template <typename T>
__device__ __forceinline__ void head_block(const HeadParams& p, float* acc, int64_t t0, const float* bias_s,
                                           uint32_t q_s, float* s_t, int wg, int wq, int g8, int c4, int tw) {
#if MAXSIM_WG_DEVICE
  using cuda_fwd::named_bar;
  using cuda_fwd::wg_commit;
  using cuda_fwd::wg_desc;
  using cuda_fwd::wg_fence;
  using cuda_fwd::wg_fence_acc;
  using cuda_fwd::wg_wait;
  // Validity of this thread's two rows (loads issued before the epilogue).
  bool row_ok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t t = t0 + wq * 16 + g8 + 8 * h;
    row_ok[h] = t < p.T && (p.d_mask == nullptr || p.d_mask[t]);
  }

  // 2. epilogue: bias, normalisation, rounding, A fragments.
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float bv = bias_s[8 * j + 2 * c4 + e];
      acc[4 * j + e] += bv;
      acc[4 * j + 2 + e] += bv;
    }
  if (p.normalize) {
    float ss[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) ss[h] = fmaf(acc[4 * j + 2 * h + e], acc[4 * j + 2 * h + e], ss[h]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ss[h] += __shfl_xor_sync(0xffffffffu, ss[h], 1);
      ss[h] += __shfl_xor_sync(0xffffffffu, ss[h], 2);
      ss[h] = 1.f / fmaxf(sqrtf(ss[h]), 1e-12f);
    }
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) acc[4 * j + 2 * h + e] *= ss[h];
  }
  uint32_t a[8][4];
#pragma unroll
  for (int ks = 0; ks < 8; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) a[ks][r] = head_pack<T>(acc[8 * ks + 2 * r], acc[8 * ks + 2 * r + 1]);

  // 3. scores: S^T = D x Q^T (8 k steps over d_out).
  float sacc[32];
  wg_fence_acc<32>(sacc);
  wg_fence();
#pragma unroll
  for (int ks = 0; ks < 8; ++ks)
    cuda_fwd::WgMma<T>::n64(sacc, a[ks], wg_desc(q_s + (uint32_t)((ks >> 2) * kHeadNQ * 128 + (ks & 3) * 32)), ks);
  wg_commit();
  wg_wait<0>();
  wg_fence_acc<32>(sacc);

  // 4. per-document maxima of the block's 64 rows. Rows past the hidden rows
  // or masked out become -inf in registers, so the reduction reads no mask.
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (!row_ok[h])
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        sacc[4 * j + 2 * h] = neg_inf();
        sacc[4 * j + 2 * h + 1] = neg_inf();
      }
  named_bar(1 + wg, 128);  // the previous block's reduction has read s_t
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wq * 16 + g8 + 8 * h;
      *reinterpret_cast<float2*>(s_t + r * kHeadSStride + 8 * j + 2 * c4) =
          make_float2(sacc[4 * j + 2 * h], sacc[4 * j + 2 * h + 1]);
    }
  named_bar(1 + wg, 128);
  if (t0 >= p.T) return;  // warpgroup-uniform
  // Items: (document segment of the 64 rows, query token, row part). A
  // segment's rows split into `parts` ranges when there are fewer (segment,
  // token) pairs than threads (long documents): each part merges on its own.
  const int nv = p.T - t0 < 64 ? (int)(p.T - t0) : 64;
  const int64_t n_first = t0 / p.Ld;
  const int nseg = (int)((t0 + nv - 1) / p.Ld - n_first) + 1;
  const int pairs = nseg * p.nqv;
  const int parts = pairs >= 64 ? 1 : pairs >= 32 ? 2 : pairs >= 16 ? 4 : 8;
  const int items = pairs * parts;
  for (int it = tw; it < items; it += 128) {
    const int pair = it / parts, part = it - pair * parts;
    const int seg = pair / p.nqv, col = pair - seg * p.nqv;
    const int64_t n = n_first + seg;
    const int64_t lo = n * p.Ld - t0, hi = lo + p.Ld;
    const int r0 = lo > 0 ? (int)lo : 0;
    const int r1 = hi < nv ? (int)hi : nv;
    const int per = (r1 - r0 + parts - 1) / parts;
    const int q0 = r0 + part * per;
    const int q1 = q0 + per < r1 ? q0 + per : r1;
    float m[4] = {neg_inf(), neg_inf(), neg_inf(), neg_inf()};
    const float* sc = s_t + col;
    int r = q0;
    for (; r + 4 <= q1; r += 4)
#pragma unroll
      for (int u = 0; u < 4; ++u) m[u] = max_nan(m[u], sc[(r + u) * kHeadSStride]);
    for (; r < q1; ++r) m[0] = max_nan(m[0], sc[r * kHeadSStride]);
    const float mx = max_nan(max_nan(m[0], m[1]), max_nan(m[2], m[3]));
    if (mx != neg_inf()) atomicMax(p.maxbuf + n * p.nqv + col, head_key(mx));
  }
#endif  // MAXSIM_WG_DEVICE
}

template <typename T, int MT>
__global__ void __launch_bounds__(kHeadThreads, 1)
    head_fused_kernel(const __grid_constant__ CUtensorMap hmap, const __grid_constant__ CUtensorMap wmap,
                      const HeadParams p) {
#if MAXSIM_WG_DEVICE
  using cuda_fwd::mbar_arrive;
  using cuda_fwd::mbar_expect_tx;
  using cuda_fwd::mbar_init;
  using cuda_fwd::mbar_wait;
  using cuda_fwd::tma_load_2d;
  using cuda_fwd::wg_commit;
  using cuda_fwd::wg_desc;
  using cuda_fwd::wg_fence;
  using cuda_fwd::wg_fence_acc;
  using cuda_fwd::wg_wait;
  using C = HeadCfg<MT>;
  constexpr int ST = C::STAGES, BM = C::BM;

  // Static shared memory (its presence tells the host the sm_90a body is in
  // the build): barriers, bias.
  __shared__ __align__(8) uint64_t bars[2 * ST];
  __shared__ float bias_s[kHeadDout];
  extern __shared__ __align__(1024) unsigned char head_smem[];
  const uint32_t base = (cuda_fwd::smem_u32(head_smem) + 1023u) & ~1023u;
  unsigned char* const base_ptr = head_smem + (base - cuda_fwd::smem_u32(head_smem));
  const uint32_t ring = base;
  const uint32_t q_s = ring + ST * C::STAGE_BYTES;
  float* const s_all = reinterpret_cast<float*>(base_ptr + ST * C::STAGE_BYTES + kHeadQBytes);
  const uint32_t bar_full = cuda_fwd::smem_u32(bars);
  const uint32_t bar_empty = bar_full + 8u * ST;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < ST; ++s) {
      mbar_init(bar_full + 8u * s, 1);
      mbar_init(bar_empty + 8u * s, 2);  // one arrival per consumer warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  pdl_wait();  // before the first global access
  // Query tokens -> [2 k blocks][64 rows][128 B], 128B swizzle (rows past nqv zero).
  {
    const uint4* q = reinterpret_cast<const uint4*>(p.q);
    for (int x = tid; x < kHeadNQ * 16; x += kHeadThreads) {
      const int r = x >> 4, j = x & 15;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (r < p.nqv) v = q[(int64_t)r * 16 + j];
      *reinterpret_cast<uint4*>(base_ptr + ST * C::STAGE_BYTES + (j >> 3) * kHeadNQ * 128 + r * 128 +
                                (((j & 7) ^ (r & 7)) << 4)) = v;
    }
    if (tid < kHeadDout)
      bias_s[tid] = p.bias != nullptr ? to_f<T>(reinterpret_cast<const T*>(p.bias)[tid]) : 0.f;
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic writes -> wgmma operand reads
  __syncthreads();

  if (warp >= 8) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (warp != 8 || lane != 0) return;
    // ---- producer ----------------------------------------------------------
    uint32_t g = 0;
    for (int64_t tile = blockIdx.x; tile < p.ntiles; tile += gridDim.x) {
      const int y = (int)(tile * BM);
      for (int kb = 0; kb < p.nkb; ++kb, ++g) {
        const int s = (int)(g % ST);
        mbar_wait(bar_empty + 8u * s, ((g / ST) & 1u) ^ 1u);
        const uint32_t dst = ring + (uint32_t)(s * C::STAGE_BYTES);
        mbar_expect_tx(bar_full + 8u * s, (uint32_t)C::STAGE_BYTES);
        tma_load_2d(dst, &hmap, kb * 64, y, bar_full + 8u * s);
        tma_load_2d(dst + C::H_BYTES, &wmap, kb * 64, 0, bar_full + 8u * s);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  // ---- consumers -------------------------------------------------------------
  // Warpgroup wg owns the 64-row blocks 2 m + wg (m < MT) of each tile.
  const int wg = warp >> 2, wq = warp & 3, tw = tid & 127;
  const int g8 = lane >> 2, c4 = lane & 3;
  float* const s_t = s_all + wg * 64 * kHeadSStride;  // this warpgroup's S^T [64 rows][kHeadSStride]
  float acc[MT][64];
  uint32_t g = 0;
  for (int64_t tile = blockIdx.x; tile < p.ntiles; tile += gridDim.x) {
    // 1. projection: D = H rows x W^T over d_model, one chain per block.
    for (int kb = 0; kb < p.nkb; ++kb, ++g) {
      const int s = (int)(g % ST);
      mbar_wait(bar_full + 8u * s, (g / ST) & 1u);
      const uint32_t st = ring + (uint32_t)(s * C::STAGE_BYTES);
#pragma unroll
      for (int m = 0; m < MT; ++m) wg_fence_acc<64>(acc[m]);
      wg_fence();
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int k = 0; k < 4; ++k)
          cuda_fwd::WgMmaSs<T, 128>::run(acc[m], wg_desc(st + (uint32_t)((2 * m + wg) * 64 * 128) + 32u * k),
                                         wg_desc(st + (uint32_t)C::H_BYTES + 32u * k), (kb | k) != 0);
      wg_commit();
      if (kb > 0) {  // the previous k block's chains have retired: free its stage
        wg_wait<1>();
        if (tw == 0) mbar_arrive(bar_empty + 8u * ((g - 1) % ST));
      }
    }
    wg_wait<0>();
#pragma unroll
    for (int m = 0; m < MT; ++m) wg_fence_acc<64>(acc[m]);
    if (tw == 0) mbar_arrive(bar_empty + 8u * ((g - 1) % ST));
#pragma unroll
    for (int m = 0; m < MT; ++m)
      head_block<T>(p, acc[m], tile * BM + (2 * m + wg) * 64, bias_s, q_s, s_t, wg, wq, g8, c4, tw);
  }
#endif  // MAXSIM_WG_DEVICE
}

// scores [Nq, Nd] from the running maxima: query q's valid tokens' maxima
// summed in token order; a token without any valid document token adds 0.
__global__ void head_finalize_kernel(const uint32_t* __restrict__ maxbuf, const unsigned char* __restrict__ q_mask,
                                     float* __restrict__ scores, int64_t Nq, int64_t Nd, int Lq) {
  pdl_wait();
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= Nq * Nd) return;
  const int64_t q = i / Nd, n = i - q * Nd;
  const int nqv = (int)Nq * Lq;
  float sum = 0.f;
  for (int k = 0; k < Lq; ++k) {
    const int c = (int)q * Lq + k;
    if (q_mask != nullptr && !q_mask[c]) continue;
    const float v = head_unkey(maxbuf[n * nqv + c]);
    sum += v == neg_inf() ? 0.f : v;
  }
  scores[i] = sum;
}

}  // namespace head
}  // namespace maxsim
