// Shared pieces of the CUDA forward kernels: the launch parameters, pair /
// segment resolution, the NaN-aware running max, PTX wrappers (cp.async,
// ldmatrix, mma.sync) and the tile epilogue that turns per-row maxima into
// scores / argmax rows (direct mode) or per-row partials (row mode, reduced by
// the finalize kernels in a fixed order).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "check.h"
#include "forward_plan.h"
#include "pdl.cuh"
#include "search_keys.h"

namespace maxsim {
namespace cuda_fwd {

constexpr int kCrossL = 0, kGroupedL = 1, kListL = 2;
// Host-internal (never an op's layout argument): LIST pairs given as search
// keys, pair p = (p / pair_kc, the id of pair_keys[p]); the streaming kernel
// only (rescore_topk.cu).
constexpr int kKeysL = 3;

struct FwdParams {
  const char* q;  // [Tq, dim] raw bytes
  const char* d;  // [Td, dim]
  const int* q_start;
  const int* q_len;
  const bool* q_mask;  // nullable
  const int* d_start;
  const int* d_len;
  const bool* d_mask;  // nullable
  const int* pair_q;   // LIST only
  const int* pair_d;
  const int64_t* pair_keys;  // kKeysL only: [Nq, pair_kc] search keys
  int64_t pair_kc;
  // Per-token scales: the value of token row r is scale[r] * stored row.
  // 8-bit tokens (forward_quant) always; float tokens under `normalize`
  // (inverse row norms); else null.
  const float* q_scale;  // [Tq]
  const float* d_scale;  // [Td]
  // forward_quant's promise that d_scale is constant (and > 0) within each
  // document: the wgmma kernel then applies it to the row maxima.
  int d_scale_per_doc;
  int64_t Tq, Td;
  int64_t row_bytes;  // dim * element size
  int64_t Nq, Nd, P, K;  // K: docs per query (GROUPED), >= 1
  int layout;
  int lq;
  // Tiling (set by the host for the chosen kernel).
  int qpt;  // queries stacked in one M tile (CROSS only, else 1)
  int tpq;  // M tiles per query (lq > BM), else 1
  int64_t mt_total;  // M tiles per "u" (doc for CROSS/GROUPED, pair for LIST)
  int S;             // doc splits (each split: a BN-aligned chunk of tokens)
  int kch;           // k chunks (MMA path)
  int ksteps_last;   // 32-byte k steps holding data in the last k chunk (MMA path)
  int64_t row_bytes_pad;  // row_bytes rounded up to 32: bytes past it are never read
  int vecb;          // cp.async width in bytes (MMA path): 16, 8 or 4
  int row_mode;      // 0 direct, 1 tile partial sums, 2 per-row partials (see finish_tile)
  // Several docs per CTA (MMA path, S == 1, CROSS / GROUPED only; 1 = one
  // item per CTA as decode_work). Docs come in groups of gsz consecutive docs
  // sharing the query tile (all docs for CROSS, the K docs of a query for
  // GROUPED); a CTA takes up to dpc consecutive docs of one group, so its
  // query tile is the same for all of them. cpg = ceil(gsz / dpc).
  int dpc;
  int64_t gsz, cpg;
  int qrows;  // packed kernel: query rows per slot (a power of two >= lq)
  // Streaming kernel: warps per pair (1, 2, 4), stream_il (bit 0: the
  // whole-sector lane layout, bit 1: a split pair's warps take interleaved
  // tiles instead of contiguous ranges), the per-CTA query staging (<= 0 /
  // < 0: the launcher's heuristic);
  // the last stream_tail pairs split over 4 warps, one pair per CTA after
  // the first stream_head_blocks CTAs (< 0: the launcher's heuristic);
  // stream_keep: plain document loads that leave them in L2 (1: all CTAs,
  // k > 1: the first k) or evict-first streamed loads (0); the launcher
  // turns it into the number of leading CTAs that load plainly (INT32_MAX:
  // all). stream_multiwave:
  // the grid runs in more than one wave (set by the launcher).
  int stream_split, stream_il, stream_qsm, stream_keep, stream_multiwave;
  // Streaming kernel, 16-bit CROSS / GROUPED: every document segment is
  // guessed to start at id * stream_extent (> 0: the host saw Td = Nd x
  // extent), so its first tiles are requested before (start, len) arrive;
  // a wrong guess refetches them. 0: no guess. stream_qextent: the same for
  // the query rows (Tq = Nq x qextent), staged by cp.async before their
  // segment's (start, len) arrive.
  int64_t stream_extent, stream_qextent;
  int64_t stream_tail, stream_head_blocks;
  // Streaming kernels, runs of pairs (forward_stream_run.cuh,
  // forward_stream_wg.cuh): pairs per warp's (CTA's) run (0: one pair per
  // warp or CTA, or split pairs) and runs per group (the K candidates of a
  // query, or every pair of one CROSS query).
  int stream_run;
  int64_t stream_rpg;
  // Outputs.
  float* scores;
  void* argmax;
  int argmax_kind;
  float* ws_best;  // row_mode 1: [tpq, P]; row_mode 2: [S, P, lq]
  int* ws_idx;     // row_mode 2: [S, P, lq] (argmax only)
  // kKeysL with a fused top-k (streaming kernel): rank_done [Nq] zeroed
  // counters of scored pairs per row; the CTA that completes row n ranks its
  // pair_kc scores and writes the top rank_k decoded to rank_scores /
  // rank_ids [Nq, rank_k].
  int* rank_done;
  int64_t rank_k;
  float* rank_scores;
  int64_t* rank_ids;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// int8 with one scale per document keeps row maxima as raw s32 dot products
// in float registers; -inf's bits (0xff800000 = -2^23 as an integer) mean
// "no column yet" and sort below every dot product of <= 256 int8 pairs
// (|x| <= 2^22). The maximum as fp32 (exact), -inf if no column counted.
__device__ __forceinline__ float s32_max_value(float bits) {
  const int b = __float_as_int(bits);
  return b == __float_as_int(neg_inf()) ? neg_inf() : (float)b;
}

// max that propagates NaN (PTX max.NaN, sm_80+).
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Running (max, argmax) update for a column visited in increasing index
// order: NaN wins (first NaN kept), ties keep the earlier (lower) index, -inf
// (masked) never wins.
__device__ __forceinline__ void upd_arg(float& best, int& idx, float v, int col) {
  float m = max_nan(best, v);
  bool take = __float_as_int(m) != __float_as_int(best);
  idx = take ? col : idx;
  best = m;
}

// Merge of two partial (max, argmax) states under the total order
// "NaN > any value; larger value; equal value -> lower index"; idx < 0 is
// the empty state. Commutative, so any fixed merge tree is deterministic.
__device__ __forceinline__ void merge_arg(float& b, int& i, float ob, int oi) {
  bool take;
  if (oi < 0) {
    take = false;
  } else if (i < 0) {
    take = true;
  } else {
    bool bn = b != b, on = ob != ob;
    if (bn || on)
      take = on && (!bn || oi < i);
    else
      take = ob > b || (ob == b && oi < i);
  }
  if (take) {
    b = ob;
    i = oi;
  }
}

// ---------------------------------------------------------------------------
// Segment / pair resolution. A segment that is invalid (len < 0, id out of
// range, rows outside the tensor) makes every pair touching it NaN.
// ---------------------------------------------------------------------------
// Both words of a segment load before either is tested, with no branch on a
// loaded value in between: a caller's segment loads for several ids (the
// streaming kernel's query, document and staged query) then share one L2
// round trip. Branches here made them a chain of dependent loads, the
// largest part of the streaming kernel's fixed cost per CTA.
__device__ __forceinline__ bool query_ok(const FwdParams& p, int64_t n, int& qs, int& ql) {
  const bool in = n >= 0 && n < p.Nq;
  const int s = in ? p.q_start[n] : 0, len = in ? p.q_len[n] : -1;
  const int l = min(len, p.lq);
  const bool ok = len >= 0 && s >= 0 && (int64_t)s + l <= p.Tq;
  qs = ok ? s : 0;
  ql = ok ? l : 0;
  return ok;
}

__device__ __forceinline__ bool doc_ok(const FwdParams& p, int64_t dn, int& ds, int& dl) {
  const bool in = dn >= 0 && dn < p.Nd;
  const int s = in ? p.d_start[dn] : 0, len = in ? p.d_len[dn] : -1;
  const bool ok = len >= 0 && s >= 0 && (int64_t)s + len <= p.Td;
  ds = ok ? s : 0;
  dl = ok ? len : 0;
  return ok;
}

// Pair p -> (query id, doc id); ids may be out of range (then invalid).
__device__ __forceinline__ void pair_ids(const FwdParams& p, int64_t pr, int64_t& n, int64_t& dn) {
  if (p.layout == kCrossL) {
    n = pr / p.Nd;
    dn = pr - n * p.Nd;
  } else if (p.layout == kGroupedL) {
    n = pr / p.K;
    dn = pr;
  } else if (p.layout == kListL) {
    n = p.pair_q[pr];
    dn = p.pair_d[pr];
  } else {  // kKeysL: an empty slot -> id -1, invalid
    n = pr / p.pair_kc;
    dn = search_keys::id_of(p.pair_keys[pr]);
  }
}

// Work item (one CTA): M tile mt, doc split s, "u" = doc (CROSS / GROUPED) or
// pair (LIST). The M tile index varies fastest so CTAs sharing a doc run
// together (the doc is read from DRAM once, then from L2).
struct Work {
  int mt, s;
  int64_t u;
  int64_t dn;
  bool dvalid;
  int ds, dl;
  int c0, c1;  // token range [c0, c1) of this split within the doc
};

template <int BN>
__device__ __forceinline__ Work decode_work(const FwdParams& p, int64_t item) {
  Work w;
  w.mt = (int)(item % p.mt_total);
  int64_t rest = item / p.mt_total;
  w.s = (int)(rest % p.S);
  w.u = rest / p.S;
  w.dn = (p.layout == kListL) ? (int64_t)p.pair_d[w.u] : w.u;
  w.dvalid = doc_ok(p, w.dn, w.ds, w.dl);
  int chunk = (w.dl + p.S - 1) / p.S;
  chunk = (chunk + BN - 1) / BN * BN;
  long long c0 = (long long)w.s * chunk;
  long long c1 = c0 + chunk;
  if (c1 > w.dl) c1 = w.dl;
  if (c0 > c1) c0 = c1;
  w.c0 = (int)c0;
  w.c1 = (int)c1;
  return w;
}

// Query of slot k of the CTA's M tile (slots exist for k < qpt when CROSS).
__device__ __forceinline__ int64_t slot_query(const FwdParams& p, const Work& w, int k) {
  if (p.layout == kCrossL) return (int64_t)(w.mt / p.tpq) * p.qpt + k;
  if (p.layout == kGroupedL) return w.u / p.K;
  return p.pair_q[w.u];
}

__device__ __forceinline__ int64_t slot_pair(const FwdParams& p, const Work& w, int64_t n) {
  return p.layout == kCrossL ? n * p.Nd + w.u : w.u;
}

__device__ __forceinline__ bool slot_exists(const FwdParams& p, int64_t n, int k) {
  return p.layout == kCrossL ? (n < p.Nq) : (k == 0);
}

// Row r of an M tile of BM rows -> (slot k, row i within the query).
__device__ __forceinline__ void tile_row(const FwdParams& p, int BM, int mt, int r, int& k, int& i) {
  if (p.tpq > 1) {
    k = 0;
    i = (mt % p.tpq) * BM + r;
  } else {
    k = r / p.lq;
    i = r - k * p.lq;
  }
}

// Rows of slot k's query held by M tile t (t = mt % tpq) of BM rows: query
// rows i in [i0, i1), at tile row rbase + i.
__device__ __forceinline__ void slot_rows(const FwdParams& p, int BM, int t, int k, int& i0, int& i1, int& rbase) {
  if (p.tpq > 1) {
    i0 = t * BM;
    i1 = min(p.lq, i0 + BM);
    rbase = -i0;
  } else {
    i0 = 0;
    i1 = p.lq;
    rbase = k * p.lq;
  }
}

// Fills the row table of the CTA: global query row to load (-1: zero) and
// whether the row counts (valid query, i < q_len, not masked).
template <int BM, int NTH>
__device__ __forceinline__ void build_row_table(const FwdParams& p, const Work& w, long long* row_src,
                                                unsigned char* row_ok) {
  for (int r = threadIdx.x; r < BM; r += NTH) {
    int k, i;
    tile_row(p, BM, w.mt, r, k, i);
    long long src = -1;
    bool ok = false;
    int nslots = p.layout == kCrossL ? p.qpt : 1;
    if (k < nslots && i < p.lq) {
      int64_t n = slot_query(p, w, k);
      int qs, ql;
      if (slot_exists(p, n, k) && query_ok(p, n, qs, ql) && i < ql) {
        src = (long long)qs + i;
        ok = p.q_mask == nullptr || p.q_mask[src];
      }
    }
    row_src[r] = src;
    row_ok[r] = ok;
  }
}

__device__ __forceinline__ void store_argmax(const FwdParams& p, int64_t idx, int v) {
  if (p.argmax_kind == 1)
    static_cast<int*>(p.argmax)[idx] = v;
  else
    static_cast<int16_t*>(p.argmax)[idx] = (int16_t)v;
}

// The result stores of every forward kernel (one epilogue contract):
//   store_score      a pair's final score; NaN for an invalid pair.
//   store_pair_sum   a slot's row sum: the score (row_mode 0) or the tile
//                    partial ws_best[t * P + pair] (row_mode 1).
//   store_row_partial  a row's (max, argmax) of doc split s (row_mode 2).
__device__ __forceinline__ void store_score(const FwdParams& p, int64_t pr, bool ok, float sum) {
  p.scores[pr] = ok ? sum : __int_as_float(0x7fc00000);
}

__device__ __forceinline__ void store_pair_sum(const FwdParams& p, int64_t pr, int t, bool ok, float sum) {
  if (p.row_mode == 0)
    store_score(p, pr, ok, sum);
  else
    p.ws_best[(int64_t)t * p.P + pr] = sum;
}

template <bool ARG>
__device__ __forceinline__ void store_row_partial(const FwdParams& p, int s, int64_t pr, int i, float best, int idx) {
  const int64_t o = ((int64_t)s * p.P + pr) * p.lq + i;
  p.ws_best[o] = best;
  if (ARG) p.ws_idx[o] = idx;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Tile epilogue. rb/ri: per-row max / argmax over this CTA's doc chunk
// (rb = -inf: no valid doc token).
//   row_mode 0 (direct): one warp per query slot sums its rows in a fixed
//     order and writes score + argmax row.
//   row_mode 1 (tile partial; S == 1, lq > BM): the same for the BM rows of
//     this tile; argmax rows are final, the partial sum goes to
//     ws_best[t * P + pair] and finalize_partial_kernel adds the tpq partials.
//   row_mode 2 (doc split, S > 1): per-row (max, argmax) partials go to
//     ws_best / ws_idx [S, P, lq]; finalize_rows_kernel merges them.
template <int BM, int NTH, bool ARG>
__device__ __forceinline__ void finish_tile(const FwdParams& p, const Work& w, const float* rb, const int* ri,
                                            const unsigned char* row_ok) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int NW = NTH / 32;
  const int nslots = p.layout == kCrossL ? p.qpt : 1;
  if (p.row_mode <= 1) {
    const int t = w.mt % p.tpq;
    for (int k = warp; k < nslots; k += NW) {
      int64_t n = slot_query(p, w, k);
      if (!slot_exists(p, n, k)) continue;
      int qs, ql;
      bool ok = query_ok(p, n, qs, ql) && w.dvalid;
      int64_t pr = slot_pair(p, w, n);
      int i0, i1, rbase;
      slot_rows(p, BM, t, k, i0, i1, rbase);
      float sum = 0.f;
      for (int i = i0 + lane; i < i1; i += 32) {
        int r = rbase + i;
        float v = rb[r];
        bool use = ok && row_ok[r] && v != neg_inf();
        sum += use ? v : 0.f;
        if (ARG) store_argmax(p, pr * p.lq + i, use ? ri[r] : -1);
      }
      sum = warp_sum(sum);
      if (lane == 0) store_pair_sum(p, pr, t, ok, sum);
    }
  } else {
    for (int r = threadIdx.x; r < BM; r += NTH) {
      if (!row_ok[r]) continue;
      int k, i;
      tile_row(p, BM, w.mt, r, k, i);
      int64_t n = slot_query(p, w, k);
      int64_t pr = slot_pair(p, w, n);
      store_row_partial<ARG>(p, w.s, pr, i, rb[r], ri[r]);
    }
  }
}

// ---------------------------------------------------------------------------
// PTX wrappers.
// ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

template <int B>
__device__ __forceinline__ void cp_async(uint32_t dst, const void* src, bool pred) {
  int sz = pred ? B : 0;
  if constexpr (B == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(sz) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(B), "r"(sz)
                 : "memory");
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ void ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// One k-step of 32 bytes per row: m16n8k16 for fp16 / bf16, m16n8k8 for tf32.
template <typename T>
struct Mma;

template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ float value(float acc) { return acc; }
  // Sum of squares of the elements of one fragment register (normalize).
  static __device__ __forceinline__ float sumsq(uint32_t r) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&r));
    return fmaf(f.x, f.x, f.y * f.y);
  }
};
template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ float value(float acc) { return acc; }
  static __device__ __forceinline__ float sumsq(uint32_t r) {
    const float a = __uint_as_float(r << 16), b = __uint_as_float(r & 0xffff0000u);
    return fmaf(a, a, b * b);
  }
};
template <>
struct Mma<float> {  // TF32 (operands passed as raw fp32 bits)
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ float value(float acc) { return acc; }
  static __device__ __forceinline__ float sumsq(uint32_t r) {
    const float a = __uint_as_float(r);
    return a * a;
  }
};

// fp32 tokens as split TF32 pairs (3xTF32): x = hi + lo with hi = tf32(x),
// lo = tf32(x - hi) (round to nearest), and a*b ~ ahi*bhi + ahi*blo + alo*bhi
// with fp32 accumulation; the dropped alo*blo and lo's rounding are ~2^-22
// relative, so products agree with fp32 to about 1e-7 (plain TF32: ~5e-4).
// The token type of the split path: the kernels read the same fp32 rows as
// Mma<float>; split_tf32 turns a fragment register into its (hi, lo) pair.
struct Tf32x3 {};
__device__ __forceinline__ void split_tf32(uint32_t x, uint32_t& hi, uint32_t& lo) {
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(hi) : "f"(__uint_as_float(x)));
  float r = __uint_as_float(x) - __uint_as_float(hi);
  r = r == r ? r : 0.f;  // x = +-inf: hi carries it (a NaN lo would turn inf scores into NaN)
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(lo) : "f"(r));
}
template <>
struct Mma<Tf32x3> {
  // One k step from split fragments (small terms first).
  static __device__ __forceinline__ void run3(float* c, const uint32_t* ahi, const uint32_t* alo,
                                              const uint32_t* bhi, const uint32_t* blo) {
    Mma<float>::run(c, alo, bhi);
    Mma<float>::run(c, ahi, blo);
    Mma<float>::run(c, ahi, bhi);
  }
  static __device__ __forceinline__ float value(float acc) { return acc; }
  static __device__ __forceinline__ float sumsq(uint32_t r) { return Mma<float>::sumsq(r); }
};
template <typename T>
constexpr bool kIsSplit = std::is_same<T, Tf32x3>::value;

// 8-bit k-step (m16n8k32): its A / B fragments hold the same bytes as the
// 16-bit m16n8k16 ones (4 consecutive bytes of a row per register), so the
// byte-addressed tiles and ldmatrix offsets of the kernel serve unchanged.
// int8 accumulates exactly in int32, carried in the float registers' bits.
template <>
struct Mma<int8_t> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
    uint32_t c0 = __float_as_uint(c[0]), c1 = __float_as_uint(c[1]), c2 = __float_as_uint(c[2]),
             c3 = __float_as_uint(c[3]);
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(c0), "+r"(c1), "+r"(c2), "+r"(c3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    c[0] = __uint_as_float(c0);
    c[1] = __uint_as_float(c1);
    c[2] = __uint_as_float(c2);
    c[3] = __uint_as_float(c3);
  }
  static __device__ __forceinline__ float value(float acc) { return (float)__float_as_int(acc); }
};
template <>
struct Mma<__nv_fp8_e4m3> {  // sm_89+; the host never launches it on older GPUs
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();
#endif
  }
  static __device__ __forceinline__ float value(float acc) { return acc; }
};

template <typename T>
constexpr bool kIsQuant = std::is_same<T, int8_t>::value || std::is_same<T, __nv_fp8_e4m3>::value;

}  // namespace cuda_fwd
}  // namespace maxsim
