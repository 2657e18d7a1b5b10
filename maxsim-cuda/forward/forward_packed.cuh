// Packed short documents (plan::Family::kPacked): fp16 / bf16, fp32
// accumulation; mma.sync m16n8k16, or on sm_90a wgmma m64n64k16 with the
// same accumulator layout (so one epilogue serves both).
//
// The other tile kernels give every (query tile, document) its own column
// tiles, so a document of 8 tokens costs a 64-column tile and an epilogue.
// Here the scores are the GEMM [query rows, d] x [d, concatenated document
// tokens]: a CTA holds BM = 128 query rows (queries in aligned slots of
// packed_rows(lq) rows; per-query candidates: one query) as A fragments in
// registers, and streams the tokens of up to dpc consecutive documents,
// concatenated, through a cp.async ring of BN = 64-column tiles. A table per
// tile maps each column to its token row (gathered, so any (start, length)
// works: padded, ragged, overlapping) and marks, as bit masks, the columns
// that start / end a document and those that count.
//
// The epilogue stays in registers. The tile's columns are permuted on load
// so that each lane of an MMA quad holds 16 consecutive columns of its four
// rows; per row it runs a segmented (max, argmax) over them (NaN wins, ties
// to the lower column, masked columns -inf), takes the carry of the columns
// before them (the quad's other lanes and the previous tile) with a 4-lane
// segmented scan, and adds the finished maxima of the rows of one query
// slot; a transposing shuffle reduction over the slot's lanes then leaves
// each lane two columns' row sums, stored where a document ends. Documents
// longer than a tile continue in the next one through the per-row carry.
// When every document of a CTA has one length (a power of two <= BN, or a
// multiple of BN) they start at aligned columns and the epilogue takes
// their maxima directly, without the scan (uniform_epilogue).
#pragma once

#include <c10/cuda/CUDAException.h>

#include "../common/common.cuh"
#include "../common/smem_opt_in.h"
#include "../forward_sm90a/forward_wgmma.cuh"  // WgMma (RS), wg_desc, wgmma fences (sm_90a)

namespace maxsim {
namespace cuda_fwd {

using plan::kPackedBM;
using plan::kPackedBN;
using plan::kPackedMaxDocs;
using plan::kPackedStages;
using plan::kPackedThreads;

// Byte offset of 16-byte chunk c of row r in a tile of RB-byte rows.
template <int RB>
__device__ __forceinline__ uint32_t packed_swz(int r, int c) {
  return (uint32_t)(r * RB + ((c ^ (r & 7)) << 4));
}

// Byte offset of 16-byte chunk c of row r in a document tile: the layout
// above, or on sm_90a wgmma's K-major 128B-swizzle layout (128-byte column
// blocks of BN rows, 8-row groups 1024 B apart).
template <int RB>
__device__ __forceinline__ uint32_t packed_tile_swz(int r, int c) {
#if MAXSIM_WG_DEVICE
  return (uint32_t)((c >> 3) * (kPackedBN * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
#else
  return packed_swz<RB>(r, c);
#endif
}

// Tile column n (B row n, accumulator column jn * 8 + 2 * quad + e) holds
// stream column 16 * quad + 2 * jn + e: quad lane q's accumulators
// acc[.][k / 2][. + k % 2] are its stream columns 16 q + k, k = 0..15.
__device__ __forceinline__ int packed_stream_col(int n) { return ((n & 7) >> 1) * 16 + (n >> 3) * 2 + (n & 1); }

// (b, i) becomes the (max, argmax) of an earlier run of columns (eb, ei)
// followed by (b, i), as upd_arg would have scanned them: the later state
// wins only with a larger value or a NaN after a number (an empty state is
// -inf). Branch-free: selects only.
template <bool ARG>
__device__ __forceinline__ void packed_after(float eb, int ei, float& b, int& i) {
  if (ARG) {
    const bool later = b != b ? eb == eb : b > eb;
    b = later ? b : eb;
    i = later ? i : ei;
  } else {
    b = max_nan(eb, b);
  }
}

// One level of the row sums' transposing reduction: lanes with `bit` set
// keep the upper half of the N columns, the others the lower half, each
// adding its partner's copy of the half it keeps.
template <int N>
__device__ __forceinline__ void fold_half(const float (&in)[N], float (&out)[N / 2], int lane, int bit) {
  const bool upper = lane & bit;
#pragma unroll
  for (int j = 0; j < N / 2; ++j) {
    const float send = upper ? in[j] : in[j + N / 2];
    out[j] = (upper ? in[j + N / 2] : in[j]) + __shfl_xor_sync(0xffffffffu, send, bit);
  }
}

template <typename T, int KS, bool ARG>
__global__ void __launch_bounds__(kPackedThreads, 2) packed_fwd_kernel(FwdParams p, int64_t item0) {
  constexpr int BM = kPackedBM, BN = kPackedBN, NTH = kPackedThreads, STAGES = kPackedStages;
  constexpr int TS = STAGES + 1;  // table ring: a tile's table lives from STAGES iterations ahead
  constexpr int RB = KS * 32;     // row bytes
  constexpr int UPR = RB / 16;    // 16-byte units per row
  constexpr int RSTEP = NTH / UPR;
  constexpr int MT = 2, NT = BN / 8;  // per warp: 32 rows x 64 columns
  static_assert(NTH == BM && BN == 64 && NT == 8 && BN <= NTH && BN % RSTEP == 0 && BM % RSTEP == 0,
                "packed tile shape");
  pdl_wait();

  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ long long cs[kPackedMaxDocs + 1];  // first stream column of each document
  __shared__ int dstart[kPackedMaxDocs];
  __shared__ unsigned char dvalid[kPackedMaxDocs];
  __shared__ int col_tok[TS][BN];  // token row of each stream column (-1: past the stream)
  __shared__ int col_doc[TS][BN];  // its document
  // Per tile, bit c of word [k][c / 32]: stream column c starts a document
  // (k 0), ends one (k 1), counts (k 2: in the stream, not masked).
  __shared__ uint32_t col_bits[TS][3][2];
  __shared__ long long row_src[BM];
  __shared__ unsigned char row_cnt[BM];   // the row counts (live, not masked)
  __shared__ unsigned char slot_qok[BM];  // slot s's query is valid (written by its row 0)
  __shared__ long long warp_tot[NTH / 32];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t ring = (smem_u32(smem) + 1023u) & ~1023u;  // wgmma: 1024-byte aligned tiles
  const uint32_t q_s = ring + (uint32_t)(STAGES * BN * RB);  // query staging

  // ---- work item: M tile, documents [u0, u1) of one group ---------------------
  const int64_t item = item0 + blockIdx.x;
  const int mt = (int)(item % p.mt_total);
  const int64_t rest = item / p.mt_total;
  const int64_t grp = rest / p.cpg, cg = rest - grp * p.cpg;
  const int64_t u0 = grp * p.gsz + cg * p.dpc;
  int64_t u1 = min(grp * p.gsz + p.gsz, u0 + (int64_t)p.dpc);
  if (u1 > p.Nd) u1 = p.Nd;
  if (u1 <= u0) return;  // whole CTA
  const int nd = (int)(u1 - u0);
  const bool cross = p.layout == kCrossL;
  const int R = p.qrows;
  // Slot s: its query and whether it exists in this launch.
  auto slot_query = [&](int s) -> int64_t { return cross ? (int64_t)mt * p.qpt + s : grp; };
  auto slot_live = [&](int s) { return cross ? (s < p.qpt && slot_query(s) < p.Nq) : s == 0; };
  // The pair of slot s and the CTA's document j.
  auto pair_of = [&](int s, int j) -> int64_t { return cross ? slot_query(s) * p.Nd + u0 + j : u0 + j; };

  // ---- row tid: its query row ------------------------------------------------------
  {
    const int slot = tid / R, qi = tid - slot * R;
    int qs = 0, ql = 0;
    const bool qok = slot_live(slot) && query_ok(p, slot_query(slot), qs, ql);
    const bool row_live = qok && qi < ql;
    row_src[tid] = row_live ? (long long)qs + qi : -1;
    row_cnt[tid] = row_live && (p.q_mask == nullptr || p.q_mask[qs + qi]);
    if (qi == 0) slot_qok[slot] = qok;
  }

  // ---- document table: starts, validity, prefix of lengths --------------------
  bool any_empty = false, same_len = true;
  int len0 = 0;  // the first document's length
  {
    int ds0;
    doc_ok(p, u0, ds0, len0);
    constexpr int PER = kPackedMaxDocs / NTH;
    long long tot = 0;
    int len[PER];
#pragma unroll
    for (int e = 0; e < PER; ++e) {
      const int j = tid * PER + e;
      int ds = 0, dl = 0;
      bool ok = false;
      if (j < nd) {
        ok = doc_ok(p, u0 + j, ds, dl);
        dstart[j] = ds;
        dvalid[j] = ok;
        any_empty |= dl == 0;
        same_len &= ok && dl == len0;
      }
      len[e] = dl;
      tot += dl;
    }
    long long inc = tot;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const long long v = __shfl_up_sync(0xffffffffu, inc, o);
      if (lane >= o) inc += v;
    }
    if (lane == 31) warp_tot[warp] = inc;
    __syncthreads();
    long long base = inc - tot;
    for (int w = 0; w < warp; ++w) base += warp_tot[w];
#pragma unroll
    for (int e = 0; e < PER; ++e) {
      const int j = tid * PER + e;
      if (j <= nd) cs[j] = base;
      base += len[e];
    }
    if (tid == NTH - 1 && nd == kPackedMaxDocs) cs[nd] = base;
  }
  any_empty = __syncthreads_or(any_empty);
  same_len = __syncthreads_and(same_len);
  const long long total = cs[nd];
  // Documents of one length L, a power of two <= BN (mode log2 L) or a
  // multiple of BN (mode 7, tpd tiles each), start at aligned stream
  // columns: the epilogue takes their maxima without the segmented scan.
  const int tpd = len0 / BN;
  const int umode = ARG || !same_len || len0 <= 0                ? -1
                    : (len0 & (len0 - 1)) == 0 && len0 <= BN     ? __ffs(len0) - 1
                    : len0 % BN == 0                             ? 7
                                                                 : -1;
  const int nch = (int)((total + BN - 1) / BN);  // total < 2^31 (planner: Td < 2^31)
  const bool has_mask = p.d_mask != nullptr;

  // An empty document has no end column: its score (0, no row counts) and
  // argmax rows (-1) are stored here.
  if (any_empty) {
    const int slot = tid / R, qi = tid - slot * R;
    if (slot_live(slot))
      for (int j = 0; j < nd; ++j) {
        if (cs[j + 1] != cs[j]) continue;
        const int64_t pr = pair_of(slot, j);
        if (qi == 0) store_score(p, pr, slot_qok[slot] && dvalid[j], 0.f);
        if (ARG && qi < p.lq) store_argmax(p, pr * p.lq + qi, -1);
      }
  }

  // Table of tile ch into slot ts (threads < BN, whole warps; thread tid is
  // stream column ch * BN + tid): its token row, document (the last j with
  // cs[j] <= column), start / end bits; whether it counts goes to `mval`
  // (the mask load's latency is hidden: its bits are written later).
  auto tile_table = [&](int ch, int ts, bool& mval) {
    const long long gc = (long long)ch * BN + tid;
    int tok = -1, lo = 0;
    bool st = false, en = false;
    mval = false;
    if (gc < total) {
      if (same_len) {
        lo = (int)(gc / len0);  // documents of one length: cs[j] = j * len0
      } else {
        int hi = nd - 1;
        while (lo < hi) {
          const int mid = (lo + hi + 1) >> 1;
          if (cs[mid] <= gc)
            lo = mid;
          else
            hi = mid - 1;
        }
      }
      tok = dstart[lo] + (int)(gc - cs[lo]);
      st = gc == cs[lo];
      en = gc + 1 == cs[lo + 1];
      mval = !has_mask || p.d_mask[tok];
    }
    col_tok[ts][tid] = tok;
    col_doc[ts][tid] = lo;
    const uint32_t sb = __ballot_sync(0xffffffffu, st), eb = __ballot_sync(0xffffffffu, en);
    if (lane == 0) {
      col_bits[ts][0][warp] = sb;
      col_bits[ts][1][warp] = eb;
    }
  };
  auto put_valid = [&](int ts, bool m) {
    const uint32_t vb = __ballot_sync(0xffffffffu, m);
    if (lane == 0) col_bits[ts][2][warp] = vb;
  };
  // This thread copies unit uc of rows r0 + k * RSTEP: as RSTEP is a multiple
  // of 8, their stream columns and tile offsets step by constants from row r0's.
  static_assert(RSTEP % 8 == 0, "rows of one thread keep their swizzle phase");
  const int r0 = tid / UPR, uc = tid % UPR;
  const int scol0 = packed_stream_col(r0);
  const uint32_t dst0 = packed_tile_swz<RB>(r0, uc), dstep = packed_tile_swz<RB>(r0 + RSTEP, uc) - dst0;
  const unsigned char* const dsrc = reinterpret_cast<const unsigned char*>(p.d) + uc * 16;
  // cp.async of the tile whose table is in slot ts into ring stage `stage`,
  // permuted (packed_stream_col); columns past the stream: zeros.
  auto issue = [&](int ts, int stage) {
    const uint32_t dst = ring + (uint32_t)(stage * BN * RB) + dst0;
#pragma unroll
    for (int k = 0; k < BN / RSTEP; ++k) {
      const int tok = col_tok[ts][scol0 + k * (RSTEP / 4)];
      const bool ok = tok >= 0;  // else zero-filled: nothing is read
      cp_async<16>(dst + k * dstep, dsrc + (int64_t)(ok ? tok : 0) * RB, ok);
    }
  };

  // ---- prologue: query tile (staged), the first tables and tiles -----------------
  __syncthreads();  // row_src
#pragma unroll 4
  for (int r = r0; r < BM; r += RSTEP) {
    const long long src = row_src[r];
    cp_async<16>(q_s + packed_swz<RB>(r, uc), src >= 0 ? (const void*)(p.q + src * RB + uc * 16) : (const void*)p.q,
                 src >= 0);
  }
  cp_async_commit();
  if (tid < BN) {
#pragma unroll
    for (int ch = 0; ch < STAGES; ++ch) {
      bool m;
      tile_table(ch, ch, m);
      put_valid(ch, m);
    }
  }
  __syncthreads();
#pragma unroll
  for (int ch = 0; ch < STAGES - 1; ++ch) {
    if (ch < nch) issue(ch, ch);
    cp_async_commit();
  }
  cp_async_wait<STAGES - 1>();  // the query group
  __syncthreads();
  uint32_t af[KS][MT][4];
  {
    const uint32_t a_row = (uint32_t)((warp * 32 + (lane & 15)) * RB);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int i = 0; i < MT; ++i)
        ldsm_x4(af[ks][i][0], af[ks][i][1], af[ks][i][2], af[ks][i][3],
                q_s + a_row + (uint32_t)(i * 16 * RB) + (((ks * 2 + (lane >> 4)) ^ (lane & 7)) << 4));
  }

  // ---- this lane's rows warp * 32 + i * 16 + h * 8 + g, columns 16 q + k ----------
  const int g = lane >> 2, q = lane & 3;
  bool rc[MT][2];
  float cb[MT][2];  // carry: the (max, argmax) of the document running past the last tile
  int ci[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rc[i][h] = row_cnt[warp * 32 + i * 16 + h * 8 + g];
      cb[i][h] = neg_inf();
      ci[i][h] = -1;
    }
  // A slot's rows in this lane: 4 (R 32), 2 (R 16), else 1; the lane bits
  // (xor 4, 8, 16) its rows span: log2(min(R, 8)).
  const int rows_in_lane = R >= 32 ? 4 : R == 16 ? 2 : 1;
  const int lane_levels = R >= 8 ? 3 : R == 4 ? 2 : R == 2 ? 1 : 0;
  const int lg_rows = __ffs(R) - 1;  // R is a power of two: slot = row >> lg_rows

  // Epilogue of one tile of documents of one length (umode LG): the lane's
  // 16 columns hold 16 >> LG whole documents (LG <= 4), half of one (5), a
  // quarter (6), or a quarter of a tile of one (7: the maxima carry over the
  // document's tiles in cb). The same maxima and sums, in the same order, as
  // the segmented scan below.
  auto uniform_epilogue = [&](const float(&acc)[MT][NT][4], int ch, auto lg_c) {
    constexpr int LG = decltype(lg_c)::value;
    constexpr int N = LG <= 4 ? 16 >> LG : 1;  // documents per lane
    constexpr int SPAN = LG <= 4 ? 1 << LG : 16;
    const bool doc_end = LG < 7 || ch % tpd == tpd - 1;
    const int doc0 = LG <= 4 ? (ch * BN + 16 * q) >> LG : LG == 5 ? (ch * BN + 16 * q) >> 5 : LG == 6 ? ch : ch / tpd;
    const bool writer = (LG <= 4 || (LG == 5 ? (q & 1) == 0 : q == 0)) && (g & ((1 << lane_levels) - 1)) == 0;
    float ps[N];
#pragma unroll
    for (int d = 0; d < N; ++d) ps[d] = 0.f;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v[16];
#pragma unroll
        for (int k = 0; k < 16; ++k) v[k] = acc[i][k >> 1][h * 2 + (k & 1)];
#pragma unroll
        for (int s = 1; s < SPAN; s *= 2)
#pragma unroll
          for (int k = 0; k < 16; k += 2 * s) v[k] = max_nan(v[k], v[k + s]);
        if (LG == 7) {
          v[0] = max_nan(cb[i][h], v[0]);
          cb[i][h] = doc_end ? neg_inf() : v[0];
          if (!doc_end) continue;
        }
        if (LG >= 5) v[0] = max_nan(v[0], __shfl_xor_sync(0xffffffffu, v[0], 1));
        if (LG >= 6) v[0] = max_nan(v[0], __shfl_xor_sync(0xffffffffu, v[0], 2));
#pragma unroll
        for (int d = 0; d < N; ++d) ps[d] += rc[i][h] && v[d * SPAN] != neg_inf() ? v[d * SPAN] : 0.f;
        if ((i * 2 + h + 1) % rows_in_lane != 0) continue;
#pragma unroll
        for (int l = 0; l < 3; ++l)
          if (l < lane_levels)
#pragma unroll
            for (int d = 0; d < N; ++d) ps[d] += __shfl_xor_sync(0xffffffffu, ps[d], 4 << l);
        const int slot = (warp * 32 + i * 16 + h * 8 + g) >> lg_rows;
        if (writer && slot_live(slot))
#pragma unroll
          for (int d = 0; d < N; ++d) {
            const int dj = doc0 + d;
            if (dj >= nd) continue;
            const int64_t pr = pair_of(slot, dj);
            store_score(p, pr, slot_qok[slot] && dvalid[dj], ps[d]);
          }
#pragma unroll
        for (int d = 0; d < N; ++d) ps[d] = 0.f;
      }
  };

  bool pend = false;
  int pend_slot = -1;
  int s_cur = 0, t_cur = 0;  // ch % STAGES, ch % TS
  for (int ch = 0; ch < nch;
       ++ch, s_cur = s_cur + 1 == STAGES ? 0 : s_cur + 1, t_cur = t_cur + 1 == TS ? 0 : t_cur + 1) {
    cp_async_wait<STAGES - 2>();
#if MAXSIM_WG_DEVICE
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // this thread's tile copies, to wgmma
#endif
    __syncthreads();
    // MMAs: 32 query rows x 64 columns per warp.
    float acc[MT][NT][4];
#if MAXSIM_WG_DEVICE
    // One warpgroup: per k step a wgmma m64n64k16 per 16-row block of each
    // warp's 32 rows (A: the warp's fragments, as for mma.sync; B: the
    // tile), running while the next tile's copies and table are issued.
    {
      // k step ks starts (ks >> 2) column blocks and (ks & 3) 32-byte steps
      // into the stage.
      const uint64_t stage_desc = wg_desc(ring + (uint32_t)(s_cur * BN * RB));
#pragma unroll
      for (int i = 0; i < MT; ++i) wg_fence_acc<NT * 4>(&acc[i][0][0]);
      wg_fence();
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
#pragma unroll
        for (int i = 0; i < MT; ++i)
          WgMma<T>::n64(&acc[i][0][0], af[ks][i], wg_desc_advance(stage_desc, (uint32_t)((ks >> 2) * BN * 128 + (ks & 3) * 32)),
                        ks != 0);
      wg_commit();
    }
#endif
    if (pend_slot >= 0) put_valid(pend_slot, pend);
    if (ch + STAGES - 1 < nch) issue((t_cur + STAGES - 1) % TS, (s_cur + STAGES - 1) % STAGES);
    cp_async_commit();
    pend_slot = -1;
    if (tid < BN && ch + STAGES < nch) {
      pend_slot = (t_cur + STAGES) % TS;
      tile_table(ch + STAGES, pend_slot, pend);
    }
#if MAXSIM_WG_DEVICE
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < MT; ++i) wg_fence_acc<NT * 4>(&acc[i][0][0]);
#else
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int jn = 0; jn < NT; ++jn)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][jn][e] = 0.f;
    const int b_hi = (lane >> 3) & 1;
    const uint32_t b_base = ring + (uint32_t)(s_cur * BN * RB) + (uint32_t)(((lane & 7) + ((lane >> 4) << 3)) * RB);
    uint32_t bfr[2][NT][2];
    auto load_b = [&](int buf, int ks) {
#pragma unroll
      for (int np = 0; np < NT / 2; ++np)
        ldsm_x4(bfr[buf][2 * np][0], bfr[buf][2 * np][1], bfr[buf][2 * np + 1][0], bfr[buf][2 * np + 1][1],
                b_base + (uint32_t)(np * 16 * RB) + (((ks * 2 + b_hi) ^ (lane & 7)) << 4));
    };
    load_b(0, 0);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      if (ks + 1 < KS) load_b((ks + 1) & 1, ks + 1);
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int jn = 0; jn < NT; ++jn) Mma<T>::run(acc[i][jn], af[ks][i], bfr[ks & 1][jn]);
    }
#endif

    const int ts = t_cur;
    // Columns that do not count (masked, past the stream) become -inf here,
    // off the common path: the epilogues read the accumulators as they are.
    const uint32_t v16 = (col_bits[ts][2][q >> 1] >> (16 * (q & 1))) & 0xffffu;
    if (v16 != 0xffffu) {
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int k = 0; k < 16; ++k)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (!((v16 >> k) & 1u)) acc[i][k >> 1][h * 2 + (k & 1)] = neg_inf();
    }
    if (umode >= 0) {
      switch (umode) {
        case 0: uniform_epilogue(acc, ch, std::integral_constant<int, 0>{}); break;
        case 1: uniform_epilogue(acc, ch, std::integral_constant<int, 1>{}); break;
        case 2: uniform_epilogue(acc, ch, std::integral_constant<int, 2>{}); break;
        case 3: uniform_epilogue(acc, ch, std::integral_constant<int, 3>{}); break;
        case 4: uniform_epilogue(acc, ch, std::integral_constant<int, 4>{}); break;
        case 5: uniform_epilogue(acc, ch, std::integral_constant<int, 5>{}); break;
        case 6: uniform_epilogue(acc, ch, std::integral_constant<int, 6>{}); break;
        default: uniform_epilogue(acc, ch, std::integral_constant<int, 7>{}); break;
      }
      continue;
    }

    // ---- epilogue: documents of any lengths --------------------------------------
    const uint32_t w0 = col_bits[ts][0][0], w1 = col_bits[ts][0][1];
    const uint32_t st16 = ((q < 2 ? w0 : w1) >> (16 * (q & 1))) & 0xffffu;
    const uint32_t en16 = (col_bits[ts][1][q >> 1] >> (16 * (q & 1))) & 0xffffu;
    // A start in quad lane t's columns (the carry stops there).
    const bool hs[4] = {(w0 & 0xffffu) != 0, (w0 >> 16) != 0, (w1 & 0xffffu) != 0, (w1 >> 16) != 0};
    // The end column of the head segment (the columns before this lane's
    // first start), the only one that takes the carry.
    const uint32_t head_end = (st16 ? (st16 & (0u - st16)) - 1u : 0xffffu) & en16;
    const int c0 = ch * BN + 16 * q;  // stream column of k = 0
    float ps[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) ps[k] = 0.f;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Segmented (max, argmax) over this lane's 16 columns of the row.
        float ev[16];
        int ei[16];
        float b = neg_inf();
        int bi = -1;
#pragma unroll
        for (int k = 0; k < 16; ++k) {
          const float v = acc[i][k >> 1][h * 2 + (k & 1)];
          if ((st16 >> k) & 1u) {
            b = neg_inf();
            bi = -1;
          }
          if (ARG)
            upd_arg(b, bi, v, c0 + k);
          else
            b = max_nan(b, v);
          ev[k] = b;
          ei[k] = bi;
        }
        // The carry into each quad lane: the previous tile's, then lanes
        // 0..q-1's tails (a tail restarts where its lane has a start).
        float in_b = neg_inf(), run_b = cb[i][h];
        int in_i = -1, run_i = ci[i][h];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          float tb = __shfl_sync(0xffffffffu, b, (lane & ~3) | t);
          int ti = ARG ? __shfl_sync(0xffffffffu, bi, (lane & ~3) | t) : -1;
          if (t == q) {
            in_b = run_b;
            in_i = run_i;
          }
          if (!hs[t]) packed_after<ARG>(run_b, run_i, tb, ti);
          run_b = tb;
          run_i = ti;
        }
        cb[i][h] = run_b;
        ci[i][h] = run_i;
        const int row = warp * 32 + i * 16 + h * 8 + g;
        const int slot = row >> lg_rows, qi = row & (R - 1);
        const bool live = slot_live(slot);
#pragma unroll
        for (int k = 0; k < 16; ++k) {
          if ((head_end >> k) & 1u) packed_after<ARG>(in_b, in_i, ev[k], ei[k]);
          const bool use = rc[i][h] && ev[k] != neg_inf();
          ps[k] += use ? ev[k] : 0.f;
          if (ARG && ((en16 >> k) & 1u) && live && qi < p.lq) {
            const int dj = col_doc[ts][16 * q + k];
            const int64_t pr = pair_of(slot, dj);
            store_argmax(p, pr * p.lq + qi, use ? ei[k] - (int)cs[dj] : -1);
          }
        }
        if ((i * 2 + h + 1) % rows_in_lane != 0) continue;
        // The slot's row sums: a transposing reduction over its lanes
        // (xor 4, 8, 16); lane bit 2 + l keeps half the columns at level l.
        auto store = [&](const auto& sum, int kb) {
          constexpr int n = sizeof(sum) / sizeof(float);
          if (!live) return;
#pragma unroll
          for (int jj = 0; jj < n; ++jj) {
            const int k = kb + jj;
            if (!((en16 >> k) & 1u)) continue;
            const int dj = col_doc[ts][16 * q + k];
            const int64_t pr = pair_of(slot, dj);
            store_score(p, pr, slot_qok[slot] && dvalid[dj], sum[jj]);
          }
        };
        if (lane_levels == 0) {
          store(ps, 0);
        } else {
          float s8[8];
          fold_half(ps, s8, lane, 4);
          const int kb8 = lane & 4 ? 8 : 0;
          if (lane_levels == 1) {
            store(s8, kb8);
          } else {
            float s4[4];
            fold_half(s8, s4, lane, 8);
            const int kb4 = kb8 + (lane & 8 ? 4 : 0);
            if (lane_levels == 2) {
              store(s4, kb4);
            } else {
              float s2[2];
              fold_half(s4, s2, lane, 16);
              store(s2, kb4 + (lane & 16 ? 2 : 0));
            }
          }
        }
#pragma unroll
        for (int k = 0; k < 16; ++k) ps[k] = 0.f;
      }
  }
  cp_async_wait_all();
}

// Resident CTAs per SM (asked once per instance).
template <typename T, int KS, bool ARG>
auto prepared_packed_kernel() {
  auto kern = packed_fwd_kernel<T, KS, ARG>;
  static int set_bytes[kSmemOptInDevices] = {};
  opt_in_dynamic_smem(kern, (size_t)plan::packed_smem(KS), set_bytes);
  return kern;
}

template <typename F>
auto with_packed_shape(int ks, bool arg, F&& f) {
  const auto by_arg = [&](auto k) {
    if (arg) return f(k, std::true_type{});
    return f(k, std::false_type{});
  };
  if (ks == 4) return by_arg(std::integral_constant<int, 4>{});
  MAXSIM_CHECK(ks == 8, "maxsim: packed kernel: rows of %d k steps not supported", ks);
  return by_arg(std::integral_constant<int, 8>{});
}

template <typename T>
void launch_packed(const plan::PackedPlan& pk, bool arg, const FwdParams& p, int64_t item0, int64_t nitems,
                   cudaStream_t st) {
  with_packed_shape(pk.ks, arg, [&](auto k, auto a) {
    constexpr int KS = decltype(k)::value;
    constexpr bool ARG = decltype(a)::value;
    launch_pdl(prepared_packed_kernel<T, KS, ARG>(), dim3((unsigned)nitems), dim3(kPackedThreads),
               (size_t)plan::packed_smem(KS), st, p, item0);
  });
}

template <typename T>
int packed_kernel_blocks(int ks, bool arg) {
  return with_packed_shape(ks, arg, [&](auto k, auto a) {
    constexpr int KS = decltype(k)::value;
    constexpr bool ARG = decltype(a)::value;
    static const int per_sm = [] {
      int b = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, prepared_packed_kernel<T, KS, ARG>(),
                                                                   kPackedThreads, (size_t)plan::packed_smem(KS)));
      return b;
    }();
    return per_sm;
  });
}

// Defined for __half / __nv_bfloat16 in forward_packed.cu.
template <typename T>
void run_packed(const plan::PackedPlan& pk, bool arg, const FwdParams& p, int64_t item0, int64_t nitems,
                cudaStream_t st);
template <typename T>
int packed_blocks(int ks, bool arg);

}  // namespace cuda_fwd
}  // namespace maxsim
