// Register-streaming forward for one short query against many documents
// (lq <= 32, rows of 64 / 128 / 192 / 256 bytes: fp16 / bf16 dim 32-128, or
// int8 / fp8 e4m3 tokens with per-token or per-document scales, dim
// 64-256; no argmax, no `normalize`; the planner selects it): memory-bound
// reranking and corpus scans (search over an 8-bit corpus included), where
// the tile kernel's shared-memory staging, ldmatrix and barriers only add
// latency between DRAM and the tensor cores. Any layout works; the host
// takes it for CROSS with one query and for 16-bit GROUPED candidates and
// LIST pairs (forward_plan.h). On sm_90a the staged wgmma stream
// (forward_stream_wg.cuh) takes most of those shapes; this kernel keeps
// documents under 64 tokens, few pairs, pair lists, 8-bit rows and the
// search re-score.
//
// Many short documents of one query (CROSS with one query, GROUPED
// candidates; 16-bit rows of 128 / 256 bytes): runs of consecutive pairs per
// warp (forward_stream_run.cuh), the query's fragments loaded once per run
// and the steps in flight across document boundaries, bitwise the scores of
// the one-pair-per-warp path below. Otherwise:
// One warp per pair, or S = 2 / 4 warps per pair each taking every S-th of
// the document's tiles, so the pair's warps read adjacent tiles at once
// (a little faster than contiguous ranges). Their row maxima combine
// through shared memory; max is order-free, so every S gives the same bits.
// A grid of several waves takes its last pairs at S = 4, one per CTA, so it
// ends on short tasks; few pairs of long documents (<= one CTA per SM) take
// CTAs of 8 warps, one pair each, halving each warp's chain of loads. The
// query's A fragments stay in registers; document tokens are loaded straight
// into B fragments, 8 tokens (one m16n8k16 n tile) per step, U steps in
// flight.
// The trick that makes the loads coalesced 16-byte vectors: a dot product
// does not care about the order of k, so lane (g, c) (g = lane / 4,
// c = lane % 4) takes W = row bytes / 64 vectors of token g of the step --
// vectors 4w + c (16-bit rows: in each load the quad reads 64 contiguous
// bytes, whole sectors) or c * W + w (8-bit rows) -- and k step s uses its
// words 2s and 2s + 1 as {b0b1, b2b3}. The query rows' A fragments are
// built from the same vectors in the same order (row g and g + 8: words
// 2s -> {a0a1, a2a3}, 2s + 1 -> {a4a5, a6a7}), so every product pairs the
// same dim of query and document. fp32 accumulation as elsewhere; row
// maxima in registers, reduced over the quad and summed over rows with the
// same masking rules and row-sum order as finish_tile (common.cuh); int8
// rows with one scale per document keep their maxima as exact int32 (the
// scale applied once per row).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <map>
#include <mutex>

#include "../common/common.cuh"

namespace maxsim {
namespace cuda_fwd {

using plan::kStreamWarps;  // warps (pairs) per CTA
// Few pairs of 16-bit rows at d = 64 / 128: one pair per CTA of this many
// warps, so each warp's chain of dependent tile loads is half as long.
using plan::kStreamWideWarps;
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

// One query row's words of the A fragments (h = 0: row g of the 16-row tile,
// h = 1: row g + 8) from the lane's W vectors of that row: words 2s, 2s + 1
// of k step s, the documents' k order (see the header).
template <int KS, int W>
__device__ __forceinline__ void query_row_words(uint32_t (&a)[KS][4], int h, const uint4 (&seg)[W]) {
#pragma unroll
  for (int s = 0; s < KS; ++s) {
    a[s][h] = u4_word(seg[s / 2], 2 * (s % 2));
    a[s][2 + h] = u4_word(seg[s / 2], 2 * (s % 2) + 1);
  }
}

// The lane's W vectors of query row i read from global memory (stride vs
// uint4), zeros past the query's length ql or for an invalid query.
template <int W>
__device__ __forceinline__ void query_row_global(uint4 (&seg)[W], const FwdParams& p, bool ok, int qs, int ql,
                                                 int i, int64_t rb, int lane_off, int vs) {
#pragma unroll
  for (int w = 0; w < W; ++w) seg[w] = make_uint4(0, 0, 0, 0);
  if (ok && i < ql) {
    const uint4* src = reinterpret_cast<const uint4*>(p.q + ((int64_t)qs + i) * rb + lane_off);
#pragma unroll
    for (int w = 0; w < W; ++w) seg[w] = __ldg(src + w * vs);
  }
}

// Columns 2c, 2c + 1 of an n tile fold into the query rows' running maxima
// unless past the document or masked (v0, v1); IM: exact int32 products of
// 8-bit rows (compared as integers).
template <bool IM, int MT>
__device__ __forceinline__ void fold_columns(float (&best)[MT][2], const float (&acc)[MT][4], bool v0, bool v1) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (IM) {
        const int none = __float_as_int(neg_inf());
        best[mt][h] = __int_as_float(__vimax3_s32(__float_as_int(best[mt][h]),
                                                  v0 ? __float_as_int(acc[mt][2 * h]) : none,
                                                  v1 ? __float_as_int(acc[mt][2 * h + 1]) : none));
      } else {
        best[mt][h] = max_nan(best[mt][h],
                              max_nan(v0 ? acc[mt][2 * h] : neg_inf(), v1 ? acc[mt][2 * h + 1] : neg_inf()));
      }
    }
}

// A 16-byte streamed load (evict first) with the L2 256-byte prefetch hint:
// a quad reads 64 bytes of a token per load, and the rest of its row (and,
// for rows under 256 bytes, the next token's) is then already on its way
// (faster than the 128-byte hint or none on every streaming shape).
__device__ __forceinline__ uint4 ld_stream(const uint4* ptr) {
  uint4 v;
  asm("ld.global.cs.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  return v;
}

// p + s, opaque to the compiler: written as `p += s`, the unrolled loop
// below gets the U fetch addresses precomputed (p + k s) and kept live, 16-20
// registers more, which cost the 8-bit and 256-byte kernels a CTA per SM.
__device__ __forceinline__ const char* advance(const char* p, int64_t s) {
  asm("add.s64 %0, %0, %1;" : "+l"(p) : "l"(s));
  return p;
}

// The same load at the normal L2 priority: documents that fit in L2 stay
// there for the next call (plan::Plan::keep).
__device__ __forceinline__ uint4 ld_keep(const uint4* ptr) {
  uint4 v;
  asm("ld.global.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  return v;
}

// The low two e4m3 of a word as f16x2 (exact).
__device__ __forceinline__ uint32_t f8x2_to_h2(uint32_t w) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), __NV_E4M3);
  return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

// Rows of at most this many candidates rank in the fused top-k below (one
// key per thread).
using plan::kRankMax;

// The fused top-k of rescore_topk (kKeysL, rank_done set): pairs [lo, hi)
// are this CTA's; the CTA that completes a row's count ranks the row's
// pair_kc <= kRankMax keys (score, id) and writes the top rank_k decoded:
// block_topk's order (higher score, then lower id; NaN, then empty slots
// last), (-inf, -1) past the candidates. Thread i holds key i and counts the
// greater keys (equal ones before it count too: a permutation even with
// repeated keys). The count is cheaper than a sort in registers or shared
// memory at these sizes; past 128 keys it lost to a separate select, so
// longer rows are scored here without it and ranked by block_topk
// (rescore_topk.cu).
// Every thread of the CTA calls it; xch: shared memory for kRankMax keys.
__device__ __forceinline__ void rank_rows(const FwdParams& p, int64_t lo, int64_t hi, long long* xch) {
  __shared__ int rows[1 + kStreamWarps];
  const int tid = threadIdx.x;
  const int kc = (int)p.pair_kc;
  const int64_t k = p.rank_k;
  // The CTA's score stores reach thread 0 through the barrier; its count is
  // a release (publishing them, cumulatively, to the CTA that completes the
  // row) and an acquire (making the other CTAs' stores visible here, and to
  // this CTA's threads through the next barrier) -- the pattern of CUTLASS's
  // generic barrier, in place of two full fences.
  __syncthreads();
  if (tid == 0) {
    int nl = 0;
    for (int64_t a = lo; a < hi;) {
      const int64_t n = a / kc, b = min(hi, (n + 1) * kc);
      int old;
      asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;"
                   : "=r"(old) : "l"(p.rank_done + n), "r"((int)(b - a)) : "memory");
      if (old + (b - a) == kc) rows[1 + nl++] = (int)n;
      a = b;
    }
    rows[0] = nl;
  }
  __syncthreads();
  const int nl = rows[0];
  for (int r = 0; r < nl; ++r) {
    const int64_t n = rows[1 + r];
    long long x = INT64_MIN;
    if (tid < kc)
      x = search_keys::encode_id(__ldcg(p.scores + n * kc + tid), search_keys::id_of(p.pair_keys[n * kc + tid]));
    xch[tid] = x;
    __syncthreads();
    int g = 0;
#pragma unroll 8
    for (int j = 0; j < kRankMax; ++j) {
      const long long y = xch[j];
      g += (int)(y > x) | ((int)(y == x) & (int)(j < tid));
    }
    if (g < k) search_keys::decode(x, p.rank_scores[n * k + g], p.rank_ids[n * k + g]);
    for (int64_t e = kRankMax + tid; e < k; e += kRankMax) {
      p.rank_scores[n * k + e] = neg_inf();
      p.rank_ids[n * k + e] = -1;
    }
    __syncthreads();  // xch: the next row
  }
}

// KS: k steps (row bytes / 32); MT: m tiles of 16 query rows (lq <= 16 * MT);
// RK: the fused top-k of rescore_topk (rank_rows; 16-bit tokens only); DS:
// 8-bit rows with one scale per document (p.d_scale_per_doc); NW: warps
// per CTA (kStreamWideWarps: one pair per CTA, p.stream_split = NW).
template <typename T, int KS, int MT, bool RK, bool DS, int NW = kStreamWarps>
__global__ void __launch_bounds__(NW * 32) stream_fwd_kernel(const FwdParams p) {
#if MAXSIM_STREAM_DEVICE
  static_assert(NW == kStreamWarps || !RK, "the fused top-k ranks kRankMax keys per CTA");
  pdl_wait();
  constexpr bool SC = kIsQuant<T>;
  // int8 with one scale per document: the scale is common to a row's columns
  // and applied after the max (as below for every 8-bit row), so `best`
  // carries the exact s32 dot products' maxima (s32_max_value, common.cuh),
  // converted once after the loop -- no conversion, scaling or NaN-aware max
  // per column.
  constexpr bool IM = std::is_same<T, int8_t>::value && DS;
  constexpr int U = kStreamU<T, KS>;
  constexpr int W = KS / 2;  // 16-byte vectors per lane per row
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, warp = threadIdx.x >> 5;
  // Head CTAs: NW / SP pairs each; tail CTAs: one pair over all their warps.
  const bool tail = blockIdx.x >= p.stream_head_blocks;
  const int SP = tail ? NW : p.stream_split;  // warps per pair: 1, 2, 4 (or 8 = NW)
  // Shifts, not divisions, by SP: every instruction before the first load
  // below delays a new CTA's first DRAM request (a generic division is ~40
  // dependent instructions).
  const int lgSP = __ffs(SP) - 1;
  const int part = warp & (SP - 1);
  const int64_t per = NW >> lgSP;  // pairs per CTA
  const int64_t pr = tail ? (p.P - p.stream_tail) + (blockIdx.x - p.stream_head_blocks)
                          : (int64_t)blockIdx.x * per + (warp >> lgSP);
  const bool live = pr < (tail ? p.P : p.P - p.stream_tail);
  // Warps past the last pair stay to the end: the CTA meets at barriers.
  // One query against documents, or candidates: the document id is the
  // pair's, so the guessed loads below wait for no division; the query id
  // (a division for candidates) is worked out after them.
  const bool by_pos = p.layout == kGroupedL || (p.layout == kCrossL && p.Nq == 1);
  auto query_of = [&](int64_t x) -> int64_t { return p.layout == kGroupedL ? x / p.K : 0; };
  int64_t n = 0, dn = pr;
  if (live && !by_pos) pair_ids(p, pr, n, dn);
  const int64_t rb = p.row_bytes;
  // A warp's first tiles do not depend on the document's length when it
  // starts at tile `part` (interleaved split or one warp per pair), so with
  // a guessed start (stream_extent) they are requested before the segment's
  // (start, len) arrive -- at a wave boundary that dependent load otherwise
  // delays every new CTA's first DRAM request.
  const bool ilv = (p.stream_il & 2) != 0 && SP > 1;
  // 16-bit rows of >= 128 bytes (d >= 64) only: at d = 32 the guess cost spills.
  constexpr bool kGuess = !kIsQuant<T> && !RK && KS >= 4;
  const bool spec = kGuess && live && p.stream_extent > 0 && (ilv || SP == 1);
  const int64_t gds = dn * p.stream_extent;
  // Interleaved: in load w, the quad's four lanes read 64 contiguous bytes
  // (vector 4w + c), so every 32-byte sector of a request is whole.
  const bool il = (p.stream_il & 1) != 0;
  const int lane_off = il ? c * 16 : c * W * 16;
  const int vs = il ? 4 : 1;  // stride between a lane's vectors, in uint4

  float best[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) best[mt][0] = best[mt][1] = neg_inf();
  uint4 buf[U][W];
  const int ts = ilv ? SP : 1;
  const int64_t fstep = 8 * ts * rb;
  const bool keep = (int)blockIdx.x < p.stream_keep;
  const int tb0 = ilv ? part : 0;  // the first tile when spec
  if (spec) {
    const char* src0 = p.d + (gds + tb0 * 8 + g) * rb + lane_off;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if ((tb0 + u * ts) * 8 + g < p.stream_extent) {
        const uint4* src = reinterpret_cast<const uint4*>(src0 + u * fstep);
#pragma unroll
        for (int w = 0; w < W; ++w) buf[u][w] = keep ? ld_keep(src + w * vs) : ld_stream(src + w * vs);
      } else {
#pragma unroll
        for (int w = 0; w < W; ++w) buf[u][w] = make_uint4(0, 0, 0, 0);
      }
    }
  }
  if (live && by_pos) n = query_of(pr);
  // The CTA's staged query rows, guessed the same way (every warp of the CTA
  // takes part: the guess is CTA-uniform).
  __shared__ uint4 qsh[32 * 256 / 16];
  const bool staged = p.stream_qsm || tail;
  const bool qspec = kGuess && staged && p.stream_qextent > 0;
  // The CTA's first pair: looked up here only where the guess needs it, so
  // the instantiations without it (8-bit, fused re-score, d = 32) keep their
  // old order of loads (below).
  int64_t n0 = 0, dn0 = 0;
  auto first_pair = [&] {
    const int64_t pr0 = tail ? pr : (int64_t)blockIdx.x * per;
    if (live && pr0 == pr)
      n0 = n;
    else if (by_pos)
      n0 = query_of(pr0);
    else
      pair_ids(p, pr0, n0, dn0);
  };
  if (kGuess && staged) first_pair();
  const int64_t gq0 = n0 * p.stream_qextent;
  const int qrows = (int)min((int64_t)p.lq, p.stream_qextent);
  if (qspec && n0 < p.Nq) {
    const char* src = p.q + gq0 * rb;
    for (int x = threadIdx.x; x < qrows * (int)(rb / 16); x += NW * 32)
      cp_async<16>(smem_u32(qsh + x), src + (int64_t)x * 16, true);
    cp_async_commit();
  }
  int qs = 0, ql = 0, ds = 0, dl = 0;
  const bool qok = live && query_ok(p, n, qs, ql);
  const bool ok = live && doc_ok(p, dn, ds, dl) && qok;
  // The staged query's segment, beside the pair's own (one round trip).
  int qs0 = 0, ql0 = 0;
  bool q0ok = kGuess && staged && query_ok(p, n0, qs0, ql0);
  // The guess held if the segment starts there and ends within the guessed
  // extent (rows past its end were read but are masked like any tail).
  const bool guessed = spec && ok && ds == gds && dl <= p.stream_extent;
  const int ntile = ok ? (dl + 7) / 8 : 0;
  // This warp's tiles of the pair: a contiguous range, or (stream_il bit 1)
  // every SP-th tile from tile `part`, so the pair's warps read adjacent
  // tiles at any moment.
  const int tchunk = (ntile + SP - 1) >> lgSP;
  const int tb = ilv ? part : min(ntile, part * tchunk), te = ilv ? ntile : min(ntile, tb + tchunk);
  float2 dsc[SC && !DS ? U : 1];  // doc-token scales of columns 2c, 2c + 1 (8-bit)
  // One scale per document (the caller's promise): applied to the row sum's
  // terms at the end instead of to every product, and no scale loads.
  constexpr bool doc_sc = SC && DS;
  // Tiles are fetched in order, so the next one's address and token index
  // advance by a tile per fetch instead of being recomputed (64-bit
  // products) each time; token j of the warp's range is in bounds iff
  // j < jlim (j = 8 t + g: t < te and j < dl).
  const int jlim = ilv ? dl : min(te * 8, dl);
  int fj = tb * 8 + g;
  const char* fsrc = p.d + ((int64_t)ds + fj) * rb + lane_off;
  const float* fsc = SC && !DS ? p.d_scale + ds + tb * 8 + 2 * c : nullptr;
  auto fetch = [&](int u) {
    if (fj < jlim) {
      const uint4* src = reinterpret_cast<const uint4*>(fsrc);
#pragma unroll
      for (int w = 0; w < W; ++w) buf[u][w] = keep ? ld_keep(src + w * vs) : ld_stream(src + w * vs);
    } else {
#pragma unroll
      for (int w = 0; w < W; ++w) buf[u][w] = make_uint4(0, 0, 0, 0);
    }
    if constexpr (SC && !DS) {
      // Columns past the document are masked below; their scale is never used.
      const int j0 = fj - g + 2 * c;
      dsc[u].x = j0 < jlim ? __ldcs(fsc) : 0.f;
      dsc[u].y = j0 + 1 < jlim ? __ldcs(fsc + 1) : 0.f;
      fsc += 8 * ts;
    }
    fsrc = advance(fsrc, fstep);
    fj += 8 * ts;
  };
  if (guessed) {  // the first U tiles are in flight: continue after them
    fj += U * 8 * ts;
    fsrc = advance(fsrc, U * fstep);
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u) fetch(u);
  }

  // The query rows: staged once per CTA in shared memory when the CTA's
  // warps share the query of its first pair (one query against many
  // documents, GROUPED candidates), else read by each warp. The documents'
  // first tiles are already in flight.
  bool from_sh = false;
  if (staged) {
    if (!kGuess) {
      first_pair();
      q0ok = query_ok(p, n0, qs0, ql0);
    }
    if (qspec && n0 < p.Nq) cp_async_wait_all();  // drained either way before qsh is rewritten
    if (q0ok) {
      // The guess held if the segment starts there with no more rows than
      // were staged (rows past its length are staged but never read).
      if (!(qspec && qs0 == gq0 && ql0 <= qrows)) {
        const uint4* src = reinterpret_cast<const uint4*>(p.q + (int64_t)qs0 * rb);
        for (int x = threadIdx.x; x < ql0 * (int)(rb / 16); x += NW * 32) qsh[x] = __ldg(src + x);
      }
      from_sh = ok && n == n0;
    }
    __syncthreads();
  }
  uint32_t a[MT][KS][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = mt * 16 + h * 8 + g;
      uint4 seg[W];
      if (from_sh) {
        // Rows past the query's length read stale shared memory: a row of
        // the products depends on its own query row only, and those rows'
        // maxima are never summed (no zeroing on the critical path).
        const uint4* src = qsh + (i * rb + lane_off) / 16;
#pragma unroll
        for (int w = 0; w < W; ++w) seg[w] = src[w * vs];
      } else {
        query_row_global<W>(seg, p, ok, qs, ql, i, rb, lane_off, vs);
      }
      query_row_words<KS, W>(a[mt], h, seg);
    }

  // fp8: Hopper's fp8 mma.sync issues below the f16 rate; every e4m3 value is exact in f16, so each word
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

  for (int t0 = tb; t0 < te; t0 += U * ts) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * ts;
      if (t < te) {
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
        if constexpr (SC && !IM) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float x = Mma<T>::value(acc[mt][e]);
              acc[mt][e] = doc_sc ? x : x * (e & 1 ? dsc[u].y : dsc[u].x);
            }
        }
        // Whether the tile is whole and unmasked is the same for the warp's
        // lanes, so only the last tile (or a masked document) pays the
        // per-column tests.
        if (t * 8 + 8 <= dl && p.d_mask == nullptr) {
          fold_columns<IM>(best, acc, true, true);
        } else {
          const int j0 = t * 8 + 2 * c;
          bool v0 = j0 < dl, v1 = j0 + 1 < dl;
          if (p.d_mask != nullptr) {
            v0 = v0 && p.d_mask[(int64_t)ds + j0];
            v1 = v1 && p.d_mask[(int64_t)ds + j0 + 1];
          }
          fold_columns<IM>(best, acc, v0, v1);
        }
      }
      fetch(u);
    }
  }
  if constexpr (IM) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) best[mt][h] = s32_max_value(best[mt][h]);
  }
  // A grid of several waves lets the next kernel launch once every CTA is
  // past its loads (its CTAs wait in the slots the tail frees); a one-wave
  // grid leaves it to the exit (triggered at the start, the successor takes
  // the free slots of a partly filled GPU and slows it).
  if (p.stream_multiwave) pdl_trigger();
  // Row r = 16 mt + 8 h + g: max over the quad, then to lane r.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      best[mt][h] = max_nan(best[mt][h], __shfl_xor_sync(0xffffffffu, best[mt][h], 1));
      best[mt][h] = max_nan(best[mt][h], __shfl_xor_sync(0xffffffffu, best[mt][h], 2));
    }
  bool writer = true;  // the pair's first warp writes its score
  if (SP > 1) {  // the pair's warps combine their row maxima (max is order-free)
    __shared__ float red[NW][32];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (c == 0) red[warp][16 * mt + 8 * h + g] = best[mt][h];
    __syncthreads();
    if (part != 0 || !live) {
      if constexpr (!RK) return;
      writer = false;
    }
    if (writer)
      for (int o = 1; o < SP; ++o)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) best[mt][h] = max_nan(best[mt][h], red[warp + o][16 * mt + 8 * h + g]);
  }
  if (writer) {
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
    if (SC && use) v *= doc_sc ? p.q_scale[(int64_t)qs + lane] * p.d_scale[ds] : p.q_scale[(int64_t)qs + lane];
    const float sum = warp_sum(use ? v : 0.f);
    if (lane == 0 && live) store_score(p, pr, ok, sum);
  }
  if constexpr (RK) {  // kKeysL with the fused top-k (the whole CTA)
    const int64_t lo = tail ? pr : (int64_t)blockIdx.x * per;
    const int64_t hi = tail ? pr + 1 : min(lo + per, p.P - p.stream_tail);
    rank_rows(p, lo, hi, reinterpret_cast<long long*>(qsh));
  }
#endif
}

template <typename Kern>
int stream_blocks_per_sm(Kern kern, int threads, size_t smem = 0) {
  int b = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kern, threads, smem));
  return std::max(b, 1);
}

// The streaming kernel instance of a plan and its threads per CTA.
struct StreamKernel {
  void (*fn)(const FwdParams);
  int threads;
};

}  // namespace cuda_fwd
}  // namespace maxsim

#include "forward_stream_run.cuh"  // runs of pairs (plan::StreamPlan::run)

namespace maxsim {
namespace cuda_fwd {

template <typename T, int KS, int MT, bool RK, bool DS>
StreamKernel stream_kernel_nw(const plan::StreamPlan& s) {
  if constexpr (!kIsQuant<T> && !RK && !DS && (KS == 4 || KS == 8)) {
    if (s.warps == kStreamWideWarps)
      return {stream_fwd_kernel<T, KS, MT, false, false, kStreamWideWarps>, kStreamWideWarps * 32};
  }
  return {stream_fwd_kernel<T, KS, MT, RK, DS>, kStreamWarps * 32};
}

template <typename T, int KS, int MT>
StreamKernel stream_kernel_mode(const plan::StreamPlan& s) {
  if constexpr (!kIsQuant<T>) {
    MAXSIM_CHECK(!s.doc_scale, "maxsim: per-document scales take 8-bit tokens");
    return s.rank ? stream_kernel_nw<T, KS, MT, true, false>(s) : stream_kernel_nw<T, KS, MT, false, false>(s);
  } else {
    MAXSIM_CHECK(!s.rank, "maxsim: the fused top-k takes 16-bit tokens");
    return s.doc_scale ? stream_kernel_nw<T, KS, MT, false, true>(s) : stream_kernel_nw<T, KS, MT, false, false>(s);
  }
}

template <typename T, int KS>
StreamKernel stream_kernel_rows(const plan::StreamPlan& s) {
  return s.rows == 1 ? stream_kernel_mode<T, KS, 1>(s) : stream_kernel_mode<T, KS, 2>(s);
}

template <typename T>
StreamKernel stream_kernel(const plan::StreamPlan& s) {
  if (s.run > 0) return stream_run_kernel_of<T>(s);
  switch (s.ks) {
    case 2: return stream_kernel_rows<T, 2>(s);
    case 4: return stream_kernel_rows<T, 4>(s);
    case 6: return stream_kernel_rows<T, 6>(s);
    case 8: return stream_kernel_rows<T, 8>(s);
    default: MAXSIM_CHECK(false, "maxsim: streaming kernel: rows of %d k steps not supported", s.ks);
  }
  return {};
}

// Resident CTAs per SM of the plan's kernel (asked once per kernel).
template <typename T>
int stream_kernel_blocks(const plan::StreamPlan& s) {
  static std::mutex mu;
  static std::map<void (*)(const FwdParams), int> cache;
  const StreamKernel k = stream_kernel<T>(s);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(k.fn);
  if (it != cache.end()) return it->second;
  return cache[k.fn] = stream_blocks_per_sm(k.fn, k.threads);
}

// Launches the plan's kernel; p carries the plan's stream_* fields.
template <typename T>
void launch_stream(const plan::StreamPlan& s, const FwdParams& p, cudaStream_t st) {
  const StreamKernel k = stream_kernel<T>(s);
  MAXSIM_CHECK(s.blocks <= INT32_MAX, "maxsim: too many pairs (%lld) for one launch", (long long)p.P);
  launch_pdl(k.fn, dim3((unsigned)s.blocks), dim3(k.threads), 0, st, p);
}

// Defined for __half / __nv_bfloat16 / int8_t / __nv_fp8_e4m3 in
// forward_stream.cu.
template <typename T>
void run_stream(const plan::StreamPlan& s, const FwdParams& p, cudaStream_t st);
template <typename T>
int stream_blocks(const plan::StreamPlan& s);

}  // namespace cuda_fwd
}  // namespace maxsim
