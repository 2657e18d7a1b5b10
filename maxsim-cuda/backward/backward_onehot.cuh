// Backward of CROSS pairs over short bf16 documents as tensor-core products
// (contract: torch-ext/torch_binding.h; host choice: backward.cu).
//
// With A the one-hot matrix of the winners, A[(query i, token s), doc row]
// = grad[i, n] where argmax[i, n, s] picks that row, dq = A D and dd = A^T Q.
// The gather kernels spend ~0.2 ns per (pair, query token) entry whatever the
// document length; here an entry costs one shared-memory store and the
// products run on the tensor cores, so short documents (few rows per pair)
// no longer pay per pair.
//
// Tiles: a query block is kOhRows / lq whole queries (rows (i, s), s < lq);
// a document tile is kOhRows consecutive rows of d. A CTA owns one block of
// output rows (dq: a query block, dd: a document tile) and walks the other
// side's tiles as its K dimension. Per step it
//   * streams the K tile of rows (d rows for dq, query rows for dd) through a
//     2-stage cp.async ring, swizzled, and zeroes its non-finite elements in
//     shared memory (a 0 of A times inf would poison every output row);
//   * scatters the entries of (query block x the documents overlapping the
//     tile, ranges from onehot_tiles_kernel) into a [kOhRows x kOhRows] bf16
//     tile of A, the fp32 value split as hi + lo (two products, ~2^-17
//     relative);
//   * runs mma.sync m16n8k16 (4 warps x 16 output rows x dim).
// An entry that hits a zeroed element adds its exact non-finite product as
// flags (NaN / +inf / -inf) that override the sum in the epilogue: the
// result of adding inf / NaN terms does not depend on the order.
// Each output row has one owner, sums in a fixed order: deterministic. Rows
// of dd are written by their tile (zero where no entry hits them); rows of
// dq by their query block, which also zeroes its queries' gaps (the rule in
// backward_kernels.cuh). Segments sorted and disjoint, as for the gather.
#pragma once

#include "../common/common.cuh"
#include "backward_kernels.cuh"

namespace maxsim {
namespace cuda_bwd {

constexpr int kOhThreads = 128;
constexpr int kOhRows = 64;     // output rows per CTA = K rows per step
constexpr int kOhEpt = 4;       // entries a thread prefetches per step
constexpr int kOhCtasPerSm = 3;  // launch bound (smem ~57 KB at dim 128)

// Documents overlapping document tile t: [first[t], end[t]) (empty or
// invalid ones inside contribute nothing). Ends and starts are monotone for
// sorted, disjoint segments, so two binary searches per tile.
__global__ void onehot_tiles_kernel(const BwdParams p, int64_t n_tiles, int* __restrict__ first,
                                    int* __restrict__ end) {
  pdl_enter();
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n_tiles) return;
  const int64_t k0 = t * kOhRows, k1 = k0 + kOhRows;
  int64_t lo = 0, hi = p.Nd;  // first n whose clamped end > k0
  while (lo < hi) {
    const int64_t m = (lo + hi) / 2;
    const int r = seg_rows(p.d_start, p.d_len, m, kNoWidth, p.Td);
    if (clamp_row(p.d_start[m], p.Td) + (r > 0 ? r : 0) > k0) hi = m;
    else lo = m + 1;
  }
  first[t] = (int)lo;
  hi = p.Nd;  // first n whose clamped start >= k1
  while (lo < hi) {
    const int64_t m = (lo + hi) / 2;
    if (clamp_row(p.d_start[m], p.Td) >= k1) hi = m;
    else lo = m + 1;
  }
  end[t] = (int)lo;
}

// Byte offset of element (r, c) of a [rows x kOhRows] bf16 tile (128-byte
// rows, 16-byte chunks swizzled by r & 7 like the K tiles).
__device__ __forceinline__ uint32_t oh_a_offset(int r, int c) {
  return (uint32_t)(r * 128 + ((((c >> 3) ^ (r & 7))) << 4) + (c & 7) * 2);
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                              uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// Flags of an exact non-finite product, OR-ed per output element.
constexpr uint32_t kOhNan = 1, kOhPosInf = 2, kOhNegInf = 4;

__device__ __forceinline__ uint32_t nonfinite_flags(float v) {
  return v != v ? kOhNan : (v > 0.f ? kOhPosInf : kOhNegInf);
}

__device__ __forceinline__ float apply_flags(float acc, uint32_t f) {
  if (f == 0) return acc;
  if ((f & kOhNan) || (f & (kOhPosInf | kOhNegInf)) == (kOhPosInf | kOhNegInf)) return __int_as_float(0x7fc00000);
  return (f & kOhPosInf) ? INFINITY : -INFINITY;
}

// One prefetched entry: (query-block row qv, document n) -> raw winner and grad.
struct OhEntry {
  int n;      // document, -1: none
  int w;      // argmax value
  float g;    // grad of the pair
  int dst, dlen;  // document segment
};

template <class A, int DIM>
struct Onehot {
  static constexpr int KCB = DIM * 2;        // bytes per K row
  static constexpr int CPR = KCB / 16;       // 16-byte chunks per K row
  static constexpr int CPT = kOhRows * CPR / kOhThreads;  // chunks per thread per K tile
  static constexpr int kStage = kOhRows * KCB;
  static constexpr int kATile = kOhRows * kOhRows * 2;
  static constexpr int kFlagWords = kOhRows * DIM / 4;
  static constexpr size_t kSmem = 2 * kStage + 2 * kATile + kFlagWords * 4;

  const BwdParams& p;
  const bool is_dd;
  const int qpb;  // queries per query block
  const int tid;

  // Query-block row qv of block b: query i, token s, its physical row (or -1).
  __device__ __forceinline__ int64_t query_row(int64_t b, int qv, int64_t& i, int& s) const {
    i = b * qpb + qv / p.lq;
    s = qv % p.lq;
    if (qv >= qpb * p.lq || i >= p.Nq) return -1;
    const int rows = seg_rows(p.q_start, p.q_len, i, p.lq, p.Tq);
    return s < rows ? (int64_t)p.q_start[i] + s : -1;
  }

  // Issue the cp.async loads of K tile `k` (dd: query block k, dq: document
  // tile k) into stage buffer `dst`; missing rows read as zeros.
  __device__ __forceinline__ void load_k_tile(int64_t k, uint32_t dst) const {
    const char* base = static_cast<const char*>(is_dd ? p.q : p.d);
#pragma unroll
    for (int u = 0; u < CPT; ++u) {
      const int idx = tid + u * kOhThreads, r = idx / CPR, c = idx % CPR;
      int64_t row;
      if (is_dd) {
        int64_t i;
        int s;
        row = query_row(k, r, i, s);
      } else {
        row = k * kOhRows + r;
        if (row >= p.Td) row = -1;
      }
      const bool ok = row >= 0;
      const char* src = ok ? base + row * KCB + c * 16 : base;
      cuda_fwd::cp_async<16>(dst + r * KCB + ((c ^ (r & 7)) << 4), src, ok);
    }
  }

  // Zero the non-finite bf16 elements of this thread's chunks of the landed
  // stage; mark their rows in `poison` (bit r).
  __device__ __forceinline__ void clean_k_tile(char* stage, uint32_t* poison) const {
#pragma unroll
    for (int u = 0; u < CPT; ++u) {
      const int idx = tid + u * kOhThreads, r = idx / CPR, c = idx % CPR;
      uint4* v = reinterpret_cast<uint4*>(stage + r * KCB + ((c ^ (r & 7)) << 4));
      uint4 x = *v;
      uint32_t w[4] = {x.x, x.y, x.z, x.w};
      bool bad = false;
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const uint32_t e = w[h] & 0x7f807f80u;
        uint32_t keep = 0xffffffffu;
        if ((e & 0xffffu) == 0x7f80u) keep &= 0xffff0000u;
        if ((e >> 16) == 0x7f80u) keep &= 0x0000ffffu;
        bad |= keep != 0xffffffffu;
        w[h] &= keep;
      }
      if (bad) {
        *v = make_uint4(w[0], w[1], w[2], w[3]);
        atomicOr(&poison[r >> 5], 1u << (r & 31));
      }
    }
  }

  // Document range of step k's document tile.
  __device__ __forceinline__ int64_t doc_tile(int64_t step, int64_t fixed) const { return is_dd ? fixed : step; }
  __device__ __forceinline__ int64_t query_block(int64_t step, int64_t fixed) const { return is_dd ? step : fixed; }

  // Load entry m of pass `pass` of (query block b, document tile t).
  __device__ __forceinline__ OhEntry load_entry(int64_t b, int f0, int f1, int j) const {
    OhEntry e{-1, -1, 0.f, 0, 0};
    const int qv = tid & (kOhRows - 1);
    int64_t i;
    int s;
    if (j >= f1 || query_row(b, qv, i, s) < 0) return e;
    e.n = j;
    e.w = (int)static_cast<const A*>(p.argmax)[(i * p.Nd + j) * p.lq + s];
    e.g = p.grad[i * p.Nd + j];
    e.dst = p.d_start[j];
    e.dlen = p.d_len[j];
    return e;
  }

  // Scatter one entry into the A tile (and its non-finite products into the
  // flags); t: document tile, b: query block.
  __device__ __forceinline__ void scatter(const OhEntry& e, int64_t b, int64_t t, char* a_hi, char* a_lo,
                                          const uint32_t* poison, uint32_t* flags, int* any_flag) const {
    if (e.n < 0 || e.w < 0) return;
    const int rows = seg_rows_of(e.dlen, e.dst, kNoWidth, p.Td);
    if (e.w >= rows) return;
    const int64_t rowd = (int64_t)e.dst + e.w;
    const int64_t dj = rowd - t * kOhRows;
    if (dj < 0 || dj >= kOhRows) return;
    const int qv = tid & (kOhRows - 1);
    int64_t i;
    int s;
    const int64_t rowq = query_row(b, qv, i, s);
    float val = e.g;
    if (is_dd) {
      if (p.q_scale) val *= p.q_scale[rowq];
    } else {
      if (p.d_scale) val *= p.d_scale[rowd];
    }
    const int r_out = is_dd ? (int)dj : qv, c_k = is_dd ? qv : (int)dj;
    const __nv_bfloat16 hi = __float2bfloat16_rn(val);
    const float rest = val - __bfloat162float(hi);
    const __nv_bfloat16 lo = __float2bfloat16_rn(isfinite(val) ? rest : 0.f);
    *reinterpret_cast<__nv_bfloat16*>(a_hi + oh_a_offset(r_out, c_k)) = hi;
    *reinterpret_cast<__nv_bfloat16*>(a_lo + oh_a_offset(r_out, c_k)) = lo;
    const int kb = c_k;  // the K row this entry multiplies
    if (poison[kb >> 5] & (1u << (kb & 31))) {
      const __nv_bfloat16* src =
          static_cast<const __nv_bfloat16*>(is_dd ? p.q : p.d) + (is_dd ? rowq : rowd) * DIM;
      for (int c = 0; c < DIM; ++c) {
        const float x = __bfloat162float(src[c]);
        if (isfinite(x)) continue;
        const int idx = r_out * DIM + c;
        atomicOr(&flags[idx >> 2], nonfinite_flags(val * x) << ((idx & 3) * 8));
        *any_flag = 1;
      }
    }
  }
};

template <class A, class O, int DIM>
__global__ void __launch_bounds__(kOhThreads, kOhCtasPerSm)
    onehot_kernel(const BwdParams p, const int* __restrict__ tile_first, const int* __restrict__ tile_end,
                  int qpb, int n_dd, int64_t n_qblocks, int64_t n_dtiles) {
  using K = Onehot<A, DIM>;
  extern __shared__ __align__(16) unsigned char smem[];
  char* stage_s = reinterpret_cast<char*>(smem);
  char* a_hi = stage_s + 2 * K::kStage;
  char* a_lo = a_hi + K::kATile;
  uint32_t* flags = reinterpret_cast<uint32_t*>(a_lo + K::kATile);
  __shared__ uint32_t poison[2][2];
  __shared__ int any_flag;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const bool is_dd = (int)blockIdx.x < n_dd;
  const int64_t fixed = is_dd ? (int64_t)blockIdx.x : (int64_t)blockIdx.x - n_dd;
  const int64_t steps = is_dd ? n_qblocks : n_dtiles;
  const K k{p, is_dd, qpb, tid};

  pdl_wait();
  for (int w = tid; w < K::kFlagWords; w += kOhThreads) flags[w] = 0;
  if (tid < 4) poison[tid >> 1][tid & 1] = 0;
  if (tid == 0) any_flag = 0;
  __syncthreads();

  const uint32_t stage0 = cuda_fwd::smem_u32(stage_s);
  // Entries of step 0 (first pass), prefetched.
  OhEntry ent[kOhEpt];
  int f0 = 0, f1 = 0;
  if (steps > 0) {
    k.load_k_tile(0, stage0);
    cuda_fwd::cp_async_commit();
    const int64_t t = k.doc_tile(0, fixed);
    f0 = tile_first[t];
    f1 = tile_end[t];
#pragma unroll
    for (int m = 0; m < kOhEpt; ++m) ent[m] = k.load_entry(k.query_block(0, fixed), f0, f1, f0 + (tid >> 6) + 2 * m);
  }

  float acc[DIM / 8][4];
#pragma unroll
  for (int j = 0; j < DIM / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  for (int64_t st = 0; st < steps; ++st) {
    const int cur = (int)(st & 1);
    const int64_t t = k.doc_tile(st, fixed), b = k.query_block(st, fixed);
    if (st + 1 < steps) {
      k.load_k_tile(st + 1, stage0 + (cur ^ 1) * K::kStage);
      cuda_fwd::cp_async_commit();
    }
    // Zero the A tiles (the previous step's products are done).
#pragma unroll
    for (int u = 0; u < K::kATile / 16 / kOhThreads; ++u) {
      reinterpret_cast<uint4*>(a_hi)[tid + u * kOhThreads] = make_uint4(0, 0, 0, 0);
      reinterpret_cast<uint4*>(a_lo)[tid + u * kOhThreads] = make_uint4(0, 0, 0, 0);
    }
    if (st + 1 < steps) cuda_fwd::cp_async_wait<1>();
    else cuda_fwd::cp_async_wait<0>();
    k.clean_k_tile(stage_s + cur * K::kStage, poison[cur]);
    __syncthreads();
    // Scatter this step's entries: the prefetched first pass, then any
    // further passes (tiles of more than 2 kOhEpt documents) loaded here.
#pragma unroll
    for (int m = 0; m < kOhEpt; ++m) k.scatter(ent[m], b, t, a_hi, a_lo, poison[cur], flags, &any_flag);
    for (int j0 = f0 + 2 * kOhEpt; j0 < f1; j0 += 2 * kOhEpt) {
#pragma unroll
      for (int m = 0; m < kOhEpt; ++m) ent[m] = k.load_entry(b, f0, f1, j0 + (tid >> 6) + 2 * m);
#pragma unroll
      for (int m = 0; m < kOhEpt; ++m) k.scatter(ent[m], b, t, a_hi, a_lo, poison[cur], flags, &any_flag);
    }
    // Prefetch the next step's first pass (its loads fly during the products).
    if (st + 1 < steps) {
      const int64_t tn = k.doc_tile(st + 1, fixed), bn = k.query_block(st + 1, fixed);
      f0 = tile_first[tn];
      f1 = tile_end[tn];
#pragma unroll
      for (int m = 0; m < kOhEpt; ++m) ent[m] = k.load_entry(bn, f0, f1, f0 + (tid >> 6) + 2 * m);
    }
    if (tid < 2) poison[cur ^ 1][tid] = 0;
    __syncthreads();
    // Products: warp rows [16 warp, +16) x DIM, K = kOhRows.
    const uint32_t sa_hi = cuda_fwd::smem_u32(a_hi), sa_lo = cuda_fwd::smem_u32(a_lo);
    const uint32_t sb = stage0 + cur * K::kStage;
    const int ar = warp * 16 + (lane & 15);
#pragma unroll
    for (int kk = 0; kk < kOhRows / 16; ++kk) {
      uint32_t ah[4], al[4];
      const int ac = 2 * kk + (lane >> 4);
      const uint32_t aoff = (uint32_t)(ar * 128 + ((ac ^ (ar & 7)) << 4));
      cuda_fwd::ldsm_x4(ah[0], ah[1], ah[2], ah[3], sa_hi + aoff);
      cuda_fwd::ldsm_x4(al[0], al[1], al[2], al[3], sa_lo + aoff);
      const int br = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int np = 0; np < DIM / 16; ++np) {
        const int bc = 2 * np + (lane >> 4);
        uint32_t bf[4];
        ldsm_x4_trans(bf[0], bf[1], bf[2], bf[3], sb + br * K::KCB + ((bc ^ (br & 7)) << 4));
        cuda_fwd::Mma<__nv_bfloat16>::run(acc[2 * np], ah, bf);
        cuda_fwd::Mma<__nv_bfloat16>::run(acc[2 * np], al, bf);
        cuda_fwd::Mma<__nv_bfloat16>::run(acc[2 * np + 1], ah, bf + 2);
        cuda_fwd::Mma<__nv_bfloat16>::run(acc[2 * np + 1], al, bf + 2);
      }
    }
    __syncthreads();
  }

  // Epilogue: rows 16 warp + gid (+ 8), columns 8 j + 2 tig (+ 1).
  O* out = static_cast<O*>(is_dd ? p.dd : p.dq);
  const int gid = lane >> 2, tig = lane & 3;
  const bool fix = any_flag != 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + gid + 8 * h;
    int64_t row;
    if (is_dd) {
      row = fixed * kOhRows + r;
      if (row >= p.Td) continue;
    } else {
      int64_t i;
      int s;
      row = k.query_row(fixed, r, i, s);
      if (row < 0) continue;
    }
    O* dst = out + row * DIM;
#pragma unroll
    for (int j = 0; j < DIM / 8; ++j) {
      const int c = 8 * j + 2 * tig;
      float v0 = acc[j][2 * h], v1 = acc[j][2 * h + 1];
      if (fix) {
        const int idx = r * DIM + c;
        const uint32_t f = flags[idx >> 2] >> ((idx & 3) * 8);
        v0 = apply_flags(v0, f & 0xffu);
        v1 = apply_flags(v1, (f >> 8) & 0xffu);
      }
      if constexpr (std::is_same<O, float>::value) {
        *reinterpret_cast<float2*>(dst + c) = make_float2(v0, v1);
      } else {
        *reinterpret_cast<uint32_t*>(dst + c) = pack2<O>(v0, v1);
      }
    }
  }
  if (!is_dd) {
    // The gaps after this block's queries (and before query 0) are its rows.
    constexpr int kVecO = 16 / (int)sizeof(O);
    for (int q = 0; q < qpb; ++q) {
      const int64_t i = fixed * qpb + q;
      if (i >= p.Nq) break;
      int64_t z0, z1;
      seg_gap(p.q_start, seg_rows(p.q_start, p.q_len, i, p.lq, p.Tq), i, p.Nq, p.Tq, z0, z1);
      const int64_t pre = i == 0 ? clamp_row(p.q_start[0], p.Tq) : 0;
      const float z[kVecO] = {};
      for (int64_t e = tid; e < (z1 > z0 ? z1 - z0 : 0) * (DIM / kVecO) + pre * (DIM / kVecO); e += kOhThreads) {
        const int64_t rr = e / (DIM / kVecO), cc = (e % (DIM / kVecO)) * kVecO;
        const int64_t row = rr < pre ? rr : z0 + (rr - pre);
        store_out<O, kVecO>(out + row * DIM + cc, z);
      }
    }
  }
}

}  // namespace cuda_bwd
}  // namespace maxsim
