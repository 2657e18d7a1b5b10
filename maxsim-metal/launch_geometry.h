// Launch geometry of the Metal backend, shared verbatim by three compilers:
//   * the Metal shader compiler (maxsim.metal includes this file),
//   * the Objective-C++ host glue (maxsim.mm, through host_driver.h),
//   * the C++ emulator (emu/), which runs the very same shaders on the CPU.
// Buffer indices, tile sizes, parameter structs and the threadgroup-memory
// layout are defined here once, so the shaders, the real dispatch and the
// emulated dispatch cannot drift apart.
//
// The first part is written in the common subset of C++17 and the Metal
// Shading Language (no std headers, no address-space qualifiers, only by-value
// functions, `int`/`long` which are 32/64-bit in both). The host-only part
// (grid and parameter planning) is hidden from the Metal compiler.
#ifndef MAXSIM_METAL_LAUNCH_GEOMETRY_H
#define MAXSIM_METAL_LAUNCH_GEOMETRY_H

// ---------------------------------------------------------------------------
// Buffer indices ([[buffer(n)]]). Plain macros: they must expand to integer
// literals inside the attribute.
// ---------------------------------------------------------------------------
// forward kernels
#define MS_BUF_Q 0
#define MS_BUF_D 1
#define MS_BUF_Q_START 2
#define MS_BUF_Q_LEN 3
#define MS_BUF_D_START 4
#define MS_BUF_D_LEN 5
#define MS_BUF_Q_MASK 6
#define MS_BUF_D_MASK 7
#define MS_BUF_PAIR_Q 8
#define MS_BUF_PAIR_D 9
#define MS_BUF_SCORES 10
#define MS_BUF_ARGMAX 11
#define MS_BUF_FWD_PARAMS 12
// backward kernels (dq reads d rows, dd reads q rows: MS_BUF_SRC)
#define MS_BUF_GRAD 0
#define MS_BUF_SRC 1
#define MS_BUF_BQ_START 2
#define MS_BUF_BQ_LEN 3
#define MS_BUF_BD_START 4
#define MS_BUF_BD_LEN 5
#define MS_BUF_BPAIR_Q 6
#define MS_BUF_BPAIR_D 7
#define MS_BUF_BARGMAX 8
#define MS_BUF_CSR_PTR 9
#define MS_BUF_CSR_PAIRS 10
#define MS_BUF_OUT 11
#define MS_BUF_BWD_PARAMS 12
// the one threadgroup-memory argument ([[threadgroup(0)]]) of every kernel
#define MS_TGMEM_INDEX 0

// ---------------------------------------------------------------------------
// Tile geometry.
// ---------------------------------------------------------------------------
enum MsGeometry {
  MS_NT = 128,               // threads per threadgroup, every kernel
  MS_SIMD = 32,              // SIMD-group width the kernels are written for
  MS_NSG = MS_NT / MS_SIMD,  // SIMD groups per threadgroup (4)

  // forward: an M tile of MS_BM query rows meets a tile of MS_BN document
  // tokens, the embedding dim streamed in chunks of MS_BK.
  MS_BM = 32,
  MS_BN = 32,
  MS_BK = 32,
  MS_PAD = 4,                // row padding (floats) of the threadgroup tiles
  MS_DS_LD = MS_BK + MS_PAD, // row stride of the document chunk
  MS_S_LD = MS_BN + MS_PAD,  // row stride of the similarity tile (matrix path)
  MS_QRES_MAX = 128,         // dim (padded to 8) up to which the query tile stays resident
  // matrix path: SIMD groups in a 2 x 2 grid, each owns 16 x 16 = 2 x 2
  // simdgroup_float8x8 accumulators.
  MS_SGM = 2,
  MS_SGN = 2,
  MS_FM = MS_BM / MS_SGM / 8,
  MS_FN = MS_BN / MS_SGN / 8,
  // fold: MS_TPR adjacent lanes own one query row, each MS_CPT columns
  // (column = lane_in_row + MS_TPR * e) and a running (max, argmax).
  MS_TPR = MS_NT / MS_BM,
  MS_CPT = MS_BN / MS_TPR,

  // backward
  MS_BWD_DC = 128,                   // dim columns per pass (32 lanes x 4)
  MS_BWD_VPL = MS_BWD_DC / MS_SIMD,  // values per lane per pass
  MS_BWD_ROWS = 8,                   // document rows owned by one SIMD group (dd)
  MS_DD_TG_ROWS = MS_BWD_ROWS * MS_NSG,

  // layouts / argmax kinds / dtypes (torch_binding.h)
  MS_CROSS = 0,
  MS_GROUPED = 1,
  MS_LIST = 2,
  MS_ARGMAX_NONE = 0,
  MS_ARGMAX_I32 = 1,
  MS_ARGMAX_I16 = 2,
  MS_F32 = 0,
  MS_F16 = 1,
  MS_BF16 = 2,

  MS_GRID_X_MAX = 32768,  // threadgroups per grid row; longer grids use y
};

// Forward parameters ([[buffer(MS_BUF_FWD_PARAMS)]], setBytes). 64-bit fields
// first so that C++ and MSL lay the struct out identically.
struct MsFwdParams {
  long Tq, Td, Nq, Nd, P, K;  // K: documents per query (GROUPED), >= 1
  long units;                 // threadgroups doing work (one per work unit)
  long nblk;                  // CROSS: query blocks (qpt queries each)
  int dim, dim_pad, lq, layout;
  int argmax_kind, has_qmask, has_dmask, qpt;  // qpt: queries stacked in an M tile
  int q_resident, qld, grid_x, mma;            // qld: row stride of the query tile
  // threadgroup-memory layout, byte offsets
  int off_qs, off_ds, off_s, off_colok;
  int off_rowsrc, off_rowval, smem_bytes, pad0;
};

// Backward parameters (dq and dd kernels each get their own copy).
struct MsBwdParams {
  long Tq, Td, Nq, Nd, P, K;
  long units;
  int dim, lq, layout, argmax_kind;
  int rblocks;  // dq: row blocks of MS_NSG rows per query
  int dsplit;   // dd: threadgroups per document
  int grid_x, smem_bytes;
};

inline int ms_align16(int bytes) { return (bytes + 15) / 16 * 16; }

// Row stride of the forward query tile.
inline int ms_fwd_qld(int q_resident, int dim_pad) {
  return (q_resident != 0 ? dim_pad : (int)MS_BK) + (int)MS_PAD;
}

// ---------------------------------------------------------------------------
// Host-side planning (C++ only).
// ---------------------------------------------------------------------------
#if !defined(__METAL_VERSION__)

static_assert(sizeof(long) == 8, "the Metal parameter structs need a 64-bit long");
static_assert(sizeof(MsFwdParams) == 8 * 8 + 20 * 4, "MsFwdParams layout");
static_assert(sizeof(MsBwdParams) == 7 * 8 + 8 * 4, "MsBwdParams layout");

struct MsLaunch {
  long grid_x, grid_y;  // threadgroups (dispatchThreadgroups)
  long threads;         // threads per threadgroup (x only)
  long smem_bytes;      // setThreadgroupMemoryLength:atIndex:MS_TGMEM_INDEX
};

inline long ms_ceil_div(long a, long b) { return b > 0 ? (a + b - 1) / b : 0; }

// Grid for `units` threadgroups: a row of up to MS_GRID_X_MAX, as many rows as
// needed. Threadgroup (x, y) does unit y * grid_x + x (or nothing past units).
inline MsLaunch ms_grid(long units, int smem_bytes) {
  MsLaunch l;
  l.grid_x = units < (long)MS_GRID_X_MAX ? (units > 0 ? units : 1) : (long)MS_GRID_X_MAX;
  l.grid_y = units > 0 ? ms_ceil_div(units, l.grid_x) : 1;
  l.threads = MS_NT;
  l.smem_bytes = smem_bytes;
  return l;
}

inline MsFwdParams ms_fwd_params(long Tq, long Td, long Nq, long Nd, long P, int dim, int lq,
                                 int layout, int argmax_kind, bool has_qmask, bool has_dmask,
                                 bool mma) {
  MsFwdParams p = {};
  p.Tq = Tq, p.Td = Td, p.Nq = Nq, p.Nd = Nd, p.P = P;
  p.K = (layout == MS_GROUPED && Nq > 0) ? (Nd / Nq > 0 ? Nd / Nq : 1) : 1;
  p.dim = dim;
  p.dim_pad = (dim + 7) / 8 * 8;
  p.lq = lq, p.layout = layout, p.argmax_kind = argmax_kind;
  p.has_qmask = has_qmask ? 1 : 0, p.has_dmask = has_dmask ? 1 : 0;
  // CROSS: short queries share an M tile (rows of query s at s*lq ...).
  p.qpt = 1;
  if (layout == MS_CROSS && lq > 0 && lq <= MS_BM / 2) {
    long q = MS_BM / lq;
    p.qpt = (int)(q < Nq ? q : (Nq > 0 ? Nq : 1));
  }
  if (layout == MS_CROSS) {
    p.nblk = ms_ceil_div(Nq, p.qpt);
    p.units = p.nblk * Nd;
  } else {
    p.nblk = 0;
    p.units = P;
  }
  p.q_resident = p.dim_pad <= MS_QRES_MAX ? 1 : 0;
  p.qld = ms_fwd_qld(p.q_resident, p.dim_pad);
  p.mma = mma ? 1 : 0;
  int off = 0;
  p.off_qs = off;
  off += ms_align16(4 * MS_BM * p.qld);
  p.off_ds = off;
  off += ms_align16(4 * MS_BN * MS_DS_LD);
  p.off_s = off;
  off += mma ? ms_align16(4 * MS_BM * MS_S_LD) : 0;
  p.off_colok = off;
  off += ms_align16(4 * MS_BN);
  p.off_rowsrc = off;
  off += ms_align16(4 * MS_BM);
  p.off_rowval = off;
  off += ms_align16(4 * MS_BM);
  p.smem_bytes = off;
  p.grid_x = (int)ms_grid(p.units, p.smem_bytes).grid_x;
  return p;
}

inline MsLaunch ms_fwd_launch(const MsFwdParams& p) { return ms_grid(p.units, p.smem_bytes); }

inline MsBwdParams ms_bwd_base(long Tq, long Td, long Nq, long Nd, long P, int dim, int lq,
                               int layout, int argmax_kind) {
  MsBwdParams p = {};
  p.Tq = Tq, p.Td = Td, p.Nq = Nq, p.Nd = Nd, p.P = P;
  p.K = (layout == MS_GROUPED && Nq > 0) ? (Nd / Nq > 0 ? Nd / Nq : 1) : 1;
  p.dim = dim, p.lq = lq, p.layout = layout, p.argmax_kind = argmax_kind;
  return p;
}

// dq: one SIMD group per query row, MS_NSG rows of one query per threadgroup.
inline MsBwdParams ms_bwd_dq_params(MsBwdParams p) {
  p.rblocks = (int)ms_ceil_div(p.lq, MS_NSG);
  p.dsplit = 1;
  p.units = p.Nq * p.rblocks;
  p.smem_bytes = 0;  // no threadgroup memory
  p.grid_x = (int)ms_grid(p.units, p.smem_bytes).grid_x;
  return p;
}

// dd: dsplit threadgroups per document; SIMD group g of split s owns the row
// blocks b = s * MS_NSG + g + k * dsplit * MS_NSG (MS_BWD_ROWS rows each).
inline MsBwdParams ms_bwd_dd_params(MsBwdParams p) {
  p.rblocks = 1;
  const long avg = p.Nd > 0 ? ms_ceil_div(p.Td, p.Nd) : 0;
  long want = p.Nd > 0 ? ms_ceil_div(1024, p.Nd) : 1;    // aim at ~1k threadgroups
  long most = ms_ceil_div(avg, MS_DD_TG_ROWS);          // no split beyond the rows
  if (want > most) want = most;
  if (want < 1) want = 1;
  if (want > 4096) want = 4096;
  p.dsplit = (int)want;
  p.units = p.Nd * p.dsplit;
  p.smem_bytes = ms_align16(4 * MS_NSG * MS_BWD_ROWS * MS_BWD_DC);
  p.grid_x = (int)ms_grid(p.units, p.smem_bytes).grid_x;
  return p;
}

inline MsLaunch ms_bwd_launch(const MsBwdParams& p) { return ms_grid(p.units, p.smem_bytes); }

// Kernel (Metal function) names, as the shader defines them.
inline const char* ms_fwd_kernel_name(bool mma, int dtype) {
  static const char* const names[2][3] = {
      {"maxsim_fwd_simt_f32", "maxsim_fwd_simt_f16", "maxsim_fwd_simt_bf16"},
      {"maxsim_fwd_mma_f32", "maxsim_fwd_mma_f16", "maxsim_fwd_mma_bf16"}};
  return names[mma ? 1 : 0][dtype];
}
inline const char* ms_bwd_dq_kernel_name(int dtype) {
  static const char* const names[3] = {"maxsim_bwd_dq_f32", "maxsim_bwd_dq_f16",
                                       "maxsim_bwd_dq_bf16"};
  return names[dtype];
}
inline const char* ms_bwd_dd_kernel_name(int dtype) {
  static const char* const names[3] = {"maxsim_bwd_dd_f32", "maxsim_bwd_dd_f16",
                                       "maxsim_bwd_dd_bf16"};
  return names[dtype];
}

#endif  // !__METAL_VERSION__

#endif  // MAXSIM_METAL_LAUNCH_GEOMETRY_H
