// Offsets -> (start, length) segments, int32 ids / lengths, one launch per
// call (contract in torch_binding.h), where tensor ops would take ~25
// launches, more time than the forward itself. Each offsets array of up to kOneCta segments is one CTA
// (it must see every offset before writing any length: a decrease anywhere
// poisons all); the CTAs after them copy the ids. Longer arrays take a
// check grid and a write grid.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../common/pdl.cuh"
#include "torch_binding.h"

namespace maxsim {
namespace {

constexpr int kJobs = 2;
constexpr int kThreads = 1024;
constexpr int64_t kOneCta = 1 << 16;
constexpr int kIdsPerCta = 8 * kThreads;

struct Ints {
  const void* p;
  bool i64;
  __device__ __forceinline__ int64_t operator[](int64_t i) const {
    return i64 ? static_cast<const int64_t*>(p)[i] : (int64_t) static_cast<const int32_t*>(p)[i];
  }
};

struct SegJob {
  Ints off;
  int64_t n, total, max_len;
  int32_t *start, *len;
};

struct IdJob {
  Ints ids;
  int64_t n, lo, hi;
  int32_t* out;
};

struct Jobs {
  SegJob seg[kJobs];
  IdJob id[kJobs];
  int nseg, nid;
};

__device__ __forceinline__ void write_segment(const SegJob& j, int64_t i, bool bad) {
  const int64_t s = j.off[i], l = j.off[i + 1] - s;
  j.start[i] = (int32_t)s;
  j.len[i] = bad || (j.max_len >= 0 && l > j.max_len) ? -1 : (int32_t)l;
}

__global__ void __launch_bounds__(kThreads) segments_kernel(const Jobs jobs) {
  pdl_enter();
  if ((int)blockIdx.x < jobs.nseg) {
    const SegJob& j = jobs.seg[blockIdx.x];
    bool bad = j.off[0] != 0 || j.off[j.n] != j.total;
    for (int64_t i = threadIdx.x; i < j.n; i += kThreads) bad |= j.off[i + 1] < j.off[i];
    bad = __syncthreads_or(bad);
    for (int64_t i = threadIdx.x; i < j.n; i += kThreads) write_segment(j, i, bad);
    return;
  }
  const int64_t i0 = ((int64_t)blockIdx.x - jobs.nseg) * kIdsPerCta;
  for (int k = 0; k < jobs.nid; ++k) {
    const IdJob& j = jobs.id[k];
    for (int64_t i = i0 + threadIdx.x; i < j.n && i < i0 + kIdsPerCta; i += kThreads) {
      const int64_t v = j.ids[i];
      j.out[i] = v < j.lo || v > j.hi ? -1 : (int32_t)v;
    }
  }
}

// Arrays past kOneCta: flag any violation, then write.
__global__ void segments_check_kernel(const SegJob j, int* bad) {
  pdl_enter();
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  bool b = i < j.n && j.off[i + 1] < j.off[i];
  if (i == 0) b |= j.off[0] != 0 || j.off[j.n] != j.total;
  if (__syncthreads_or(b) && threadIdx.x == 0) atomicOr(bad, 1);
}

__global__ void segments_write_kernel(const SegJob j, const int* bad) {
  pdl_enter();
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < j.n) write_segment(j, i, *bad != 0);
}

__global__ void uniform_segments_kernel(int64_t n, int64_t extent, int32_t* start, int32_t* len) {
  pdl_enter();
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    start[i] = (int32_t)(i * extent);
    len[i] = (int32_t)extent;
  }
}

Ints ints(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "maxsim: segments: ", what,
              " must be int32 or int64");
  return Ints{t.data_ptr(), t.scalar_type() == at::kLong};
}

}  // namespace

std::vector<at::Tensor> segments_cuda(at::TensorList offsets, at::IntArrayRef totals, at::IntArrayRef max_lens,
                                      at::TensorList ids, at::IntArrayRef lo, at::IntArrayRef hi) {
  TORCH_CHECK(offsets.size() <= kJobs && ids.size() <= kJobs && totals.size() == offsets.size() &&
                  max_lens.size() == offsets.size() && lo.size() == ids.size() && hi.size() == ids.size(),
              "maxsim: segments takes up to 2 offsets (with a total and max_len each) and up to 2 int tensors (with "
              "lo and hi each)");
  TORCH_CHECK(!offsets.empty() || !ids.empty(), "maxsim: segments: nothing to do");
  const at::Device dev = offsets.empty() ? ids[0].device() : offsets[0].device();
  c10::cuda::CUDAGuard guard(dev);
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto i32 = at::TensorOptions().device(dev).dtype(at::kInt);
  std::vector<at::Tensor> out, keep;
  Jobs jobs{};
  std::vector<SegJob> big;
  for (size_t k = 0; k < offsets.size(); ++k) {
    const at::Tensor o = offsets[k].contiguous();
    TORCH_CHECK(o.is_cuda() && o.device() == dev && o.dim() == 1 && o.numel() >= 1,
                "maxsim: segments: offsets must be 1-D, >= 1 entry, on one CUDA device");
    keep.push_back(o);
    const int64_t n = o.numel() - 1;
    out.push_back(at::empty({n}, i32));
    out.push_back(at::empty({n}, i32));
    SegJob j{ints(o, "offsets"), n, totals[k], max_lens[k], out[out.size() - 2].data_ptr<int32_t>(),
             out.back().data_ptr<int32_t>()};
    if (n == 0) continue;
    if (n > kOneCta)
      big.push_back(j);
    else
      jobs.seg[jobs.nseg++] = j;
  }
  int64_t max_ids = 0;
  for (size_t k = 0; k < ids.size(); ++k) {
    const at::Tensor c = ids[k].contiguous();
    TORCH_CHECK(c.is_cuda() && c.device() == dev, "maxsim: segments: ids must be on the offsets' device");
    keep.push_back(c);
    out.push_back(at::empty(c.sizes(), i32));
    if (c.numel() == 0) continue;
    jobs.id[jobs.nid++] = IdJob{ints(c, "ids"), c.numel(), lo[k], hi[k], out.back().data_ptr<int32_t>()};
    max_ids = std::max(max_ids, c.numel());
  }
  const int64_t id_ctas = (max_ids + kIdsPerCta - 1) / kIdsPerCta;
  if (jobs.nseg + id_ctas > 0)
    launch_pdl(segments_kernel, dim3((unsigned)(jobs.nseg + id_ctas)), dim3(kThreads), 0, stream, jobs);
  for (const SegJob& j : big) {
    at::Tensor bad = at::zeros({1}, i32);
    const unsigned grid = (unsigned)((j.n + 255) / 256);
    launch_pdl(segments_check_kernel, dim3(grid), dim3(256), 0, stream, j, bad.data_ptr<int>());
    launch_pdl(segments_write_kernel, dim3(grid), dim3(256), 0, stream, j, (const int*)bad.data_ptr<int>());
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> uniform_segments_cuda(const at::Tensor& like, int64_t n, int64_t extent) {
  TORCH_CHECK(like.is_cuda() && n >= 0, "maxsim: uniform_segments: a CUDA tensor and n >= 0");
  c10::cuda::CUDAGuard guard(like.device());
  const auto opts = at::TensorOptions().device(like.device()).dtype(at::kInt);
  at::Tensor start = at::empty({n}, opts), len = at::empty({n}, opts);
  if (n > 0) {
    const unsigned grid = (unsigned)std::min<int64_t>((n + kThreads - 1) / kThreads, 1024);
    launch_pdl(uniform_segments_kernel, dim3(grid), dim3(kThreads), 0, at::cuda::getCurrentCUDAStream(), n, extent,
               start.data_ptr<int32_t>(), len.data_ptr<int32_t>());
  }
  return {start, len};
}

}  // namespace maxsim
