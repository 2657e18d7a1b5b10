// Op schemas, declared once for every backend; each backend registers its
// implementation for its dispatch key. The contract is in torch_binding.h.
#include <torch/library.h>

#include "normalize_rows.h"
#include "registration.h"
#include "torch_binding.h"

#define MAXSIM_FORWARD_ARGS                                              \
  "(Tensor q, Tensor q_start, Tensor q_len, Tensor? q_mask, Tensor d, "    \
  "Tensor d_start, Tensor d_len, Tensor? d_mask, Tensor? pair_q, "         \
  "Tensor? pair_d, int layout, int lq, int argmax_kind, int precision, "     \
  "bool normalize=False) -> "

namespace maxsim {
namespace {

// forward_train and backward on the backends whose backward derives its own
// inverse norms (torch_binding.h, ForwardTrainFn): the forward returns them
// from ATen ops, the backward leaves them.
template <ForwardFn* F>
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_train_of(
    const at::Tensor& q, const at::Tensor& q_start, const at::Tensor& q_len, const std::optional<at::Tensor>& q_mask,
    const at::Tensor& d, const at::Tensor& d_start, const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
    const std::optional<at::Tensor>& pair_q, const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
    int64_t argmax_kind, int64_t precision, bool normalize) {
  auto [scores, argmax] =
      F(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d, layout, lq, argmax_kind, precision,
        normalize);
  return {scores, argmax, normalize ? inverse_norms(q, d) : at::empty({0}, q.options().dtype(at::kFloat))};
}

template <BackwardFn* F>
std::tuple<at::Tensor, at::Tensor> backward_of(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& q_start, const at::Tensor& q_len,
    const at::Tensor& d, const at::Tensor& d_start, const at::Tensor& d_len, const std::optional<at::Tensor>& pair_q,
    const std::optional<at::Tensor>& pair_d, const at::Tensor& argmax, int64_t layout,
    const std::optional<at::Tensor>& q_ptr, const std::optional<at::Tensor>& q_pairs,
    const std::optional<at::Tensor>& d_ptr, const std::optional<at::Tensor>& d_pairs, bool need_dq, bool need_dd,
    bool normalize, const std::optional<at::Tensor>&) {
  return F(grad, q, q_start, q_len, d, d_start, d_len, pair_q, pair_d, argmax, layout, q_ptr, q_pairs, d_ptr, d_pairs,
           need_dq, need_dd, normalize);
}

}  // namespace
}  // namespace maxsim

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  // Two names, one kernel: autograd is registered on forward_train only, so
  // inference calls go straight to the device kernel without the autograd
  // wrapper's cost. forward_train also returns the inverse norms its
  // backward reads under normalize (torch_binding.h, ForwardTrainFn).
  ops.def("forward" MAXSIM_FORWARD_ARGS "(Tensor scores, Tensor argmax)");
  ops.def("forward_train" MAXSIM_FORWARD_ARGS "(Tensor scores, Tensor argmax, Tensor inv_norms)");
  ops.def(
      "forward_quant(Tensor q, Tensor q_scale, Tensor q_start, Tensor q_len, "
      "Tensor? q_mask, Tensor d, Tensor d_scale, Tensor d_start, Tensor d_len, "
      "Tensor? d_mask, Tensor? pair_q, Tensor? pair_d, int layout, int lq, "
      "int argmax_kind, bool uniform_doc_scales=False) -> (Tensor scores, Tensor argmax)");
  ops.def("quantize(Tensor x, int kind, Tensor? scales=None) -> (Tensor values, Tensor scales)");
  ops.def("block_topk(Tensor scores, int id0, int k, Tensor? ids=None) -> Tensor keys");
  ops.def("decode_keys(Tensor keys) -> (Tensor scores, Tensor ids)");
  ops.def(
      "rescore_topk(Tensor q, Tensor q_start, Tensor q_len, Tensor? q_mask, Tensor d, "
      "Tensor d_start, Tensor d_len, Tensor? d_mask, Tensor keys, int lq, int k) -> (Tensor scores, Tensor ids)");
  ops.def(
      "backward(Tensor grad, Tensor q, Tensor q_start, Tensor q_len, "
      "Tensor d, Tensor d_start, Tensor d_len, Tensor? pair_q, "
      "Tensor? pair_d, Tensor argmax, int layout, Tensor? q_ptr, "
      "Tensor? q_pairs, Tensor? d_ptr, Tensor? d_pairs, bool need_dq, "
      "bool need_dd, bool normalize=False, Tensor? inv_norms=None) -> (Tensor dq, Tensor dd)");
  ops.def("segments(Tensor[] offsets, int[] totals, int[] max_lens, Tensor[] ints, int[] lo, int[] hi) -> Tensor[]");
  ops.def("uniform_segments(Tensor like, int n, int extent) -> (Tensor start, Tensor len)");
  ops.def("plaid_approx(Tensor qcs, Tensor codes, Tensor d_start, Tensor d_len, Tensor? keep=None) -> Tensor");
  ops.def(
      "plaid_forward(Tensor q, Tensor codes, Tensor residuals, Tensor centroids, Tensor bucket_weights, "
      "Tensor d_start, Tensor d_len, Tensor? pair_q, int nbits, bool normalize, bool argmax) -> (Tensor scores, "
      "Tensor argmax)");
  ops.def(
      "plaid_backward(Tensor grad, Tensor q, Tensor codes, Tensor residuals, Tensor centroids, "
      "Tensor bucket_weights, Tensor d_start, Tensor d_len, Tensor argmax, int nbits, bool normalize) -> Tensor");
  // MaxSim through a projection head, fused (torch_binding.h): no autograd
  // (training's forward takes the argmax), sm_90a CUDA kernel; other devices
  // take the composition in head.py.
  ops.def(
      "head_forward(Tensor q, Tensor h, Tensor w, Tensor? b, Tensor? q_mask, Tensor? d_mask, bool normalize, "
      "bool with_argmax) -> (Tensor, Tensor)");
  // Its training backward from the winners (head.py), CUDA kernels; other
  // devices take the composition in head.py.
  ops.def(
      "head_winner_grad(Tensor unit, Tensor q, Tensor grad, Tensor idx, bool normalize, bool need_dp) -> "
      "(Tensor dq, Tensor dp, Tensor db)");
  ops.def("head_scatter_rows(Tensor rows, Tensor idx, int ld, bool per_query) -> Tensor");
  // The composition's row normalisation in training (head.py), CUDA
  // kernels; other devices take F.normalize.
  ops.def("head_normalize(Tensor x) -> Tensor");
  ops.def("head_normalize_backward(Tensor grad, Tensor x) -> Tensor");
  // The CUDA forward's plan for a call's shape facts (forward_plan.h): no
  // tensors, one implementation for every backend.
  ops.def(
      "plan_forward(int layout, int nq, int nd, int tq, int td, int pairs, int lq, int dim, ScalarType dtype, "
      "bool quant, bool uniform_doc_scales, bool argmax, int precision, bool normalize, int ptr_align, int arch, "
      "int sm_count, str force) -> str",
      &maxsim::plan_forward);
  // The calling thread's planner override (maxsim.plan.forcing).
  ops.def("set_forced_family(str family) -> str", &maxsim::set_forced_family);
  // The CPU kernels are [torch] sources: every variant has them.
  ops.impl("forward", torch::kCPU, &maxsim::forward_cpu);
  ops.impl("forward_train", torch::kCPU, &maxsim::forward_train_of<&maxsim::forward_cpu>);
  ops.impl("forward_quant", torch::kCPU, &maxsim::forward_quant_cpu);
  ops.impl("quantize", torch::kCPU, &maxsim::quantize_cpu);
  ops.impl("block_topk", torch::kCPU, &maxsim::block_topk_cpu);
  ops.impl("decode_keys", torch::kCPU, &maxsim::decode_keys_cpu);
  ops.impl("rescore_topk", torch::kCPU, &maxsim::rescore_topk_cpu);
  ops.impl("backward", torch::kCPU, &maxsim::backward_of<&maxsim::backward_cpu>);
  ops.impl("segments", torch::kCPU, &maxsim::segments_cpu);
  ops.impl("uniform_segments", torch::kCPU, &maxsim::uniform_segments_cpu);
  ops.impl("plaid_approx", torch::kCPU, &maxsim::plaid_approx_cpu);
  ops.impl("plaid_forward", torch::kCPU, &maxsim::plaid_forward_cpu);
  ops.impl("plaid_backward", torch::kCPU, &maxsim::plaid_backward_cpu);
#if defined(CUDA_KERNEL)
  ops.impl("forward", torch::kCUDA, &maxsim::forward_cuda);
  ops.impl("forward_train", torch::kCUDA, &maxsim::forward_train_cuda);
  ops.impl("forward_quant", torch::kCUDA, &maxsim::forward_quant_cuda);
  ops.impl("quantize", torch::kCUDA, &maxsim::quantize_cuda);
  ops.impl("block_topk", torch::kCUDA, &maxsim::block_topk_cuda);
  ops.impl("decode_keys", torch::kCUDA, &maxsim::decode_keys_cuda);
  ops.impl("rescore_topk", torch::kCUDA, &maxsim::rescore_topk_cuda);
  ops.impl("backward", torch::kCUDA, &maxsim::backward_cuda);
  ops.impl("segments", torch::kCUDA, &maxsim::segments_cuda);
  ops.impl("uniform_segments", torch::kCUDA, &maxsim::uniform_segments_cuda);
  ops.impl("plaid_approx", torch::kCUDA, &maxsim::plaid_approx_cuda);
  ops.impl("plaid_forward", torch::kCUDA, &maxsim::plaid_forward_cuda);
  ops.impl("plaid_backward", torch::kCUDA, &maxsim::plaid_backward_cuda);
  ops.impl("head_forward", torch::kCUDA, &maxsim::head_forward_cuda);
  ops.impl("head_winner_grad", torch::kCUDA, &maxsim::head_winner_grad_cuda);
  ops.impl("head_scatter_rows", torch::kCUDA, &maxsim::head_scatter_rows_cuda);
  ops.impl("head_normalize", torch::kCUDA, &maxsim::head_normalize_cuda);
  ops.impl("head_normalize_backward", torch::kCUDA, &maxsim::head_normalize_backward_cuda);
#endif
#if defined(METAL_KERNEL)
  ops.impl("forward", torch::kMPS, &maxsim::forward_mps);
  ops.impl("forward_train", torch::kMPS, &maxsim::forward_train_of<&maxsim::forward_mps>);
  ops.impl("backward", torch::kMPS, &maxsim::backward_of<&maxsim::backward_mps>);
#endif
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
