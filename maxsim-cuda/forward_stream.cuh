// Register-streaming forward for one short query against many documents
// (lq <= 32, rows of 64 / 128 / 192 / 256 bytes: fp16 / bf16 dim 32-128, or
// int8 / fp8 e4m3 tokens with per-token scales, dim 64-256; no argmax, no
// `normalize`; forward.cu selects it): memory-bound reranking and corpus
// scans (search over an 8-bit corpus included), where the
// tile kernel's shared-memory staging, ldmatrix and barriers only add latency
// between DRAM and the tensor cores. Any layout works; the host takes it for
// CROSS with one query only (measured, see forward.cu).
//
// One warp per pair, no shared memory. The query's A fragments stay in
// registers; document tokens are loaded straight into B fragments, 8 tokens
// (one m16n8k16 n tile) per step, U steps in flight. The trick that makes
// the loads coalesced 16-byte vectors: a dot product does not care about
// the order of k, so lane (g, c) (g = lane / 4, c = lane % 4) loads the
// contiguous dims [c * dim / 4, (c + 1) * dim / 4) of token g of the step,
// and k step s uses its words 2s and 2s + 1 as {b0b1, b2b3}. The query rows'
// A fragments are built from the same dims in the same order (row g and
// g + 8: words 2s -> {a0a1, a2a3}, 2s + 1 -> {a4a5, a6a7}), so every product
// pairs the same dim of query and document. fp32 accumulation as elsewhere;
// row maxima in registers, reduced over the quad and summed over rows with
// the same masking rules and row-sum order as finish_tile (common.cuh).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include "common.cuh"

namespace maxsim {
namespace cuda_fwd {

constexpr int kStreamWarps = 4;  // warps (pairs) per CTA
// n tiles (8 tokens each) in flight per warp: 8 KB of 16-bit tokens at dim
// 128; 8-bit rows of <= 128 bytes keep twice the tiles (same bytes, and the
// registers of wider 8-bit rows would spill).
template <typename T, int KS>
constexpr int kStreamU = kIsQuant<T> && KS <= 4 ? 8 : 4;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define MAXSIM_STREAM_DEVICE 0
#else
#define MAXSIM_STREAM_DEVICE 1
#endif

__device__ __forceinline__ uint32_t u4_word(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// The low two e4m3 of a word as f16x2 (exact).
__device__ __forceinline__ uint32_t f8x2_to_h2(uint32_t w) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), __NV_E4M3);
  return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

// KS: k steps (row bytes / 32); MT: m tiles of 16 query rows (lq <= 16 * MT).
template <typename T, int KS, int MT>
__global__ void __launch_bounds__(kStreamWarps * 32) stream_fwd_kernel(const FwdParams p) {
#if MAXSIM_STREAM_DEVICE
  constexpr bool SC = kIsQuant<T>;
  constexpr int U = kStreamU<T, KS>;
  constexpr int W = KS / 2;  // 16-byte vectors per lane per row
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int64_t pr = (int64_t)blockIdx.x * kStreamWarps + (threadIdx.x >> 5);
  if (pr >= p.P) return;  // warp-uniform
  int64_t n, dn;
  pair_ids(p, pr, n, dn);
  int qs, ql, ds, dl;
  const bool qok = query_ok(p, n, qs, ql);
  const bool ok = doc_ok(p, dn, ds, dl) && qok;
  const int64_t rb = p.row_bytes;
  const int lane_off = c * W * 16;

  uint32_t a[MT][KS][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = mt * 16 + h * 8 + g;
      uint4 seg[W];
#pragma unroll
      for (int w = 0; w < W; ++w) seg[w] = make_uint4(0, 0, 0, 0);
      if (ok && i < ql) {
        const uint4* src = reinterpret_cast<const uint4*>(p.q + ((int64_t)qs + i) * rb + lane_off);
#pragma unroll
        for (int w = 0; w < W; ++w) seg[w] = __ldg(src + w);
      }
#pragma unroll
      for (int s = 0; s < KS; ++s) {
        a[mt][s][h] = u4_word(seg[s / 2], 2 * (s % 2));
        a[mt][s][2 + h] = u4_word(seg[s / 2], 2 * (s % 2) + 1);
      }
    }

  // fp8: Hopper's fp8 mma.sync issues below the f16 rate (measured: the fp8
  // scan 1.35x the int8 one); every e4m3 value is exact in f16, so each word
  // of 4 e4m3 becomes one f16 k16 step (bytes 0-1 -> k 2c, 2c + 1; bytes 2-3
  // -> k 2c + 8, 2c + 9, the same for query rows and document tokens).
  constexpr bool kF8 = std::is_same<T, __nv_fp8_e4m3>::value;
  uint32_t ah[kF8 ? MT : 1][kF8 ? KS : 1][2][4];
  if constexpr (kF8) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int s = 0; s < KS; ++s)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t r0 = a[mt][s][2 * h], r1 = a[mt][s][2 * h + 1];  // rows g, g + 8
          ah[mt][s][h][0] = f8x2_to_h2(r0);
          ah[mt][s][h][1] = f8x2_to_h2(r1);
          ah[mt][s][h][2] = f8x2_to_h2(r0 >> 16);
          ah[mt][s][h][3] = f8x2_to_h2(r1 >> 16);
        }
  }

  float best[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) best[mt][0] = best[mt][1] = neg_inf();
  const int ntile = ok ? (dl + 7) / 8 : 0;
  const char* dbase = p.d + (int64_t)ds * rb + lane_off;
  uint4 buf[U][W];
  float2 dsc[SC ? U : 1];  // doc-token scales of columns 2c, 2c + 1 (8-bit)
  auto fetch = [&](int t, int u) {
    const int j = t * 8 + g;
    if (t < ntile && j < dl) {
      const uint4* src = reinterpret_cast<const uint4*>(dbase + (int64_t)j * rb);
#pragma unroll
      for (int w = 0; w < W; ++w) buf[u][w] = __ldcs(src + w);  // streamed once: evict first
    } else {
#pragma unroll
      for (int w = 0; w < W; ++w) buf[u][w] = make_uint4(0, 0, 0, 0);
    }
    if constexpr (SC) {
      // Columns past the document are masked below; their scale is never used.
      const int j0 = t * 8 + 2 * c;
      const float* sp = p.d_scale + ds + j0;
      dsc[u].x = t < ntile && j0 < dl ? __ldcs(sp) : 0.f;
      dsc[u].y = t < ntile && j0 + 1 < dl ? __ldcs(sp + 1) : 0.f;
    }
  };
#pragma unroll
  for (int u = 0; u < U; ++u) fetch(u, u);
  for (int t0 = 0; t0 < ntile; t0 += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u;
      if (t < ntile) {
        float acc[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
#pragma unroll
        for (int s = 0; s < KS; ++s) {
          const uint32_t b[2] = {u4_word(buf[u][s / 2], 2 * (s % 2)), u4_word(buf[u][s / 2], 2 * (s % 2) + 1)};
          if constexpr (kF8) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint32_t bh[2] = {f8x2_to_h2(b[h]), f8x2_to_h2(b[h] >> 16)};
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) Mma<__half>::run(acc[mt], ah[mt][s][h], bh);
            }
          } else {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) Mma<T>::run(acc[mt], a[mt][s], b);
          }
        }
        if constexpr (SC) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][e] = Mma<T>::value(acc[mt][e]) * (e & 1 ? dsc[u].y : dsc[u].x);
        }
        // Columns 2c, 2c + 1 of the tile: -inf past the document or masked.
        const int j0 = t * 8 + 2 * c;
        bool v0 = j0 < dl, v1 = j0 + 1 < dl;
        if (p.d_mask != nullptr) {
          v0 = v0 && p.d_mask[(int64_t)ds + j0];
          v1 = v1 && p.d_mask[(int64_t)ds + j0 + 1];
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            best[mt][h] = max_nan(best[mt][h],
                                  max_nan(v0 ? acc[mt][2 * h] : neg_inf(), v1 ? acc[mt][2 * h + 1] : neg_inf()));
      }
      fetch(t + U, u);
    }
  }
  // Row r = 16 mt + 8 h + g: max over the quad, then to lane r.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      best[mt][h] = max_nan(best[mt][h], __shfl_xor_sync(0xffffffffu, best[mt][h], 1));
      best[mt][h] = max_nan(best[mt][h], __shfl_xor_sync(0xffffffffu, best[mt][h], 2));
    }
  float v = neg_inf();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float x = __shfl_sync(0xffffffffu, best[mt][h], 4 * (lane & 7));
      if ((lane >> 3) == 2 * mt + h) v = x;
    }
  bool use = ok && lane < ql && v != neg_inf();
  if (use && p.q_mask != nullptr) use = p.q_mask[(int64_t)qs + lane];
  if (SC && use) v *= p.q_scale[(int64_t)qs + lane];
  const float sum = warp_sum(use ? v : 0.f);
  if (lane == 0) p.scores[pr] = ok ? sum : __int_as_float(0x7fc00000);
#endif
}

// Whether the streaming kernel takes this forward (host side). `normalize`d
// float tokens stay on the tile kernel (it derives the documents' norms from
// its fragments); fp8 needs sm_89+.
inline bool stream_shape_ok(at::ScalarType t, int64_t lq, bool arg, bool normalize, int sm, const FwdParams& p) {
  const bool b16 = t == at::kHalf || t == at::kBFloat16;
  const bool b8 = t == at::kChar || (t == at::kFloat8_e4m3fn && sm >= 89);
  if (!(b16 || b8) || arg || normalize || lq < 1 || lq > 32) return false;
  const int64_t rb = p.row_bytes;
  if (rb != 64 && rb != 128 && rb != 192 && rb != 256) return false;
  if (b8 && (p.q_scale == nullptr || p.d_scale == nullptr)) return false;
  return reinterpret_cast<uintptr_t>(p.q) % 16 == 0 && reinterpret_cast<uintptr_t>(p.d) % 16 == 0;
}

// Defined for __half / __nv_bfloat16 / int8_t / __nv_fp8_e4m3 in
// forward_stream.cu (run_stream_impl).
template <typename T>
void run_stream(const FwdParams& p, cudaStream_t st);

template <typename T, int KS>
void launch_stream(const FwdParams& p, cudaStream_t st) {
  const unsigned blocks = (unsigned)((p.P + kStreamWarps - 1) / kStreamWarps);
  if (p.lq <= 16)
    stream_fwd_kernel<T, KS, 1><<<blocks, kStreamWarps * 32, 0, st>>>(p);
  else
    stream_fwd_kernel<T, KS, 2><<<blocks, kStreamWarps * 32, 0, st>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void run_stream_impl(const FwdParams& p, cudaStream_t st) {
  switch (p.row_bytes) {
    case 64: launch_stream<T, 2>(p, st); break;
    case 128: launch_stream<T, 4>(p, st); break;
    case 192: launch_stream<T, 6>(p, st); break;
    case 256: launch_stream<T, 8>(p, st); break;
    default: TORCH_CHECK(false, "maxsim: streaming kernel: rows of ", p.row_bytes, " bytes not supported");
  }
}

}  // namespace cuda_fwd
}  // namespace maxsim
