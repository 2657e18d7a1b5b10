// The register stream's runs of pairs (plan::StreamPlan::run > 0): each
// warp scores a run of up to plan::kStreamRunMax consecutive pairs that
// share one query -- consecutive documents of one query (CROSS), or
// consecutive candidates of one query (GROUPED) -- for many short documents,
// where one warp per pair reloads the query's A fragments (lq x row bytes,
// from L2) for every document, up to 4x the document's own bytes at 8
// tokens, and waits on a short chain of dependent loads per pair.
//
// The run's A fragments load once. Its documents are one stream of n-tile
// steps (8 tokens of one document each; a document of l tokens takes
// max(1, ceil(l / 8)) steps, so an empty or invalid one takes a step that
// loads nothing), U steps in flight across document boundaries: a step's
// slot is refilled before the epilogue of the document the step ended, so
// the next documents' loads are on their way while it runs. The epilogue
// (row maxima reduced over the quad, summed over the query rows in lane
// order, masked / out-of-length columns -inf) is stream_fwd_kernel's, on
// the same lane layout and k order, so every score is bitwise the one the
// one-pair-per-warp path gives. Lane i holds the run's i-th document
// segment (start, length; -1 when the pair is invalid), loaded once per
// run; the step cursors take them by shuffles.
//
// 16-bit rows of 128 / 256 bytes only (d 64 / 128, the short-document
// shapes); no fused top-k, no argmax, no per-token scales. Included by
// forward_stream.cuh.
#pragma once

namespace maxsim {
namespace cuda_fwd {

// Steps in flight per warp: 8 KB of 256-byte rows (as stream_fwd_kernel),
// twice the steps of 128-byte rows (same bytes; the registers allow it).
template <int KS>
constexpr int kStreamRunU = KS <= 4 ? 8 : 4;

// Resident CTAs per SM the registers must allow: unbounded, 256-byte rows
// with 32 query rows took a few registers more than 3 CTAs allow, and 2
// CTAs (8 warps) keep a third fewer bytes in flight per SM.
constexpr int kStreamRunMinBlocks = 3;

// KS: k steps (row bytes / 32: 4 or 8); MT: m tiles of 16 query rows.
// p.stream_run: pairs per run; p.stream_rpg: runs per group (a group: the
// K candidates of a query, or all P pairs of one CROSS query).
template <typename T, int KS, int MT>
__global__ void __launch_bounds__(kStreamWarps * 32, kStreamRunMinBlocks) stream_run_kernel(const FwdParams p) {
#if MAXSIM_STREAM_DEVICE
  static_assert(!kIsQuant<T> && (KS == 4 || KS == 8), "runs of pairs take 16-bit rows of 128 / 256 bytes");
  pdl_wait();
  constexpr int U = kStreamRunU<KS>;
  constexpr int W = KS / 2;  // 16-byte vectors per lane per row
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  // The run: a 32-bit division (the planner keeps P < 2^31).
  const uint32_t run_id = blockIdx.x * kStreamWarps + (threadIdx.x >> 5);
  const uint32_t rpg = (uint32_t)p.stream_rpg, R = (uint32_t)p.stream_run;
  const uint32_t grp = run_id / rpg, rr = run_id - grp * rpg;
  const int64_t gsz = p.layout == kGroupedL ? p.K : p.P;
  const int64_t first = (int64_t)grp * gsz + (int64_t)rr * R;
  if (first >= p.P) return;  // past the last run (whole warps)
  const int cnt = (int)min((int64_t)R, min(gsz - (int64_t)rr * R, p.P - first));
  // One query per run (CROSS: the only one); pair first + i is document
  // first + i in both layouts (pair_ids).
  const int64_t n = p.layout == kGroupedL ? (int64_t)grp : 0;
  int qs = 0, ql = 0, ds = 0, dl = 0;
  const bool qok = query_ok(p, n, qs, ql);
  const bool dok = lane < cnt && doc_ok(p, first + lane, ds, dl);
  // Lane i's document: its length, -1 for an invalid pair (scored NaN,
  // nothing loaded).
  const int dle = dok && qok ? dl : -1;

  const int64_t rb = p.row_bytes;
  // The whole-sector lane layout (stream_il bit 0), always: the 16-bit
  // one-pair path's, so the products pair the same dims in the same k order.
  const int lane_off = c * 16;
  constexpr int vs = 4;  // stride between a lane's vectors, in uint4
  const bool keep = (int)blockIdx.x < p.stream_keep;
  const int64_t tstep = 8 * rb;

  // The fetch cursor: document fi of the run, its first token ft of the
  // step (8 per step), length fdl (>= 0). A document's last step is the one
  // with ft + 8 >= its length (one step for an empty document).
  uint4 buf[U][W];
  int fi = 0, ft = 0;
  int fdl = max(__shfl_sync(kAll, dle, 0), 0);
  const char* fsrc = p.d + ((int64_t)__shfl_sync(kAll, ds, 0) + g) * rb + lane_off;
  auto fetch = [&](int u) {
    if (fi < cnt) {  // warp-uniform
      if (ft + g < fdl) {
        const uint4* src = reinterpret_cast<const uint4*>(fsrc);
#pragma unroll
        for (int w = 0; w < W; ++w) buf[u][w] = keep ? ld_keep(src + w * vs) : ld_stream(src + w * vs);
      } else {
#pragma unroll
        for (int w = 0; w < W; ++w) buf[u][w] = make_uint4(0, 0, 0, 0);
      }
      ft += 8;
      if (ft < fdl) {
        fsrc = advance(fsrc, tstep);
      } else {  // the next document of the run
        ++fi;
        ft = 0;
        const int sl = fi & 31;
        fdl = max(__shfl_sync(kAll, dle, sl), 0);
        fsrc = p.d + ((int64_t)__shfl_sync(kAll, ds, sl) + g) * rb + lane_off;
      }
    }
  };
#pragma unroll
  for (int u = 0; u < U; ++u) fetch(u);

  // The query's A fragments, once per run (rows past its length zero), and
  // the query rows that count (lane r: row r) -- the documents' first steps
  // are already in flight.
  uint32_t a[MT][KS][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = mt * 16 + h * 8 + g;
      uint4 seg[W];
      query_row_global<W>(seg, p, qok, qs, ql, i, rb, lane_off, vs);
      query_row_words<KS, W>(a[mt], h, seg);
    }
  bool qrow = qok && lane < ql;
  if (qrow && p.q_mask != nullptr) qrow = p.q_mask[(int64_t)qs + lane];

  // The consume cursor: document ci, its step's first token ct, its start
  // and length (-1: an invalid pair).
  float best[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) best[mt][0] = best[mt][1] = neg_inf();
  int ci = 0, ct = 0;
  int cle = __shfl_sync(kAll, dle, 0), cds = __shfl_sync(kAll, ds, 0);
  // Document ci's score: stream_fwd_kernel's epilogue (one warp per pair).
  auto finish = [&] {
    float v = neg_inf();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float b = best[mt][h];
        b = max_nan(b, __shfl_xor_sync(kAll, b, 1));
        b = max_nan(b, __shfl_xor_sync(kAll, b, 2));
        const float x = __shfl_sync(kAll, b, 4 * (lane & 7));
        if ((lane >> 3) == 2 * mt + h) v = x;
        best[mt][h] = neg_inf();
      }
    const bool ok = cle >= 0;
    const bool use = ok && qrow && v != neg_inf();
    const float sum = warp_sum(use ? v : 0.f);
    if (lane == 0) store_score(p, first + ci, ok, sum);
  };

  while (true) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (ci < cnt) {  // warp-uniform
        float acc[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
#pragma unroll
        for (int s = 0; s < KS; ++s) {
          const uint32_t b[2] = {u4_word(buf[u][s / 2], 2 * (s % 2)), u4_word(buf[u][s / 2], 2 * (s % 2) + 1)};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) Mma<T>::run(acc[mt], a[mt][s], b);
        }
        const int cdl = max(cle, 0);
        if (ct + 8 <= cdl && p.d_mask == nullptr) {
          fold_columns<false>(best, acc, true, true);
        } else {
          const int j0 = ct + 2 * c;
          bool v0 = j0 < cdl, v1 = j0 + 1 < cdl;
          if (p.d_mask != nullptr) {
            v0 = v0 && p.d_mask[(int64_t)cds + j0];
            v1 = v1 && p.d_mask[(int64_t)cds + j0 + 1];
          }
          fold_columns<false>(best, acc, v0, v1);
        }
        // The slot is free: refill it before this document's epilogue.
        fetch(u);
        ct += 8;
        if (ct >= cdl) {  // the document's last step
          finish();
          ++ci;
          ct = 0;
          const int sl = ci & 31;
          cle = __shfl_sync(kAll, dle, sl);
          cds = __shfl_sync(kAll, ds, sl);
        }
      }
    }
    if (ci >= cnt) break;
  }
  if (p.stream_multiwave) pdl_trigger();
#endif
}

// The run kernel of a plan (16-bit rows; stream_kernel's dispatch).
template <typename T>
StreamKernel stream_run_kernel_of(const plan::StreamPlan& s) {
  if constexpr (kIsQuant<T>) {
    MAXSIM_CHECK(false, "maxsim: runs of pairs take 16-bit tokens");
    return {};
  } else {
    MAXSIM_CHECK(!s.rank && !s.doc_scale && (s.ks == 4 || s.ks == 8),
                 "maxsim: runs of pairs take rows of 4 or 8 k steps, no fused top-k");
    constexpr int kThreads = kStreamWarps * 32;
    if (s.ks == 4)
      return s.rows == 1 ? StreamKernel{stream_run_kernel<T, 4, 1>, kThreads}
                         : StreamKernel{stream_run_kernel<T, 4, 2>, kThreads};
    return s.rows == 1 ? StreamKernel{stream_run_kernel<T, 8, 1>, kThreads}
                       : StreamKernel{stream_run_kernel<T, 8, 2>, kThreads};
  }
}

}  // namespace cuda_fwd
}  // namespace maxsim
