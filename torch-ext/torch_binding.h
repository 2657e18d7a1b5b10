// The op contract every backend implements (CPU, CUDA, MPS).
//
// All public layouts (padded candidates, contrastive, packed pairs, masks) are
// lowered by the Python layer to one representation:
//   q  [Tq, dim]  query token rows,    d  [Td, dim] document token rows
//      (same float dtype: fp32 / fp16 / bf16; contiguous)
//   q_start, q_len [Nq] int32 : query n owns rows q_start[n] .. q_start[n]+q_len[n]-1
//   d_start, d_len [Nd] int32 : likewise for documents
//   a length < 0 marks an invalid segment (bad user lengths/offsets detected
//   on device): every pair touching it scores NaN.
//   q_mask [Tq], d_mask [Td] optional bool: false = token ignored.
//   layout (which (query, document) pairs are scored; P = number of pairs):
//     0 CROSS   P = Nq*Nd, pair p = (p / Nd, p % Nd)
//     1 GROUPED P = Nd (Nd % Nq == 0, K = Nd / Nq), pair p = (p / K, p)
//     2 LIST    P = pair_q.numel(), pair p = (pair_q[p], pair_d[p]) int32;
//               an id out of range scores NaN.
//
// score[p] = sum over valid query tokens i of max over valid doc tokens j of
// <q_i, d_j>, accumulated in fp32. A query token with no valid doc token adds
// 0. NaN in a product propagates to the score (as torch.max would).
//
// lq: width of the argmax output and an upper bound on every q_len the caller
// guarantees (the Python layer marks q_len > lq invalid).
// argmax_kind: 0 none (argmax is an empty int32 tensor), 1 int32 [P, lq],
// 2 int16 [P, lq]. Entry = index of the winning token *within* the document
// (0 .. d_len-1), lowest index on ties, -1 for padded/masked query tokens and
// for tokens with no valid document token.
// precision (plan::Precision; CUDA fp32 only, other dtypes and backends
// ignore it): 0 default (split 3xTF32 tensor cores, ~1e-7 relative per
// product), 1 tf32 (one TF32 product, ~5e-4), 2 exact (scalar fp32).
// normalize: every q / d row r stands for x_r / max(|x_r|, 1e-12) (norm in
// fp32 from the stored values, fp64 for fp64). Kernels fold the inverse norms
// into the scores (query row after the max, document token before it) rather
// than writing normalised copies; the backward takes the same flag, scales the
// gathered rows likewise and applies the Jacobian of the normalisation,
// (g - x^ <x^, g>) / |x| (g / 1e-12 for a row under the clamp), to each fp32
// row sum before rounding it to the input dtype.
#pragma once

#include "check.h"
#include "forward_plan.h"
#include <torch/torch.h>

#include <string>
#include <tuple>

namespace maxsim {

enum Layout : int64_t { kCross = 0, kGrouped = 1, kList = 2 };
enum ArgmaxKind : int64_t { kNoArgmax = 0, kArgmaxI32 = 1, kArgmaxI16 = 2 };

// The forward planner's token types (forward_plan.h); float32 for any other.
inline plan::Dtype plan_dtype(at::ScalarType t) {
  return t == at::kHalf             ? plan::Dtype::kF16
         : t == at::kBFloat16       ? plan::Dtype::kBF16
         : t == at::kChar           ? plan::Dtype::kI8
         : t == at::kFloat8_e4m3fn  ? plan::Dtype::kE4M3
                                    : plan::Dtype::kF32;
}
inline at::ScalarType scalar_type(plan::Dtype t) {
  return t == plan::Dtype::kF16    ? at::kHalf
         : t == plan::Dtype::kBF16 ? at::kBFloat16
         : t == plan::Dtype::kI8   ? at::kChar
         : t == plan::Dtype::kE4M3 ? at::kFloat8_e4m3fn
                                   : at::kFloat;
}

// The planner's request for a forward call's shape facts (token rows Tq / Td
// of Nq queries and Nd documents, P pairs); the override of the calling
// thread included. The caller adds pointer facts (ptr_align, ...).
inline plan::Request forward_request(int64_t layout, int64_t nq, int64_t nd, int64_t tq, int64_t td, int64_t pairs,
                                     int64_t lq, int64_t dim, at::ScalarType dtype, bool quant,
                                     bool uniform_doc_scales, bool argmax, int64_t precision, bool normalize) {
  plan::Request r;
  r.layout = (int)layout;
  r.Nq = nq;
  r.Nd = nd;
  r.Tq = tq;
  r.Td = td;
  r.P = pairs;
  r.lq = lq;
  r.dim = dim;
  r.dtype = plan_dtype(dtype);
  r.quant = quant;
  r.uniform_doc_scales = uniform_doc_scales;
  r.argmax = argmax;
  r.precision = (plan::Precision)precision;
  r.normalize = normalize;
  r.force = plan::forced_family();
  r.force_run = plan::forced_run();
  return r;
}

// Sets the calling thread's planner override ("" for none; a family name as
// plan::family_name spells it, or "stream_run" / "stream_pair",
// "stream_wg_run" / "stream_wg_pair": a stream with its runs of pairs forced
// on / off) and returns the previous one.
std::string set_forced_family(std::string family);

// Returns (scores [P] fp32, argmax). R: the result (ForwardTrainFn's adds a tensor).
template <typename R>
using ForwardSignature = R(
    const at::Tensor& q, const at::Tensor& q_start, const at::Tensor& q_len,
    const std::optional<at::Tensor>& q_mask, const at::Tensor& d,
    const at::Tensor& d_start, const at::Tensor& d_len,
    const std::optional<at::Tensor>& d_mask,
    const std::optional<at::Tensor>& pair_q,
    const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
    int64_t argmax_kind, int64_t precision, bool normalize);
using ForwardFn = ForwardSignature<std::tuple<at::Tensor, at::Tensor>>;

// forward_train: forward's (scores, argmax) and, under normalize (else an
// empty tensor), the inverse row norms: fp32 [inv_norms_d_start(Tq) + Td]
// (normalize_rows.h), 1 / max(|q_r|, 1e-12) at r, the documents' from
// inv_norms_d_start(Tq). CUDA computes
// them for its forward kernels anyway and its backward reads them (the
// backward's inv_norms); other backends' backward derives its own.
using ForwardTrainFn = ForwardSignature<std::tuple<at::Tensor, at::Tensor, at::Tensor>>;

// Quantized tokens (inference only): q / d are int8 or float8_e4m3fn with
// per-token fp32 scales q_scale [Tq] (> 0) / d_scale [Td]; token r stands for
// scale[r] * row r. Same contract as forward otherwise (no precision).
// uniform_doc_scales: the caller promises that d_scale is the same (> 0)
// for all tokens of each document, so a kernel may apply it to the row
// maxima instead of to every product (the result is the same).
using ForwardQuantFn = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& q, const at::Tensor& q_scale, const at::Tensor& q_start, const at::Tensor& q_len,
    const std::optional<at::Tensor>& q_mask, const at::Tensor& d, const at::Tensor& d_scale,
    const at::Tensor& d_start, const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
    const std::optional<at::Tensor>& pair_q, const std::optional<at::Tensor>& pair_d, int64_t layout, int64_t lq,
    int64_t argmax_kind, bool uniform_doc_scales);

// Per-token symmetric quantisation of x [T, d] (float): kind 0 int8, 1 fp8
// e4m3. Returns (values [T, round_up(d, 16)], scales [T] fp32); semantics in
// quantize_rows.h. Given `scales` (fp32 [T], on x's device), rows are divided
// by them instead of by their own amax / qmax; the result's scales are a copy.
using QuantizeFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& x, int64_t kind,
                                                      const std::optional<at::Tensor>& scales);

// Search helpers (contract in torch-ext/maxsim/retrieval.py): block_topk
// packs scores [R, n] fp32 with document ids id0 .. id0+n-1 into int64 keys
// ("higher score, then lower id"; NaN below every number) and returns the
// top min(k, n) keys per row, sorted descending; with ids (int64 [R, n], same
// device) the ids are ids[r, c] instead (id < 0: an empty slot; id0 unused).
// decode_keys inverts a key tensor into (scores fp32, ids int64); INT64_MIN is
// an empty slot (-inf, -1).
using BlockTopkFn = at::Tensor(const at::Tensor& scores, int64_t id0, int64_t k, const c10::optional<at::Tensor>& ids);
using DecodeKeysFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& keys);

// Re-scoring search candidates: keys [Nq, kc] int64 search keys whose ids
// are documents (d_start / d_len rows; id -1 = an empty slot); candidate c of
// row n is scored against query n as the LIST pair (n, id) of forward
// (float q / d; an id past the documents scores NaN). Returns the top k of
// each row decoded -- (scores fp32, ids int64) [Nq, k], block_topk's order
// (higher score, then lower id; NaN, then empty slots last), (-inf, -1) past
// the candidates. CUDA, 16-bit tokens and lq <= 32: the streaming forward
// reads the candidates from the keys and, for <= 128 candidates per row,
// ranks them in the same kernel (else block_topk); other inputs compose
// forward, block_topk and decode_keys.
using RescoreTopkFn = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& q, const at::Tensor& q_start, const at::Tensor& q_len, const std::optional<at::Tensor>& q_mask,
    const at::Tensor& d, const at::Tensor& d_start, const at::Tensor& d_len, const std::optional<at::Tensor>& d_mask,
    const at::Tensor& keys, int64_t lq, int64_t k);

// Backward from the saved argmax. grad [P] fp32. Returns (dq [Tq, dim],
// dd [Td, dim]) in the input dtype, fp32-accumulated, each row written by
// exactly one owner (deterministic). Rows no pair selects are zero. A gradient
// not needed comes back as an empty tensor.
// For LIST, q_ptr [Nq+1] / q_pairs [P] list the pairs of each query and
// d_ptr [Nd+1] / d_pairs [P] the pairs of each document (CSR, stable order);
// they are ignored for CROSS and GROUPED.
// Extra: BackwardNormsFn's trailing inv_norms.
template <typename... Extra>
using BackwardSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& q_start,
    const at::Tensor& q_len, const at::Tensor& d, const at::Tensor& d_start,
    const at::Tensor& d_len, const std::optional<at::Tensor>& pair_q,
    const std::optional<at::Tensor>& pair_d, const at::Tensor& argmax,
    int64_t layout, const std::optional<at::Tensor>& q_ptr,
    const std::optional<at::Tensor>& q_pairs,
    const std::optional<at::Tensor>& d_ptr,
    const std::optional<at::Tensor>& d_pairs, bool need_dq, bool need_dd, bool normalize, Extra...);
using BackwardFn = BackwardSignature<>;
// The backward op's kernel on CUDA: also forward_train's inverse norms
// (inv_norms, optional; recomputed where absent or of another size).
using BackwardNormsFn = BackwardSignature<const std::optional<at::Tensor>&>;

// Segments of the packed and padded layouts, so a call's index tensors cost
// one op: offsets[i] (int32 / int64 [N_i + 1], a packed tensor of totals[i]
// rows) -> start_i, len_i int32 [N_i] (start = offset, len = next offset -
// offset). Offsets that do not start at 0, end at totals[i] and never
// decrease describe no layout: every len_i is -1. A len over max_lens[i]
// (when >= 0) is -1 too. ints[j] (int32 / int64: pair ids, lengths) ->
// int32 copies, a value outside [lo[j], hi[j]] -> -1 (an id past int32 is
// out of range, never another pair; a length past its extent is invalid).
// Returns [start_0, len_0, ..., ints_0, ...]. At most two of each on CUDA,
// one launch there for up to 65536 segments per offsets tensor.
using SegmentsFn = std::vector<at::Tensor>(at::TensorList offsets, at::IntArrayRef totals, at::IntArrayRef max_lens,
                                           at::TensorList ints, at::IntArrayRef lo, at::IntArrayRef hi);
// uniform_segments: n back-to-back segments of `extent` rows on like's
// device, start int32 [n] = i * extent, len int32 [n] = extent (one launch
// on CUDA: torch's own arange / fill would load their kernels on a
// process's first call).
using UniformSegmentsFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& like, int64_t n, int64_t extent);

// PLAID / ColBERTv2 compressed documents (codec in plaid_codec.h): codes
// [T] int32, residuals [T, P] uint8, centroids [C, d] fp32, bucket_weights
// [2^nbits] fp32; document n owns tokens d_start[n] .. d_start[n]+d_len[n]-1
// (int32 [Nd]; a length <= 0 is an empty document).
//
// plaid_approx: qcs [Nq, C, Lq] fp32, fp16 or bf16 (query-token x centroid
// scores) -> scores [Nq, Nd] fp32 (maxima exact, sums in fp32), score[i, n]
// = sum over s of max over the tokens t of n of qcs[i, codes[t], s]; an
// empty document scores 0. With keep (uint8
// [Nq, C], PLAID's centroid pruning) only the tokens whose centroid query i
// keeps (non-zero) count, and a query token no kept token reaches adds 0.
using PlaidApproxFn = at::Tensor(const at::Tensor& qcs, const at::Tensor& codes, const at::Tensor& d_start,
                                 const at::Tensor& d_len, const std::optional<at::Tensor>& keep);
// plaid_forward: q [Nq, Lq, d] fp32 -> (scores, argmax): MaxSim of query
// pair_q[n] (int32 [Nd]; absent: every query, scores [Nq, Nd]) against the
// decompressed tokens of document n, each token divided by max(|x|, 1e-12)
// when normalize, fp32 accumulation; scores [Nd] with pair_q. A query token
// with no document token adds 0. argmax (when asked, else empty): int32
// [Nq, Nd, Lq] / [Nd, Lq], the winning token within the document, lowest
// index on ties, -1 for none.
using PlaidForwardFn = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& q, const at::Tensor& codes, const at::Tensor& residuals, const at::Tensor& centroids,
    const at::Tensor& bucket_weights, const at::Tensor& d_start, const at::Tensor& d_len,
    const std::optional<at::Tensor>& pair_q, int64_t nbits, bool normalize, bool argmax);
// plaid_backward: grad [Nq, Nd] fp32 and plaid_forward's argmax [Nq, Nd, Lq]
// (every query x every document) -> dq [Nq, Lq, d] fp32, dq[i, s] = sum over n
// of grad[i, n] * token(argmax[i, n, s]) (normalised when normalize), summed
// in document order.
using PlaidBackwardFn = at::Tensor(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& codes,
                                   const at::Tensor& residuals, const at::Tensor& centroids,
                                   const at::Tensor& bucket_weights, const at::Tensor& d_start,
                                   const at::Tensor& d_len, const at::Tensor& argmax, int64_t nbits, bool normalize);

// head_forward: q [Nq, Lq, d_out], h [Nd, Ld, d_model], w [d_out, d_model],
// b [d_out] (optional; same 16-bit dtype as q, h, w) -> scores [Nq, Nd] fp32
// and, with_argmax, argmax [Nq, Nd, Lq] int32 (the winning token within its
// document, lowest on ties, -1 for a masked query token or one without a
// valid document token; else an empty tensor):
// MaxSim of q against the projected documents D = h @ w^T + b, each token
// divided by max(|x|, 1e-12) when normalize and rounded to q's dtype, fp32
// accumulation, without writing D to memory. q_mask [Nq, Lq], d_mask [Nd, Ld]
// optional bool (true = real token); a query token with no valid document
// token adds 0, NaN propagates. No autograd. CUDA: the fused
// sm_90a kernel (maxsim-cuda/head/head_fused.cu), for d_out == 128, d_model
// a multiple of 64, Nq * Lq <= 1024; the caller (head.py) routes every other
// case to the composition.
using HeadForwardFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& q, const at::Tensor& h,
                                                         const at::Tensor& w, const std::optional<at::Tensor>& b,
                                                         const std::optional<at::Tensor>& q_mask,
                                                         const std::optional<at::Tensor>& d_mask, bool normalize,
                                                         bool with_argmax);

// The projection head's training backward from the winners (head.py;
// CUDA: maxsim-cuda/head/head_backward.cu; elsewhere the composition in
// head.py). idx [Nq, c, Lq] int32 holds each query token's winning token
// within document (or candidate) j of a chunk, -1 for none.
// head_winner_grad: unit [Nq, c, Lq, d_out] (the winners' projected rows,
// fp32 / fp16 / bf16), q [Nq, Lq, d_out] fp32, grad [Nq, c] -> (dq [Nq, Lq, d_out]
// fp32 = sum over j of grad * u, dp [Nq, c, Lq, d_out] in unit's dtype = the
// gradient of each projected row, db [d_out] fp32 = the sum of dp's rows;
// dp and db empty unless need_dp), u = unit / max(|unit|, 1e-12) when
// normalize (dp through that Jacobian), else unit; a row without a winner
// contributes exact zeros (its unit is never read). d_out <= 1024; sums in
// a fixed order.
using HeadWinnerGradFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor& unit, const at::Tensor& q,
                                                                        const at::Tensor& grad, const at::Tensor& idx,
                                                                        bool normalize, bool need_dp);
// head_scatter_rows: rows [Nq, c, Lq, width] (one per winner), Ld -> out,
// [c, Ld, width] (every query's winners in document j) or, per_query,
// [Nq, c, Ld, width] (the winners of query i's candidate j): out[doc, t] =
// the sum in fp32 of the rows whose winner is token t, in ascending (i, k)
// order, rounded to rows' dtype; zeros where none. Every row written once.
using HeadScatterRowsFn = at::Tensor(const at::Tensor& rows, const at::Tensor& idx, int64_t Ld, bool per_query);
// The head's row normalisation in training (head.py; CUDA:
// maxsim-cuda/head/head_normalize.cu; elsewhere the composition in head.py).
// head_normalize: x [T, d] (fp32 / fp16 / bf16) -> x / max(|x|, 1e-12) per
// row; head_normalize_backward: grad [T, d] w.r.t. that result, x -> the
// gradient w.r.t. x, (g - x^ <x^, g>) / max(|x|, 1e-12) (g / 1e-12 for a
// row under the clamp). Norms and products in fp32, results in x's dtype.
using HeadNormalizeFn = at::Tensor(const at::Tensor& x);
using HeadNormalizeBackwardFn = at::Tensor(const at::Tensor& grad, const at::Tensor& x);

// The CUDA forward's plan (forward_plan.cpp), as "key=value" words. arch -1:
// the current CUDA device; else a model of sm_<arch> with sm_count SMs (<= 0:
// the model's). force: "" or a family name (plan::family_name).
std::string plan_forward(int64_t layout, int64_t nq, int64_t nd, int64_t tq, int64_t td, int64_t pairs, int64_t lq,
                         int64_t dim, at::ScalarType dtype, bool quant, bool uniform_doc_scales, bool argmax,
                         int64_t precision, bool normalize, int64_t ptr_align, int64_t arch, int64_t sm_count,
                         std::string force);

// The CPU kernels (maxsim-cpu/) are [torch] sources, compiled into every
// variant; kernel-builder defines one of CPU_KERNEL / CUDA_KERNEL /
// METAL_KERNEL per variant for the device kernels.
ForwardFn forward_cpu;
ForwardQuantFn forward_quant_cpu;
QuantizeFn quantize_cpu;
BlockTopkFn block_topk_cpu;
DecodeKeysFn decode_keys_cpu;
RescoreTopkFn rescore_topk_cpu;
BackwardFn backward_cpu;
SegmentsFn segments_cpu;
UniformSegmentsFn uniform_segments_cpu;
PlaidApproxFn plaid_approx_cpu;
PlaidForwardFn plaid_forward_cpu;
PlaidBackwardFn plaid_backward_cpu;
#if defined(CUDA_KERNEL)
ForwardFn forward_cuda;
ForwardTrainFn forward_train_cuda;
ForwardQuantFn forward_quant_cuda;
QuantizeFn quantize_cuda;
BlockTopkFn block_topk_cuda;
DecodeKeysFn decode_keys_cuda;
RescoreTopkFn rescore_topk_cuda;
BackwardNormsFn backward_cuda;
SegmentsFn segments_cuda;
UniformSegmentsFn uniform_segments_cuda;
PlaidApproxFn plaid_approx_cuda;
PlaidForwardFn plaid_forward_cuda;
PlaidBackwardFn plaid_backward_cuda;
HeadForwardFn head_forward_cuda;
HeadWinnerGradFn head_winner_grad_cuda;
HeadScatterRowsFn head_scatter_rows_cuda;
HeadNormalizeFn head_normalize_cuda;
HeadNormalizeBackwardFn head_normalize_backward_cuda;
// The planner's facts of the current CUDA device (maxsim-cuda/forward/forward.cu).
plan::DeviceFacts cuda_device_facts();
#endif
#if defined(METAL_KERNEL)
ForwardFn forward_mps;
BackwardFn backward_mps;
#endif

}  // namespace maxsim
