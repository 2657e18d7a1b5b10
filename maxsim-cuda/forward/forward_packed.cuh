// Packed short documents (plan::Family::kPacked): fp16 / bf16 via mma.sync
// m16n8k16, fp32 accumulation.
//
// The other tile kernels give every (query tile, document) its own column
// tiles, so a document of 8 tokens costs a 64-column tile and an epilogue.
// Here the scores are the GEMM [query rows, d] x [d, concatenated document
// tokens]: a CTA holds BM = 128 query rows (queries in aligned slots of
// packed_rows(lq) rows; per-query candidates: one query) as A fragments in
// registers, and streams the tokens of up to dpc consecutive documents,
// concatenated, through a cp.async ring of BN = 64-column tiles. A table per
// tile maps each column to its token row (gathered, so any (start, length)
// works: padded, ragged, overlapping). After the MMAs the tile goes to shared
// memory and thread r scans row r's columns in order: a running (max,
// argmax) per row, NaN-propagating, ties to the lower index, masked columns
// -inf; where a document ends (the same column for every row, so the branch
// is uniform) each slot's rows are summed by xor shuffles in a fixed order
// and the score / argmax row are stored (store_score / store_argmax).
// Documents longer than a tile simply continue in the next one.
#pragma once

#include <c10/cuda/CUDAException.h>

#include "../common/common.cuh"
#include "../common/smem_opt_in.h"

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

template <typename T, int KS, bool ARG>
__global__ void __launch_bounds__(kPackedThreads, 2) packed_fwd_kernel(FwdParams p, int64_t item0) {
  constexpr int BM = kPackedBM, BN = kPackedBN, NTH = kPackedThreads, STAGES = kPackedStages;
  constexpr int TS = STAGES + 1;  // column-table ring: a tile's table lives from STAGES iterations ahead
  constexpr int RB = KS * 32;     // row bytes
  constexpr int UPR = RB / 16;    // 16-byte units per row
  constexpr int RSTEP = NTH / UPR;
  constexpr int SST = plan::kPackedSst;
  constexpr int MT = 2, NT = BN / 8;  // per warp: 32 rows x 64 columns
  static_assert(NTH == BM && BN <= NTH && BN % RSTEP == 0 && BM % RSTEP == 0, "packed tile shape");
  pdl_wait();

  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ long long cs[kPackedMaxDocs + 1];  // first stream column of each document
  __shared__ int dstart[kPackedMaxDocs];
  __shared__ unsigned char dvalid[kPackedMaxDocs];
  __shared__ int col_tok[TS][BN];            // token row of each column (-1: past the stream)
  __shared__ unsigned char col_m[TS][BN];    // the column counts (in the stream, not masked)
  __shared__ long long row_src[BM];
  __shared__ long long warp_tot[NTH / 32];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t ring = smem_u32(smem);
  float* S = reinterpret_cast<float*>(smem + STAGES * BN * RB);  // [BM][SST]; the query staging before
  const uint32_t q_s = smem_u32(S);

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

  // ---- this thread's query row ----------------------------------------------------
  const int R = p.qrows;
  const int slot = tid / R, qi = tid - slot * R;
  const int64_t qn = cross ? (int64_t)mt * p.qpt + slot : grp;
  const bool slot_live = cross ? (slot < p.qpt && qn < p.Nq) : slot == 0;
  int qs = 0, ql = 0;
  const bool qok = slot_live && query_ok(p, qn, qs, ql);
  const bool row_live = qok && qi < ql;
  const bool row_counts = row_live && (p.q_mask == nullptr || p.q_mask[qs + qi]);
  row_src[tid] = row_live ? (long long)qs + qi : -1;

  // ---- document table: starts, validity, prefix of lengths --------------------
  {
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
  __syncthreads();
  const long long total = cs[nd];
  const long long nch = (total + BN - 1) / BN;
  const bool has_mask = p.d_mask != nullptr;

  // Column table of tile ch (threads < BN): the token row of column
  // ch * BN + tid (the document holding it: the last j with cs[j] <= column),
  // and whether it counts (the mask byte goes to `mval`, stored later).
  auto col_table = [&](long long ch, bool& mval) -> int {
    const long long gc = ch * BN + tid;
    if (gc >= total) {
      mval = false;
      return -1;
    }
    int lo = 0, hi = nd - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (cs[mid] <= gc)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int tok = dstart[lo] + (int)(gc - cs[lo]);
    mval = !has_mask || p.d_mask[tok];
    return tok;
  };
  // cp.async of tile ch into its stage (columns past the stream: zeros).
  auto issue = [&](long long ch) {
    const int ts = (int)(ch % TS);
    const uint32_t dst = ring + (uint32_t)((ch % STAGES) * BN * RB);
    const int uc = tid % UPR;
#pragma unroll
    for (int r = tid / UPR; r < BN; r += RSTEP) {
      const int tok = col_tok[ts][r];
      const bool ok = tok >= 0;
      cp_async<16>(dst + packed_swz<RB>(r, uc), ok ? (const void*)(p.d + (int64_t)tok * RB + uc * 16) : (const void*)p.d,
                   ok);
    }
  };

  // ---- prologue: query tile (staged in S), the first tables and tiles -------------
  __syncthreads();  // row_src
  {
    const int uc = tid % UPR;
#pragma unroll 4
    for (int r = tid / UPR; r < BM; r += RSTEP) {
      const long long src = row_src[r];
      cp_async<16>(q_s + packed_swz<RB>(r, uc), src >= 0 ? (const void*)(p.q + src * RB + uc * 16) : (const void*)p.q,
                   src >= 0);
    }
    cp_async_commit();
  }
  if (tid < BN) {
#pragma unroll
    for (int ch = 0; ch < STAGES; ++ch) {
      bool m;
      col_tok[ch][tid] = col_table(ch, m);
      col_m[ch][tid] = m;
    }
  }
  __syncthreads();
#pragma unroll
  for (int ch = 0; ch < STAGES - 1; ++ch) {
    if (ch < nch) issue(ch);
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

  // ---- scan state (uniform across the CTA): document j, its remaining columns --
  float best = neg_inf();
  int bidx = -1;
  int j = 0, pos = 0, left = 0;
  // Ends document j: each slot's row sum (xor shuffles within the slot's
  // aligned lanes), its score and argmax row; then skips empty documents.
  auto finish = [&]() {
    const bool dok = dvalid[j];
    const bool use = row_counts && best != neg_inf();
    float v = use ? best : 0.f;
    for (int o = R >> 1; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (slot_live) {
      const int64_t dn = u0 + j;
      const int64_t pr = cross ? qn * p.Nd + dn : dn;
      if (qi == 0) store_score(p, pr, qok && dok, v);
      if (ARG && qi < p.lq) store_argmax(p, pr * p.lq + qi, use ? bidx : -1);
    }
    best = neg_inf();
    bidx = -1;
    ++j;
  };
  auto next_doc = [&]() {
    while (j < nd && cs[j + 1] == cs[j]) finish();
    pos = 0;
    left = j < nd ? (int)(cs[j + 1] - cs[j]) : 0;
  };
  next_doc();

  const int b_hi = (lane >> 3) & 1;
  const uint32_t b_row = (uint32_t)(((lane & 7) + ((lane >> 4) << 3)) * RB);
  const float* srow = S + tid * SST;
  bool pend = false;
  int pend_slot = -1;
  for (long long ch = 0; ch < nch; ++ch) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (pend_slot >= 0) col_m[pend_slot][tid] = pend;
    if (ch + STAGES - 1 < nch) issue(ch + STAGES - 1);
    cp_async_commit();
    pend_slot = -1;
    if (tid < BN && ch + STAGES < nch) {
      const int ts = (int)((ch + STAGES) % TS);
      col_tok[ts][tid] = col_table(ch + STAGES, pend);
      pend_slot = ts;
    }

    // MMAs: 32 query rows x 64 columns per warp.
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int jn = 0; jn < NT; ++jn)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][jn][e] = 0.f;
    const uint32_t b_base = ring + (uint32_t)((ch % STAGES) * BN * RB) + b_row;
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
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float* dst = S + (warp * 32 + i * 16 + h * 8 + (lane >> 2)) * SST + 2 * (lane & 3);
#pragma unroll
        for (int jn = 0; jn < NT; ++jn) {
          dst[jn * 8] = acc[i][jn][h * 2];
          dst[jn * 8 + 1] = acc[i][jn][h * 2 + 1];
        }
      }
    __syncthreads();

    // Row tid's columns of this tile, in order.
    const int ncol = (int)min((long long)BN, total - ch * BN);
    const unsigned char* cm = col_m[ch % TS];
    for (int c = 0; c < ncol; ++c) {
      const float v = cm[c] ? srow[c] : neg_inf();
      if (ARG)
        upd_arg(best, bidx, v, pos);
      else
        best = max_nan(best, v);
      ++pos;
      if (--left == 0) {
        finish();
        next_doc();
      }
    }
  }
  cp_async_wait_all();
  while (j < nd) finish();  // never taken: every document ended on its last column or was empty
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
