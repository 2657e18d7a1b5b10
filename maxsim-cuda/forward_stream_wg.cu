// Staged wgmma forward kernels (forward_stream_wg.cuh): fp16 / bf16.
#include <ATen/cuda/CUDAContext.h>

#include "forward_stream_wg.cuh"
#include "smem_opt_in.h"

namespace maxsim {
namespace cuda_fwd {
namespace {

template <typename T, int KS, int NQ, int NST>
bool launch_stream_wg(FwdParams p, bool forced, int64_t mean_ld, int num_sms, cudaStream_t st) {
  auto kern = stream_wg_kernel<T, KS, NQ, NST>;
  constexpr int smem = stream_wg_smem(KS, NQ, NST);
  static int set_bytes[kSmemOptInDevices] = {};
  opt_in_dynamic_smem(kern, smem, set_bytes);
  static const int per_sm = stream_blocks_per_sm(kern, kStreamWgThreads, smem);
  const int64_t wave = (int64_t)per_sm * num_sms;
  // Where the mma.sync stream stays (H100, session 32, graph us, stream ->
  // this kernel): documents shorter than a stage, whose CTA stages as many
  // query bytes as it reads document bytes (one query x 1000 documents of 32
  // tokens 5.9 -> 7.1, 10k 38.1 -> 59.0, 40k of 12 at dim 64 45.7 -> 95.1);
  // 128-byte rows in under three waves of one pair per CTA (1000 x 300
  // tokens, 1.26 waves: 11.7 -> 14.0; 4000 x 300: 56.0 -> 53.0).
  // Few pairs: one warpgroup per pair walks its stages in sequence, where
  // the mma.sync stream spreads a pair over up to 8 warps. Queries of 33-128
  // rows have no mma.sync stream: against the tile kernels this kernel wins
  // at every length and count measured (session 33, graph / do_bench us,
  // tile -> this: dim 128 lq 48 one query x 31 documents of 300 tokens
  // 10.0 / 24.9 -> 4.4 / 15.4, x 1000 of 32 13.7 / 17.7 -> 9.2 / 15.3; dim 64
  // lq 128 1000 x 1024 58.0 / 69.7 -> 51.0 / 58.3), except graph time at
  // dim 128 lq 128 over long documents in several waves (1000 x 1024 92.6 /
  // 104.4 -> 93.1 / 103.5; 200 x 4096 76.8 / 89.9 -> 79.0 / 90.6; 3000 x
  // 300 86.8 / 99.1 -> 90.2 / 91.3), where the do_bench time (cold L2)
  // gains too except at 4096 tokens. Few pairs of documents past 1024
  // tokens: one warpgroup walks each pair while the tile kernels split it
  // over the SMs. They keep up to a pair per two stages of a pair, and at
  // lq 128 (no padded query rows, their best case) fewer pairs than both
  // SMs / 2 and 4/3 of a pair's stages (session 34, dim 128 graph /
  // do_bench us, tile -> this: lq 48 16 x 2048 10.5 / 17.8 -> 14.2 / 18.0,
  // 24 x 4096 20.4 / 31.1 -> 26.3 / 32.4, 40 x 4096 30.1 / 39.3 -> 27.0 /
  // 31.2; lq 64 20 x 2048 15.3 / 22.5 -> 14.5 / 18.9; lq 100 30 x 4096 31.1
  // / 39.2 -> 35.9 / 39.8, 64 x 1500 26.5 / 35.0 -> 15.6 / 22.6; lq 128 32
  // x 2048 14.9 / 24.0 -> 19.7 / 23.9, 60 x 1500 19.6 / 30.0 -> 15.6 /
  // 21.9, 64 x 4096 35.6 / 46.7 -> 37.3 / 41.9, 100 x 4096 51.8 / 65.0 ->
  // 41.0 / 46.7).
  if (!forced && NQ <= 32 && (mean_ld < kStreamWgTokens || p.P < 32 || (KS == 4 && p.P < 3 * wave))) return false;
  if (!forced && NQ > 32 && mean_ld > 1024 &&
      (p.lq == 128 ? 2 * p.P < num_sms && 3 * kStreamWgTokens * p.P < 4 * mean_ld
                   : 2 * kStreamWgTokens * p.P <= mean_ld))
    return false;
  p.stream_multiwave = p.P > wave;
  // The streaming kernel's rule: scans of >= 12 waves load their first ~2.5
  // L2 sizes plainly (a dirty L2 drains up front).
  const int64_t prefix = p.stream_keep < 0 && p.P >= 12 * wave ? stream_plain_prefix(mean_ld * p.row_bytes) : 0;
  p.stream_keep = stream_plain_ctas(p, mean_ld, prefix);
  launch_pdl(kern, dim3((unsigned)p.P), dim3(kStreamWgThreads), smem, st, p);
  return true;
}

template <typename T, int KS, int NQ>
bool by_nst(const FwdParams& p, int nst, int64_t mean_ld, int num_sms, cudaStream_t st) {
  const bool forced = nst > 0;
  // Four stages (three CTAs per SM at 256-byte rows). H100, session 32,
  // graph us, 3 -> 4 stages: 1000 x 300 tokens 28.7 -> 29.0, 10k x 300
  // 245.6 -> 244.2, 1000 x 1024 88.5 -> 88.5, 600 x 1024 58.8 -> 55.9,
  // 64 x 4096 33.0 -> 28.6, 200 x 4096 72.4 -> 73.8; candidates 32 x 50 x
  // 180 28.0 -> 27.5, 20 x 100 x 200 37.5 -> 38.2. (With 1 KB more shared
  // memory, three stages ran three CTAs per SM and took 1000 x 1024 in 87.8
  // against 88.2.)
  if (!forced) nst = 4;
  if (nst == 3) return launch_stream_wg<T, KS, NQ, 3>(p, forced, mean_ld, num_sms, st);
  if (nst == 5) return launch_stream_wg<T, KS, NQ, 5>(p, forced, mean_ld, num_sms, st);
  return launch_stream_wg<T, KS, NQ, 4>(p, forced, mean_ld, num_sms, st);
}

template <typename T, int KS>
bool by_nq(const FwdParams& p, int nst, int64_t mean_ld, int num_sms, cudaStream_t st) {
  if (p.lq <= 16) return by_nst<T, KS, 16>(p, nst, mean_ld, num_sms, st);
  if (p.lq <= 32) return by_nst<T, KS, 32>(p, nst, mean_ld, num_sms, st);
  if (p.lq <= 64) return by_nst<T, KS, 64>(p, nst, mean_ld, num_sms, st);
  return by_nst<T, KS, 128>(p, nst, mean_ld, num_sms, st);
}

}  // namespace

template <typename T>
bool run_stream_wg(const FwdParams& p, int nst, int64_t mean_ld, int num_sms, cudaStream_t st) {
  if (p.row_bytes == 128) return by_nq<T, 4>(p, nst, mean_ld, num_sms, st);
  return by_nq<T, 8>(p, nst, mean_ld, num_sms, st);
}
template bool run_stream_wg<__half>(const FwdParams&, int, int64_t, int, cudaStream_t);
template bool run_stream_wg<__nv_bfloat16>(const FwdParams&, int, int64_t, int, cudaStream_t);

}  // namespace cuda_fwd
}  // namespace maxsim
