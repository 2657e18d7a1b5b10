"""Public scoring API: every layout lowers to the one ``forward`` op.

Checks here are on shapes, dtypes and devices only (no host synchronisation).
Data-dependent problems (a length outside its padded extent, offsets that do
not start at 0 / end at the token count / decrease, pair ids out of range, a
``max_query_length`` below a query's length) raise :class:`InputError` in
validation mode (``validate=True`` per call, or process-wide: see
:mod:`maxsim.checks`; one host sync), and otherwise make the affected
scores NaN on the device rather than garbage.
"""

from __future__ import annotations

from typing import Optional

import torch

from .lowering import (
    I16_MAX,
    I32_RANGE,
    argmax_kind,
    as_int32,
    empty_result,
    empty_scores,
    flat_mask,
    precision_code,
    index_cached,
    run,
    segments,
    uniform_segments,
)
from .reference import CROSS, GROUPED, LIST
from .checks import (
    check_count,
    check_dim,
    check_float,
    check_int,
    check_lengths,
    check_mask,
    check_rank,
    check_same,
    should_validate,
    validate_ids,
    validate_lengths,
    validate_max_length,
    validate_offsets,
)

Tensor = torch.Tensor

__all__ = [
    "maxsim",
    "score_candidates_padded",
    "score_candidates_padded_with_argmax",
    "score_candidates_padded_train",
    "score_contrastive",
    "score_contrastive_with_argmax",
    "score_contrastive_train",
    "score_pairs_packed",
    "score_pairs_packed_with_argmax",
    "score_pairs_packed_train",
]


# ----------------------------------------------------------------------------
# padded candidates: Q [B, Lq, d] x D [B, K, Ld, d] -> [B, K]
# ----------------------------------------------------------------------------

def _candidates(queries, documents, query_lengths, doc_lengths, *, mode, validate, precision, normalize):
    check_float("queries", queries)
    check_float("documents", documents)
    check_rank("queries", queries, 3, "[B, Lq, d]")
    check_rank("documents", documents, 4, "[B, K, Ld, d]")
    B, Lq, dim = queries.shape
    Bd, K, Ld, _ = documents.shape
    if Bd != B:
        raise ValueError(f"batch mismatch: queries has B={B}, documents has B={Bd}")
    check_dim("queries", queries, "documents", documents)
    if query_lengths is not None:
        check_lengths("query_lengths", query_lengths, (B,))
    if doc_lengths is not None:
        check_lengths("doc_lengths", doc_lengths, (B, K))
    check_same("queries", queries, "documents", documents, "query_lengths", query_lengths,
               "doc_lengths", doc_lengths)
    if should_validate(validate):
        if query_lengths is not None:
            validate_lengths("query_lengths", query_lengths, Lq)
        if doc_lengths is not None:
            validate_lengths("doc_lengths", doc_lengths, Ld)
    if B * K == 0:
        return empty_result((B, K), Lq, queries, documents, mode)
    q_start, q_len = uniform_segments(B, Lq, queries)
    d_start, d_len = uniform_segments(B * K, Ld, queries)
    capped = iter(segments(ints=[(t, 0, e) for t, e in ((query_lengths, Lq), (doc_lengths, Ld)) if t is not None]))
    if query_lengths is not None:
        q_len = next(capped)
    if doc_lengths is not None:
        d_len = next(capped)
    kind = argmax_kind(mode == "train", mode == "argmax", Ld)
    scores, argmax = run(queries, q_start, q_len, None, documents, d_start, d_len,
                         None, None, None, GROUPED, Lq, kind, precision, normalize)
    if mode == "argmax":
        return scores, as_int32(argmax).view(B, K, Lq)
    return scores


def score_candidates_padded(queries: Tensor, documents: Tensor, query_lengths: Optional[Tensor] = None,
                            doc_lengths: Optional[Tensor] = None, *, validate: Optional[bool] = None,
                            precision: Optional[str] = None, tf32: bool = False, normalize: bool = False) -> Tensor:
    """MaxSim of each query against its own K padded candidates.

    queries ``[B, Lq, d]``, documents ``[B, K, Ld, d]``, query_lengths ``[B]``
    and doc_lengths ``[B, K]`` (int32/int64, ``None`` = full extent).
    Returns fp32 ``[B, K]``. A query with no valid document token scores 0
    against that document.
    """
    return _candidates(queries, documents, query_lengths, doc_lengths, mode="score",
                       validate=validate,
                  precision=precision_code(precision, tf32), normalize=normalize)


def score_candidates_padded_with_argmax(queries, documents, query_lengths=None, doc_lengths=None, *,
                                        validate: Optional[bool] = None, precision: Optional[str] = None,
                                        tf32: bool = False, normalize: bool = False):
    """As :func:`score_candidates_padded`, plus int32 ``[B, K, Lq]`` winning
    document-token index per query token (-1 for padded query tokens and for
    tokens with no valid document token; lowest index on ties)."""
    return _candidates(queries, documents, query_lengths, doc_lengths, mode="argmax",
                       validate=validate,
                  precision=precision_code(precision, tf32), normalize=normalize)


def score_candidates_padded_train(queries, documents, query_lengths=None, doc_lengths=None, *,
                                  validate: Optional[bool] = None, precision: Optional[str] = None,
                                  tf32: bool = False, normalize: bool = False):
    """Differentiable :func:`score_candidates_padded` (gradients to queries and
    documents, from the saved argmax only)."""
    return _candidates(queries, documents, query_lengths, doc_lengths, mode="train",
                       validate=validate,
                  precision=precision_code(precision, tf32), normalize=normalize)


# ----------------------------------------------------------------------------
# contrastive: Q [Nq, Lq, d] x packed D [T, d] with offsets [Nb+1] -> [Nq, Nb]
# ----------------------------------------------------------------------------

def _contrastive(queries, documents, document_offsets, query_lengths, *, mode, validate, precision, normalize):
    check_float("queries", queries)
    check_float("documents", documents)
    check_rank("queries", queries, 3, "[Nq, Lq, d]")
    check_rank("documents", documents, 2, "packed [total_tokens, d]")
    check_int("document_offsets", document_offsets, 1)
    if document_offsets.shape[0] < 1:
        raise ValueError("document_offsets must have at least one entry (0)")
    check_dim("queries", queries, "documents", documents)
    Nq, Lq, _ = queries.shape
    T = documents.shape[0]
    Nb = document_offsets.shape[0] - 1
    if query_lengths is not None:
        check_lengths("query_lengths", query_lengths, (Nq,))
    check_same("queries", queries, "documents", documents, "document_offsets", document_offsets,
               "query_lengths", query_lengths)
    if should_validate(validate):
        validate_offsets("document_offsets", document_offsets, T)
        if query_lengths is not None:
            validate_lengths("query_lengths", query_lengths, Lq)
    if Nq * Nb == 0:
        return empty_result((Nq, Nb), Lq, queries, documents, mode)
    q_start, q_len = uniform_segments(Nq, Lq, queries)
    seg = segments([(document_offsets, T, -1)], [(query_lengths, 0, Lq)] if query_lengths is not None else [])
    d_start, d_len = seg[0], seg[1]
    if query_lengths is not None:
        q_len = seg[2]
    kind = argmax_kind(mode == "train", mode == "argmax", T)
    scores, argmax = run(queries, q_start, q_len, None, documents, d_start, d_len,
                         None, None, None, CROSS, Lq, kind, precision, normalize)
    if mode == "argmax":
        return scores, as_int32(argmax).view(Nq, Nb, Lq)
    return scores


def score_contrastive(queries: Tensor, documents: Tensor, document_offsets: Tensor,
                      query_lengths: Optional[Tensor] = None, *, validate: Optional[bool] = None,
                      precision: Optional[str] = None, tf32: bool = False, normalize: bool = False) -> Tensor:
    """Every query ``[Nq, Lq, d]`` against every packed document
    (``documents [total_tokens, d]``, ``document_offsets [Nb+1]``) -> fp32 ``[Nq, Nb]``."""
    return _contrastive(queries, documents, document_offsets, query_lengths, mode="score",
                        validate=validate,
                  precision=precision_code(precision, tf32), normalize=normalize)


def score_contrastive_with_argmax(queries, documents, document_offsets, query_lengths=None, *,
                                  validate: Optional[bool] = None, precision: Optional[str] = None,
                                  tf32: bool = False, normalize: bool = False):
    """As :func:`score_contrastive`, plus int32 argmax ``[Nq, Nb, Lq]``."""
    return _contrastive(queries, documents, document_offsets, query_lengths, mode="argmax",
                        validate=validate,
                  precision=precision_code(precision, tf32), normalize=normalize)


def score_contrastive_train(queries, documents, document_offsets, query_lengths=None, *,
                            validate: Optional[bool] = None, precision: Optional[str] = None,
                            tf32: bool = False, normalize: bool = False):
    """Differentiable :func:`score_contrastive`."""
    return _contrastive(queries, documents, document_offsets, query_lengths, mode="train",
                        validate=validate,
                  precision=precision_code(precision, tf32), normalize=normalize)


# ----------------------------------------------------------------------------
# packed pairs: packed Q and D with offsets, plus an explicit pair list -> [P]
# ----------------------------------------------------------------------------

def _max_length(max_query_length, max_q_len) -> tuple[str, Optional[int]]:
    """(the keyword used, its value): ``max_q_len`` is erikkaum/maxsim's name."""
    if max_q_len is None:
        return "max_query_length", max_query_length
    if max_query_length is not None:
        raise TypeError("pass max_query_length or its alias max_q_len, not both")
    return "max_q_len", max_q_len


def _pairs(queries, query_offsets, documents, document_offsets, pair_query_ids, pair_document_ids,
           max_lengths, *, mode, validate, precision, normalize):
    length_name, max_query_length = _max_length(*max_lengths)
    check_float("queries", queries)
    check_float("documents", documents)
    check_rank("queries", queries, 2, "packed [total_query_tokens, d]")
    check_rank("documents", documents, 2, "packed [total_doc_tokens, d]")
    check_int("query_offsets", query_offsets, 1)
    check_int("document_offsets", document_offsets, 1)
    check_int("pair_query_ids", pair_query_ids, 1)
    check_int("pair_document_ids", pair_document_ids, 1)
    if pair_query_ids.shape != pair_document_ids.shape:
        raise ValueError(f"pair_query_ids {tuple(pair_query_ids.shape)} and pair_document_ids "
                         f"{tuple(pair_document_ids.shape)} must have the same shape")
    for name, off in (("query_offsets", query_offsets), ("document_offsets", document_offsets)):
        if off.shape[0] < 1:
            raise ValueError(f"{name} must have at least one entry (0)")
    check_dim("queries", queries, "documents", documents)
    check_same("queries", queries, "query_offsets", query_offsets, "documents", documents,
               "document_offsets", document_offsets, "pair_query_ids", pair_query_ids,
               "pair_document_ids", pair_document_ids)
    Tq, Td = queries.shape[0], documents.shape[0]
    Nq, Nd = query_offsets.shape[0] - 1, document_offsets.shape[0] - 1
    if should_validate(validate):
        validate_offsets("query_offsets", query_offsets, Tq)
        validate_offsets("document_offsets", document_offsets, Td)
        validate_ids("pair_query_ids", pair_query_ids, Nq)
        validate_ids("pair_document_ids", pair_document_ids, Nd)
    if max_query_length is None:
        # Argmax width / tiling bound: one host sync unless the caller says.
        # (At most Tq: offsets that describe no layout score NaN anyway.)
        lq = width = min(int((query_offsets[1:] - query_offsets[:-1]).max()), Tq) if Nq else 0
    else:
        width = check_count(length_name, max_query_length)
        if should_validate(validate):
            validate_max_length(length_name, width, query_offsets)
        # The kernels' bound: no query is longer than Tq, so a larger declared
        # bound only widens the returned argmax (with -1), not the work.
        lq = min(width, Tq)
    # One op for the segments and the int32 pair ids; a query longer than lq
    # is an invalid segment (NaN).
    q_start, q_len, d_start, d_len, pair_q32, pair_d32 = segments(
        [(query_offsets, Tq, lq), (document_offsets, Td, -1)],
        [(pair_query_ids, *I32_RANGE), (pair_document_ids, *I32_RANGE)])
    P = pair_query_ids.shape[0]
    if P == 0:
        return empty_result((0,), width, queries, documents, mode)
    kind = argmax_kind(mode == "train", mode == "argmax", Td)
    scores, argmax = run(queries, q_start, q_len, None, documents, d_start,
                         d_len, None, pair_q32, pair_d32, LIST, lq, kind, precision, normalize)
    if mode == "argmax":
        argmax = as_int32(argmax)
        if width > lq:
            argmax = torch.cat([argmax, argmax.new_full((P, width - lq), -1)], dim=1)
        return scores, argmax
    return scores


def score_pairs_packed(queries: Tensor, query_offsets: Tensor, documents: Tensor,
                       document_offsets: Tensor, pair_query_ids: Tensor, pair_document_ids: Tensor, *,
                       max_query_length: Optional[int] = None, validate: Optional[bool] = None,
                       precision: Optional[str] = None, tf32: bool = False, normalize: bool = False,
                       max_q_len: Optional[int] = None) -> Tensor:
    """Scores of arbitrary (query, document) pairs over packed ragged tokens -> fp32 ``[P]``.

    ``max_query_length`` (an upper bound on every query's length) avoids the
    one host sync that otherwise finds it; pass it under ``torch.compile`` or
    CUDA-graph capture. A query longer than it scores NaN (raises in
    validation mode). ``max_q_len`` is the same bound under erikkaum/maxsim's
    name.
    """
    return _pairs(queries, query_offsets, documents, document_offsets, pair_query_ids,
                  pair_document_ids, (max_query_length, max_q_len), mode="score", validate=validate,
                  precision=precision_code(precision, tf32),
                  normalize=normalize)


def score_pairs_packed_with_argmax(queries, query_offsets, documents, document_offsets, pair_query_ids,
                                   pair_document_ids, *, max_query_length=None, validate=None, precision=None,
                                   tf32=False, normalize=False, max_q_len=None):
    """As :func:`score_pairs_packed`, plus int32 argmax ``[P, max_query_length]``
    (without it, as wide as the longest query): document-token index within
    the document, -1 past the query's length."""
    return _pairs(queries, query_offsets, documents, document_offsets, pair_query_ids,
                  pair_document_ids, (max_query_length, max_q_len), mode="argmax", validate=validate,
                  precision=precision_code(precision, tf32),
                  normalize=normalize)


def score_pairs_packed_train(queries, query_offsets, documents, document_offsets, pair_query_ids,
                             pair_document_ids, *, max_query_length=None, validate=None, precision=None,
                             tf32=False, normalize=False, max_q_len=None):
    """Differentiable :func:`score_pairs_packed`."""
    return _pairs(queries, query_offsets, documents, document_offsets, pair_query_ids,
                  pair_document_ids, (max_query_length, max_q_len), mode="train", validate=validate,
                  precision=precision_code(precision, tf32),
                  normalize=normalize)


# ----------------------------------------------------------------------------
# maxsim(): boolean masks, cross or per-query candidates, differentiable
# ----------------------------------------------------------------------------

def _check_maxsim(Q, D, q_mask, d_mask) -> None:
    """maxsim()'s argument checks (types, ranks, shapes, dtypes, devices)."""
    check_float("Q", Q)
    check_float("D", D)
    check_rank("Q", Q, 3, "[Nq, Lq, d]")
    if D.dim() not in (3, 4):
        raise ValueError(f"D must be 3-D [Nd, Ld, d] or 4-D [Nq, K, Ld, d], got shape {tuple(D.shape)}")
    check_dim("Q", Q, "D", D)
    Nq = Q.shape[0]
    if D.dim() == 4 and D.shape[0] != Nq:
        raise ValueError(f"D [Nq, K, Ld, d] must have Nq={Nq} in dim 0, got {D.shape[0]}")
    if q_mask is not None:
        check_mask("q_mask", q_mask, Q.shape[:2])
    if d_mask is not None:
        check_mask("d_mask", d_mask, D.shape[:-1])
    check_same("Q", Q, "D", D, "q_mask", q_mask, "d_mask", d_mask)


# maxsim()'s per-shape decisions: key (everything the checks read) -> the
# lowered call's index tensors and constants, so a repeated shape (every
# training step) skips the checks and the lowering. Bounded like the index
# cache; not filled while compiling or capturing.
_MAXSIM_PLANS: dict = {}


def _maxsim_key(Q, D, q_mask, d_mask):
    try:
        return (Q.shape, D.shape, Q.dtype, D.dtype, Q.device, D.device,
                None if q_mask is None else (q_mask.shape, q_mask.dtype, q_mask.device),
                None if d_mask is None else (d_mask.shape, d_mask.dtype, d_mask.device))
    except AttributeError:
        return None  # not tensors: the checks say what is wrong


def _maxsim_plan(Q, D, q_mask, d_mask):
    """(q_start, q_len, d_start, d_len, layout, Lq, Ld), or the output shape
    (a tuple of two ints) for a call with no pairs; checks the arguments."""
    _check_maxsim(Q, D, q_mask, d_mask)
    Nq, Lq, _ = Q.shape
    Ld = D.shape[-2]
    n_docs = D.shape[0] * (D.shape[1] if D.dim() == 4 else 1)
    if Nq * n_docs == 0:
        return (Nq, D.shape[1] if D.dim() == 4 else D.shape[0])
    q_start, q_len = uniform_segments(Nq, Lq, Q)
    d_start, d_len = uniform_segments(n_docs, Ld, Q)
    return (q_start, q_len, d_start, d_len, GROUPED if D.dim() == 4 else CROSS, Lq, Ld)


def _cached_maxsim_plan(Q, D, q_mask, d_mask):
    key = None if torch.compiler.is_compiling() else _maxsim_key(Q, D, q_mask, d_mask)
    plan = _MAXSIM_PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _maxsim_plan(Q, D, q_mask, d_mask)
        if (key is not None and len(plan) > 2 and len(_MAXSIM_PLANS) < 256
                and index_cached(plan[0]) and index_cached(plan[2])):
            _MAXSIM_PLANS[key] = plan
    return plan


def maxsim_with_argmax_nograd(Q: Tensor, D: Tensor, q_mask: Optional[Tensor] = None,
                              d_mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """:func:`maxsim`'s scores (no autograd) and the int32 argmax ``[Nq, Nd,
    Lq]`` (``[Nq, K, Lq]`` for per-query candidates): the winning token within
    its document, -1 for a masked query token or one with no valid document
    token. For callers that write their own backward from the winners."""
    plan = _cached_maxsim_plan(Q, D, q_mask, d_mask)
    if len(plan) == 2:
        return empty_result(plan, Q.shape[1], Q, D, "argmax")
    q_start, q_len, d_start, d_len, layout, Lq, Ld = plan
    scores, argmax = run(Q, q_start, q_len, flat_mask(q_mask), D, d_start, d_len, flat_mask(d_mask),
                         None, None, layout, Lq, argmax_kind(False, True, Ld), 0, False, False)
    return scores, as_int32(argmax).view(*scores.shape, Lq)


def maxsim(Q: Tensor, D: Tensor, q_mask: Optional[Tensor] = None, d_mask: Optional[Tensor] = None, *,
           normalize: bool = False, precision: Optional[str] = None, tf32: bool = False) -> Tensor:
    """MaxSim of ``Q [Nq, Lq, d]`` against ``D [Nd, Ld, d]`` (every query x every
    document -> ``[Nq, Nd]``) or ``D [Nq, K, Ld, d]`` (each query's own K
    candidates -> ``[Nq, K]``). Masks are boolean, True = real token
    (``q_mask [Nq, Lq]``, ``d_mask`` shaped like ``D`` without its last dim).
    ``normalize=True`` scores L2-normalised tokens (cosine similarity), with the
    norms folded into the kernels: no normalised copy is made. Differentiable.
    ``precision`` (fp32 tokens on CUDA; every scoring function takes it):
    ``"default"`` / ``None`` split 3xTF32 tensor cores (within 1e-6 of fp64),
    ``"exact"`` scalar fp32, ``"tf32"`` one TF32 product (~7e-4);
    ``tf32=True`` means ``precision="tf32"``. The CPU is exact whatever it is.
    """
    plan = _cached_maxsim_plan(Q, D, q_mask, d_mask)
    if len(plan) == 2:
        return empty_scores(plan, Q, D)
    q_start, q_len, d_start, d_len, layout, Lq, Ld = plan
    train = torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    kind = (2 if Ld <= I16_MAX else 1) if train else 0
    return run(Q, q_start, q_len, flat_mask(q_mask), D, d_start, d_len, flat_mask(d_mask),
               None, None, layout, Lq, kind, precision_code(precision, tf32), normalize, train)[0]
