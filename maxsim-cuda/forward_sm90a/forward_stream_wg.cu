// Staged wgmma forward kernels (forward_stream_wg.cuh): fp16 / bf16, the
// planner's stage count (plan::kStreamWgStages).
#include <ATen/cuda/CUDAContext.h>

#include "forward_stream_wg.cuh"
#include "../common/smem_opt_in.h"

namespace maxsim {
namespace cuda_fwd {
namespace {

constexpr int kNst = plan::kStreamWgStages;

// The kernel with its dynamic shared memory opted in (once per device).
template <typename T, int KS, int NQ, bool ARG>
auto prepared_stream_wg_kernel() {
  auto kern = stream_wg_kernel<T, KS, NQ, kNst, ARG>;
  static int set_bytes[kSmemOptInDevices] = {};
  opt_in_dynamic_smem(kern, stream_wg_smem(KS, NQ, kNst, ARG), set_bytes);
  return kern;
}

// Calls f(std::integral_constant<int, KS>, std::integral_constant<int, NQ>,
// std::integral_constant<bool, ARG>).
template <typename F>
auto with_stream_wg_shape(int ks, int nq, bool argmax, F&& f) {
  const auto by_arg = [&](auto k, auto n) {
    if (argmax) return f(k, n, std::true_type{});
    return f(k, n, std::false_type{});
  };
  const auto by_nq = [&](auto k) {
    if (nq <= 16) return by_arg(k, std::integral_constant<int, 16>{});
    if (nq <= 32) return by_arg(k, std::integral_constant<int, 32>{});
    if (nq <= 64) return by_arg(k, std::integral_constant<int, 64>{});
    return by_arg(k, std::integral_constant<int, 128>{});
  };
  if (ks == 4) return by_nq(std::integral_constant<int, 4>{});
  MAXSIM_CHECK(ks == 8, "maxsim: staged wgmma stream: rows of %d k steps not supported", ks);
  return by_nq(std::integral_constant<int, 8>{});
}

}  // namespace

template <typename T>
void run_stream_wg(const plan::StreamWgPlan& w, int64_t grid, const FwdParams& p, cudaStream_t st) {
  MAXSIM_CHECK(w.stages == kNst, "maxsim: staged wgmma stream: %d stages not built", w.stages);
  with_stream_wg_shape(w.ks, w.nq, p.argmax != nullptr, [&](auto k, auto n, auto a) {
    constexpr int KS = decltype(k)::value, NQ = decltype(n)::value;
    constexpr bool ARG = decltype(a)::value;
    launch_pdl(prepared_stream_wg_kernel<T, KS, NQ, ARG>(), dim3((unsigned)grid), dim3(kStreamWgThreads),
               stream_wg_smem(KS, NQ, kNst, ARG), st, p);
  });
}

template <typename T>
int stream_wg_blocks(int ks, int nq, bool argmax) {
  return with_stream_wg_shape(ks, nq, argmax, [&](auto k, auto n, auto a) {
    constexpr int KS = decltype(k)::value, NQ = decltype(n)::value;
    constexpr bool ARG = decltype(a)::value;
    static const int per_sm = stream_blocks_per_sm(prepared_stream_wg_kernel<T, KS, NQ, ARG>(), kStreamWgThreads,
                                                   stream_wg_smem(KS, NQ, kNst, ARG));
    return per_sm;
  });
}

template void run_stream_wg<__half>(const plan::StreamWgPlan&, int64_t, const FwdParams&, cudaStream_t);
template void run_stream_wg<__nv_bfloat16>(const plan::StreamWgPlan&, int64_t, const FwdParams&, cudaStream_t);
template int stream_wg_blocks<__half>(int, int, bool);
template int stream_wg_blocks<__nv_bfloat16>(int, int, bool);

}  // namespace cuda_fwd
}  // namespace maxsim
