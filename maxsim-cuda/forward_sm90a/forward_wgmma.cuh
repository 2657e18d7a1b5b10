// Hopper (sm_90a) tensor-core forward kernel: wgmma + TMA, fp16 / bf16
// inputs, fp32 accumulation, for rows of 16 to 256 bytes (a multiple of 16:
// 8 <= dim <= 128 for 16-bit tokens). int8 tokens (s32 accumulation, exact;
// forward_quant) run the same kernel: a 32-byte k step is k16 for 16-bit and
// k32 for 8-bit types, so fragments, swizzle and descriptors are unchanged.
// fp8 e4m3 tokens of <= 128 bytes run it too (k32 steps, f32 accumulators),
// with one caveat: Hopper's fp8 wgmma adds the products of a chain in a
// reduced-precision accumulator (relative score errors of ~1e-5 against the
// dequantised fp64 reference, where the other paths are within ~1e-7; the
// e4m3 rounding of the tokens themselves is ~1e-2). A chain spans
// at most 128 products (the interval after which fp8 GEMM libraries promote
// partial sums to fp32); wider fp8 rows, and argmax (whose winners could
// swap on near-ties), stay on the exact mma.sync kernel.
// Scaled variants (SC: 8-bit tokens, and 16-bit tokens under normalize) take
// per-token scales: the documents' travel with each doc tile (a 1-D TMA of
// the tile's scales into the stage) and multiply the products before the
// max; the queries' multiply the row maxima in the finisher. Where the
// caller promises one scale per document (forward_quant's
// uniform_doc_scales; fp8 corpora are stored that way, int8 ones on request),
// the kernel takes kScDoc: the document's scale commutes with the max and
// joins the query's in the finisher, and the fold is the max alone (the
// per-product scale step is a third of a long scan's time); for int8
// the max of the raw s32 products, as integers.
//
// Persistent kernel, one CTA per SM (384 threads), each CTA walking the same
// work items as the other forward kernels (decode_work: M tile of BM = 128
// query rows x BN-aligned chunk of one document; qpt / tpq / S / row_mode as
// set by the host) with a stride of gridDim.x. Warp roles:
//   * warpgroups 0 and 1 (consumers, 200 registers): each owns 64 of the 128
//     query rows. The query rows are copied from shared memory into wgmma A
//     fragments (registers) once per item; each BN = 128 doc-token tile is
//     one chain of dim/16 wgmma m64n128k16 (RS: A registers, B = doc tile in
//     shared memory, K-major, 128B swizzle); while one warpgroup folds its
//     tile into the row maxima the other one's chain keeps the tensor cores
//     busy. A final tile of <= 64 valid tokens uses m64n64k16. Running
//     row max / argmax live in registers (NaN propagates, lowest index wins
//     ties, out-of-range and masked tokens are -inf); at the end of an item
//     the 4 lanes of a quad merge and write per-row results to shared memory.
//   * warp 8 (producer, one lane): streams doc tiles [BN rows x 128 B] per
//     64-column block with cp.async.bulk.tensor (a 2-D tensor map over the
//     whole [Td, dim] d matrix, row coordinate d_start + token; rows of other
//     documents are masked in the fold, rows past Td / columns past dim are
//     zero-filled by TMA) into a STAGES-deep ring guarded by full / empty
//     mbarriers.
//   * warps 9, 10 (loader): decode the next work item, build its row table
//     and query-slot states (global loads issued before waiting), then, once
//     the consumers hold the current query rows in registers, load the next
//     query tile: one TMA per 128-byte column block when its rows are
//     consecutive Q rows (padded queries), else a cp.async gather (zero-filled
//     rows / columns); completion on an mbarrier either way. Item descriptors
//     and tables live in a ring of NR = 4.
//   * warp 11 (finisher): the per-item epilogue, a port of finish_tile with
//     the same row_mode / workspace conventions (so the finalize kernels of
//     forward.cu apply unchanged), off the consumers' critical path. Scores
//     of tiles holding several queries run an instantiation (MS) whose
//     finisher resolves the query slots in interleaved groups of four: one
//     chain per slot made this warp the pace-setter of short items.
// Item schedule: strided over CTAs (CTAs running together share documents
// through L2), or contiguous ranges when a doc chunk fits the stage ring: a
// chunk then stays resident across the consecutive items (M tiles) that use
// it and is loaded once. Flags (kernel argument, kWg*): contiguous schedule,
// argmax fold variant, loader variant; the host picks them (launch_wgmma).
// Deterministic: maxima are exact, sums are taken in a fixed order.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <type_traits>

#include "../common/common.cuh"
#include "../common/smem_opt_in.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MAXSIM_WG_DEVICE 1
#else
#define MAXSIM_WG_DEVICE 0
#endif

namespace maxsim {
namespace cuda_fwd {

using plan::kWgBM;  // query rows per work item (2 consumer warpgroups x 64)
using plan::kWgBN;  // doc tokens per pipeline stage
constexpr int kWgThreads = 384;  // 2 consumer warpgroups + producer / loader / finisher warpgroup
constexpr int kWgMaxDim = 128;

// Scaled variants: a tile's doc-token scales arrive by a 1-D TMA whose start
// must be 16-byte aligned, so the box starts at the tile's first row rounded
// down to 4 and holds BN + 4 scales; stages are 128-byte aligned.
constexpr int kWgScaleBox = kWgBN + 4;
constexpr int kWgScaleStride = 160;  // floats per stage (640 B)

// NKB: 64-element (128-byte) column blocks of dim (1 or 2).
template <int NKB>
struct WgCfg {
  static constexpr int STAGES = plan::wg_stages(NKB);
  static constexpr int STAGE_BYTES = NKB * kWgBN * 128;
  static constexpr int Q_BYTES = NKB * kWgBM * 128;
  static constexpr int SCALE_BYTES = STAGES * kWgScaleStride * 4;  // scaled variants: doc-token scales per stage
  static constexpr int SMEM = STAGES * STAGE_BYTES + Q_BYTES + SCALE_BYTES + 1024;  // + alignment slack
};

// Scale modes (template parameter SC).
constexpr int kScNone = 0;   // 16-bit tokens
constexpr int kScToken = 1;  // per-token scales, the documents' before the max
constexpr int kScDoc = 2;    // one scale per document, applied to the row maxima

// int8 tokens with one scale per document: the fold takes the row maxima of
// the raw s32 products as integers (the scale is applied to them in the
// finisher), converted to fp32 once per row at the end of an item.
template <typename T, int SC>
constexpr bool kWgIntMax = SC == kScDoc && std::is_same<T, int8_t>::value;

// Kernel flags (the planner's schedule, plan::wgmma_flags).
using plan::kWgContiguous;  // contiguous item ranges per CTA (else strided)
using plan::kWgFastLoader;  // loader: slot-level loads only, rows from the slot table (fewer round trips)

// Doc chunk of the previous item (producer and consumers decide residency
// identically): the same chunk of <= stages tiles is not reloaded.
struct WgChunk {
  int ds = -1, c0 = -1, c1 = -1, nt = 0;
  __device__ __forceinline__ bool same(const Work& w, int stages) const {
    return nt >= 1 && nt <= stages && w.ds == ds && w.c0 == c0 && w.c1 == c1;
  }
  __device__ __forceinline__ void set(const Work& w, int ntiles) {
    ds = w.ds;
    c0 = w.c0;
    c1 = w.c1;
    nt = ntiles;
  }
};

template <typename T>
struct WgMma;

// ---------------------------------------------------------------------------
// PTX wrappers (sm_90a only; empty elsewhere so the file compiles for sm_80).
// ---------------------------------------------------------------------------
#if MAXSIM_WG_DEVICE
// f32-accumulator wrappers: k and the A / B types in SHAPE_TYPES; IMM are the
// immediates after scale-d (scale-a, scale-b, and B's transpose for 16-bit types).
#define MAXSIM_WGMMA_F32(T, SHAPE_TYPES, IMM) \
template <> \
struct WgMma<T> { \
  static __device__ __forceinline__ void n128(float* d, const uint32_t* a, uint64_t desc, int scale_d) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n128" SHAPE_TYPES " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
        "{%64, %65, %66, %67}, %68, p, " IMM ";\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d)); \
  } \
  static __device__ __forceinline__ void n64(float* d, const uint32_t* a, uint64_t desc, int scale_d) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n64" SHAPE_TYPES " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
        "{%32, %33, %34, %35}, %36, p, " IMM ";\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d)); \
  } \
  static __device__ __forceinline__ float value(float acc) { return acc; } \
};
MAXSIM_WGMMA_F32(__nv_bfloat16, "k16.f32.bf16.bf16", "1, 1, 0")
MAXSIM_WGMMA_F32(__half, "k16.f32.f16.f16", "1, 1, 0")
// e4m3 tokens, k = 32 per 32-byte step (B from shared memory, A from
// registers, both K-major as fp8 wgmma requires). The fp8 tensor-core path
// adds products in a reduced-precision accumulator (see the header).
MAXSIM_WGMMA_F32(__nv_fp8_e4m3, "k32.f32.e4m3.e4m3", "1, 1")
#undef MAXSIM_WGMMA_F32

// int8 tokens, k = 32 per 32-byte step. int8 accumulates exactly in s32,
// carried in the float registers' bits (bound as 32-bit integer operands);
// value() turns an accumulator into its fp32 product.
template <>
struct WgMma<int8_t> {
  static __device__ __forceinline__ void n128(float* d, const uint32_t* a, uint64_t desc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p;\n}\n"
        : "+r"(reinterpret_cast<uint32_t&>(d[0])), "+r"(reinterpret_cast<uint32_t&>(d[1])), "+r"(reinterpret_cast<uint32_t&>(d[2])), "+r"(reinterpret_cast<uint32_t&>(d[3])), "+r"(reinterpret_cast<uint32_t&>(d[4])), "+r"(reinterpret_cast<uint32_t&>(d[5])), "+r"(reinterpret_cast<uint32_t&>(d[6])), "+r"(reinterpret_cast<uint32_t&>(d[7])), "+r"(reinterpret_cast<uint32_t&>(d[8])), "+r"(reinterpret_cast<uint32_t&>(d[9])), "+r"(reinterpret_cast<uint32_t&>(d[10])), "+r"(reinterpret_cast<uint32_t&>(d[11])), "+r"(reinterpret_cast<uint32_t&>(d[12])), "+r"(reinterpret_cast<uint32_t&>(d[13])), "+r"(reinterpret_cast<uint32_t&>(d[14])), "+r"(reinterpret_cast<uint32_t&>(d[15])), "+r"(reinterpret_cast<uint32_t&>(d[16])), "+r"(reinterpret_cast<uint32_t&>(d[17])), "+r"(reinterpret_cast<uint32_t&>(d[18])), "+r"(reinterpret_cast<uint32_t&>(d[19])), "+r"(reinterpret_cast<uint32_t&>(d[20])), "+r"(reinterpret_cast<uint32_t&>(d[21])), "+r"(reinterpret_cast<uint32_t&>(d[22])), "+r"(reinterpret_cast<uint32_t&>(d[23])), "+r"(reinterpret_cast<uint32_t&>(d[24])), "+r"(reinterpret_cast<uint32_t&>(d[25])), "+r"(reinterpret_cast<uint32_t&>(d[26])), "+r"(reinterpret_cast<uint32_t&>(d[27])), "+r"(reinterpret_cast<uint32_t&>(d[28])), "+r"(reinterpret_cast<uint32_t&>(d[29])), "+r"(reinterpret_cast<uint32_t&>(d[30])), "+r"(reinterpret_cast<uint32_t&>(d[31])), "+r"(reinterpret_cast<uint32_t&>(d[32])), "+r"(reinterpret_cast<uint32_t&>(d[33])), "+r"(reinterpret_cast<uint32_t&>(d[34])), "+r"(reinterpret_cast<uint32_t&>(d[35])), "+r"(reinterpret_cast<uint32_t&>(d[36])), "+r"(reinterpret_cast<uint32_t&>(d[37])), "+r"(reinterpret_cast<uint32_t&>(d[38])), "+r"(reinterpret_cast<uint32_t&>(d[39])), "+r"(reinterpret_cast<uint32_t&>(d[40])), "+r"(reinterpret_cast<uint32_t&>(d[41])), "+r"(reinterpret_cast<uint32_t&>(d[42])), "+r"(reinterpret_cast<uint32_t&>(d[43])), "+r"(reinterpret_cast<uint32_t&>(d[44])), "+r"(reinterpret_cast<uint32_t&>(d[45])), "+r"(reinterpret_cast<uint32_t&>(d[46])), "+r"(reinterpret_cast<uint32_t&>(d[47])), "+r"(reinterpret_cast<uint32_t&>(d[48])), "+r"(reinterpret_cast<uint32_t&>(d[49])), "+r"(reinterpret_cast<uint32_t&>(d[50])), "+r"(reinterpret_cast<uint32_t&>(d[51])), "+r"(reinterpret_cast<uint32_t&>(d[52])), "+r"(reinterpret_cast<uint32_t&>(d[53])), "+r"(reinterpret_cast<uint32_t&>(d[54])), "+r"(reinterpret_cast<uint32_t&>(d[55])), "+r"(reinterpret_cast<uint32_t&>(d[56])), "+r"(reinterpret_cast<uint32_t&>(d[57])), "+r"(reinterpret_cast<uint32_t&>(d[58])), "+r"(reinterpret_cast<uint32_t&>(d[59])), "+r"(reinterpret_cast<uint32_t&>(d[60])), "+r"(reinterpret_cast<uint32_t&>(d[61])), "+r"(reinterpret_cast<uint32_t&>(d[62])), "+r"(reinterpret_cast<uint32_t&>(d[63]))
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  }
  static __device__ __forceinline__ void n64(float* d, const uint32_t* a, uint64_t desc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p;\n}\n"
        : "+r"(reinterpret_cast<uint32_t&>(d[0])), "+r"(reinterpret_cast<uint32_t&>(d[1])), "+r"(reinterpret_cast<uint32_t&>(d[2])), "+r"(reinterpret_cast<uint32_t&>(d[3])), "+r"(reinterpret_cast<uint32_t&>(d[4])), "+r"(reinterpret_cast<uint32_t&>(d[5])), "+r"(reinterpret_cast<uint32_t&>(d[6])), "+r"(reinterpret_cast<uint32_t&>(d[7])), "+r"(reinterpret_cast<uint32_t&>(d[8])), "+r"(reinterpret_cast<uint32_t&>(d[9])), "+r"(reinterpret_cast<uint32_t&>(d[10])), "+r"(reinterpret_cast<uint32_t&>(d[11])), "+r"(reinterpret_cast<uint32_t&>(d[12])), "+r"(reinterpret_cast<uint32_t&>(d[13])), "+r"(reinterpret_cast<uint32_t&>(d[14])), "+r"(reinterpret_cast<uint32_t&>(d[15])), "+r"(reinterpret_cast<uint32_t&>(d[16])), "+r"(reinterpret_cast<uint32_t&>(d[17])), "+r"(reinterpret_cast<uint32_t&>(d[18])), "+r"(reinterpret_cast<uint32_t&>(d[19])), "+r"(reinterpret_cast<uint32_t&>(d[20])), "+r"(reinterpret_cast<uint32_t&>(d[21])), "+r"(reinterpret_cast<uint32_t&>(d[22])), "+r"(reinterpret_cast<uint32_t&>(d[23])), "+r"(reinterpret_cast<uint32_t&>(d[24])), "+r"(reinterpret_cast<uint32_t&>(d[25])), "+r"(reinterpret_cast<uint32_t&>(d[26])), "+r"(reinterpret_cast<uint32_t&>(d[27])), "+r"(reinterpret_cast<uint32_t&>(d[28])), "+r"(reinterpret_cast<uint32_t&>(d[29])), "+r"(reinterpret_cast<uint32_t&>(d[30])), "+r"(reinterpret_cast<uint32_t&>(d[31]))
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  }
  // s32 -> fp32 without the quarter-rate I2F (it bound the fold: int8 ran at
  // bf16 speed): exact for |x| <= 2^22, which holds for the <= 256-element
  // dot products of 8-bit rows this kernel takes.
  static __device__ __forceinline__ float value(float acc) {
    return __int_as_float(__float_as_int(acc) + 0x4B400000) - 12582912.f;
  }
};

// Pins accumulator registers in program order around wgmma issue / wait so
// that ordinary reads are not moved into a wgmma pipeline stage.
template <int N>
__device__ __forceinline__ void wg_fence_acc(float* acc) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Shared-memory matrix descriptor: K-major, 128B swizzle, 8-row groups 1024 B
// apart (tile base 1024-byte aligned; a k step inside the 128 B row advances
// the start address by 32 B).
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr) {
  uint64_t d = (uint64_t)((saddr & 0x3FFFFu) >> 4);
  d |= (uint64_t)1 << 16;
  d |= (uint64_t)(1024 >> 4) << 32;
  d |= (uint64_t)1 << 62;
  return d;
}
// wg_desc(saddr + bytes) from wg_desc(saddr): the address field holds bytes /
// 16 and shared addresses stay below its 2^18-byte range, so it never carries.
__device__ __forceinline__ uint64_t wg_desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ bool mbar_try(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try(bar, parity)) {
  }
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_1d(uint32_t dst, const CUtensorMap* map, int x, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2}], [%3];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void named_bar(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
#endif  // MAXSIM_WG_DEVICE

// Row r of the item's M tile: global query row to load (-1: zero) and
// whether the row counts (as build_row_table in common.cuh).
template <int BM>
__device__ __forceinline__ void wg_row(const FwdParams& p, const Work& w, int r, long long& src, bool& ok) {
  int k, i;
  tile_row(p, BM, w.mt, r, k, i);
  src = -1;
  ok = false;
  const int nslots = p.layout == kCrossL ? p.qpt : 1;
  if (k < nslots && i < p.lq) {
    int64_t n = slot_query(p, w, k);
    int qs, ql;
    if (slot_exists(p, n, k) && query_ok(p, n, qs, ql) && i < ql) {
      src = (long long)qs + i;
      ok = p.q_mask == nullptr || p.q_mask[src];
    }
  }
}

// State of query slot k of the item: 0 no such slot, 1 pair invalid (NaN), 2 valid.
__device__ __forceinline__ unsigned char wg_slot_state(const FwdParams& p, const Work& w, int k) {
  const int nslots = p.layout == kCrossL ? p.qpt : 1;
  if (k >= nslots) return 0;
  int64_t n = slot_query(p, w, k);
  if (!slot_exists(p, n, k)) return 0;
  int qs, ql;
  return (query_ok(p, n, qs, ql) && w.dvalid) ? 2 : 1;
}

// Slot k of the item: state (as wg_slot_state) and, when the query segment is
// valid, its first row / length (ql = -1 otherwise).
__device__ __forceinline__ void wg_slot_info(const FwdParams& p, const Work& w, int k, int& qs, int& ql,
                                             unsigned char& st) {
  qs = 0;
  ql = -1;
  st = 0;
  const int nslots = p.layout == kCrossL ? p.qpt : 1;
  if (k >= nslots) return;
  int64_t n = slot_query(p, w, k);
  if (!slot_exists(p, n, k)) return;
  int s0, l0;
  const bool qok = query_ok(p, n, s0, l0);
  if (qok) {
    qs = s0;
    ql = l0;
  }
  st = (qok && w.dvalid) ? 2 : 1;
}

// finish_tile (common.cuh) for one warp, with the slot states precomputed.
// MS: tiles of several queries (CROSS, qpt >= 2), their own instantiation.
template <int BM, bool ARG, int SC, bool MS>
__device__ __forceinline__ void wg_finish(const FwdParams& p, const Work& w, const float* rb, const int* ri,
                                          const unsigned char* row_ok, const unsigned char* slot_st, int lane,
                                          const long long* rsrc) {
  // Scaled variants: a query row's scale (> 0) commutes with its max.
  // kScDoc: a valid row's max came from a token of this document, so d_scale[ds] is in range.
  auto rowv = [&](int r) {
    if (SC == kScNone || rb[r] == neg_inf()) return rb[r];
    const float v = rb[r] * p.q_scale[rsrc[r]];
    return SC == kScDoc ? v * p.d_scale[w.ds] : v;
  };
  if (MS && p.row_mode <= 1) {
    // Slots in groups of four: their row sums and warp reductions interleave
    // instead of running one dependent chain (loads, five shuffles, a store)
    // per slot. One warp finishes every item of the CTA, and with a chain per
    // slot it set the pace of short items (the consumers waited on the next
    // query tile). Same
    // per-lane order and butterfly as the one-chain form below: the sums
    // are bitwise those of the other instantiations.
    const int nslots = p.layout == kCrossL ? p.qpt : 1;
    const int tt = p.tpq > 1 ? w.mt % p.tpq : 0;
    const int64_t n0 = slot_query(p, w, 0);  // CROSS: slot k holds query n0 + k
    for (int k0 = 0; k0 < nslots; k0 += 4) {
      float sum[4];
      int64_t pr[4];
      unsigned char st[4];
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        const int k = k0 + g;
        sum[g] = 0.f;
        st[g] = k < nslots ? slot_st[k] : 0;
        pr[g] = slot_pair(p, w, p.layout == kCrossL ? n0 + k : n0);
        if (st[g] == 0) continue;  // warp-uniform
        const bool ok = st[g] == 2;
        int i0, i1, rbase;
        slot_rows(p, BM, tt, k, i0, i1, rbase);
        for (int i = i0 + lane; i < i1; i += 32) {
          int r = rbase + i;
          bool use = ok && row_ok[r] && rb[r] != neg_inf();
          float v = use ? rowv(r) : 0.f;
          sum[g] += use ? v : 0.f;
          if (ARG) store_argmax(p, pr[g] * p.lq + i, use ? ri[r] : -1);
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int g = 0; g < 4; ++g) sum[g] += __shfl_xor_sync(0xffffffffu, sum[g], o);
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        if (lane != g || st[g] == 0) continue;
        store_pair_sum(p, pr[g], tt, st[g] == 2, sum[g]);
      }
    }
  } else if (p.row_mode <= 1) {
    const int nslots = p.layout == kCrossL ? p.qpt : 1;
    const int tt = w.mt % p.tpq;
    for (int k = 0; k < nslots; ++k) {
      const unsigned char st = slot_st[k];
      if (st == 0) continue;
      const bool ok = st == 2;
      const int64_t n = slot_query(p, w, k);
      const int64_t pr = slot_pair(p, w, n);
      int i0, i1, rbase;
      slot_rows(p, BM, tt, k, i0, i1, rbase);
      float sum = 0.f;
      for (int i = i0 + lane; i < i1; i += 32) {
        int r = rbase + i;
        bool use = ok && row_ok[r] && rb[r] != neg_inf();
        float v = use ? rowv(r) : 0.f;
        sum += use ? v : 0.f;
        if (ARG) store_argmax(p, pr * p.lq + i, use ? ri[r] : -1);
      }
      sum = warp_sum(sum);
      if (lane == 0) store_pair_sum(p, pr, tt, ok, sum);
    }
  } else {
    for (int r = lane; r < BM; r += 32) {
      if (!row_ok[r]) continue;
      int k, i;
      tile_row(p, BM, w.mt, r, k, i);
      int64_t n = slot_query(p, w, k);
      int64_t pr = slot_pair(p, w, n);
      store_row_partial<ARG>(p, w.s, pr, i, rowv(r), ri[r]);
    }
  }
}

#if MAXSIM_WG_DEVICE
// Folds one accumulator tile (NJ 8-column blocks valid) into the running row
// maxima of this thread (rows g and g + 8 of its warp; columns visited in
// increasing order). Out-of-range / masked columns become -inf. Without
// argmax: a max.NaN tree. With argmax: a sequential (max, argmax) update
// (measured faster than the tree followed by a search of tiles that beat the
// running max: in short items nearly every tile took the search).
template <typename T, int NJ, bool ARG, int SC>
__device__ __forceinline__ void wg_fold(const FwdParams& p, const Work& w, float* acc, int jt, float* best,
                                        int* bidx, const float* tile_scale) {
  const int lane = threadIdx.x & 31;
  if constexpr (SC == kScToken) {
    // Scaled tokens (int8, or normalize): fp32 product times the doc token's
    // scale (staged with the tile), before the max. A thread's columns come
    // in pairs: one 8-byte load per pair when the tile's scales start at an
    // even token. These loads share shared-memory bandwidth with the wgmma B
    // operand reads (int8 chains are short enough for the two to saturate it).
    const float* cs = tile_scale + 2 * (lane & 3);
    if ((reinterpret_cast<uintptr_t>(cs) & 7u) == 0) {
#pragma unroll
      for (int jn = 0; jn < NJ; ++jn) {
        const float2 c = *reinterpret_cast<const float2*>(cs + jn * 8);
        acc[4 * jn] = WgMma<T>::value(acc[4 * jn]) * c.x;
        acc[4 * jn + 1] = WgMma<T>::value(acc[4 * jn + 1]) * c.y;
        acc[4 * jn + 2] = WgMma<T>::value(acc[4 * jn + 2]) * c.x;
        acc[4 * jn + 3] = WgMma<T>::value(acc[4 * jn + 3]) * c.y;
      }
    } else {
#pragma unroll
      for (int jn = 0; jn < NJ; ++jn)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float c = cs[jn * 8 + e];
          acc[4 * jn + e] = WgMma<T>::value(acc[4 * jn + e]) * c;
          acc[4 * jn + 2 + e] = WgMma<T>::value(acc[4 * jn + 2 + e]) * c;
        }
    }
  }
  const int n0 = w.c0 + jt * kWgBN;
  const int colbase = n0 + 2 * (lane & 3);
  const bool has_mask = p.d_mask != nullptr;
  const bool fast = !has_mask && n0 + NJ * 8 <= w.c1;
  if (!fast) {
#pragma unroll
    for (int jn = 0; jn < NJ; ++jn)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = colbase + jn * 8 + e;
        bool valid = col < w.c1;
        if (valid && has_mask) valid = p.d_mask[(int64_t)w.ds + col];
        if (!valid) {
          acc[4 * jn + e] = neg_inf();
          acc[4 * jn + 2 + e] = neg_inf();
        }
      }
  }
  if constexpr (ARG) {
    // Sequential (max, argmax) update, columns in increasing order. The
    // winner is kept as its offset in the tile (an immediate per column);
    // masking inside this loop made the compiler build a per-column bit mask
    // and ~6 instructions per element.
    int off[2] = {-1, -1};
#pragma unroll
    for (int jn = 0; jn < NJ; ++jn)
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float m = max_nan(best[h], acc[4 * jn + 2 * h + e]);
          if (__float_as_int(m) != __float_as_int(best[h])) off[h] = jn * 8 + e;
          best[h] = m;
        }
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (off[h] >= 0) bidx[h] = colbase + off[h];
    return;
  }
  if constexpr (kWgIntMax<T, SC>) {
    // int8 with one scale per document: the raw s32 dot products compare as
    // integers, and a 3-input integer max (VIMNMX3 on sm_90) folds two
    // columns per instruction where the float tree takes one; -inf's bits
    // mean no column, and the row maxima become fp32 at the end of the item
    // (s32_max_value, common.cuh). Two chains per row for ILP.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int x0 = __float_as_int(best[h]), x1 = __float_as_int(neg_inf());
#pragma unroll
      for (int jn = 0; jn < NJ; ++jn) {
        int& x = jn & 1 ? x1 : x0;
        x = __vimax3_s32(x, __float_as_int(acc[4 * jn + 2 * h]), __float_as_int(acc[4 * jn + 2 * h + 1]));
      }
      best[h] = __int_as_float(max(x0, x1));
    }
    return;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float x = max_nan(max_nan(acc[2 * h], acc[2 * h + 1]), max_nan(acc[4 + 2 * h], acc[5 + 2 * h]));
#pragma unroll
    for (int jn = 2; jn < NJ; jn += 2)
      x = max_nan(x, max_nan(max_nan(acc[4 * jn + 2 * h], acc[4 * jn + 2 * h + 1]),
                             max_nan(acc[4 * jn + 4 + 2 * h], acc[4 * jn + 5 + 2 * h])));
    best[h] = max_nan(best[h], x);
  }
}

// One doc tile for a consumer warpgroup: wait for the stage, run the wgmma
// chain (dim / 16 k steps) into acc, retire it, free the stage (unless the
// doc chunk stays resident), fold. An idle warpgroup (none of its 64 query
// rows counts, e.g. in the last M tile of a query) only keeps the ring's pace.
template <typename T, int NKB, bool ARG, int SC>
__device__ __forceinline__ void wg_tile(const FwdParams& p, const Work& w, float* acc, float* acch,
                                        const uint32_t (*a)[4],
                                        int j, uint32_t g, uint32_t d_s, uint32_t bar_full, uint32_t bar_empty,
                                        float* best, int* bidx, bool release, const float* stage_scales, bool idle) {
  using C = WgCfg<NKB>;
  constexpr int NK16 = NKB * 4;
  const int s = (int)(g % C::STAGES);
  const float* tile_scale = stage_scales + s * kWgScaleStride + ((w.ds + w.c0 + j * kWgBN) & 3);
  mbar_wait(bar_full + 8u * s, (g / C::STAGES) & 1u);
  if (idle) {  // still waits for the stage: an early arrival would count in the wrong phase
    if (release && (threadIdx.x & 31) == 0) mbar_arrive(bar_empty + 8u * s);
    return;
  }
  const uint32_t sbase = d_s + (uint32_t)(s * C::STAGE_BYTES);
  const bool half = w.c1 - (w.c0 + j * kWgBN) <= 64;
  if (half) {
    // Last tile with <= 64 valid tokens: m64n64 into its own accumulators.
    wg_fence_acc<32>(acch);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < NK16; ++ks)
      WgMma<T>::n64(acch, a[ks], wg_desc(sbase + (uint32_t)((ks >> 2) * kWgBN * 128 + (ks & 3) * 32)), ks);
    wg_commit();
    wg_wait<0>();
    wg_fence_acc<32>(acch);
    if (release && (threadIdx.x & 31) == 0) mbar_arrive(bar_empty + 8u * s);
    wg_fold<T, 8, ARG, SC>(p, w, acch, j, best, bidx, tile_scale);
  } else {
    wg_fence_acc<64>(acc);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < NK16; ++ks)
      WgMma<T>::n128(acc, a[ks], wg_desc(sbase + (uint32_t)((ks >> 2) * kWgBN * 128 + (ks & 3) * 32)), ks);
    wg_commit();
    wg_wait<0>();
    wg_fence_acc<64>(acc);
    if (release && (threadIdx.x & 31) == 0) mbar_arrive(bar_empty + 8u * s);
    wg_fold<T, 16, ARG, SC>(p, w, acc, j, best, bidx, tile_scale);
  }
}
#endif  // MAXSIM_WG_DEVICE

template <typename T, int NKB, bool ARG, int SC, bool MS = false>
__global__ void __launch_bounds__(kWgThreads, 1)
    wg_fwd_kernel(const __grid_constant__ CUtensorMap tmap, const __grid_constant__ CUtensorMap smap,
                  const __grid_constant__ CUtensorMap qmap, const FwdParams p, int64_t item0, int64_t nitems,
                  int flags) {
#if MAXSIM_WG_DEVICE
  using C = WgCfg<NKB>;
  constexpr int BM = kWgBM, BN = kWgBN, ST = C::STAGES, NK16 = NKB * 4;
  constexpr int NR = 4;  // ring of per-item tables / results (loader -> consumers -> finisher)
  extern __shared__ unsigned char wg_smem[];
  __shared__ __align__(8) uint64_t bars[2 * ST + 2 + 2 * NR];
  __shared__ Work work_s[NR];
  __shared__ long long row_src[NR][BM];
  __shared__ unsigned char row_ok[NR][BM];
  __shared__ unsigned char slot_st[NR][BM];
  __shared__ int slot_qs[BM], slot_ql[BM];  // loader only (fast loader)
  __shared__ int q_dense[2];                 // loader only: per loader warp, its rows are Q rows base + r
  __shared__ float rbest[NR][BM];
  __shared__ int ridx[ARG ? NR : 1][BM];

  const uint32_t base = (smem_u32(wg_smem) + 1023u) & ~1023u;
  const uint32_t d_s = base;
  const uint32_t q_s = base + (uint32_t)(ST * C::STAGE_BYTES);
  static_assert(SC || !kIsQuant<T>, "int8 tokens carry scales");
  // Scaled variants: doc-token scales, one row per stage.
  const uint32_t sc_s = q_s + (uint32_t)C::Q_BYTES;
  const float* sc_g = reinterpret_cast<const float*>(wg_smem + (sc_s - smem_u32(wg_smem)));
  const uint32_t bar0 = smem_u32(bars);
  const uint32_t bar_full = bar0, bar_empty = bar0 + 8u * ST;  // [ST] each
  const uint32_t bar_qfull = bar0 + 16u * ST, bar_qempty = bar_qfull + 8u;
  const uint32_t bar_rfull = bar_qfull + 16u, bar_free = bar_rfull + 8u * NR;  // [NR] each

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  constexpr int kLoader = 64;  // warps 9, 10
  // Item schedule: strided (CTAs running together share documents: L2 reuse)
  // or contiguous ranges (consecutive items of one doc chunk: the chunk stays
  // resident in the stage ring when it fits, see below).
  int64_t i_lo, i_hi, i_step;
  if (flags & kWgContiguous) {
    i_lo = nitems * (int64_t)blockIdx.x / gridDim.x;
    i_hi = nitems * (int64_t)(blockIdx.x + 1) / gridDim.x;
    i_step = 1;
  } else {
    i_lo = blockIdx.x;
    i_hi = nitems;
    i_step = gridDim.x;
  }
  if (tid == 0) {
    for (int s = 0; s < ST; ++s) {
      mbar_init(bar_full + 8u * s, 1);
      mbar_init(bar_empty + 8u * s, 8);  // one arrival per consumer warp
    }
    mbar_init(bar_qfull, kLoader + 1);  // cp.async arrivals + one release of work_s
    mbar_init(bar_qempty, 8);
    for (int b = 0; b < NR; ++b) {
      mbar_init(bar_rfull + 8u * b, 256);
      mbar_init(bar_free + 8u * b, 32);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();
  pdl_wait();  // the barriers above are set up while the previous kernel finishes

  if (warp >= 8) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 104;\n" ::: "memory");
    if (warp == 8) {
      // ---- producer: doc tiles through TMA --------------------------------
      if (lane == 0) {
        uint32_t g = 0;
        WgChunk prev;
        for (int64_t li = i_lo; li < i_hi; li += i_step) {
          const Work w = decode_work<BN>(p, item0 + li);
          const int ntiles = (w.c1 - w.c0 + BN - 1) / BN;
          const int row0 = w.ds + w.c0;
          const bool resident = prev.same(w, ST);
          prev.set(w, ntiles);
          if (resident) continue;  // the consumers reuse the stages of the previous item
          for (int j = 0; j < ntiles; ++j, ++g) {
            const int s = (int)(g % ST);
            mbar_wait(bar_empty + 8u * s, ((g / ST) & 1u) ^ 1u);
            mbar_expect_tx(bar_full + 8u * s, (uint32_t)(C::STAGE_BYTES + (SC == kScToken ? kWgScaleBox * 4 : 0)));
#pragma unroll
            for (int kb = 0; kb < NKB; ++kb)
              tma_load_2d(d_s + (uint32_t)(s * C::STAGE_BYTES + kb * BN * 128), &tmap, kb * (128 / (int)sizeof(T)),
                          row0 + j * BN, bar_full + 8u * s);
            if (SC == kScToken) tma_load_1d(sc_s + (uint32_t)(s * kWgScaleStride * 4), &smap, (row0 + j * BN) & ~3, bar_full + 8u * s);
          }
        }
      }
    } else if (warp <= 10) {
      // ---- loader: work item, row table, slot states, query tile -----------
      const int lt = tid - 288;
      const bool fast_loader = (flags & kWgFastLoader) != 0;
      uint32_t it = 0;
      for (int64_t li = i_lo; li < i_hi; li += i_step, ++it) {
        const Work w = decode_work<BN>(p, item0 + li);
        const int b = (int)(it % NR);
        if (fast_loader) {
          // Slot-level loads only (one round trip, independent of decode's),
          // rows derived from the slot table in shared memory.
          int sqs[2], sql[2];
          unsigned char sst[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) wg_slot_info(p, w, lt + h * kLoader, sqs[h], sql[h], sst[h]);
          mbar_wait(bar_free + 8u * b, ((it / NR) & 1u) ^ 1u);  // finisher done with item it - NR
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            slot_st[b][lt + h * kLoader] = sst[h];
            slot_qs[lt + h * kLoader] = sqs[h];
            slot_ql[lt + h * kLoader] = sql[h];
          }
          if (lt == 0) work_s[b] = w;
          named_bar(1, kLoader);
          const int nslots = p.layout == kCrossL ? p.qpt : 1;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = lt + h * kLoader;
            int k, i;
            tile_row(p, BM, w.mt, r, k, i);
            long long src = -1;
            bool ok = false;
            if (k < nslots && i < p.lq && slot_st[b][k] != 0 && i < slot_ql[k]) {  // slot_ql < 0: bad query
              src = (long long)slot_qs[k] + i;
              ok = p.q_mask == nullptr || p.q_mask[src];
            }
            row_src[b][r] = src;
            row_ok[b][r] = ok;
          }
        } else {
          // Everything that needs global loads first, into registers.
          long long src0, src1;
          bool ok0, ok1;
          wg_row<BM>(p, w, lt, src0, ok0);
          wg_row<BM>(p, w, lt + kLoader, src1, ok1);
          const unsigned char st0 = wg_slot_state(p, w, lt), st1 = wg_slot_state(p, w, lt + kLoader);
          mbar_wait(bar_free + 8u * b, ((it / NR) & 1u) ^ 1u);  // finisher done with item it - NR
          row_src[b][lt] = src0;
          row_src[b][lt + kLoader] = src1;
          row_ok[b][lt] = ok0;
          row_ok[b][lt + kLoader] = ok1;
          slot_st[b][lt] = st0;
          slot_st[b][lt + kLoader] = st1;
          if (lt == 0) work_s[b] = w;
        }
        named_bar(1, kLoader);
        // A tile whose rows are consecutive Q rows (padded / uniform queries:
        // every row that counts is row base + r) comes in by one TMA per
        // 128-byte column block; rows that do not count may hold any data
        // (the finisher skips them; rows past Tq are zero-filled). Otherwise
        // the loader threads gather the rows with cp.async.
        const long long qb = row_src[b][0];
        {
          const long long s0 = row_src[b][lt], s1 = row_src[b][lt + kLoader];
          const bool ok = qb >= 0 && (s0 < 0 || s0 == qb + lt) && (s1 < 0 || s1 == qb + lt + kLoader);
          const bool wok = __all_sync(0xffffffffu, ok);
          if ((lt & 31) == 0) q_dense[lt >> 5] = wok;
        }
        named_bar(1, kLoader);
        const bool dense = q_dense[0] && q_dense[1];
        mbar_wait(bar_qempty, (it & 1u) ^ 1u);  // consumers hold item it - 1's query rows
        if (dense) {
          if (lt == 0) {
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // after earlier cp.async writes
            mbar_expect_tx(bar_qfull, (uint32_t)C::Q_BYTES);
#pragma unroll
            for (int kb = 0; kb < NKB; ++kb)
              tma_load_2d(q_s + (uint32_t)(kb * BM * 128), &qmap, kb * (128 / (int)sizeof(T)), (int)qb, bar_qfull);
          }
          mbar_arrive(bar_qfull);  // 64 arrivals + the expect_tx one: the barrier's count
          continue;
        }
        // Thread lt copies 16-byte chunk c = lt % 8 of rows lt / 8 + 8 j of each
        // 128-byte k block: the chunk's column, its swizzle (row % 8 is fixed)
        // and the smem stride are loop invariants. With the index arithmetic
        // per copy this loop was ~37 instructions per cp.async, and the loader
        // (not the tensor cores) set the pace of short items.
        static_assert(kLoader == 64 && BM % 8 == 0, "loader thread -> (row % 8, chunk) map");
        {
          const int c = lt & 7, r0 = lt >> 3;
          const uint32_t swz = (uint32_t)((c ^ r0) << 4);
          const uint32_t rb = (uint32_t)p.row_bytes;  // <= 256 on this path (wgmma_shape_ok); token rows < 2^31
          const char* const q0 = p.q;
#pragma unroll
          for (int kb = 0; kb < NKB; ++kb) {
            const uint32_t byte = (uint32_t)(kb * 128 + c * 16);
            const bool colok = byte < rb;
            const uint32_t dst = q_s + (uint32_t)(kb * BM * 128 + r0 * 128) + swz;
#pragma unroll
            for (int j = 0; j < BM / 8; ++j) {
              const int src = (int)row_src[b][r0 + 8 * j];
              const bool ok = colok && src >= 0;
              const uint64_t off = ok ? (uint64_t)(uint32_t)src * rb + byte : 0;  // row 0 byte 0 when nothing is read
              cp_async<16>(dst + (uint32_t)(j * 8 * 128), q0 + off, ok);
            }
          }
        }
        cp_async_mbar_arrive(bar_qfull);
        if (lt == 0) mbar_arrive(bar_qfull);
      }
    } else {
      // ---- finisher: per-item epilogue (scores / argmax / partials) ----------
      uint32_t it = 0;
      for (int64_t li = i_lo; li < i_hi; li += i_step, ++it) {
        const int b = (int)(it % NR);
        mbar_wait(bar_rfull + 8u * b, (it / NR) & 1u);
        const Work w = work_s[b];
        wg_finish<BM, ARG, SC, MS>(p, w, rbest[b], ridx[ARG ? b : 0], row_ok[b], slot_st[b], lane, row_src[b]);
        __syncwarp();
        mbar_arrive(bar_free + 8u * b);
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 200;\n" ::: "memory");
    // ---- consumers ------------------------------------------------------------
    const int wg = warp >> 2, wq = warp & 3;
    const int row_g = wg * 64 + wq * 16 + (lane >> 2);
    float acc[64], acch[32];
#pragma unroll
    for (int e = 0; e < 64; ++e) acc[e] = 0.f;
#pragma unroll
    for (int e = 0; e < 32; ++e) acch[e] = 0.f;
    uint32_t g = 0, it = 0, chunk_g = 0, held_base = 0;
    int held_n = 0;
    WgChunk prev;
    for (int64_t li = i_lo; li < i_hi; li += i_step, ++it) {
      const int b = (int)(it % NR);
      // Query rows -> A fragments (rows of this warp, all of dim).
      uint32_t a[NK16][4];
      mbar_wait(bar_qfull, it & 1u);
      const Work w = work_s[b];
      const int ntiles = (w.c1 - w.c0 + BN - 1) / BN;
      {
        const int r = wg * 64 + wq * 16 + (lane & 15);
        const int hi = lane >> 4;
#pragma unroll
        for (int ks = 0; ks < NK16; ++ks) {
          const int c = (ks & 3) * 2 + hi;
          ldsm_x4(a[ks][0], a[ks][1], a[ks][2], a[ks][3],
                  q_s + (uint32_t)((ks >> 2) * BM * 128 + r * 128 + ((c ^ (r & 7)) << 4)));
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(bar_qempty);
      // The row table is written before the query tile's barrier completes;
      // the group's four warps read the same 64 flags, so they agree.
      const bool idle = !__any_sync(0xffffffffu, row_ok[b][wg * 64 + lane] | row_ok[b][wg * 64 + 32 + lane]);

      float best[2] = {neg_inf(), neg_inf()};
      int bidx[2] = {-1, -1};
      // Doc chunk of <= ST tiles: keep its stages until an item needs another
      // chunk (the producer skips reloading it; full barriers stay complete).
      const bool resident = prev.same(w, ST);
      prev.set(w, ntiles);
      if (!resident) {
        if (lane == 0)
          for (int t = 0; t < held_n; ++t) mbar_arrive(bar_empty + 8u * ((held_base + (uint32_t)t) % ST));
        held_n = 0;
        chunk_g = g;
        g += (uint32_t)ntiles;
      }
      const bool hold = ntiles <= ST;
      for (int j = 0; j < ntiles; ++j)
        wg_tile<T, NKB, ARG, SC>(p, w, acc, acch, a, j, chunk_g + (uint32_t)j, d_s, bar_full, bar_empty, best, bidx,
                             !hold, sc_g, idle);
      if (hold && !resident) {
        held_base = chunk_g;
        held_n = ntiles;
      }
      if constexpr (kWgIntMax<T, SC>) {
#pragma unroll
        for (int h = 0; h < 2; ++h) best[h] = s32_max_value(best[h]);
      }
      // Merge the 4 lanes of a quad (same rows, different columns).
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
          float ob = __shfl_xor_sync(0xffffffffu, best[h], o);
          if (ARG) {
            int oi = __shfl_xor_sync(0xffffffffu, bidx[h], o);
            merge_arg(best[h], bidx[h], ob, oi);
          } else {
            best[h] = max_nan(best[h], ob);
          }
        }
      mbar_wait(bar_free + 8u * b, ((it / NR) & 1u) ^ 1u);  // finisher done with item it - NR
      if ((lane & 3) == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          rbest[b][row_g + 8 * h] = best[h];
          if (ARG) ridx[ARG ? b : 0][row_g + 8 * h] = bidx[h];
        }
      }
      mbar_arrive(bar_rfull + 8u * b);
    }
  }
#endif  // MAXSIM_WG_DEVICE
}

// ---------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------

// cuTensorMapEncodeTiled through the runtime's driver entry point (no -lcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 wg_encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q);
#else
    cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

template <typename T, int NKB, bool ARG, int SC, bool MS = false>
inline bool wg_kernel_ready() {
  static int state[kSmemOptInDevices] = {};
  return sm90a_kernel_ready(wg_fwd_kernel<T, NKB, ARG, SC, MS>, WgCfg<NKB>::SMEM, state);
}

// Launches the persistent kernel of the plan over work items [item0, item0 +
// nitems) with the planner's schedule flags. p is set up for BM = kWgBM,
// BN = kWgBN (qpt, tpq, mt_total, S, row_mode, workspaces), exactly as for
// the other kernels. SC: per-token scales in p.q_scale / p.d_scale (8-bit
// tokens; 16-bit tokens under normalize, with the documents' inverse norms
// from a pre-pass); the plan's scale 2 runs kScDoc (8-bit tokens, one scale
// per document, applied to the row maxima).
template <typename T, int SC>
inline void launch_wgmma(const plan::WgmmaPlan& w, bool arg, const FwdParams& p, int64_t dim, int64_t item0,
                         int64_t nitems, int flags, int num_sms, cudaStream_t stream) {
  if (nitems <= 0) return;
  constexpr bool q8 = kIsQuant<T>;
  CUtensorMap map, smap;
  cuuint64_t gdim[2] = {(cuuint64_t)dim, (cuuint64_t)p.Td};
  cuuint64_t gstride[1] = {(cuuint64_t)p.row_bytes};
  cuuint32_t box[2] = {(cuuint32_t)(128 / sizeof(T)), (cuuint32_t)kWgBN};  // 128-byte column blocks
  cuuint32_t estride[2] = {1, 1};
  const CUtensorMapDataType dt = q8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                 : std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                  : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  MAXSIM_CHECK(wg_encode_fn() != nullptr, "maxsim: cuTensorMapEncodeTiled unavailable");
  CUresult r = wg_encode_fn()(&map, dt, 2, const_cast<char*>(p.d), gdim, gstride, box, estride,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MAXSIM_CHECK(r == CUDA_SUCCESS, "maxsim: cuTensorMapEncodeTiled failed (%d)", (int)r);
  CUtensorMap qmap;  // query tiles of consecutive rows (the loader's TMA path)
  {
    cuuint64_t qdim[2] = {(cuuint64_t)dim, (cuuint64_t)std::max<int64_t>(p.Tq, 1)};
    cuuint32_t qbox[2] = {(cuuint32_t)(128 / sizeof(T)), (cuuint32_t)kWgBM};
    r = wg_encode_fn()(&qmap, dt, 2, const_cast<char*>(p.q), qdim, gstride, qbox, estride,
                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    MAXSIM_CHECK(r == CUDA_SUCCESS, "maxsim: cuTensorMapEncodeTiled (queries) failed (%d)", (int)r);
  }
  smap = map;  // unused by unscaled kernels
  if (SC != kScNone) {  // doc-token scales, one BN-row box per stage (rows past Td read as 0)
    cuuint64_t sdim[1] = {(cuuint64_t)p.Td};
    cuuint64_t sgstride[1] = {(cuuint64_t)p.Td * 4};  // rank 1 reads none; never passed as null
    cuuint32_t sbox[1] = {(cuuint32_t)kWgScaleBox};
    cuuint32_t sstride[1] = {1};
    r = wg_encode_fn()(&smap, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 1, const_cast<float*>(p.d_scale), sdim, sgstride, sbox,
                       sstride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                       CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    MAXSIM_CHECK(r == CUDA_SUCCESS, "maxsim: cuTensorMapEncodeTiled (scales) failed (%d)", (int)r);
  }
  const unsigned grid = (unsigned)std::min<int64_t>(nitems, std::max(1, num_sms));
  // The kernel instance: prepared (shared memory opted in, sm_90a body
  // present), then launched.
  const auto go = [&](auto ready, auto kern, int smem) {
    TORCH_CHECK(ready, "maxsim: wgmma kernel unavailable");
    launch_pdl(kern, dim3(grid), dim3(kWgThreads), (size_t)smem, stream, map, smap, qmap, p, item0, nitems, flags);
  };
  const auto go_n = [&](auto n) {
    constexpr int N = decltype(n)::value;
    if constexpr (SC == kScNone && !q8) {  // tiles of several queries: their own instantiation
      if (w.multi) {
        if (arg)
          go(wg_kernel_ready<T, N, true, SC, true>(), wg_fwd_kernel<T, N, true, SC, true>, WgCfg<N>::SMEM);
        else
          go(wg_kernel_ready<T, N, false, SC, true>(), wg_fwd_kernel<T, N, false, SC, true>, WgCfg<N>::SMEM);
        return;
      }
    }
    if (arg)
      go(wg_kernel_ready<T, N, true, SC>(), wg_fwd_kernel<T, N, true, SC>, WgCfg<N>::SMEM);
    else
      go(wg_kernel_ready<T, N, false, SC>(), wg_fwd_kernel<T, N, false, SC>, WgCfg<N>::SMEM);
  };
  if constexpr (q8) {  // one scale per document: scores only, rows of <= 128 bytes
    if (w.scale == 2) {
      MAXSIM_CHECK(!arg && w.nkb == 1, "maxsim: wgmma: per-document scales take scores of rows <= 128 bytes");
      go(wg_kernel_ready<T, 1, false, kScDoc>(), wg_fwd_kernel<T, 1, false, kScDoc>, WgCfg<1>::SMEM);
      return;
    }
  }
  if constexpr (std::is_same<T, __nv_fp8_e4m3>::value) {  // fp8: scores only, rows of <= 128 products
    MAXSIM_CHECK(!arg && w.nkb == 1, "maxsim: wgmma: fp8 tokens take scores of rows <= 128 bytes");
    go(wg_kernel_ready<T, 1, false, SC>(), wg_fwd_kernel<T, 1, false, SC>, WgCfg<1>::SMEM);
  } else if (w.nkb == 1) {
    go_n(std::integral_constant<int, 1>{});
  } else {
    go_n(std::integral_constant<int, 2>{});
  }
}

// Per-dtype entry points (defined in forward_wgmma_<dtype>.cu so the kernels
// are compiled once; the scaled 16-bit kernels of normalize in
// forward_wgmma_<dtype>_normalize.cu).
template <typename T>
void run_wgmma(const plan::WgmmaPlan& w, bool arg, const FwdParams& p, int64_t dim, int64_t item0, int64_t nitems,
               int flags, int num_sms, cudaStream_t stream);
template <typename T>
void run_wgmma_scaled(const plan::WgmmaPlan& w, bool arg, const FwdParams& p, int64_t dim, int64_t item0,
                      int64_t nitems, int flags, int num_sms, cudaStream_t stream);
// Whether the sm_90a kernels are in this build (on an sm_90 device).
bool wgmma_built();

#define MAXSIM_DEFINE_WGMMA_RUNNERS_(NAME, T, SC)                                                                \
  template <>                                                                                                    \
  void NAME<T>(const plan::WgmmaPlan& w, bool arg, const FwdParams& p, int64_t dim, int64_t item0,               \
               int64_t nitems, int flags, int num_sms, cudaStream_t stream) {                                    \
    launch_wgmma<T, SC>(w, arg, p, dim, item0, nitems, flags, num_sms, stream);                                  \
  }
#define MAXSIM_DEFINE_WGMMA_RUNNERS(T) MAXSIM_DEFINE_WGMMA_RUNNERS_(run_wgmma, T, (kIsQuant<T> ? kScToken : kScNone))
#define MAXSIM_DEFINE_WGMMA_SCALED_RUNNERS(T) MAXSIM_DEFINE_WGMMA_RUNNERS_(run_wgmma_scaled, T, kScToken)

}  // namespace cuda_fwd
}  // namespace maxsim
