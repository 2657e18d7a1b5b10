// Metal (MPS) backend of maxsim: forward_mps / backward_mps (torch_binding.h).
//
// Everything except Metal itself lives in host_driver.h (checks, outputs,
// kernel choice, parameters, dispatch list) and is exercised in CI through the
// emulator (emu/). This file only
//   * obtains the shader library: the metallib kernel-builder compiles and
//     embeds (EMBEDDED_METALLIB_HEADER), or else the source compiled at first
//     use with newLibraryWithSource (see metal_source() below),
//   * caches one compute pipeline per kernel,
//   * encodes the dispatches on torch's current MPS stream: on the stream's
//     serial dispatch queue, into its current compute command encoder, so they
//     are ordered with every other MPS op and committed with torch's command
//     buffer (no extra command buffer, no synchronisation).
#include <torch/torch.h>  // first, as other kernels-hub Metal kernels do

#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <dlfcn.h>

#include <cstdlib>
#include <exception>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "host_driver.h"
#include "normalize_rows.h"
#include "torch_binding.h"

#ifdef EMBEDDED_METALLIB_HEADER
#include EMBEDDED_METALLIB_HEADER
#endif
#ifdef MAXSIM_METAL_SOURCE_HEADER
#include MAXSIM_METAL_SOURCE_HEADER  // maxsim_metal_source[] (embed_source.py)
#endif

namespace maxsim {
namespace {

using metal_host::Command;

id<MTLDevice> mtl_device() { return at::mps::MPSDevice::getInstance()->device(); }

// The MTLBuffer behind an MPS tensor's storage (what
// at::native::mps::getMTLBufferStorage does); bind at storage_offset.
inline id<MTLBuffer> mtl_buffer(const at::Tensor& t) {
  return __builtin_bit_cast(id<MTLBuffer>, t.storage().data());
}

#if !defined(EMBEDDED_METALLIB_HEADER) && !defined(MAXSIM_METAL_SOURCE_HEADER)
std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::string();
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string dirname_of(const std::string& p) {
  const size_t s = p.find_last_of('/');
  return s == std::string::npos ? std::string(".") : p.substr(0, s);
}

// maxsim.metal with launch_geometry.h spliced in (newLibraryWithSource cannot
// resolve #include "..."); embed_source.py does the same offline.
std::string splice(const std::string& metal, const std::string& header) {
  std::istringstream in(metal);
  std::ostringstream out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("#include \"launch_geometry.h\"") != std::string::npos)
      out << header << "\n";
    else
      out << line << "\n";
  }
  return out.str();
}

// Source for the runtime compile, first found of: $MAXSIM_METAL_DIR, the
// directory this file was compiled from (local builds), the directory of the
// loaded binary.
std::string metal_source(std::string& tried) {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("MAXSIM_METAL_DIR")) dirs.emplace_back(env);
  dirs.push_back(dirname_of(__FILE__));
  Dl_info info;
  if (dladdr(reinterpret_cast<const void*>(&mtl_device), &info) && info.dli_fname) {
    const std::string so_dir = dirname_of(info.dli_fname);
    dirs.push_back(so_dir);
    dirs.push_back(so_dir + "/maxsim-metal");
  }
  for (const auto& dir : dirs) {
    tried += " " + dir;
    const std::string metal = read_text(dir + "/maxsim.metal");
    const std::string header = read_text(dir + "/launch_geometry.h");
    if (!metal.empty() && !header.empty()) return splice(metal, header);
  }
  return std::string();
}
#elif defined(MAXSIM_METAL_SOURCE_HEADER)
std::string metal_source(std::string&) { return std::string(maxsim_metal_source); }
#endif

id<MTLLibrary> library() {
  static std::once_flag once;
  static id<MTLLibrary> lib = nil;
  static std::string failure;
  std::call_once(once, [] {
    @autoreleasepool {
      NSError* error = nil;
#if defined(EMBEDDED_METALLIB_HEADER)
      // Prebuilt by kernel-builder from maxsim.metal (+ launch_geometry.h).
      dispatch_data_t data = dispatch_data_create(EMBEDDED_METALLIB_NAMESPACE::metallib_data,
                                                  EMBEDDED_METALLIB_NAMESPACE::metallib_data_len, nullptr,
                                                  DISPATCH_DATA_DESTRUCTOR_DEFAULT);
      lib = [mtl_device() newLibraryWithData:data error:&error];
#else
      std::string tried;
      const std::string src = metal_source(tried);
      if (src.empty()) {
        failure = "maxsim.metal / launch_geometry.h not found (looked in:" + tried +
                  "); set MAXSIM_METAL_DIR or build with the embedded metallib";
        return;
      }
      MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
      // Exact IEEE semantics (NaN propagation, no reassociation).
#if defined(__MAC_OS_X_VERSION_MAX_ALLOWED) && __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
      if (@available(macOS 15.0, *)) {
        options.mathMode = MTLMathModeSafe;
      } else {
        options.fastMathEnabled = NO;
      }
#else
      options.fastMathEnabled = NO;
#endif
      lib = [mtl_device() newLibraryWithSource:[NSString stringWithUTF8String:src.c_str()]
                                       options:options
                                         error:&error];
#if !__has_feature(objc_arc)
      [options release];
#endif
#endif
      if (lib == nil)
        failure = error ? std::string(error.localizedDescription.UTF8String) : std::string("unknown error");
    }
  });
  TORCH_CHECK(lib != nil, "maxsim: cannot load the Metal library: ", failure);
  return lib;
}

id<MTLComputePipelineState> pipeline(const char* name) {
  static std::mutex mu;
  static std::unordered_map<std::string, id<MTLComputePipelineState>> cache;
  std::lock_guard<std::mutex> guard(mu);
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  id<MTLComputePipelineState> pso = nil;
  std::string err;
  id<MTLLibrary> lib = library();
  @autoreleasepool {  // nothing throws inside: C++ exceptions must not cross the pool
    NSError* error = nil;
    id<MTLFunction> fn = [lib newFunctionWithName:[NSString stringWithUTF8String:name]];
    if (fn == nil) {
      err = "function not found in the library";
    } else {
      pso = [mtl_device() newComputePipelineStateWithFunction:fn error:&error];
#if !__has_feature(objc_arc)
      [fn release];
#endif
      if (pso == nil) err = error ? std::string(error.localizedDescription.UTF8String) : std::string("unknown error");
    }
  }
  TORCH_CHECK(pso != nil, "maxsim: cannot build the Metal pipeline for ", name, ": ", err);
  // The kernels are written for 32-wide SIMD groups and 128-thread threadgroups.
  TORCH_CHECK(long(pso.threadExecutionWidth) == long(MS_SIMD), "maxsim: ", name, " needs 32-wide SIMD groups, this GPU has ",
              (long)pso.threadExecutionWidth);
  TORCH_CHECK(long(pso.maxTotalThreadsPerThreadgroup) >= long(MS_NT), "maxsim: ", name, " allows only ",
              (long)pso.maxTotalThreadsPerThreadgroup, " threads per threadgroup, needs ", (int)MS_NT);
  cache.emplace(name, pso);
  return pso;
}

// simdgroup_matrix needs an Apple7+ GPU (M1 / A14 and later). Older GPUs (and
// MAXSIM_METAL_PATH=simt) take the scalar kernels.
bool use_mma() {
  static int v = -1;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("MAXSIM_METAL_PATH");
    if (env && std::string(env) == "simt")
      v = 0;
    else if (env && std::string(env) == "mma")
      v = 1;
    else
      v = [mtl_device() supportsFamily:MTLGPUFamilyApple7] ? 1 : 0;
  });
  return v == 1;
}

void run_commands(const std::vector<Command>& cmds) {
  if (cmds.empty()) return;
  std::vector<id<MTLComputePipelineState>> psos;
  psos.reserve(cmds.size());
  const NSUInteger max_tg_mem = mtl_device().maxThreadgroupMemoryLength;
  for (const Command& c : cmds) {
    psos.push_back(pipeline(c.kernel));
    TORCH_CHECK(NSUInteger(c.launch.smem_bytes) <= max_tg_mem, "maxsim: ", c.kernel, " needs ",
                c.launch.smem_bytes, " bytes of threadgroup memory, the device has ", (long)max_tg_mem);
  }
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  TORCH_CHECK(stream != nullptr, "maxsim: no current MPS stream");
  const std::vector<Command>* cmds_p = &cmds;
  const std::vector<id<MTLComputePipelineState>>* psos_p = &psos;
  __block std::exception_ptr failure = nullptr;
  dispatch_sync(stream->queue(), ^() {
    @autoreleasepool {
      try {
        id<MTLComputeCommandEncoder> encoder = stream->commandEncoder();
        TORCH_CHECK(encoder != nil, "maxsim: cannot get the MPS compute command encoder");
        for (size_t i = 0; i < cmds_p->size(); ++i) {
          const Command& c = (*cmds_p)[i];
          [encoder setComputePipelineState:(*psos_p)[i]];
          for (const auto& a : c.args) {
            if (a.tensor.defined()) {
              [encoder setBuffer:mtl_buffer(a.tensor)
                          offset:NSUInteger(a.tensor.storage_offset() * a.tensor.element_size())
                         atIndex:NSUInteger(a.index)];
            } else {
              [encoder setBytes:a.bytes.data() length:a.bytes.size() atIndex:NSUInteger(a.index)];
            }
          }
          if (c.launch.smem_bytes > 0)
            [encoder setThreadgroupMemoryLength:NSUInteger(c.launch.smem_bytes) atIndex:MS_TGMEM_INDEX];
          [encoder dispatchThreadgroups:MTLSizeMake(NSUInteger(c.launch.grid_x), NSUInteger(c.launch.grid_y), 1)
                  threadsPerThreadgroup:MTLSizeMake(NSUInteger(c.launch.threads), 1, 1)];
        }
      } catch (...) {
        failure = std::current_exception();
      }
    }
  });
  if (failure) std::rethrow_exception(failure);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> forward_mps(
    const at::Tensor& q, const at::Tensor& q_start, const at::Tensor& q_len,
    const std::optional<at::Tensor>& q_mask, const at::Tensor& d, const at::Tensor& d_start,
    const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
    const std::optional<at::Tensor>& pair_q, const std::optional<at::Tensor>& pair_d, int64_t layout,
    int64_t lq, int64_t argmax_kind, int64_t /*precision: fp32 is always exact on Metal*/, bool normalize) {
  // normalize: the composite form (normalize_rows.h), normalised fp32 copies.
  const at::Tensor qn = normalize ? normalized_rows(q) : q, dn = normalize ? normalized_rows(d) : d;
  auto plan = metal_host::plan_forward(qn, q_start, q_len, q_mask, dn, d_start, d_len, d_mask, pair_q, pair_d,
                                       layout, lq, argmax_kind, use_mma(),
                                       c10::DeviceType::MPS, "forward_mps");
  run_commands(plan.commands);
  return {plan.scores, plan.argmax};
}

std::tuple<at::Tensor, at::Tensor> backward_mps(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& q_start, const at::Tensor& q_len,
    const at::Tensor& d, const at::Tensor& d_start, const at::Tensor& d_len,
    const std::optional<at::Tensor>& pair_q, const std::optional<at::Tensor>& pair_d,
    const at::Tensor& argmax, int64_t layout, const std::optional<at::Tensor>& q_ptr,
    const std::optional<at::Tensor>& q_pairs, const std::optional<at::Tensor>& d_ptr,
    const std::optional<at::Tensor>& d_pairs, bool need_dq, bool need_dd, bool normalize) {
  // normalize: fp32 gradients w.r.t. the normalised copies, then the
  // Jacobian of the normalisation (normalize_rows.h).
  const at::Tensor qn = normalize ? normalized_rows(q) : q, dn = normalize ? normalized_rows(d) : d;
  auto plan = metal_host::plan_backward(grad, qn, q_start, q_len, dn, d_start, d_len, pair_q, pair_d, argmax,
                                        layout, q_ptr, q_pairs, d_ptr, d_pairs, need_dq, need_dd,
                                        c10::DeviceType::MPS, "backward_mps");
  run_commands(plan.commands);
  if (!normalize) return {plan.dq, plan.dd};
  return {need_dq ? normalize_backward(plan.dq, q, q.scalar_type()) : plan.dq,
          need_dd ? normalize_backward(plan.dd, d, d.scalar_type()) : plan.dd};
}

}  // namespace maxsim
