// rescore_topk on CUDA: the exact re-score of search candidates (contract in
// torch_binding.h). Where the planner gives it the streaming kernel (16-bit
// tokens, lq <= 32), that kernel takes the candidates straight from their
// keys (kKeysL: no decode / cast kernels) and the last CTA of each row ranks
// the row (rank_rows, forward_stream.cuh): one kernel, plus the zeroed row
// counters, where the composition launches decode, an int32 cast, the
// forward, a select and a decode. Rows of more than kRankMax candidates are
// scored from their keys by the same kernel and ranked by block_topk.
// Elsewhere the composition runs.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../forward/forward_stream.cuh"
#include "../common/dtype_dispatch.cuh"
#include "../common/fwd_params.h"
#include "rescore_compose.h"
#include "torch_binding.h"

namespace maxsim {
namespace {

// The rank's row counters, zeroed by a dependent launch of its own (at::zeros
// would be an ordinary launch between the select and the re-score).
__global__ void zero_counts_kernel(int* __restrict__ c, int64_t n) {
  pdl_enter();
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) c[i] = 0;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rescore_topk_cuda(const at::Tensor& q, const at::Tensor& q_start,
                                                     const at::Tensor& q_len, const std::optional<at::Tensor>& q_mask,
                                                     const at::Tensor& d, const at::Tensor& d_start,
                                                     const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
                                                     const at::Tensor& keys, int64_t lq, int64_t k) {
  using namespace cuda_fwd;
  check_rescore_args(q_start, keys, k);
  TORCH_CHECK(q.is_cuda() && d.is_cuda() && keys.is_cuda(), "maxsim: rescore_topk: CUDA tensors expected");
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t Nq = keys.size(0), kc = keys.size(1), Nd = d_start.numel();
  const auto t = q.scalar_type();
  const bool b16 = (t == at::kHalf || t == at::kBFloat16) && d.scalar_type() == t;
  const bool idx = [&] {
    for (const at::Tensor* x : {&q_start, &q_len, &d_start, &d_len})
      if (!(x->is_cuda() && x->scalar_type() == at::kInt && x->dim() == 1 && x->is_contiguous())) return false;
    return q_len.numel() == Nq && d_len.numel() == Nd;
  }();
  const bool shape = q.dim() == 2 && d.dim() == 2 && q.size(1) == d.size(1);
  const auto composed = [&] {
    return rescore_topk_composed(&forward_cuda, &block_topk_cuda, &decode_keys_cuda, q, q_start, q_len, q_mask, d,
                                 d_start, d_len, d_mask, keys, lq, k);
  };
  if (!(b16 && idx && shape && k > 0)) return composed();
  const at::Tensor qc = q.contiguous(), dc = d.contiguous(), kk = keys.contiguous();
  plan::Request rq = forward_request(plan::kKeys, Nq, Nd, qc.size(0), dc.size(0), Nq * kc, lq, qc.size(1), t, false,
                                     false, false, false, false);
  rq.rank = kc <= kRankMax;
  rq.ptr_align = ptr_align(qc.data_ptr(), dc.data_ptr());
  const plan::Plan pl = plan::plan_forward(rq, cuda_device_facts());
  if (pl.family != plan::Family::kStream) return composed();
  const at::Tensor qm = token_mask(q_mask, qc.size(0), "maxsim: q_mask must be [Tq]");
  const at::Tensor dm = token_mask(d_mask, dc.size(0), "maxsim: d_mask must be [Td]");
  FwdParams p{};
  set_segments(p, qc, q_start, q_len, qm, dc, d_start, d_len, dm);
  p.pair_keys = kk.data_ptr<int64_t>();
  p.pair_kc = kc;
  p.P = rq.P;
  p.K = 1;
  p.layout = kKeysL;
  p.lq = (int)lq;
  set_stream_plan(p, pl);
  auto fopts = qc.options().dtype(at::kFloat);
  at::Tensor scores = at::empty({p.P}, fopts);
  p.scores = scores.data_ptr<float>();
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto run = [&] {
    dispatch_float_type(t, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (kIs16Bit<T>) run_stream<T>(pl.stream, p, stream);
    });
  };
  if (!rq.rank) {  // scores from the keys, then a select (faster than the fused rank for long rows)
    run();
    return top_k_decoded(&block_topk_cuda, &decode_keys_cuda, scores.view({Nq, kc}), std::get<1>(decode_keys_cuda(kk)),
                         k);
  }
  at::Tensor done = at::empty({Nq}, qc.options().dtype(at::kInt));
  launch_pdl(zero_counts_kernel, dim3((unsigned)std::min<int64_t>((Nq + 255) / 256, 1024)), dim3(256), 0, stream,
             done.data_ptr<int>(), Nq);
  at::Tensor out_s = at::empty({Nq, k}, fopts);
  at::Tensor out_id = at::empty({Nq, k}, qc.options().dtype(at::kLong));
  p.rank_done = done.data_ptr<int>();
  p.rank_k = k;
  p.rank_scores = out_s.data_ptr<float>();
  p.rank_ids = out_id.data_ptr<int64_t>();
  run();
  return {out_s, out_id};
}

}  // namespace maxsim
