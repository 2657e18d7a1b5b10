// The forward planner: the one place that decides how a CUDA forward runs.
//
// plan_forward() maps the facts of a call (layout, shapes, dtype, flags,
// pointer alignment) and of the device (architecture, SM count, shared
// memory, L2, resident CTAs per SM of a kernel) to a Plan: the kernel family,
// its configuration, the document split and the grid. It is a pure host
// function (no CUDA calls: the device facts come in, occupancy through a
// callback), compiled in every variant: the CUDA forward executes its plan,
// and the plan_forward op (forward_plan.cpp) shows it to Python
// (maxsim.explain) and to the CPU tests.
//
// Families, in the order they are tried:
//   * kPacked (sm_80+, fp16 / bf16 rows of 128 / 256 bytes, lq <= 32): many
//     short documents (mean <= kPackedMaxMeanLd tokens; with an argmax on
//     sm_90a, kPackedMaxMeanLdArgmaxWg) shared by several
//     queries (per-query candidates when forced): documents packed side by
//     side into one tensor-core tile (wgmma on sm_90a), reduced per
//     document in the epilogue (aligned when a CTA's documents share one
//     length, a segmented scan otherwise);
//   * kStreamWg (sm_90a, fp16 / bf16 rows of 128 / 256 bytes): the staged
//     wgmma stream, one query (or per-query candidates, pair lists) against
//     documents of >= 64 tokens; also queries of 33-128 rows;
//   * kStream: the register-streaming kernel, lq <= 32, one warp (or a few)
//     per document, no shared memory: reranking, corpus scans; for many
//     short documents of one query (mean <= kStreamRunMaxMeanLd tokens,
//     CROSS with one query or GROUPED candidates, 16-bit rows of 128 / 256
//     bytes) runs of up to kStreamRunMax consecutive pairs per warp
//     (StreamPlan::run), the query loaded once per run;
//   * kWgmma (sm_90a): the wgmma + TMA tile kernel when a 128-row query tile
//     is full;
//   * kMma: the mma.sync tile kernel, one of kMmaConfigs by lq / layout;
//   * kSimt: exact fp32 (precision kExact), and whatever the tensor cores
//     cannot take.
// A new kernel family: add it to Family, give it a rule below (and a
// KernelId for its occupancy), and an executor in maxsim-cuda/forward/forward.cu.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>

namespace maxsim {
namespace plan {

enum class Family : int {
  kNone = 0,      // no kernel: lq == 0 (the finalize kernel writes 0 / NaN scores)
  kStream = 1,    // forward_stream.cuh
  kStreamWg = 2,  // forward_stream_wg.cuh (sm_90a)
  kMma = 3,       // forward_mma.cuh
  kWgmma = 4,     // forward_wgmma.cuh (sm_90a)
  kSimt = 5,      // forward_simt.cuh
  kComposed = 6,  // rescore_topk only: the composition of forward, select and decode
  kPacked = 7,    // forward_packed.cuh
};
constexpr const char* family_name(Family f) {
  return f == Family::kStream      ? "stream"
         : f == Family::kStreamWg  ? "stream_wg"
         : f == Family::kMma       ? "mma"
         : f == Family::kWgmma     ? "wgmma"
         : f == Family::kSimt      ? "simt"
         : f == Family::kComposed  ? "composed"
         : f == Family::kPacked    ? "packed"
                                   : "none";
}

enum class Dtype : int { kF32 = 0, kF16, kBF16, kI8, kE4M3 };

// How CUDA runs fp32 tokens (the op's `precision`; other dtypes ignore it):
// kDefault: tensor cores with split 3xTF32 products (~1e-7 relative),
// kTf32: one TF32 product (~5e-4), kExact: the scalar fp32 kernel.
enum class Precision : int { kDefault = 0, kTf32 = 1, kExact = 2 };
constexpr const char* precision_name(Precision p) {
  return p == Precision::kTf32 ? "tf32" : p == Precision::kExact ? "exact" : "default";
}
constexpr int elem_size(Dtype t) { return t == Dtype::kF32 ? 4 : (t == Dtype::kF16 || t == Dtype::kBF16) ? 2 : 1; }
constexpr bool is_16bit(Dtype t) { return t == Dtype::kF16 || t == Dtype::kBF16; }

// Layouts (the op's `layout`, plus kKeys: rescore_topk's candidates given as
// search keys, never an op argument).
constexpr int kCross = 0, kGrouped = 1, kList = 2, kKeys = 3;

// ---- kernel constants the plan depends on (the kernels use these too) -----

// mma.sync tile configurations: (id, BM, BN, warps along M, warps along N,
// cp.async stages, min CTAs per SM). The planner returns only these ids and
// the kernels are instantiated for exactly these (forward_mma.cuh).
// 0: lq <= 32, memory bound, 3 stages so that 4 CTAs fit an SM; 1: lq <= 64;
// 2: longer queries and stacked CROSS queries (4 warps, 64x32 warp tiles).
#define MAXSIM_MMA_CONFIGS(X) \
  X(0, 32, 64, 1, 4, 3, 4)    \
  X(1, 64, 64, 2, 2, 4, 2)    \
  X(2, 128, 64, 2, 2, 3, 2)

struct MmaConfig {
  int bm, bn, wm, wn, stages, minb;
  constexpr int threads() const { return wm * wn * 32; }
};
#define MAXSIM_MMA_CONFIG_ENTRY_(ID, BM, BN, WM, WN, ST, MINB) MmaConfig{BM, BN, WM, WN, ST, MINB},
constexpr MmaConfig kMmaConfigs[] = {MAXSIM_MMA_CONFIGS(MAXSIM_MMA_CONFIG_ENTRY_)};
#undef MAXSIM_MMA_CONFIG_ENTRY_
constexpr int kNumMmaConfigs = (int)(sizeof(kMmaConfigs) / sizeof(kMmaConfigs[0]));

constexpr int kMmaKChunkBytes = 256;
// 8-bit tokens: 128-B k chunks and twice the stages, so a stage holds the
// same rows with half the bytes and twice the tiles are in flight.
constexpr int kMmaKChunkBytes8 = 128;
constexpr int mma_kchunk(bool q8) { return q8 ? kMmaKChunkBytes8 : kMmaKChunkBytes; }
constexpr int mma_stages(int stages, bool q8) { return q8 ? 2 * stages : stages; }
constexpr int kMmaMaxDpc = 32;  // docs per CTA, at most (one warp scans them)

// Dynamic shared memory: resident query tile + the doc stage ring.
constexpr int64_t mma_smem_bytes(int cfg, int kch, bool q8) {
  return (int64_t)kMmaConfigs[cfg].bm * kch * mma_kchunk(q8) +
         (int64_t)mma_stages(kMmaConfigs[cfg].stages, q8) * kMmaConfigs[cfg].bn * mma_kchunk(q8);
}
// Upper bound of the kernel's static shared memory.
constexpr int64_t mma_static_smem(int cfg, bool q8) {
  return (int64_t)kMmaConfigs[cfg].bm * 13 + (int64_t)2 * kMmaConfigs[cfg].wn * kMmaConfigs[cfg].bm * 4 +
         (int64_t)mma_stages(kMmaConfigs[cfg].stages, q8) * kMmaConfigs[cfg].bn * (q8 ? 5 : 1) +
         (int64_t)kMmaMaxDpc * 21 + 256;
}

constexpr int kSimtBM = 64, kSimtBN = 64;

constexpr int kWgBM = 128;  // wgmma: query rows per work item (2 consumer warpgroups x 64)
constexpr int kWgBN = 128;  // doc tokens per pipeline stage
constexpr int wg_stages(int nkb) { return nkb == 1 ? 8 : 5; }  // NKB: 128-byte column blocks of a row
constexpr int kWgContiguous = 1;  // flag: contiguous item ranges per CTA (else strided)
constexpr int kWgFastLoader = 4;  // flag: slot-level loads only, rows from the slot table

constexpr int kStreamWarps = 4;      // streaming kernel: warps (pairs) per CTA
constexpr int kStreamWideWarps = 8;  // one pair per CTA of this many warps
constexpr int kRankMax = kStreamWarps * 32;  // fused top-k: candidates per row, at most
constexpr int64_t kStreamMaxMeanLd = 4096;   // longer documents take the tile kernels' splits
// Runs of pairs (forward_stream_run.cuh): pairs per warp, at most (lane i
// holds the run's i-th document segment), and the rule's mean document
// length, at most (longer documents stream well one pair per warp: the
// query's reload is a small part of their bytes).
constexpr int kStreamRunMax = 32;
constexpr int64_t kStreamRunMaxMeanLd = 32;

constexpr int kStreamWgThreads = 128;  // staged wgmma stream: one warpgroup
constexpr int kStreamWgTokens = 64;    // tokens per stage (wgmma M)
// Four document stages (three CTAs per SM at 256-byte rows).
constexpr int kStreamWgStages = 4;
// Stages, the query tile, two reduction buffers of 4 warps' column maxima
// (argmax: 64-bit keys).
constexpr int stream_wg_smem(int ks, int nq, int nst, bool argmax) {
  return (nst * kStreamWgTokens + nq) * ks * 32 + 2 * 4 * nq * (argmax ? 8 : 4);
}
// Its runs of pairs: pairs per CTA, at most (lane i of each warp holds the
// run's i-th document), and the rule's mean document length, at most
// (longer documents amortise a CTA's start over their own stages).
constexpr int kStreamWgRunMax = 32;
constexpr int64_t kStreamWgRunMaxMeanLd = 2 * kStreamWgTokens;

// Packed short documents (forward_packed.cuh): a CTA keeps BM query rows
// (queries in power-of-two row slots) in registers and streams the
// concatenated tokens of up to kPackedMaxDocs consecutive documents through
// BN-column tiles; the epilogue takes each document's max over its columns
// and sums each slot's rows.
constexpr int kPackedBM = 128, kPackedBN = 64, kPackedThreads = 128;
constexpr int kPackedStages = 4;
constexpr int kPackedMaxDocs = 512;    // documents per CTA, at most
constexpr int64_t kPackedMaxMeanLd = 32;  // the rule's mean document length, at most
constexpr int64_t kPackedMaxMeanLdArgmaxWg = 20;  // the same with an argmax where wgmma takes the call
// Documents padded to this many tokens (Td = Nd * kPackedPaddedLd): one
// length per CTA, the aligned epilogue (four quad lanes a document), which
// beats wgmma's tile per document there on sm_90a.
constexpr int64_t kPackedPaddedLd = 64;
constexpr int64_t packed_smem(int ks) {
  return (int64_t)(kPackedStages * kPackedBN + kPackedBM) * ks * 32 + 1024;  // tile ring, query staging, alignment
}
// Query rows per slot: the power of two >= lq (lq <= 32).
constexpr int packed_rows(int64_t lq) {
  int r = 1;
  while (r < lq) r *= 2;
  return r;
}

// ---- inputs -----------------------------------------------------------------

// A kernel whose resident CTAs per SM the planner asks for (fields that do
// not apply to its family are 0).
struct KernelId {
  Family family = Family::kNone;
  Dtype dtype = Dtype::kF32;
  bool argmax = false;
  bool scaled = false;  // float tokens under normalize (per-token inverse norms)
  bool split = false;   // kMma, float tokens: split 3xTF32 products
  int cfg = 0;          // kMma: config id
  int64_t smem = 0;     // kMma: dynamic shared memory
  int ks = 0;           // kStream / kStreamWg / kPacked: 32-byte k steps per row
  int rows = 0;         // kStream: query row groups (1, 2); kStreamWg: query rows per tile (16..128)
  int warps = 0;        // kStream: warps per CTA (kStreamWarps or kStreamWideWarps)
  bool rank = false;    // kStream: the fused top-k
  bool doc_scale = false;  // kStream: 8-bit tokens with one scale per document
  bool run = false;        // kStream: runs of pairs (StreamPlan::run)
};

struct DeviceFacts {
  int arch = 90;  // major * 10 + minor
  int sm_count = 132;
  int64_t smem_optin = 232448;  // dynamic shared memory a block may opt in to
  int64_t l2_bytes = 52428800;
  bool wgmma_built = true;  // the sm_90a kernels (and the tensor-map encoder) are there
  std::function<int(const KernelId&)> blocks_per_sm;  // resident CTAs per SM (>= 0)
};

struct Request {
  int layout = kCross;
  int64_t Nq = 0, Nd = 0;  // segments (queries, documents)
  int64_t Tq = 0, Td = 0;  // token rows
  int64_t P = 0;           // pairs scored
  int64_t lq = 0;          // query rows (the padded query length)
  int64_t dim = 0;
  Dtype dtype = Dtype::kF32;
  bool quant = false;  // 8-bit tokens with per-token scales (forward_quant)
  bool uniform_doc_scales = false;
  bool argmax = false;
  Precision precision = Precision::kDefault;
  bool normalize = false;
  bool rank = false;  // kKeys: the last CTA of a row ranks it (fused top-k)
  int ptr_align = 16;  // the largest of 16, 8, 4, 2, 1 dividing both token pointers
  bool d_scale_aligned = true;  // d_scale 16-byte aligned (8-bit tokens)
  // Public override (benchmarks): this family wherever it can take the
  // call, else the rules. kNone: the rules.
  Family force = Family::kNone;
  // The streams' runs of pairs (force == kStream or kStreamWg only): 1
  // wherever they can take the call (the longest runs), -1 never (one pair
  // per warp or CTA, or split pairs), 0 the rules.
  int force_run = 0;
};

// The calling thread's override, which every request built by
// forward_request starts from (set by maxsim.plan.forcing).
inline Family& forced_family() {
  thread_local Family f = Family::kNone;
  return f;
}
// Its runs-of-pairs part (Request::force_run): forcing("stream_run") /
// forcing("stream_pair"), forcing("stream_wg_run") / forcing("stream_wg_pair").
inline int& forced_run() {
  thread_local int f = 0;
  return f;
}

// ---- the plan -----------------------------------------------------------------

struct StreamPlan {  // kStream
  int ks = 0, rows = 0, warps = kStreamWarps;
  bool rank = false, doc_scale = false;
  int split = 1;  // warps per pair
  int il = 0;     // bit 0: whole-sector lanes; bit 1: interleaved tiles of a split pair
  int qsm = 0;    // query staged in shared memory
  int64_t tail = 0, head_blocks = 0, blocks = 0;
  int64_t extent = 0, qextent = 0;  // guessed segment starts (0: none)
  int run = 0;       // > 0: runs of this many pairs per warp (forward_stream_run.cuh)
  int64_t rpg = 0;   // runs: runs per group of pairs sharing a query
};

struct StreamWgPlan {  // kStreamWg
  int ks = 0, nq = 0, stages = kStreamWgStages;
  int run = 0;      // > 0: runs of this many pairs per CTA
  int64_t rpg = 0;  // runs: runs per group of pairs sharing a query
};

struct PackedPlan {  // kPacked (tile fields: qpt, mt_total, dpc = documents per CTA, gsz, cpg, items)
  int ks = 0;    // 32-byte k steps per row (4 or 8)
  int rows = 0;  // query rows per slot (packed_rows(lq))
};

struct WgmmaPlan {  // kWgmma
  int nkb = 1;             // 128-byte column blocks per row
  int scale = 0;           // 0 none, 1 per token, 2 per document (applied to the row maxima)
  bool multi = false;      // tiles of several queries finish in their own instantiation
};

struct Plan {
  Family family = Family::kNone;
  bool ok = true;           // false: no kernel takes the call (error says why)
  const char* error = "";
  bool scaled = false;      // normalize of float tokens: inverse norms as per-token scales
  bool d_inv_prepass = false;  // the documents' inverse norms from a pre-pass
  bool split = false;       // kMma on float tokens: split 3xTF32 products (else one TF32)
  // Tile kernels (kMma, kWgmma, kSimt).
  int cfg = -1;             // kMma config
  int64_t smem = 0;         // kMma dynamic shared memory
  int bm = 0, bn = 0;
  int qpt = 1, tpq = 1;
  int64_t mt_total = 0;
  int kch = 0, ksteps_last = 0, vecb = 0;
  int64_t row_bytes_pad = 0;
  int occupancy = 0;        // resident CTAs per SM used for the split
  int splits = 1;           // document splits S
  int row_mode = 0;         // 0 direct, 1 tile partial sums, 2 per-row partials
  int dpc = 1;
  int64_t gsz = 1, cpg = 1;
  int64_t items = 0;        // work items (CTAs of kMma / kSimt)
  // Streaming kernels.
  int keep = 0;             // leading CTAs loading documents plainly (INT32_MAX: all)
  bool multiwave = false;
  StreamPlan stream;
  StreamWgPlan stream_wg;
  PackedPlan packed;
  WgmmaPlan wgmma;
  int64_t grid = 0;         // CTAs of the (first) launch
};

// ---- rules ----------------------------------------------------------------------

namespace detail {

inline int blocks(const DeviceFacts& dev, const KernelId& k) { return dev.blocks_per_sm ? dev.blocks_per_sm(k) : 1; }

// Whether the streaming kernels take the call's shape (max_lq: 128 for the
// staged wgmma stream's longer queries). normalize stays on the tile kernels
// (the mma.sync kernel derives the documents' norms from its fragments); fp8
// needs sm_89+. Of the two, only the staged wgmma stream writes argmax rows.
inline bool stream_shape_ok(const Request& r, bool scaled, int arch, int64_t max_lq) {
  const bool b16 = is_16bit(r.dtype);
  const bool b8 = r.dtype == Dtype::kI8 || (r.dtype == Dtype::kE4M3 && arch >= 89);
  if (!(b16 || b8) || scaled || r.lq < 1 || r.lq > max_lq) return false;
  const int64_t rb = r.dim * elem_size(r.dtype);
  if (rb != 64 && rb != 128 && rb != 192 && rb != 256) return false;
  if (b8 && !r.quant) return false;
  return r.ptr_align >= 16;
}

// The staged wgmma stream: sm_90a, 16-bit rows of 128 / 256 bytes, no fused
// rank (the search re-score stays on the mma.sync stream's k order).
inline bool stream_wg_ok(const Request& r, int arch) {
  const int64_t rb = r.dim * elem_size(r.dtype);
  return arch == 90 && is_16bit(r.dtype) && (rb == 128 || rb == 256) && !r.rank &&
         (r.layout == kCross || r.layout == kGrouped || r.layout == kList) &&
         r.P <= std::numeric_limits<int32_t>::max();
}

inline int stream_wg_nq(int64_t lq) { return lq <= 16 ? 16 : lq <= 32 ? 32 : lq <= 64 ? 64 : 128; }

// Documents read once per call are streamed evict-first, unless they fit
// well inside L2: then plain loads keep them for the next call.
inline bool stream_fits_l2(const Request& r, const DeviceFacts& dev, int64_t mean_ld) {
  const int64_t rows = std::min<int64_t>(r.Td, r.P * std::max<int64_t>(mean_ld, 1));
  return rows * r.dim * elem_size(r.dtype) * 4 <= dev.l2_bytes * 3;
}
// The plain-load prefix of a scan of >= 12 waves: the CTAs that read the
// first ~2.5 L2 sizes, at least 2 (a dirty L2 drains up front).
inline int64_t stream_plain_prefix(const DeviceFacts& dev, int64_t cta_bytes) {
  return std::min<int64_t>(std::max<int64_t>(2, 5 * dev.l2_bytes / 2 / std::max<int64_t>(1, cta_bytes)),
                           std::numeric_limits<int32_t>::max() - 1);
}
// Leading CTAs that load plainly: all (INT32_MAX) when the documents fit L2,
// else `prefix`.
inline int stream_plain_ctas(const Request& r, const DeviceFacts& dev, int64_t mean_ld, int64_t prefix) {
  const int64_t k = stream_fits_l2(r, dev, mean_ld) ? 1 : prefix;
  return k == 1 ? std::numeric_limits<int32_t>::max() : (int)k;
}

// The staged wgmma stream where it beats the alternative: the mma.sync
// stream for lq <= 32 keeps documents shorter than a stage, one query's
// documents of up to two stages without an argmax (as fast as runs of pairs
// here, 2 % faster at 64-128 tokens on the H100), few pairs, and 128-byte
// rows in under three waves; the tile kernels for lq 33-128 keep few pairs
// of documents past 1024 tokens (one warpgroup walks each pair while they
// split it over the SMs).
inline bool stream_wg_wins(const Request& r, int64_t mean_ld, int64_t wave, int ks, int nq, int sm_count) {
  if (nq <= 32 && r.layout == kCross && !r.argmax && mean_ld <= kStreamWgRunMaxMeanLd) return false;
  if (nq <= 32) return !(mean_ld < kStreamWgTokens || r.P < 32 || (ks == 4 && r.P < 3 * wave));
  return !(mean_ld > 1024 && (r.lq == 128 ? 2 * r.P < sm_count && 3 * kStreamWgTokens * r.P < 4 * mean_ld
                                          : 2 * kStreamWgTokens * r.P <= mean_ld));
}

// Pairs of a group sharing one query: a query's K candidates (GROUPED), or
// every pair of one CROSS query.
inline int64_t gsz_of(const Request& r) {
  return r.layout == kGrouped ? std::max<int64_t>(1, r.Nq > 0 ? r.Nd / r.Nq : 1) : std::max<int64_t>(r.P, 1);
}

// Runs of pairs sharing a query in whole waves of `slots` resident runs:
// the fewest waves (>= 2, so ragged runs even out; a last wave of a few
// runs would walk a whole run alone) that keep runs <= run_max, then the
// shortest runs that fill them, capped at the group (a query's candidates);
// forced: the longest. run 0 where the rule gives runs of one pair.
struct Runs {
  int64_t run = 0, rpg = 0, count = 0;  // pairs a run, runs a group, runs in all
};
// Runs of `run` pairs over every group (the last run of a group may be shorter).
inline Runs runs_of(const Request& r, int64_t run) {
  const int64_t gsz = gsz_of(r), groups = (r.P + gsz - 1) / gsz, rpg = (gsz + run - 1) / run;
  return {run, rpg, groups * rpg};
}
inline Runs whole_wave_runs(const Request& r, int64_t slots, int64_t run_max, bool forced) {
  const int64_t gsz = gsz_of(r), groups = (r.P + gsz - 1) / gsz;
  const int64_t waves = std::max<int64_t>(2, (r.P + slots * run_max - 1) / (slots * run_max));
  const int64_t rpg_fit = std::max<int64_t>(1, waves * slots / groups);
  int64_t run = forced ? run_max : (gsz + rpg_fit - 1) / rpg_fit;
  run = std::max<int64_t>(1, std::min<int64_t>({run, run_max, gsz}));
  if (!forced && run < 2) return {};
  return runs_of(r, run);
}

// The staged wgmma stream's runs of pairs (one CTA a run of consecutive
// pairs sharing the query: CROSS with one query, GROUPED candidates): for
// documents of up to two stages and >= 4 waves of pairs, whole waves of
// runs of at most kStreamWgRunMax; for more than one wave of pairs and at
// most 4/3, runs of two in one wave (a second wave a quarter full would
// walk its pairs alone: 8-20 % faster at 1.26-1.29 waves on the H100,
// mixed at 1.5-1.8). Forced (force_run 1 with the family forced): the
// longest runs; -1: none. Returns the grid (runs, else pairs).
inline int64_t plan_stream_wg_runs(StreamWgPlan& w, const Request& r, int64_t mean_ld, int64_t wave) {
  const bool layout_ok = (r.layout == kCross && r.Nq == 1) || r.layout == kGrouped;
  if (!layout_ok || r.force_run < 0 || r.P > std::numeric_limits<int32_t>::max()) return r.P;
  const bool forced = r.force == Family::kStreamWg && r.force_run > 0;
  const bool one_wave_of_twos = !forced && r.P > wave && 3 * r.P <= 4 * wave && gsz_of(r) >= 2;
  if (!one_wave_of_twos && !forced && (mean_ld > kStreamWgRunMaxMeanLd || r.P < 4 * wave)) return r.P;
  const Runs runs = one_wave_of_twos ? runs_of(r, 2) : whole_wave_runs(r, wave, kStreamWgRunMax, forced);
  if (runs.run == 0) return r.P;
  w.run = (int)runs.run;
  w.rpg = runs.rpg;
  return runs.count;
}

// The staged wgmma stream for 128 / 256-byte rows (rb), when forced or when
// it wins the shape; false leaves the plan untouched.
inline bool plan_stream_wg(Plan& pl, const Request& r, const DeviceFacts& dev, int64_t mean_ld, int64_t rb,
                           bool forced) {
  const int ks = rb == 128 ? 4 : 8, nq = stream_wg_nq(r.lq);
  KernelId k{Family::kStreamWg, r.dtype, r.argmax};
  k.ks = ks;
  k.rows = nq;
  const int64_t wave = (int64_t)std::max(blocks(dev, k), 1) * dev.sm_count;
  if (!forced && !stream_wg_wins(r, mean_ld, wave, ks, nq, dev.sm_count)) return false;
  pl.family = Family::kStreamWg;
  pl.stream_wg = StreamWgPlan{ks, nq, kStreamWgStages};
  pl.grid = plan_stream_wg_runs(pl.stream_wg, r, mean_ld, wave);
  const int64_t run = std::max(pl.stream_wg.run, 1);
  pl.multiwave = pl.grid > wave;
  const int64_t prefix =
      pl.grid >= 12 * wave ? stream_plain_prefix(dev, run * mean_ld * r.dim * elem_size(r.dtype)) : 0;
  pl.keep = stream_plain_ctas(r, dev, mean_ld, prefix);
  return true;
}

// Runs of pairs where they can take the call: 16-bit rows of 128 / 256
// bytes, consecutive pairs sharing a query (CROSS with one query, GROUPED
// candidates; P < 2^31), no fused top-k.
inline bool stream_run_ok(const Request& r, const StreamPlan& s) {
  return is_16bit(r.dtype) && !s.rank && (s.ks == 4 || s.ks == 8) &&
         ((r.layout == kCross && r.Nq == 1) || r.layout == kGrouped) &&
         r.P <= std::numeric_limits<int32_t>::max() && r.force_run >= 0;
}

// Runs of pairs for many short documents: one warp per pair reloads the
// query (8 KB at 32 rows of 256 bytes, from L2) per document of 2 KB (8
// tokens) and starts each pair on a chain of dependent loads; a run loads
// the query once and keeps its steps in flight across documents. Taken
// from 4 pairs per resident warp slot (fewer: one pair per warp, splits),
// in whole waves of runs of at most kStreamRunMax (whole_wave_runs). Forced
// (force_run 1): the longest runs. false leaves the plan untouched.
inline bool plan_stream_runs(Plan& pl, const Request& r, const DeviceFacts& dev, int64_t mean_ld) {
  StreamPlan& s = pl.stream;
  if (!stream_run_ok(r, s)) return false;
  const bool forced = r.force == Family::kStream && r.force_run > 0;
  if (!forced && mean_ld > kStreamRunMaxMeanLd) return false;
  KernelId k{Family::kStream, r.dtype};
  k.ks = s.ks;
  k.rows = s.rows;
  k.warps = kStreamWarps;
  k.run = true;
  const int per_sm = std::max(blocks(dev, k), 1);
  const int64_t slots = (int64_t)per_sm * kStreamWarps * dev.sm_count;
  if (!forced && (r.P < 4 * slots || gsz_of(r) < 2)) return false;
  const Runs w = whole_wave_runs(r, slots, kStreamRunMax, forced);
  if (w.run == 0) return false;
  const int64_t run = w.run, runs = w.count;
  s.run = (int)run;
  s.rpg = w.rpg;
  s.warps = kStreamWarps;
  s.split = 1;
  s.tail = 0;
  s.blocks = s.head_blocks = (runs + kStreamWarps - 1) / kStreamWarps;
  s.il = 3;  // the run kernel always takes the 16-bit one-pair lane layout (same k order, same bits)
  s.qsm = 0;
  const int64_t wave = (int64_t)per_sm * dev.sm_count;
  pl.multiwave = s.blocks > wave;
  const int64_t prefix = s.blocks >= 12 * wave
                             ? stream_plain_prefix(dev, kStreamWarps * run * std::max<int64_t>(mean_ld, 1) * r.dim *
                                                            elem_size(r.dtype))
                             : 0;
  pl.keep = stream_plain_ctas(r, dev, mean_ld, prefix);
  pl.grid = s.blocks;
  return true;
}

// Register-streaming kernel: warps per pair, tail, lane layout, staging.
// A pair split over S warps shortens each warp's chain of dependent loads
// and the last wave's tail, but costs a query load per warp and can push a
// one-wave grid into more; a grid of several waves ends on pairs split over
// 4 warps (stream.tail). 8-bit rows keep one warp per pair.
inline void plan_stream(Plan& pl, const Request& r, const DeviceFacts& dev, int64_t mean_ld) {
  pl.family = Family::kStream;
  StreamPlan& s = pl.stream;
  const bool b16 = is_16bit(r.dtype);
  const int64_t rb = r.dim * elem_size(r.dtype);
  s.ks = (int)(rb / 32);
  s.rows = r.lq <= 16 ? 1 : 2;
  s.rank = b16 && r.rank;
  s.doc_scale = !b16 && r.quant && r.uniform_doc_scales;
  KernelId k{Family::kStream, r.dtype};
  k.ks = s.ks;
  k.rows = s.rows;
  k.rank = s.rank;
  k.doc_scale = s.doc_scale;
  if (plan_stream_runs(pl, r, dev, mean_ld)) return;
  const int64_t ntile = (mean_ld + 7) / 8;
  if (b16 && !s.rank && (s.ks == 4 || s.ks == 8)) {
    // Pairs that fit one wave of 8-warp CTAs with >= 4 tiles per warp: one
    // pair per CTA.
    KernelId kw = k;
    kw.warps = kStreamWideWarps;
    const int64_t wave = (int64_t)std::max(detail::blocks(dev, kw), 1) * dev.sm_count;
    if (r.P <= wave && ntile >= 4 * kStreamWideWarps) {
      s.warps = kStreamWideWarps;
      s.split = kStreamWideWarps;
      s.tail = 0;
      s.head_blocks = r.P;
      s.blocks = r.P;
      s.il = 3;
      s.qsm = 1;
      pl.keep = stream_plain_ctas(r, dev, mean_ld, 0);
      pl.multiwave = r.P > wave;
      pl.grid = s.blocks;
      return;
    }
  }
  k.warps = kStreamWarps;
  const int per_sm = std::max(detail::blocks(dev, k), 1);
  const int64_t slots = (int64_t)per_sm * kStreamWarps * dev.sm_count;
  int S = 1;
  if (b16) {
    if (r.P <= slots)
      S = ntile >= 64 || 4 * r.P * 3 <= 2 * slots                       ? 4
          : 2 * r.P <= slots || (8 * r.P >= 5 * slots && ntile >= 32) ? 2
                                                                      : 1;
    else
      S = 4 * r.P <= 9 * slots                                 ? 1
          : ntile >= 44 || (ntile >= 32 && r.layout == kCross) ? 4
          : ntile >= 22                                        ? 2
                                                               : 1;
  }
  s.split = S;
  s.tail = r.P * S > slots ? slots / 2 : 0;
  if (S == kStreamWarps) s.tail = 0;
  s.tail = std::min<int64_t>(s.tail, r.P);
  const auto count_blocks = [&] {
    const int64_t per = kStreamWarps / s.split;  // pairs per head CTA
    s.head_blocks = (r.P - s.tail + per - 1) / per;
    s.blocks = s.head_blocks + s.tail;
  };
  count_blocks();
  if (s.blocks > std::numeric_limits<int32_t>::max()) {
    s.split = 1;
    s.tail = 0;
    count_blocks();
  }
  s.il = b16 ? 3 : 0;  // 16-bit: whole-sector lanes, interleaved tiles
  s.qsm = s.split >= 4 ? 1 : 0;
  const int64_t wave = (int64_t)per_sm * dev.sm_count;
  pl.multiwave = s.blocks > wave;
  // Scans of >= 12 waves load their first ~2.5 L2 sizes of documents plainly.
  const int64_t prefix =
      b16 && s.blocks >= 12 * wave ? stream_plain_prefix(dev, kStreamWarps / s.split * mean_ld * rb) : 0;
  pl.keep = stream_plain_ctas(r, dev, mean_ld, prefix);
  pl.grid = s.blocks;
}

// mma.sync tile configuration from the shape: several CROSS queries stack
// in one M tile so each document tile feeds many queries.
constexpr int choose_mma_cfg(int layout, int64_t nq, int64_t lq) {
  if (layout == kCross && nq > 1) {
    if (lq <= 32 && nq * lq <= 32) return 0;
    if (lq <= 64 && nq * lq <= 64) return 1;
    if (lq <= 64) return 2;
  }
  if (lq <= 32) return 0;
  if (lq <= 64) return 1;
  return 2;
}

// Every config the rule returns is built (the fallback for a tile too wide
// for shared memory only narrows it: 2 -> 1 -> 0).
constexpr bool mma_choices_built() {
  for (int layout = kCross; layout <= kList; ++layout)
    for (int64_t nq = 1; nq <= 8; ++nq)
      for (int64_t lq = 1; lq <= 256; ++lq)
        if (choose_mma_cfg(layout, nq, lq) >= kNumMmaConfigs) return false;
  return true;
}
static_assert(mma_choices_built(), "the planner returns an mma.sync config that is not instantiated");

inline bool wgmma_takes(const Request& r, const DeviceFacts& dev, bool scaled) {
  const int64_t esz = elem_size(r.dtype), rb = r.dim * esz;
  if (r.dtype == Dtype::kF32 || dev.arch != 90 || !dev.wgmma_built) return false;
  if (rb < 16 || rb > 2 * 128 || rb % 16 != 0) return false;
  if (r.Td <= 0 || r.Td >= ((int64_t)1 << 31) || r.Tq >= ((int64_t)1 << 31)) return false;  // 32-bit row ids
  if (r.ptr_align < 16) return false;
  if (esz == 1 && !(r.quant && r.d_scale_aligned)) return false;  // scales through a 1-D tensor map
  if (scaled && !is_16bit(r.dtype)) return false;
  // fp8 argmax: exact products on mma.sync; fp8 rows of <= 128 products.
  if (r.dtype == Dtype::kE4M3 && (r.argmax || rb > 128)) return false;
  return true;
}

// The packed kernel takes the call: sm_80+, 16-bit rows of 128 / 256 bytes,
// 16-byte aligned, queries of <= 32 rows, CROSS or GROUPED, no normalize.
inline bool packed_ok(const Request& r, const DeviceFacts& dev, bool scaled) {
  const int64_t rb = r.dim * elem_size(r.dtype);
  return dev.arch >= 80 && is_16bit(r.dtype) && !r.quant && !scaled && (rb == 128 || rb == 256) &&
         r.ptr_align >= 16 && r.lq >= 1 && r.lq <= 32 && (r.layout == kCross || r.layout == kGrouped) &&
         r.Nd <= std::numeric_limits<int32_t>::max() && r.Td < ((int64_t)1 << 31);
}

// Where it wins: several queries sharing many short documents (per
// (query, document) pair the other families pay a 64-column tile; here a
// document costs its own columns). Its scanned epilogue costs more per
// column than the tile kernels', so longer documents go back to them (but
// padded 64-token ones, below); one query and per-query candidates stream
// (3/4 of this kernel's tile rows would be empty). Measurements:
// performance.md, many short documents.
// With an argmax the packed epilogue's cost grows with the document length
// while a wgmma tile's stays flat up to 64 tokens: wgmma overtakes it past
// ~20 tokens (mma.sync does not, up to kPackedMaxMeanLd).
// Padded 64-token documents without an argmax on sm_90a take the aligned
// epilogue (a token mask leaves every document 64 columns long). The rule
// sees only Td = 64 Nd: a ragged corpus of exactly that mean also matches
// and takes the scan, which wgmma beats there.
inline bool packed_wins(const Request& r, const DeviceFacts& dev, int64_t mean_ld) {
  const int64_t max_ld = r.argmax && wgmma_takes(r, dev, false) ? kPackedMaxMeanLdArgmaxWg : kPackedMaxMeanLd;
  const bool padded64 = !r.argmax && dev.arch == 90 && dev.wgmma_built && r.Td == r.Nd * kPackedPaddedLd;
  return r.layout == kCross && r.Nq >= 2 && (mean_ld <= max_ld || padded64) && r.Nd >= 64;
}

// Documents per CTA and the grid: about two waves (at least kPackedMaxDocs
// documents' worth of CTAs), each CTA >= 4 column tiles where there are
// that many.
inline void plan_packed(Plan& pl, const Request& r, const DeviceFacts& dev, int64_t mean_ld) {
  pl.family = Family::kPacked;
  const int64_t rb = r.dim * elem_size(r.dtype);
  pl.packed.ks = (int)(rb / 32);
  pl.packed.rows = packed_rows(r.lq);
  KernelId k{Family::kPacked, r.dtype, r.argmax};
  k.ks = pl.packed.ks;
  pl.occupancy = std::max(1, blocks(dev, k));
  const int64_t slots = (int64_t)pl.occupancy * dev.sm_count;
  const bool cross = r.layout == kCross;
  pl.qpt = cross ? kPackedBM / pl.packed.rows : 1;
  pl.mt_total = cross ? (r.Nq + pl.qpt - 1) / pl.qpt : 1;
  pl.gsz = cross ? std::max<int64_t>(r.Nd, 1) : std::max<int64_t>(1, r.Nq > 0 ? r.Nd / r.Nq : 1);
  const int64_t groups = (r.Nd + pl.gsz - 1) / pl.gsz;
  const int64_t tiles_of_group = std::max<int64_t>(1, pl.gsz * std::max<int64_t>(mean_ld, 1) / (4 * kPackedBN));
  const int64_t want = (2 * slots + pl.mt_total * groups - 1) / (pl.mt_total * groups);
  int64_t cpg = std::max<int64_t>((pl.gsz + kPackedMaxDocs - 1) / kPackedMaxDocs, std::min(want, tiles_of_group));
  cpg = std::min(cpg, pl.gsz);
  pl.dpc = (int)((pl.gsz + cpg - 1) / cpg);
  pl.cpg = (pl.gsz + pl.dpc - 1) / pl.dpc;
  pl.items = pl.mt_total * groups * pl.cpg;
  pl.grid = pl.items;
}

}  // namespace detail

// The wgmma kernel's schedule for a launch of `items` work items.
inline int wgmma_flags(const Plan& pl, const Request& r, const DeviceFacts& dev, int64_t items) {
  const int64_t grid = std::min<int64_t>(items, std::max(1, dev.sm_count));
  const int64_t avg_chunk = (r.Nd > 0 ? r.Td / r.Nd : 0) / std::max(1, pl.splits);
  // Contiguous item ranges (and the fast loader) when a doc chunk fits the
  // stage ring: the chunk is loaded once per CTA and shared by its M tiles.
  return avg_chunk <= (int64_t)wg_stages(pl.wgmma.nkb) * kWgBN && items >= 2 * grid ? kWgContiguous | kWgFastLoader
                                                                                      : 0;
}

inline Plan plan_forward(const Request& r, const DeviceFacts& dev) {
  using namespace detail;
  Plan pl;
  pl.scaled = r.normalize && !r.quant && r.lq > 0;
  const int64_t mean_ld = r.Nd > 0 ? r.Td / r.Nd : 0;
  const int64_t esz = elem_size(r.dtype), rb = r.dim * esz;
  const bool forced = r.force != Family::kNone;

  if (r.layout == kKeys) {  // rescore_topk: the streaming kernel from the keys, else the composition
    const bool takes = is_16bit(r.dtype) && !r.argmax && r.lq >= 1 && r.lq <= 32 && r.P >= 1 &&
                       r.P <= std::numeric_limits<int32_t>::max() && dev.arch >= 80 && mean_ld <= kStreamMaxMeanLd &&
                       stream_shape_ok(r, false, dev.arch, 32);
    if (takes)
      plan_stream(pl, r, dev, mean_ld);
    else
      pl.family = Family::kComposed;
    return pl;
  }
  if (r.P == 0) return pl;
  if (r.lq == 0) {  // no query rows: scores are 0 (NaN for invalid pairs)
    pl.splits = 0;
    pl.row_mode = 2;
    return pl;
  }

  // ---- packed short documents -------------------------------------------------
  if ((forced ? r.force == Family::kPacked : packed_wins(r, dev, mean_ld)) && packed_ok(r, dev, pl.scaled) &&
      r.P > 0) {
    plan_packed(pl, r, dev, mean_ld);
    return pl;
  }

  // ---- streaming kernels -----------------------------------------------------
  // One query against many documents, and per-query candidate lists / pair
  // lists of 16-bit tokens; several queries share documents through the tile
  // kernels' query tiles (CROSS). Very long documents take the tile kernels'
  // splits.
  const bool stream_layout = (r.layout == kCross && r.Nq == 1) || (r.layout != kCross && !r.quant);
  const bool want_stream = forced ? (r.force == Family::kStream || r.force == Family::kStreamWg) : stream_layout;
  if (want_stream && dev.arch >= 80 && mean_ld <= kStreamMaxMeanLd && stream_shape_ok(r, pl.scaled, dev.arch, 32)) {
    // Guessed segment starts only where segment n's id is its position.
    const bool by_position = r.layout == kCross || r.layout == kGrouped;
    pl.stream.extent = by_position && r.Nd > 0 && r.Td % r.Nd == 0 ? r.Td / r.Nd : 0;
    pl.stream.qextent = by_position && r.Nq > 0 && r.Tq % r.Nq == 0 ? r.Tq / r.Nq : 0;
    if (r.force != Family::kStream && stream_wg_ok(r, dev.arch) &&
        plan_stream_wg(pl, r, dev, mean_ld, rb, r.force == Family::kStreamWg))
      return pl;
    if (!r.argmax) {
      plan_stream(pl, r, dev, mean_ld);
      return pl;
    }
  }
  // Queries of 33-128 rows, one query or candidates: the staged wgmma stream
  // before the tile kernels.
  const bool want_long = forced ? r.force == Family::kStreamWg : stream_layout;
  if (want_long && r.lq > 32 && mean_ld <= kStreamMaxMeanLd && stream_shape_ok(r, pl.scaled, dev.arch, 128) &&
      stream_wg_ok(r, dev.arch) && plan_stream_wg(pl, r, dev, mean_ld, rb, forced))
    return pl;

  // ---- tile kernels --------------------------------------------------------------
  // fp32: tensor cores unless precision is exact (split 3xTF32 by default).
  bool use_mma = r.dtype != Dtype::kF32 || r.precision != Precision::kExact;
  int vecb = 0;
  for (int v : {16, 8, 4})
    if (rb % v == 0 && r.ptr_align >= v) {
      vecb = v;
      break;
    }
  if (vecb == 0) use_mma = false;
  if (r.quant && vecb == 0) {
    pl.ok = false;
    pl.error = "maxsim: quantized token rows must be 4-byte aligned";
    return pl;
  }
  const int kcb = mma_kchunk(r.quant);
  const int kch = (int)std::max<int64_t>(1, (rb + kcb - 1) / kcb);
  int cfg = -1;
  int64_t smem = 0;
  if (use_mma) {
    cfg = choose_mma_cfg(r.layout, r.Nq, r.lq);
    // Narrower query tiles when the resident tile does not fit: 128 -> 64 -> 32 rows.
    while (true) {
      smem = mma_smem_bytes(cfg, kch, r.quant);
      if (smem + mma_static_smem(cfg, r.quant) <= dev.smem_optin) break;
      if (kMmaConfigs[cfg].bm == 128)
        cfg = 1;
      else if (cfg == 1)
        cfg = 0;
      else {
        cfg = -1;
        break;
      }
    }
    if (cfg < 0) use_mma = false;
  }
  if (r.force == Family::kSimt && !r.quant) use_mma = false;
  if (!use_mma && r.quant) {
    pl.ok = false;
    pl.error = "maxsim: quantized query tile does not fit in shared memory";
    return pl;
  }
  // sm_90a wgmma + TMA kernel when its 128-row M tile is full.
  const int64_t rows_per_token = r.layout == kCross ? r.Nq * r.lq : r.lq;
  const int64_t wg_rows = std::min<int64_t>(rows_per_token, kWgBM);
  const bool wg_wanted = r.force == Family::kWgmma || (!forced && wg_rows >= kWgBM);
  const bool use_wg = use_mma && wg_wanted && wgmma_takes(r, dev, pl.scaled);

  pl.family = use_wg ? Family::kWgmma : use_mma ? Family::kMma : Family::kSimt;
  pl.split = use_mma && r.dtype == Dtype::kF32 && r.precision == Precision::kDefault;
  pl.cfg = use_mma && !use_wg ? cfg : -1;
  pl.smem = use_mma && !use_wg ? smem : 0;
  pl.bm = use_wg ? kWgBM : use_mma ? kMmaConfigs[cfg].bm : kSimtBM;
  pl.bn = use_wg ? kWgBN : use_mma ? kMmaConfigs[cfg].bn : kSimtBN;
  if (r.lq <= pl.bm) {
    pl.qpt = r.layout == kCross ? (int)std::max<int64_t>(1, std::min<int64_t>(pl.bm / r.lq, r.Nq)) : 1;
    pl.tpq = 1;
  } else {
    pl.qpt = 1;
    pl.tpq = (int)((r.lq + pl.bm - 1) / pl.bm);
  }
  pl.mt_total = r.layout == kCross ? ((r.Nq + pl.qpt - 1) / pl.qpt) * pl.tpq : pl.tpq;
  pl.kch = kch;
  pl.ksteps_last = (int)((rb - (int64_t)(kch - 1) * kcb + 31) / 32);
  pl.row_bytes_pad = (rb + 31) / 32 * 32;
  pl.vecb = vecb;
  const int64_t U = r.layout == kList ? r.P : r.Nd;
  const int64_t items_base = U * pl.mt_total;

  // ---- doc splits for parallelism (few work items, long docs) ---------------
  int occ = 1;
  if (!use_wg) {
    KernelId k{use_mma ? Family::kMma : Family::kSimt, r.dtype, r.argmax, pl.scaled, pl.split};
    k.cfg = use_mma ? cfg : 0;
    k.smem = use_mma ? smem : 0;
    occ = std::max(1, blocks(dev, k));
  }
  pl.occupancy = occ;
  const int64_t slots = (int64_t)occ * dev.sm_count;
  int S = 1;
  if (items_base < slots) {
    const int64_t by_len = mean_ld / (2 * pl.bn);  // keep >= 2 tiles per chunk
    const int64_t want = (2 * slots + items_base - 1) / items_base;
    S = (int)std::max<int64_t>(1, std::min<int64_t>({want, by_len, 1024}));
  }
  pl.splits = S;
  pl.row_mode = S > 1 ? 2 : (pl.tpq > 1 ? 1 : 0);

  // ---- several docs per CTA (mma.sync kernel, no doc split) -------------------
  // Many short docs: a CTA walks up to dpc consecutive docs of one group (same
  // query tile), so the query tile is loaded once and the cp.async ring keeps
  // streaming across doc boundaries. Sized so the grid is about one wave when
  // the plain grid would be 2 to 12 waves (more waves hide the fill / drain);
  // 8-bit docs (half the bytes) up to 32 waves, else 8 docs per CTA.
  pl.items = items_base * S;
  if (use_mma && !use_wg && S == 1 && r.layout != kList && r.Nd > 0) {
    int64_t dpc = 1;
    if (items_base >= 2 * slots && items_base <= 12 * slots)
      dpc = (items_base + slots - 1) / slots;
    else if (r.quant && items_base <= 32 * slots)
      dpc = (items_base + slots - 1) / slots;
    else if (r.quant)
      dpc = 8;
    dpc = std::min<int64_t>(dpc, kMmaMaxDpc);
    if (dpc > 1) {
      const int64_t K = std::max<int64_t>(1, (r.layout == kGrouped && r.Nq > 0) ? r.Nd / r.Nq : 1);
      const int64_t gsz = r.layout == kCross ? r.Nd : K;
      pl.dpc = (int)dpc;
      pl.gsz = gsz;
      pl.cpg = (gsz + dpc - 1) / dpc;
      pl.items = pl.mt_total * ((r.Nd + gsz - 1) / gsz) * pl.cpg;
    }
  }
  pl.d_inv_prepass = pl.scaled && (!use_mma || use_wg);  // the mma.sync kernel derives its own

  if (use_wg) {
    const int64_t avg_chunk = mean_ld / std::max(1, S);
    pl.wgmma.nkb = rb <= 128 ? 1 : 2;
    const bool doc_scale = r.quant && r.uniform_doc_scales;
    if (r.dtype == Dtype::kE4M3)
      pl.wgmma.scale = doc_scale ? 2 : 1;
    else if (r.dtype == Dtype::kI8)
      pl.wgmma.scale = rb <= 128 && !r.argmax && doc_scale ? 2 : 1;
    else
      pl.wgmma.scale = pl.scaled ? 1 : 0;
    // Tiles of several CROSS queries (16-bit, direct rows) finish in their own
    // instantiation; with argmax only items of one doc tile.
    pl.wgmma.multi = pl.wgmma.scale == 0 && (!r.argmax || avg_chunk <= kWgBN) && r.layout == kCross &&
                     pl.qpt >= 2 && pl.row_mode == 0;
    pl.grid = std::min<int64_t>(std::min<int64_t>(pl.items, (int64_t)1 << 30), std::max(1, dev.sm_count));
  } else {
    pl.grid = std::min<int64_t>(pl.items, (int64_t)1 << 30);
  }
  return pl;
}

}  // namespace plan
}  // namespace maxsim
