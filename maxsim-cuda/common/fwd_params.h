// Host side of FwdParams shared by the forward ops (forward.cu) and the
// search re-score (rescore_topk.cu): the optional token masks as contiguous
// bool tensors, and the token / segment fields.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "common.cuh"

namespace maxsim {
namespace cuda_fwd {

// An optional token mask of `rows` entries as a contiguous bool tensor
// (undefined when absent).
inline at::Tensor token_mask(const std::optional<at::Tensor>& m, int64_t rows, const char* msg) {
  if (!m.has_value() || !m->defined()) return at::Tensor();
  at::Tensor t = m->to(at::kBool).contiguous();
  TORCH_CHECK(t.is_cuda() && t.numel() == rows, msg);
  return t;
}

// The planner's pointer alignment of two token tensors: the largest of 16,
// 8, 4, 2, 1 dividing both data pointers.
inline int ptr_align(const void* a, const void* b) {
  const uintptr_t x = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b);
  for (int v : {16, 8, 4, 2})
    if (x % v == 0) return v;
  return 1;
}

// The streaming kernels' fields of a plan.
inline void set_stream_plan(FwdParams& p, const plan::Plan& pl) {
  p.stream_split = pl.stream.split;
  p.stream_il = pl.stream.il;
  p.stream_qsm = pl.stream.qsm;
  p.stream_tail = pl.stream.tail;
  p.stream_head_blocks = pl.stream.head_blocks;
  p.stream_extent = pl.stream.extent;
  p.stream_qextent = pl.stream.qextent;
  p.stream_keep = pl.keep;
  p.stream_multiwave = pl.multiwave;
  const bool wg = pl.family == plan::Family::kStreamWg;
  p.stream_run = wg ? pl.stream_wg.run : pl.stream.run;
  p.stream_rpg = wg ? pl.stream_wg.rpg : pl.stream.rpg;
}

// The tile kernels' fields of a plan (kMma, kWgmma, kSimt, kPacked).
inline void set_tile_plan(FwdParams& p, const plan::Plan& pl) {
  p.qpt = pl.qpt;
  p.tpq = pl.tpq;
  p.mt_total = pl.mt_total;
  p.kch = pl.kch;
  p.ksteps_last = pl.ksteps_last;
  p.row_bytes_pad = pl.row_bytes_pad;
  p.vecb = pl.vecb;
  p.S = pl.splits;
  p.row_mode = pl.row_mode;
  p.dpc = pl.dpc;
  p.gsz = pl.gsz;
  p.cpg = pl.cpg;
  p.qrows = pl.packed.rows;
}

// Token rows, (start, length) per query and document, masks (qm / dm may be
// undefined), and the sizes derived from them.
inline void set_segments(FwdParams& p, const at::Tensor& q, const at::Tensor& q_start, const at::Tensor& q_len,
                         const at::Tensor& qm, const at::Tensor& d, const at::Tensor& d_start,
                         const at::Tensor& d_len, const at::Tensor& dm) {
  p.q = static_cast<const char*>(q.data_ptr());
  p.d = static_cast<const char*>(d.data_ptr());
  p.q_start = q_start.data_ptr<int>();
  p.q_len = q_len.data_ptr<int>();
  p.q_mask = qm.defined() ? qm.data_ptr<bool>() : nullptr;
  p.d_start = d_start.data_ptr<int>();
  p.d_len = d_len.data_ptr<int>();
  p.d_mask = dm.defined() ? dm.data_ptr<bool>() : nullptr;
  p.Tq = q.size(0);
  p.Td = d.size(0);
  p.row_bytes = q.size(1) * q.element_size();
  p.Nq = q_start.numel();
  p.Nd = d_start.numel();
}

}  // namespace cuda_fwd
}  // namespace maxsim
