// Shared pieces of the CPU backend: portable vector types, dtype conversion,
// the register-blocked MaxSim micro-kernel and a small work scheduler.
//
// Kernel orientation: query rows live in the vector lanes (a query block of
// up to 2*W rows is packed once, transposed as [dim][lanes]) and document
// values are broadcast. The running max then stays a per-lane vector (no
// horizontal reductions in the hot loop), documents need no transposition
// (fp32 documents are read in place), and the packed query is reused across
// every document of its pairs.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace maxsim {
namespace cpu {

#if defined(__AVX512F__)
constexpr int W = 16;    // fp32 lanes per vector
constexpr int RMAX = 12; // doc tokens per micro-tile: 2x12 accumulators of 32
#elif defined(__x86_64__) && !defined(__AVX__)
constexpr int W = 4;     // baseline SSE: 2x6 accumulators fit 16 xmm registers
constexpr int RMAX = 6;
#else
constexpr int W = 8;     // AVX2 / NEON (a 32-byte vector is two NEON registers)
constexpr int RMAX = 6;  // 2x6 accumulators fit 16 ymm (or 32 NEON) registers
#endif
constexpr int QW = 2 * W;  // query rows per packed block

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

inline vf select(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
inline vi select(vi m, vi a, vi b) { return (a & m) | (b & ~m); }

// ---------------------------------------------------------------- dtypes --
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) { return bits_f32(uint32_t(x.x) << 16); }
// Branch-free IEEE half -> float (exact, subnormals included, independent of
// the FTZ/DAZ mode) so that conversion loops vectorise on every target.
inline float to_f32(c10::Half x) {
  const uint32_t w = uint32_t(x.x) << 16, sign = w & 0x80000000u, two_w = w + w;
  const float norm = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denorm = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  return bits_f32(sign | (two_w < (1u << 27) ? f32_bits(denorm) : f32_bits(norm)));
}

template <class T> inline T from_f32(float x) { return static_cast<T>(x); }

template <class T>
inline void row_to_f32(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t k = 0; k < n; ++k) dst[k] = to_f32(src[k]);
}

// ------------------------------------------------------------ normalize --
// The `normalize` flag (torch_binding.h): rows scaled by 1 / max(|x|, eps)
// as they are converted to fp32, so no normalised copy is ever written.
inline double to_f64(double x) { return x; }
template <class T> inline double to_f64(T x) { return double(to_f32(x)); }

template <class T>
inline double row_norm(const T* __restrict x, int64_t dim) {
  double ss = 0;
  for (int64_t k = 0; k < dim; ++k) ss += to_f64(x[k]) * to_f64(x[k]);
  return std::sqrt(ss);
}

// 1 / max(|x_r|, eps) for rows [0, n), or empty when `on` is false.
template <class S, class T>
std::vector<S> inv_row_norms(bool on, const T* x, int64_t n, int64_t dim, double eps) {
  std::vector<S> inv(on ? n : 0);
  if (on)
    at::parallel_for(0, n, 256, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) inv[r] = S(1.0 / std::max(row_norm(x + r * dim, dim), eps));
    });
  return inv;
}

// In place on the fp32 row sum g = dL/dx^ of row x: dL/dx = (g - x^ <x^, g>) / |x|
// (g / eps under the clamp).
template <class T>
inline void normalize_grad_row(float* __restrict g, const T* __restrict x, int64_t dim, double eps) {
  const double nrm = row_norm(x, dim), inv = 1.0 / std::max(nrm, eps);
  double c = 0;
  if (nrm >= eps)
    for (int64_t k = 0; k < dim; ++k) c += to_f64(x[k]) * inv * double(g[k]);
  for (int64_t k = 0; k < dim; ++k) g[k] = float(inv * (double(g[k]) - to_f64(x[k]) * inv * c));
}

// ------------------------------------------------------------- segments --
constexpr int64_t kNoWidth = std::numeric_limits<int64_t>::max();

// Rows of segment i the contract reads (at most `width`), or -1 if the segment
// is invalid. Rows outside the tensor count as invalid rather than being read.
inline int64_t seg_rows(const int32_t* start, const int32_t* len, int64_t i, int64_t width,
                        int64_t total) {
  const int64_t l = len[i];
  if (l < 0) return -1;
  const int64_t n = std::min(l, width);
  if (n > 0 && (start[i] < 0 || start[i] + n > total)) return -1;
  return n;
}

// 64-byte aligned growable scratch; contents are not preserved on growth.
struct Scratch {
  std::vector<float> v;
  float* get(size_t n) {
    if (v.size() < n + 16) v.assign(n + 16, 0.f);
    auto a = (reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63);
    return reinterpret_cast<float*>(a);
  }
};

// ---------------------------------------------------------- micro-kernel --
// Running (max, argmax) of up to 2*W query rows, one lane per row.
struct RowState {
  vf cur[2];
  vi arg[2];
  void reset() {
    for (int v = 0; v < 2; ++v) {
      cur[v] = (vf){} - __builtin_inff();
      arg[v] = (vi){} - 1;
    }
  }
};

// qp: packed query block [dim][NV*W]; d: R fp32 doc rows of stride ldd;
// jmap: token index (within the document) of each of the R rows, ascending.
// pf, npf: npf 64-byte lines of memory read soon, prefetched here: a document
// is usually read once, from DRAM, and the hardware prefetcher follows R
// strided streams poorly. Any address is fine: prefetches never fault.
// Folds sims into s with torch.max semantics: the first NaN wins and sticks,
// otherwise strictly greater wins, so ties keep the lowest token index.
template <int NV, int R>
void maxsim_tile(const float* __restrict qp, const float* __restrict d, int64_t ldd,
                 int64_t dim, const int32_t* __restrict jmap, uintptr_t pf, int64_t npf,
                 RowState& s) {
  vf acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = (vf){};
  const float* dr[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) dr[r] = d + r * ldd;
  for (int64_t k = 0; k < dim; ++k) {
    if (k < npf) __builtin_prefetch(reinterpret_cast<const void*>(pf + 64 * k));
    vf qv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) qv[v] = *reinterpret_cast<const vf*>(qp + (k * NV + v) * W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float b = dr[r][k];
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] += b * qv[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const vi j = (vi){} + jmap[r];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const vi take = ~(acc[r][v] <= s.cur[v]) & (s.cur[v] == s.cur[v]);
      s.cur[v] = select(take, acc[r][v], s.cur[v]);
      s.arg[v] = select(take, j, s.arg[v]);
    }
  }
}

using TileFn = void (*)(const float*, const float*, int64_t, int64_t, const int32_t*,
                        uintptr_t, int64_t, RowState&);

template <int NV, int... Rs>
constexpr std::array<TileFn, sizeof...(Rs)> tile_table(std::integer_sequence<int, Rs...>) {
  return {{&maxsim_tile<NV, Rs + 1>...}};
}

// kTiles[nv - 1][r - 1]: kernel for nv vectors of query rows and r doc rows.
inline const std::array<TileFn, RMAX> kTiles[2] = {
    tile_table<1>(std::make_integer_sequence<int, RMAX>{}),
    tile_table<2>(std::make_integer_sequence<int, RMAX>{})};

// ------------------------------------------------------------- scheduler --
// Runs body(next) once per thread of torch's intra-op pool; next(b, e) hands
// out contiguous batches of [0, n) dynamically and returns false when none is
// left. Work items (pairs, rows) differ in cost, and a thread keeps its
// scratch and packed query across the batches it takes. Results never depend
// on which thread ran an item.
template <class F>
void parallel_items(int64_t n, int64_t batch, const F& body) {
  if (n <= 0) return;
  batch = std::max<int64_t>(batch, 1);
  std::atomic<int64_t> next{0};
  auto grab = [&](int64_t& b, int64_t& e) {
    b = next.fetch_add(batch, std::memory_order_relaxed);
    e = std::min(n, b + batch);
    return b < n;
  };
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), (n + batch - 1) / batch);
  if (nt <= 1 || at::in_parallel_region()) {
    body(grab);
    return;
  }
  at::parallel_for(0, nt, 1, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) body(grab);
  });
}

}  // namespace cpu
}  // namespace maxsim
