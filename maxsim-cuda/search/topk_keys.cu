// Search helpers: (score, document id) packed into int64 keys ordered by
// "higher score, then lower id" (see torch-ext/maxsim/retrieval.py), so an
// exact, deterministic top-k is one torch topk over unique keys, and blocks,
// streams and ranks merge by another topk. One kernel each way instead of a
// dozen elementwise ops.
// block_topk, k < 1024: each CTA takes a chunk of up to 12288 keys and
// selects its top k (topk_select.cuh); rows longer than a chunk repeat the
// select over the chunks' winners. A torch topk over 10k int64 keys is a
// multi-pass radix select of several launches (longer than a 10k-document
// int8 scan).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "search_keys.h"
#include "../common/smem_opt_in.h"
#include "topk_select.cuh"
#include "torch_binding.h"

namespace maxsim {
namespace {

__global__ void encode_keys_kernel(const float* __restrict__ s, const int64_t* __restrict__ ids,
                                   int64_t* __restrict__ out, int64_t total, int64_t n, int64_t id0) {
  pdl_enter();
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < total) out[i] = search_keys::encode_id(s[i], ids ? ids[i] : id0 + i % n);
}

__global__ void decode_keys_kernel(const int64_t* __restrict__ k, float* __restrict__ s, int64_t* __restrict__ ids,
                                   int64_t total) {
  pdl_enter();
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < total) search_keys::decode(k[i], s[i], ids[i]);
}

// One select round over m values per row in chunks of `chunk`.
template <int T, bool KEYS>
void launch_select(const void* src, const int64_t* ids, int64_t R, int64_t m, int64_t id0, int64_t nchunks,
                   int64_t chunk, int64_t kk, int64_t* out, cudaStream_t stream) {
  using namespace topk_select;
  auto kernel = select_kernel<T, KEYS>;
  const int smem = kBytesPerKey * (int)chunk;
  static int set_bytes[kSmemOptInDevices] = {};
  opt_in_dynamic_smem(kernel, smem, set_bytes);
  launch_pdl(kernel, dim3((unsigned)(R * nchunks)), dim3(T), smem, stream, src, ids, m, id0, (int)nchunks, (int)chunk,
             (int)kk, out);
}

// Keys one select_kernel CTA holds on the current device: kChunk, or fewer
// where the opt-in shared memory per block is smaller (99 KB on sm_86 /
// sm_89, 163 KB on sm_80, against 12 bytes per key plus the static part).
int64_t select_chunk_cap() {
  static int64_t cap[64] = {0};
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 64 && cap[dev] > 0) return cap[dev];
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, topk_select::select_kernel<512, false>));
  const int64_t fit = ((int64_t)optin - (int64_t)attr.sharedSizeBytes) / topk_select::kBytesPerKey / 256 * 256;
  const int64_t c = std::max<int64_t>(1024, std::min<int64_t>(topk_select::kChunk, fit));
  if (dev < 64) cap[dev] = c;
  return c;
}

}  // namespace

at::Tensor block_topk_cuda(const at::Tensor& scores, int64_t id0, int64_t k, const c10::optional<at::Tensor>& ids) {
  TORCH_CHECK(scores.is_cuda() && scores.scalar_type() == at::kFloat && scores.dim() == 2,
              "maxsim: block_topk takes fp32 [rows, n] CUDA scores");
  TORCH_CHECK(k >= 0 && id0 >= 0 && id0 + scores.size(1) < search_keys::kLow, "maxsim: block_topk: bad k / id range");
  TORCH_CHECK(!ids || (ids->device() == scores.device() && ids->scalar_type() == at::kLong &&
                       ids->sizes() == scores.sizes()),
              "maxsim: block_topk: ids must be int64 with the scores' shape and device");
  c10::cuda::CUDAGuard guard(scores.device());
  const at::Tensor s = scores.contiguous();
  const at::Tensor idt = ids ? ids->contiguous() : at::Tensor();
  const int64_t* ip = ids ? idt.data_ptr<int64_t>() : nullptr;
  const int64_t R = s.size(0), n = s.size(1);
  const int64_t kk = std::min<int64_t>(k, n);
  auto stream = at::cuda::getCurrentCUDAStream();
  if (kk < topk_select::kMaxK && R > 0 && n > 0) {
    using namespace topk_select;
    at::Tensor cur = at::empty({R, 0}, s.options().dtype(at::kLong));
    if (kk == 0) return cur;
    // Chunks of the scores, then rounds over the chunks' winners until one
    // chunk per row remains (sizes known here: no host sync).
    int64_t m = n;
    bool keys = false;
    while (true) {
      const bool small = kk <= kSmallK;
      const int64_t chunk = small ? std::min<int64_t>(m, select_chunk_cap()) : kWideChunk;
      const int64_t nchunks = (m + chunk - 1) / chunk;
      at::Tensor next = at::empty({R, nchunks * kk}, s.options().dtype(at::kLong));
      const void* src = keys ? (const void*)cur.data_ptr<int64_t>() : (const void*)s.data_ptr<float>();
      const int64_t* sip = keys ? nullptr : ip;
      int64_t* dst = next.data_ptr<int64_t>();
      if (small && chunk <= 256) {  // measured: fewer warps pay less per phase on short rows
        if (keys)
          launch_select<256, true>(src, sip, R, m, id0, nchunks, chunk, kk, dst, stream);
        else
          launch_select<256, false>(src, sip, R, m, id0, nchunks, chunk, kk, dst, stream);
      } else if (small) {
        if (keys)
          launch_select<512, true>(src, sip, R, m, id0, nchunks, chunk, kk, dst, stream);
        else
          launch_select<512, false>(src, sip, R, m, id0, nchunks, chunk, kk, dst, stream);
      } else {
        launch_pdl(keys ? select_wide_kernel<true> : select_wide_kernel<false>, dim3((unsigned)(R * nchunks)),
                   dim3(kWideThreads), 0, stream, src, sip, m, id0, (int)nchunks, (int)kk, dst);
      }
      cur = next;
      keys = true;
      m = nchunks * kk;
      if (nchunks == 1) return cur;
    }
  }
  at::Tensor keys = at::empty(s.sizes(), s.options().dtype(at::kLong));
  const int64_t total = s.numel();
  if (total > 0) {
    launch_pdl(encode_keys_kernel, dim3((unsigned)((total + 255) / 256)), dim3(256), 0, stream,
               s.data_ptr<float>(), ip, keys.data_ptr<int64_t>(), total, n, id0);
  }
  if (kk == n) return std::get<0>(at::sort(keys, 1, /*descending=*/true));
  return std::get<0>(at::topk(keys, kk, 1, /*largest=*/true, /*sorted=*/true));
}

std::tuple<at::Tensor, at::Tensor> decode_keys_cuda(const at::Tensor& keys) {
  TORCH_CHECK(keys.is_cuda() && keys.scalar_type() == at::kLong, "maxsim: decode_keys takes int64 CUDA keys");
  c10::cuda::CUDAGuard guard(keys.device());
  const at::Tensor k = keys.contiguous();
  at::Tensor s = at::empty(k.sizes(), k.options().dtype(at::kFloat));
  at::Tensor ids = at::empty(k.sizes(), k.options());
  const int64_t total = k.numel();
  if (total > 0) {
    launch_pdl(decode_keys_kernel, dim3((unsigned)((total + 255) / 256)), dim3(256), 0,
               at::cuda::getCurrentCUDAStream(), k.data_ptr<int64_t>(), s.data_ptr<float>(),
               ids.data_ptr<int64_t>(), total);
  }
  return {s, ids};
}

}  // namespace maxsim
