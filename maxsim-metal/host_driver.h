// Host side of the Metal backend that does not touch Metal: argument checks,
// output allocation, kernel choice, parameters and the exact list of
// dispatches (kernel name, grid, threadgroup size, threadgroup memory,
// buffer bindings). maxsim.mm encodes these commands on torch's MPS stream;
// the emulator binding (emu/emu_binding.cpp) runs the same commands on the
// CPU, so everything but the Metal API calls is exercised in CI.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "launch_geometry.h"

namespace maxsim {
namespace metal_host {

// One buffer binding: a tensor (setBuffer, at its storage offset) or a small
// struct copied by value (setBytes).
struct Arg {
  int index = 0;
  at::Tensor tensor;
  std::vector<unsigned char> bytes;
};

struct Command {
  const char* kernel = nullptr;  // Metal function name
  MsLaunch launch{};
  std::vector<Arg> args;
};

struct ForwardPlan {
  at::Tensor scores, argmax;
  std::vector<Command> commands;
};

struct BackwardPlan {
  at::Tensor dq, dd;
  std::vector<Command> commands;
};

inline int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MS_F32;
    case at::kHalf: return MS_F16;
    case at::kBFloat16: return MS_BF16;
    default: return -1;
  }
}

template <class S>
inline Arg bytes_arg(int index, const S& s) {
  Arg a;
  a.index = index;
  a.bytes.resize(sizeof(S));
  std::memcpy(a.bytes.data(), &s, sizeof(S));
  return a;
}

// A buffer binding; absent or empty tensors bind `dummy` (never read: the
// parameters tell the kernel so), as Metal wants a real buffer at every index
// the function declares.
inline Arg tensor_arg(int index, const at::Tensor& t, const at::Tensor& dummy) {
  Arg a;
  a.index = index;
  a.tensor = (t.defined() && t.numel() > 0) ? t : dummy;
  return a;
}
inline Arg tensor_arg(int index, const std::optional<at::Tensor>& t, const at::Tensor& dummy) {
  return tensor_arg(index, t.has_value() ? *t : at::Tensor(), dummy);
}

inline void check_index(const at::Tensor& t, c10::DeviceType dev, const char* who, const char* name) {
  TORCH_CHECK(t.device().type() == dev && t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(),
              "maxsim ", who, ": ", name, " must be a contiguous 1-D int32 tensor on the ", c10::DeviceTypeName(dev),
              " device");
}

inline void check_floats(const at::Tensor& q, const at::Tensor& d, c10::DeviceType dev, const char* who) {
  TORCH_CHECK(q.device().type() == dev && d.device().type() == dev, "maxsim ", who, ": q and d must be ",
              c10::DeviceTypeName(dev), " tensors");
  TORCH_CHECK(q.dim() == 2 && d.dim() == 2 && q.size(1) == d.size(1),
              "maxsim ", who, ": q and d must be [T, dim] with the same dim");
  TORCH_CHECK(q.scalar_type() == d.scalar_type() && dtype_code(q.scalar_type()) >= 0,
              "maxsim ", who, ": q and d must share dtype float32, float16 or bfloat16");
  TORCH_CHECK(q.is_contiguous() && d.is_contiguous(), "maxsim ", who, ": q, d must be contiguous");
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(q.size(0) <= kMax && d.size(0) <= kMax && q.size(1) <= kMax,
              "maxsim ", who, ": token counts and dim must fit in int32");
}

inline int64_t num_pairs(int64_t layout, int64_t Nq, int64_t Nd, const std::optional<at::Tensor>& pair_q,
                         const std::optional<at::Tensor>& pair_d, c10::DeviceType dev, const char* who) {
  if (layout == MS_CROSS) return Nq * Nd;
  if (layout == MS_GROUPED) {
    TORCH_CHECK(Nq > 0 ? Nd % Nq == 0 : Nd == 0, "maxsim ", who, ": GROUPED needs Nd % Nq == 0");
    return Nd;
  }
  TORCH_CHECK(pair_q.has_value() && pair_d.has_value(), "maxsim ", who, ": LIST needs pair_q, pair_d");
  check_index(*pair_q, dev, who, "pair_q");
  check_index(*pair_d, dev, who, "pair_d");
  TORCH_CHECK(pair_q->numel() == pair_d->numel(), "maxsim ", who, ": pair_q/pair_d size mismatch");
  return pair_q->numel();
}

// ---------------------------------------------------------------------------
// forward (ForwardFn of torch_binding.h)
// ---------------------------------------------------------------------------
inline ForwardPlan plan_forward(const at::Tensor& q, const at::Tensor& q_start, const at::Tensor& q_len,
                                const std::optional<at::Tensor>& q_mask, const at::Tensor& d,
                                const at::Tensor& d_start, const at::Tensor& d_len,
                                const std::optional<at::Tensor>& d_mask, const std::optional<at::Tensor>& pair_q,
                                const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
                                int64_t argmax_kind, bool mma, c10::DeviceType dev, const char* who) {
  check_floats(q, d, dev, who);
  check_index(q_start, dev, who, "q_start");
  check_index(q_len, dev, who, "q_len");
  check_index(d_start, dev, who, "d_start");
  check_index(d_len, dev, who, "d_len");
  TORCH_CHECK(q_start.numel() == q_len.numel() && d_start.numel() == d_len.numel(),
              "maxsim ", who, ": start/len size mismatch");
  for (const auto* m : {&q_mask, &d_mask}) {
    if (!m->has_value()) continue;
    const at::Tensor& t = **m;
    TORCH_CHECK(t.device().type() == dev && t.scalar_type() == at::kBool && t.dim() == 1 && t.is_contiguous() &&
                    t.numel() == (m == &q_mask ? q : d).size(0),
                "maxsim ", who, ": masks must be contiguous bool [T] tensors");
  }
  TORCH_CHECK(layout >= MS_CROSS && layout <= MS_LIST, "maxsim ", who, ": bad layout ", layout);
  TORCH_CHECK(argmax_kind >= MS_ARGMAX_NONE && argmax_kind <= MS_ARGMAX_I16, "maxsim ", who,
              ": bad argmax_kind ", argmax_kind);
  TORCH_CHECK(lq >= 0 && lq <= std::numeric_limits<int32_t>::max(), "maxsim ", who, ": lq must be in [0, 2^31)");

  const int64_t Nq = q_start.numel(), Nd = d_start.numel();
  const int64_t P = num_pairs(layout, Nq, Nd, pair_q, pair_d, dev, who);

  ForwardPlan plan;
  plan.scores = at::empty({P}, q.options().dtype(at::kFloat));
  plan.argmax = argmax_kind == MS_ARGMAX_NONE
                    ? at::empty({0}, q.options().dtype(at::kInt))
                    : at::empty({P, lq}, q.options().dtype(argmax_kind == MS_ARGMAX_I16 ? at::kShort : at::kInt));
  if (P == 0) return plan;

  const MsFwdParams p =
      ms_fwd_params(q.size(0), d.size(0), Nq, Nd, P, int(q.size(1)), int(lq), int(layout), int(argmax_kind),
                    q_mask.has_value(), d_mask.has_value(), mma);
  const at::Tensor& dummy = plan.scores;
  Command c;
  c.kernel = ms_fwd_kernel_name(mma, dtype_code(q.scalar_type()));
  c.launch = ms_fwd_launch(p);
  c.args = {tensor_arg(MS_BUF_Q, q, dummy),
            tensor_arg(MS_BUF_D, d, dummy),
            tensor_arg(MS_BUF_Q_START, q_start, dummy),
            tensor_arg(MS_BUF_Q_LEN, q_len, dummy),
            tensor_arg(MS_BUF_D_START, d_start, dummy),
            tensor_arg(MS_BUF_D_LEN, d_len, dummy),
            tensor_arg(MS_BUF_Q_MASK, q_mask, dummy),
            tensor_arg(MS_BUF_D_MASK, d_mask, dummy),
            tensor_arg(MS_BUF_PAIR_Q, layout == MS_LIST ? pair_q : std::nullopt, dummy),
            tensor_arg(MS_BUF_PAIR_D, layout == MS_LIST ? pair_d : std::nullopt, dummy),
            tensor_arg(MS_BUF_SCORES, plan.scores, dummy),
            tensor_arg(MS_BUF_ARGMAX, plan.argmax, dummy),
            bytes_arg(MS_BUF_FWD_PARAMS, p)};
  plan.commands.push_back(std::move(c));
  return plan;
}

// ---------------------------------------------------------------------------
// backward (BackwardFn of torch_binding.h)
// ---------------------------------------------------------------------------
inline BackwardPlan plan_backward(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& q_start,
                                  const at::Tensor& q_len, const at::Tensor& d, const at::Tensor& d_start,
                                  const at::Tensor& d_len, const std::optional<at::Tensor>& pair_q,
                                  const std::optional<at::Tensor>& pair_d, const at::Tensor& argmax,
                                  int64_t layout, const std::optional<at::Tensor>& q_ptr,
                                  const std::optional<at::Tensor>& q_pairs, const std::optional<at::Tensor>& d_ptr,
                                  const std::optional<at::Tensor>& d_pairs, bool need_dq, bool need_dd,
                                  c10::DeviceType dev, const char* who) {
  check_floats(q, d, dev, who);
  check_index(q_start, dev, who, "q_start");
  check_index(q_len, dev, who, "q_len");
  check_index(d_start, dev, who, "d_start");
  check_index(d_len, dev, who, "d_len");
  TORCH_CHECK(q_start.numel() == q_len.numel() && d_start.numel() == d_len.numel(),
              "maxsim ", who, ": start/len size mismatch");
  TORCH_CHECK(layout >= MS_CROSS && layout <= MS_LIST, "maxsim ", who, ": bad layout ", layout);
  TORCH_CHECK(argmax.device().type() == dev && argmax.is_contiguous() &&
                  (argmax.scalar_type() == at::kInt || argmax.scalar_type() == at::kShort) &&
                  (argmax.dim() == 2 || argmax.numel() == 0),
              "maxsim ", who, ": argmax must be a contiguous int32/int16 [P, lq] tensor");
  const int64_t Nq = q_start.numel(), Nd = d_start.numel();
  const int64_t P = argmax.dim() == 2 ? argmax.size(0) : 0;
  const int64_t lq = argmax.dim() == 2 ? argmax.size(1) : 0;
  TORCH_CHECK(lq <= std::numeric_limits<int32_t>::max(), "maxsim ", who, ": lq must fit in int32");
  TORCH_CHECK(grad.device().type() == dev && grad.scalar_type() == at::kFloat && grad.dim() == 1 &&
                  grad.is_contiguous() && (grad.numel() == P || P == 0),
              "maxsim ", who, ": grad must be a contiguous fp32 [P] tensor");
  const int64_t expectP = num_pairs(layout, Nq, Nd, pair_q, pair_d, dev, who);
  TORCH_CHECK(P == 0 || P == expectP, "maxsim ", who, ": argmax has ", P, " rows, expected ", expectP);
  if (layout == MS_LIST) {
    if (need_dq) {
      TORCH_CHECK(q_ptr.has_value() && q_pairs.has_value(), "maxsim ", who, ": LIST dq needs q_ptr, q_pairs");
      check_index(*q_ptr, dev, who, "q_ptr");
      check_index(*q_pairs, dev, who, "q_pairs");
      TORCH_CHECK(q_ptr->numel() == Nq + 1 && q_pairs->numel() == expectP, "maxsim ", who,
                  ": q_ptr/q_pairs size mismatch");
    }
    if (need_dd) {
      TORCH_CHECK(d_ptr.has_value() && d_pairs.has_value(), "maxsim ", who, ": LIST dd needs d_ptr, d_pairs");
      check_index(*d_ptr, dev, who, "d_ptr");
      check_index(*d_pairs, dev, who, "d_pairs");
      TORCH_CHECK(d_ptr->numel() == Nd + 1 && d_pairs->numel() == expectP, "maxsim ", who,
                  ": d_ptr/d_pairs size mismatch");
    }
  }

  BackwardPlan plan;
  // Rows no pair selects stay zero; every other row is written by its owner.
  plan.dq = need_dq ? at::zeros(q.sizes(), q.options()) : q.new_empty({0});
  plan.dd = need_dd ? at::zeros(d.sizes(), d.options()) : d.new_empty({0});
  if (P == 0 || lq == 0 || q.size(1) == 0) return plan;

  const int kind = argmax.scalar_type() == at::kShort ? MS_ARGMAX_I16 : MS_ARGMAX_I32;
  const MsBwdParams base =
      ms_bwd_base(q.size(0), d.size(0), Nq, Nd, P, int(q.size(1)), int(lq), int(layout), kind);
  const int dt = dtype_code(q.scalar_type());
  const bool list = layout == MS_LIST;
  const at::Tensor& dummy = grad;  // P > 0: never empty
  auto common = [&](Command& c, const at::Tensor& src) {
    c.args = {tensor_arg(MS_BUF_GRAD, grad, dummy),
              tensor_arg(MS_BUF_SRC, src, dummy),
              tensor_arg(MS_BUF_BQ_START, q_start, dummy),
              tensor_arg(MS_BUF_BQ_LEN, q_len, dummy),
              tensor_arg(MS_BUF_BD_START, d_start, dummy),
              tensor_arg(MS_BUF_BD_LEN, d_len, dummy),
              tensor_arg(MS_BUF_BPAIR_Q, list ? pair_q : std::nullopt, dummy),
              tensor_arg(MS_BUF_BPAIR_D, list ? pair_d : std::nullopt, dummy),
              tensor_arg(MS_BUF_BARGMAX, argmax, dummy)};
  };
  if (need_dq && Nq > 0) {
    const MsBwdParams p = ms_bwd_dq_params(base);
    Command c;
    c.kernel = ms_bwd_dq_kernel_name(dt);
    c.launch = ms_bwd_launch(p);
    common(c, d);
    c.args.push_back(tensor_arg(MS_BUF_CSR_PTR, list ? q_ptr : std::nullopt, dummy));
    c.args.push_back(tensor_arg(MS_BUF_CSR_PAIRS, list ? q_pairs : std::nullopt, dummy));
    c.args.push_back(tensor_arg(MS_BUF_OUT, plan.dq, dummy));
    c.args.push_back(bytes_arg(MS_BUF_BWD_PARAMS, p));
    plan.commands.push_back(std::move(c));
  }
  if (need_dd && Nd > 0) {
    const MsBwdParams p = ms_bwd_dd_params(base);
    Command c;
    c.kernel = ms_bwd_dd_kernel_name(dt);
    c.launch = ms_bwd_launch(p);
    common(c, q);
    c.args.push_back(tensor_arg(MS_BUF_CSR_PTR, list ? d_ptr : std::nullopt, dummy));
    c.args.push_back(tensor_arg(MS_BUF_CSR_PAIRS, list ? d_pairs : std::nullopt, dummy));
    c.args.push_back(tensor_arg(MS_BUF_OUT, plan.dd, dummy));
    c.args.push_back(bytes_arg(MS_BUF_BWD_PARAMS, p));
    plan.commands.push_back(std::move(c));
  }
  return plan;
}

}  // namespace metal_host
}  // namespace maxsim
