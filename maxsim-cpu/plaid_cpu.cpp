// PLAID / ColBERTv2 compressed documents on the CPU (contract in
// torch-ext/torch_binding.h, codec in torch-ext/plaid_codec.h): tokens are
// decompressed one at a time into a stack row, never into a tensor.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "normalize_rows.h"
#include "plaid_args.h"
#include "torch_binding.h"

namespace maxsim {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A document's token range, or len -1 when it leaves [0, tokens) (scores NaN).
inline void doc_range(const int32_t* st, const int32_t* ln, int64_t n, int64_t tokens, int64_t& s, int64_t& l) {
  s = st[n];
  l = std::max<int64_t>(ln[n], 0);
  if (s < 0 || s + l > tokens) l = -1;
}

struct Decoder {
  const int32_t* codes;
  const uint8_t* res;
  const float* cent;
  const float* bw;
  int64_t dim, packed, n_centroids;
  int nbits;
  bool normalize;

  // Token t into row[0..dim); returns the factor its products are scaled by.
  float token(int64_t t, float* row) const {
    const float* c = cent + (int64_t)plaid::clamp_code(codes[t], n_centroids) * dim;
    const uint8_t* r = res + t * packed;
    float ss = 0.f;
    for (int64_t f = 0; f < dim; ++f) {
      row[f] = c[f] + bw[plaid::bucket_of(r, f, nbits)];
      ss += row[f] * row[f];
    }
    return normalize ? 1.f / std::max(std::sqrt(ss), kNormEpsF) : 1.f;
  }
};

}  // namespace

at::Tensor plaid_approx_cpu(const at::Tensor& qcs_in, const at::Tensor& codes_in, const at::Tensor& d_start_in,
                            const at::Tensor& d_len_in, const std::optional<at::Tensor>& keep_in) {
  TORCH_CHECK(qcs_in.device().is_cpu(), "maxsim: plaid_approx_cpu takes CPU tensors");
  plaid::check_score_table(qcs_in);
  TORCH_CHECK(codes_in.dim() == 1 && codes_in.scalar_type() == at::kInt && codes_in.device().is_cpu(),
              "maxsim: plaid_approx codes must be int32 [T]");
  plaid::check_segments(d_start_in, d_len_in, qcs_in.device());
  plaid::check_keep(keep_in, qcs_in);
  // 16-bit tables widen exactly: maxima and fp32 sums as on the GPU.
  const at::Tensor qcs = qcs_in.to(at::kFloat).contiguous(), codes = codes_in.contiguous();
  const at::Tensor st = d_start_in.contiguous(), ln = d_len_in.contiguous();
  const int64_t nq = qcs.size(0), C = qcs.size(1), lq = qcs.size(2), nd = st.size(0), T = codes.size(0);
  const at::Tensor keep = keep_in ? keep_in->contiguous() : at::Tensor();
  const uint8_t* kp = keep_in ? keep.data_ptr<uint8_t>() : nullptr;
  at::Tensor out = at::empty({nq, nd}, qcs.options());
  const float* qp = qcs.data_ptr<float>();
  const int32_t* cp = codes.data_ptr<int32_t>();
  const int32_t *sp = st.data_ptr<int32_t>(), *lp = ln.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, nq * nd, 16, [&](int64_t p0, int64_t p1) {
    std::vector<float> m(lq);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t i = p / nd, n = p % nd;
      int64_t s0, len;
      doc_range(sp, lp, n, T, s0, len);
      if (len < 0 || C == 0) {
        op[p] = len == 0 ? 0.f : std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      std::fill(m.begin(), m.end(), kNegInf);
      bool any = false;
      for (int64_t t = s0; t < s0 + len; ++t) {
        const int64_t c = plaid::clamp_code(cp[t], C);
        if (kp && !kp[i * C + c]) continue;
        any = true;
        const float* row = qp + (i * C + c) * lq;
        for (int64_t s = 0; s < lq; ++s) m[s] = std::max(m[s], row[s]);
      }
      float acc = 0.f;
      for (int64_t s = 0; s < lq; ++s) acc += any ? m[s] : 0.f;
      op[p] = acc;
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> plaid_forward_cpu(const at::Tensor& q_in, const at::Tensor& codes_in,
                                                     const at::Tensor& res_in, const at::Tensor& cent_in,
                                                     const at::Tensor& bw_in, const at::Tensor& st_in,
                                                     const at::Tensor& ln_in, const std::optional<at::Tensor>& pair_q,
                                                     int64_t nbits, bool normalize, bool want_argmax) {
  TORCH_CHECK(q_in.device().is_cpu(), "maxsim: plaid_forward_cpu takes CPU tensors");
  const plaid::Shapes sh = plaid::check_forward(q_in, codes_in, res_in, cent_in, bw_in, st_in, ln_in, pair_q, nbits);
  const at::Tensor q = q_in.contiguous(), codes = codes_in.contiguous(), res = res_in.contiguous();
  const at::Tensor cent = cent_in.contiguous(), bw = bw_in.contiguous(), st = st_in.contiguous(),
                   ln = ln_in.contiguous();
  const at::Tensor pq = pair_q.has_value() ? pair_q->contiguous() : at::Tensor();
  const int64_t P = sh.pairs, lq = sh.lq, dim = sh.dim, nd = sh.nd;
  at::Tensor scores = pair_q.has_value() ? at::empty({nd}, q.options()) : at::empty({sh.nq, nd}, q.options());
  at::Tensor argmax = want_argmax ? at::empty({P, lq}, q.options().dtype(at::kInt)) : at::empty({0}, q.options().dtype(at::kInt));
  const Decoder dec{codes.data_ptr<int32_t>(), res.data_ptr<uint8_t>(), cent.data_ptr<float>(), bw.data_ptr<float>(),
                    dim, sh.packed, sh.n_centroids, (int)nbits, normalize};
  const float* qp = q.data_ptr<float>();
  const int32_t *sp = st.data_ptr<int32_t>(), *lp = ln.data_ptr<int32_t>();
  const int32_t* pqp = pair_q.has_value() ? pq.data_ptr<int32_t>() : nullptr;
  float* op = scores.data_ptr<float>();
  int32_t* ap = want_argmax ? argmax.data_ptr<int32_t>() : nullptr;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> row(std::max<int64_t>(dim, 1)), m(lq);
    std::vector<int32_t> w(lq);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = pqp ? p : p % nd;
      const int64_t i = pqp ? pqp[p] : p / nd;
      int64_t s0, len;
      doc_range(sp, lp, n, sh.tokens, s0, len);
      if (i < 0 || i >= sh.nq) len = -1;
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(w.begin(), w.end(), -1);
      for (int64_t t = 0; t < len; ++t) {
        const float scale = dec.token(s0 + t, row.data());
        const float* qi = qp + i * lq * dim;
        for (int64_t s = 0; s < lq; ++s) {
          float dot = 0.f;
          for (int64_t f = 0; f < dim; ++f) dot += qi[s * dim + f] * row[f];
          dot *= scale;
          if (dot > m[s]) m[s] = dot, w[s] = (int32_t)t;
        }
      }
      float acc = 0.f;
      for (int64_t s = 0; s < lq; ++s) acc += w[s] >= 0 ? m[s] : 0.f;
      op[p] = len < 0 ? std::numeric_limits<float>::quiet_NaN() : acc;
      if (ap) std::copy(w.begin(), w.end(), ap + p * lq);
    }
  });
  if (want_argmax && !pair_q.has_value()) argmax = argmax.view({sh.nq, nd, lq});
  return {scores, argmax};
}

at::Tensor plaid_backward_cpu(const at::Tensor& grad_in, const at::Tensor& q_in, const at::Tensor& codes_in,
                              const at::Tensor& res_in, const at::Tensor& cent_in, const at::Tensor& bw_in,
                              const at::Tensor& st_in, const at::Tensor& ln_in, const at::Tensor& argmax_in,
                              int64_t nbits, bool normalize) {
  TORCH_CHECK(q_in.device().is_cpu(), "maxsim: plaid_backward_cpu takes CPU tensors");
  const plaid::Shapes sh = plaid::check_forward(q_in, codes_in, res_in, cent_in, bw_in, st_in, ln_in, {}, nbits);
  TORCH_CHECK(grad_in.scalar_type() == at::kFloat && grad_in.sizes() == at::IntArrayRef({sh.nq, sh.nd}),
              "maxsim: plaid_backward grad must be float32 [Nq, Nd]");
  TORCH_CHECK(argmax_in.scalar_type() == at::kInt && argmax_in.sizes() == at::IntArrayRef({sh.nq, sh.nd, sh.lq}),
              "maxsim: plaid_backward argmax must be int32 [Nq, Nd, Lq]");
  const at::Tensor grad = grad_in.contiguous(), argmax = argmax_in.contiguous(), codes = codes_in.contiguous();
  const at::Tensor res = res_in.contiguous(), cent = cent_in.contiguous(), bw = bw_in.contiguous();
  const at::Tensor st = st_in.contiguous(), ln = ln_in.contiguous();
  const int64_t nq = sh.nq, lq = sh.lq, dim = sh.dim, nd = sh.nd;
  at::Tensor dq = at::zeros({nq, lq, dim}, q_in.options());
  const Decoder dec{codes.data_ptr<int32_t>(), res.data_ptr<uint8_t>(), cent.data_ptr<float>(), bw.data_ptr<float>(),
                    dim, sh.packed, sh.n_centroids, (int)nbits, normalize};
  const float* gp = grad.data_ptr<float>();
  const int32_t* ap = argmax.data_ptr<int32_t>();
  const int32_t *sp = st.data_ptr<int32_t>(), *lp = ln.data_ptr<int32_t>();
  float* dp = dq.data_ptr<float>();
  at::parallel_for(0, nq * lq, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(std::max<int64_t>(dim, 1));
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = r / lq, s = r % lq;
      float* out = dp + r * dim;
      for (int64_t n = 0; n < nd; ++n) {
        const int32_t t = ap[(i * nd + n) * lq + s];
        int64_t s0, len;
        doc_range(sp, lp, n, sh.tokens, s0, len);
        if (t < 0 || t >= len) continue;
        const float g = gp[i * nd + n] * dec.token(s0 + t, row.data());
        for (int64_t f = 0; f < dim; ++f) out[f] += g * row[f];
      }
    }
  });
  return dq;
}

}  // namespace maxsim
