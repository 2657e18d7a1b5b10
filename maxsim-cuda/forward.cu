// maxsim::forward_cuda: host dispatch of the forward kernels.
//
// Paths:
//   * fp16 / bf16 (and fp32 with tf32=True): tensor-core kernel
//     (forward_mma.cuh), one of a few tile configurations chosen from lq, the
//     layout and the number of queries (see choose_mma_cfg);
//   * int8 / fp8 e4m3 tokens with per-token scales (forward_quant): the same
//     tensor-core kernel on m16n8k32 (fp8 needs sm_89+); int8, and fp8 rows
//     of <= 128 bytes, with >= 128 query rows per tile on sm_90a: the wgmma
//     kernel (k32 steps; fp8 accumulation there: see forward_wgmma.cuh);
//   * fp16 / bf16 or 8-bit tokens, one query of lq <= 32 against many
//     documents of a few thousand tokens at most, no argmax (reranking,
//     corpus scans and searches: memory bound): the register-streaming kernel
//     (forward_stream.cuh), one warp per document, no shared memory;
//   * fp32 (exact, default) and whatever the tensor-core kernel cannot take
//     (odd dim in 16-bit types, rows not 4-byte aligned, a query tile too wide
//     for shared memory): the FFMA kernel (forward_simt.cuh).
// One CTA per (M tile, doc chunk, doc or pair). When a query spans several M
// tiles (lq > BM) or docs are split into chunks for parallelism, CTAs write
// partials to a workspace and finalize_partial_kernel / finalize_rows_kernel
// merge and sum them in a fixed order (deterministic; no atomics). No host synchronisation: the
// longest document is unknown on the host, so splits are sized from the mean
// document length and every CTA derives its token range from d_len on device.
//
// normalize: inverse row norms go in as per-token scales, applied like 8-bit
// token scales (doc token before the max, query row after it): the query's
// from a small pre-pass (normalize_rows.cuh), the documents' computed by the
// tensor-core kernel from its own B fragments (documents read once); the
// SIMT kernel takes both from pre-passes and scales rows as it converts
// them; the wgmma kernel stages the documents' pre-pass norms with each
// tile (as 8-bit token scales). No normalised copy is written.
//
// Hook for other kernels (e.g. a wgmma path for large lq on sm_90): plug in at
// the "path selection" block of forward_cuda; FwdParams carries everything
// the work decomposition and the finalize kernels need.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "forward_mma.cuh"
#include "forward_simt.cuh"
#include "forward_stream.cuh"
#include "forward_stream_wg.cuh"
#include "forward_wgmma.cuh"
#include "fwd_params.h"
#include "normalize_rows.cuh"
#include "torch_binding.h"

namespace maxsim {
namespace cuda_fwd {

// Developer hook (benchmark harness only): force a tensor-core configuration
// (0..kNumMmaCfgs-1), -2 forces the SIMT kernel, -3 the streaming kernel for
// any layout it can take, -4 the sm_90a wgmma kernel wherever it can take the
// shape, however few query rows fill its 128-row tile, -1 = heuristic. Also a
// forced doc split count (0 = heuristic).
static int g_forced_cfg = -1;
static int g_forced_splits = 0;
static int g_forced_dpc = 0;  // docs per CTA of the MMA kernel (0 = heuristic)
void set_forced_config(int cfg, int splits) {
  g_forced_cfg = cfg;
  g_forced_splits = splits;
}
void set_forced_dpc(int dpc) { g_forced_dpc = dpc; }
static int g_stream_split = 0;  // streaming kernel warps per pair (0 = heuristic)
static int g_stream_il = -1;    // interleaved lanes (-1 = heuristic)
static int g_stream_qsm = -1;   // query staged in shared memory (-1 = heuristic)
void set_stream_mode(int split, int il, int qsm) {
  g_stream_split = split;
  g_stream_il = il;
  g_stream_qsm = qsm;
}
static int g_stream_keep = -1;  // plain (L2-keeping) document loads: 1 all CTAs, k > 1 the first k, 0 none, -1 heuristic
void set_stream_keep(int keep) { g_stream_keep = keep; }
static int64_t g_stream_tail = -1;  // streaming kernel tail pairs split over 4 warps (-1 = heuristic)
void set_stream_tail(int64_t pairs) { g_stream_tail = pairs; }
static int g_stream_spec = 3;  // guessed starts: bit 0 documents, bit 1 queries
void set_stream_spec(int on) { g_stream_spec = on; }
static int g_stream_wg = -1;  // staged wgmma stream kernel: its document stages (3-5), 0 off, -1 heuristic
void set_stream_wg(int nst) { g_stream_wg = nst; }
// The staged wgmma stream for queries of 33-128 rows (one query or per-query
// candidates): this many stages (3-5), 0 off (the tile kernels), -1 the
// launcher's rule.
static int g_stream_wg_long = -1;
void set_stream_wg_long(int nst) { g_stream_wg_long = nst; }

namespace {

__device__ __forceinline__ bool pair_ok(const FwdParams& p, int64_t pr, int& qs, int& ql) {
  int64_t n, dn;
  pair_ids(p, pr, n, dn);
  int ds, dl;
  bool ok = query_ok(p, n, qs, ql);
  return doc_ok(p, dn, ds, dl) && ok;
}

// row_mode 1: score = sum of the tpq tile partials, in tile order.
__global__ void __launch_bounds__(256) finalize_partial_kernel(FwdParams p) {
  pdl_enter();
  int64_t pr = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (pr >= p.P) return;
  int qs, ql;
  bool ok = pair_ok(p, pr, qs, ql);
  float sum = 0.f;
  for (int t = 0; t < p.tpq; ++t) sum += p.ws_best[(int64_t)t * p.P + pr];
  p.scores[pr] = ok ? sum : __int_as_float(0x7fc00000);
}

// row_mode 2: one warp per pair merges the S split partials of each row (in
// split order), sums the rows in a fixed order, writes score and argmax.
// With S == 0 it only writes 0 / NaN scores and -1 argmax (lq == 0).
template <bool ARG>
__global__ void __launch_bounds__(256) finalize_rows_kernel(FwdParams p) {
  pdl_enter();
  int64_t pr = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (pr >= p.P) return;
  int qs, ql;
  bool ok = pair_ok(p, pr, qs, ql);
  float sum = 0.f;
  for (int i = lane; i < p.lq; i += 32) {
    int out = -1;
    if (ok && i < ql && (p.q_mask == nullptr || p.q_mask[(int64_t)qs + i])) {
      float b = neg_inf();
      int ix = -1;
      for (int s = 0; s < p.S; ++s) {
        int64_t o = ((int64_t)s * p.P + pr) * p.lq + i;
        float v = p.ws_best[o];
        if (ARG)
          merge_arg(b, ix, v, p.ws_idx[o]);
        else
          b = max_nan(b, v);
      }
      if (b != neg_inf()) {
        sum += b;
        out = ix;
      }
    }
    if (ARG) store_argmax(p, pr * p.lq + i, out);
  }
  sum = warp_sum(sum);
  if (lane == 0) p.scores[pr] = ok ? sum : __int_as_float(0x7fc00000);
}

void run_mma_any(at::ScalarType t, int cfg, bool arg, const FwdParams& p, int64_t item0, int64_t n, size_t smem,
                 cudaStream_t st, bool scaled) {
  if (scaled) {  // float tokens under normalize
    if (t == at::kHalf)
      run_mma_scaled<__half>(cfg, arg, p, item0, n, smem, st);
    else if (t == at::kBFloat16)
      run_mma_scaled<__nv_bfloat16>(cfg, arg, p, item0, n, smem, st);
    else
      run_mma_scaled<float>(cfg, arg, p, item0, n, smem, st);
    return;
  }
  if (t == at::kHalf)
    run_mma<__half>(cfg, arg, p, item0, n, smem, st);
  else if (t == at::kChar)
    run_mma<int8_t>(cfg, arg, p, item0, n, smem, st);
  else if (t == at::kFloat8_e4m3fn)
    run_mma<__nv_fp8_e4m3>(cfg, arg, p, item0, n, smem, st);
  else if (t == at::kBFloat16)
    run_mma<__nv_bfloat16>(cfg, arg, p, item0, n, smem, st);
  else
    run_mma<float>(cfg, arg, p, item0, n, smem, st);
}

bool wgmma_ready_any(at::ScalarType t, int64_t dim, bool arg, bool scaled) {
  if (scaled) {  // 16-bit tokens under normalize
    if (t == at::kHalf) return run_wgmma_scaled_available<__half>(dim, arg);
    if (t == at::kBFloat16) return run_wgmma_scaled_available<__nv_bfloat16>(dim, arg);
    return false;
  }
  if (t == at::kHalf) return run_wgmma_available<__half>(dim, arg);
  if (t == at::kBFloat16) return run_wgmma_available<__nv_bfloat16>(dim, arg);
  if (t == at::kChar) return run_wgmma_available<int8_t>(dim, arg);
  if (t == at::kFloat8_e4m3fn) return run_wgmma_available<__nv_fp8_e4m3>(dim, arg);
  return false;
}

void run_wgmma_any(at::ScalarType t, bool arg, const FwdParams& p, int64_t dim, int64_t item0, int64_t n,
                   int num_sms, cudaStream_t st, bool scaled) {
  if (scaled) {
    if (t == at::kHalf)
      run_wgmma_scaled<__half>(arg, p, dim, item0, n, num_sms, st);
    else
      run_wgmma_scaled<__nv_bfloat16>(arg, p, dim, item0, n, num_sms, st);
    return;
  }
  if (t == at::kHalf)
    run_wgmma<__half>(arg, p, dim, item0, n, num_sms, st);
  else if (t == at::kChar)
    run_wgmma<int8_t>(arg, p, dim, item0, n, num_sms, st);
  else if (t == at::kFloat8_e4m3fn)
    run_wgmma<__nv_fp8_e4m3>(arg, p, dim, item0, n, num_sms, st);
  else
    run_wgmma<__nv_bfloat16>(arg, p, dim, item0, n, num_sms, st);
}

int occupancy_mma_any(at::ScalarType t, int cfg, bool arg, size_t smem, bool scaled) {
  if (scaled) {
    if (t == at::kHalf) return occupancy_mma_scaled<__half>(cfg, arg, smem);
    if (t == at::kBFloat16) return occupancy_mma_scaled<__nv_bfloat16>(cfg, arg, smem);
    return occupancy_mma_scaled<float>(cfg, arg, smem);
  }
  if (t == at::kHalf) return occupancy_mma<__half>(cfg, arg, smem);
  if (t == at::kBFloat16) return occupancy_mma<__nv_bfloat16>(cfg, arg, smem);
  if (t == at::kChar) return occupancy_mma<int8_t>(cfg, arg, smem);
  if (t == at::kFloat8_e4m3fn) return occupancy_mma<__nv_fp8_e4m3>(cfg, arg, smem);
  return occupancy_mma<float>(cfg, arg, smem);
}

void run_stream_any(at::ScalarType t, const FwdParams& p, int64_t mean_ld, int num_sms, cudaStream_t st) {
  if (t == at::kHalf)
    run_stream<__half>(p, mean_ld, num_sms, st);
  else if (t == at::kBFloat16)
    run_stream<__nv_bfloat16>(p, mean_ld, num_sms, st);
  else if (t == at::kChar)
    run_stream<int8_t>(p, mean_ld, num_sms, st);
  else
    run_stream<__nv_fp8_e4m3>(p, mean_ld, num_sms, st);
}

// fp16 / bf16 only (stream_wg_ok).
bool run_stream_wg_any(at::ScalarType t, const FwdParams& p, int nst, int64_t mean_ld, int num_sms, cudaStream_t st) {
  if (t == at::kHalf) return run_stream_wg<__half>(p, nst, mean_ld, num_sms, st);
  return run_stream_wg<__nv_bfloat16>(p, nst, mean_ld, num_sms, st);
}

void run_simt_any(at::ScalarType t, bool arg, const FwdParams& p, int64_t item0, int64_t n, cudaStream_t st) {
  if (t == at::kHalf)
    run_simt<__half>(arg, p, item0, n, st);
  else if (t == at::kBFloat16)
    run_simt<__nv_bfloat16>(arg, p, item0, n, st);
  else
    run_simt<float>(arg, p, item0, n, st);
}

int occupancy_simt_any(at::ScalarType t, bool arg) {
  if (t == at::kHalf) return occupancy_simt_t<__half>(arg);
  if (t == at::kBFloat16) return occupancy_simt_t<__nv_bfloat16>(arg);
  return occupancy_simt_t<float>(arg);
}

// Tile configuration from the shape (see forward_mma.cuh for the shapes).
// Measured on H100 (bf16, dim 128, goal shapes): config 0 is best for
// lq <= 32 (memory bound); config 2 (4 warps, 64x32 warp tiles) beats the
// 8-warp configs 3 / 4 on every compute-heavy goal shape, so it takes the
// stacked-query CROSS case and lq > 64.
// Plug-in point: a wgmma (sm_90a) path for large lq would be selected here.
int choose_mma_cfg(int64_t layout, int64_t nq, int64_t lq) {
  if (layout == kCross && nq > 1) {
    // Stack several queries in one M tile so each doc tile feeds many queries.
    if (lq <= 32 && nq * lq <= 32) return 0;
    if (lq <= 64 && nq * lq <= 64) return 1;
    if (lq <= 64) return 2;
  }
  if (lq <= 32) return 0;
  if (lq <= 64) return 1;
  return 2;
}

void launch_finalize(bool arg, const FwdParams& p, cudaStream_t st) {
  if (p.row_mode == 1) {
    launch_pdl(finalize_partial_kernel, dim3((unsigned)((p.P + 255) / 256)), dim3(256), 0, st, p);
  } else {
    const dim3 blocks((unsigned)((p.P * 32 + 255) / 256));
    launch_pdl(arg ? finalize_rows_kernel<true> : finalize_rows_kernel<false>, blocks, dim3(256), 0, st, p);
  }
}

void check_index(const at::Tensor& t, const char* name) {
  MAXSIM_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(),
               "maxsim: %s must be a contiguous 1-D int32 CUDA tensor", name);
}

}  // namespace

// Query rows each document token meets (one wgmma M tile holds kWgBM).
inline int64_t query_rows_per_token(int64_t layout, int64_t Nq, int64_t lq) {
  return layout == kCross ? Nq * lq : lq;
}

std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& q_in, const at::Tensor* q_scale,
                                                const at::Tensor& q_start, const at::Tensor& q_len,
                                                const std::optional<at::Tensor>& q_mask, const at::Tensor& d_in,
                                                const at::Tensor* d_scale, const at::Tensor& d_start,
                                                const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
                                                const std::optional<at::Tensor>& pair_q,
                                                const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
                                                int64_t argmax_kind, bool tf32, bool normalize,
                                                bool uniform_doc_scales = false) {
  TORCH_CHECK(q_in.is_cuda() && d_in.is_cuda(), "maxsim: q and d must be CUDA tensors");
  TORCH_CHECK(q_in.dim() == 2 && d_in.dim() == 2 && q_in.size(1) == d_in.size(1),
              "maxsim: q [Tq, dim] and d [Td, dim] must share dim");
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK(dtype == d_in.scalar_type(), "maxsim: q and d must have the same dtype");
  const bool quant = q_scale != nullptr;
  if (quant) {
    TORCH_CHECK(dtype == at::kChar || dtype == at::kFloat8_e4m3fn,
                "maxsim: quantized tokens must be int8 or float8_e4m3fn");
    for (const at::Tensor* s : {q_scale, d_scale})
      TORCH_CHECK(s->is_cuda() && s->scalar_type() == at::kFloat && s->dim() == 1 && s->is_contiguous(),
                  "maxsim: token scales must be contiguous 1-D float32 CUDA tensors");
    TORCH_CHECK(q_scale->numel() == q_in.size(0) && d_scale->numel() == d_in.size(0),
                "maxsim: q_scale must be [Tq] and d_scale [Td]");
    TORCH_CHECK(q_in.size(1) % 4 == 0, "maxsim: quantized tokens need dim % 4 == 0 (zero-pad)");
    if (dtype == at::kFloat8_e4m3fn) {
      const auto* pr = at::cuda::getCurrentDeviceProperties();
      TORCH_CHECK(pr->major * 10 + pr->minor >= 89, "maxsim: float8_e4m3fn tokens need sm_89 or newer");
    }
  } else {
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                "maxsim: dtype must be float32, float16 or bfloat16");
  }
  TORCH_CHECK(layout >= 0 && layout <= 2, "maxsim: bad layout");
  TORCH_CHECK(argmax_kind >= 0 && argmax_kind <= 2, "maxsim: bad argmax_kind");
  TORCH_CHECK(lq >= 0 && lq < (int64_t)1 << 30, "maxsim: bad lq");
  check_index(q_start, "q_start");
  check_index(q_len, "q_len");
  check_index(d_start, "d_start");
  check_index(d_len, "d_len");
  TORCH_CHECK(q_start.numel() == q_len.numel() && d_start.numel() == d_len.numel(),
              "maxsim: start / len size mismatch");

  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous();
  const at::Tensor d = d_in.contiguous();
  const int64_t Nq = q_start.numel(), Nd = d_start.numel();

  int64_t P = 0;
  at::Tensor pq, pd;
  if (layout == kCross) {
    P = Nq * Nd;
  } else if (layout == kGrouped) {
    P = Nd;
  } else {
    TORCH_CHECK(pair_q.has_value() && pair_d.has_value(), "maxsim: LIST layout needs pair_q / pair_d");
    pq = pair_q->contiguous();
    pd = pair_d->contiguous();
    check_index(pq, "pair_q");
    check_index(pd, "pair_d");
    TORCH_CHECK(pq.numel() == pd.numel(), "maxsim: pair_q / pair_d size mismatch");
    P = pq.numel();
  }

  auto fopts = q.options().dtype(at::kFloat);
  at::Tensor scores = at::empty({P}, fopts);
  at::Tensor argmax = argmax_kind == 0
                          ? at::empty({0}, q.options().dtype(at::kInt))
                          : at::empty({P, lq}, q.options().dtype(argmax_kind == 1 ? at::kInt : at::kShort));
  if (P == 0) return {scores, argmax};

  const at::Tensor qm = token_mask(q_mask, q.size(0), "maxsim: q_mask must be [Tq]");
  const at::Tensor dm = token_mask(d_mask, d.size(0), "maxsim: d_mask must be [Td]");

  const bool arg = argmax_kind != 0;
  const int64_t dim = q.size(1);
  const int64_t esz = q.element_size();

  FwdParams p{};
  set_segments(p, q, q_start, q_len, qm, d, d_start, d_len, dm);
  p.pair_q = pq.defined() ? pq.data_ptr<int>() : nullptr;
  p.pair_d = pd.defined() ? pd.data_ptr<int>() : nullptr;
  // normalize: query inverse norms up front; the tensor-core kernel derives
  // the documents' from its own fragments, the SIMT kernel reads d_inv.
  const bool scaled = normalize && !quant && lq > 0;
  at::Tensor q_inv, d_inv;
  if (scaled) q_inv = cuda_norm::inv_norms(q);
  p.q_scale = quant ? q_scale->data_ptr<float>() : scaled ? q_inv.data_ptr<float>() : nullptr;
  p.d_scale = quant ? d_scale->data_ptr<float>() : nullptr;
  p.d_scale_per_doc = quant && uniform_doc_scales;
  p.P = P;
  p.K = std::max<int64_t>(1, (layout == kGrouped && Nq > 0) ? Nd / Nq : 1);
  p.layout = (int)layout;
  p.lq = (int)lq;
  p.scores = scores.data_ptr<float>();
  p.argmax = arg ? argmax.data_ptr() : nullptr;
  p.argmax_kind = (int)argmax_kind;

  cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  if (lq == 0) {  // no query rows: scores are 0 (NaN for invalid pairs)
    p.S = 0;
    p.tpq = 1;
    p.row_mode = 2;
    launch_finalize(arg, p, stream);
    return {scores, argmax};
  }

  // ---- path selection ------------------------------------------------------
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  // Register streaming: one query against many documents, and per-query
  // candidate lists / pair lists of 16-bit tokens. Several queries share
  // documents through the tile kernels' query tiles (CROSS). LIST streamed:
  // 7-25 % faster than the tile kernels (session 15). GROUPED measured 3-9 %
  // slower streamed than on the tile kernel with one warp per pair and the
  // old lane layout; with whole-sector loads and split pairs it is 0-28 %
  // faster at lq 32 on H100 (Rerank, the one exception, within 1.5 %; perf
  // notes, session 11). Very long documents take the tile kernel's splits.
  // On sm_90a the staged wgmma stream takes one query and candidates first
  // (its launcher declines the shapes where this kernel is faster).
  const int64_t mean_ld = Nd > 0 ? d.size(0) / Nd : 0;  // also sizes the doc splits below
  const bool stream_layout = (layout == kCross && Nq == 1) || (layout != kCross && !quant);
  if (((g_forced_cfg == -1 && stream_layout) || g_forced_cfg == -3) && prop->major >= 8 && mean_ld <= 4096 &&
      stream_shape_ok(dtype, lq, arg, scaled, prop->major * 10 + prop->minor, p)) {
    p.stream_split = g_stream_split;
    p.stream_il = g_stream_il;
    p.stream_qsm = g_stream_qsm;
    p.stream_tail = g_stream_tail;
    p.stream_keep = g_stream_keep;
    // Guessed starts only where segment n's id is its position (CROSS and
    // GROUPED; pair lists name their segments freely), so the kernel needs
    // no layout test.
    const bool by_position = layout == kCross || layout == kGrouped;
    p.stream_extent = by_position && (g_stream_spec & 1) && Nd > 0 && d.size(0) % Nd == 0 ? d.size(0) / Nd : 0;
    p.stream_qextent = by_position && (g_stream_spec & 2) && Nq > 0 && q.size(0) % Nq == 0 ? q.size(0) / Nq : 0;
    if (g_stream_wg != 0 && stream_wg_ok(dtype, prop->major * 10 + prop->minor, p) &&
        run_stream_wg_any(dtype, p, g_stream_wg, mean_ld, prop->multiProcessorCount, stream))
      return {scores, argmax};
    run_stream_any(dtype, p, mean_ld, prop->multiProcessorCount, stream);
    return {scores, argmax};
  }
  // Queries of 33-128 rows, one query or candidates: the staged wgmma stream
  // before the tile kernels (its launcher's rule, forward_stream_wg.cu).
  if (g_stream_wg_long != 0 && g_forced_cfg == -1 && stream_layout && lq > 32 && mean_ld <= 4096 &&
      stream_shape_ok(dtype, lq, arg, scaled, prop->major * 10 + prop->minor, p, 128) &&
      stream_wg_ok(dtype, prop->major * 10 + prop->minor, p)) {
    p.stream_keep = g_stream_keep;
    if (run_stream_wg_any(dtype, p, g_stream_wg_long, mean_ld, prop->multiProcessorCount, stream))
      return {scores, argmax};
  }
  const size_t smem_optin = prop->sharedMemPerBlockOptin;
  const int num_sms = prop->multiProcessorCount;

  bool use_mma = (dtype != at::kFloat) || tf32;
  int vecb = 0;
  for (int v : {16, 8, 4}) {
    if (p.row_bytes % v == 0 && reinterpret_cast<uintptr_t>(p.q) % v == 0 &&
        reinterpret_cast<uintptr_t>(p.d) % v == 0) {
      vecb = v;
      break;
    }
  }
  if (vecb == 0) use_mma = false;
  TORCH_CHECK(!quant || vecb > 0, "maxsim: quantized token rows must be 4-byte aligned");
  const int kcb = mma_kchunk(quant);
  const int kch = (int)std::max<int64_t>(1, (p.row_bytes + kcb - 1) / kcb);
  int cfg = -1;
  size_t smem = 0;
  if (use_mma) {
    cfg = g_forced_cfg >= 0 ? g_forced_cfg % kNumMmaCfgs : choose_mma_cfg(layout, Nq, lq);
    // Fall back to narrower query tiles when the resident tile does not fit.
    while (true) {
      smem = mma_smem_bytes(cfg, kch, quant);
      if (smem + mma_static_smem(cfg, quant) <= smem_optin) break;
      if (mma_cfg_info(cfg).bm == 128)  // 128-row tiles -> 64 -> 32
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
  if (g_forced_cfg == -2 && !quant) use_mma = false;
  MAXSIM_CHECK(use_mma || !quant, "maxsim: quantized query tile of dim %lld does not fit in shared memory",
               (long long)dim);
  // sm_90a wgmma + TMA kernel when its 128-row M tile is (nearly) full.
  const int64_t wg_rows = std::min<int64_t>(query_rows_per_token(layout, Nq, lq), kWgBM);
  const bool use_wg = use_mma && dtype != at::kFloat && g_forced_cfg < 0 && prop->major == 9 &&
                      (wg_rows >= kWgBM || g_forced_cfg == -4) && wgmma_shape_ok(p, dim, esz) &&
                      wgmma_ready_any(dtype, dim, arg, scaled);

  const int bm = use_wg ? kWgBM : use_mma ? mma_cfg_info(cfg).bm : kSimtBM;
  const int bn = use_wg ? kWgBN : use_mma ? mma_cfg_info(cfg).bn : kSimtBN;
  if (lq <= bm) {
    p.qpt = layout == kCross ? (int)std::max<int64_t>(1, std::min<int64_t>(bm / lq, Nq)) : 1;
    p.tpq = 1;
  } else {
    p.qpt = 1;
    p.tpq = (int)((lq + bm - 1) / bm);
  }
  p.mt_total = layout == kCross ? ((Nq + p.qpt - 1) / p.qpt) * p.tpq : p.tpq;
  p.kch = kch;
  p.ksteps_last = (int)((p.row_bytes - (int64_t)(kch - 1) * kcb + 31) / 32);
  p.row_bytes_pad = (p.row_bytes + 31) / 32 * 32;
  p.vecb = vecb;
  const int64_t U = layout == kList ? P : Nd;
  const int64_t items_base = U * p.mt_total;

  // ---- doc splits for parallelism (few work items, long docs) ---------------
  const int occ = use_wg ? 1 : std::max(1, use_mma ? occupancy_mma_any(dtype, cfg, arg, smem, scaled) : occupancy_simt_any(dtype, arg));
  const int64_t slots = (int64_t)occ * num_sms;
  int S = 1;
  if (g_forced_splits > 0) {
    S = g_forced_splits;
  } else if (items_base < slots) {
    const int64_t by_len = mean_ld / (2 * bn);  // keep >= 2 tiles per chunk
    const int64_t want = (2 * slots + items_base - 1) / items_base;
    S = (int)std::max<int64_t>(1, std::min<int64_t>({want, by_len, 1024}));
  }
  p.S = S;
  p.row_mode = S > 1 ? 2 : (p.tpq > 1 ? 1 : 0);

  // ---- several docs per CTA (MMA kernel, no doc split) -----------------------
  // Many short docs: a CTA walks up to dpc consecutive docs of one group (same
  // query tile), so the query tile is loaded once and the cp.async ring keeps
  // streaming across doc boundaries instead of filling and draining per doc.
  // Sized so the grid is about one wave of resident CTAs, when the plain grid
  // would be 2 to 12 waves: H100 bf16 lq 32 measured 1000 x Ld 300: 0.0376 ->
  // 0.0340 ms, 4000 x Ld 64: 0.053 -> 0.032, 1600 x Ld 180: 0.039 -> 0.034;
  // at 10000 x Ld 300 (25 waves) the fill / drain per CTA is already hidden
  // and one wave was 2% slower, so many waves keep one doc per CTA.
  p.dpc = 1;
  p.gsz = 1;
  p.cpg = 1;
  int64_t total_items = items_base * S;
  if (use_mma && !use_wg && S == 1 && layout != kList && Nd > 0) {
    int64_t dpc = 1;
    if (g_forced_dpc > 0)
      dpc = g_forced_dpc;
    else if (items_base >= 2 * slots && items_base <= 12 * slots)
      dpc = (items_base + slots - 1) / slots;
    else if (quant && items_base <= 32 * slots)
      dpc = (items_base + slots - 1) / slots;  // 8-bit, up to 32 waves: one wave (10k docs: 0.186 -> 0.168 ms)
    else if (quant)
      dpc = 8;  // 8-bit docs are half the bytes: amortise the per-CTA fill / drain over 8 docs
    dpc = std::min<int64_t>(dpc, kMmaMaxDpc);
    if (dpc > 1) {
      const int64_t gsz = layout == kCross ? Nd : p.K;
      p.dpc = (int)dpc;
      p.gsz = gsz;
      p.cpg = (gsz + dpc - 1) / dpc;
      total_items = p.mt_total * ((Nd + gsz - 1) / gsz) * p.cpg;
    }
  }

  at::Tensor ws_best, ws_idx;
  if (p.row_mode == 1) {
    ws_best = at::empty({(int64_t)p.tpq * P}, fopts);
    p.ws_best = ws_best.data_ptr<float>();
  } else if (p.row_mode == 2) {
    ws_best = at::empty({(int64_t)S * P * lq}, fopts);
    p.ws_best = ws_best.data_ptr<float>();
    if (arg) {
      ws_idx = at::empty({(int64_t)S * P * lq}, q.options().dtype(at::kInt));
      p.ws_idx = ws_idx.data_ptr<int>();
    }
  }

  if (scaled && (!use_mma || use_wg)) {  // the mma.sync kernel derives its own
    d_inv = cuda_norm::inv_norms(d);
    p.d_scale = d_inv.data_ptr<float>();
  }

  // ---- launch (grid.x only, in chunks below the 2^31-1 limit) ---------------
  constexpr int64_t kMaxGrid = (int64_t)1 << 30;
  for (int64_t item0 = 0; item0 < total_items; item0 += kMaxGrid) {
    const int64_t n = std::min(kMaxGrid, total_items - item0);
    if (use_wg)
      run_wgmma_any(dtype, arg, p, dim, item0, n, num_sms, stream, scaled);
    else if (use_mma)
      run_mma_any(dtype, cfg, arg, p, item0, n, smem, stream, scaled);
    else
      run_simt_any(dtype, arg, p, item0, n, stream);
  }
  if (p.row_mode) launch_finalize(arg, p, stream);
  return {scores, argmax};
}

}  // namespace cuda_fwd

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& q, const at::Tensor& q_start,
                                                const at::Tensor& q_len, const std::optional<at::Tensor>& q_mask,
                                                const at::Tensor& d, const at::Tensor& d_start,
                                                const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
                                                const std::optional<at::Tensor>& pair_q,
                                                const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
                                                int64_t argmax_kind, bool tf32, bool normalize) {
  return cuda_fwd::forward_impl(q, nullptr, q_start, q_len, q_mask, d, nullptr, d_start, d_len, d_mask, pair_q,
                                pair_d, layout, lq, argmax_kind, tf32, normalize);
}

std::tuple<at::Tensor, at::Tensor> forward_quant_cuda(
    const at::Tensor& q, const at::Tensor& q_scale, const at::Tensor& q_start, const at::Tensor& q_len,
    const std::optional<at::Tensor>& q_mask, const at::Tensor& d, const at::Tensor& d_scale,
    const at::Tensor& d_start, const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
    const std::optional<at::Tensor>& pair_q, const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
    int64_t argmax_kind, bool uniform_doc_scales) {
  const at::Tensor qs = q_scale.contiguous(), ds = d_scale.contiguous();
  return cuda_fwd::forward_impl(q, &qs, q_start, q_len, q_mask, d, &ds, d_start, d_len, d_mask, pair_q, pair_d,
                                layout, lq, argmax_kind, false, false, uniform_doc_scales);
}

}  // namespace maxsim
