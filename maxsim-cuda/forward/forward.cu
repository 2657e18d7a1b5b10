// maxsim::forward_cuda: executes the forward plan (forward_plan.h) of a call.
//
// The planner picks the kernel family (register streaming, staged wgmma
// stream, packed short documents, wgmma, mma.sync, SIMT), its configuration, the document split and
// the grid from the call's shape facts and the device facts gathered here
// (cuda_device_facts); this file validates the arguments, fills FwdParams from the
// plan and launches. The executors never decline.
//
// One CTA per (M tile, doc chunk, doc or pair) for the tile kernels. When a
// query spans several M tiles (lq > BM) or docs are split into chunks for
// parallelism, CTAs write partials to a workspace and finalize_partial_kernel
// / finalize_rows_kernel merge and sum them in a fixed order (deterministic;
// no atomics). No host synchronisation: the longest document is unknown on
// the host, so splits are sized from the mean document length and every CTA
// derives its token range from d_len on device.
//
// normalize: inverse row norms go in as per-token scales, applied like 8-bit
// token scales (doc token before the max, query row after it): the query's
// from a small pre-pass (normalize_rows.cuh), the documents' computed by the
// mma.sync kernel from its own B fragments (documents read once); the SIMT
// and wgmma kernels take the documents' from the same pre-pass launch. No
// normalised copy is written.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "forward_mma.cuh"
#include "forward_packed.cuh"
#include "forward_simt.cuh"
#include "forward_stream.cuh"
#include "../forward_sm90a/forward_stream_wg.cuh"
#include "../forward_sm90a/forward_wgmma.cuh"
#include "../common/dtype_dispatch.cuh"
#include "../common/fwd_params.h"
#include "../common/normalize_rows_launch.cuh"
#include "torch_binding.h"

namespace maxsim {
namespace cuda_fwd {

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
  store_score(p, pr, ok, sum);
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
  if (lane == 0) store_score(p, pr, ok, sum);
}

// Resident CTAs per SM of a kernel the planner considers (the runtime's
// occupancy; each kernel asked once, or once per shared-memory size).
int blocks_per_sm(const plan::KernelId& k) {
  return dispatch_token_type(scalar_type(k.dtype), [&](auto tag) -> int {
    using T = decltype(tag);
    if (k.family == plan::Family::kMma) {
      if constexpr (std::is_same<T, float>::value) {
        if (k.split)
          return k.scaled ? occupancy_mma_scaled<Tf32x3>(k.cfg, k.argmax, (size_t)k.smem)
                          : occupancy_mma<Tf32x3>(k.cfg, k.argmax, (size_t)k.smem);
      }
      if constexpr (!kIsQuant<T>) {
        if (k.scaled) return occupancy_mma_scaled<T>(k.cfg, k.argmax, (size_t)k.smem);
      }
      return occupancy_mma<T>(k.cfg, k.argmax, (size_t)k.smem);
    }
    if (k.family == plan::Family::kSimt) {
      if constexpr (!kIsQuant<T>) return occupancy_simt_t<T>(k.argmax);
    } else if (k.family == plan::Family::kStream) {
      if constexpr (!std::is_same<T, float>::value) {
        plan::StreamPlan s;
        s.ks = k.ks;
        s.rows = k.rows;
        s.warps = k.warps;
        s.rank = k.rank;
        s.doc_scale = k.doc_scale;
        s.run = k.run ? 1 : 0;
        return stream_blocks<T>(s);
      }
    } else if (k.family == plan::Family::kStreamWg) {
      if constexpr (kIs16Bit<T>) return stream_wg_blocks<T>(k.ks, k.rows, k.argmax);
    } else if (k.family == plan::Family::kPacked) {
      if constexpr (kIs16Bit<T>) return packed_blocks<T>(k.ks, k.argmax);
    }
    return 0;  // no such kernel: the planner does not ask for it
  });
}

void run_tiles(const plan::Plan& pl, const plan::Request& rq, const plan::DeviceFacts& dev, at::ScalarType t,
               const FwdParams& p, int64_t item0, int64_t n, cudaStream_t st) {
  dispatch_token_type(t, [&](auto tag) {
    using T = decltype(tag);
    if (pl.family == plan::Family::kWgmma) {
      if constexpr (std::is_same<T, float>::value) {
        MAXSIM_CHECK(false, "maxsim: no wgmma kernel for float32 tokens");
      } else {
        const int flags = plan::wgmma_flags(pl, rq, dev, n);
        if (pl.scaled) {
          if constexpr (kIs16Bit<T>) run_wgmma_scaled<T>(pl.wgmma, rq.argmax, p, rq.dim, item0, n, flags, dev.sm_count, st);
        } else {
          run_wgmma<T>(pl.wgmma, rq.argmax, p, rq.dim, item0, n, flags, dev.sm_count, st);
        }
      }
    } else if (pl.family == plan::Family::kPacked) {
      if constexpr (kIs16Bit<T>)
        run_packed<T>(pl.packed, rq.argmax, p, item0, n, st);
      else
        MAXSIM_CHECK(false, "maxsim: the packed kernel takes 16-bit tokens");
    } else if (pl.family == plan::Family::kMma) {
      if constexpr (std::is_same<T, float>::value) {
        if (pl.split) {  // fp32 at the default precision: split 3xTF32
          if (pl.scaled)
            run_mma_scaled<Tf32x3>(pl.cfg, rq.argmax, p, item0, n, (size_t)pl.smem, st);
          else
            run_mma<Tf32x3>(pl.cfg, rq.argmax, p, item0, n, (size_t)pl.smem, st);
          return;
        }
      }
      if constexpr (kIsQuant<T>) {
        run_mma<T>(pl.cfg, rq.argmax, p, item0, n, (size_t)pl.smem, st);
      } else if (pl.scaled) {
        run_mma_scaled<T>(pl.cfg, rq.argmax, p, item0, n, (size_t)pl.smem, st);
      } else {
        run_mma<T>(pl.cfg, rq.argmax, p, item0, n, (size_t)pl.smem, st);
      }
    } else {
      if constexpr (kIsQuant<T>)
        MAXSIM_CHECK(false, "maxsim: no SIMT kernel for 8-bit tokens");
      else
        run_simt<T>(rq.argmax, p, item0, n, st);
    }
  });
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

std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& q_in, const at::Tensor* q_scale,
                                                const at::Tensor& q_start, const at::Tensor& q_len,
                                                const std::optional<at::Tensor>& q_mask, const at::Tensor& d_in,
                                                const at::Tensor* d_scale, const at::Tensor& d_start,
                                                const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
                                                const std::optional<at::Tensor>& pair_q,
                                                const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
                                                int64_t argmax_kind, int64_t precision, bool normalize,
                                                bool uniform_doc_scales = false, at::Tensor* inv_out = nullptr) {
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
  TORCH_CHECK(precision >= 0 && precision <= 2, "maxsim: bad precision");
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

  FwdParams p{};
  set_segments(p, q, q_start, q_len, qm, d, d_start, d_len, dm);
  p.pair_q = pq.defined() ? pq.data_ptr<int>() : nullptr;
  p.pair_d = pd.defined() ? pd.data_ptr<int>() : nullptr;
  p.q_scale = quant ? q_scale->data_ptr<float>() : nullptr;
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

  plan::Request rq = forward_request(layout, Nq, Nd, q.size(0), d.size(0), P, lq, dim, dtype, quant,
                                     uniform_doc_scales, arg, precision, normalize);
  rq.ptr_align = ptr_align(p.q, p.d);
  rq.d_scale_aligned = quant && aligned_to(p.d_scale, 16);
  const plan::DeviceFacts dev = cuda_device_facts();
  const plan::Plan pl = plan::plan_forward(rq, dev);
  TORCH_CHECK(pl.ok, pl.error);

  if (pl.family == plan::Family::kStream || pl.family == plan::Family::kStreamWg) {
    set_stream_plan(p, pl);
    dispatch_token_type(dtype, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (std::is_same<T, float>::value) {
        MAXSIM_CHECK(false, "maxsim: no streaming kernel for float32 tokens");
      } else if (pl.family == plan::Family::kStreamWg) {
        if constexpr (kIs16Bit<T>) run_stream_wg<T>(pl.stream_wg, pl.grid, p, stream);
      } else {
        run_stream<T>(pl.stream, p, stream);
      }
    });
    return {scores, argmax};
  }

  set_tile_plan(p, pl);

  at::Tensor ws_best, ws_idx;
  if (p.row_mode == 1) {
    ws_best = at::empty({(int64_t)p.tpq * P}, fopts);
    p.ws_best = ws_best.data_ptr<float>();
  } else if (p.row_mode == 2) {
    ws_best = at::empty({(int64_t)p.S * P * lq}, fopts);
    p.ws_best = ws_best.data_ptr<float>();
    if (arg) {
      ws_idx = at::empty({(int64_t)p.S * P * lq}, q.options().dtype(at::kInt));
      p.ws_idx = ws_idx.data_ptr<int>();
    }
  }

  // normalize: the queries' inverse norms, and in the same launch the
  // documents' where the kernel does not derive them from its own fragments
  // or the backward reads them (inv_out: forward_train).
  cuda_norm::InvNorms inv;
  if (pl.scaled) {
    inv = cuda_norm::inv_norms(q, pl.d_inv_prepass || inv_out ? d : at::Tensor());
    p.q_scale = inv.a;
    if (pl.d_inv_prepass) p.d_scale = inv.b;
    if (inv_out) *inv_out = inv.buf;
  }

  // ---- launch (grid.x only, in chunks below the 2^31-1 limit) ---------------
  constexpr int64_t kMaxGrid = (int64_t)1 << 30;
  for (int64_t item0 = 0; item0 < pl.items; item0 += kMaxGrid)
    run_tiles(pl, rq, dev, dtype, p, item0, std::min(kMaxGrid, pl.items - item0), stream);
  if (p.row_mode) launch_finalize(arg, p, stream);
  return {scores, argmax};
}

}  // namespace cuda_fwd

plan::DeviceFacts cuda_device_facts() {
  using namespace cuda_fwd;
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  plan::DeviceFacts f;
  f.arch = prop->major * 10 + prop->minor;
  f.sm_count = prop->multiProcessorCount;
  f.smem_optin = (int64_t)prop->sharedMemPerBlockOptin;
  f.l2_bytes = prop->l2CacheSize;
  f.wgmma_built = f.arch == 90 && wgmma_built();
  f.blocks_per_sm = &blocks_per_sm;
  return f;
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& q, const at::Tensor& q_start,
                                                const at::Tensor& q_len, const std::optional<at::Tensor>& q_mask,
                                                const at::Tensor& d, const at::Tensor& d_start,
                                                const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
                                                const std::optional<at::Tensor>& pair_q,
                                                const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
                                                int64_t argmax_kind, int64_t precision, bool normalize) {
  return cuda_fwd::forward_impl(q, nullptr, q_start, q_len, q_mask, d, nullptr, d_start, d_len, d_mask, pair_q,
                                pair_d, layout, lq, argmax_kind, precision, normalize);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_train_cuda(
    const at::Tensor& q, const at::Tensor& q_start, const at::Tensor& q_len, const std::optional<at::Tensor>& q_mask,
    const at::Tensor& d, const at::Tensor& d_start, const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
    const std::optional<at::Tensor>& pair_q, const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
    int64_t argmax_kind, int64_t precision, bool normalize) {
  at::Tensor inv;
  auto [scores, argmax] = cuda_fwd::forward_impl(q, nullptr, q_start, q_len, q_mask, d, nullptr, d_start, d_len,
                                                 d_mask, pair_q, pair_d, layout, lq, argmax_kind, precision, normalize,
                                                 false, normalize ? &inv : nullptr);
  if (!normalize) return {scores, argmax, at::empty({0}, q.options().dtype(at::kFloat))};
  // A call whose kernels read no norms (no pairs, no query rows) computes
  // them all the same: the backward trusts a buffer of the full size.
  if (!inv.defined()) inv = inverse_norms(q, d);
  return {scores, argmax, inv};
}

std::tuple<at::Tensor, at::Tensor> forward_quant_cuda(
    const at::Tensor& q, const at::Tensor& q_scale, const at::Tensor& q_start, const at::Tensor& q_len,
    const std::optional<at::Tensor>& q_mask, const at::Tensor& d, const at::Tensor& d_scale,
    const at::Tensor& d_start, const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
    const std::optional<at::Tensor>& pair_q, const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
    int64_t argmax_kind, bool uniform_doc_scales) {
  const at::Tensor qs = q_scale.contiguous(), ds = d_scale.contiguous();
  return cuda_fwd::forward_impl(q, &qs, q_start, q_len, q_mask, d, &ds, d_start, d_len, d_mask, pair_q, pair_d,
                                layout, lq, argmax_kind, 0, false, uniform_doc_scales);
}

}  // namespace maxsim
