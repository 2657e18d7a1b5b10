// maxsim Metal kernels: exact MaxSim forward (scores + argmax) and the
// deterministic backward from the saved argmax. Contract: torch-ext/torch_binding.h.
//
// Kernels (one per dtype: _f32, _f16, _bf16):
//   maxsim_fwd_mma_*   forward, simdgroup_matrix 8x8 multiply-accumulate tiles
//                      (fp32 fragments and accumulators), documents streamed
//                      through threadgroup memory, running max/argmax in registers
//   maxsim_fwd_simt_*  same tiling, scalar FMA per thread; for GPUs without
//                      simdgroup_matrix (pre-Apple7)
//   maxsim_bwd_dq_*    dq rows, each owned by one SIMD group
//   maxsim_bwd_dd_*    dd rows, each owned by one SIMD group
// No atomics anywhere: every output element has exactly one writer and sums
// run in a fixed order, so results are bitwise reproducible.
//
// Exactness: fp16/bf16 values are converted to fp32 when staged, products of
// two fp16/bf16 values are exact in fp32 and accumulation is fp32 throughout.
// NaN tests use the bit pattern, so the kernels behave the same with or
// without fast-math.
//
// This file is also compiled as C++17 by the emulator in emu/, which defines
// the Metal vocabulary (address spaces, vector types, simd_* functions,
// simdgroup_matrix, barriers) and maps the MS_ATTR(...) attributes to the
// values a Metal dispatch would bind. Keep every attribute behind MS_ATTR.
#if defined(__METAL_VERSION__)
#include <metal_stdlib>
using namespace metal;
#define MS_ATTR(x) [[x]]
#define MS_REGISTER_KERNEL(name)
#elif !defined(MS_EMULATOR)
#error "maxsim.metal is Metal Shading Language; on the host it only builds through maxsim-metal/emu/"
#endif

#include "launch_geometry.h"

// ---------------------------------------------------------------------------
// dtypes. bf16 is carried as its raw bits (Metal's `bfloat` needs MSL 3.1;
// the bit conversion below is exact and works with any language version).
// ---------------------------------------------------------------------------
struct ms_bf16 {
  ushort bits;
};

// Element i of a device array, as fp32 (exact for every dtype).
inline float ms_load(device const float* p, long i) { return p[i]; }
inline float ms_load(device const half* p, long i) { return float(p[i]); }
inline float ms_load(device const ms_bf16* p, long i) { return as_type<float>(uint(p[i].bits) << 16); }

inline bool ms_isnan(float x) { return (as_type<uint>(x) & 0x7fffffffu) > 0x7f800000u; }
inline float ms_nan() { return as_type<float>(0x7fc00000u); }

// float -> bf16, round to nearest even (what torch does), NaN -> quiet NaN.
inline ushort ms_bf16_bits(float x) {
  uint u = as_type<uint>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ushort(0x7fc0u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return ushort(u >> 16);
}

inline void ms_store(device float* p, long i, float v) { p[i] = v; }
inline void ms_store(device half* p, long i, float v) { p[i] = half(v); }
inline void ms_store(device ms_bf16* p, long i, float v) { p[i].bits = ms_bf16_bits(v); }

inline void ms_put_argmax(device uchar* raw, int kind, long off, int v) {
  if (kind == MS_ARGMAX_I32)
    ((device int*)raw)[off] = v;
  else
    ((device short*)raw)[off] = short(v);
}

inline int ms_get_argmax(device const uchar* raw, int kind, long off) {
  if (kind == MS_ARGMAX_I32) return ((device const int*)raw)[off];
  return int(((device const short*)raw)[off]);
}

// ---------------------------------------------------------------------------
// Segments. A segment is invalid (-1) when its id is out of range, its length
// is negative or its rows leave the tensor; every pair touching it is NaN.
// ---------------------------------------------------------------------------
inline int ms_query_rows(device const int* q_start, device const int* q_len, long n, long Nq,
                         int lq, long Tq, thread int& start) {
  start = 0;
  if (n < 0 || n >= Nq) return -1;
  const int s = q_start[n];
  const int len = q_len[n];
  if (len < 0) return -1;
  const int rows = len < lq ? len : lq;
  if (rows > 0 && (s < 0 || long(s) + long(rows) > Tq)) return -1;
  start = s;
  return rows;
}

inline int ms_doc_rows(device const int* d_start, device const int* d_len, long m, long Nd, long Td,
                       thread int& start) {
  start = 0;
  if (m < 0 || m >= Nd) return -1;
  const int s = d_start[m];
  const int len = d_len[m];
  if (len < 0) return -1;
  if (len > 0 && (s < 0 || long(s) + long(len) > Td)) return -1;
  start = s;
  return len;
}

// Running (max, argmax) merge under the total order "NaN above everything,
// then larger value, equal values -> lower index"; idx < 0 is the empty state.
// Commutative, so any merge tree gives the same answer (NaN -> first NaN,
// ties -> lowest index, as torch.max).
inline void ms_merge(thread float& best, thread int& idx, float ob, int oi) {
  if (oi < 0) return;
  bool take;
  if (idx < 0) {
    take = true;
  } else {
    const bool bn = ms_isnan(best);
    const bool on = ms_isnan(ob);
    if (bn || on)
      take = on && (!bn || oi < idx);
    else
      take = ob > best || (ob == best && oi < idx);
  }
  if (take) {
    best = ob;
    idx = oi;
  }
}

// ---------------------------------------------------------------------------
// Forward: staging of the query tile (rows from the row table, -1 = zero row)
// and of a document chunk, both converted to fp32 and zero-padded.
// ---------------------------------------------------------------------------
// Columns go to consecutive threads (coalesced reads, conflict-free writes);
// MS_NT / MS_BK rows per pass, no integer division.
template <typename T>
inline void ms_stage_q(threadgroup float* Qs, int qld, threadgroup const int* rowsrc,
                       device const T* q, int dim, int k0, int kc, uint tid) {
  for (int c0 = 0; c0 < kc; c0 += MS_BK) {
    const int k = c0 + int(tid) % MS_BK;
    if (k >= kc) continue;
    const int kg = k0 + k;
    for (int r = int(tid) / MS_BK; r < MS_BM; r += MS_NT / MS_BK) {
      const int src = rowsrc[r];
      Qs[r * qld + k] = (src >= 0 && kg < dim) ? ms_load(q, long(src) * dim + kg) : 0.f;
    }
  }
}

template <typename T>
inline void ms_stage_d(threadgroup float* Ds, device const T* d, int ds, int dl, int j0, int dim,
                       int k0, int kc, uint tid) {
  const int k = int(tid) % MS_BK;
  if (k >= kc) return;
  const int kg = k0 + k;
  for (int c = int(tid) / MS_BK; c < MS_BN; c += MS_NT / MS_BK) {
    const int j = j0 + c;
    Ds[c * MS_DS_LD + k] = (j < dl && kg < dim) ? ms_load(d, (long(ds) + j) * dim + kg) : 0.f;
  }
}

// ---- matrix path: each SIMD group owns a 16 x 16 block of the 32 x 32 tile.
struct MsMmaAcc {
  simdgroup_float8x8 m[MS_FM][MS_FN];
};

inline void ms_acc_init(thread MsMmaAcc& a) {
  for (int i = 0; i < MS_FM; ++i)
    for (int j = 0; j < MS_FN; ++j) a.m[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.f);
}

// acc += Qs[rows, 0:kc] * Ds[cols, 0:kc]^T (the document chunk is loaded
// transposed, so no transposed copy is ever written).
inline void ms_acc_step(thread MsMmaAcc& a, threadgroup const float* Qs, int qld,
                        threadgroup const float* Ds, int kc, uint sgid, uint /*tid*/) {
  const int r0 = int(sgid / MS_SGN) * (MS_FM * 8);
  const int c0 = int(sgid % MS_SGN) * (MS_FN * 8);
  for (int kk = 0; kk < kc; kk += 8) {
    simdgroup_float8x8 am[MS_FM];
    simdgroup_float8x8 bm[MS_FN];
    for (int i = 0; i < MS_FM; ++i) simdgroup_load(am[i], Qs + (r0 + 8 * i) * qld + kk, ulong(qld));
    for (int j = 0; j < MS_FN; ++j)
      simdgroup_load(bm[j], Ds + (c0 + 8 * j) * MS_DS_LD + kk, ulong(MS_DS_LD), ulong2(0, 0), true);
    for (int i = 0; i < MS_FM; ++i)
      for (int j = 0; j < MS_FN; ++j) simdgroup_multiply_accumulate(a.m[i][j], am[i], bm[j], a.m[i][j]);
  }
}

// Hands the tile to the fold: accumulators -> S, then each thread reads its
// row's columns fq, fq + MS_TPR, ...
inline void ms_acc_finish(thread MsMmaAcc& a, threadgroup float* S, uint sgid, uint tid,
                          thread float* vals) {
  const int r0 = int(sgid / MS_SGN) * (MS_FM * 8);
  const int c0 = int(sgid % MS_SGN) * (MS_FN * 8);
  for (int i = 0; i < MS_FM; ++i)
    for (int j = 0; j < MS_FN; ++j)
      simdgroup_store(a.m[i][j], S + (r0 + 8 * i) * MS_S_LD + c0 + 8 * j, ulong(MS_S_LD));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int fr = int(tid) / MS_TPR;
  const int fq = int(tid) % MS_TPR;
  for (int e = 0; e < MS_CPT; ++e) vals[e] = S[fr * MS_S_LD + fq + MS_TPR * e];
}

// ---- scalar path: each thread computes its own fold entries directly.
struct MsSimtAcc {
  float v[MS_CPT];
};

inline void ms_acc_init(thread MsSimtAcc& a) {
  for (int e = 0; e < MS_CPT; ++e) a.v[e] = 0.f;
}

inline void ms_acc_step(thread MsSimtAcc& a, threadgroup const float* Qs, int qld,
                        threadgroup const float* Ds, int kc, uint /*sgid*/, uint tid) {
  const int fr = int(tid) / MS_TPR;
  const int fq = int(tid) % MS_TPR;
  threadgroup const float* qrow = Qs + fr * qld;
  for (int k = 0; k < kc; ++k) {
    const float qv = qrow[k];
    for (int e = 0; e < MS_CPT; ++e) a.v[e] = fma(qv, Ds[(fq + MS_TPR * e) * MS_DS_LD + k], a.v[e]);
  }
}

inline void ms_acc_finish(thread MsSimtAcc& a, threadgroup float* /*S*/, uint /*sgid*/,
                          uint /*tid*/, thread float* vals) {
  for (int e = 0; e < MS_CPT; ++e) vals[e] = a.v[e];
}

// ---------------------------------------------------------------------------
// Forward. One threadgroup per work unit: (block of qpt queries, document)
// for CROSS, a pair otherwise. Its query rows are processed in M tiles of
// MS_BM rows (several short queries stacked in one tile, or one long query
// in consecutive tiles); for each tile the document is streamed in chunks of
// MS_BN tokens x MS_BK dims. Threadgroup memory does not depend on Lq, Ld or
// dim (the query tile is resident only while dim <= MS_QRES_MAX).
// ---------------------------------------------------------------------------
template <typename T, typename Acc>
inline void ms_fwd_body(device const T* q, device const T* d, device const int* q_start,
                        device const int* q_len, device const int* d_start,
                        device const int* d_len, device const uchar* q_mask,
                        device const uchar* d_mask, device const int* pair_q,
                        device const int* pair_d, device float* scores, device uchar* argmax,
                        constant MsFwdParams& p, threadgroup uchar* smem, uint3 tgpig, uint tid,
                        uint sgid) {
  const long item = long(tgpig.y) * long(p.grid_x) + long(tgpig.x);
  if (item >= p.units) return;

  threadgroup float* Qs = (threadgroup float*)(smem + p.off_qs);
  threadgroup float* Ds = (threadgroup float*)(smem + p.off_ds);
  threadgroup float* S = (threadgroup float*)(smem + p.off_s);
  threadgroup int* colok = (threadgroup int*)(smem + p.off_colok);
  threadgroup int* rowsrc = (threadgroup int*)(smem + p.off_rowsrc);
  threadgroup float* rowval = (threadgroup float*)(smem + p.off_rowval);

  // Work unit -> document m, first query n0, slots, pair of slot s = pair0 + s * pstride.
  long m;
  long n0;
  long pair0;
  long pstride = 0;
  int nslots = 1;
  if (p.layout == MS_CROSS) {
    m = item / p.nblk;
    const long b = item - m * p.nblk;
    n0 = b * p.qpt;
    const long left = p.Nq - n0;
    nslots = left < long(p.qpt) ? int(left) : p.qpt;
    pair0 = n0 * p.Nd + m;
    pstride = p.Nd;
  } else if (p.layout == MS_GROUPED) {
    m = item;
    n0 = item / p.K;
    pair0 = item;
  } else {
    m = pair_d[item];
    n0 = pair_q[item];
    pair0 = item;
  }
  int ds = 0;
  const int dl = ms_doc_rows(d_start, d_len, m, p.Nd, p.Td, ds);
  const int stride = p.qpt > 1 ? p.lq : int(MS_BM);  // rows per slot in the tile
  int nsub = 0;                                        // M tiles to run
  if (dl >= 0) {
    if (p.qpt > 1) {
      nsub = 1;
    } else {
      int qs0 = 0;
      const int rows0 = ms_query_rows(q_start, q_len, n0, p.Nq, p.lq, p.Tq, qs0);
      nsub = rows0 > 0 ? (rows0 + MS_BM - 1) / MS_BM : 0;
    }
  }

  const int fr = int(tid) / MS_TPR;  // fold row of this thread
  const int fq = int(tid) % MS_TPR;  // its lane within the row
  float slot_sum = 0.f;              // threads tid < nslots: score of slot tid

  for (int t = 0; t < nsub; ++t) {
    // Row table: global query row of each tile row, -1 = padding / masked.
    if (int(tid) < MS_BM) {
      const int r = int(tid);
      const int s = r / stride;
      const int i = t * MS_BM + (r - s * stride);
      int src = -1;
      if (s < nslots) {
        int qs = 0;
        const int rows = ms_query_rows(q_start, q_len, n0 + s, p.Nq, p.lq, p.Tq, qs);
        if (i < rows && (p.has_qmask == 0 || q_mask[long(qs) + i] != 0)) src = qs + i;
      }
      rowsrc[r] = src;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (p.q_resident != 0) ms_stage_q(Qs, p.qld, rowsrc, q, p.dim, 0, p.dim_pad, tid);

    float best = 0.f;
    int bidx = -1;
    for (int j0 = 0; j0 < dl; j0 += MS_BN) {
      Acc acc;
      ms_acc_init(acc);
      int k0 = 0;
      do {  // at least once, so that dim == 0 still scores 0
        const int kc = p.dim_pad - k0 < int(MS_BK) ? p.dim_pad - k0 : int(MS_BK);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (k0 == 0 && int(tid) < MS_BN) {
          const int j = j0 + int(tid);
          colok[tid] = (j < dl && (p.has_dmask == 0 || d_mask[long(ds) + j] != 0)) ? 1 : 0;
        }
        ms_stage_d(Ds, d, ds, dl, j0, p.dim, k0, kc, tid);
        if (p.q_resident == 0) ms_stage_q(Qs, p.qld, rowsrc, q, p.dim, k0, kc, tid);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        ms_acc_step(acc, Qs + (p.q_resident != 0 ? k0 : 0), p.qld, Ds, kc, sgid, tid);
        k0 += MS_BK;
      } while (k0 < p.dim_pad);
      float vals[MS_CPT];
      ms_acc_finish(acc, S, sgid, tid, vals);
      for (int e = 0; e < MS_CPT; ++e) {
        const int c = fq + MS_TPR * e;
        if (colok[c] != 0) ms_merge(best, bidx, vals[e], j0 + c);
      }
    }
    // The MS_TPR threads of a row are adjacent lanes of one SIMD group.
    for (int off = 1; off < MS_TPR; off <<= 1) {
      const float ob = simd_shuffle_xor(best, ushort(off));
      const int oi = simd_shuffle_xor(bidx, ushort(off));
      ms_merge(best, bidx, ob, oi);
    }
    if (fq == 0) {
      const int r = fr;
      const int s = r / stride;
      const int i = t * MS_BM + (r - s * stride);
      const bool ok = rowsrc[r] >= 0 && bidx >= 0;
      rowval[r] = ok ? best : 0.f;
      if (p.argmax_kind != MS_ARGMAX_NONE && s < nslots && i < p.lq)
        ms_put_argmax(argmax, p.argmax_kind, (pair0 + long(s) * pstride) * p.lq + i, ok ? bidx : -1);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (int(tid) < nslots) {  // fixed row order: deterministic fp32 sum
      const int s = int(tid);
      const int r1 = (s + 1) * stride < int(MS_BM) ? (s + 1) * stride : int(MS_BM);
      for (int r = s * stride; r < r1; ++r) slot_sum += rowval[r];
    }
  }

  if (int(tid) < nslots) {
    const int s = int(tid);
    int qs = 0;
    const int rows = ms_query_rows(q_start, q_len, n0 + s, p.Nq, p.lq, p.Tq, qs);
    scores[pair0 + long(s) * pstride] = (rows < 0 || dl < 0) ? ms_nan() : slot_sum;
  }
  if (p.argmax_kind != MS_ARGMAX_NONE) {  // argmax rows no tile wrote
    const int covered = nsub == 0 ? 0 : (p.qpt > 1 ? p.lq : (nsub * MS_BM < p.lq ? nsub * MS_BM : p.lq));
    const int rest = p.lq - covered;
    for (int e = int(tid); e < nslots * rest; e += MS_NT) {
      const int s = e / rest;
      const int i = covered + (e - s * rest);
      ms_put_argmax(argmax, p.argmax_kind, (pair0 + long(s) * pstride) * p.lq + i, -1);
    }
  }
}

// ---------------------------------------------------------------------------
// Backward, dq: SIMD group (query n, row i) owns dq[q_start[n] + i] and sums
// grad[p] * d[row argmax[p, i]] over the pairs of n in a fixed order
// (CROSS: by document, GROUPED: by candidate, LIST: the q_ptr/q_pairs CSR).
// ---------------------------------------------------------------------------
template <typename T>
inline void ms_bwd_dq_body(device const float* grad, device const T* d, device const int* q_start,
                           device const int* q_len, device const int* d_start,
                           device const int* d_len, device const int* pair_q,
                           device const int* pair_d, device const uchar* argmax,
                           device const int* q_ptr, device const int* q_pairs, device T* dq,
                           constant MsBwdParams& p, uint3 tgpig, uint sgid, uint lane) {
  const long item = long(tgpig.y) * long(p.grid_x) + long(tgpig.x);
  if (item >= p.units) return;
  const long n = item / p.rblocks;
  const int i = int(item - n * p.rblocks) * MS_NSG + int(sgid);
  int qs = 0;
  const int rows = ms_query_rows(q_start, q_len, n, p.Nq, p.lq, p.Tq, qs);
  if (i >= rows) return;  // also: invalid query (rows < 0)
  long cnt;
  long c0 = 0;
  if (p.layout == MS_CROSS) {
    cnt = p.Nd;
  } else if (p.layout == MS_GROUPED) {
    cnt = p.K;
  } else {
    c0 = q_ptr[n];
    cnt = long(q_ptr[n + 1]) - c0;
  }
  for (int k0 = 0; k0 < p.dim; k0 += MS_BWD_DC) {
    float acc[MS_BWD_VPL];
    for (int v = 0; v < MS_BWD_VPL; ++v) acc[v] = 0.f;
    for (long c = 0; c < cnt; ++c) {
      long pr;
      long m;
      if (p.layout == MS_CROSS) {
        pr = n * p.Nd + c;
        m = c;
      } else if (p.layout == MS_GROUPED) {
        pr = n * p.K + c;
        m = pr;
      } else {
        pr = q_pairs[c0 + c];
        if (pr < 0 || pr >= p.P || long(pair_q[pr]) != n) continue;
        m = pair_d[pr];
      }
      if (pr >= p.P) continue;
      int ds = 0;
      const int dl = ms_doc_rows(d_start, d_len, m, p.Nd, p.Td, ds);
      if (dl <= 0) continue;
      const int a = ms_get_argmax(argmax, p.argmax_kind, pr * p.lq + i);
      if (a < 0 || a >= dl) continue;
      const float g = grad[pr];
      device const T* src = d + (long(ds) + a) * p.dim;
      for (int v = 0; v < MS_BWD_VPL; ++v) {
        const int k = k0 + int(lane) + MS_SIMD * v;
        if (k < p.dim) acc[v] += g * ms_load(src, k);
      }
    }
    for (int v = 0; v < MS_BWD_VPL; ++v) {
      const int k = k0 + int(lane) + MS_SIMD * v;
      if (k < p.dim) ms_store(dq, (long(qs) + i) * p.dim + k, acc[v]);
    }
  }
}

// ---------------------------------------------------------------------------
// Backward, dd: SIMD group owns MS_BWD_ROWS rows of one document (fp32
// accumulators in its slice of threadgroup memory, each lane its own columns)
// and scans the argmax rows of the document's pairs in a fixed order
// (pairs as listed, query rows ascending), 32 entries per step.
// ---------------------------------------------------------------------------
template <typename T>
inline void ms_bwd_dd_body(device const float* grad, device const T* q, device const int* q_start,
                           device const int* q_len, device const int* d_start,
                           device const int* d_len, device const int* pair_q,
                           device const int* pair_d, device const uchar* argmax,
                           device const int* d_ptr, device const int* d_pairs, device T* dd,
                           constant MsBwdParams& p, threadgroup uchar* smem, uint3 tgpig,
                           uint sgid, uint lane) {
  const long item = long(tgpig.y) * long(p.grid_x) + long(tgpig.x);
  if (item >= p.units) return;
  const long m = item / p.dsplit;
  const int split = int(item - m * p.dsplit);
  int ds = 0;
  const int dl = ms_doc_rows(d_start, d_len, m, p.Nd, p.Td, ds);
  if (dl <= 0) return;
  threadgroup float* acc = (threadgroup float*)smem + int(sgid) * (MS_BWD_ROWS * MS_BWD_DC);
  long cnt;
  long c0 = 0;
  if (p.layout == MS_CROSS) {
    cnt = p.Nq;
  } else if (p.layout == MS_GROUPED) {
    cnt = 1;
  } else {
    c0 = d_ptr[m];
    cnt = long(d_ptr[m + 1]) - c0;
  }
  const int nblocks = (dl + MS_BWD_ROWS - 1) / MS_BWD_ROWS;
  for (int b = split * MS_NSG + int(sgid); b < nblocks; b += p.dsplit * MS_NSG) {
    const int j0 = b * MS_BWD_ROWS;
    const int j1 = j0 + MS_BWD_ROWS < dl ? j0 + MS_BWD_ROWS : dl;
    for (int k0 = 0; k0 < p.dim; k0 += MS_BWD_DC) {
      for (int r = 0; r < MS_BWD_ROWS; ++r)
        for (int v = 0; v < MS_BWD_VPL; ++v) acc[r * MS_BWD_DC + int(lane) + MS_SIMD * v] = 0.f;
      for (long c = 0; c < cnt; ++c) {
        long pr;
        long n;
        if (p.layout == MS_CROSS) {
          pr = c * p.Nd + m;
          n = c;
        } else if (p.layout == MS_GROUPED) {
          pr = m;
          n = m / p.K;
        } else {
          pr = d_pairs[c0 + c];
          if (pr < 0 || pr >= p.P || long(pair_d[pr]) != m) continue;
          n = pair_q[pr];
        }
        int qs = 0;
        const int rows = ms_query_rows(q_start, q_len, n, p.Nq, p.lq, p.Tq, qs);
        if (rows <= 0) continue;
        const float g = grad[pr];
        for (int i0 = 0; i0 < rows; i0 += MS_SIMD) {
          const int i = i0 + int(lane);
          const int a = i < rows ? ms_get_argmax(argmax, p.argmax_kind, pr * p.lq + i) : -1;
          if (!simd_any(a >= j0 && a < j1)) continue;
          const int lim = rows - i0 < int(MS_SIMD) ? rows - i0 : int(MS_SIMD);
          for (int l = 0; l < lim; ++l) {  // matches in row order, uniform over the SIMD group
            const int al = simd_shuffle(a, ushort(l));
            if (al < j0 || al >= j1) continue;
            device const T* src = q + (long(qs) + i0 + l) * p.dim;
            threadgroup float* row = acc + (al - j0) * MS_BWD_DC;
            for (int v = 0; v < MS_BWD_VPL; ++v) {
              const int k = k0 + int(lane) + MS_SIMD * v;
              if (k < p.dim) row[int(lane) + MS_SIMD * v] += g * ms_load(src, k);
            }
          }
        }
      }
      for (int j = j0; j < j1; ++j)
        for (int v = 0; v < MS_BWD_VPL; ++v) {
          const int k = k0 + int(lane) + MS_SIMD * v;
          if (k < p.dim)
            ms_store(dd, (long(ds) + j) * p.dim + k, acc[(j - j0) * MS_BWD_DC + int(lane) + MS_SIMD * v]);
        }
    }
  }
}

// ---------------------------------------------------------------------------
// Entry points. Parameter order follows the buffer indices; every attribute
// goes through MS_ATTR so that the emulator can bind it.
// ---------------------------------------------------------------------------
#define MS_FWD_KERNEL(NAME, T, ACC)                                                          \
  kernel void NAME(device const T* q MS_ATTR(buffer(MS_BUF_Q)),                              \
                   device const T* d MS_ATTR(buffer(MS_BUF_D)),                              \
                   device const int* q_start MS_ATTR(buffer(MS_BUF_Q_START)),                \
                   device const int* q_len MS_ATTR(buffer(MS_BUF_Q_LEN)),                    \
                   device const int* d_start MS_ATTR(buffer(MS_BUF_D_START)),                \
                   device const int* d_len MS_ATTR(buffer(MS_BUF_D_LEN)),                    \
                   device const uchar* q_mask MS_ATTR(buffer(MS_BUF_Q_MASK)),                \
                   device const uchar* d_mask MS_ATTR(buffer(MS_BUF_D_MASK)),                \
                   device const int* pair_q MS_ATTR(buffer(MS_BUF_PAIR_Q)),                  \
                   device const int* pair_d MS_ATTR(buffer(MS_BUF_PAIR_D)),                  \
                   device float* scores MS_ATTR(buffer(MS_BUF_SCORES)),                      \
                   device uchar* argmax MS_ATTR(buffer(MS_BUF_ARGMAX)),                      \
                   constant MsFwdParams& p MS_ATTR(buffer(MS_BUF_FWD_PARAMS)),               \
                   threadgroup uchar* smem MS_ATTR(threadgroup(MS_TGMEM_INDEX)),             \
                   uint3 tgpig MS_ATTR(threadgroup_position_in_grid),                        \
                   uint tid MS_ATTR(thread_index_in_threadgroup),                            \
                   uint sgid MS_ATTR(simdgroup_index_in_threadgroup)) {                      \
    ms_fwd_body<T, ACC>(q, d, q_start, q_len, d_start, d_len, q_mask, d_mask, pair_q, pair_d, \
                        scores, argmax, p, smem, tgpig, tid, sgid);                          \
  }                                                                                          \
  MS_REGISTER_KERNEL(NAME)

#define MS_BWD_DQ_KERNEL(NAME, T)                                                    \
  kernel void NAME(device const float* grad MS_ATTR(buffer(MS_BUF_GRAD)),           \
                   device const T* d MS_ATTR(buffer(MS_BUF_SRC)),                    \
                   device const int* q_start MS_ATTR(buffer(MS_BUF_BQ_START)),       \
                   device const int* q_len MS_ATTR(buffer(MS_BUF_BQ_LEN)),           \
                   device const int* d_start MS_ATTR(buffer(MS_BUF_BD_START)),       \
                   device const int* d_len MS_ATTR(buffer(MS_BUF_BD_LEN)),           \
                   device const int* pair_q MS_ATTR(buffer(MS_BUF_BPAIR_Q)),         \
                   device const int* pair_d MS_ATTR(buffer(MS_BUF_BPAIR_D)),         \
                   device const uchar* argmax MS_ATTR(buffer(MS_BUF_BARGMAX)),       \
                   device const int* q_ptr MS_ATTR(buffer(MS_BUF_CSR_PTR)),          \
                   device const int* q_pairs MS_ATTR(buffer(MS_BUF_CSR_PAIRS)),      \
                   device T* dq MS_ATTR(buffer(MS_BUF_OUT)),                         \
                   constant MsBwdParams& p MS_ATTR(buffer(MS_BUF_BWD_PARAMS)),       \
                   uint3 tgpig MS_ATTR(threadgroup_position_in_grid),                \
                   uint sgid MS_ATTR(simdgroup_index_in_threadgroup),                \
                   uint lane MS_ATTR(thread_index_in_simdgroup)) {                   \
    ms_bwd_dq_body<T>(grad, d, q_start, q_len, d_start, d_len, pair_q, pair_d, argmax, \
                      q_ptr, q_pairs, dq, p, tgpig, sgid, lane);                     \
  }                                                                                  \
  MS_REGISTER_KERNEL(NAME)

#define MS_BWD_DD_KERNEL(NAME, T)                                                    \
  kernel void NAME(device const float* grad MS_ATTR(buffer(MS_BUF_GRAD)),           \
                   device const T* q MS_ATTR(buffer(MS_BUF_SRC)),                    \
                   device const int* q_start MS_ATTR(buffer(MS_BUF_BQ_START)),       \
                   device const int* q_len MS_ATTR(buffer(MS_BUF_BQ_LEN)),           \
                   device const int* d_start MS_ATTR(buffer(MS_BUF_BD_START)),       \
                   device const int* d_len MS_ATTR(buffer(MS_BUF_BD_LEN)),           \
                   device const int* pair_q MS_ATTR(buffer(MS_BUF_BPAIR_Q)),         \
                   device const int* pair_d MS_ATTR(buffer(MS_BUF_BPAIR_D)),         \
                   device const uchar* argmax MS_ATTR(buffer(MS_BUF_BARGMAX)),       \
                   device const int* d_ptr MS_ATTR(buffer(MS_BUF_CSR_PTR)),          \
                   device const int* d_pairs MS_ATTR(buffer(MS_BUF_CSR_PAIRS)),      \
                   device T* dd MS_ATTR(buffer(MS_BUF_OUT)),                         \
                   constant MsBwdParams& p MS_ATTR(buffer(MS_BUF_BWD_PARAMS)),       \
                   threadgroup uchar* smem MS_ATTR(threadgroup(MS_TGMEM_INDEX)),     \
                   uint3 tgpig MS_ATTR(threadgroup_position_in_grid),                \
                   uint sgid MS_ATTR(simdgroup_index_in_threadgroup),                \
                   uint lane MS_ATTR(thread_index_in_simdgroup)) {                   \
    ms_bwd_dd_body<T>(grad, q, q_start, q_len, d_start, d_len, pair_q, pair_d, argmax, \
                      d_ptr, d_pairs, dd, p, smem, tgpig, sgid, lane);               \
  }                                                                                  \
  MS_REGISTER_KERNEL(NAME)

MS_FWD_KERNEL(maxsim_fwd_mma_f32, float, MsMmaAcc)
MS_FWD_KERNEL(maxsim_fwd_mma_f16, half, MsMmaAcc)
MS_FWD_KERNEL(maxsim_fwd_mma_bf16, ms_bf16, MsMmaAcc)
MS_FWD_KERNEL(maxsim_fwd_simt_f32, float, MsSimtAcc)
MS_FWD_KERNEL(maxsim_fwd_simt_f16, half, MsSimtAcc)
MS_FWD_KERNEL(maxsim_fwd_simt_bf16, ms_bf16, MsSimtAcc)

MS_BWD_DQ_KERNEL(maxsim_bwd_dq_f32, float)
MS_BWD_DQ_KERNEL(maxsim_bwd_dq_f16, half)
MS_BWD_DQ_KERNEL(maxsim_bwd_dq_bf16, ms_bf16)

MS_BWD_DD_KERNEL(maxsim_bwd_dd_f32, float)
MS_BWD_DD_KERNEL(maxsim_bwd_dd_f16, half)
MS_BWD_DD_KERNEL(maxsim_bwd_dd_bf16, ms_bf16)
