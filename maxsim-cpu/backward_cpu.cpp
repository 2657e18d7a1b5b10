// CPU backward from the saved argmax (contract in torch_binding.h).
//
// Deterministic without atomics: every output row has one owner task that
// sums its contributions in a fixed order. dq rows are owned by their query
// (tasks = blocks of query rows, looping over the query's pairs); dd rows by
// their document (tasks = chunks of document rows, scanning the argmax rows
// of the document's pairs). A task sums into a small fp32 scratch and writes
// its rows once, in the input dtype: outputs are as large as the inputs, so
// they are touched once (no zero-fill pass). Rows outside every segment are
// zeroed separately. Assumes segments of one side do not overlap, as the
// Python lowering makes them.
#include "normalize_rows.h"
#include "tile_kernels.h"
#include "torch_binding.h"

namespace maxsim {
namespace {
using namespace cpu;

constexpr int64_t kRowBlock = 8;    // query rows per dq task
constexpr int64_t kMinChunk = 16;   // smallest document chunk per dd task
constexpr int64_t kMaxChunk = 256;  // largest (bounds the scratch)

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  for (int64_t k = 0; k < n; ++k) y[k] += a * x[k];
}
template <class T>
inline void axpy(float* __restrict y, float a, const T* __restrict x, int64_t n) {
  for (int64_t k = 0; k < n; ++k) y[k] += a * to_f32(x[k]);
}

template <class T>
inline void store_rows(T* __restrict dst, const float* __restrict src, int64_t n) {
  for (int64_t k = 0; k < n; ++k) dst[k] = from_f32<T>(src[k]);
}

// Zeroes the rows of out [rows, dim] that no valid segment owns.
template <class T>
void zero_unowned(T* out, int64_t rows, int64_t dim, const int32_t* start, const int32_t* len,
                  int64_t n, int64_t width) {
  int64_t next = 0;  // segments laid end to end over [0, rows): nothing to do
  bool tiled = true;
  for (int64_t i = 0; i < n && tiled; ++i) {
    const int64_t r = seg_rows(start, len, i, width, rows);
    tiled = r == len[i] && (r == 0 || start[i] == next);
    next += std::max<int64_t>(r, 0);
  }
  if (tiled && next == rows) return;
  std::vector<int32_t> cover(rows + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = seg_rows(start, len, i, width, rows);
    if (r > 0) ++cover[start[i]], --cover[start[i] + r];
  }
  int32_t c = 0;
  for (int64_t t = 0; t < rows; ++t)
    if ((c += cover[t]) == 0) std::fill(out + t * dim, out + (t + 1) * dim, from_f32<T>(0.f));
}

// Expands the per-item work counts into prefix offsets so that tasks can be
// distributed evenly; returns the total.
template <class F>
int64_t prefix(std::vector<int64_t>& off, int64_t n, const F& count) {
  off.assign(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) off[i + 1] = off[i] + count(i);
  return off[n];
}

template <class T, class A>
void backward_impl(const float* grad, const T* q, const T* d, int64_t Tq, int64_t Td, int64_t dim,
                   const int32_t* qs, const int32_t* ql, int64_t Nq, const int32_t* ds,
                   const int32_t* dl, int64_t Nd, const int32_t* pq, const int32_t* pd,
                   const A* am, int64_t P, int64_t lq, int64_t layout, const int32_t* qptr,
                   const int32_t* qpairs, const int32_t* dptr, const int32_t* dpairs, bool normalize,
                   T* dq, T* dd) {
  // normalize: gathered rows are x^ = x * inv, so contributions carry their
  // row's inverse norm, and each owned fp32 row sum gets the Jacobian of the
  // normalisation before it is rounded.
  const auto qinv = inv_row_norms<float>(normalize && dd, q, Tq, dim, kNormEps);
  const auto dinv = inv_row_norms<float>(normalize && dq, d, Td, dim, kNormEps);
  const int64_t K = (layout == kGrouped && Nq > 0) ? Nd / Nq : 0;
  auto qid = [&](int64_t p) -> int64_t {
    return layout == kCross ? p / Nd : layout == kGrouped ? p / K : pq[p];
  };
  auto did = [&](int64_t p) -> int64_t { return layout == kList ? pd[p] : p % Nd; };
  // Rows of pair p's query / document that the forward read; -1: skip the pair.
  auto pair_rows = [&](int64_t p, int64_t& nq, int64_t& nd) {
    const int64_t n = qid(p), m = did(p);
    nq = (n >= 0 && n < Nq) ? seg_rows(qs, ql, n, lq, Tq) : -1;
    nd = (m >= 0 && m < Nd) ? seg_rows(ds, dl, m, kNoWidth, Td) : -1;
    return nq >= 0 && nd >= 0;
  };
  // The pairs of query n / document m, in a fixed order.
  auto q_pairs_of = [&](int64_t n, auto&& fn) {
    if (layout == kCross)
      for (int64_t m = 0; m < Nd; ++m) fn(n * Nd + m);
    else if (layout == kGrouped)
      for (int64_t k = 0; k < K; ++k) fn(n * K + k);
    else
      for (int64_t i = qptr[n]; i < qptr[n + 1]; ++i) fn(int64_t(qpairs[i]));
  };
  auto d_pairs_of = [&](int64_t m, auto&& fn) {
    if (layout == kCross)
      for (int64_t n = 0; n < Nq; ++n) fn(n * Nd + m);
    else if (layout == kGrouped)
      fn(m);
    else
      for (int64_t i = dptr[m]; i < dptr[m + 1]; ++i) fn(int64_t(dpairs[i]));
  };
  const int64_t nthreads = at::get_num_threads();

  if (dq) {
    zero_unowned(dq, Tq, dim, qs, ql, Nq, lq);
    std::vector<int64_t> off;
    const int64_t ntask = prefix(off, Nq, [&](int64_t n) {
      const int64_t r = seg_rows(qs, ql, n, lq, Tq);
      return r > 0 ? (r + kRowBlock - 1) / kRowBlock : 0;
    });
    parallel_items(ntask, ntask / (8 * nthreads), [&](auto&& grab) {
      Scratch scratch;
      float* acc = scratch.get(size_t(kRowBlock * dim));
      int64_t b, e;
      while (grab(b, e))
        for (int64_t t = b; t < e; ++t) {
          const int64_t n = std::upper_bound(off.begin(), off.end(), t) - off.begin() - 1;
          const int64_t i0 = (t - off[n]) * kRowBlock;
          const int64_t i1 = std::min(seg_rows(qs, ql, n, lq, Tq), i0 + kRowBlock);
          std::fill(acc, acc + (i1 - i0) * dim, 0.f);
          q_pairs_of(n, [&](int64_t p) {
            int64_t nq, nd;
            if (p < 0 || p >= P || qid(p) != n || !pair_rows(p, nq, nd)) return;
            const int64_t d0 = ds[did(p)];
            const T* drow = d + d0 * dim;
            for (int64_t i = i0; i < i1; ++i) {
              const int64_t a = am[p * lq + i];
              if (a >= 0 && a < nd)
                axpy(acc + (i - i0) * dim, normalize ? grad[p] * dinv[d0 + a] : grad[p], drow + a * dim, dim);
            }
          });
          if (normalize)
            for (int64_t i = i0; i < i1; ++i)
              normalize_grad_row(acc + (i - i0) * dim, q + (qs[n] + i) * dim, dim, kNormEps);
          store_rows(dq + (qs[n] + i0) * dim, acc, (i1 - i0) * dim);
        }
    });
  }

  if (dd) {
    zero_unowned(dd, Td, dim, ds, dl, Nd, kNoWidth);
    // Split documents further only as parallelism needs: every chunk of a
    // document rescans the argmax rows of all its pairs.
    const int64_t split = std::max<int64_t>(1, (4 * nthreads + Nd - 1) / std::max<int64_t>(Nd, 1));
    std::vector<int64_t> off, csize(Nd);
    const int64_t ntask = prefix(off, Nd, [&](int64_t m) {
      const int64_t r = seg_rows(ds, dl, m, kNoWidth, Td);
      if (r <= 0) return int64_t(0);
      const int64_t c = std::max((r + kMaxChunk - 1) / kMaxChunk,
                                 std::min(split, (r + kMinChunk - 1) / kMinChunk));
      csize[m] = (r + c - 1) / c;
      return (r + csize[m] - 1) / csize[m];
    });
    parallel_items(ntask, ntask / (8 * nthreads), [&](auto&& grab) {
      Scratch scratch;
      float* acc = scratch.get(size_t(kMaxChunk * dim));
      int64_t b, e;
      while (grab(b, e))
        for (int64_t t = b; t < e; ++t) {
          const int64_t m = std::upper_bound(off.begin(), off.end(), t) - off.begin() - 1;
          const int64_t j0 = (t - off[m]) * csize[m];
          const int64_t j1 = std::min(j0 + csize[m], seg_rows(ds, dl, m, kNoWidth, Td));
          std::fill(acc, acc + (j1 - j0) * dim, 0.f);
          d_pairs_of(m, [&](int64_t p) {
            int64_t nq, nd;
            if (p < 0 || p >= P || did(p) != m || !pair_rows(p, nq, nd)) return;
            const int64_t q0 = qs[qid(p)];
            const T* qrow = q + q0 * dim;
            for (int64_t i = 0; i < nq; ++i) {
              const int64_t a = am[p * lq + i];
              if (a >= j0 && a < j1)
                axpy(acc + (a - j0) * dim, normalize ? grad[p] * qinv[q0 + i] : grad[p], qrow + i * dim, dim);
            }
          });
          if (normalize)
            for (int64_t j = j0; j < j1; ++j)
              normalize_grad_row(acc + (j - j0) * dim, d + (ds[m] + j) * dim, dim, kNormEps);
          store_rows(dd + (ds[m] + j0) * dim, acc, (j1 - j0) * dim);
        }
    });
  }
}

inline void check_index(const at::Tensor& t, const char* name) {
  MAXSIM_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(),
               "maxsim backward_cpu: %s must be a contiguous 1-D int32 CPU tensor", name);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& q_start,
    const at::Tensor& q_len, const at::Tensor& d, const at::Tensor& d_start,
    const at::Tensor& d_len, const std::optional<at::Tensor>& pair_q,
    const std::optional<at::Tensor>& pair_d, const at::Tensor& argmax, int64_t layout,
    const std::optional<at::Tensor>& q_ptr, const std::optional<at::Tensor>& q_pairs,
    const std::optional<at::Tensor>& d_ptr, const std::optional<at::Tensor>& d_pairs,
    bool need_dq, bool need_dd, bool normalize) {
  TORCH_CHECK(q.device().is_cpu() && d.device().is_cpu(), "maxsim backward_cpu: CPU tensors expected");
  TORCH_CHECK(q.dim() == 2 && d.dim() == 2 && q.size(1) == d.size(1),
              "maxsim backward_cpu: q and d must be [T, dim] with the same dim");
  TORCH_CHECK(q.scalar_type() == d.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kHalf ||
                   q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kDouble),
              "maxsim backward_cpu: q and d must share dtype float32, float16, bfloat16 or float64");
  TORCH_CHECK(q.is_contiguous() && d.is_contiguous(), "maxsim backward_cpu: q, d must be contiguous");
  check_index(q_start, "q_start"), check_index(q_len, "q_len");
  check_index(d_start, "d_start"), check_index(d_len, "d_len");
  TORCH_CHECK(q_start.numel() == q_len.numel() && d_start.numel() == d_len.numel(),
              "maxsim backward_cpu: start/len size mismatch");
  MAXSIM_CHECK(layout >= kCross && layout <= kList, "maxsim backward_cpu: bad layout %lld", (long long)layout);
  TORCH_CHECK(argmax.device().is_cpu() && argmax.is_contiguous() &&
                  (argmax.scalar_type() == at::kInt || argmax.scalar_type() == at::kShort) &&
                  (argmax.dim() == 2 || argmax.numel() == 0),
              "maxsim backward_cpu: argmax must be a contiguous int32/int16 [P, lq] CPU tensor");
  const int64_t Nq = q_start.numel(), Nd = d_start.numel();
  const int64_t P = argmax.dim() == 2 ? argmax.size(0) : 0;
  const int64_t lq = argmax.dim() == 2 ? argmax.size(1) : 0;
  TORCH_CHECK(grad.device().is_cpu() && grad.scalar_type() == at::kFloat && grad.dim() == 1 &&
                  grad.is_contiguous() && (grad.numel() == P || P == 0),
              "maxsim backward_cpu: grad must be a contiguous fp32 [P] CPU tensor");
  int64_t expectP = 0;
  if (layout == kCross) {
    expectP = Nq * Nd;
  } else if (layout == kGrouped) {
    TORCH_CHECK(Nq > 0 ? Nd % Nq == 0 : Nd == 0, "maxsim backward_cpu: GROUPED needs Nd % Nq == 0");
    expectP = Nd;
  } else {
    // The CSR of a side only where its gradient is wanted (as the autograd
    // node builds them).
    TORCH_CHECK(pair_q && pair_d && (!need_dq || (q_ptr && q_pairs)) && (!need_dd || (d_ptr && d_pairs)),
                "maxsim backward_cpu: LIST needs pair_q, pair_d and the CSR tensors of each wanted gradient");
    for (const auto* t : {&*pair_q, &*pair_d}) check_index(*t, "LIST index");
    TORCH_CHECK(pair_d->numel() == pair_q->numel(), "maxsim backward_cpu: LIST index size mismatch");
    // One side's CSR: ptr [owners + 1] into pairs [P].
    const auto check_csr = [&](const at::Tensor& ptr, const at::Tensor& pairs, int64_t owners) {
      check_index(ptr, "LIST index"), check_index(pairs, "LIST index");
      TORCH_CHECK(pairs.numel() == pair_q->numel() && ptr.numel() == owners + 1,
                  "maxsim backward_cpu: LIST index size mismatch");
    };
    if (need_dq) check_csr(*q_ptr, *q_pairs, Nq);
    if (need_dd) check_csr(*d_ptr, *d_pairs, Nd);
    expectP = pair_q->numel();
  }
  MAXSIM_CHECK(P == 0 || P == expectP, "maxsim backward_cpu: argmax has %lld rows, expected %lld", (long long)P,
               (long long)expectP);

  at::Tensor dq = need_dq ? at::empty(q.sizes(), q.options()) : q.new_empty({0});
  at::Tensor dd = need_dd ? at::empty(d.sizes(), d.options()) : d.new_empty({0});
  if (P == 0 || lq == 0) {  // nothing selected
    if (need_dq) dq.zero_();
    if (need_dd) dd.zero_();
    return {dq, dd};
  }
  const int32_t* pq = layout == kList ? pair_q->data_ptr<int32_t>() : nullptr;
  const int32_t* pd = layout == kList ? pair_d->data_ptr<int32_t>() : nullptr;
  const int32_t* qp = layout == kList && need_dq ? q_ptr->data_ptr<int32_t>() : nullptr;
  const int32_t* qpp = layout == kList && need_dq ? q_pairs->data_ptr<int32_t>() : nullptr;
  const int32_t* dp = layout == kList && need_dd ? d_ptr->data_ptr<int32_t>() : nullptr;
  const int32_t* dpp = layout == kList && need_dd ? d_pairs->data_ptr<int32_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "maxsim_backward_cpu", [&] {
    auto go = [&](auto* am) {
      backward_impl(grad.data_ptr<float>(), q.data_ptr<scalar_t>(), d.data_ptr<scalar_t>(),
                    q.size(0), d.size(0), q.size(1), q_start.data_ptr<int32_t>(),
                    q_len.data_ptr<int32_t>(), Nq, d_start.data_ptr<int32_t>(),
                    d_len.data_ptr<int32_t>(), Nd, pq, pd, am, P, lq, layout, qp, qpp, dp, dpp, normalize,
                    need_dq ? dq.data_ptr<scalar_t>() : nullptr,
                    need_dd ? dd.data_ptr<scalar_t>() : nullptr);
    };
    if (argmax.scalar_type() == at::kShort)
      go(argmax.data_ptr<int16_t>());
    else
      go(argmax.data_ptr<int32_t>());
  });
  return {dq, dd};
}

}  // namespace maxsim
