// maxsim::backward_cuda: host dispatch of the backward kernels
// (backward_kernels.cuh; contract in torch_binding.h).
//
// One launch of the gradient kernels on the current stream, no host
// synchronisation, no workspace: dq_kernel or dd_kernel when only one
// gradient is needed, dqdd_kernel (both kinds of CTA in one grid) when both
// are; the dd_one_pair forms of the last two when every document belongs to
// one pair. Under normalize, the inverse row norms of both sides come from
// forward_train (or, without them, one launch first); the kernels then apply the normalisation's Jacobian to each
// row's fp32 sums before rounding (a lane group holds a whole row when the
// row fits one dim chunk), or else write fp32 row sums that one
// normalize_grad launch turns into dq / dd. Outputs are allocated
// uninitialised and fully written by the kernels (segment rows by their
// owners, the rows between segments by the gap rule in
// backward_kernels.cuh), so there is no memset either; when there is
// nothing to compute (P == 0, lq == 0, no segments) they come back as zeros
// without a launch.
//
// Work decomposition (from shapes and the device's occupancy only, so a given
// shape on a given GPU model always takes the same path and gives bitwise
// identical results):
//   * a lane group of G = 8/16/32 lanes covers one chunk of G 16-byte
//     vectors of a row (dim chunks beyond that: H CTAs per row set);
//   * dq: CTA = (query, block of BR rows, dim chunk); the query's pairs are
//     split into S = groups / BR slices summed in a fixed order;
//   * dd: CTA = (document, row part c of C, dim chunk); the fp32 tile holds
//     R rows, R * C covering the mean document length (longer documents take
//     more passes); documents of one pair each (GROUPED, one CROSS query)
//     write their rows from registers instead (dd_one_pair_cta), C sized
//     for about one wave;
//   BR and (R, C) minimise waves x (work per CTA + a fixed per-CTA cost),
//   waves counted with the occupancy the registers and shared memory allow.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "backward_kernels.cuh"
#include "../common/dtype_dispatch.cuh"
#include "../common/normalize_rows_launch.cuh"
#include "../common/smem_opt_in.h"
#include "torch_binding.h"

namespace maxsim {
namespace cuda_bwd {
namespace {

constexpr int64_t kMaxGrid = (int64_t)1 << 30;

void check_index(const at::Tensor& t, const char* name) {
  MAXSIM_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(),
               "maxsim backward: %s must be a contiguous 1-D int32 CUDA tensor", name);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int ceil_pow2(int64_t x) {
  int r = 1;
  while (r < x && r < (1 << 30)) r <<= 1;
  return r;
}

int ilog2(int x) {
  int r = 0;
  while ((1 << r) < x) ++r;
  return r;
}

template <class T, class A, int VEC, class O>
void set_dd_smem(size_t smem) {
  static int set_bytes[kSmemOptInDevices] = {};
  opt_in_dynamic_smem(dd_kernel<T, A, VEC, O>, smem, set_bytes);
}

template <class T, class A, int VEC, class O>
void set_dqdd_smem(size_t smem) {
  static int set_bytes[kSmemOptInDevices] = {};
  opt_in_dynamic_smem(dqdd_kernel<T, A, VEC, O>, smem, set_bytes);
}

template <class T, class A, int VEC, class O>
void set_dqdd_one_pair_smem(size_t smem) {
  static int set_bytes[kSmemOptInDevices] = {};
  opt_in_dynamic_smem(dqdd_one_pair_kernel<T, A, VEC, O>, smem, set_bytes);
}

// Resident CTAs per SM allowed by registers / threads (shared memory apart),
// of the standalone kernels: the plans below size each kind's grid by them.
template <class T, class A, int VEC, class O>
void base_occupancy(int& occ_dq, int& occ_dd) {
  static int cache[64][2] = {{0}};
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 64 && cache[dev][0] > 0) {
    occ_dq = cache[dev][0];
    occ_dd = cache[dev][1];
    return;
  }
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_dq, dq_kernel<T, A, VEC, O>, kThreads, 0));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_dd, dd_kernel<T, A, VEC, O>, kThreads, 0));
  occ_dq = std::max(occ_dq, 1);
  occ_dd = std::max(occ_dd, 1);
  if (dev < 64) {
    cache[dev][0] = occ_dq;
    cache[dev][1] = occ_dd;
  }
}

// Per-CTA fixed cost (staging, syncs, latency) in units of row loads per
// lane group, for the waves x work-per-CTA model below.
constexpr double kCtaFixed = 16.0;

// dq tiling: query rows per CTA (BR) and pair slices (S = groups / BR),
// minimising waves * (pairs per group + fixed cost).
void plan_dq(BwdParams& p, int64_t slots, int NG, size_t& smem, int64_t& ctas) {
  const int64_t Nq = p.Nq, lq = p.lq;
  const double np = p.layout == kCross ? (double)p.Nd
                    : p.layout == kGrouped ? (double)p.K
                                           : (double)p.P / (double)std::max<int64_t>(Nq, 1);
  int best = 1;
  double best_cost = 0;
  for (int BR = std::min(NG, ceil_pow2(lq)); BR >= 1; BR >>= 1) {
    const int64_t n = Nq * ceil_div(lq, BR) * p.H;
    const double cost = (double)ceil_div(n, slots) * (np * BR / NG + kCtaFixed);
    if (best_cost == 0 || cost < best_cost) {
      best = BR;
      best_cost = cost;
    }
  }
  const int BR = best;
  p.lgBR = ilog2(BR);
  p.S = NG / BR;
  p.NB = (int)ceil_div(lq, BR);
  p.PC = std::max(64, std::min(512, 4096 / BR));
  smem = std::max<size_t>((size_t)p.PC * 20 + (size_t)p.PC * BR * 4, (size_t)kThreads * p.vec * 4);
  ctas = Nq * p.NB * p.H;
}

// dd tiling: tile rows R and row parts C per document, R * C >= the mean
// document length, minimising waves * (work per CTA + fixed cost) with the
// occupancy the tile's shared memory allows.
void plan_dd(BwdParams& p, const cudaDeviceProp* prop, int occ_regs, int NG, size_t& smem, int64_t& ctas) {
  const size_t row_bytes = (size_t)(kThreads / NG) * p.vec * 4;  // G * VEC floats
  const size_t per_sm = prop->sharedMemPerMultiprocessor;
  const size_t reserved = prop->reservedSharedMemPerBlock;
  const size_t budget = std::min<size_t>(prop->sharedMemPerBlockOptin, per_sm / 2 > reserved ? per_sm / 2 - reserved : per_sm / 2);
  const size_t fixed = dd_fixed_smem();
  TORCH_CHECK(budget > fixed + row_bytes, "maxsim backward: not enough shared memory");
  const int64_t rmax = std::min<int64_t>(4096, (int64_t)((budget - fixed) / row_bytes));
  const int64_t Nd = p.Nd;
  const int64_t ld = std::max<int64_t>(1, ceil_div(p.Td, Nd));     // mean rows per document
  const double ent = (double)p.P * p.lq / (double)Nd;               // mean entries per document
  const int64_t cmin = ceil_div(ld, rmax);
  const int64_t cmax = std::max(cmin, std::min<int64_t>({ceil_div(ld, 8), cmin * 64, cmin + 1024}));
  int64_t best_c = cmin, best_r = ceil_div(ld, cmin);
  double best_cost = 0;
  for (int64_t C = cmin; C <= cmax; ++C) {
    const int64_t R = ceil_div(ld, C);
    if (C > cmin && ceil_div(ld, C - 1) == R) continue;  // same tile
    const size_t sm = (size_t)R * row_bytes + fixed;
    const int64_t occ = std::max<int64_t>(1, std::min<int64_t>(occ_regs, (int64_t)(per_sm / (sm + reserved))));
    const int64_t slots = occ * prop->multiProcessorCount;
    const int64_t n = Nd * C * p.H;
    const double work = ent * (double)R / (double)ld / NG + (double)R / NG + ent / kThreads + kCtaFixed;
    const double cost = (double)ceil_div(n, slots) * work;
    if (best_cost == 0 || cost < best_cost) {
      best_c = C;
      best_r = R;
      best_cost = cost;
    }
  }
  p.R = (int)best_r;
  p.C = (int)best_c;
  smem = (size_t)best_r * row_bytes + fixed;
  ctas = Nd * best_c * p.H;
}

// dd_one_pair tiling: row parts C per document so the grid fills at most
// one wave of resident CTAs, each part >= NG rows. Each part stages its
// pair's entries and ballots every row over all of them (a fixed cost of a
// few hundred instructions a warp), so more parts add work: two waves of
// half parts (512 documents on 528 slots) were slower than one.
void plan_dd_one_pair(BwdParams& p, int64_t slots, int NG, size_t& smem, int64_t& ctas) {
  const int64_t Nd = p.Nd;
  const int64_t ld = std::max<int64_t>(1, ceil_div(p.Td, std::max<int64_t>(Nd, 1)));
  const int64_t want = slots / std::max<int64_t>(1, Nd * p.H);
  p.C = (int)std::max<int64_t>(1, std::min<int64_t>({want, ceil_div(ld, NG), 1024}));
  p.R = 0;
  smem = dd_one_pair_smem(p.lq);
  ctas = Nd * p.C * p.H;
}

// Every document in one pair: GROUPED, or CROSS with one query.
// Queries of up to kMaxOnePairLq rows (their entries staged in one pass).
bool one_pair_docs(const BwdParams& p) {
  return (p.layout == kGrouped || (p.layout == kCross && p.Nq == 1)) && p.lq <= kMaxOnePairLq;
}

template <class T, class A, int VEC, class O>
void launch(BwdParams& p, bool do_dq, bool do_dd, int NG, cudaStream_t st) {
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  int occ_dq = 1, occ_dd = 1;
  base_occupancy<T, A, VEC, O>(occ_dq, occ_dd);
  int64_t n_dq = 0, n_dd = 0;
  size_t smem_dq = 0, smem_dd = 0;
  if (do_dq) plan_dq(p, (int64_t)occ_dq * prop->multiProcessorCount, NG, smem_dq, n_dq);
  if (do_dd && one_pair_docs(p)) {
    // Resident CTAs per SM: the launch bounds of the fused kernel.
    plan_dd_one_pair(p, kOnePairCtasPerSm * (int64_t)prop->multiProcessorCount, NG, smem_dd, n_dd);
    if (n_dq > 0 && n_dq + n_dd <= kMaxGrid) {
      const size_t smem = std::max(smem_dq, smem_dd);
      set_dqdd_one_pair_smem<T, A, VEC, O>(smem);
      launch_pdl(dqdd_one_pair_kernel<T, A, VEC, O>, dim3((unsigned)(n_dq + n_dd)), dim3(kThreads), smem, st, p,
                 (int)n_dd);
      return;
    }
    for (int64_t i0 = 0; i0 < n_dq; i0 += kMaxGrid) {
      const int64_t n = std::min(kMaxGrid, n_dq - i0);
      launch_pdl(dq_kernel<T, A, VEC, O>, dim3((unsigned)n), dim3(kThreads), smem_dq, st, p, i0);
    }
    for (int64_t i0 = 0; i0 < n_dd; i0 += kMaxGrid) {
      const int64_t n = std::min(kMaxGrid, n_dd - i0);
      launch_pdl(dd_one_pair_kernel<T, A, VEC, O>, dim3((unsigned)n), dim3(kThreads), smem_dd, st, p, i0);
    }
    return;
  }
  if (do_dd) plan_dd(p, prop, occ_dd, NG, smem_dd, n_dd);
  // Both: one launch of the fused kernel (dd CTAs first, then dq). The two
  // write disjoint outputs, so they share the GPU instead of each leaving
  // part of it idle, without a stream fork / join on the host (faster than
  // dq on a side stream beside dd on every training shape).
  if (n_dq > 0 && n_dd > 0 && n_dq + n_dd <= kMaxGrid) {
    const size_t smem = std::max(smem_dq, smem_dd);
    set_dqdd_smem<T, A, VEC, O>(smem);
    launch_pdl(dqdd_kernel<T, A, VEC, O>, dim3((unsigned)(n_dq + n_dd)), dim3(kThreads), smem, st, p, (int)n_dd);
    return;
  }
  for (int64_t i0 = 0; i0 < n_dq; i0 += kMaxGrid) {
    const int64_t n = std::min(kMaxGrid, n_dq - i0);
    launch_pdl(dq_kernel<T, A, VEC, O>, dim3((unsigned)n), dim3(kThreads), smem_dq, st, p, i0);
  }
  if (n_dd > 0) set_dd_smem<T, A, VEC, O>(smem_dd);
  for (int64_t i0 = 0; i0 < n_dd; i0 += kMaxGrid) {
    const int64_t n = std::min(kMaxGrid, n_dd - i0);
    launch_pdl(dd_kernel<T, A, VEC, O>, dim3((unsigned)n), dim3(kThreads), smem_dd, st, p, i0);
  }
}

// The Jacobian in the kernels is only taken with 16-byte vectors, so only
// those forms of it are instantiated.
template <class T, class A, class O>
void launch_v(bool v16, BwdParams& p, bool do_dq, bool do_dd, int NG, cudaStream_t st) {
  constexpr int kVec = 16 / (int)sizeof(T);
  if constexpr (OutRow<O>::kJacobian) {
    TORCH_CHECK(v16, "maxsim backward: the in-kernel Jacobian needs 16-byte rows");
    launch<T, A, kVec, O>(p, do_dq, do_dd, NG, st);
  } else if (v16) {
    launch<T, A, kVec, O>(p, do_dq, do_dd, NG, st);
  } else {
    launch<T, A, 1, O>(p, do_dq, do_dd, NG, st);
  }
}

template <class T, class O>
void launch_o(bool a16, bool v16, BwdParams& p, bool do_dq, bool do_dd, int NG, cudaStream_t st) {
  if (a16)
    launch_v<T, int16_t, O>(v16, p, do_dq, do_dd, NG, st);
  else
    launch_v<T, int32_t, O>(v16, p, do_dq, do_dd, NG, st);
}

// The row stores' output policy (backward_kernels.cuh): the gradient, the
// gradient of normalize (Jacobian in the kernel), or normalize's fp32 row
// sums (for fp32 inputs the same kernel as the gradient's).
enum class RowOut { kGrad, kJacobian, kRowSums };

template <class T>
void launch_t(RowOut out, bool a16, bool v16, BwdParams& p, bool do_dq, bool do_dd, int NG, cudaStream_t st) {
  if (out == RowOut::kJacobian)
    launch_o<T, Jacobian<T>>(a16, v16, p, do_dq, do_dd, NG, st);
  else if (out == RowOut::kRowSums && !std::is_same<T, float>::value)
    launch_o<T, float>(a16, v16, p, do_dq, do_dd, NG, st);
  else
    launch_o<T, T>(a16, v16, p, do_dq, do_dd, NG, st);
}

}  // namespace
}  // namespace cuda_bwd

std::tuple<at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_in, const at::Tensor& q_in, const at::Tensor& q_start, const at::Tensor& q_len,
    const at::Tensor& d_in, const at::Tensor& d_start, const at::Tensor& d_len,
    const std::optional<at::Tensor>& pair_q, const std::optional<at::Tensor>& pair_d, const at::Tensor& argmax_in,
    int64_t layout, const std::optional<at::Tensor>& q_ptr, const std::optional<at::Tensor>& q_pairs,
    const std::optional<at::Tensor>& d_ptr, const std::optional<at::Tensor>& d_pairs, bool need_dq, bool need_dd,
    bool normalize, const std::optional<at::Tensor>& inv_norms) {
  using namespace cuda_bwd;
  TORCH_CHECK(q_in.is_cuda() && d_in.is_cuda(), "maxsim backward: q and d must be CUDA tensors");
  TORCH_CHECK(q_in.dim() == 2 && d_in.dim() == 2 && q_in.size(1) == d_in.size(1),
              "maxsim backward: q [Tq, dim] and d [Td, dim] must share dim");
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK(dtype == d_in.scalar_type() && (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16),
              "maxsim backward: q and d must share dtype float32, float16 or bfloat16");
  MAXSIM_CHECK(layout >= kCross && layout <= kList, "maxsim backward: bad layout %lld", (long long)layout);
  check_index(q_start, "q_start");
  check_index(q_len, "q_len");
  check_index(d_start, "d_start");
  check_index(d_len, "d_len");
  TORCH_CHECK(q_start.numel() == q_len.numel() && d_start.numel() == d_len.numel(),
              "maxsim backward: start / len size mismatch");
  TORCH_CHECK(argmax_in.is_cuda() && (argmax_in.scalar_type() == at::kInt || argmax_in.scalar_type() == at::kShort) &&
                  (argmax_in.dim() == 2 || argmax_in.numel() == 0),
              "maxsim backward: argmax must be an int32 / int16 [P, lq] CUDA tensor");

  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous();
  const at::Tensor d = d_in.contiguous();
  const at::Tensor argmax = argmax_in.contiguous();
  const int64_t Nq = q_start.numel(), Nd = d_start.numel();
  const int64_t P = argmax.dim() == 2 ? argmax.size(0) : 0;
  const int64_t lq = argmax.dim() == 2 ? argmax.size(1) : 0;
  const int64_t Tq = q.size(0), Td = d.size(0), dim = q.size(1);
  TORCH_CHECK(lq < ((int64_t)1 << 30), "maxsim backward: lq too large");
  TORCH_CHECK(grad_in.is_cuda() && grad_in.scalar_type() == at::kFloat && grad_in.dim() == 1 &&
                  (grad_in.numel() == P || P == 0),
              "maxsim backward: grad must be a fp32 [P] CUDA tensor");
  TORCH_CHECK(Tq < ((int64_t)1 << 31) && Td < ((int64_t)1 << 31), "maxsim backward: too many rows");

  int64_t expectP = 0;
  at::Tensor pq, pd, qp, qpp, dp, dpp;
  if (layout == kCross) {
    expectP = Nq * Nd;
  } else if (layout == kGrouped) {
    TORCH_CHECK(Nq > 0 ? Nd % Nq == 0 : Nd == 0, "maxsim backward: GROUPED needs Nd % Nq == 0");
    expectP = Nd;
  } else {
    TORCH_CHECK(pair_q.has_value() && pair_d.has_value() && pair_q->defined() && pair_d->defined(),
                "maxsim backward: LIST needs pair_q / pair_d");
    pq = pair_q->contiguous();
    pd = pair_d->contiguous();
    check_index(pq, "pair_q");
    check_index(pd, "pair_d");
    TORCH_CHECK(pq.numel() == pd.numel(), "maxsim backward: pair_q / pair_d size mismatch");
    expectP = pq.numel();
    if (need_dq) {
      TORCH_CHECK(q_ptr.has_value() && q_pairs.has_value() && q_ptr->defined() && q_pairs->defined(),
                  "maxsim backward: LIST needs q_ptr / q_pairs for dq");
      qp = q_ptr->contiguous();
      qpp = q_pairs->contiguous();
      check_index(qp, "q_ptr");
      check_index(qpp, "q_pairs");
      TORCH_CHECK(qp.numel() == Nq + 1 && qpp.numel() == expectP, "maxsim backward: q_ptr / q_pairs size mismatch");
    }
    if (need_dd) {
      TORCH_CHECK(d_ptr.has_value() && d_pairs.has_value() && d_ptr->defined() && d_pairs->defined(),
                  "maxsim backward: LIST needs d_ptr / d_pairs for dd");
      dp = d_ptr->contiguous();
      dpp = d_pairs->contiguous();
      check_index(dp, "d_ptr");
      check_index(dpp, "d_pairs");
      TORCH_CHECK(dp.numel() == Nd + 1 && dpp.numel() == expectP, "maxsim backward: d_ptr / d_pairs size mismatch");
    }
  }
  MAXSIM_CHECK(P == 0 || P == expectP, "maxsim backward: argmax has %lld rows, expected %lld", (long long)P,
               (long long)expectP);
  const at::Tensor grad = grad_in.contiguous();

  const bool work = P > 0 && lq > 0 && dim > 0;
  const bool do_dq = need_dq && work && Nq > 0 && Tq > 0;
  const bool do_dd = need_dd && work && Nd > 0 && Td > 0;
  at::Tensor dq = !need_dq ? q.new_empty({0}) : (do_dq ? at::empty(q.sizes(), q.options()) : at::zeros(q.sizes(), q.options()));
  at::Tensor dd = !need_dd ? d.new_empty({0}) : (do_dd ? at::empty(d.sizes(), d.options()) : at::zeros(d.sizes(), d.options()));
  if (!do_dq && !do_dd) return {dq, dd};

  // ---- vectors and lane groups --------------------------------------------
  // (dq / dd come from at::empty: 16-byte aligned.)
  const int64_t esz = q.element_size();
  const bool v16 = (dim * esz) % 16 == 0 && aligned_to(q.data_ptr(), 16) && aligned_to(d.data_ptr(), 16);
  const int VEC = v16 ? (int)(16 / esz) : 1;
  const int64_t nvec = dim / VEC;
  const int G = std::min(32, std::max(8, ceil_pow2(nvec)));
  const int NG = kThreads / G;
  const int H = (int)ceil_div(nvec, G);

  // normalize: inverse norms of the gathered sides (q's rows for dd, then d's
  // for dq): forward_train's, else one launch for both; the Jacobian in the kernels when a lane
  // group holds a whole row (16-byte vectors, one dim chunk), else fp32 row
  // sums out (one buffer for both sides) and one normalize_grad launch.
  const at::Tensor none;
  cuda_norm::InvNorms inv;
  const RowOut row_out = !normalize ? RowOut::kGrad : (v16 && H == 1 ? RowOut::kJacobian : RowOut::kRowSums);
  at::Tensor g32, gq, gd;
  if (normalize) inv = cuda_norm::saved_inv_norms(inv_norms, Tq, Td, q.device());
  if (normalize && !inv.buf.defined()) inv = cuda_norm::inv_norms(do_dd ? q : none, do_dq ? d : none);
  if (row_out == RowOut::kRowSums) {
    g32 = at::empty({(do_dq ? Tq : 0) + (do_dd ? Td : 0), dim}, q.options().dtype(at::kFloat));
    if (do_dq) gq = g32.narrow(0, 0, Tq);
    if (do_dd) gd = g32.narrow(0, do_dq ? Tq : 0, Td);
  }
  const at::Tensor& out_q = row_out == RowOut::kRowSums ? gq : dq;
  const at::Tensor& out_d = row_out == RowOut::kRowSums ? gd : dd;

  BwdParams p{};
  p.grad = grad.data_ptr<float>();
  p.q = q.data_ptr();
  p.d = d.data_ptr();
  p.q_start = q_start.data_ptr<int>();
  p.q_len = q_len.data_ptr<int>();
  p.d_start = d_start.data_ptr<int>();
  p.d_len = d_len.data_ptr<int>();
  p.pair_q = pq.defined() ? pq.data_ptr<int>() : nullptr;
  p.pair_d = pd.defined() ? pd.data_ptr<int>() : nullptr;
  p.argmax = argmax.data_ptr();
  p.q_scale = normalize && do_dd ? inv.a : nullptr;
  p.d_scale = normalize && do_dq ? inv.b : nullptr;
  p.q_ptr = qp.defined() ? qp.data_ptr<int>() : nullptr;
  p.q_pairs = qpp.defined() ? qpp.data_ptr<int>() : nullptr;
  p.d_ptr = dp.defined() ? dp.data_ptr<int>() : nullptr;
  p.d_pairs = dpp.defined() ? dpp.data_ptr<int>() : nullptr;
  p.dq = do_dq ? out_q.data_ptr() : nullptr;
  p.dd = do_dd ? out_d.data_ptr() : nullptr;
  p.Tq = Tq;
  p.Td = Td;
  p.dim = dim;
  p.Nq = Nq;
  p.Nd = Nd;
  p.P = P;
  p.K = std::max<int64_t>(1, (layout == kGrouped && Nq > 0) ? Nd / Nq : 1);
  p.lq = (int)lq;
  p.layout = (int)layout;
  p.nvec = (int)nvec;
  p.vec = VEC;
  p.lgG = ilog2(G);
  p.H = H;

  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool a16 = argmax.scalar_type() == at::kShort;
  dispatch_float_type(dtype, [&](auto tag) {
    launch_t<decltype(tag)>(row_out, a16, v16, p, do_dq, do_dd, NG, stream);
  });
  if (row_out == RowOut::kRowSums) cuda_norm::normalize_grad(g32, do_dq ? q : none, dq, do_dd ? d : none, dd);
  return {dq, dd};
}

}  // namespace maxsim
