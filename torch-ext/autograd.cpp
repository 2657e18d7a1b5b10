// Autograd for forward_train, in C++ for every backend: the forward saves
// the winning document-token index per (pair, query row) and, under
// normalize on CUDA, the inverse row norms its kernels read, nothing else;
// the backward calls the backward op (dq by gather, dd by a destination-owned
// reduction) for the inputs that need a gradient.
//
// The autograd kernel also takes q / d of any rank [..., dim] and returns
// scores shaped by layout ([Nq, Nd] CROSS, [Nq, K] GROUPED, [P] LIST): the
// flatten and the reshape happen inside the node, where autograd records
// nothing, instead of as three view nodes per training step in Python
// (~7 us each on the host).
//
// Why C++ and not torch.library.register_autograd: the Python wrapper cost
// ~140 us per forward (schema default filling) and a GIL round trip on the
// autograd thread per backward, more than the kernels of a typical
// contrastive step take on a GPU. Both halves only call dispatcher ops, so
// torch.compile and CUDA-graph capture trace through them.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "registration.h"
#include "torch_binding.h"

namespace maxsim {
namespace {

#define MAXSIM_STR_(x) #x
#define MAXSIM_STR(x) MAXSIM_STR_(x)
constexpr const char* kNs = MAXSIM_STR(TORCH_EXTENSION_NAME);

using at::Tensor;
using OptTensor = std::optional<Tensor>;

OptTensor opt(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

std::tuple<Tensor, Tensor, Tensor> call_forward_train(const Tensor& q, const Tensor& q_start, const Tensor& q_len,
                                                      const OptTensor& q_mask, const Tensor& d, const Tensor& d_start,
                                                      const Tensor& d_len, const OptTensor& d_mask,
                                                      const OptTensor& pair_q, const OptTensor& pair_d,
                                                      int64_t layout, int64_t lq, int64_t argmax_kind,
                                                      int64_t precision, bool normalize) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow((std::string(kNs) + "::forward_train").c_str(), "")
                       .typed<std::tuple<Tensor, Tensor, Tensor>(
                           const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const Tensor&,
                           const Tensor&, const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, int64_t,
                           int64_t, int64_t, int64_t, bool)>();
  return op.call(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d, layout, lq, argmax_kind,
                 precision, normalize);
}

std::tuple<Tensor, Tensor> call_backward(const Tensor& grad, const Tensor& q, const Tensor& q_start,
                                         const Tensor& q_len, const Tensor& d, const Tensor& d_start,
                                         const Tensor& d_len, const OptTensor& pair_q, const OptTensor& pair_d,
                                         const Tensor& argmax, int64_t layout, const OptTensor& q_ptr,
                                         const OptTensor& q_pairs, const OptTensor& d_ptr,
                                         const OptTensor& d_pairs, bool need_dq, bool need_dd, bool normalize,
                                         const OptTensor& inv_norms) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow((std::string(kNs) + "::backward").c_str(), "")
                       .typed<std::tuple<Tensor, Tensor>(
                           const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const Tensor&, const OptTensor&, const OptTensor&, const Tensor&, int64_t,
                           const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, bool, bool,
                           bool, const OptTensor&)>();
  return op.call(grad, q, q_start, q_len, d, d_start, d_len, pair_q, pair_d, argmax, layout, q_ptr, q_pairs, d_ptr,
                 d_pairs, need_dq, need_dd, normalize, inv_norms);
}

// Stable grouping of pair indices by id: (ptr [n+1], pairs [P]); ids outside
// [0, n) fall outside every group. No host synchronisation.
std::pair<Tensor, Tensor> csr(const Tensor& ids, int64_t n) {
  const Tensor ids64 = ids.to(at::kLong);
  const Tensor order = std::get<1>(at::sort(ids64, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const Tensor ptr = at::searchsorted(ids64.index_select(0, order), at::arange(n + 1, ids64.options()));
  return {ptr.to(at::kInt), order.to(at::kInt)};
}

// [T, dim] view of a [..., dim] token tensor.
Tensor rows2d(const Tensor& x) { return x.dim() <= 2 ? x : x.reshape({-1, x.size(-1)}); }

std::vector<int64_t> score_shape(int64_t layout, int64_t nq, int64_t nd, int64_t P) {
  if (layout == kCross) return {nq, nd};
  if (layout == kGrouped && nq > 0 && P == nd) return {nq, nd / nq};
  return {P};
}

struct ForwardTrain : public torch::autograd::Function<ForwardTrain> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& q,
                                                const Tensor& q_start, const Tensor& q_len, const OptTensor& q_mask,
                                                const Tensor& d, const Tensor& d_start, const Tensor& d_len,
                                                const OptTensor& d_mask, const OptTensor& pair_q,
                                                const OptTensor& pair_d, int64_t layout, int64_t lq,
                                                int64_t argmax_kind, int64_t precision, bool normalize) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [scores, argmax, inv_norms] = call_forward_train(rows2d(q), q_start, q_len, q_mask, rows2d(d), d_start, d_len,
                                                          d_mask, pair_q, pair_d, layout, lq, argmax_kind, precision,
                                                          normalize);
    ctx->saved_data["layout"] = layout;
    ctx->saved_data["normalize"] = normalize;
    ctx->saved_data["has_argmax"] = argmax_kind != 0;
    // needs_input_grad counts tensor inputs only: d follows q, q_start,
    // q_len and q_mask when one was given.
    ctx->saved_data["d_edge"] = (int64_t)(q_mask.has_value() && q_mask->defined() ? 4 : 3);
    ctx->save_for_backward({q, q_start, q_len, d, d_start, d_len, pair_q.value_or(Tensor()), pair_d.value_or(Tensor()),
                            argmax, inv_norms});
    ctx->mark_non_differentiable({argmax, inv_norms});
    // No zero-filled gradient for the (integer) argmax output: one kernel
    // per training step otherwise.
    ctx->set_materialize_grads(false);
    return {scores.view(score_shape(layout, q_start.size(0), d_start.size(0), scores.size(0))), argmax, inv_norms};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(ctx->saved_data["has_argmax"].toBool(),
                "maxsim: this call was made without keeping the argmax needed for gradients; use the *_train "
                "variant or maxsim()");
    if (!grads[0].defined()) return torch::autograd::variable_list(15);
    const auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &q_start = s[1], &q_len = s[2], &d = s[3], &d_start = s[4], &d_len = s[5];
    const Tensor &pair_q = s[6], &pair_d = s[7], &argmax = s[8], &inv_norms = s[9];
    const int64_t layout = ctx->saved_data["layout"].toInt();
    const bool need_dq = ctx->needs_input_grad(0), need_dd = ctx->needs_input_grad(ctx->saved_data["d_edge"].toInt());
    OptTensor q_ptr, q_pairs, d_ptr, d_pairs;
    if (layout == kList) {
      if (need_dq) std::tie(q_ptr, q_pairs) = csr(pair_q, q_start.size(0));
      if (need_dd) std::tie(d_ptr, d_pairs) = csr(pair_d, d_start.size(0));
    }
    auto [dq, dd] = call_backward(grads[0].contiguous().view(-1).to(at::kFloat), rows2d(q), q_start, q_len, rows2d(d),
                                  d_start, d_len, opt(pair_q), opt(pair_d), argmax, layout, q_ptr, q_pairs, d_ptr,
                                  d_pairs, need_dq, need_dd, ctx->saved_data["normalize"].toBool(), opt(inv_norms));
    torch::autograd::variable_list out(15);
    if (need_dq) out[0] = dq.view(q.sizes());
    if (need_dd) out[4] = dd.view(d.sizes());
    return out;
  }
};

std::tuple<Tensor, Tensor, Tensor> forward_train_autograd(const Tensor& q, const Tensor& q_start, const Tensor& q_len,
                                                          const OptTensor& q_mask, const Tensor& d,
                                                          const Tensor& d_start, const Tensor& d_len,
                                                          const OptTensor& d_mask, const OptTensor& pair_q,
                                                          const OptTensor& pair_d, int64_t layout, int64_t lq,
                                                          int64_t argmax_kind, int64_t precision, bool normalize) {
  auto out = ForwardTrain::apply(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d, layout, lq,
                                 argmax_kind, precision, normalize);
  return {out[0], out[1], out[2]};
}

}  // namespace
}  // namespace maxsim

TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, Autograd, m) {
  m.impl("forward_train", &maxsim::forward_train_autograd);
}
