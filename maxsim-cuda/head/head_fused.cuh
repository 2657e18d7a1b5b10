// Fused MaxSim through a projection head (sm_90a: wgmma + TMA), the forward
// of maxsim_from_hidden for inference:
//   score[q, n] = sum over valid query tokens i of max over valid document
//   tokens j of <Q[q, i], round(normalize(H[n, j] @ W^T + b))>
// with the projected token rounded to the 16-bit dtype before the dot
// product and fp32 accumulation everywhere, without writing the projected
// documents to global memory. Scope: fp16 / bf16, d_out == 128, d_model a
// multiple of 64, Nq * Lq <= kHeadMaxQ query tokens in all, scored in chunks
// of 64 (one wgmma N).
//
// Persistent kernel, one CTA per SM (384 threads), each CTA walking work
// items with a stride of gridDim.x. An item is a tile of BM = 128 MT rows
// (MT = kHeadMT) of the flat hidden rows
// [Nd * Ld, d_model] and a group of consecutive query chunks: with fewer
// tiles than SMs (few, short documents against many query tokens) a tile's
// chunks split over up to `qgroups` items on as many CTAs, each projecting
// the tile again (the tile is read from L2 then) -- otherwise most SMs idle.
//   * warp 8 (producer, one lane): per 64-column k block of a tile, one TMA of
//     the H tile [BM rows x 128 B] and one of the W tile [128 (d_out) rows x
//     128 B] (both 128B-swizzled, K-major; rows past Nd * Ld zero-filled) into
//     a HeadCfg::STAGES-deep ring guarded by full / empty mbarriers. W is read
//     again (from L2) for every tile: at 192 KB (d_model 768) it cannot stay
//     resident beside the ring. The query chunks [64 tokens x 128] (two
//     TMAs of [64 x 128 B], rows past Nq * Lq zero-filled) are loaded once
//     when they all fit the HeadCfg::QS chunk slots (resident), else streamed
//     through those slots, per item after its H / W k blocks, behind their
//     own full / empty mbarriers.
//   * warpgroups 0 and 1 (consumers): each owns MT of the tile's 64-row
//     blocks (2 m + wg, m < MT).
//     1. projection: per block a chain of d_model / 16 wgmma m64n128k16 (A =
//        H rows, B = W, both from shared memory) into D [64 x 128] fp32
//        registers (the chains of a k block are one commit group);
//     2. epilogue in registers, per block: + bias, the row's sum of squares
//        (a quad's 4 lanes hold one row: two shuffles), times
//        1 / max(|x|, 1e-12), rounded to T and repacked as wgmma A fragments
//        (the m64nNk16 accumulator layout of 16-bit values is the A-register
//        layout) into the first half of the block's accumulator registers;
//     then, per query chunk of the item:
//     3. scores: per block S^T [64 tokens x 64 query tokens] = D (A,
//        registers) x Qc^T (B: the chunk in shared memory), 8 wgmma
//        m64n64k16, one commit group per block (block 1's group runs while
//        block 0 is reduced);
//     4. S^T (rows past Nd * Ld or masked out: -inf) goes to a per-warpgroup
//        shared tile; the warpgroup's threads take (document segment of the 64
//        rows, query token[, part of the segment's rows]) items, reduce them
//        with a NaN-propagating max and merge each into the running maxima
//        maxbuf [Nd, Nq * Lq] with an atomic max on an order-preserving
//        integer encoding (documents straddle tiles and CTAs, query chunks
//        straddle items).
// head_finalize_kernel then sums each query's valid tokens' maxima (-inf,
// i.e. no valid document token, adds 0) into scores [Nq, Nd].
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include "../common/convert.cuh"
#include "../common/pdl.cuh"
#include "../forward_sm90a/forward_stream_wg.cuh"  // WgMmaSs (both operands from shared memory)
#include "../forward_sm90a/forward_wgmma.cuh"     // WgMma (RS), wg_desc, mbarrier / TMA helpers
#include "../common/normalize_jacobian.cuh"        // inv_norm

namespace maxsim {
namespace head {

using cuda_cvt::to_f;
using cuda_fwd::max_nan;
using cuda_fwd::neg_inf;

constexpr int kHeadThreads = 384;  // 2 consumer warpgroups + the producer's warpgroup
constexpr int kHeadDout = 128;     // projected width (wgmma N of the projection)
constexpr int kHeadNQ = 64;        // query tokens per chunk (wgmma N of the scores)
constexpr int kHeadMaxQ = 1024;    // query tokens in all (Nq * Lq): 16 chunks
constexpr int kHeadSStride = 72;   // floats per row of the S^T tile (64 + 8: fewer bank conflicts)
constexpr int kHeadQBytes = 2 * kHeadNQ * 128;          // one query chunk, 2 k blocks [64 rows x 128 B]
constexpr int kHeadSBytes = 2 * 64 * kHeadSStride * 4;  // S^T of both warpgroups (64 rows each)

// MT: 64-row blocks per consumer warpgroup and tile (tiles of BM = 128 MT
// hidden rows). Each tile reads all of W again (from L2): MT = 2 would halve
// that traffic (W is as many bytes as 128 rows of H) at the cost of a
// second accumulator tile per thread and a shallower ring, and times slower
// (kHeadMT = 1: the deeper ring hides more than the W reads cost). QS query chunk
// slots: at least two, so that the next chunk streams in while one is
// scored; the rest of the 227 KB goes to the H / W ring.
constexpr int kHeadMT = 1;

template <int MT>
struct HeadCfg {
  static constexpr int BM = 128 * MT;
  static constexpr int H_BYTES = BM * 128;               // H k block [BM rows x 128 B]
  static constexpr int STAGE_BYTES = H_BYTES + kHeadDout * 128;  // + W k block [128 rows x 128 B]
  static constexpr int STAGES = MT == 1 ? 4 : 3;         // k blocks in flight
  static constexpr int QS = MT == 1 ? 3 : 2;             // query chunk slots
  static constexpr int SMEM = STAGES * STAGE_BYTES + QS * kHeadQBytes + kHeadSBytes + 1024;  // + alignment
  static_assert(SMEM + 1024 <= 227 * 1024, "dynamic + static shared memory beyond a CTA's 227 KB");
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

// With the argmax, a running maximum is one 64-bit word: the key above, then
// ~token (the winner's index in its document), so that one atomic max keeps
// the largest key and, among equal keys, the lowest token.
__device__ __forceinline__ unsigned long long head_key_arg(uint32_t key, int token) {
  return ((unsigned long long)key << 32) | (uint32_t)~(uint32_t)token;
}

struct HeadParams {
  const void* bias;             // [128] or null
  const unsigned char* d_mask;  // [T] (flat [Nd, Ld]) or null
  void* maxbuf;                 // [Nd, nqv] running maxima: keys (uint32), or head_key_arg words
  int64_t T;                    // hidden rows, Nd * Ld
  int64_t nwork;                // work items, ceil(T / BM) * qgroups
  int Ld;                       // tokens per document (>= 1)
  int nqv;                      // query tokens, Nq * Lq (1 .. kHeadMaxQ)
  int nqc;                      // query chunks, ceil(nqv / 64)
  int qgroups;                  // items per tile: chunks [g * qcpg, (g + 1) * qcpg) of item g
  int qcpg;                     // query chunks per item
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

// A 64-row block of a consumer warpgroup: its first hidden row, and the
// documents its valid rows touch.
struct HeadBlock {
  int64_t t0;       // first hidden row
  int64_t n_first;  // document of row t0
  int off;          // t0's token index in that document
  int nv;           // rows below T (0 .. 64)
  int nseg;         // documents touched by those rows
};

__device__ __forceinline__ HeadBlock head_block_info(const HeadParams& p, int64_t t0) {
  HeadBlock b;
  b.t0 = t0;
  b.nv = t0 >= p.T ? 0 : p.T - t0 < 64 ? (int)(p.T - t0) : 64;
  b.n_first = t0 / p.Ld;
  b.off = (int)(t0 - b.n_first * p.Ld);
  b.nseg = b.nv > 0 ? (int)((t0 + b.nv - 1) / p.Ld - b.n_first) + 1 : 0;
  return b;
}

// Step 2 for one 64-row block: acc holds its projected rows (acc[4 j + 2 h
// + e]: row 16 wq + g8 + 8 h of the block, column 8 j + 2 c4 + e). On
// return acc[4 ks + r] (ks < 8, r < 4) holds the bits of the A fragment
// register r of k step ks; row_ok the validity of this thread's two rows.
template <typename T>
__device__ __forceinline__ void head_epilogue(const HeadParams& p, float* acc, int64_t t0, const float* bias_s,
                                              int wq, int g8, int c4, bool* row_ok) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t t = t0 + wq * 16 + g8 + 8 * h;
    row_ok[h] = t < p.T && (p.d_mask == nullptr || p.d_mask[t]);
  }
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
      ss[h] = inv_norm(ss[h]);
    }
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) acc[4 * j + 2 * h + e] *= ss[h];
  }
  // In place: register i is written after registers 2 i and 2 i + 1 are read.
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = __uint_as_float(head_pack<T>(acc[2 * i], acc[2 * i + 1]));
}

// Step 4 for one block (nv > 0) and query chunk c: sacc holds S^T [64 rows
// x 64 chunk tokens] (sacc[4 j + 2 h + e]: row 16 wq + g8 + 8 h, token
// 8 j + 2 c4 + e). ARG: the running maxima carry the winning token.
template <bool ARG>
__device__ __forceinline__ void head_reduce(const HeadParams& p, const HeadBlock& b, float* sacc, const bool* row_ok,
                                            int c, float* s_t, int wg, int wq, int g8, int c4, int tw) {
#if MAXSIM_WG_DEVICE
  using cuda_fwd::named_bar;
  // Rows past the hidden rows or masked out become -inf in registers, so the
  // reduction reads no mask.
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (!row_ok[h])
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        sacc[4 * j + 2 * h] = neg_inf();
        sacc[4 * j + 2 * h + 1] = neg_inf();
      }
  named_bar(1 + wg, 128);  // the previous reduction has read s_t
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wq * 16 + g8 + 8 * h;
      *reinterpret_cast<float2*>(s_t + r * kHeadSStride + 8 * j + 2 * c4) =
          make_float2(sacc[4 * j + 2 * h], sacc[4 * j + 2 * h + 1]);
    }
  named_bar(1 + wg, 128);
  // Items: (row part, document segment of the 64 rows, chunk token), the
  // token fastest (neighbouring threads read neighbouring words). A
  // segment's rows split into `parts` ranges when there are at most 64
  // (segment, token) pairs (long documents): each part merges on its own.
  const int ncol = p.nqv - c * kHeadNQ < kHeadNQ ? p.nqv - c * kHeadNQ : kHeadNQ;
  const int pairs = b.nseg * ncol;
  const int parts = pairs > 64 ? 1 : pairs > 32 ? 2 : pairs > 16 ? 4 : 8;
  const int items = pairs * parts;
  const int64_t mb = b.n_first * p.nqv + c * kHeadNQ;
  for (int it = tw; it < items; it += 128) {
    const int part = it / pairs, pair = it - part * pairs;
    const int seg = pair / ncol, col = pair - seg * ncol;
    const int64_t lo = (int64_t)seg * p.Ld - b.off, hi = lo + p.Ld;
    const int r0 = lo > 0 ? (int)lo : 0;
    const int r1 = hi < b.nv ? (int)hi : b.nv;
    const int per = (r1 - r0 + parts - 1) / parts;
    const int q0 = r0 + part * per;
    const int q1 = q0 + per < r1 ? q0 + per : r1;
    const float* sc = s_t + col;
    int r = q0;
    if constexpr (ARG) {
      // Keys in row order, a strictly larger key replacing: the lowest row
      // of the largest key (NaN the largest) per lane of 4, then merged.
      uint32_t k[4] = {0u, 0u, 0u, 0u};
      int at[4] = {0, 0, 0, 0};
      for (; r + 4 <= q1; r += 4)
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const uint32_t ku = head_key(sc[(r + u) * kHeadSStride]);
          if (ku > k[u]) k[u] = ku, at[u] = r + u;
        }
      for (; r < q1; ++r) {
        const uint32_t ku = head_key(sc[r * kHeadSStride]);
        if (ku > k[0]) k[0] = ku, at[0] = r;
      }
#pragma unroll
      for (int u = 1; u < 4; ++u)
        if (k[u] > k[0] || (k[u] == k[0] && at[u] < at[0])) k[0] = k[u], at[0] = at[u];
      if (k[0] > kHeadNegInfKey)
        atomicMax(static_cast<unsigned long long*>(p.maxbuf) + mb + (int64_t)seg * p.nqv + col,
                  head_key_arg(k[0], at[0] + b.off - seg * p.Ld));
    } else {
      float m[4] = {neg_inf(), neg_inf(), neg_inf(), neg_inf()};
      for (; r + 4 <= q1; r += 4)
#pragma unroll
        for (int u = 0; u < 4; ++u) m[u] = max_nan(m[u], sc[(r + u) * kHeadSStride]);
      for (; r < q1; ++r) m[0] = max_nan(m[0], sc[r * kHeadSStride]);
      const float mx = max_nan(max_nan(m[0], m[1]), max_nan(m[2], m[3]));
      if (mx != neg_inf()) atomicMax(static_cast<uint32_t*>(p.maxbuf) + mb + (int64_t)seg * p.nqv + col, head_key(mx));
    }
  }
#endif  // MAXSIM_WG_DEVICE
}

template <typename T, int MT, bool ARG>
__global__ void __launch_bounds__(kHeadThreads, 1)
    head_fused_kernel(const __grid_constant__ CUtensorMap hmap, const __grid_constant__ CUtensorMap wmap,
                      const __grid_constant__ CUtensorMap qmap, const HeadParams p) {
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
  constexpr int ST = C::STAGES, QS = C::QS, BM = C::BM;
  static_assert(MT == 1 || MT == 2, "one or two 64-row blocks per consumer warpgroup");

  // Static shared memory (its presence tells the host the sm_90a body is in
  // the build): barriers, bias.
  __shared__ __align__(8) uint64_t bars[2 * ST + 2 * QS];
  __shared__ float bias_s[kHeadDout];
  extern __shared__ __align__(1024) unsigned char head_smem[];
  const uint32_t base = (cuda_fwd::smem_u32(head_smem) + 1023u) & ~1023u;
  unsigned char* const base_ptr = head_smem + (base - cuda_fwd::smem_u32(head_smem));
  const uint32_t ring = base;
  const uint32_t q_s = ring + ST * C::STAGE_BYTES;  // QS chunk slots
  float* const s_all = reinterpret_cast<float*>(base_ptr + ST * C::STAGE_BYTES + QS * kHeadQBytes);
  const uint32_t bar_full = cuda_fwd::smem_u32(bars);
  const uint32_t bar_empty = bar_full + 8u * ST;
  const uint32_t bar_qfull = bar_empty + 8u * ST;
  const uint32_t bar_qempty = bar_qfull + 8u * QS;
  // All chunks fit their slots: chunk c stays in slot c, loaded once.
  const bool resident = p.nqc <= QS;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < ST; ++s) {
      mbar_init(bar_full + 8u * s, 1);
      mbar_init(bar_empty + 8u * s, 2);  // one arrival per consumer warpgroup
    }
    for (int s = 0; s < QS; ++s) {
      mbar_init(bar_qfull + 8u * s, 1);
      mbar_init(bar_qempty + 8u * s, 2);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  pdl_wait();  // before the first global access
  if (tid < kHeadDout) bias_s[tid] = p.bias != nullptr ? to_f<T>(reinterpret_cast<const T*>(p.bias)[tid]) : 0.f;
  __syncthreads();

  if (warp >= 8) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (warp != 8 || lane != 0) return;
    // ---- producer ----------------------------------------------------------
    // Query chunk c -> [2 k blocks][64 rows][128 B], 128B swizzle.
    const auto load_chunk = [&](int slot, int c) {
      const uint32_t dst = q_s + (uint32_t)(slot * kHeadQBytes), bar = bar_qfull + 8u * slot;
      mbar_expect_tx(bar, (uint32_t)kHeadQBytes);
      tma_load_2d(dst, &qmap, 0, c * kHeadNQ, bar);
      tma_load_2d(dst + kHeadQBytes / 2, &qmap, 64, c * kHeadNQ, bar);
    };
    if (resident)
      for (int c = 0; c < p.nqc; ++c) load_chunk(c, c);
    uint32_t g = 0, qg = 0;
    for (int64_t w = blockIdx.x; w < p.nwork; w += gridDim.x) {
      const int64_t tile = w / p.qgroups;
      const int y = (int)(tile * BM);
      for (int kb = 0; kb < p.nkb; ++kb, ++g) {
        const int s = (int)(g % ST);
        mbar_wait(bar_empty + 8u * s, ((g / ST) & 1u) ^ 1u);
        const uint32_t dst = ring + (uint32_t)(s * C::STAGE_BYTES);
        mbar_expect_tx(bar_full + 8u * s, (uint32_t)C::STAGE_BYTES);
        tma_load_2d(dst, &hmap, kb * 64, y, bar_full + 8u * s);
        tma_load_2d(dst + C::H_BYTES, &wmap, kb * 64, 0, bar_full + 8u * s);
      }
      if (!resident) {  // the item's chunks, in the order the consumers take them
        const int c0 = (int)(w - tile * p.qgroups) * p.qcpg;
        const int c1 = c0 + p.qcpg < p.nqc ? c0 + p.qcpg : p.nqc;
        for (int c = c0; c < c1; ++c, ++qg) {
          const int s = (int)(qg % QS);
          mbar_wait(bar_qempty + 8u * s, ((qg / QS) & 1u) ^ 1u);
          load_chunk(s, c);
        }
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
  uint32_t g = 0, qg = 0;
  for (int64_t w = blockIdx.x; w < p.nwork; w += gridDim.x) {
    const int64_t tile = w / p.qgroups;
    // 1. projection: D = H rows x W^T over d_model, one chain per block. The
    // zero fill ends the live range of the previous item's A fragments (the
    // first wgmma of a chain does not read its accumulator).
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[m][i] = 0.f;
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

    // 2. epilogue, block by block.
    HeadBlock blk[MT];
    bool row_ok[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      blk[m] = head_block_info(p, tile * BM + (2 * m + wg) * 64);
      head_epilogue<T>(p, acc[m], blk[m].t0, bias_s, wq, g8, c4, row_ok[m]);
    }

    // 3-4. the item's query chunks. Blocks past the hidden rows (the last
    // tile) are scored too (a wgmma under a branch serialises every wgmma of
    // the kernel) but not reduced.
    const int c0 = (int)(w - tile * p.qgroups) * p.qcpg;
    const int c1 = c0 + p.qcpg < p.nqc ? c0 + p.qcpg : p.nqc;
    for (int c = c0; c < c1; ++c) {
      const int s = resident ? c : (int)(qg % QS);
      mbar_wait(bar_qfull + 8u * s, resident ? 0u : (qg / QS) & 1u);
      const uint32_t qb = q_s + (uint32_t)(s * kHeadQBytes);
      float sacc[MT][32];
#pragma unroll
      for (int m = 0; m < MT; ++m) wg_fence_acc<32>(sacc[m]);
      wg_fence();
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
          const uint32_t a[4] = {__float_as_uint(acc[m][4 * ks]), __float_as_uint(acc[m][4 * ks + 1]),
                                 __float_as_uint(acc[m][4 * ks + 2]), __float_as_uint(acc[m][4 * ks + 3])};
          cuda_fwd::WgMma<T>::n64(sacc[m], a, wg_desc(qb + (uint32_t)((ks >> 2) * (kHeadQBytes / 2) + (ks & 3) * 32)),
                                  ks);
        }
        wg_commit();
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m + 1 < MT)
          wg_wait<1>();  // block m's group (MT == 2: block 1's still runs)
        else
          wg_wait<0>();
        wg_fence_acc<32>(sacc[m]);
        if (blk[m].nv > 0) head_reduce<ARG>(p, blk[m], sacc[m], row_ok[m], c, s_t, wg, wq, g8, c4, tw);
      }
      // The chunk's groups have retired (as for the H / W ring): free its slot.
      if (!resident) {
        if (tw == 0) mbar_arrive(bar_qempty + 8u * s);
        ++qg;
      }
    }
  }
#endif  // MAXSIM_WG_DEVICE
}

// scores [Nq, Nd] from the running maxima: query q's valid tokens' maxima
// summed in a fixed order; a token without any valid document token adds 0.
// ARG: also argmax [Nq, Nd, Lq] int32, the winning token (-1: a masked query
// token or no valid document token).
template <bool ARG>
__global__ void head_finalize_kernel(const void* __restrict__ maxbuf, const unsigned char* __restrict__ q_mask,
                                     float* __restrict__ scores, int* __restrict__ argmax, int64_t Nq, int64_t Nd,
                                     int Lq) {
  pdl_wait();
  // One warp per (query, document) pair, lanes over its query tokens (a
  // coalesced run of maxbuf): a thread a pair left most of the GPU idle.
  const int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (i >= Nq * Nd) return;
  const int64_t q = i / Nd, n = i - q * Nd;
  const int64_t row = n * Nq * Lq + q * Lq;
  float sum = 0.f;
  for (int k = lane; k < Lq; k += 32) {
    const bool valid = q_mask == nullptr || q_mask[q * Lq + k];
    uint32_t key;
    if constexpr (ARG) {
      const unsigned long long w = static_cast<const unsigned long long*>(maxbuf)[row + k];
      key = (uint32_t)(w >> 32);
      argmax[i * Lq + k] = valid && key > kHeadNegInfKey ? (int)~(uint32_t)w : -1;
    } else {
      key = static_cast<const uint32_t*>(maxbuf)[row + k];
    }
    if (!valid) continue;
    const float v = head_unkey(key);
    sum += v == neg_inf() ? 0.f : v;
  }
  sum = cuda_fwd::warp_sum(sum);
  if (lane == 0) scores[i] = sum;
}

}  // namespace head
}  // namespace maxsim
