// CPU forward: exact MaxSim scores (+ argmax) for the CROSS / GROUPED / LIST
// pair layouts of torch_binding.h.
//
// Work item = one document with the queries scored against it (CROSS: a block
// of queries, GROUPED / LIST: one). Per item the document is streamed in
// chunks of DT tokens (fp32 documents without mask are read in place, others
// are converted / compacted into a chunk buffer); every query block runs the
// micro-kernel over the chunk and folds into its running max. Scratch per
// thread: one packed query group, one doc chunk, the running states.
#include <cmath>
#include <limits>
#include <type_traits>

#include "tile_kernels.h"
#include "torch_binding.h"

namespace maxsim {
namespace {
using namespace cpu;

template <class T>
struct Fwd {
  const T *q, *d;
  int64_t dim, Tq, Td, Nq, Nd, lq, DT;
  const int32_t *qs, *ql, *ds, *dl;
  const bool *qm, *dm;
  float* score;
  int32_t* am32;
  int16_t* am16;
};

template <class T>
struct Worker {
  const Fwd<T>& f;
  struct QInfo {
    int64_t nrows, row0, blk0, nblk;  // nrows < 0: invalid query
  };
  int64_t key = -1;  // which query group is packed
  std::vector<QInfo> qi;
  std::vector<int32_t> qrow;  // query row (within its query) of each packed row
  std::vector<int64_t> blkoff;
  std::vector<int8_t> blknv;
  std::vector<RowState> st;
  std::vector<int32_t> jmap;
  Scratch qs_, ds_;
  float* qbuf = nullptr;

  explicit Worker(const Fwd<T>& f) : f(f), jmap(f.DT) {}

  // Packs queries n0 .. n0+cnt-1: valid (unmasked) rows compacted, blocks of
  // QW rows transposed to [dim][nv*W], padding lanes zero.
  void pack(int64_t key_, int64_t n0, int64_t cnt) {
    if (key_ == key) return;
    key = key_;
    qi.clear(), qrow.clear(), blkoff.clear(), blknv.clear();
    int64_t total = 0;
    for (int64_t n = n0; n < n0 + cnt; ++n) {
      QInfo x{-1, int64_t(qrow.size()), int64_t(blkoff.size()), 0};
      const int64_t rows = (n >= 0 && n < f.Nq) ? seg_rows(f.qs, f.ql, n, f.lq, f.Tq) : -1;
      if (rows >= 0) {
        for (int64_t i = 0; i < rows; ++i)
          if (!f.qm || f.qm[f.qs[n] + i]) qrow.push_back(int32_t(i));
        x.nrows = int64_t(qrow.size()) - x.row0;
        x.nblk = (x.nrows + QW - 1) / QW;
        for (int64_t b = 0; b < x.nblk; ++b) {
          const int nv = std::min<int64_t>(QW, x.nrows - b * QW) > W ? 2 : 1;
          blkoff.push_back(total);
          blknv.push_back(int8_t(nv));
          total += f.dim * nv * W;
        }
      }
      qi.push_back(x);
    }
    qbuf = qs_.get(size_t(total));
    std::fill(qbuf, qbuf + total, 0.f);
    for (int64_t g = 0; g < cnt; ++g) {
      const QInfo& x = qi[g];
      for (int64_t t = 0; t < std::max<int64_t>(x.nrows, 0); ++t) {
        const int64_t b = x.blk0 + t / QW, stride = blknv[b] * W;
        const T* src = f.q + (f.qs[n0 + g] + qrow[x.row0 + t]) * f.dim;
        float* dst = qbuf + blkoff[b] + t % QW;
        for (int64_t k = 0; k < f.dim; ++k) dst[k * stride] = to_f32(src[k]);
      }
    }
  }

  // Scores document m against the packed group; pair_of(g) = pair index of
  // the group's g-th query.
  template <class PairOf>
  void run(int64_t m, const PairOf& pair_of) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const int64_t G = int64_t(qi.size());
    const int64_t dlen = (m >= 0 && m < f.Nd) ? seg_rows(f.ds, f.dl, m, kNoWidth, f.Td) : -1;
    if (dlen < 0) {
      for (int64_t g = 0; g < G; ++g) f.score[pair_of(g)] = nan;
      return;
    }
    const int64_t d0 = f.ds[m], dim = f.dim;
    int64_t first = -1;  // first valid doc token: argmax when every sim is -inf
    for (int64_t j = 0; j < dlen && first < 0; ++j)
      if (!f.dm || f.dm[d0 + j]) first = j;
    st.resize(blkoff.size());
    for (auto& s : st) s.reset();
    constexpr bool kF32 = std::is_same<T, float>::value;
    for (int64_t c0 = 0; first >= 0 && c0 < dlen; c0 += f.DT) {
      const int64_t c1 = std::min(dlen, c0 + f.DT);
      const float* rows;
      int64_t nr = 0;
      if (kF32 && !f.dm) {
        rows = reinterpret_cast<const float*>(f.d) + (d0 + c0) * dim;
        for (int64_t j = c0; j < c1; ++j) jmap[nr++] = int32_t(j);
      } else {
        float* buf = ds_.get(size_t(f.DT * dim));
        for (int64_t j = c0; j < c1; ++j) {
          if (f.dm && !f.dm[d0 + j]) continue;
          row_to_f32(f.d + (d0 + j) * dim, buf + nr * dim, dim);
          jmap[nr++] = int32_t(j);
        }
        rows = buf;
      }
      for (int64_t g = 0; g < G; ++g) {
        const QInfo& x = qi[g];
        for (int64_t b = x.blk0; b < x.blk0 + x.nblk; ++b) {
          const auto& tiles = kTiles[blknv[b] - 1];
          for (int64_t j0 = 0; j0 < nr; j0 += RMAX) {
            const int64_t r = std::min<int64_t>(RMAX, nr - j0);
            tiles[r - 1](qbuf + blkoff[b], rows + j0 * dim, dim, dim, jmap.data() + j0, st[b]);
          }
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const QInfo& x = qi[g];
      const int64_t p = pair_of(g);
      if (x.nrows < 0) {
        f.score[p] = nan;
        continue;
      }
      double sum = 0;  // fp32 sims, summed exactly enough to match any order
      for (int64_t t = 0; first >= 0 && t < x.nrows; ++t) {
        const RowState& s = st[x.blk0 + t / QW];
        const int lane = int(t % QW);
        float val = s.cur[lane / W][lane % W];
        int32_t a = s.arg[lane / W][lane % W];
        if (a < 0) val = -std::numeric_limits<float>::infinity(), a = int32_t(first);
        sum += val;
        const int64_t o = p * f.lq + qrow[x.row0 + t];
        if (f.am32) f.am32[o] = a;
        if (f.am16) f.am16[o] = int16_t(a);
      }
      f.score[p] = float(sum);
    }
  }
};

inline void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == 1 &&
                  t.is_contiguous(),
              "maxsim forward_cpu: ", name, " must be a contiguous 1-D int32 CPU tensor");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> forward_cpu(
    const at::Tensor& q, const at::Tensor& q_start, const at::Tensor& q_len,
    const std::optional<at::Tensor>& q_mask, const at::Tensor& d,
    const at::Tensor& d_start, const at::Tensor& d_len,
    const std::optional<at::Tensor>& d_mask, const std::optional<at::Tensor>& pair_q,
    const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
    int64_t argmax_kind, bool /*tf32: exact fp32 only on CPU*/) {
  TORCH_CHECK(q.device().is_cpu() && d.device().is_cpu(), "maxsim forward_cpu: CPU tensors expected");
  TORCH_CHECK(q.dim() == 2 && d.dim() == 2 && q.size(1) == d.size(1),
              "maxsim forward_cpu: q and d must be [T, dim] with the same dim");
  TORCH_CHECK(q.scalar_type() == d.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kHalf ||
                   q.scalar_type() == at::kBFloat16),
              "maxsim forward_cpu: q and d must share dtype float32, float16 or bfloat16");
  TORCH_CHECK(q.is_contiguous() && d.is_contiguous(), "maxsim forward_cpu: q, d must be contiguous");
  check_index(q_start, "q_start"), check_index(q_len, "q_len");
  check_index(d_start, "d_start"), check_index(d_len, "d_len");
  TORCH_CHECK(q_start.numel() == q_len.numel() && d_start.numel() == d_len.numel(),
              "maxsim forward_cpu: start/len size mismatch");
  for (const auto* m : {&q_mask, &d_mask}) {
    if (!m->has_value()) continue;
    const at::Tensor& t = **m;
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBool && t.dim() == 1 &&
                    t.is_contiguous() && t.numel() == (m == &q_mask ? q : d).size(0),
                "maxsim forward_cpu: masks must be contiguous bool [T] CPU tensors");
  }
  TORCH_CHECK(layout >= kCross && layout <= kList, "maxsim forward_cpu: bad layout ", layout);
  TORCH_CHECK(argmax_kind >= kNoArgmax && argmax_kind <= kArgmaxI16,
              "maxsim forward_cpu: bad argmax_kind ", argmax_kind);
  TORCH_CHECK(lq >= 0, "maxsim forward_cpu: lq must be >= 0");

  const int64_t Nq = q_start.numel(), Nd = d_start.numel();
  int64_t P = 0;
  if (layout == kCross) {
    P = Nq * Nd;
  } else if (layout == kGrouped) {
    TORCH_CHECK(Nq > 0 ? Nd % Nq == 0 : Nd == 0, "maxsim forward_cpu: GROUPED needs Nd % Nq == 0");
    P = Nd;
  } else {
    TORCH_CHECK(pair_q.has_value() && pair_d.has_value(), "maxsim forward_cpu: LIST needs pair_q, pair_d");
    check_index(*pair_q, "pair_q"), check_index(*pair_d, "pair_d");
    TORCH_CHECK(pair_q->numel() == pair_d->numel(), "maxsim forward_cpu: pair_q/pair_d size mismatch");
    P = pair_q->numel();
  }

  auto scores = at::zeros({P}, q.options().dtype(at::kFloat));
  at::Tensor argmax =
      argmax_kind == kNoArgmax
          ? at::empty({0}, q.options().dtype(at::kInt))
          : at::full({P, lq}, -1, q.options().dtype(argmax_kind == kArgmaxI16 ? at::kShort : at::kInt));
  if (P == 0) return {scores, argmax};

  const int64_t dim = q.size(1), nthreads = at::get_num_threads();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "maxsim_forward_cpu", [&] {
    Fwd<scalar_t> f{};
    f.q = q.data_ptr<scalar_t>(), f.d = d.data_ptr<scalar_t>();
    f.dim = dim, f.Tq = q.size(0), f.Td = d.size(0), f.Nq = Nq, f.Nd = Nd, f.lq = lq;
    // Doc chunk of ~256 KiB fp32, a multiple of the micro-tile height.
    f.DT = std::max<int64_t>(RMAX, (65536 / std::max<int64_t>(dim, 1)) / RMAX * RMAX);
    f.qs = q_start.data_ptr<int32_t>(), f.ql = q_len.data_ptr<int32_t>();
    f.ds = d_start.data_ptr<int32_t>(), f.dl = d_len.data_ptr<int32_t>();
    f.qm = q_mask ? q_mask->data_ptr<bool>() : nullptr;
    f.dm = d_mask ? d_mask->data_ptr<bool>() : nullptr;
    f.score = scores.data_ptr<float>();
    f.am32 = argmax_kind == kArgmaxI32 ? argmax.data_ptr<int32_t>() : nullptr;
    f.am16 = argmax_kind == kArgmaxI16 ? argmax.data_ptr<int16_t>() : nullptr;

    if (layout == kCross) {
      // A block of QB queries shares each document chunk; keep the packed
      // block near L2 size and leave enough items for every thread.
      int64_t QB = std::max<int64_t>(1, std::min<int64_t>(Nq, 512 / std::max<int64_t>(lq, 1)));
      while (QB > 1 && (Nq + QB - 1) / QB * Nd < 8 * nthreads) QB = (QB + 1) / 2;
      const int64_t items = (Nq + QB - 1) / QB * Nd;
      parallel_items(items, items / (8 * nthreads), [&](auto&& grab) {
        Worker<scalar_t> w(f);
        int64_t b, e;
        while (grab(b, e))
          for (int64_t k = b; k < e; ++k) {
            const int64_t g = k / Nd, m = k % Nd, n0 = g * QB;
            w.pack(g, n0, std::min(QB, Nq - n0));
            w.run(m, [&](int64_t i) { return (n0 + i) * Nd + m; });
          }
      });
    } else if (layout == kGrouped) {
      const int64_t K = Nd / Nq;
      parallel_items(Nd, Nd / (8 * nthreads), [&](auto&& grab) {
        Worker<scalar_t> w(f);
        int64_t b, e;
        while (grab(b, e))
          for (int64_t m = b; m < e; ++m) {
            w.pack(m / K, m / K, 1);
            w.run(m, [&](int64_t) { return m; });
          }
      });
    } else {
      const int32_t *pq = pair_q->data_ptr<int32_t>(), *pd = pair_d->data_ptr<int32_t>();
      parallel_items(P, P / (8 * nthreads), [&](auto&& grab) {
        Worker<scalar_t> w(f);
        int64_t b, e;
        while (grab(b, e))
          for (int64_t p = b; p < e; ++p) {
            w.pack(pq[p] >= 0 && pq[p] < Nq ? pq[p] : -2, pq[p], 1);  // out of range: invalid
            w.run(pd[p], [&](int64_t) { return p; });
          }
      });
    }
  });
  return {scores, argmax};
}

}  // namespace maxsim
