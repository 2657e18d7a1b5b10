// Python binding of the emulated Metal backend: forward / backward with the
// op contract of torch_binding.h, on CPU tensors. The host side is the very
// code maxsim.mm runs (host_driver.h: checks, outputs, parameters, dispatch
// list); only the last step differs: commands go to the emulator instead of
// an MTLComputeCommandEncoder.
#include <torch/extension.h>

#include <map>
#include <stdexcept>
#include <string>

#include "../host_driver.h"
#include "metal_emu.h"

namespace {

using maxsim::metal_host::Command;

std::string g_path = "auto";  // auto (= the emulated GPU has simdgroup_matrix) | mma | simt

bool use_mma() { return g_path != "simt"; }

// The emulator's counterpart of the encoder loop in maxsim.mm.
void run_commands(const std::vector<Command>& cmds) {
  for (const Command& c : cmds) {
    emu::Launch L;
    L.kernel = c.kernel;
    L.grid[0] = c.launch.grid_x, L.grid[1] = c.launch.grid_y, L.grid[2] = 1;
    L.threads[0] = c.launch.threads, L.threads[1] = 1, L.threads[2] = 1;
    L.smem_bytes = c.launch.smem_bytes;
    for (const auto& a : c.args) {
      if (a.tensor.defined()) {
        const at::Tensor& t = a.tensor;
        TORCH_CHECK(t.is_cpu(), "emulated Metal: bound tensors must be CPU tensors");
        const char* base = static_cast<const char*>(t.storage().data());
        L.set_buffer(a.index, base + t.storage_offset() * t.element_size(),
                     size_t(t.storage().nbytes()) - size_t(t.storage_offset() * t.element_size()));
      } else {
        L.set_bytes(a.index, a.bytes.data(), a.bytes.size());
      }
    }
    emu::run(L);
  }
}

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& q_start, const at::Tensor& q_len,
                                           const std::optional<at::Tensor>& q_mask, const at::Tensor& d,
                                           const at::Tensor& d_start, const at::Tensor& d_len,
                                           const std::optional<at::Tensor>& d_mask,
                                           const std::optional<at::Tensor>& pair_q,
                                           const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
                                           int64_t argmax_kind, bool /*tf32*/) {
  auto plan = maxsim::metal_host::plan_forward(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d,
                                               layout, lq, argmax_kind, use_mma(), c10::DeviceType::CPU,
                                               "forward_mps (emulated)");
  run_commands(plan.commands);
  return {plan.scores, plan.argmax};
}

std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& q_start,
                                            const at::Tensor& q_len, const at::Tensor& d, const at::Tensor& d_start,
                                            const at::Tensor& d_len, const std::optional<at::Tensor>& pair_q,
                                            const std::optional<at::Tensor>& pair_d, const at::Tensor& argmax,
                                            int64_t layout, const std::optional<at::Tensor>& q_ptr,
                                            const std::optional<at::Tensor>& q_pairs,
                                            const std::optional<at::Tensor>& d_ptr,
                                            const std::optional<at::Tensor>& d_pairs, bool need_dq, bool need_dd) {
  auto plan = maxsim::metal_host::plan_backward(grad, q, q_start, q_len, d, d_start, d_len, pair_q, pair_d, argmax,
                                                layout, q_ptr, q_pairs, d_ptr, d_pairs, need_dq, need_dd,
                                                c10::DeviceType::CPU, "backward_mps (emulated)");
  run_commands(plan.commands);
  return {plan.dq, plan.dd};
}

// Dispatch list of a forward call, for tests: [(kernel, grid, threads, smem)].
std::vector<std::tuple<std::string, std::vector<int64_t>, int64_t, int64_t>> forward_plan(
    const at::Tensor& q, const at::Tensor& q_start, const at::Tensor& q_len, const std::optional<at::Tensor>& q_mask,
    const at::Tensor& d, const at::Tensor& d_start, const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
    const std::optional<at::Tensor>& pair_q, const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
    int64_t argmax_kind) {
  auto plan = maxsim::metal_host::plan_forward(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d,
                                               layout, lq, argmax_kind, use_mma(), c10::DeviceType::CPU, "plan");
  std::vector<std::tuple<std::string, std::vector<int64_t>, int64_t, int64_t>> out;
  for (const auto& c : plan.commands)
    out.emplace_back(c.kernel, std::vector<int64_t>{c.launch.grid_x, c.launch.grid_y, 1}, c.launch.threads,
                     c.launch.smem_bytes);
  return out;
}

// Raw dispatch of any kernel of the emulated library (self tests).
void launch(const std::string& kernel, std::vector<int64_t> grid, std::vector<int64_t> threads, int64_t smem,
            const std::map<int64_t, at::Tensor>& buffers) {
  emu::Launch L;
  L.kernel = kernel;
  for (int k = 0; k < 3; ++k) {
    L.grid[k] = k < int(grid.size()) ? grid[size_t(k)] : 1;
    L.threads[k] = k < int(threads.size()) ? threads[size_t(k)] : 1;
  }
  L.smem_bytes = smem;
  for (const auto& kv : buffers) {
    TORCH_CHECK(kv.second.is_cpu() && kv.second.is_contiguous(), "launch: contiguous CPU tensors only");
    L.set_buffer(int(kv.first), kv.second.data_ptr(), size_t(kv.second.nbytes()));
  }
  emu::run(L);
}

// Every argument left as None keeps its current value.
void configure(std::optional<std::string> path, std::optional<std::string> mode, std::optional<int64_t> workers,
               std::optional<double> timeout_s, std::optional<int64_t> schedule) {
  if (path) {
    TORCH_CHECK(*path == "auto" || *path == "mma" || *path == "simt", "path must be auto, mma or simt");
    g_path = *path;
  }
  if (mode) {
    if (*mode == "fibers")
      emu::config().mode = emu::kFibers;
    else if (*mode == "ucontext")
      emu::config().mode = emu::kUcontext;
    else if (*mode == "threads")
      emu::config().mode = emu::kThreads;
    else
      TORCH_CHECK(false, "mode must be fibers, ucontext or threads");
  }
  if (workers) emu::config().workers = int(*workers);
  if (timeout_s) emu::config().timeout_s = *timeout_s;
  if (schedule) emu::config().schedule = unsigned(*schedule);
}

std::map<std::string, std::string> settings() {
  static const char* modes[] = {"fibers", "ucontext", "threads"};
  return {{"path", g_path},
          {"mode", modes[emu::config().mode]},
          {"workers", std::to_string(emu::config().workers)},
          {"schedule", std::to_string(emu::config().schedule)}};
}

std::map<std::string, int64_t> geometry() {
  return {{"NT", MS_NT},          {"SIMD", MS_SIMD},     {"BM", MS_BM},         {"BN", MS_BN},
          {"BK", MS_BK},          {"QRES_MAX", MS_QRES_MAX}, {"BWD_DC", MS_BWD_DC}, {"BWD_ROWS", MS_BWD_ROWS},
          {"GRID_X_MAX", MS_GRID_X_MAX}};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "maxsim Metal kernels run by a CPU emulator of the Metal compute model";
  m.def("forward", &forward, "maxsim::forward (Metal kernels, emulated)");
  m.def("backward", &backward, "maxsim::backward (Metal kernels, emulated)");
  m.def("forward_plan", &forward_plan);
  m.def("launch", &launch, pybind11::arg("kernel"), pybind11::arg("grid"), pybind11::arg("threads"),
        pybind11::arg("smem"), pybind11::arg("buffers"));
  m.def("configure", &configure, pybind11::arg("path") = pybind11::none(), pybind11::arg("mode") = pybind11::none(),
        pybind11::arg("workers") = pybind11::none(), pybind11::arg("timeout_s") = pybind11::none(),
        pybind11::arg("schedule") = pybind11::none());
  m.def("settings", &settings);
  m.def("kernel_names", &emu::kernel_names);
  m.def("launch_counts", [] {
    std::map<std::string, int64_t> r;
    for (auto& kv : emu::launch_counts()) r[kv.first] = kv.second;
    return r;
  });
  m.def("fibers_native", &emu::fibers_native);
  m.def("geometry", &geometry);
}
