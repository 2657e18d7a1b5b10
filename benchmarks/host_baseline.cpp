// The host-time baseline of benchmarks/host_time.py: a custom op built the
// way maxsim's forward_train is (schema in a TORCH_LIBRARY, a C++
// torch::autograd::Function on the Autograd key that calls the device
// kernel and, in backward, a second op through the dispatcher), with
// kernels that do nothing but allocate the same outputs and issue a given
// number of launches (fills). Its step time is what any C++ autograd op of
// that launch count costs on this host; maxsim's excess over it is ours.
// Built at benchmark time by torch.utils.cpp_extension.load; not part of the
// package.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace {

using at::Tensor;

std::tuple<Tensor, Tensor> fwd_kernel(const Tensor& q, const Tensor& d, int64_t pairs, int64_t lq,
                                      int64_t launches) {
  Tensor scores = at::empty({pairs}, q.options().dtype(at::kFloat));
  Tensor argmax = at::empty({pairs, lq}, q.options().dtype(at::kShort));
  for (int64_t i = 0; i < launches; ++i) scores.fill_(0);
  return {scores, argmax};
}

std::tuple<Tensor, Tensor> bwd_kernel(const Tensor& grad, const Tensor& q, const Tensor& d, const Tensor& argmax,
                                      int64_t launches) {
  Tensor dq = at::empty_like(q), dd = at::empty_like(d);
  for (int64_t i = 0; i < launches; ++i) (i % 2 ? dd : dq).fill_(0);
  return {dq, dd};
}

std::tuple<Tensor, Tensor> call_fwd(const Tensor& q, const Tensor& d, int64_t pairs, int64_t lq, int64_t launches) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("maxsim_host_baseline::fwd", "")
                       .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, int64_t, int64_t, int64_t)>();
  return op.call(q, d, pairs, lq, launches);
}

std::tuple<Tensor, Tensor> call_bwd(const Tensor& grad, const Tensor& q, const Tensor& d, const Tensor& argmax,
                                    int64_t launches) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("maxsim_host_baseline::bwd", "")
          .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t)>();
  return op.call(grad, q, d, argmax, launches);
}

struct Step : public torch::autograd::Function<Step> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& q,
                                                const Tensor& d, int64_t pairs, int64_t lq, int64_t fwd_launches,
                                                int64_t bwd_launches) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [scores, argmax] = call_fwd(q, d, pairs, lq, fwd_launches);
    ctx->saved_data["bwd_launches"] = bwd_launches;
    ctx->save_for_backward({q, d, argmax});
    ctx->mark_non_differentiable({argmax});
    ctx->set_materialize_grads(false);
    return {scores, argmax};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto [dq, dd] = call_bwd(grads[0], s[0], s[1], s[2], ctx->saved_data["bwd_launches"].toInt());
    return {dq, dd, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> step_autograd(const Tensor& q, const Tensor& d, int64_t pairs, int64_t lq,
                                         int64_t fwd_launches, int64_t bwd_launches) {
  auto out = Step::apply(q, d, pairs, lq, fwd_launches, bwd_launches);
  return {out[0], out[1]};
}

std::tuple<Tensor, Tensor> step_kernel(const Tensor& q, const Tensor& d, int64_t pairs, int64_t lq,
                                       int64_t fwd_launches, int64_t bwd_launches) {
  return call_fwd(q, d, pairs, lq, fwd_launches);
}

}  // namespace

TORCH_LIBRARY(maxsim_host_baseline, m) {
  m.def("fwd(Tensor q, Tensor d, int pairs, int lq, int launches) -> (Tensor, Tensor)");
  m.def("bwd(Tensor grad, Tensor q, Tensor d, Tensor argmax, int launches) -> (Tensor, Tensor)");
  m.def("step(Tensor q, Tensor d, int pairs, int lq, int fwd_launches, int bwd_launches) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(maxsim_host_baseline, CompositeExplicitAutograd, m) {
  m.impl("fwd", &fwd_kernel);
  m.impl("bwd", &bwd_kernel);
  m.impl("step", &step_kernel);
}

TORCH_LIBRARY_IMPL(maxsim_host_baseline, Autograd, m) { m.impl("step", &step_autograd); }
