// head_forward on CUDA: the fused projection-head MaxSim (head_fused.cuh),
// sm_90a devices only. Three launches on the current stream (the running
// maxima's -inf fill, the fused kernel, the finisher), no host
// synchronisation: capturable in a CUDA graph. With the argmax (training's
// forward) the running maxima are 64-bit words that carry the winner.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "../common/dtype_dispatch.cuh"
#include "../common/smem_opt_in.h"
#include "head_fused.cuh"
#include "check.h"
#include "torch_binding.h"

namespace maxsim {
namespace {

// The kernel for T, its dynamic shared memory opted in; false when this
// build lacks its sm_90a body.
template <typename T, bool ARG>
bool head_kernel_ready() {
  static int state[kSmemOptInDevices] = {};
  return sm90a_kernel_ready(head::head_fused_kernel<T, head::kHeadMT, ARG>, head::HeadCfg<head::kHeadMT>::SMEM,
                            state);
}

// A 2-D tensor map over rows x cols of 16-bit T (row-major, contiguous),
// boxes of [box_rows x 64 columns] with the 128-byte swizzle.
template <typename T>
CUtensorMap head_map(const void* ptr, int64_t rows, int64_t cols, int box_rows, CUtensorMapL2promotion promo) {
  CUtensorMap map;
  cuuint64_t gdim[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
  cuuint64_t gstride[1] = {(cuuint64_t)cols * sizeof(T)};
  cuuint32_t box[2] = {64u, (cuuint32_t)box_rows};
  cuuint32_t estride[2] = {1, 1};
  const CUtensorMapDataType dt =
      std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  auto encode = cuda_fwd::wg_encode_fn();
  TORCH_CHECK(encode != nullptr, "maxsim: head_forward: cuTensorMapEncodeTiled unavailable");
  const CUresult r = encode(&map, dt, 2, const_cast<void*>(ptr), gdim, gstride, box, estride,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MAXSIM_CHECK(r == CUDA_SUCCESS, "maxsim: head_forward: cuTensorMapEncodeTiled failed (%d)", (int)r);
  return map;
}

// Items per tile (each scoring a range of the query chunks): with fewer
// tiles than SMs, split the chunks so that the items fill the SMs once; each
// item projects its tile again, so no split where the tiles alone fill them.
int head_query_groups(int64_t ntiles, int nqc, int sms) {
  if (ntiles >= sms) return 1;
  return (int)std::max<int64_t>(1, std::min<int64_t>(nqc, sms / ntiles));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> head_forward_cuda(const at::Tensor& q_in, const at::Tensor& h_in,
                                                     const at::Tensor& w_in, const std::optional<at::Tensor>& b_in,
                                                     const std::optional<at::Tensor>& q_mask_in,
                                                     const std::optional<at::Tensor>& d_mask_in, bool normalize,
                                                     bool with_argmax) {
  TORCH_CHECK(q_in.dim() == 3 && h_in.dim() == 3 && w_in.dim() == 2,
              "maxsim: head_forward: q [Nq, Lq, d_out], h [Nd, Ld, d_model], w [d_out, d_model]");
  const at::ScalarType dt = q_in.scalar_type();
  TORCH_CHECK(dt == at::kHalf || dt == at::kBFloat16, "maxsim: head_forward: fp16 / bf16 only");
  TORCH_CHECK(h_in.scalar_type() == dt && w_in.scalar_type() == dt && (!b_in || b_in->scalar_type() == dt),
              "maxsim: head_forward: q, h, w, b must share one dtype");
  TORCH_CHECK(q_in.is_cuda() && h_in.device() == q_in.device() && w_in.device() == q_in.device() &&
                  (!b_in || b_in->device() == q_in.device()),
              "maxsim: head_forward: tensors on one CUDA device");
  const int64_t Nq = q_in.size(0), Lq = q_in.size(1), Nd = h_in.size(0), Ld = h_in.size(1);
  const int64_t d_out = w_in.size(0), d_model = w_in.size(1);
  TORCH_CHECK(d_out == head::kHeadDout && q_in.size(2) == d_out, "maxsim: head_forward: d_out must be 128");
  TORCH_CHECK(h_in.size(2) == d_model && d_model > 0 && d_model % 64 == 0,
              "maxsim: head_forward: d_model must be a positive multiple of 64");
  MAXSIM_CHECK(Nq * Lq <= head::kHeadMaxQ, "maxsim: head_forward: at most %d query tokens (Nq * Lq)",
               head::kHeadMaxQ);
  TORCH_CHECK(!b_in || (b_in->dim() == 1 && b_in->size(0) == d_out), "maxsim: head_forward: b must be [d_out]");
  TORCH_CHECK(!q_mask_in || (q_mask_in->scalar_type() == at::kBool && q_mask_in->sizes() == at::IntArrayRef{Nq, Lq}),
              "maxsim: head_forward: q_mask must be bool [Nq, Lq]");
  TORCH_CHECK(!d_mask_in || (d_mask_in->scalar_type() == at::kBool && d_mask_in->sizes() == at::IntArrayRef{Nd, Ld}),
              "maxsim: head_forward: d_mask must be bool [Nd, Ld]");
  const int64_t rows = Nd * Ld;
  TORCH_CHECK(rows + 256 < ((int64_t)1 << 31), "maxsim: head_forward: Nd * Ld must be below 2^31");

  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(prop->major == 9, "maxsim: head_forward: the fused kernel needs an sm_90 device");
  const auto idx_opts = q_in.options().dtype(at::kInt);
  if (Nq * Lq == 0 || rows == 0)
    return {at::zeros({Nq, Nd}, q_in.options().dtype(at::kFloat)),
            with_argmax ? at::full({Nq, Nd, Lq}, -1, idx_opts) : at::empty({0}, idx_opts)};
  at::Tensor scores = at::empty({Nq, Nd}, q_in.options().dtype(at::kFloat));
  at::Tensor argmax = with_argmax ? at::empty({Nq, Nd, Lq}, idx_opts) : at::empty({0}, idx_opts);

  // Operands: H, W and Q through TMA (16-byte aligned base, rows of d_model
  // or d_out elements). Copies only where a view is not contiguous / aligned
  // (Q, W, b and the masks are small).
  const auto aligned = [](const at::Tensor& t) -> at::Tensor {
    if (t.is_contiguous() && aligned_to(t.data_ptr(), 16)) return t;
    return t.clone(at::MemoryFormat::Contiguous);
  };
  const at::Tensor h = aligned(h_in), w = aligned(w_in), q = aligned(q_in);
  const at::Tensor b = b_in ? b_in->contiguous() : at::Tensor();
  const at::Tensor qm = q_mask_in ? q_mask_in->contiguous() : at::Tensor();
  const at::Tensor dm = d_mask_in ? d_mask_in->contiguous() : at::Tensor();
  const int nqv = (int)(Nq * Lq);
  // -inf keys (the token bits of an argmax word are never read under them).
  at::Tensor maxbuf = with_argmax
                          ? at::full({Nd, nqv}, (int64_t)head::kHeadNegInfKey << 32, q_in.options().dtype(at::kLong))
                          : at::full({Nd, nqv}, (int64_t)head::kHeadNegInfKey, idx_opts);

  head::HeadParams p{};
  p.bias = b.defined() ? b.data_ptr() : nullptr;
  p.d_mask = dm.defined() ? reinterpret_cast<const unsigned char*>(dm.data_ptr<bool>()) : nullptr;
  p.maxbuf = maxbuf.data_ptr();
  p.T = rows;
  p.Ld = (int)Ld;
  p.nqv = nqv;
  p.nqc = (nqv + head::kHeadNQ - 1) / head::kHeadNQ;
  p.nkb = (int)(d_model / 64);
  p.normalize = normalize ? 1 : 0;

  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_float_type(dt, [&](auto tv) {
    using T = decltype(tv);
    if constexpr (kIs16Bit<T>) {
      constexpr int MT = head::kHeadMT;
      constexpr int BM = head::HeadCfg<MT>::BM;
      const bool ready = with_argmax ? head_kernel_ready<T, true>() : head_kernel_ready<T, false>();
      TORCH_CHECK(ready, "maxsim: head_forward: this build lacks the sm_90a kernel");
      const int sms = std::max(1, prop->multiProcessorCount);
      const int64_t ntiles = (rows + BM - 1) / BM;
      const int groups = head_query_groups(ntiles, p.nqc, sms);
      p.qcpg = (p.nqc + groups - 1) / groups;
      p.qgroups = (p.nqc + p.qcpg - 1) / p.qcpg;  // none empty
      p.nwork = ntiles * p.qgroups;
      const unsigned grid = (unsigned)std::min<int64_t>(p.nwork, sms);
      const CUtensorMap hmap = head_map<T>(h.data_ptr(), rows, d_model, BM, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
      const CUtensorMap wmap =
          head_map<T>(w.data_ptr(), d_out, d_model, head::kHeadDout, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
      const CUtensorMap qmap =
          head_map<T>(q.data_ptr(), nqv, d_out, head::kHeadNQ, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
      const auto kernel = with_argmax ? head::head_fused_kernel<T, MT, true> : head::head_fused_kernel<T, MT, false>;
      launch_pdl(kernel, dim3(grid), dim3(head::kHeadThreads), (size_t)head::HeadCfg<MT>::SMEM, stream, hmap, wmap,
                 qmap, p);
    }
  });
  const int64_t pairs_per_block = 8;  // a warp each
  launch_pdl(with_argmax ? head::head_finalize_kernel<true> : head::head_finalize_kernel<false>,
             dim3((unsigned)((Nq * Nd + pairs_per_block - 1) / pairs_per_block)), dim3(32 * pairs_per_block), 0,
             stream, (const void*)p.maxbuf,
             qm.defined() ? reinterpret_cast<const unsigned char*>(qm.data_ptr<bool>()) : nullptr,
             scores.data_ptr<float>(), with_argmax ? argmax.data_ptr<int>() : nullptr, Nq, Nd, (int)Lq);
  return {scores, argmax};
}

}  // namespace maxsim
