// Tensor-core forward kernel (fp16 / bf16 via mma.sync m16n8k16, fp32 via
// TF32 m16n8k8 (T = float) or split 3xTF32 (T = Tf32x3: the same fp32 tiles,
// each fragment split into TF32 hi / lo parts), int8 / fp8 e4m3 via
// m16n8k32), fp32 accumulation (int32 for int8, exact).
//
// One CTA = one work item: an M tile of BM query rows (one query, several
// stacked queries for CROSS, or a BM-row slice of a long query) against one
// BN-aligned chunk of one document. The query tile stays resident in shared
// memory for the whole CTA (loaded once, k-chunk major, 128B XOR swizzle);
// the document streams through a STAGES-deep cp.async ring of [BN x 256 B]
// tiles (256 B = one k chunk; dim is zero-padded to a multiple of it).
// After the last k chunk of each BN tile the accumulators are folded into a
// running (max, argmax) per query row held in registers (NaN-propagating,
// lowest index on ties, out-of-range / masked columns set to -inf), then the
// CTA reduces across quads and warps and calls finish_tile.
// Quantized tokens (int8 / fp8, per-token scales): each tile's products are
// multiplied by their document token's scale before the max (the tile's
// scales ride in the stage's cp.async group into a ring beside the mask
// ring: a global load per tile in the fold was a quarter of the int8 loop's
// instructions and its latency was exposed); the query token's scale (> 0)
// commutes with the max and is applied to the row maxima.
#pragma once

#include <map>
#include <mutex>
#include <utility>

#include <c10/cuda/CUDAException.h>

#include "../common/common.cuh"
#include "../common/smem_opt_in.h"
#include "../common/normalize_jacobian.cuh"  // inv_norm

namespace maxsim {
namespace cuda_fwd {

using plan::kMmaMaxDpc;
using plan::mma_kchunk;
using plan::mma_stages;

template <int BM_, int BN_, int WM_, int WN_, int STAGES_, int MINB_>
struct MmaShape {
  static constexpr int BM = BM_, BN = BN_, WM = WM_, WN = WN_, STAGES = STAGES_, MINB = MINB_;
  static constexpr int NTH = WM * WN * 32;
};

// The tile configurations the planner returns (plan::kMmaConfigs).
template <int CFG>
struct MmaCfgOf {
  static constexpr plan::MmaConfig c = plan::kMmaConfigs[CFG];
  using type = MmaShape<c.bm, c.bn, c.wm, c.wn, c.stages, c.minb>;
};

// Byte offset of 16-byte chunk c of row r in a [rows x KCB] tile.
template <int KCB>
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return (uint32_t)(r * KCB + ((c ^ (r & 7)) << 4));
}

// Loads one [BN x 256 B] doc tile (rows tok0 .. tok0+nvalid-1, bytes
// kb0 .. kb0+255 of each row); everything else zero-filled.
template <int KCB, int VB, int BN, int NTH>
__device__ __forceinline__ void load_doc_tile(const FwdParams& p, uint32_t sdst, int64_t tok0, int nvalid,
                                              int kb0) {
  constexpr int UPR = KCB / VB;  // units per row
  static_assert(NTH % UPR == 0, "threads must cover whole rows");
  constexpr int RSTEP = NTH / UPR;
  constexpr int ITERS = BN / RSTEP;
  static_assert(BN % RSTEP == 0, "tile rows");
  const int uc = threadIdx.x % UPR;
  const int r0 = threadIdx.x / UPR;
  const int b = kb0 + uc * VB;
  if (b >= p.row_bytes_pad) return;  // past the last k step: never read
  const bool colok = b < p.row_bytes;
  const char* g = p.d + (tok0 + r0) * p.row_bytes + b;
  const int64_t gstep = (int64_t)RSTEP * p.row_bytes;
  const uint32_t inner = (uint32_t)((uc * VB) & 15);
  const int c = (uc * VB) >> 4;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    int r = r0 + it * RSTEP;
    bool ok = colok && r < nvalid;
    cp_async<VB>(sdst + swz<KCB>(r, c) + inner, ok ? (const void*)g : (const void*)p.d, ok);
    g += gstep;
  }
}

// Loads the resident query tile [kch][BM][256 B].
template <int KCB, int VB, int BM, int NTH>
__device__ __forceinline__ void load_query_tile(const FwdParams& p, uint32_t sdst, const long long* row_src) {
  constexpr int UPR = KCB / VB;
  static_assert(NTH % UPR == 0, "threads must cover whole rows");
  constexpr int RSTEP = NTH / UPR;
  const int uc = threadIdx.x % UPR;
  const int r0 = threadIdx.x / UPR;
  const uint32_t inner = (uint32_t)((uc * VB) & 15);
  const int c = (uc * VB) >> 4;
  for (int kc = 0; kc < p.kch; ++kc) {
    const int b = kc * KCB + uc * VB;
    if (b >= p.row_bytes_pad) continue;
    const bool colok = b < p.row_bytes;
    const uint32_t base = sdst + (uint32_t)(kc * BM * KCB);
#pragma unroll 4
    for (int r = r0; r < BM; r += RSTEP) {
      long long src = row_src[r];
      bool ok = colok && src >= 0;
      const char* g = ok ? p.q + src * p.row_bytes + b : p.q;
      cp_async<VB>(base + swz<KCB>(r, c) + inner, g, ok);
    }
  }
}

// Scale mode SCM: 0 none; 1 per-token scales from p.q_scale / p.d_scale
// (8-bit tokens); 2 `normalize` of float tokens: query rows scaled by
// p.q_scale (inverse norms), document tokens by inverse norms computed here
// from the B fragments the MMAs already hold (each lane squares its
// elements, a quad sums a token's k slices), so the documents are read once.
template <typename T, class C, bool ARG, int SCM>
__global__ void __launch_bounds__(C::NTH, C::MINB) mma_fwd_kernel(FwdParams p, int64_t item0) {
  constexpr bool QUANT = kIsQuant<T>;
  constexpr bool SC = SCM != 0, DNORM = SCM == 2;
  static_assert((SCM == 1) == QUANT, "8-bit tokens, and only they, carry scale arrays");
  constexpr int KCB = mma_kchunk(QUANT);
  constexpr int BM = C::BM, BN = C::BN, WM = C::WM, WN = C::WN, NTH = C::NTH;
  constexpr int STAGES = mma_stages(C::STAGES, QUANT);
  constexpr int WTM = BM / WM, WTN = BN / WN;
  constexpr int MT = WTM / 16, NT = WTN / 8;
  constexpr int KSTEPS = KCB / 32;
  static_assert(WTM % 16 == 0 && WTN % 16 == 0, "warp tile");
  static_assert(BN <= NTH, "one mask byte per thread");
  static_assert(STAGES >= 3, "mask prefetch needs >= 3 stages");
  pdl_wait();

  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ long long row_src[BM];
  __shared__ unsigned char row_ok[BM];
  __shared__ float red_b[WN][BM];
  __shared__ int red_i[ARG ? WN : 1][BM];
  __shared__ unsigned char mask_s[STAGES][BN];  // doc-mask ring (tile j -> slot j % STAGES)
  // The CTA's docs (chunks): first token row, token range, validity and the
  // running count of BN tiles up to and including each doc.
  __shared__ long long doc_tb[kMmaMaxDpc];
  __shared__ int doc_c0[kMmaMaxDpc], doc_c1[kMmaMaxDpc], doc_tend[kMmaMaxDpc];
  __shared__ unsigned char doc_valid[kMmaMaxDpc];
  __shared__ float row_scale[SC ? BM : 1];
  __shared__ __align__(16) float dscale_s[SCM == 1 ? STAGES : 1][SCM == 1 ? BN : 2];  // doc-token scale ring (8-bit)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WN, wn = warp % WN;

  // Work: one item (decode_work) or up to dpc consecutive docs of one group
  // with the same M tile (and so the same query tile).
  Work w;
  int nd = 1;
  if (p.dpc <= 1) {
    w = decode_work<BN>(p, item0 + blockIdx.x);
    if (tid == 0) {
      doc_tb[0] = (long long)w.ds + w.c0;
      doc_c0[0] = w.c0;
      doc_c1[0] = w.c1;
      doc_valid[0] = w.dvalid;
      doc_tend[0] = (w.c1 - w.c0 + BN - 1) / BN;
    }
  } else {
    const int64_t item = item0 + blockIdx.x;
    w.mt = (int)(item % p.mt_total);
    const int64_t rest = item / p.mt_total;
    const int64_t g = rest / p.cpg, c = rest - g * p.cpg;
    const int64_t u0 = g * p.gsz + c * p.dpc;
    int64_t u1 = g * p.gsz + p.gsz;
    if (u0 + p.dpc < u1) u1 = u0 + p.dpc;
    if (p.Nd < u1) u1 = p.Nd;
    if (u1 <= u0) return;  // past the last doc of a partial last group (whole CTA)
    nd = (int)(u1 - u0);
    w.s = 0;
    w.u = w.dn = u0;
    w.dvalid = false;
    w.ds = w.dl = 0;
    w.c0 = w.c1 = 0;
    if (warp == 0) {
      int ds = 0, dl = 0;
      bool ok = false;
      if (lane < nd) ok = doc_ok(p, u0 + lane, ds, dl);
      int nt = lane < nd ? (dl + BN - 1) / BN : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        int v = __shfl_up_sync(0xffffffffu, nt, o);
        if (lane >= o) nt += v;
      }
      if (lane < nd) {
        doc_tb[lane] = ds;
        doc_c0[lane] = 0;
        doc_c1[lane] = dl;
        doc_valid[lane] = ok;
        doc_tend[lane] = nt;
      }
    }
  }
  build_row_table<BM, NTH>(p, w, row_src, row_ok);
  if (SC) {
    __syncthreads();
    for (int r = tid; r < BM; r += NTH) row_scale[r] = row_src[r] >= 0 ? p.q_scale[row_src[r]] : 0.f;
  }
  __syncthreads();

  const uint32_t q_s = smem_u32(smem);
  const uint32_t d_s = q_s + (uint32_t)(BM * p.kch * KCB);
  constexpr uint32_t STAGE_BYTES = BN * KCB;

  const int total = doc_tend[nd - 1] * p.kch;
  const bool has_mask = p.d_mask != nullptr;

  float best[MT][2];
  int bidx[MT][2];
  auto reset_best = [&]() {
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        best[i][h] = neg_inf();
        bidx[i][h] = -1;
      }
  };
  reset_best();

  // Epilogue of doc t (its running maxima are in best / bidx): reduce across
  // the 4 lanes of a quad (same rows, different columns), then across the WN
  // warps of a row block in column order, then finish_tile.
  auto finish_doc = [&](int t) {
    __syncthreads();  // red_b may still be read by the previous doc's finish_tile
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
          float ob = __shfl_xor_sync(0xffffffffu, best[i][h], o);
          if (ARG) {
            int oi = __shfl_xor_sync(0xffffffffu, bidx[i][h], o);
            merge_arg(best[i][h], bidx[i][h], ob, oi);
          } else {
            best[i][h] = max_nan(best[i][h], ob);
          }
        }
        if ((lane & 3) == 0) {
          int row = wm * WTM + i * 16 + h * 8 + (lane >> 2);
          red_b[wn][row] = best[i][h];
          if (ARG) red_i[wn][row] = bidx[i][h];
        }
      }
    __syncthreads();
    if (WN > 1) {
      for (int r = tid; r < BM; r += NTH) {
        float b = red_b[0][r];
        int ix = ARG ? red_i[0][r] : 0;
#pragma unroll
        for (int x = 1; x < WN; ++x) {
          if (ARG)
            merge_arg(b, ix, red_b[x][r], red_i[x][r]);
          else
            b = max_nan(b, red_b[x][r]);
        }
        red_b[0][r] = b;
        if (ARG) red_i[0][r] = ix;
      }
      __syncthreads();
    }
    if (SC) {
      for (int r = tid; r < BM; r += NTH) {
        float v = red_b[0][r];
        if (v != neg_inf()) red_b[0][r] = v * row_scale[r];
      }
      __syncthreads();
    }
    Work wd = w;
    if (p.dpc > 1) {
      wd.u = wd.dn = w.u + t;
      wd.dvalid = doc_valid[t];
    }
    finish_tile<BM, NTH, ARG>(p, wd, red_b[0], red_i[0], row_ok);
    reset_best();
  };

  // Docs are finished in order; cdoc = next doc to finish. Docs with no
  // tiles (empty, invalid) finish as soon as the tiles before them are done.
  int cdoc = 0;
  while (cdoc < nd && doc_tend[cdoc] == 0) finish_doc(cdoc++);

  if (total > 0) {
    // Doc-mask prefetch: the byte for tile row `tid` is loaded into a register
    // when the tile's first k chunk is issued and stored to mask_s one
    // iteration later (its consumer is >= 1 barrier after that).
    unsigned char pend_mask = 0;
    int pend_slot = -1;
    int idoc = 0, ibase = 0;  // doc of the next issued tile, its first global tile
    // Position of the next issued iteration, advanced by one per call
    // (global tile, k chunk, stage slot, tile ring slot): no divisions.
    int i_jg = 0, i_kc = 0, i_slot = 0, i_tslot = 0;

    // Issue the stage load for the next flattened iteration (global tile
    // i_jg, k chunk i_kc); called once per iteration, in order.
    auto issue = [&](bool defer_mask) {
      const int jg = i_jg, kc = i_kc;
      while (jg >= doc_tend[idoc]) ibase = doc_tend[idoc++];
      const int j = jg - ibase;
      uint32_t dst = d_s + (uint32_t)(i_slot * STAGE_BYTES);
      int64_t tok0 = doc_tb[idoc] + (int64_t)j * BN;
      int nvalid = min(BN, doc_c1[idoc] - doc_c0[idoc] - j * BN);
      int kb0 = kc * KCB;
      if (p.vecb == 16)
        load_doc_tile<KCB, 16, BN, NTH>(p, dst, tok0, nvalid, kb0);
      else if (p.vecb == 8)
        load_doc_tile<KCB, 8, BN, NTH>(p, dst, tok0, nvalid, kb0);
      else
        load_doc_tile<KCB, 4, BN, NTH>(p, dst, tok0, nvalid, kb0);
      if (SCM == 1 && kc == 0 && tid < BN) {
        const bool ok = tid < nvalid;
        cp_async<4>(smem_u32(&dscale_s[i_tslot][tid]), ok ? (const void*)(p.d_scale + tok0 + tid) : (const void*)p.d_scale,
                    ok);
      }
      if (has_mask && kc == 0 && tid < BN) {
        unsigned char m = (tid < nvalid && p.d_mask[tok0 + tid]) ? 1 : 0;
        if (defer_mask) {
          pend_mask = m;
          pend_slot = i_tslot;
        } else {
          mask_s[i_tslot][tid] = m;
        }
      }
      if (++i_slot == STAGES) i_slot = 0;
      if (++i_kc == p.kch) {
        i_kc = 0;
        ++i_jg;
        if (++i_tslot == STAGES) i_tslot = 0;
      }
    };

    if (p.vecb == 16)
      load_query_tile<KCB, 16, BM, NTH>(p, q_s, row_src);
    else if (p.vecb == 8)
      load_query_tile<KCB, 8, BM, NTH>(p, q_s, row_src);
    else
      load_query_tile<KCB, 4, BM, NTH>(p, q_s, row_src);
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
      if (st < total) issue(false);
      cp_async_commit();
    }

    float dss[DNORM ? NT : 1];  // normalize: running sum of squares of this lane's B elements
#pragma unroll
    for (int jn = 0; jn < (DNORM ? NT : 1); ++jn) dss[jn] = 0.f;
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    // Per-lane ldmatrix offsets (row & 7 == lane & 7 for both operands).
    const int sw = lane & 7;
    const uint32_t a_row = (uint32_t)((wm * WTM + (lane & 15)) * KCB);
    const int a_hi = lane >> 4;
    const uint32_t b_row = (uint32_t)((wn * WTN + (lane & 7) + ((lane >> 4) << 3)) * KCB);
    const int b_hi = (lane >> 3) & 1;

    int jg = 0, cbase = 0, kc = 0, slot = 0, t_slot = 0;  // global tile, first global tile of cdoc, rings
    for (int it = 0; it < total; ++it) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      if (pend_slot >= 0) {
        mask_s[pend_slot][tid] = pend_mask;
        pend_slot = -1;
      }
      if (it + STAGES - 1 < total) issue(true);
      cp_async_commit();

      float cs[SC ? NT : 1][2];  // doc-token scales of this lane's columns
      const uint32_t a_base = q_s + (uint32_t)(kc * BM * KCB) + a_row;
      const uint32_t b_base = d_s + (uint32_t)(slot * STAGE_BYTES) + b_row;
      // Fragments double-buffered in registers across the k steps.
      uint32_t af[2][MT][4], bfr[2][NT][2];
      auto load_frags = [&](int buf, int ks) {
#pragma unroll
        for (int i = 0; i < MT; ++i)
          ldsm_x4(af[buf][i][0], af[buf][i][1], af[buf][i][2], af[buf][i][3],
                  a_base + (uint32_t)(i * 16 * KCB) + (((ks * 2 + a_hi) ^ sw) << 4));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np)
          ldsm_x4(bfr[buf][2 * np][0], bfr[buf][2 * np][1], bfr[buf][2 * np + 1][0], bfr[buf][2 * np + 1][1],
                  b_base + (uint32_t)(np * 16 * KCB) + (((ks * 2 + b_hi) ^ sw) << 4));
      };
      // k steps with data in this chunk (a narrow row, e.g. 128 B of int8,
      // fills only part of the 256 B chunk).
      const int kst = kc + 1 == p.kch ? p.ksteps_last : KSTEPS;
      load_frags(0, 0);
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        if (ks >= kst) break;
        if (ks + 1 < kst) load_frags((ks + 1) & 1, ks + 1);
        if constexpr (kIsSplit<T>) {
          // Each fragment split once per k step, then 3 MMAs per tile.
          uint32_t ah[MT][4], al[MT][4], bh[NT][2], bl[NT][2];
#pragma unroll
          for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) split_tf32(af[ks & 1][i][e], ah[i][e], al[i][e]);
#pragma unroll
          for (int jn = 0; jn < NT; ++jn)
#pragma unroll
            for (int e = 0; e < 2; ++e) split_tf32(bfr[ks & 1][jn][e], bh[jn][e], bl[jn][e]);
#pragma unroll
          for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int jn = 0; jn < NT; ++jn) Mma<T>::run3(acc[i][jn], ah[i], al[i], bh[jn], bl[jn]);
        } else {
#pragma unroll
          for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int jn = 0; jn < NT; ++jn) Mma<T>::run(acc[i][jn], af[ks & 1][i], bfr[ks & 1][jn]);
        }
        if constexpr (DNORM) {
#pragma unroll
          for (int jn = 0; jn < NT; ++jn)
            dss[jn] += Mma<T>::sumsq(bfr[ks & 1][jn][0]) + Mma<T>::sumsq(bfr[ks & 1][jn][1]);
        }
      }

      if (++kc == p.kch) {
        if constexpr (DNORM) {
          // Lane holds token lane / 4 of each n8 block in its B fragments and
          // tokens 2 * (lane % 4) + {0, 1} in its accumulators.
#pragma unroll
          for (int jn = 0; jn < NT; ++jn) {
            float v = dss[jn];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
#pragma unroll
            for (int e = 0; e < 2; ++e)
              cs[jn][e] = inv_norm(__shfl_sync(0xffffffffu, v, ((lane & 3) * 2 + e) * 4));
            dss[jn] = 0.f;
          }
        }
        if constexpr (SCM == 1) {
          // Rows past the tile's end were zero-filled (their columns are masked below).
#pragma unroll
          for (int jn = 0; jn < NT; ++jn) {
            const float2 v = *reinterpret_cast<const float2*>(&dscale_s[t_slot][wn * WTN + jn * 8 + 2 * (lane & 3)]);
            cs[jn][0] = v.x;
            cs[jn][1] = v.y;
          }
        }
        if constexpr (SC) {
#pragma unroll
          for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int jn = 0; jn < NT; ++jn)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[i][jn][e] = Mma<T>::value(acc[i][jn][e]) * cs[jn][e & 1];
        }
        // Fold tile j of doc cdoc into the running row maxima (columns in
        // increasing order).
        const int c0 = doc_c0[cdoc], c1 = doc_c1[cdoc];
        const int n0 = c0 + (jg - cbase) * BN;  // first token (within the doc) of the tile
        const int colbase = n0 + wn * WTN + 2 * (lane & 3);
        if (!has_mask && n0 + BN <= c1) {
#pragma unroll
          for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int jn = 0; jn < NT; ++jn)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  if (ARG)
                    upd_arg(best[i][h], bidx[i][h], acc[i][jn][h * 2 + e], colbase + jn * 8 + e);
                  else
                    best[i][h] = max_nan(best[i][h], acc[i][jn][h * 2 + e]);
                }
        } else {
          const unsigned char* ms = &mask_s[t_slot][wn * WTN + 2 * (lane & 3)];
#pragma unroll
          for (int jn = 0; jn < NT; ++jn)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = colbase + jn * 8 + e;
              const bool valid = has_mask ? ms[jn * 8 + e] != 0 : col < c1;
#pragma unroll
              for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                  float v = valid ? acc[i][jn][h * 2 + e] : neg_inf();
                  if (ARG)
                    upd_arg(best[i][h], bidx[i][h], v, col);
                  else
                    best[i][h] = max_nan(best[i][h], v);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int jn = 0; jn < NT; ++jn)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][jn][e] = 0.f;
        kc = 0;
        ++jg;
        if (++t_slot == STAGES) t_slot = 0;
        // Finish every doc whose tiles are all done (the loads of the next
        // doc's tiles are already in flight).
        while (cdoc < nd && doc_tend[cdoc] == jg) {
          cbase = jg;
          finish_doc(cdoc++);
        }
      }
      if (++slot == STAGES) slot = 0;
    }
    cp_async_wait_all();
  }
}

}  // namespace cuda_fwd
}  // namespace maxsim

// ---------------------------------------------------------------------------
// Launch helpers (instantiated per dtype in forward_mma_<dtype>.cu).
// ---------------------------------------------------------------------------
namespace maxsim {
namespace cuda_fwd {

template <typename T, int CFG, bool ARG, int SCM>
inline void prepare_mma(size_t smem) {
  using C = typename MmaCfgOf<CFG>::type;
  static int set_bytes[kSmemOptInDevices] = {};
  opt_in_dynamic_smem(mma_fwd_kernel<T, C, ARG, SCM>, smem, set_bytes);
}

template <typename T, int CFG, bool ARG, int SCM>
inline void launch_mma_cfg(const FwdParams& p, int64_t item0, int64_t nitems, size_t smem, cudaStream_t stream) {
  using C = typename MmaCfgOf<CFG>::type;
  prepare_mma<T, CFG, ARG, SCM>(smem);
  launch_pdl(mma_fwd_kernel<T, C, ARG, SCM>, dim3((unsigned)nitems), dim3(C::NTH), smem, stream, p, item0);
}

// Resident CTAs per SM, cached per (device, shared memory): the host asks on
// every call, and the runtime query is a measurable share of a short call.
template <typename T, int CFG, bool ARG, int SCM>
inline int mma_occupancy_cfg(size_t smem) {
  using C = typename MmaCfgOf<CFG>::type;
  static std::mutex mu;
  static std::map<std::pair<int, size_t>, int> cache;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find({dev, smem});
    if (it != cache.end()) return it->second;
  }
  prepare_mma<T, CFG, ARG, SCM>(smem);
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, mma_fwd_kernel<T, C, ARG, SCM>, C::NTH, smem));
  std::lock_guard<std::mutex> lock(mu);
  cache[{dev, smem}] = n;
  return n;
}

// Runtime dispatch over (config, argmax); defined per dtype (the `normalize`
// kernels, SCM 2, in forward_mma_<dtype>_normalize.cu).
template <typename T>
void run_mma(int cfg, bool arg, const FwdParams& p, int64_t item0, int64_t nitems, size_t smem,
             cudaStream_t stream);
template <typename T>
int occupancy_mma(int cfg, bool arg, size_t smem);
template <typename T>
void run_mma_scaled(int cfg, bool arg, const FwdParams& p, int64_t item0, int64_t nitems, size_t smem,
                    cudaStream_t stream);
template <typename T>
int occupancy_mma_scaled(int cfg, bool arg, size_t smem);

// Calls f(std::integral_constant<int, CFG>) for the planner's config id cfg.
template <int CFG = 0, typename F>
inline auto with_mma_cfg(int cfg, F&& f) {
  if constexpr (CFG + 1 < plan::kNumMmaConfigs) {
    if (cfg != CFG) return with_mma_cfg<CFG + 1>(cfg, f);
  }
  return f(std::integral_constant<int, CFG>{});
}

template <typename T, int SCM>
inline void run_mma_scm(int cfg, bool arg, const FwdParams& p, int64_t item0, int64_t nitems, size_t smem,
                        cudaStream_t stream) {
  with_mma_cfg(cfg, [&](auto c) {
    constexpr int CFG = decltype(c)::value;
    if (arg)
      launch_mma_cfg<T, CFG, true, SCM>(p, item0, nitems, smem, stream);
    else
      launch_mma_cfg<T, CFG, false, SCM>(p, item0, nitems, smem, stream);
  });
}

template <typename T, int SCM>
inline int occupancy_mma_scm(int cfg, bool arg, size_t smem) {
  return with_mma_cfg(cfg, [&](auto c) {
    constexpr int CFG = decltype(c)::value;
    return arg ? mma_occupancy_cfg<T, CFG, true, SCM>(smem) : mma_occupancy_cfg<T, CFG, false, SCM>(smem);
  });
}

#define MAXSIM_DEFINE_MMA_RUNNERS_(RUN, OCC, T, SCM)                                                \
  template <>                                                                                     \
  void RUN<T>(int cfg, bool arg, const FwdParams& p, int64_t item0, int64_t nitems, size_t smem, \
              cudaStream_t stream) {                                                              \
    run_mma_scm<T, SCM>(cfg, arg, p, item0, nitems, smem, stream);                                \
  }                                                                                               \
  template <>                                                                                     \
  int OCC<T>(int cfg, bool arg, size_t smem) {                                                    \
    return occupancy_mma_scm<T, SCM>(cfg, arg, smem);                                             \
  }
#define MAXSIM_DEFINE_MMA_RUNNERS(T) MAXSIM_DEFINE_MMA_RUNNERS_(run_mma, occupancy_mma, T, kIsQuant<T> ? 1 : 0)
#define MAXSIM_DEFINE_MMA_SCALED_RUNNERS(T) MAXSIM_DEFINE_MMA_RUNNERS_(run_mma_scaled, occupancy_mma_scaled, T, 2)

}  // namespace cuda_fwd
}  // namespace maxsim
