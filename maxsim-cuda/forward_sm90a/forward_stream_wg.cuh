// Staged wgmma forward (sm_90a): one query of up to 128 rows against many
// documents of 16-bit tokens, rows of 128 or 256 bytes (dim 64 / 128). The
// memory-bound sibling of forward_stream.cuh: one pair, or a run of pairs
// sharing the query, per CTA of one warpgroup; the document streams through
// NST shared-memory stages of 64 tokens, each filled by the CTA's threads
// with 16-byte cp.async copies (zero-filled past the document) into the
// 128B-swizzled K-major layout wgmma reads; the query rows are staged once
// the same way. Each stage is one chain of wgmma m64nNk16 (A = 64 document
// tokens, B = N query rows, both from shared memory), so no register holds a
// fragment of either operand and the document bytes in flight are bounded by
// shared memory only. A thread folds its two tokens of a stage (rows g and
// g + 8 of its warp's 16) into running per-column maxima (NaN-propagating max,
// masked / out-of-range tokens -inf), reduced over the warp's and then the
// CTA's tokens at the document's end; the score is the sum over query rows in
// the order of the mma.sync stream's epilogue. ARG also keeps each column's
// argmax (a thread visits its tokens in increasing order; partial states
// merge under merge_arg's total order, as 64-bit keys), the training forward
// of per-query candidates. No normalize, no 8-bit tokens.
#pragma once

#include "../common/common.cuh"
#include "../forward/forward_stream.cuh"
#include "forward_wgmma.cuh"
#include "../common/pdl.cuh"

namespace maxsim {
namespace cuda_fwd {

#if MAXSIM_WG_DEVICE
// m64nNk16 with A and B from shared memory (both K-major).
template <typename T, int N>
struct WgMmaSs;

// One instance per N: REGS names the N / 2 accumulators, A / B / P the
// operand numbers of the two descriptors and the scale-d flag after them.
#define MAXSIM_WGMMA_SS(T, TY, N, REGS, A, B, P, ...)                                                    \
  template <>                                                                                          \
  struct WgMmaSs<T, N> {                                                                               \
    static __device__ __forceinline__ void run(float* d, uint64_t da, uint64_t db, int scale_d) {      \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n"                                     \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" REGS "}, %" A ", %" B \
                   ", p, 1, 1, 0, 0;\n}\n"                                                              \
                   : __VA_ARGS__                                                                       \
                   : "l"(da), "l"(db), "r"(scale_d));                                                  \
    }                                                                                                  \
  };
#define MAXSIM_ACC8(b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), \
                       "+f"(d[b + 6]), "+f"(d[b + 7])
#define MAXSIM_ACC16(b) MAXSIM_ACC8(b), MAXSIM_ACC8(b + 8)
#define MAXSIM_ACC32(b) MAXSIM_ACC16(b), MAXSIM_ACC16(b + 16)
#define MAXSIM_R8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define MAXSIM_R16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define MAXSIM_R32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MAXSIM_R64 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
MAXSIM_WGMMA_SS(__nv_bfloat16, "bf16", 16, MAXSIM_R8, "8", "9", "10", MAXSIM_ACC8(0))
MAXSIM_WGMMA_SS(__nv_bfloat16, "bf16", 32, MAXSIM_R16, "16", "17", "18", MAXSIM_ACC16(0))
MAXSIM_WGMMA_SS(__nv_bfloat16, "bf16", 64, MAXSIM_R32, "32", "33", "34", MAXSIM_ACC32(0))
MAXSIM_WGMMA_SS(__nv_bfloat16, "bf16", 128, MAXSIM_R64, "64", "65", "66", MAXSIM_ACC32(0), MAXSIM_ACC32(32))
MAXSIM_WGMMA_SS(__half, "f16", 16, MAXSIM_R8, "8", "9", "10", MAXSIM_ACC8(0))
MAXSIM_WGMMA_SS(__half, "f16", 32, MAXSIM_R16, "16", "17", "18", MAXSIM_ACC16(0))
MAXSIM_WGMMA_SS(__half, "f16", 64, MAXSIM_R32, "32", "33", "34", MAXSIM_ACC32(0))
MAXSIM_WGMMA_SS(__half, "f16", 128, MAXSIM_R64, "64", "65", "66", MAXSIM_ACC32(0), MAXSIM_ACC32(32))
#undef MAXSIM_WGMMA_SS
#undef MAXSIM_ACC8
#undef MAXSIM_ACC16
#undef MAXSIM_ACC32
#undef MAXSIM_R8
#undef MAXSIM_R16
#undef MAXSIM_R32
#undef MAXSIM_R64

// A 16-byte cp.async with an L2 eviction policy and the 256-byte L2
// prefetch hint; src_size 0 zero-fills the destination.
__device__ __forceinline__ void cp_async_pol(uint32_t dst, const void* src, int src_size, uint64_t pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_size), "l"(pol)
               : "memory");
}
#endif  // MAXSIM_WG_DEVICE

// A (max, argmax) state as one 64-bit key whose unsigned maximum is
// merge_arg's total order: the value's order-preserving bits above the
// complemented index (NaN highest, then larger values, then lower indices;
// -0 counts as +0 as in merge_arg's compare; 0: the empty state). The
// epilogue's 3 shuffle rounds and the cross-warp merge are then a
// branch-free 64-bit max each.
__device__ __forceinline__ uint64_t arg_key(float v, int i) {
  const uint32_t b = __float_as_uint(v + 0.f);
  const uint32_t o = v != v ? 0xffffffffu : (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return i < 0 ? 0ull : ((uint64_t)o << 32) | (uint32_t)~i;
}
__device__ __forceinline__ void arg_unkey(uint64_t k, float& v, int& i) {
  const uint32_t o = (uint32_t)(k >> 32);
  v = k == 0ull ? neg_inf() : o == 0xffffffffu ? __uint_as_float(0x7fffffffu)
                                               : __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
  i = k == 0ull ? -1 : (int)~(uint32_t)k;
}
__device__ __forceinline__ uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }

using plan::kStreamWgThreads;  // one warpgroup
using plan::kStreamWgTokens;   // tokens per stage (wgmma M)

// Dynamic shared memory of a CTA (plan::stream_wg_smem): NST document stages,
// the query tile and the two reduction buffers, nothing else (the CTA's only
// shared memory, so its base is the 1024-byte aligned start the swizzle
// needs).
using plan::stream_wg_smem;

constexpr unsigned kAll = 0xffffffffu;  // every lane of a warp

// A walk over the stages of a CTA's documents: document `doc` of the run
// (`start`, `len`; -1 if invalid), its stage `stage`. Lane i of the warp holds
// document i's segment (lds, ldl), or a single pair's in every lane.
struct RunCursor {
  int doc = 0, stage = 0, start, len;
  __device__ __forceinline__ RunCursor(int lds, int ldl, bool run)
      : start(run ? __shfl_sync(kAll, lds, 0) : lds), len(run ? __shfl_sync(kAll, ldl, 0) : ldl) {}
  // Stages of a document of l tokens: an empty or invalid one takes one
  // stage that loads nothing.
  static __device__ __forceinline__ int stages(int l) {
    return l > kStreamWgTokens ? (l + kStreamWgTokens - 1) / kStreamWgTokens : 1;
  }
  __device__ __forceinline__ bool last_stage() const { return stage + 1 == stages(len); }
  // On to the next stage, past the document's last to the next document's.
  __device__ __forceinline__ void advance(int lds, int ldl) {
    if (++stage < stages(len)) return;
    stage = 0;
    ++doc;
    start = __shfl_sync(kAll, lds, doc & 31);
    len = __shfl_sync(kAll, ldl, doc & 31);
  }
};

// KS: 32-byte k steps per row (4 or 8); NQ: query rows per tile (16, 32,
// or 64 / 128 for lq 33-128);
// NST: document stages (NST - 1 in flight while one is scored); ARG: write
// the argmax rows too.
//
// A CTA scores one pair (p.stream_run 0) or a run of up to
// plan::kStreamWgRunMax consecutive pairs sharing a query (CROSS with one
// query, GROUPED candidates; p.stream_run pairs a run, p.stream_rpg runs a
// group), for documents of a stage or two, where one pair per CTA paid the
// query's staging and the first stage's latency per document. The run's
// documents are one sequence of stages (a document of l tokens takes
// max(1, ceil(l / 64)): an empty or invalid one takes a stage that loads
// nothing), NST - 1 in flight across document boundaries. Lane i of every
// warp holds the run's i-th document segment (start, length; -1 for an
// invalid pair), which the load and score cursors take by shuffles (a
// single pair's own segment is in every lane: no shuffles). A
// document's per-warp maxima go to one of two reduction buffers, summed by
// warp 0 after the next stage's barrier, so a document costs no barrier of
// its own. Every pair is scored as in a run of one: the same bits.
template <typename T, int KS, int NQ, int NST, bool ARG>
__global__ void __launch_bounds__(kStreamWgThreads) stream_wg_kernel(const FwdParams p) {
#if MAXSIM_WG_DEVICE
  pdl_wait();
  constexpr int RB = KS * 32;                       // row bytes
  constexpr int CH = RB / 16;                       // 16-byte chunks per row
  constexpr int SB = kStreamWgTokens * RB;          // stage bytes
  constexpr int NA = NQ / 2;                        // accumulators per thread
  constexpr int CPT = kStreamWgTokens * CH / kStreamWgThreads;  // copies per thread per stage
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, c = lane & 3, warp = tid >> 5;
  // The CTA's pairs first .. first + cnt - 1, of query n; in a run, pair
  // first + i's document is first + i in both layouts (pair_ids).
  int64_t first, n = 0, dn = 0;
  int cnt = 1;
  if (p.stream_run == 0) {
    first = dn = blockIdx.x;
    if (p.layout == kGroupedL)
      n = first / p.K;
    else if (!(p.layout == kCrossL && p.Nq == 1))
      pair_ids(p, first, n, dn);
  } else {
    // A 32-bit division (the planner keeps P < 2^31); the grid holds runs only.
    const uint32_t rpg = (uint32_t)p.stream_rpg, R = (uint32_t)p.stream_run;
    const uint32_t grp = blockIdx.x / rpg, rr = blockIdx.x - grp * rpg;
    const int64_t gsz = p.layout == kGroupedL ? p.K : p.P;
    first = dn = (int64_t)grp * gsz + (int64_t)rr * R;
    cnt = (int)min((int64_t)R, min(gsz - (int64_t)rr * R, p.P - first));
    n = p.layout == kGroupedL ? (int64_t)grp : 0;
  }
  // This lane's document: the run's lane-th (id -1 past the run: no load),
  // or the pair's own in every lane. Both segments' words load before any
  // is tested (doc_ok, query_ok): one round trip, not two.
  const bool run = p.stream_run != 0;
  int seg_s, seg_l, qs = 0, ql = 0;
  const bool dok = doc_ok(p, !run ? dn : lane < cnt ? dn + lane : -1, seg_s, seg_l);
  const bool qok = query_ok(p, n, qs, ql);
  const int lds = dok && qok ? seg_s : 0, ldl = dok && qok ? seg_l : -1;
  uint64_t pol;
  if ((int)blockIdx.x < p.stream_keep)
    asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(pol));
  else
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));

  extern __shared__ __align__(1024) unsigned char wg_smem[];
  const uint32_t sbase = smem_u32(wg_smem);
  const uint32_t qbase = sbase + NST * SB;
  // Two reduction buffers of [4 warps][NQ] maxima (ARG: 64-bit keys).
  using Red = std::conditional_t<ARG, uint64_t, float>;
  Red* const red_base = reinterpret_cast<Red*>(wg_smem + NST * SB + NQ * RB);
  // Row r, chunk j of a tile of `rows` rows: 128-byte k block j / 8, 16-byte
  // slot (j % 8) ^ (r % 8) of its row (the 128B swizzle).
  auto sw = [](int rows, int r, int j) -> uint32_t {
    return (uint32_t)((j >> 3) * rows * 128 + r * 128 + ((((j & 7) ^ (r & 7))) << 4));
  };
  // The load cursor, NST - 1 stages ahead of the score cursor. Copy x of a
  // stage: row x / CH, chunk x % CH (a row's chunks on consecutive threads).
  RunCursor load(lds, ldl, run);
  auto stage_in = [&](int t) {
    if (load.doc < cnt) {
      const uint32_t dst = sbase + (uint32_t)((t % NST) * SB);
#pragma unroll
      for (int i = 0; i < CPT; ++i) {
        const int x = tid + i * kStreamWgThreads, r = x / CH, j = x % CH;
        const int tok = load.stage * kStreamWgTokens + r;
        const bool in = tok < load.len;  // nothing of an invalid document (length -1)
        const char* src = p.d + (in ? ((int64_t)load.start + tok) * RB + j * 16 : 0);
        cp_async_pol(dst + sw(kStreamWgTokens, r, j), src, in ? 16 : 0, pol);
      }
      load.advance(lds, ldl);
    }
    cp_async_commit();
  };
  // Query rows past its length are zero-filled (their columns are never
  // summed). Group 0 is the query's, group 1 + t stage t's.
#pragma unroll
  for (int i = 0; i < NQ * CH / kStreamWgThreads; ++i) {
    const int x = tid + i * kStreamWgThreads, r = x / CH, j = x % CH;
    const bool in = r < ql;
    cp_async<16>(qbase + sw(NQ, r, j), p.q + (in ? ((int64_t)qs + r) * RB + j * 16 : 0), in);
  }
  cp_async_commit();
#pragma unroll
  for (int t = 0; t < NST - 1; ++t) stage_in(t);
  // The CTA's stages: the sum over the run's documents (lane d holds
  // document d's), or the single pair's (the same in every lane). A warp
  // reduction's result is uniform to the compiler too, so the stage loop's
  // counter and the wgmma descriptors stay in uniform registers (from
  // shuffles, every wgmma of a stage's chain waited on a move of its
  // descriptor there).
  const int nst = (int)__reduce_add_sync(kAll, (run ? lane < cnt : lane == 0) ? RunCursor::stages(ldl) : 0);

  float best[NA / 2];
  int bidx[NA / 2];
#pragma unroll
  for (int i = 0; i < NA / 2; ++i) {
    best[i] = neg_inf();
    bidx[i] = -1;
  }
  // Warp 0: document d's score (and argmax rows) from its reduction buffer.
  // Lane l sums query rows l, l + 32, ... (one row for lq <= 32: the
  // mma.sync stream's order), then the warp's lanes.
  const auto finish = [&](int d) {
    const Red* red = red_base + (d & 1) * 4 * NQ;
    const bool ok = __shfl_sync(kAll, ldl, d) >= 0;
    const int64_t pr = first + d;
    float part = 0.f;
#pragma unroll
    for (int k = 0; k < (NQ + 31) / 32; ++k) {
      const int row = lane + 32 * k;
      float v = neg_inf();
      int vi = -1;
      if (row < NQ) {
        if constexpr (ARG) {
          arg_unkey(max_u64(max_u64(red[row], red[NQ + row]), max_u64(red[2 * NQ + row], red[3 * NQ + row])), v,
                    vi);
        } else {
          v = max_nan(max_nan(red[row], red[NQ + row]), max_nan(red[2 * NQ + row], red[3 * NQ + row]));
        }
      }
      bool use = ok && row < ql && v != neg_inf();
      if (use && p.q_mask != nullptr) use = p.q_mask[(int64_t)qs + row];
      part = k == 0 ? (use ? v : 0.f) : part + (use ? v : 0.f);
      if (ARG && row < p.lq) store_argmax(p, pr * p.lq + row, use ? vi : -1);
    }
    const float sum = warp_sum(part);
    if (lane == 0) store_score(p, pr, ok, sum);
  };
  // The score cursor; pend: the document whose maxima wait for warp 0.
  RunCursor score(lds, ldl, run);
  int pend = -1;
  for (int t = 0; t < nst; ++t) {
    // This thread's copies of the query and stage t have landed; the
    // barrier makes every thread's visible to wgmma, and every warp's
    // maxima of document pend visible to warp 0.
    cp_async_wait<NST - 2>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    float acc[NA];
#pragma unroll
    for (int i = 0; i < NA; ++i) acc[i] = 0.f;
    const uint32_t abase = sbase + (uint32_t)((t % NST) * SB);
    wg_fence_acc<NA>(acc);
    wg_fence();
#pragma unroll
    for (int s = 0; s < KS; ++s)
      WgMmaSs<T, NQ>::run(acc, wg_desc(abase + (uint32_t)((s >> 2) * kStreamWgTokens * 128 + (s & 3) * 32)),
                          wg_desc(qbase + (uint32_t)((s >> 2) * NQ * 128 + (s & 3) * 32)), s);
    wg_commit();
    // The stage scored before this one is free (its chain retired before the
    // barrier above).
    stage_in(t + NST - 1);
    // Warp 0 sums the previous document's maxima while the chain runs.
    if (warp == 0 && pend >= 0) finish(pend);
    pend = -1;
    wg_wait<0>();
    wg_fence_acc<NA>(acc);
    // Columns 8 j + 2 c + e; rows g (acc 4 j + e) and g + 8 (4 j + 2 + e).
    const int dl = max(score.len, 0);
    const int j0 = score.stage * kStreamWgTokens + 16 * warp + g;
    bool v0 = true, v1 = true;
    if (!(score.stage * kStreamWgTokens + kStreamWgTokens <= dl && p.d_mask == nullptr)) {
      v0 = j0 < dl;
      v1 = j0 + 8 < dl;
      if (p.d_mask != nullptr) {
        v0 = v0 && p.d_mask[(int64_t)score.start + j0];
        v1 = v1 && p.d_mask[(int64_t)score.start + j0 + 8];
      }
    }
#pragma unroll
    for (int j = 0; j < NQ / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float a0 = v0 ? acc[4 * j + e] : neg_inf(), a1 = v1 ? acc[4 * j + 2 + e] : neg_inf();
        if constexpr (ARG) {
          upd_arg(best[2 * j + e], bidx[2 * j + e], a0, j0);
          upd_arg(best[2 * j + e], bidx[2 * j + e], a1, j0 + 8);
        } else {
          best[2 * j + e] = max_nan(best[2 * j + e], max_nan(a0, a1));
        }
      }
    if (score.last_stage()) {
      // The document is scored: max over the warp's 16 tokens (lanes of
      // equal c) into its buffer, which warp 0 last read two documents ago,
      // before the barrier this stage passed.
      Red* red = red_base + (score.doc & 1) * 4 * NQ;
#pragma unroll
      for (int i = 0; i < NA / 2; ++i) {
        if constexpr (ARG) {
          uint64_t k = arg_key(best[i], bidx[i]);
#pragma unroll
          for (int o = 4; o < 32; o <<= 1) k = max_u64(k, __shfl_xor_sync(kAll, k, o));
          if (g == 0) red[warp * NQ + 8 * (i / 2) + 2 * c + (i % 2)] = k;
        } else {
          float b = best[i];
#pragma unroll
          for (int o = 4; o < 32; o <<= 1) b = max_nan(b, __shfl_xor_sync(kAll, b, o));
          if (g == 0) red[warp * NQ + 8 * (i / 2) + 2 * c + (i % 2)] = b;
        }
        best[i] = neg_inf();
        bidx[i] = -1;
      }
      pend = score.doc;
    }
    score.advance(lds, ldl);
  }
  cp_async_wait<0>();
  if (p.stream_multiwave) pdl_trigger();
  __syncthreads();
  if (warp == 0 && pend >= 0) finish(pend);
#endif
}

// Defined for __half / __nv_bfloat16 in forward_stream_wg.cu: the plan's
// kernel (KS, NQ, stages) over `grid` CTAs (pairs, or runs of pairs), and its
// resident CTAs per SM.
// One query against documents, per-query candidates and pair lists (a pair
// scores bitwise as in the padded layouts); the search re-score stays on the
// mma.sync stream's k order.
template <typename T>
void run_stream_wg(const plan::StreamWgPlan& w, int64_t grid, const FwdParams& p, cudaStream_t st);
template <typename T>
int stream_wg_blocks(int ks, int nq, bool argmax);

}  // namespace cuda_fwd
}  // namespace maxsim
