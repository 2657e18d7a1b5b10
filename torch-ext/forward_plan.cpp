// The plan_forward op: the CUDA forward planner (forward_plan.h) for a call's
// shape facts, as "key=value" words (maxsim.explain parses them). Compiled in
// every variant, so the CPU test suite checks the planner.
//
// arch -1: the current CUDA device, with the runtime's occupancy (CUDA
// variant only); otherwise a model of the named architecture (its shared
// memory and L2, and an occupancy estimate from each kernel's launch bounds,
// threads and shared memory): the kernel family and configuration are the
// device's, the split counts can differ where the estimate does.
#include <string>

#include "torch_binding.h"

namespace maxsim {
namespace {

struct ArchModel {
  int arch, sm_count;
  int64_t smem_optin, smem_per_sm, l2_bytes;
  int threads_per_sm, blocks_per_sm;
};

// The data-centre parts of each architecture the CUDA variant is built for.
constexpr ArchModel kArchModels[] = {
    {80, 108, 166912, 167936, 41943040, 2048, 32},   // A100
    {86, 84, 101376, 102400, 6291456, 1536, 16},     // A10 / RTX 30
    {89, 142, 101376, 102400, 100663296, 1536, 24},  // L40S
    {90, 132, 232448, 233472, 52428800, 2048, 32},   // H100 / H200
};

// Registers per thread assumed for the kernels without a min-blocks launch
// bound (streaming kernels).
constexpr int kModelRegs = 64;

int model_blocks(const ArchModel& m, const plan::KernelId& k) {
  int threads = 0, minb = 0;
  int64_t smem = 0;
  switch (k.family) {
    case plan::Family::kMma: {
      const plan::MmaConfig& c = plan::kMmaConfigs[k.cfg];
      threads = c.threads();
      minb = c.minb;
      smem = k.smem + plan::mma_static_smem(k.cfg, k.dtype == plan::Dtype::kI8 || k.dtype == plan::Dtype::kE4M3);
      break;
    }
    case plan::Family::kSimt:
      threads = 256;
      minb = 2;
      smem = 2 * 64 * 68 * 4;
      break;
    case plan::Family::kStream:
      threads = k.warps * 32;
      break;
    case plan::Family::kStreamWg:
      threads = plan::kStreamWgThreads;
      smem = plan::stream_wg_smem(k.ks, k.rows, plan::kStreamWgStages, k.argmax);
      break;
    case plan::Family::kPacked:
      threads = plan::kPackedThreads;
      minb = 2;
      smem = plan::packed_smem(k.ks) + 11 * 1024;  // + the document and column tables (static)
      break;
    default: return 1;
  }
  int b = std::min(m.blocks_per_sm, m.threads_per_sm / threads);
  if (smem > 0) b = std::min<int64_t>(b, m.smem_per_sm / (smem + 1024));
  b = std::min(b, minb > 0 ? minb : 65536 / (threads * kModelRegs));
  return std::max(b, 0);
}

plan::DeviceFacts model_facts(int64_t arch, int64_t sm_count) {
  for (const ArchModel& m : kArchModels) {
    if (m.arch != arch) continue;
    plan::DeviceFacts f;
    f.arch = m.arch;
    f.sm_count = sm_count > 0 ? (int)sm_count : m.sm_count;
    f.smem_optin = m.smem_optin;
    f.l2_bytes = m.l2_bytes;
    f.wgmma_built = m.arch == 90;
    f.blocks_per_sm = [m](const plan::KernelId& k) { return model_blocks(m, k); };
    return f;
  }
  MAXSIM_CHECK(false, "maxsim: plan_forward: no model of sm_%lld (known: 80, 86, 89, 90)", (long long)arch);
  return {};
}

// An override's name: a family, or a stream with its runs of pairs forced on
// ("stream_run", "stream_wg_run") or off ("stream_pair", "stream_wg_pair";
// Request::force_run).
struct Forced {
  plan::Family family;
  int run;
};

std::string run_mode_name(plan::Family f, int run) {
  return std::string(plan::family_name(f)) + (run > 0 ? "_run" : "_pair");
}

Forced forced_of(const std::string& name) {
  for (plan::Family f : {plan::Family::kStream, plan::Family::kStreamWg})
    for (int run : {1, -1})
      if (name == run_mode_name(f, run)) return {f, run};
  for (plan::Family f : {plan::Family::kStream, plan::Family::kStreamWg, plan::Family::kMma, plan::Family::kWgmma,
                         plan::Family::kSimt, plan::Family::kPacked})
    if (name == plan::family_name(f)) return {f, 0};
  MAXSIM_CHECK(name.empty(), "maxsim: plan_forward: unknown family '%s'", name.c_str());
  return {plan::Family::kNone, 0};
}

}  // namespace

std::string set_forced_family(std::string family) {
  const Forced f = forced_of(family);
  const plan::Family previous = plan::forced_family();
  const int previous_run = plan::forced_run();
  plan::forced_family() = f.family;
  plan::forced_run() = f.run;
  if (previous_run != 0) return run_mode_name(previous, previous_run);
  return previous == plan::Family::kNone ? std::string() : std::string(plan::family_name(previous));
}

std::string plan_forward(int64_t layout, int64_t nq, int64_t nd, int64_t tq, int64_t td, int64_t pairs, int64_t lq,
                         int64_t dim, at::ScalarType dtype, bool quant, bool uniform_doc_scales, bool argmax,
                         int64_t precision, bool normalize, int64_t ptr_align, int64_t arch, int64_t sm_count,
                         std::string force) {
  TORCH_CHECK(layout >= 0 && layout <= 2, "maxsim: plan_forward: bad layout");
  TORCH_CHECK(nq >= 0 && nd >= 0 && tq >= 0 && td >= 0 && pairs >= 0 && lq >= 0 && dim >= 1,
              "maxsim: plan_forward: sizes must be >= 0 (dim >= 1)");
  TORCH_CHECK(precision >= 0 && precision <= 2, "maxsim: plan_forward: bad precision");
  plan::Request r = forward_request(layout, nq, nd, tq, td, pairs, lq, dim, dtype, quant, uniform_doc_scales, argmax,
                                    precision, normalize);
  r.ptr_align = (int)ptr_align;
  if (!force.empty()) {
    const Forced f = forced_of(force);
    r.force = f.family;
    r.force_run = f.run;
  }
  plan::DeviceFacts dev;
  if (arch < 0) {
#if defined(CUDA_KERNEL)
    dev = cuda_device_facts();
    if (sm_count > 0) dev.sm_count = (int)sm_count;
#else
    TORCH_CHECK(false, "maxsim: plan_forward: arch -1 (the current device) needs the CUDA build");
#endif
  } else {
    dev = model_facts(arch, sm_count);
  }
  const plan::Plan p = plan::plan_forward(r, dev);
  TORCH_CHECK(p.ok, p.error);
  std::string out = std::string("family=") + plan::family_name(p.family);
  const auto put = [&](const char* key, int64_t v) { out += std::string(" ") + key + "=" + std::to_string(v); };
  put("arch", dev.arch);
  put("sm_count", dev.sm_count);
  put("mma_configs", plan::kNumMmaConfigs);
  switch (p.family) {
    case plan::Family::kStream:
      put("ks", p.stream.ks);
      put("rows", p.stream.rows);
      put("warps", p.stream.warps);
      put("split", p.stream.split);
      put("tail", p.stream.tail);
      put("run", p.stream.run);
      put("grid", p.grid);
      put("keep", p.keep);
      put("multiwave", p.multiwave);
      break;
    case plan::Family::kStreamWg:
      put("ks", p.stream_wg.ks);
      put("nq", p.stream_wg.nq);
      put("stages", p.stream_wg.stages);
      put("run", p.stream_wg.run);
      put("grid", p.grid);
      put("keep", p.keep);
      put("multiwave", p.multiwave);
      break;
    case plan::Family::kPacked:
      put("ks", p.packed.ks);
      put("rows", p.packed.rows);
      put("qpt", p.qpt);
      put("occupancy", p.occupancy);
      put("dpc", p.dpc);
      put("cpg", p.cpg);
      put("items", p.items);
      put("grid", p.grid);
      break;
    case plan::Family::kMma:
    case plan::Family::kWgmma:
    case plan::Family::kSimt:
      put("cfg", p.cfg);
      put("bm", p.bm);
      put("bn", p.bn);
      put("qpt", p.qpt);
      put("tpq", p.tpq);
      put("occupancy", p.occupancy);
      put("splits", p.splits);
      put("row_mode", p.row_mode);
      put("dpc", p.dpc);
      put("items", p.items);
      put("grid", p.grid);
      if (p.family == plan::Family::kMma) put("split", p.split);
      if (p.family == plan::Family::kWgmma) {
        put("nkb", p.wgmma.nkb);
        put("scale", p.wgmma.scale);
        put("multi", p.wgmma.multi);
        put("flags", plan::wgmma_flags(p, r, dev, std::min<int64_t>(p.items, (int64_t)1 << 30)));
      }
      break;
    default: break;
  }
  return out;
}

}  // namespace maxsim
