// CUDA backward kernels of maxsim (contract: torch-ext/torch_binding.h).
//
// Deterministic and atomic-free: every output row has exactly one owner (a
// lane group of one CTA) that sums its contributions in a fixed order, and
// every row of dq / dd is written exactly once per call (so the outputs need
// no memset), as long as the segments of each side are sorted by start and
// the valid ones do not overlap (what every Python lowering produces):
//   * rows of a valid segment are written by the segment's owner (zero when
//     no pair selects them);
//   * the "gap" after segment n, [start_n + rows_n, start_{n+1}) (to the end
//     of the tensor for the last one, plus [0, start_0) for segment 0), is
//     zeroed by the CTAs of segment n. These tile the tensor.
//
// dq_kernel (a gather): CTA = (query n, block of BR query rows, dim chunk).
//   Lane group (slice s, row r) accumulates, in fp32 registers,
//   grad[p] * d[doc(p) row argmax[p, i]] over its slice of the query's pairs
//   in pair order; slices are then summed in slice order through shared
//   memory. Per chunk of PC pairs the CTA stages the pair info (doc row base,
//   doc rows, grad) and the winners' document rows [PC, BR] in shared
//   memory; document rows are loaded with 16-byte vectors through a ring of
//   kRing loads in flight per lane (kRingBesideOnePair in the fused one-pair kernel).
// dd_kernel (a scatter turned into a destination-owned reduction): CTA =
//   (document j, row part c of C, dim chunk). The document's rows are done in
//   passes of R rows (rows [R*(c + C*t), +R) in pass t) accumulated in an
//   fp32 shared tile. The entries (pair k of the document, query token i),
//   in that order, are scanned in chunks of kChunk; those whose argmax falls
//   in the pass go, in entry order, to the queue of the lane group owning
//   that tile row (row % NG) (an ordered compaction: __match_any_sync ranks
//   within a warp, per-warp counters, owner-major prefix). Each group then
//   drains its queue: loads the query row (16-byte vectors, kRingDD in
//   flight) and adds grad * q into its own tile rows, two queue items at a
//   time (smem_fma2). A tile row is only ever touched by its owner group, in
//   entry order: no races, fixed summation order.
//
// normalize (torch_binding.h): p.q_scale / p.d_scale hold the inverse row
// norms; each gathered row's contribution carries its row's scale (dq: the
// document row's, loaded with the row; dd: the query row's, staged with the
// grad). When one lane group holds a whole row (one dim chunk) the kernels
// apply the normalisation's Jacobian to the row's fp32 sums themselves
// (O = Jacobian<T>, see jacobian_row); otherwise they write the fp32 row
// sums (O = float) for the Jacobian pass in normalize_rows.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../common/convert.cuh"
#include "../common/pdl.cuh"
#include "../common/normalize_jacobian.cuh"

namespace maxsim {
namespace cuda_bwd {

constexpr int kThreads = 256;               // both kernels
constexpr int kWarps = kThreads / 32;
constexpr int kEpt = 8;                     // dd: entries per lane per chunk
constexpr int kChunk = kThreads * kEpt;     // dd: entries per chunk
constexpr int kRing = 8;                    // dq: row loads in flight per lane
// dq beside the one-pair dd (dqdd_one_pair_kernel): 4 in flight keep it in
// 64 registers, so 4 CTAs fit an SM (8 spill at that bound).
constexpr int kRingBesideOnePair = 4;
constexpr int kOnePairCtasPerSm = 4;       // dqdd_one_pair_kernel's launch bound
constexpr int kRingDD = 8;                  // dd: the same (12 is slower)
constexpr int kAmRound = 8;                 // dq staging: argmax loads in flight per thread
constexpr int kCrossL = 0, kGroupedL = 1, kListL = 2;
constexpr int64_t kNoWidth = INT64_MAX;

struct BwdParams {
  const float* grad;  // [P]
  const void* q;      // [Tq, dim]
  const void* d;      // [Td, dim]
  const int* q_start;
  const int* q_len;
  const int* d_start;
  const int* d_len;
  const int* pair_q;  // LIST only
  const int* pair_d;
  const void* argmax;  // [P, lq] int32 / int16
  const float* q_scale;  // normalize: [Tq] inverse row norms (dd), else null
  const float* d_scale;  // normalize: [Td] inverse row norms (dq), else null
  const int* q_ptr;    // LIST, dq only: [Nq + 1]
  const int* q_pairs;  // [P]
  const int* d_ptr;    // LIST, dd only: [Nd + 1]
  const int* d_pairs;  // [P]
  void* dq;            // [Tq, dim] (input dtype; fp32 under normalize)
  void* dd;            // [Td, dim]
  int64_t Tq, Td, dim, Nq, Nd, P, K;
  int lq, layout;
  int nvec;  // vectors per row (dim / VEC)
  int vec;   // VEC (elements per vector; host planning only)
  int lgG;   // lane group = 1 << lgG lanes (8, 16 or 32), one vector each
  int H;     // dim chunks (of G vectors)
  // dq
  int lgBR;  // query rows per CTA = 1 << lgBR
  int NB;    // row blocks per query
  int S;     // pair slices per row (groups / BR)
  int PC;    // pairs staged per chunk
  // dd
  int R;  // rows of the shared tile (rows per pass)
  int C;  // row parts per document
};

// ---------------------------------------------------------------------------
// 16-byte vectors (VEC elements) or scalars (VEC == 1).
// ---------------------------------------------------------------------------
using cuda_cvt::from_f;
using cuda_cvt::to_f;

// Two 16-bit values packed in a 32-bit word (element 0 in the low half).
template <class T>
__device__ __forceinline__ void unpack2(uint32_t w, float& a, float& b);
template <>
__device__ __forceinline__ void unpack2<__half>(uint32_t w, float& a, float& b) {
  a = __half2float(__ushort_as_half((unsigned short)(w & 0xffffu)));
  b = __half2float(__ushort_as_half((unsigned short)(w >> 16)));
}
template <>
__device__ __forceinline__ void unpack2<__nv_bfloat16>(uint32_t w, float& a, float& b) {
  a = __uint_as_float(w << 16);
  b = __uint_as_float(w & 0xffff0000u);
}
template <class T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  return (uint32_t)__half_as_ushort(__float2half_rn(a)) | ((uint32_t)__half_as_ushort(__float2half_rn(b)) << 16);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(a)) |
         ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(b)) << 16);
}

template <class T, int VEC>
struct Vec;

template <>
struct Vec<float, 4> {
  using raw_t = uint4;
  static __device__ __forceinline__ raw_t zero() { return make_uint4(0u, 0u, 0u, 0u); }
  static __device__ __forceinline__ raw_t load(const float* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
  static __device__ __forceinline__ void store(float* p, raw_t v) { *reinterpret_cast<uint4*>(p) = v; }
  static __device__ __forceinline__ void store_evict_first(float* p, raw_t v) { __stcs(reinterpret_cast<uint4*>(p), v); }
  static __device__ __forceinline__ void unpack(raw_t v, float (&f)[4]) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  static __device__ __forceinline__ raw_t pack(const float (&f)[4]) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
};

template <class T>
struct Vec16x8 {  // 8 x 16-bit
  using raw_t = uint4;
  static __device__ __forceinline__ raw_t zero() { return make_uint4(0u, 0u, 0u, 0u); }
  static __device__ __forceinline__ raw_t load(const T* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
  static __device__ __forceinline__ void store(T* p, raw_t v) { *reinterpret_cast<uint4*>(p) = v; }
  static __device__ __forceinline__ void store_evict_first(T* p, raw_t v) { __stcs(reinterpret_cast<uint4*>(p), v); }
  static __device__ __forceinline__ void unpack(raw_t v, float (&f)[8]) {
    unpack2<T>(v.x, f[0], f[1]);
    unpack2<T>(v.y, f[2], f[3]);
    unpack2<T>(v.z, f[4], f[5]);
    unpack2<T>(v.w, f[6], f[7]);
  }
  static __device__ __forceinline__ raw_t pack(const float (&f)[8]) {
    return make_uint4(pack2<T>(f[0], f[1]), pack2<T>(f[2], f[3]), pack2<T>(f[4], f[5]), pack2<T>(f[6], f[7]));
  }
};
template <>
struct Vec<__half, 8> : Vec16x8<__half> {};
template <>
struct Vec<__nv_bfloat16, 8> : Vec16x8<__nv_bfloat16> {};

template <class T>
struct Vec<T, 1> {  // scalar fallback (rows not 16-byte aligned)
  using raw_t = T;
  static __device__ __forceinline__ raw_t zero() { return from_f<T>(0.f); }
  static __device__ __forceinline__ raw_t load(const T* p) { return *p; }
  static __device__ __forceinline__ void store(T* p, raw_t v) { *p = v; }
  static __device__ __forceinline__ void store_evict_first(T* p, raw_t v) { *p = v; }  // plain, as store
  static __device__ __forceinline__ void unpack(raw_t v, float (&f)[1]) { f[0] = to_f<T>(v); }
  static __device__ __forceinline__ raw_t pack(const float (&f)[1]) { return from_f<T>(f[0]); }
};

// Output policy of the row stores: O = T (the gradient), float (the fp32
// row sums of normalize, for the Jacobian pass), or Jacobian<T> (the
// gradient of normalize, the Jacobian applied in the kernel: jacobian_row).
template <class T>
struct Jacobian {};
template <class O>
struct OutRow {
  using type = O;  // what the output tensor holds
  static constexpr bool kJacobian = false;
};
template <class T>
struct OutRow<Jacobian<T>> {
  using type = T;
  static constexpr bool kJacobian = true;
};
template <class O>
using out_t = typename OutRow<O>::type;

// Sum over the lane group (G consecutive lanes); every lane of the warp calls it.
__device__ __forceinline__ float group_sum(float v, int G) {
  for (int o = G >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Under O = Jacobian<T>, a lane group's fp32 sums f of a whole row
// (g = dL/dx^ for x^ = x / max(|x|, eps)) become the row's gradient
// (g - x^ <x^, g>) / |x| (g / eps under the clamp), with x the input row
// (this lane's vector at x_vec, read when `own`). Every lane of the warp
// calls it (group shuffles); a lane that owns nothing passes zeros.
template <class T, class O, int VEC>
__device__ __forceinline__ void jacobian_row(const T* __restrict__ x_vec, bool own, int G, float (&f)[VEC]) {
  if constexpr (OutRow<O>::kJacobian) {
    float x[VEC];
    if (own) {
      Vec<T, VEC>::unpack(Vec<T, VEC>::load(x_vec), x);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) x[e] = 0.f;
    }
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) ss = fmaf(x[e], x[e], ss);
    const NormJacobian jac(group_sum(ss, G));
    float c = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) c = fmaf(x[e] * jac.inv, f[e], c);
    c = jac.along(group_sum(c, G));
#pragma unroll
    for (int e = 0; e < VEC; ++e) f[e] = jac.grad(x[e] * jac.inv, f[e], c);
  }
}

// One lane's VEC fp32 values stored to an output row: packed to T, or as
// fp32 (O = float, the row sums of normalize; 16-byte aligned when VEC >= 4).
// kEvictFirst: st.global.cs, the lines first out of L2 (see dd_one_pair_cta);
// scalar rows (VEC 1) store plainly either way.
template <class O, int VEC, bool kEvictFirst = false>
__device__ __forceinline__ void store_out(O* __restrict__ p, const float (&f)[VEC]) {
  if constexpr (!std::is_same<O, float>::value) {
    if constexpr (kEvictFirst)
      Vec<O, VEC>::store_evict_first(p, Vec<O, VEC>::pack(f));
    else
      Vec<O, VEC>::store(p, Vec<O, VEC>::pack(f));
  } else if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int h = 0; h < VEC / 4; ++h) {
      const float4 v = make_float4(f[4 * h], f[4 * h + 1], f[4 * h + 2], f[4 * h + 3]);
      if constexpr (kEvictFirst)
        __stcs(reinterpret_cast<float4*>(p) + h, v);
      else
        reinterpret_cast<float4*>(p)[h] = v;
    }
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) p[e] = f[e];
  }
}

// ---------------------------------------------------------------------------
// Segments and pairs.
// ---------------------------------------------------------------------------

// Rows of segment n the forward read (at most `width`), or -1 if the segment
// is invalid (len < 0, or rows outside the tensor). Same rule as the CPU
// backend's seg_rows and the forward's query_ok / doc_ok. seg_rows_of takes
// the segment's (len, start) already loaded; seg_rows loads them.
__device__ __forceinline__ int seg_rows_of(int64_t len, int64_t start, int64_t width, int64_t total) {
  if (len < 0) return -1;
  const int64_t r = len < width ? len : width;
  if (r > 0 && (start < 0 || start + r > total)) return -1;
  return (int)r;
}
__device__ __forceinline__ int seg_rows(const int* __restrict__ start, const int* __restrict__ len, int64_t n,
                                        int64_t width, int64_t total) {
  const int64_t l = len[n];
  return l < 0 ? -1 : seg_rows_of(l, start[n], width, total);
}

__device__ __forceinline__ int64_t clamp_row(int64_t s, int64_t total) { return s < 0 ? 0 : (s > total ? total : s); }

// Rows [z0, z1) that segment n zeroes (see the file comment); empty if z1 <= z0.
__device__ __forceinline__ void seg_gap(const int* __restrict__ start, int rows, int64_t n, int64_t N, int64_t total,
                                        int64_t& z0, int64_t& z1) {
  z0 = clamp_row(start[n], total) + (rows > 0 ? rows : 0);
  z1 = n + 1 < N ? clamp_row(start[n + 1], total) : total;
}

// Zeroes rows first, first + stride, ... of [r0, r1) (vector column `col`).
template <class O, int VEC, bool kEvictFirst>
__device__ __forceinline__ void zero_rows(O* __restrict__ out, int64_t dim, int64_t r0, int64_t r1, int64_t first,
                                          int64_t stride, int64_t col, bool vok) {
  if (!vok) return;
  float z[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) z[e] = 0.f;
  for (int64_t r = r0 + first; r < r1; r += stride) store_out<O, VEC, kEvictFirst>(out + r * dim + col, z);
}

// Zeroes the gap of segment n (and the prefix before segment 0), rows split
// over `nparts` CTAs (this one: `part`) and NG groups (this one: gi).
template <class O, int VEC, bool kEvictFirst = false>
__device__ __forceinline__ void zero_gap(O* __restrict__ out, const int* __restrict__ start, int rows, int64_t n,
                                         int64_t N, int64_t total, int64_t dim, int part, int nparts, int gi, int NG,
                                         int64_t col, bool vok) {
  int64_t z0, z1;
  seg_gap(start, rows, n, N, total, z0, z1);
  const int64_t first = part + (int64_t)gi * nparts, stride = (int64_t)NG * nparts;
  zero_rows<O, VEC, kEvictFirst>(out, dim, z0, z1, first, stride, col, vok);
  if (n == 0) zero_rows<O, VEC, kEvictFirst>(out, dim, 0, clamp_row(start[0], total), first, stride, col, vok);
}

// CROSS / GROUPED pair k of query n is n * positional_stride(p) + k.
__device__ __forceinline__ int64_t positional_stride(const BwdParams& p) {
  return p.layout == kCrossL ? p.Nd : p.K;
}

// LIST: the pairs of group id in a CSR pointer array (q_ptr / d_ptr),
// [lo, lo + count) clamped to [0, P).
__device__ __forceinline__ int64_t csr_group(const int* __restrict__ ptr, int64_t id, int64_t P, int64_t& lo) {
  int64_t a = ptr[id], b = ptr[id + 1];
  a = a < 0 ? 0 : a;
  b = b > P ? P : b;
  lo = a;
  return b > a ? b - a : 0;
}

// Pairs of query n: count, and pair k -> (pair id, doc id). False: skip.
__device__ __forceinline__ int64_t query_pairs(const BwdParams& p, int64_t n, int64_t& lo) {
  lo = 0;
  if (p.layout == kCrossL) return p.Nd;
  if (p.layout == kGroupedL) return p.K;
  return csr_group(p.q_ptr, n, p.P, lo);
}
__device__ __forceinline__ bool query_pair(const BwdParams& p, int64_t n, int64_t k, int64_t lo, int64_t& pr,
                                           int64_t& m) {
  if (p.layout == kCrossL) {
    pr = n * positional_stride(p) + k;
    m = k;
  } else if (p.layout == kGroupedL) {
    pr = n * positional_stride(p) + k;
    m = pr;
  } else {
    pr = p.q_pairs[lo + k];
    if (pr < 0 || pr >= p.P || p.pair_q[pr] != n) return false;
    m = p.pair_d[pr];
  }
  return pr >= 0 && pr < p.P && m >= 0 && m < p.Nd;
}

// Pairs of document j: count, and pair k -> (pair id, query id). False: skip.
__device__ __forceinline__ int64_t doc_pairs(const BwdParams& p, int64_t j, int64_t& lo) {
  lo = 0;
  if (p.layout == kCrossL) return p.Nq;
  if (p.layout == kGroupedL) return 1;
  return csr_group(p.d_ptr, j, p.P, lo);
}
__device__ __forceinline__ bool doc_pair(const BwdParams& p, int64_t j, int64_t k, int64_t lo, int64_t& pr,
                                         int64_t& n) {
  if (p.layout == kCrossL) {
    pr = k * p.Nd + j;
    n = k;
  } else if (p.layout == kGroupedL) {
    pr = j;
    n = j / p.K;
  } else {
    pr = p.d_pairs[lo + k];
    if (pr < 0 || pr >= p.P || p.pair_d[pr] != j) return false;
    n = p.pair_q[pr];
  }
  return pr >= 0 && pr < p.P && n >= 0 && n < p.Nq;
}

// The work item of a CTA and this lane's place in it. Items are numbered
// (owner o, part c of `parts`, dim chunk h) with h fastest; the owner is a
// query (dq) or a document (dd), the part a block of rows. Lane l of lane
// group gi (NG groups of G = 1 << lgG lanes) takes vector h * G + l of a
// row: elements [col, col + VEC), if vok (the vector exists).
struct CtaItem {
  int G, NG, gi, l, c;
  int64_t o;
  bool vok;
  int64_t col;
};

template <int VEC>
__device__ __forceinline__ CtaItem cta_item(const BwdParams& p, int64_t item, int parts) {
  CtaItem it;
  const int tid = threadIdx.x;
  it.G = 1 << p.lgG;
  it.NG = kThreads >> p.lgG;  // <= 32
  it.gi = tid >> p.lgG;
  it.l = tid & (it.G - 1);
  const int h = (int)(item % p.H);
  item /= p.H;
  it.c = (int)(item % parts);
  it.o = item / parts;
  const int v = h * it.G + it.l;
  it.vok = v < p.nvec;
  it.col = (int64_t)v * VEC;
  return it;
}

// g * f[4h .. 4h + 3] + base (f indexed in place: a pointer into it would
// put the caller's register array in local memory).
template <int VEC>
__device__ __forceinline__ float4 fma4(float g, const float (&f)[VEC], int h, float4 base) {
  return make_float4(fmaf(g, f[4 * h + 0], base.x), fmaf(g, f[4 * h + 1], base.y), fmaf(g, f[4 * h + 2], base.z),
                     fmaf(g, f[4 * h + 3], base.w));
}

// acc += g * f on one lane's VEC floats of a shared fp32 row. Row layout:
// [VEC/4][G][4] floats (lane-interleaved float4s: conflict-free), or [G].
// All float4s are read before any is written (G is known only at run time,
// so the compiler cannot tell the stores from the next reads).
template <int VEC>
__device__ __forceinline__ void smem_fma(float* __restrict__ row, int l, int G, float g, const float (&f)[VEC]) {
  if constexpr (VEC >= 4) {
    float4 x[VEC / 4];
#pragma unroll
    for (int h = 0; h < VEC / 4; ++h) x[h] = *reinterpret_cast<const float4*>(row + (h * G + l) * 4);
#pragma unroll
    for (int h = 0; h < VEC / 4; ++h) x[h] = fma4(g, f, h, x[h]);
#pragma unroll
    for (int h = 0; h < VEC / 4; ++h) *reinterpret_cast<float4*>(row + (h * G + l) * 4) = x[h];
  } else {
    row[l] = fmaf(g, f[0], row[l]);
  }
}
// Two updates of shared fp32 rows a then b (b may equal a): both rows are
// read before either is written, so the two read-modify-writes overlap
// instead of waiting on each other; when b == a, b's update starts from a's
// result and b's stores land last, the same two roundings in the same order
// as one after the other (so no __restrict__: the rows may alias).
template <int VEC>
__device__ __forceinline__ void smem_fma2(float* ra, float* rb, int l, int G, float ga, const float (&fa)[VEC],
                                          float gb, const float (&fb)[VEC]) {
  const bool same = ra == rb;
  if constexpr (VEC >= 4) {
    float4 x[VEC / 4], y[VEC / 4];
#pragma unroll
    for (int h = 0; h < VEC / 4; ++h) {
      x[h] = *reinterpret_cast<const float4*>(ra + (h * G + l) * 4);
      y[h] = *reinterpret_cast<const float4*>(rb + (h * G + l) * 4);
    }
#pragma unroll
    for (int h = 0; h < VEC / 4; ++h) {
      x[h] = fma4(ga, fa, h, x[h]);
      y[h] = fma4(gb, fb, h, same ? x[h] : y[h]);
    }
#pragma unroll
    for (int h = 0; h < VEC / 4; ++h) *reinterpret_cast<float4*>(ra + (h * G + l) * 4) = x[h];
#pragma unroll
    for (int h = 0; h < VEC / 4; ++h) *reinterpret_cast<float4*>(rb + (h * G + l) * 4) = y[h];
  } else {
    const float x = fmaf(ga, fa[0], ra[l]);
    const float y = fmaf(gb, fb[0], same ? x : rb[l]);
    ra[l] = x;
    rb[l] = y;
  }
}
template <int VEC>
__device__ __forceinline__ void smem_read(const float* __restrict__ row, int l, int G, float (&f)[VEC]) {
  if constexpr (VEC >= 4) {
#pragma unroll
    for (int h = 0; h < VEC / 4; ++h) {
      const float4 x = *reinterpret_cast<const float4*>(row + (h * G + l) * 4);
      f[4 * h + 0] = x.x;
      f[4 * h + 1] = x.y;
      f[4 * h + 2] = x.z;
      f[4 * h + 3] = x.w;
    }
  } else {
    f[0] = row[l];
  }
}

// ---------------------------------------------------------------------------
// dq
// ---------------------------------------------------------------------------
// Dynamic shared memory: max(PC * 20 + PC * BR * 4, kThreads * VEC * 4) bytes.
template <class T, class A, int VEC, class O, int RING = kRing>
__device__ __forceinline__ void dq_cta(const BwdParams& p, int64_t item) {
  using V = Vec<T, VEC>;
  using raw_t = typename V::raw_t;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x;
  const CtaItem it = cta_item<VEC>(p, item, p.NB);
  const int G = it.G, NG = it.NG, gi = it.gi, l = it.l, b = it.c;
  const int64_t n = it.o;
  if (n >= p.Nq) return;  // CTA-uniform
  const bool vok = it.vok;
  const int64_t col = it.col;
  const int64_t dim = p.dim;
  const int lq = p.lq;
  const T* __restrict__ dsrc = static_cast<const T*>(p.d);
  const A* __restrict__ am = static_cast<const A*>(p.argmax);
  out_t<O>* __restrict__ out = static_cast<out_t<O>*>(p.dq);
  const float* __restrict__ dsc = p.d_scale;

  const int qrows = seg_rows(p.q_start, p.q_len, n, lq, p.Tq);
  const int BR = 1 << p.lgBR, S = p.S, PC = p.PC;
  const int r = gi & (BR - 1), s = gi >> p.lgBR;
  const int i = b * BR + r;  // query row of this group

  int64_t* c_pr = reinterpret_cast<int64_t*>(smem);  // [PC] pair id, -1: invalid (LIST only)
  int* c_ds = reinterpret_cast<int*>(c_pr + PC);      // [PC] doc start row, -1: skip
  int* c_dl = c_ds + PC;                              // [PC] doc rows (0: skip)
  float* c_g = reinterpret_cast<float*>(c_dl + PC);   // [PC] grad
  int* c_am = reinterpret_cast<int*>(c_g + PC);       // [PC][BR] winning doc row (d's row index), -1: skip

  float acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = 0.f;

  if (qrows > b * BR) {  // CTA-uniform: this block has rows to own
    int64_t lo;
    const int64_t np = query_pairs(p, n, lo);
    // CROSS / GROUPED pair ids are positional (always valid); LIST pairs
    // are looked up (phase 1) before their winners can be loaded.
    const bool listed = p.layout == kListL;
    const int64_t stride = positional_stride(p);
    for (int64_t k0 = 0; k0 < np; k0 += PC) {
      const int nk = (int)(np - k0 < PC ? np - k0 : PC);
      __syncthreads();  // the previous chunk is consumed
      // 1. Each pair's (doc start, rows, grad), the loads side by side.
      for (int t = tid; t < nk; t += kThreads) {
        int64_t pr = 0, m = 0;
        int ds = -1, dl = 0;
        float g = 0.f;
        const bool ok = query_pair(p, n, k0 + t, lo, pr, m);
        if (ok) {
          const int64_t l = p.d_len[m], st = p.d_start[m];
          g = p.grad[pr];
          const int rows = seg_rows_of(l, st, kNoWidth, p.Td);
          if (rows > 0) {
            ds = (int)st;
            dl = rows;
          }
        }
        if (listed) c_pr[t] = ok ? pr : -1;
        c_ds[t] = ds;
        c_dl[t] = dl;
        c_g[t] = g;
      }
      if (listed) __syncthreads();  // CTA-uniform
      // 2. The winners' indices, kAmRound loads in flight per thread (for
      //    CROSS / GROUPED at the same time as phase 1's).
      const int ne = nk * BR;
      for (int t0 = tid; t0 < ne; t0 += kAmRound * kThreads) {
        int a[kAmRound];
#pragma unroll
        for (int u = 0; u < kAmRound; ++u) {
          const int t = t0 + u * kThreads;
          const int kk = t >> p.lgBR, ii = b * BR + (t & (BR - 1));
          const int64_t pr = t < ne ? (listed ? c_pr[kk] : n * stride + k0 + kk) : -1;
          a[u] = pr >= 0 && ii < qrows ? (int)am[pr * lq + ii] : -1;
        }
#pragma unroll
        for (int u = 0; u < kAmRound; ++u)
          if (t0 + u * kThreads < ne) c_am[t0 + u * kThreads] = a[u];
      }
      __syncthreads();
      // 3. Winners become document rows; -1 past the document (or for an
      //    invalid / empty one: c_dl 0).
      for (int t = tid; t < ne; t += kThreads) {
        const int a = c_am[t], kk = t >> p.lgBR;
        c_am[t] = a < 0 || a >= c_dl[kk] ? -1 : c_ds[kk] + a;
      }
      __syncthreads();
      // This group's slice of the chunk, in pair order.
      const int klo = (int)((int64_t)nk * s / S), khi = (int)((int64_t)nk * (s + 1) / S);
      if (i < qrows && vok) {
        // Ring of RING row loads in flight. The staged winner is the
        // document row itself and a slot's validity a bit of `live`, so an
        // item costs one shared load to fetch and one (its grad) to consume.
        raw_t buf[RING];
        float bsc[RING];  // the rows' inverse norms (normalize)
        unsigned live = 0;
        auto fetch = [&](int kk, int u) {
          const int row = kk < khi ? c_am[kk * BR + r] : -1;
          buf[u] = row >= 0 ? V::load(dsrc + (int64_t)row * dim + col) : V::zero();
          bsc[u] = dsc != nullptr && row >= 0 ? __ldg(dsc + row) : 1.f;
          live = row >= 0 ? live | (1u << u) : live & ~(1u << u);
        };
#pragma unroll
        for (int u = 0; u < RING; ++u) fetch(klo + u, u);
        for (int kk = klo; kk < khi; kk += RING) {
#pragma unroll
          for (int u = 0; u < RING; ++u) {
            const int k2 = kk + u;
            if (live & (1u << u)) {
              const float g = c_g[k2] * bsc[u];
              float f[VEC];
              V::unpack(buf[u], f);
#pragma unroll
              for (int e = 0; e < VEC; ++e) acc[e] = fmaf(g, f[e], acc[e]);
            }
            fetch(kk + RING + u, u);
          }
        }
      }
    }
  }

  // Sum the slices of each row in slice order (fixed).
  if (S > 1) {
    float* red = reinterpret_cast<float*>(smem);  // [NG][VEC][G]
    __syncthreads();
#pragma unroll
    for (int e = 0; e < VEC; ++e) red[(gi * VEC + e) * G + l] = acc[e];
    __syncthreads();
    if (s == 0) {
      for (int s2 = 1; s2 < S; ++s2) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] += red[((s2 * BR + r) * VEC + e) * G + l];
      }
    }
  }
  const bool own = s == 0 && i < qrows && vok;
  const int64_t row = own ? (int64_t)p.q_start[n] + i : 0;
  jacobian_row<T, O, VEC>(static_cast<const T*>(p.q) + row * dim + col, own, G, acc);
  if (own) store_out<out_t<O>, VEC>(out + row * dim + col, acc);

  zero_gap<out_t<O>, VEC>(out, p.q_start, qrows, n, p.Nq, p.Tq, dim, b, p.NB, gi, NG, col, vok);
}

// ---------------------------------------------------------------------------
// dd
// ---------------------------------------------------------------------------
__host__ __device__ constexpr size_t dd_fixed_smem() {
  return (size_t)kChunk * (4 + 4 + 2) + (size_t)(2 * kWarps * 32 + 33) * 4;
}

// Dynamic shared memory: R * G * VEC * 4 + dd_fixed_smem() bytes.
template <class T, class A, int VEC, class O>
__device__ __forceinline__ void dd_cta(const BwdParams& p, int64_t item) {
  using V = Vec<T, VEC>;
  using raw_t = typename V::raw_t;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const CtaItem it = cta_item<VEC>(p, item, p.C);
  const int G = it.G, NG = it.NG, gi = it.gi, l = it.l, c = it.c;
  const int64_t j = it.o;
  if (j >= p.Nd) return;  // CTA-uniform
  const bool vok = it.vok;
  const int64_t col = it.col;
  const int64_t dim = p.dim;
  const int lq = p.lq;
  const int R = p.R;
  const int DCf = G * VEC;  // floats per tile row
  const T* __restrict__ qsrc = static_cast<const T*>(p.q);
  const A* __restrict__ am = static_cast<const A*>(p.argmax);
  out_t<O>* __restrict__ out = static_cast<out_t<O>*>(p.dd);
  const T* __restrict__ dsrc = static_cast<const T*>(p.d);

  float* acc = reinterpret_cast<float*>(smem);                            // [R][DCf]
  int* q_row = reinterpret_cast<int*>(acc + (size_t)R * DCf);            // [kChunk]
  float* q_g = reinterpret_cast<float*>(q_row + kChunk);                 // [kChunk]
  unsigned short* q_rr = reinterpret_cast<unsigned short*>(q_g + kChunk);  // [kChunk]
  int* cntw = reinterpret_cast<int*>(q_rr + kChunk);                      // [kWarps][32]
  int* qbase = cntw + kWarps * 32;                                        // [kWarps][32]
  int* qoff = qbase + kWarps * 32;                                        // [33]

  const int drows = seg_rows(p.d_start, p.d_len, j, kNoWidth, p.Td);
  const int64_t ds = p.d_start[j];
  int64_t plo = 0;
  const int64_t np = drows > 0 ? doc_pairs(p, j, plo) : 0;
  const int64_t ent = np * lq;  // entries (pair k, token i), k-major
  const bool ent32 = ent <= (int64_t)0x7fffffff;

  for (int64_t r0 = (int64_t)c * R; r0 < drows; r0 += (int64_t)p.C * R) {
    const int rlen = (int)(drows - r0 < R ? drows - r0 : R);
    {
      float4* a4 = reinterpret_cast<float4*>(acc);
      const int n4 = rlen * DCf / 4;  // DCf is a multiple of 8
      for (int t = tid; t < n4; t += kThreads) a4[t] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int64_t cb = 0; cb < ent; cb += kChunk) {
      // A. entries of this lane: target tile row (-1: none), grad, query row.
      //    In rounds of independent loads over the lane's kEpt entries (the
      //    pair, then its query's segment, argmax and grad together, then
      //    the query row's scale): per entry, one after the other, they were
      //    kEpt chains of four dependent L2 round trips per chunk.
      int tg[kEpt], qr[kEpt], pos[kEpt];
      float gv[kEpt];
      int64_t prv[kEpt];
      int nv[kEpt], iv[kEpt];
#pragma unroll
      for (int t = 0; t < kEpt; ++t) {
        nv[t] = -1;
        prv[t] = 0;
        iv[t] = 0;
        const int64_t e = cb + ((warp * kEpt + t) * 32 + lane);
        if (e < ent) {
          int64_t k;
          int ii;
          if (ent32) {
            const unsigned ku = (unsigned)e / (unsigned)lq;
            k = ku;
            ii = (int)((unsigned)e - ku * (unsigned)lq);
          } else {
            k = e / lq;
            ii = (int)(e - k * lq);
          }
          int64_t pr, n;
          if (doc_pair(p, j, k, plo, pr, n)) {
            nv[t] = (int)n;  // n < Nq <= INT_MAX rows
            prv[t] = pr;
            iv[t] = ii;
          }
        }
      }
      int lenv[kEpt], stv[kEpt], amv[kEpt];
      float grv[kEpt];
#pragma unroll
      for (int t = 0; t < kEpt; ++t) {
        const bool v = nv[t] >= 0;
        lenv[t] = v ? p.q_len[nv[t]] : -1;
        stv[t] = v ? p.q_start[nv[t]] : 0;
        amv[t] = v ? (int)am[prv[t] * lq + iv[t]] : -1;  // pr < P, ii < lq: in bounds
        grv[t] = v ? p.grad[prv[t]] : 0.f;
      }
#pragma unroll
      for (int t = 0; t < kEpt; ++t) {
        tg[t] = -1;
        qr[t] = 0;
        gv[t] = 0.f;
        const int qrows = seg_rows_of(lenv[t], stv[t], lq, p.Tq);  // -1: invalid query
        const int64_t a = amv[t];
        if (iv[t] < qrows && a >= r0 && a < r0 + rlen) {
          tg[t] = (int)(a - r0);
          qr[t] = stv[t] + iv[t];
          gv[t] = grv[t];
        }
      }
      if (p.q_scale != nullptr) {
#pragma unroll
        for (int t = 0; t < kEpt; ++t)
          if (tg[t] >= 0) gv[t] *= p.q_scale[qr[t]];
      }
      // B. rank of each hit among the earlier hits of the same owner group
      //    in this warp (entry order), with per-warp running counters.
      cntw[warp * 32 + lane] = 0;
      __syncwarp();
#pragma unroll
      for (int t = 0; t < kEpt; ++t) {
        const int o = tg[t] >= 0 ? (tg[t] & (NG - 1)) : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, o);
        const int rank = __popc(peers & ((1u << lane) - 1u));
        int base = 0;
        if (o >= 0) base = cntw[warp * 32 + o];
        __syncwarp();
        if (o >= 0 && rank == 0) cntw[warp * 32 + o] = base + __popc(peers);
        __syncwarp();
        pos[t] = base + rank;
      }
      __syncthreads();
      // C. queue offsets: owner-major, then warp order.
      if (warp == 0) {
        int tot = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) tot += cntw[w * 32 + lane];
        int incl = tot;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int y = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += y;
        }
        int run = incl - tot;
        if (lane < NG) qoff[lane] = run;
        if (lane == NG - 1) qoff[NG] = incl;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          qbase[w * 32 + lane] = run;
          run += cntw[w * 32 + lane];
        }
      }
      __syncthreads();
      // D. write the hits to their queues.
#pragma unroll
      for (int t = 0; t < kEpt; ++t) {
        if (tg[t] >= 0) {
          const int idx = qbase[warp * 32 + (tg[t] & (NG - 1))] + pos[t];
          q_row[idx] = qr[t];
          q_g[idx] = gv[t];
          q_rr[idx] = (unsigned short)tg[t];
        }
      }
      __syncthreads();
      // E. each group drains its queue into its own tile rows, in order.
      //    Only the row vectors ride in registers (kRingDD loads in flight);
      //    tile row and grad are read back from the queue when consumed.
      if (vok) {
        const int x0 = qoff[gi], x1 = qoff[gi + 1];
        raw_t buf[kRingDD];
        auto fetch = [&](int x, int u) {
          buf[u] = x < x1 ? V::load(qsrc + (int64_t)q_row[x] * dim + col) : V::zero();
        };
#pragma unroll
        for (int u = 0; u < kRingDD; ++u) fetch(x0 + u, u);
        // Items in pairs (smem_fma2): the shared-row read-modify-writes were
        // the drain's critical path.
        static_assert(kRingDD % 2 == 0, "items go in pairs");
        for (int x = x0; x < x1; x += kRingDD) {
#pragma unroll
          for (int u = 0; u < kRingDD; u += 2) {
            if (x + u + 1 < x1) {
              float fa[VEC], fb[VEC];
              V::unpack(buf[u], fa);
              V::unpack(buf[u + 1], fb);
              smem_fma2<VEC>(acc + (size_t)q_rr[x + u] * DCf, acc + (size_t)q_rr[x + u + 1] * DCf, l, G,
                             q_g[x + u], fa, q_g[x + u + 1], fb);
            } else if (x + u < x1) {
              float f[VEC];
              V::unpack(buf[u], f);
              smem_fma<VEC>(acc + (size_t)q_rr[x + u] * DCf, l, G, q_g[x + u], f);
            }
            fetch(x + kRingDD + u, u);
            fetch(x + kRingDD + u + 1, u + 1);
          }
        }
      }
      __syncthreads();  // queues are rewritten by the next chunk
    }
    __syncthreads();  // tile complete (also when there were no entries)
    for (int rw = 0; rw < rlen; rw += NG) {  // CTA-uniform trips (jacobian_row's shuffles)
      const int rr = rw + gi;
      const bool own = rr < rlen && vok;
      float f[VEC];
      if (own) {
        smem_read<VEC>(acc + (size_t)rr * DCf, l, G, f);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) f[e] = 0.f;
      }
      const int64_t row = ds + r0 + (own ? rr : 0);
      jacobian_row<T, O, VEC>(dsrc + row * dim + col, own, G, f);
      if (own) store_out<out_t<O>, VEC>(out + row * dim + col, f);
    }
    __syncthreads();  // the next pass clears the tile
  }

  zero_gap<out_t<O>, VEC>(out, p.d_start, drows, j, p.Nd, p.Td, dim, c, p.C, gi, NG, col, vok);
}

// dd when every document belongs to one pair (GROUPED, or CROSS with one
// query): a document's rows take at most lq hits, so most rows are zeros and
// the tile of dd_cta (a shared fp32 row per document row, sized for many
// pairs) would only add a pass through shared memory. CTA = (document j,
// row part c of C, dim chunk); the pair's lq (argmax row, grad x scale)
// entries are staged once, then each lane group writes its rows straight
// from registers: per row a warp ballot over the entries finds the hits,
// summed in entry order (the order dd_cta uses), zeros elsewhere. The
// gradient rows are stored evict-first: written once, they would otherwise
// push the documents out of L2, and the next step's forward (candidates
// that fit L2 stay there between calls) would pay for both.
// Dynamic shared memory: dd_one_pair_smem(lq).
constexpr int kMaxOnePairLq = 4 * kThreads;  // query rows of the one-pair dd (entries staged in one pass)
__host__ __device__ constexpr size_t dd_one_pair_smem(int64_t lq) { return (size_t)((lq + 31) / 32 * 32) * 8; }

template <class T, class A, int VEC, class O>
__device__ __forceinline__ void dd_one_pair_cta(const BwdParams& p, int64_t item) {
  using V = Vec<T, VEC>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31;
  const CtaItem it = cta_item<VEC>(p, item, p.C);
  const int G = it.G, NG = it.NG, gi = it.gi, c = it.c;
  const int64_t j = it.o;
  if (j >= p.Nd) return;  // CTA-uniform
  const bool vok = it.vok;
  const int64_t col = it.col;
  const int64_t dim = p.dim;
  const int lq = p.lq, lq32 = (lq + 31) / 32 * 32;
  const T* __restrict__ qsrc = static_cast<const T*>(p.q);
  const A* __restrict__ am = static_cast<const A*>(p.argmax);
  out_t<O>* __restrict__ out = static_cast<out_t<O>*>(p.dd);
  // The gradient goes out evict-first; normalize's fp32 row sums of 16-bit
  // tokens (O = float) stay in L2 for the Jacobian pass that reads them next.
  constexpr bool kFinal = !(std::is_same<O, float>::value && !std::is_same<T, float>::value);
  int* e_row = reinterpret_cast<int*>(smem);       // [lq32] document row hit by entry i, -1: none
  float* e_g = reinterpret_cast<float*>(e_row + lq32);  // [lq32] its grad (x the query row's scale)

  // The pair and its query come from the layout (no loads), so the
  // segments, the grad and the entries load in one round trip.
  int64_t plo = 0, pr = 0, n = 0;
  const bool pair_ok = doc_pair(p, j, 0, plo, pr, n);
  const int64_t dlen = p.d_len[j], ds = p.d_start[j];
  int64_t qlen = -1, qs = 0;
  float g = 0.f;
  if (pair_ok) {
    qlen = p.q_len[n];
    qs = p.q_start[n];
    g = p.grad[pr];
  }
  constexpr int kPer = kMaxOnePairLq / kThreads;  // entries per thread
  int a_in[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = tid + u * kThreads;
    a_in[u] = pair_ok && i < lq ? (int)am[pr * lq + i] : -1;
  }
  const int drows = seg_rows_of(dlen, ds, kNoWidth, p.Td);
  const int qrows = pair_ok && drows > 0 ? seg_rows_of(qlen, qs, lq, p.Tq) : -1;
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = tid + u * kThreads;
    if (i < lq32) {
      const bool hit = i < qrows && a_in[u] >= 0 && a_in[u] < drows;
      e_row[i] = hit ? a_in[u] : -1;
      e_g[i] = hit ? (p.q_scale != nullptr ? g * p.q_scale[qs + i] : g) : 0.f;
    }
  }
  __syncthreads();

  // Rows r = (k * C + c) * NG + gi: a warp's groups take consecutive rows.
  const int gpw = 32 / G;  // groups per warp (1, 2 or 4)
  const int rows = drows > 0 ? drows : 0;
  for (int64_t rb = (int64_t)c * NG; rb < rows; rb += (int64_t)p.C * NG) {
    const int64_t r = rb + gi;  // may be >= rows: the group only takes part in the ballots
    float f[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) f[e] = 0.f;
    for (int e0 = 0; e0 < lq32; e0 += 32) {
      const int a = e_row[e0 + lane];
      unsigned mine = 0;
      for (int k = 0; k < gpw; ++k) {
        const int64_t rk = rb + (int64_t)((tid >> 5) * gpw + k);
        const unsigned m = __ballot_sync(0xffffffffu, a >= 0 && (int64_t)a == rk);
        if (k == (gi & (gpw - 1))) mine = m;
      }
      while (mine != 0u && vok) {
        const int i = e0 + __ffs(mine) - 1;
        mine &= mine - 1u;
        float q[VEC];
        V::unpack(V::load(qsrc + ((int64_t)qs + i) * dim + col), q);
        const float gg = e_g[i];
#pragma unroll
        for (int e = 0; e < VEC; ++e) f[e] = fmaf(gg, q[e], f[e]);
      }
    }
    const bool own = r < rows && vok;
    jacobian_row<T, O, VEC>(static_cast<const T*>(p.d) + (ds + (own ? r : 0)) * dim + col, own, G, f);
    if (own) store_out<out_t<O>, VEC, kFinal>(out + (ds + r) * dim + col, f);
  }

  zero_gap<out_t<O>, VEC, kFinal>(out, p.d_start, drows, j, p.Nd, p.Td, dim, c, p.C, gi, NG, col, vok);
}

// Launch forms: CTAs item0 + blockIdx.x of one kind (one gradient needed),
// or both kinds in one grid (blocks [0, n_dd) dd, the rest dq): they write
// disjoint outputs and share the SMs, with one launch on the host. dd's
// CTAs go first: they are the longer ones, and dq's fill the SMs as they
// drain (dq first, or alternating, is slower).
template <class T, class A, int VEC, class O>
__global__ void __launch_bounds__(kThreads, 3) dq_kernel(const BwdParams p, int64_t item0) {
  pdl_wait();
  dq_cta<T, A, VEC, O>(p, item0 + blockIdx.x);
}

template <class T, class A, int VEC, class O>
__global__ void __launch_bounds__(kThreads, 2) dd_kernel(const BwdParams p, int64_t item0) {
  pdl_wait();
  dd_cta<T, A, VEC, O>(p, item0 + blockIdx.x);
}

template <class T, class A, int VEC, class O>
__global__ void __launch_bounds__(kThreads, 4) dd_one_pair_kernel(const BwdParams p, int64_t item0) {
  pdl_wait();
  dd_one_pair_cta<T, A, VEC, O>(p, item0 + blockIdx.x);
}

template <class T, class A, int VEC, class O>
__global__ void __launch_bounds__(kThreads, 2) dqdd_kernel(const BwdParams p, int n_dd) {
  pdl_wait();
  const int b = (int)blockIdx.x;
  if (b < n_dd)
    dd_cta<T, A, VEC, O>(p, b);
  else
    dq_cta<T, A, VEC, O>(p, b - n_dd);
}

template <class T, class A, int VEC, class O>
__global__ void __launch_bounds__(kThreads, kOnePairCtasPerSm) dqdd_one_pair_kernel(const BwdParams p, int n_dd) {
  pdl_wait();
  const int b = (int)blockIdx.x;
  if (b < n_dd)
    dd_one_pair_cta<T, A, VEC, O>(p, b);
  else
    dq_cta<T, A, VEC, O, kRingBesideOnePair>(p, b - n_dd);
}

}  // namespace cuda_bwd
}  // namespace maxsim
