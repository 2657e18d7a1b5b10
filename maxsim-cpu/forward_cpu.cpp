// CPU forward: exact MaxSim scores (+ argmax) for the CROSS / GROUPED / LIST
// pair layouts of torch_binding.h.
//
// Work item = one document with the queries scored against it (CROSS: a block
// of queries packed together, GROUPED / LIST: one). Consecutive items of a
// thread usually share the query, which then stays packed. The document is
// streamed in chunks of DT tokens (fp32 without mask read in place, otherwise
// converted / compacted into a chunk buffer) and every packed query block
// runs the micro-kernel over each chunk. When there are too few pairs to
// occupy the threads, documents are split into parts whose per-row maxima
// are merged afterwards (exactly, in token order: results do not depend on
// the thread count). Scratch per thread: a packed query group, one document
// chunk, the running states.
#include <limits>
#include <type_traits>

#include "normalize_rows.h"
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
  const float *qsc, *dsc;  // inverse row norms (normalize), else null
  float* score;
  int32_t* am32;
  int16_t* am16;
  void set_arg(int64_t o, int32_t a) const {
    if (am32) am32[o] = a;
    if (am16) am16[o] = int16_t(a);
  }
};

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// First valid token of a document (argmax when every sim is -inf), -1: none.
inline int64_t first_valid(const bool* dm, int64_t d0, int64_t dlen) {
  for (int64_t j = 0; j < dlen; ++j)
    if (!dm || dm[d0 + j]) return j;
  return -1;
}

template <class T>
struct Worker {
  const Fwd<T>& f;
  struct QInfo {
    int64_t nrows, row0;  // nrows < 0: invalid query; rows row0 .. of the group
  };
  int64_t key = -1;  // which query group is packed
  std::vector<QInfo> qi;
  std::vector<int32_t> qrow;  // query row (within its query) of each packed row
  std::vector<int64_t> qsrc;  // source row in q of each packed row
  std::vector<int64_t> blkoff;
  std::vector<int8_t> blknv;
  std::vector<RowState> st;
  std::vector<int32_t> jmap;
  Scratch qs_, ds_;
  float* qbuf = nullptr;

  explicit Worker(const Fwd<T>& f) : f(f), jmap(f.DT) {}

  // Packs queries n0 .. n0+cnt-1: their valid (unmasked) rows, concatenated,
  // in blocks of QW rows transposed to [dim][nv*W] (padding lanes zero). A
  // block may hold rows of several queries, so short queries fill the lanes.
  void pack(int64_t key_, int64_t n0, int64_t cnt) {
    if (key_ == key) return;
    key = key_;
    qi.clear(), qrow.clear(), qsrc.clear(), blkoff.clear(), blknv.clear();
    for (int64_t n = n0; n < n0 + cnt; ++n) {
      QInfo x{-1, int64_t(qrow.size())};
      const int64_t rows = (n >= 0 && n < f.Nq) ? seg_rows(f.qs, f.ql, n, f.lq, f.Tq) : -1;
      for (int64_t i = 0; i < rows; ++i)
        if (!f.qm || f.qm[f.qs[n] + i]) qrow.push_back(int32_t(i)), qsrc.push_back(f.qs[n] + i);
      if (rows >= 0) x.nrows = int64_t(qrow.size()) - x.row0;
      qi.push_back(x);
    }
    const int64_t R = int64_t(qrow.size());
    int64_t total = 0;
    for (int64_t r0 = 0; r0 < R; r0 += QW) {
      const int nv = std::min<int64_t>(QW, R - r0) > W ? 2 : 1;
      blkoff.push_back(total);
      blknv.push_back(int8_t(nv));
      total += f.dim * nv * W;
    }
    qbuf = qs_.get(size_t(total));
    std::fill(qbuf, qbuf + total, 0.f);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t stride = blknv[r / QW] * W;
      const T* src = f.q + qsrc[r] * f.dim;
      float* dst = qbuf + blkoff[r / QW] + r % QW;
      const float s = f.qsc ? f.qsc[qsrc[r]] : 1.f;
      for (int64_t k = 0; k < f.dim; ++k) dst[k * stride] = to_f32(src[k]) * s;
    }
  }

  // Folds tokens [jb, je) of the document starting at row d0 into the running
  // states of every packed query block.
  void fold(int64_t d0, int64_t jb, int64_t je) {
    const int64_t dim = f.dim;
    const bool direct = std::is_same<T, float>::value && !f.dm && !f.dsc;  // rows read in place
    for (int64_t c0 = jb; c0 < je; c0 += f.DT) {
      const int64_t c1 = std::min(je, c0 + f.DT);
      const float* rows;
      int64_t nr = 0;
      if (direct) {
        rows = reinterpret_cast<const float*>(f.d) + (d0 + c0) * dim;
        for (int64_t j = c0; j < c1; ++j) jmap[nr++] = int32_t(j);
      } else {
        float* buf = ds_.get(size_t(f.DT * dim));
        for (int64_t j = c0; j < c1; ++j) {
          if (f.dm && !f.dm[d0 + j]) continue;
          float* row = buf + nr * dim;
          row_to_f32(f.d + (d0 + j) * dim, row, dim);
          if (f.dsc)
            for (int64_t k = 0; k < dim; ++k) row[k] *= f.dsc[d0 + j];
          jmap[nr++] = int32_t(j);
        }
        rows = buf;
      }
      // Prefetch what the following tiles read from DRAM: the next tile for
      // in-place fp32 rows, else the raw rows after this chunk (the next
      // chunk, or usually the next document).
      const int64_t pf_tile = RMAX * dim * int64_t(direct ? 4 : sizeof(T));
      const uintptr_t pf0 = direct ? reinterpret_cast<uintptr_t>(rows) + pf_tile
                                   : reinterpret_cast<uintptr_t>(f.d) + (d0 + c1) * dim * sizeof(T);
      for (size_t b = 0; b < blkoff.size(); ++b) {
        const auto& tiles = kTiles[blknv[b] - 1];
        for (int64_t j0 = 0; j0 < nr; j0 += RMAX) {
          const int64_t r = std::min<int64_t>(RMAX, nr - j0);
          tiles[r - 1](qbuf + blkoff[b], rows + j0 * dim, dim, dim, jmap.data() + j0,
                       pf0 + j0 / RMAX * pf_tile, pf_tile / 64, st[b]);
        }
      }
    }
  }

  void reset_states() {
    st.resize(blkoff.size());
    for (auto& s : st) s.reset();
  }
  // Packed row t of query x: (running max, argmax or -1).
  std::pair<float, int32_t> lane(const QInfo& x, int64_t t) const {
    const RowState& s = st[(x.row0 + t) / QW];
    const int l = int((x.row0 + t) % QW);
    return {s.cur[l / W][l % W], s.arg[l / W][l % W]};
  }

  // Scores document m against the packed group; pair_of(g) = pair index of
  // the group's g-th query.
  template <class PairOf>
  void run(int64_t m, const PairOf& pair_of) {
    const int64_t G = int64_t(qi.size());
    const int64_t dlen = (m >= 0 && m < f.Nd) ? seg_rows(f.ds, f.dl, m, kNoWidth, f.Td) : -1;
    if (dlen < 0) {
      for (int64_t g = 0; g < G; ++g) f.score[pair_of(g)] = kNaN;
      return;
    }
    const int64_t d0 = f.ds[m], first = first_valid(f.dm, d0, dlen);
    reset_states();
    if (first >= 0) fold(d0, 0, dlen);
    for (int64_t g = 0; g < G; ++g) {
      const QInfo& x = qi[g];
      const int64_t p = pair_of(g);
      if (x.nrows < 0) {
        f.score[p] = kNaN;
        continue;
      }
      double sum = 0;  // fp32 sims, summed exactly enough to match any order
      for (int64_t t = 0; first >= 0 && t < x.nrows; ++t) {
        auto [val, a] = lane(x, t);
        if (a < 0) val = -kInf, a = int32_t(first);
        sum += val;
        f.set_arg(p * f.lq + qrow[x.row0 + t], a);
      }
      f.score[p] = float(sum);
    }
  }

  // Part s of S of pair p's document (a single packed query): raw per-row
  // states into pv / pa [P, S, lq], combined later by merge_parts.
  void run_part(int64_t m, int64_t p, int64_t s, int64_t S, float* pv, int32_t* pa) {
    const int64_t dlen = (m >= 0 && m < f.Nd) ? seg_rows(f.ds, f.dl, m, kNoWidth, f.Td) : -1;
    const QInfo& x = qi[0];
    if (dlen <= 0 || x.nrows <= 0) return;
    const int64_t span = ((dlen + S - 1) / S + RMAX - 1) / RMAX * RMAX;
    const int64_t jb = s * span, je = std::min(dlen, jb + span);
    if (jb >= je) return;
    reset_states();
    fold(f.ds[m], jb, je);
    for (int64_t t = 0; t < x.nrows; ++t) {
      const int64_t o = (p * S + s) * f.lq + qrow[x.row0 + t];
      std::tie(pv[o], pa[o]) = lane(x, t);
    }
  }
};

// Combines the parts of every pair in document order with the fold's rules
// (first NaN wins, else strictly greater), then scores as Worker::run does.
template <class T, class Ids>
void merge_parts(const Fwd<T>& f, int64_t P, int64_t S, const float* pv, const int32_t* pa,
                 const Ids& ids) {
  parallel_items(P, 1 + P / (8 * at::get_num_threads()), [&](auto&& grab) {
    int64_t b, e;
    while (grab(b, e))
      for (int64_t p = b; p < e; ++p) {
        auto [n, m] = ids(p);
        const int64_t rows = (n >= 0 && n < f.Nq) ? seg_rows(f.qs, f.ql, n, f.lq, f.Tq) : -1;
        const int64_t dlen = (m >= 0 && m < f.Nd) ? seg_rows(f.ds, f.dl, m, kNoWidth, f.Td) : -1;
        if (rows < 0 || dlen < 0) {
          f.score[p] = kNaN;
          continue;
        }
        const int64_t first = first_valid(f.dm, f.ds[m], dlen);
        double sum = 0;
        for (int64_t i = 0; first >= 0 && i < rows; ++i) {
          if (f.qm && !f.qm[f.qs[n] + i]) continue;
          float val = -kInf;
          int32_t a = -1;
          for (int64_t s = 0; s < S; ++s) {
            const int64_t o = (p * S + s) * f.lq + i;
            if (pa[o] >= 0 && !(pv[o] <= val) && val == val) val = pv[o], a = pa[o];
          }
          if (a < 0) val = -kInf, a = int32_t(first);
          sum += val;
          f.set_arg(p * f.lq + i, a);
        }
        f.score[p] = float(sum);
      }
  });
}

// float64 inputs (gradient checks, references): a plain loop in fp64 with
// fp64 scores, under the same rules as the tiled path (masked / out-of-range
// tokens skipped, the first NaN wins, else strictly greater, so ties go to
// the lowest index; all sims -inf -> the first valid token; an invalid
// query or document -> NaN).
template <class Ids>
void forward_f64(const double* q, const double* d, int64_t dim, int64_t Tq, int64_t Td, int64_t Nq, int64_t Nd,
                 int64_t lq, const int32_t* qs, const int32_t* ql, const int32_t* ds, const int32_t* dl,
                 const bool* qm, const bool* dm, const double* qsc, const double* dsc, int64_t P, const Ids& ids,
                 double* score, int32_t* am32, int16_t* am16) {
  at::parallel_for(0, P, 16, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      auto [n, m] = ids(p);
      const int64_t rows = (n >= 0 && n < Nq) ? seg_rows(qs, ql, n, lq, Tq) : -1;
      const int64_t dlen = (m >= 0 && m < Nd) ? seg_rows(ds, dl, m, kNoWidth, Td) : -1;
      if (rows < 0 || dlen < 0) {
        score[p] = std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      const int64_t d0 = ds[m], first = first_valid(dm, d0, dlen);
      double sum = 0;
      for (int64_t i = 0; first >= 0 && i < rows; ++i) {
        if (qm && !qm[qs[n] + i]) continue;
        const double* qi = q + (qs[n] + i) * dim;
        double val = -std::numeric_limits<double>::infinity();
        int64_t a = -1;
        for (int64_t j = 0; j < dlen; ++j) {
          if (dm && !dm[d0 + j]) continue;
          const double* dj = d + (d0 + j) * dim;
          double v = 0;
          for (int64_t k = 0; k < dim; ++k) v += qi[k] * dj[k];
          if (qsc) v *= qsc[qs[n] + i] * dsc[d0 + j];
          if (!(v <= val) && val == val) val = v, a = j;
        }
        if (a < 0) val = -std::numeric_limits<double>::infinity(), a = first;
        sum += val;
        if (am32) am32[p * lq + i] = int32_t(a);
        if (am16) am16[p * lq + i] = int16_t(a);
      }
      score[p] = sum;
    }
  });
}

inline void check_index(const at::Tensor& t, const char* name) {
  MAXSIM_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(),
               "maxsim forward_cpu: %s must be a contiguous 1-D int32 CPU tensor", name);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> forward_cpu(
    const at::Tensor& q, const at::Tensor& q_start, const at::Tensor& q_len,
    const std::optional<at::Tensor>& q_mask, const at::Tensor& d,
    const at::Tensor& d_start, const at::Tensor& d_len,
    const std::optional<at::Tensor>& d_mask, const std::optional<at::Tensor>& pair_q,
    const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
    int64_t argmax_kind, int64_t /*precision: the CPU is exact (fp32 products, fp64 for fp64)*/, bool normalize) {
  TORCH_CHECK(q.device().is_cpu() && d.device().is_cpu(), "maxsim forward_cpu: CPU tensors expected");
  TORCH_CHECK(q.dim() == 2 && d.dim() == 2 && q.size(1) == d.size(1),
              "maxsim forward_cpu: q and d must be [T, dim] with the same dim");
  TORCH_CHECK(q.scalar_type() == d.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kHalf ||
                   q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kDouble),
              "maxsim forward_cpu: q and d must share dtype float32, float16, bfloat16 or float64");
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
  MAXSIM_CHECK(layout >= kCross && layout <= kList, "maxsim forward_cpu: bad layout %lld", (long long)layout);
  MAXSIM_CHECK(argmax_kind >= kNoArgmax && argmax_kind <= kArgmaxI16, "maxsim forward_cpu: bad argmax_kind %lld",
               (long long)argmax_kind);
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

  const bool f64 = q.scalar_type() == at::kDouble;  // fp64 in, fp64 scores out
  auto scores = at::zeros({P}, q.options().dtype(f64 ? at::kDouble : at::kFloat));
  at::Tensor argmax =
      argmax_kind == kNoArgmax
          ? at::empty({0}, q.options().dtype(at::kInt))
          : at::full({P, lq}, -1, q.options().dtype(argmax_kind == kArgmaxI16 ? at::kShort : at::kInt));
  if (P == 0) return {scores, argmax};

  const int64_t dim = q.size(1), nthreads = at::get_num_threads();
  // (query, document) of pair p.
  const int64_t K = layout == kGrouped ? Nd / Nq : 1;
  const int32_t* pq = layout == kList ? pair_q->data_ptr<int32_t>() : nullptr;
  const int32_t* pd = layout == kList ? pair_d->data_ptr<int32_t>() : nullptr;
  auto ids = [&](int64_t p) -> std::pair<int64_t, int64_t> {
    return layout == kCross ? std::make_pair(p / Nd, p % Nd)
           : layout == kGrouped ? std::make_pair(p / K, p)
                                : std::make_pair(int64_t(pq[p]), int64_t(pd[p]));
  };
  if (f64) {
    const auto qsc = inv_row_norms<double>(normalize, q.data_ptr<double>(), q.size(0), dim, kNormEps);
    const auto dsc = inv_row_norms<double>(normalize, d.data_ptr<double>(), d.size(0), dim, kNormEps);
    forward_f64(q.data_ptr<double>(), d.data_ptr<double>(), dim, q.size(0), d.size(0), Nq, Nd, lq,
                q_start.data_ptr<int32_t>(), q_len.data_ptr<int32_t>(), d_start.data_ptr<int32_t>(),
                d_len.data_ptr<int32_t>(), q_mask ? q_mask->data_ptr<bool>() : nullptr,
                d_mask ? d_mask->data_ptr<bool>() : nullptr, normalize ? qsc.data() : nullptr,
                normalize ? dsc.data() : nullptr, P, ids, scores.data_ptr<double>(),
                argmax_kind == kArgmaxI32 ? argmax.data_ptr<int32_t>() : nullptr,
                argmax_kind == kArgmaxI16 ? argmax.data_ptr<int16_t>() : nullptr);
    return {scores, argmax};
  }
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
    const auto qsc = inv_row_norms<float>(normalize, f.q, f.Tq, dim, kNormEps);
    const auto dsc = inv_row_norms<float>(normalize, f.d, f.Td, dim, kNormEps);
    f.qsc = normalize ? qsc.data() : nullptr;
    f.dsc = normalize ? dsc.data() : nullptr;
    f.score = scores.data_ptr<float>();
    f.am32 = argmax_kind == kArgmaxI32 ? argmax.data_ptr<int32_t>() : nullptr;
    f.am16 = argmax_kind == kArgmaxI16 ? argmax.data_ptr<int16_t>() : nullptr;

    // Work items: CROSS a block of QB queries x one document (the block
    // shares each document chunk; sized near L2, leaving items for every
    // thread), GROUPED / LIST one pair. When pairs are too few to occupy the
    // threads, each document is split into S parts, merged afterwards.
    int64_t QB = 1, items = P;
    if (layout == kCross) {
      QB = std::max<int64_t>(1, std::min<int64_t>(Nq, 512 / std::max<int64_t>(lq, 1)));
      while (QB > 1 && (Nq + QB - 1) / QB * Nd < 8 * nthreads) QB = (QB + 1) / 2;
      items = (Nq + QB - 1) / QB * Nd;
    }
    int64_t S = 1;
    if (QB == 1 && items < 4 * nthreads) {
      const int64_t ld = Nd ? d_len.max().item<int32_t>() : 0;
      S = std::max<int64_t>(1, std::min((4 * nthreads + items - 1) / items, ld / 256));
    }
    std::vector<float> pv(S > 1 ? P * S * lq : 0, -kInf);
    std::vector<int32_t> pa(pv.size(), -1);
    parallel_items(items * S, items * S / (8 * nthreads), [&](auto&& grab) {
      Worker<scalar_t> w(f);
      int64_t b, e;
      while (grab(b, e))
        for (int64_t it = b; it < e; ++it) {
          const int64_t k = it / S;
          if (layout == kCross) {
            const int64_t g = k / Nd, m = k % Nd, n0 = g * QB;
            w.pack(g, n0, std::min(QB, Nq - n0));
            if (S == 1) w.run(m, [&](int64_t i) { return (n0 + i) * Nd + m; });
            else w.run_part(m, n0 * Nd + m, it % S, S, pv.data(), pa.data());
            continue;
          }
          auto [n, m] = ids(k);
          w.pack(n >= 0 && n < Nq ? n : -2, n, 1);  // -2: out of range, packs as invalid
          if (S == 1) w.run(m, [&](int64_t) { return k; });
          else w.run_part(m, k, it % S, S, pv.data(), pa.data());
        }
    });
    if (S > 1) merge_parts(f, P, S, pv.data(), pa.data(), ids);
  });
  return {scores, argmax};
}

}  // namespace maxsim

namespace maxsim {

// Quantized tokens on the CPU: dequantised to fp32 (the caller bounds the
// size: search scores a corpus chunk by chunk), then the exact fp32 path.
std::tuple<at::Tensor, at::Tensor> forward_quant_cpu(
    const at::Tensor& q, const at::Tensor& q_scale, const at::Tensor& q_start, const at::Tensor& q_len,
    const std::optional<at::Tensor>& q_mask, const at::Tensor& d, const at::Tensor& d_scale,
    const at::Tensor& d_start, const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
    const std::optional<at::Tensor>& pair_q, const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
    int64_t argmax_kind, bool /*uniform_doc_scales: per-token scales are exact either way*/) {
  TORCH_CHECK(q.scalar_type() == d.scalar_type() &&
                  (q.scalar_type() == at::kChar || q.scalar_type() == at::kFloat8_e4m3fn),
              "maxsim forward_quant_cpu: q and d must share dtype int8 or float8_e4m3fn");
  TORCH_CHECK(q.dim() == 2 && d.dim() == 2 && q_scale.dim() == 1 && d_scale.dim() == 1 &&
                  q_scale.numel() == q.size(0) && d_scale.numel() == d.size(0) &&
                  q_scale.scalar_type() == at::kFloat && d_scale.scalar_type() == at::kFloat,
              "maxsim forward_quant_cpu: q_scale [Tq] and d_scale [Td] must be float32");
  const at::Tensor qf = (q.to(at::kFloat) * q_scale.unsqueeze(1)).contiguous();
  const at::Tensor df = (d.to(at::kFloat) * d_scale.unsqueeze(1)).contiguous();
  return forward_cpu(qf, q_start, q_len, q_mask, df, d_start, d_len, d_mask, pair_q, pair_d, layout, lq,
                     argmax_kind, false, false);
}

}  // namespace maxsim
