// Register-streaming forward for one short query against many documents
// (lq <= 32, rows of 64 / 128 / 192 / 256 bytes: fp16 / bf16 dim 32-128, or
// int8 / fp8 e4m3 tokens with per-token or per-document scales, dim
// 64-256; no argmax, no `normalize`; forward.cu selects it): memory-bound
// reranking and corpus scans (search over an 8-bit corpus included), where
// the tile kernel's shared-memory staging, ldmatrix and barriers only add
// latency between DRAM and the tensor cores. Any layout works; the host
// takes it for CROSS with one query and for 16-bit GROUPED candidates and
// LIST pairs (measured, see forward.cu). On sm_90a the staged wgmma stream
// (forward_stream_wg.cuh) takes most of those shapes; this kernel keeps
// documents under 64 tokens, few pairs, pair lists, 8-bit rows and the
// search re-score.
//
// One warp per pair, or S = 2 / 4 warps per pair each taking every S-th of
// the document's tiles, so the pair's warps read adjacent tiles at once
// (H100, against contiguous ranges: rerank-long -1 %, 10k documents of 180
// tokens -0.6 %, the rest level; session 24). Their row maxima combine
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
// rows with one scale per document keep their maxima as exact int32 (H100
// search at 10k documents: the scan 135 -> 131 us, session 21).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include "common.cuh"

namespace maxsim {
namespace cuda_fwd {

constexpr int kStreamWarps = 4;  // warps (pairs) per CTA
// Few pairs of 16-bit rows at d = 64 / 128: one pair per CTA of this many
// warps, so each warp's chain of dependent tile loads is half as long
// (launch_stream_mt).
constexpr int kStreamWideWarps = 8;
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

// A 16-byte streamed load (evict first) with the L2 256-byte prefetch hint:
// a quad reads 64 bytes of a token per load, and the rest of its row (and,
// for rows under 256 bytes, the next token's) is then already on its way.
// Measured against the 128-byte hint (16-bit rows) / no hint (8-bit rows)
// on the lent H100, session 16: 0.7-2.7 % faster on all eight streaming rows
// swept (`stream-l2-prefetch-256-h100.log`); the 128-byte hint itself had
// gained 0.2-0.8 % over none (session 11).
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
// there for the next call (see stream_keep in launch_stream_mt).
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
constexpr int kRankMax = kStreamWarps * 32;

// The fused top-k of rescore_topk (kKeysL, rank_done set): pairs [lo, hi)
// are this CTA's; the CTA that completes a row's count ranks the row's
// pair_kc <= kRankMax keys (score, id) and writes the top rank_k decoded:
// block_topk's order (higher score, then lower id; NaN, then empty slots
// last), (-inf, -1) past the candidates. Thread i holds key i and counts the
// greater keys (equal ones before it count too: a permutation even with
// repeated keys). Measured on H100 (session 19, the last CTA's phases by
// %globaltimer at 100 candidates): this count ~1 us, a bitonic sort in
// registers 3.7 us, a shared-memory one ~6 us; past 128 keys (4 per thread,
// blocks merged by binary search) the count lost to a separate select
// (400 candidates: +11.5 us in the kernel against 5.1 us), so longer rows
// are scored here without it and ranked by block_topk (rescore_topk.cu).
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
#pragma unroll
        for (int w = 0; w < W; ++w) seg[w] = make_uint4(0, 0, 0, 0);
        if (ok && i < ql) {
          const uint4* src = reinterpret_cast<const uint4*>(p.q + ((int64_t)qs + i) * rb + lane_off);
#pragma unroll
          for (int w = 0; w < W; ++w) seg[w] = __ldg(src + w * vs);
        }
      }
#pragma unroll
      for (int s = 0; s < KS; ++s) {
        a[mt][s][h] = u4_word(seg[s / 2], 2 * (s % 2));
        a[mt][s][2 + h] = u4_word(seg[s / 2], 2 * (s % 2) + 1);
      }
    }

  // fp8: Hopper's fp8 mma.sync issues below the f16 rate (measured: the fp8
  // scan 1.35x the int8 one); every e4m3 value is exact in f16, so each word
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
        // Columns 2c, 2c + 1 of the tile fold into the row maxima unless past
        // the document or masked. Whether the tile is whole and unmasked is
        // the same for the warp's lanes, so only the last tile (or a masked
        // document) pays the per-column tests.
        auto fold = [&](bool v0, bool v1) {
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
                best[mt][h] = max_nan(best[mt][h], max_nan(v0 ? acc[mt][2 * h] : neg_inf(),
                                                           v1 ? acc[mt][2 * h + 1] : neg_inf()));
              }
            }
        };
        if (t * 8 + 8 <= dl && p.d_mask == nullptr) {
          fold(true, true);
        } else {
          const int j0 = t * 8 + 2 * c;
          bool v0 = j0 < dl, v1 = j0 + 1 < dl;
          if (p.d_mask != nullptr) {
            v0 = v0 && p.d_mask[(int64_t)ds + j0];
            v1 = v1 && p.d_mask[(int64_t)ds + j0 + 1];
          }
          fold(v0, v1);
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
  // grid leaves it to the exit: triggered at the start, rerank-short's
  // successor took the free slots of a partly filled GPU (H100, 32.0 ->
  // 34.5 us), triggered here still 32.2.
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
    if (lane == 0 && live) p.scores[pr] = ok ? sum : __int_as_float(0x7fc00000);
  }
  if constexpr (RK) {  // kKeysL with the fused top-k (the whole CTA)
    const int64_t lo = tail ? pr : (int64_t)blockIdx.x * per;
    const int64_t hi = tail ? pr + 1 : min(lo + per, p.P - p.stream_tail);
    rank_rows(p, lo, hi, reinterpret_cast<long long*>(qsh));
  }
#endif
}

// Whether the streaming kernel takes this forward (host side; max_lq: 128
// for the staged wgmma stream's longer queries). `normalize`d
// float tokens stay on the tile kernel (it derives the documents' norms from
// its fragments); fp8 needs sm_89+.
inline bool stream_shape_ok(at::ScalarType t, int64_t lq, bool arg, bool normalize, int sm, const FwdParams& p,
                            int64_t max_lq = 32) {
  const bool b16 = t == at::kHalf || t == at::kBFloat16;
  const bool b8 = t == at::kChar || (t == at::kFloat8_e4m3fn && sm >= 89);
  if (!(b16 || b8) || arg || normalize || lq < 1 || lq > max_lq) return false;
  const int64_t rb = p.row_bytes;
  if (rb != 64 && rb != 128 && rb != 192 && rb != 256) return false;
  if (b8 && (p.q_scale == nullptr || p.d_scale == nullptr)) return false;
  return reinterpret_cast<uintptr_t>(p.q) % 16 == 0 && reinterpret_cast<uintptr_t>(p.d) % 16 == 0;
}

// Defined for __half / __nv_bfloat16 / int8_t / __nv_fp8_e4m3 in
// forward_stream.cu (run_stream_impl). mean_ld: tokens per document, for
// the split heuristic.
template <typename T>
void run_stream(FwdParams p, int64_t mean_ld, int num_sms, cudaStream_t st);

template <typename Kern>
int stream_blocks_per_sm(Kern kern, int threads, size_t smem = 0) {
  int b = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kern, threads, smem));
  return std::max(b, 1);
}

// Documents read once per call are streamed evict-first, unless they fit
// well inside L2: then plain loads keep them for the next call (H100, same
// inputs scored again: 400 documents of 300 tokens, 31 MB, 16.2 -> 11.0 us;
// document sets past L2 gain nothing and lose 1.5-5 % to plain loads:
// session 17). Returns whether they fit.
inline bool stream_fits_l2(const FwdParams& p, int64_t mean_ld) {
  const int64_t rows = std::min<int64_t>(p.Td, p.P * std::max<int64_t>(mean_ld, 1));
  const int64_t l2 = at::cuda::getCurrentDeviceProperties()->l2CacheSize;
  return rows * p.row_bytes * 4 <= l2 * 3;
}

// The plain-load prefix of a scan of >= 12 waves (see launch_stream_mt):
// the CTAs that read the first ~2.5 L2 sizes, at least 2.
inline int64_t stream_plain_prefix(int64_t cta_bytes) {
  const int64_t l2 = at::cuda::getCurrentDeviceProperties()->l2CacheSize;
  return std::min<int64_t>(std::max<int64_t>(2, 5 * l2 / 2 / std::max<int64_t>(1, cta_bytes)), INT32_MAX - 1);
}

// stream_keep as the kernel reads it: the number of leading CTAs that load
// plainly (INT32_MAX: all). The caller's 1 means all, k > 1 the first k, 0
// none; < 0: all when the documents fit L2, else `prefix` (0, or >= 2 CTAs).
inline int stream_plain_ctas(const FwdParams& p, int64_t mean_ld, int64_t prefix) {
  const int64_t k = p.stream_keep >= 0 ? p.stream_keep : stream_fits_l2(p, mean_ld) ? 1 : prefix;
  return k == 1 ? INT32_MAX : (int)k;
}

// Warps per pair, lane layout and query staging (fields left <= 0 / < 0 by
// the caller are chosen here). Measured on H100 (bf16, lq 32, d 128; perf
// notes, session 11): a pair split over S warps shortens each warp's chain
// of dependent loads and the last wave's tail, but costs a query load per
// warp and, while the S = 1 grid fits in one wave, pushes it into more.
// Best: one wave at S = 1 -> S = 4 for documents of >= 64 tiles or while
// the S = 4 grid fills <= 2/3 of a wave, else S = 2 while that grid fits
// one wave (few pairs: the chain is the whole time; H100, 1 query x 66
// documents of 300 tokens: 15.2 -> 7.5 us, session 15), or while the pairs
// fill >= 5/8 of the S = 1 slots and hold >= 32 tiles (with interleaved
// tiles; H100, session 24: rerank-short 39.1 -> 37.5 us after a memset,
// 1200 documents of 300 tokens -5 %, 24 x 50 candidates of 256 tokens
// -2.6 %; fewer pairs or shorter documents lost), else S = 1;
// up to 2.25 waves at S = 1 -> S = 1 (the tail split below balances them:
// H100, Rerank 33.1 -> 31.4 us, 64 x 50 documents of 200 tokens 63.9 ->
// 61.1, equal elsewhere; session 17), more -> the largest S leaving >= 11
// tiles per warp (one query x 10k documents: S = 1 is 0.7 % slower), and
// S = 4 from 32 tiles for one query x many documents (with the guessed
// starts, session 26: 10k documents of 256 / 300 tokens -3.1 / -1.9 %,
// 5k of 300 -3 % in graph time, eager level or better; per-query
// candidates of 38 tiles lost 2.3 %, so they keep the 44-tile rule). 8-bit
// rows measured no gain from any of the three (search-10k), so they keep
// S = 1. Either way a grid of several waves ends on split pairs
// (stream_tail).
template <typename T, int KS, int MT, bool RK, bool DS>
void launch_stream_mt(FwdParams p, int64_t mean_ld, int num_sms, cudaStream_t st) {
  auto kern = stream_fwd_kernel<T, KS, MT, RK, DS>;
  constexpr bool b16 = !kIsQuant<T>;
  static const int per_sm = stream_blocks_per_sm(kern, kStreamWarps * 32);
  // Pairs that fit one wave of 8-warp CTAs (one per SM at d = 128), with
  // >= 4 tiles per warp: one pair per CTA of kStreamWideWarps warps (16-bit
  // rows of 128 / 256 bytes). H100, one query, graph us, 4-warp S = 4 ->
  // 8 warps (session 29): 300 tokens P = 1 6.12 -> 5.49, P = 100 6.48 ->
  // 6.09, P = 132 6.59 -> 6.38; 1024 tokens P = 1 11.45 -> 8.45, P = 100
  // 12.21 -> 9.72; 128 tokens (2 tiles per warp) lost 0.1-0.4 us, P = 200
  // (two waves) 7.4 -> 10.3.
  if constexpr (b16 && !RK && !DS && (KS == 4 || KS == 8)) {
    auto wide = stream_fwd_kernel<T, KS, MT, false, false, kStreamWideWarps>;
    static const int per_sm_wide = stream_blocks_per_sm(wide, kStreamWideWarps * 32);
    const int64_t wave = (int64_t)per_sm_wide * num_sms;
    if (p.stream_split == kStreamWideWarps ||
        (p.stream_split <= 0 && p.P <= wave && (mean_ld + 7) / 8 >= 4 * kStreamWideWarps)) {
      p.stream_split = kStreamWideWarps;
      p.stream_tail = 0;
      p.stream_head_blocks = p.P;
      MAXSIM_CHECK(p.P <= INT32_MAX, "maxsim: too many pairs (%lld) for one launch", (long long)p.P);
      if (p.stream_il < 0) p.stream_il = 3;
      if (p.stream_qsm < 0) p.stream_qsm = 1;
      p.stream_keep = stream_plain_ctas(p, mean_ld, 0);
      p.stream_multiwave = p.P > wave;
      launch_pdl(wide, dim3((unsigned)p.P), dim3(kStreamWideWarps * 32), 0, st, p);
      return;
    }
  }
  const int64_t slots = (int64_t)per_sm * kStreamWarps * num_sms;
  if (p.stream_split <= 0) {
    const int64_t ntile = (mean_ld + 7) / 8;
    int S = 1;
    if (b16) {
      if (p.P <= slots)
        S = ntile >= 64 || 4 * p.P * 3 <= 2 * slots ? 4
            : 2 * p.P <= slots || (8 * p.P >= 5 * slots && ntile >= 32) ? 2
                                                                        : 1;
      else
        S = 4 * p.P <= 9 * slots ? 1
            : ntile >= 44 || (ntile >= 32 && p.layout == kCrossL) ? 4
            : ntile >= 22 ? 2
                          : 1;
    }
    p.stream_split = S;
  }
  if (p.stream_split != 2 && p.stream_split != 4) p.stream_split = 1;
  // Several waves: the last slots / 2 pairs split over 4 warps each, so the
  // grid ends on short tasks (H100, sweep of 0-1024 tail pairs: Rerank
  // -2 to -3 %, HeavyRerank / B64 K100 Ld128 -1 to -1.5 %, int8 10k scan
  // -1 %, corpus-10k / -30k and rerank-long within 0.2 %; one-wave grids
  // gain nothing: session 16).
  if (p.stream_tail < 0) p.stream_tail = p.P * p.stream_split > slots ? slots / 2 : 0;
  if (p.stream_split == kStreamWarps) p.stream_tail = 0;
  p.stream_tail = std::min<int64_t>(p.stream_tail, p.P);
  const auto blocks = [&] {
    const int64_t per = kStreamWarps / p.stream_split;  // pairs per head CTA
    p.stream_head_blocks = (p.P - p.stream_tail + per - 1) / per;
    return p.stream_head_blocks + p.stream_tail;
  };
  if (blocks() > INT32_MAX) {
    p.stream_split = 1;
    p.stream_tail = 0;
  }
  MAXSIM_CHECK(blocks() <= INT32_MAX, "maxsim: too many pairs (%lld) for one launch", (long long)p.P);
  if (p.stream_il < 0) p.stream_il = b16 ? 3 : 0;  // 16-bit: whole-sector lanes, interleaved tiles
  if (p.stream_qsm < 0) p.stream_qsm = p.stream_split >= 4 ? 1 : 0;
  const int64_t wave = (int64_t)per_sm * num_sms;
  p.stream_multiwave = blocks() > wave;
  // A dirty L2 (another kernel's writes just before, as after a query
  // encoder) slows an evict-first scan all through: the dirty lines leave
  // as it runs. Plain loads write them back up front, at a loss on a clean
  // L2. So scans of >= 12 waves (shorter ones lost: session 24) load their
  // first ~2.5 L2 sizes of documents plainly. Session 23 sized that prefix
  // as one wave, ~122 MB at one warp per pair; at one pair per CTA
  // (session 26) a wave is ~30 MB. H100, session 30, after a 256 MB memset
  // / back to back, us, no prefix / one wave / this rule: 10k documents of
  // 300 tokens 265.6 / 266.5 / 261.6 and 250.5 / 245.5 / 248.5; 20k 515.4
  // / 509.3 / 501.6 and 491.1 / 485.6 / 488.8; 30k 764.1 / 750.7 / 742.9
  // and 731.3 / 726.8 / 729.3; 10k of 256 tokens 225.0 / 227.3 / 222.1
  // and 215.1 / 207.5 / 211.3; 5k of 300 139.5 / 142.2 / 140.5 and 129.4
  // / 124.4 / 128.0. The one-wave prefix's back-to-back gain is its 30 MB
  // staying in L2 for the next call on the same inputs. Measured for
  // 16-bit rows only.
  int64_t prefix = 0;
  if (p.stream_keep < 0 && b16 && blocks() >= 12 * wave)
    prefix = stream_plain_prefix(kStreamWarps / p.stream_split * mean_ld * p.row_bytes);
  p.stream_keep = stream_plain_ctas(p, mean_ld, prefix);
  launch_pdl(kern, dim3((unsigned)blocks()), dim3(kStreamWarps * 32), 0, st, p);
}

template <typename T, int KS, bool RK, bool DS>
void launch_stream_rows(const FwdParams& p, int64_t mean_ld, int num_sms, cudaStream_t st) {
  if (p.lq <= 16)
    launch_stream_mt<T, KS, 1, RK, DS>(p, mean_ld, num_sms, st);
  else
    launch_stream_mt<T, KS, 2, RK, DS>(p, mean_ld, num_sms, st);
}

template <typename T, int KS>
void launch_stream(const FwdParams& p, int64_t mean_ld, int num_sms, cudaStream_t st) {
  if constexpr (!kIsQuant<T>) {
    if (p.rank_done != nullptr)
      launch_stream_rows<T, KS, true, false>(p, mean_ld, num_sms, st);
    else
      launch_stream_rows<T, KS, false, false>(p, mean_ld, num_sms, st);
  } else {
    MAXSIM_CHECK(p.rank_done == nullptr, "maxsim: the fused top-k takes 16-bit tokens");
    if (p.d_scale_per_doc)
      launch_stream_rows<T, KS, false, true>(p, mean_ld, num_sms, st);
    else
      launch_stream_rows<T, KS, false, false>(p, mean_ld, num_sms, st);
  }
}

template <typename T>
void run_stream_impl(const FwdParams& p, int64_t mean_ld, int num_sms, cudaStream_t st) {
  switch (p.row_bytes) {
    case 64: launch_stream<T, 2>(p, mean_ld, num_sms, st); break;
    case 128: launch_stream<T, 4>(p, mean_ld, num_sms, st); break;
    case 192: launch_stream<T, 6>(p, mean_ld, num_sms, st); break;
    case 256: launch_stream<T, 8>(p, mean_ld, num_sms, st); break;
    default: MAXSIM_CHECK(false, "maxsim: streaming kernel: rows of %lld bytes not supported", (long long)p.row_bytes);
  }
}

}  // namespace cuda_fwd
}  // namespace maxsim
