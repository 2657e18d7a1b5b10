// Offsets -> (start, length) segments and int32 ids / lengths on the CPU (contract
// in torch_binding.h); the same rules as maxsim-cuda/segments.cu.
#include <cstdint>

#include "torch_binding.h"

namespace maxsim {
namespace {

template <typename I>
void write_segments(const I* off, int64_t n, int64_t total, int64_t max_len, int32_t* start, int32_t* len) {
  bool bad = off[0] != 0 || off[n] != total;
  for (int64_t i = 0; i < n && !bad; ++i) bad = off[i + 1] < off[i];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = off[i], l = (int64_t)off[i + 1] - s;
    start[i] = (int32_t)s;
    len[i] = bad || (max_len >= 0 && l > max_len) ? -1 : (int32_t)l;
  }
}

template <typename I>
void write_ints(const I* ids, int64_t n, int64_t lo, int64_t hi, int32_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = ids[i];
    out[i] = v < lo || v > hi ? -1 : (int32_t)v;
  }
}

void check_int(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong),
              "maxsim: segments: ", what, " must be int32 or int64 CPU tensors");
}

}  // namespace

std::vector<at::Tensor> segments_cpu(at::TensorList offsets, at::IntArrayRef totals, at::IntArrayRef max_lens,
                                     at::TensorList ids, at::IntArrayRef lo, at::IntArrayRef hi) {
  TORCH_CHECK(totals.size() == offsets.size() && max_lens.size() == offsets.size() && lo.size() == ids.size() &&
                  hi.size() == ids.size(),
              "maxsim: segments takes a total and a max_len per offsets tensor, a lo and a hi per int tensor");
  std::vector<at::Tensor> out;
  for (size_t k = 0; k < offsets.size(); ++k) {
    const at::Tensor o = offsets[k].contiguous();
    check_int(o, "offsets");
    TORCH_CHECK(o.dim() == 1 && o.numel() >= 1, "maxsim: segments: offsets must be 1-D with >= 1 entry");
    const int64_t n = o.numel() - 1;
    at::Tensor start = at::empty({n}, o.options().dtype(at::kInt)), len = at::empty({n}, o.options().dtype(at::kInt));
    if (o.scalar_type() == at::kLong)
      write_segments(o.data_ptr<int64_t>(), n, totals[k], max_lens[k], start.data_ptr<int32_t>(), len.data_ptr<int32_t>());
    else
      write_segments(o.data_ptr<int32_t>(), n, totals[k], max_lens[k], start.data_ptr<int32_t>(), len.data_ptr<int32_t>());
    out.push_back(start);
    out.push_back(len);
  }
  for (size_t k = 0; k < ids.size(); ++k) {
    const at::Tensor c = ids[k].contiguous();
    check_int(c, "ids");
    at::Tensor o = at::empty(c.sizes(), c.options().dtype(at::kInt));
    if (c.scalar_type() == at::kLong)
      write_ints(c.data_ptr<int64_t>(), c.numel(), lo[k], hi[k], o.data_ptr<int32_t>());
    else
      write_ints(c.data_ptr<int32_t>(), c.numel(), lo[k], hi[k], o.data_ptr<int32_t>());
    out.push_back(o);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> uniform_segments_cpu(const at::Tensor& like, int64_t n, int64_t extent) {
  TORCH_CHECK(n >= 0, "maxsim: uniform_segments: n must be >= 0");
  const auto opts = at::TensorOptions().device(like.device()).dtype(at::kInt);
  at::Tensor start = at::empty({n}, opts), len = at::empty({n}, opts);
  int32_t* s = start.data_ptr<int32_t>();
  int32_t* l = len.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    s[i] = (int32_t)(i * extent);
    l[i] = (int32_t)extent;
  }
  return {start, len};
}

}  // namespace maxsim
