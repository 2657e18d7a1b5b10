"""Public scoring API: every layout lowers to the one ``forward`` op.

Checks here are on shapes, dtypes and devices only (no host synchronisation).
Data-dependent problems (a length outside its padded extent, offsets that do
not start at 0 / end at the token count / decrease, pair ids out of range) are
either raised eagerly with ``validate=True`` (one host sync), or detected on
device, where the affected scores come out NaN rather than garbage.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._registry import ops
from .reference import CROSS, GROUPED, LIST

Tensor = torch.Tensor
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)
_I16_MAX = 32767

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
# checks
# ----------------------------------------------------------------------------

def _check_float(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.float64 and t.device.type == "cpu":
        return  # exact fp64 path of the CPU backend (gradient checks, references)
    if t.dtype not in _FLOATS:
        extra = " (float64 only on the CPU)" if t.dtype == torch.float64 else ""
        raise TypeError(f"{name} must be float32, float16 or bfloat16{extra}, got {t.dtype}")


def _score_dtype(t: Tensor) -> torch.dtype:
    """Scores are fp32, or fp64 for fp64 inputs."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_int(name: str, t, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INTS:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")


def _check_lengths(name: str, t, shape: tuple) -> None:
    _check_int(name, t, len(shape))
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(t.shape)}")


def _check_mask(name: str, t, shape) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = real token), got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_rank(name: str, t: Tensor, dim: int, layout: str) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D {layout}, got shape {tuple(t.shape)}")


def _check_same(*named) -> None:
    """``name, tensor, name, tensor, ...`` (None skipped): one device, and one
    dtype among the floating-point ones. Runs on every call: kept lean."""
    first = t0 = fname = f0 = None
    for i in range(1, len(named), 2):
        t = named[i]
        if t is None:
            continue
        if t0 is None:
            first, t0 = named[i - 1], t
        elif t.device != t0.device:
            raise ValueError(f"{named[i - 1]} is on {t.device} but {first} is on {t0.device}; "
                             "all tensors must be on one device")
        if t.dtype.is_floating_point:
            if f0 is None:
                fname, f0 = named[i - 1], t
            elif t.dtype != f0.dtype:
                raise TypeError(f"{named[i - 1]} has dtype {t.dtype} but {fname} has "
                                f"{f0.dtype}; queries and documents must share a dtype")


def _check_dim(qname: str, q: Tensor, dname: str, d: Tensor) -> None:
    if q.shape[-1] != d.shape[-1]:
        raise ValueError(f"embedding dim mismatch: {qname} has {q.shape[-1]}, "
                         f"{dname} has {d.shape[-1]}")


def _fail(msg: str):
    raise ValueError(msg)


def _validate_lengths(name: str, lengths: Tensor, extent: int) -> None:
    if lengths.numel() and bool(((lengths < 0) | (lengths > extent)).any()):
        bad = lengths[(lengths < 0) | (lengths > extent)][0].item()
        _fail(f"{name} must lie in [0, {extent}] (the padded extent), found {bad}")


def _validate_offsets(name: str, offsets: Tensor, total: int) -> None:
    if offsets.numel() == 0:
        _fail(f"{name} must have at least one entry (0)")
    if int(offsets[0]) != 0:
        _fail(f"{name}[0] must be 0, got {int(offsets[0])}")
    if int(offsets[-1]) != total:
        _fail(f"{name}[-1] must equal the token count {total}, got {int(offsets[-1])}")
    if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        _fail(f"{name} must be non-decreasing")


def _validate_ids(name: str, ids: Tensor, n: int) -> None:
    if ids.numel() and bool(((ids < 0) | (ids >= n)).any()):
        bad = ids[(ids < 0) | (ids >= n)][0].item()
        _fail(f"{name} must lie in [0, {n}), found {bad}")


# ----------------------------------------------------------------------------
# lowering helpers (device-side, no sync)
# ----------------------------------------------------------------------------

_INDEX_CACHE: dict = {}


def _cached_index(key: tuple, device, build):
    """``build()`` (index tensors that depend only on ``key``), cached per
    device: small launches here would cost more than a short forward kernel.
    Not cached while capturing a graph or compiling (those own their tensors)."""
    key = key + (str(device),)
    hit = _INDEX_CACHE.get(key)
    if hit is not None:
        return hit
    val = build()
    capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing and not torch.compiler.is_compiling() and len(_INDEX_CACHE) < 256:
        _INDEX_CACHE[key] = val
    return val


def _uniform_segments(n: int, extent: int, device) -> tuple[Tensor, Tensor]:
    """(start, len) of n back-to-back segments of ``extent`` rows (cached)."""
    return _cached_index(("segments", n, extent), device,
                         lambda: (torch.arange(n, device=device, dtype=torch.int32) * extent,
                                  torch.full((n,), extent, device=device, dtype=torch.int32)))


_I32_RANGE = (-(1 << 31), (1 << 31) - 1)


def _segments(offsets=(), ints=()) -> list:
    """A call's index tensors from one op (one launch on a GPU; contract in
    torch_binding.h): ``offsets`` [(offsets, total, max_len)] -> start, len
    each (offsets that describe no layout poison every segment); ``ints``
    [(tensor, lo, hi)] -> flat int32 copies, -1 outside [lo, hi]."""
    if not offsets and not ints:
        return []
    args = ([o for o, _, _ in offsets], [t for _, t, _ in offsets], [m for _, _, m in offsets],
            [t if t.dim() == 1 else t.reshape(-1) for t, _, _ in ints],
            [a for _, a, _ in ints], [b for _, _, b in ints])
    return ops.segments(*args)


def _padded_segments(n: int, extent: int, lengths: Optional[Tensor], device) -> tuple[Tensor, Tensor]:
    start, full = _uniform_segments(n, extent, device)
    if lengths is None:
        return start, full
    return start, _segments(ints=[(lengths, 0, extent)])[0]


def _flat(x: Tensor) -> Tensor:
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _flat_mask(m: Optional[Tensor]) -> Optional[Tensor]:
    return None if m is None else m.reshape(-1).contiguous()


def _argmax_kind(train: bool, with_argmax: bool, doc_bound: int) -> int:
    if train:
        return 2 if doc_bound <= _I16_MAX else 1
    return 1 if with_argmax else 0


def _run(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d,
         layout, lq, argmax_kind, tf32, normalize=False):
    """q / d: token tensors [..., dim]. Returns scores shaped by layout
    ([Nq, Nd] CROSS, [Nq, K] GROUPED, [P] LIST) and the argmax [P, lq]."""
    q = q if q.is_contiguous() else q.contiguous()
    d = d if d.is_contiguous() else d.contiguous()
    if torch.is_grad_enabled() and (q.requires_grad or d.requires_grad):
        # The autograd-carrying op only when a gradient can flow (it costs an
        # autograd node per call); it flattens and reshapes inside the node.
        return ops.forward_train(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask,
                                 pair_q, pair_d, layout, lq, argmax_kind, tf32, normalize)
    scores, argmax = ops.forward(_flat(q), q_start, q_len, q_mask, _flat(d), d_start, d_len, d_mask,
                                 pair_q, pair_d, layout, lq, argmax_kind, tf32, normalize)
    nq, nd = q_start.shape[0], d_start.shape[0]
    if layout == CROSS:
        scores = scores.view(nq, nd)
    elif layout == GROUPED and nq > 0:
        scores = scores.view(nq, nd // nq)
    return scores, argmax


def _empty_result(shape: tuple, lq: int, queries: Tensor, mode: str):
    """Result of a call with no pairs: zero scores (and -1 argmax)."""
    dev = queries.device
    s = torch.zeros(shape, device=dev, dtype=_score_dtype(queries))
    return s if mode != "argmax" else (s, torch.full(shape + (lq,), -1, device=dev, dtype=torch.int32))


def _i32(argmax: Tensor) -> Tensor:
    return argmax if argmax.dtype == torch.int32 else argmax.to(torch.int32)


# ----------------------------------------------------------------------------
# padded candidates: Q [B, Lq, d] x D [B, K, Ld, d] -> [B, K]
# ----------------------------------------------------------------------------

def _candidates(queries, documents, query_lengths, doc_lengths, *, mode, validate, tf32, normalize):
    _check_float("queries", queries)
    _check_float("documents", documents)
    _check_rank("queries", queries, 3, "[B, Lq, d]")
    _check_rank("documents", documents, 4, "[B, K, Ld, d]")
    B, Lq, dim = queries.shape
    Bd, K, Ld, _ = documents.shape
    if Bd != B:
        raise ValueError(f"batch mismatch: queries has B={B}, documents has B={Bd}")
    _check_dim("queries", queries, "documents", documents)
    if query_lengths is not None:
        _check_lengths("query_lengths", query_lengths, (B,))
    if doc_lengths is not None:
        _check_lengths("doc_lengths", doc_lengths, (B, K))
    _check_same("queries", queries, "documents", documents, "query_lengths", query_lengths,
                "doc_lengths", doc_lengths)
    if validate:
        if query_lengths is not None:
            _validate_lengths("query_lengths", query_lengths, Lq)
        if doc_lengths is not None:
            _validate_lengths("doc_lengths", doc_lengths, Ld)
    dev = queries.device
    if B * K == 0:
        return _empty_result((B, K), Lq, queries, mode)
    q_start, q_len = _uniform_segments(B, Lq, dev)
    d_start, d_len = _uniform_segments(B * K, Ld, dev)
    capped = iter(_segments(ints=[(t, 0, e) for t, e in ((query_lengths, Lq), (doc_lengths, Ld)) if t is not None]))
    if query_lengths is not None:
        q_len = next(capped)
    if doc_lengths is not None:
        d_len = next(capped)
    kind = _argmax_kind(mode == "train", mode == "argmax", Ld)
    scores, argmax = _run(queries, q_start, q_len, None, documents, d_start, d_len,
                          None, None, None, GROUPED, Lq, kind, tf32, normalize)
    if mode == "argmax":
        return scores, _i32(argmax).view(B, K, Lq)
    return scores


def score_candidates_padded(queries: Tensor, documents: Tensor, query_lengths: Optional[Tensor] = None,
                            doc_lengths: Optional[Tensor] = None, *, validate: bool = False,
                            tf32: bool = False, normalize: bool = False) -> Tensor:
    """MaxSim of each query against its own K padded candidates.

    queries ``[B, Lq, d]``, documents ``[B, K, Ld, d]``, query_lengths ``[B]``
    and doc_lengths ``[B, K]`` (int32/int64, ``None`` = full extent).
    Returns fp32 ``[B, K]``. A query with no valid document token scores 0
    against that document.
    """
    return _candidates(queries, documents, query_lengths, doc_lengths, mode="score",
                       validate=validate, tf32=tf32, normalize=normalize)


def score_candidates_padded_with_argmax(queries, documents, query_lengths=None, doc_lengths=None, *,
                                        validate: bool = False, tf32: bool = False,
                                        normalize: bool = False):
    """As :func:`score_candidates_padded`, plus int32 ``[B, K, Lq]`` winning
    document-token index per query token (-1 for padded query tokens and for
    tokens with no valid document token; lowest index on ties)."""
    return _candidates(queries, documents, query_lengths, doc_lengths, mode="argmax",
                       validate=validate, tf32=tf32, normalize=normalize)


def score_candidates_padded_train(queries, documents, query_lengths=None, doc_lengths=None, *,
                                  validate: bool = False, tf32: bool = False,
                                  normalize: bool = False):
    """Differentiable :func:`score_candidates_padded` (gradients to queries and
    documents, from the saved argmax only)."""
    return _candidates(queries, documents, query_lengths, doc_lengths, mode="train",
                       validate=validate, tf32=tf32, normalize=normalize)


# ----------------------------------------------------------------------------
# contrastive: Q [Nq, Lq, d] x packed D [T, d] with offsets [Nb+1] -> [Nq, Nb]
# ----------------------------------------------------------------------------

def _contrastive(queries, documents, document_offsets, query_lengths, *, mode, validate, tf32, normalize):
    _check_float("queries", queries)
    _check_float("documents", documents)
    _check_rank("queries", queries, 3, "[Nq, Lq, d]")
    _check_rank("documents", documents, 2, "packed [total_tokens, d]")
    _check_int("document_offsets", document_offsets, 1)
    if document_offsets.shape[0] < 1:
        raise ValueError("document_offsets must have at least one entry (0)")
    _check_dim("queries", queries, "documents", documents)
    Nq, Lq, _ = queries.shape
    T = documents.shape[0]
    Nb = document_offsets.shape[0] - 1
    if query_lengths is not None:
        _check_lengths("query_lengths", query_lengths, (Nq,))
    _check_same("queries", queries, "documents", documents, "document_offsets", document_offsets,
                "query_lengths", query_lengths)
    if validate:
        _validate_offsets("document_offsets", document_offsets, T)
        if query_lengths is not None:
            _validate_lengths("query_lengths", query_lengths, Lq)
    dev = queries.device
    if Nq * Nb == 0:
        return _empty_result((Nq, Nb), Lq, queries, mode)
    q_start, q_len = _uniform_segments(Nq, Lq, dev)
    seg = _segments([(document_offsets, T, -1)], [(query_lengths, 0, Lq)] if query_lengths is not None else [])
    d_start, d_len = seg[0], seg[1]
    if query_lengths is not None:
        q_len = seg[2]
    kind = _argmax_kind(mode == "train", mode == "argmax", T)
    scores, argmax = _run(queries, q_start, q_len, None, documents, d_start, d_len,
                          None, None, None, CROSS, Lq, kind, tf32, normalize)
    if mode == "argmax":
        return scores, _i32(argmax).view(Nq, Nb, Lq)
    return scores


def score_contrastive(queries: Tensor, documents: Tensor, document_offsets: Tensor,
                      query_lengths: Optional[Tensor] = None, *, validate: bool = False,
                      tf32: bool = False, normalize: bool = False) -> Tensor:
    """Every query ``[Nq, Lq, d]`` against every packed document
    (``documents [total_tokens, d]``, ``document_offsets [Nb+1]``) -> fp32 ``[Nq, Nb]``."""
    return _contrastive(queries, documents, document_offsets, query_lengths, mode="score",
                        validate=validate, tf32=tf32, normalize=normalize)


def score_contrastive_with_argmax(queries, documents, document_offsets, query_lengths=None, *,
                                  validate: bool = False, tf32: bool = False,
                                  normalize: bool = False):
    """As :func:`score_contrastive`, plus int32 argmax ``[Nq, Nb, Lq]``."""
    return _contrastive(queries, documents, document_offsets, query_lengths, mode="argmax",
                        validate=validate, tf32=tf32, normalize=normalize)


def score_contrastive_train(queries, documents, document_offsets, query_lengths=None, *,
                            validate: bool = False, tf32: bool = False,
                            normalize: bool = False):
    """Differentiable :func:`score_contrastive`."""
    return _contrastive(queries, documents, document_offsets, query_lengths, mode="train",
                        validate=validate, tf32=tf32, normalize=normalize)


# ----------------------------------------------------------------------------
# packed pairs: packed Q and D with offsets, plus an explicit pair list -> [P]
# ----------------------------------------------------------------------------

def _pairs(queries, query_offsets, documents, document_offsets, pair_query_ids, pair_document_ids,
           max_query_length, *, mode, validate, tf32, normalize):
    _check_float("queries", queries)
    _check_float("documents", documents)
    _check_rank("queries", queries, 2, "packed [total_query_tokens, d]")
    _check_rank("documents", documents, 2, "packed [total_doc_tokens, d]")
    _check_int("query_offsets", query_offsets, 1)
    _check_int("document_offsets", document_offsets, 1)
    _check_int("pair_query_ids", pair_query_ids, 1)
    _check_int("pair_document_ids", pair_document_ids, 1)
    if pair_query_ids.shape != pair_document_ids.shape:
        raise ValueError(f"pair_query_ids {tuple(pair_query_ids.shape)} and pair_document_ids "
                         f"{tuple(pair_document_ids.shape)} must have the same shape")
    for name, off in (("query_offsets", query_offsets), ("document_offsets", document_offsets)):
        if off.shape[0] < 1:
            raise ValueError(f"{name} must have at least one entry (0)")
    _check_dim("queries", queries, "documents", documents)
    _check_same("queries", queries, "query_offsets", query_offsets, "documents", documents,
                "document_offsets", document_offsets, "pair_query_ids", pair_query_ids,
                "pair_document_ids", pair_document_ids)
    Tq, Td = queries.shape[0], documents.shape[0]
    Nq, Nd = query_offsets.shape[0] - 1, document_offsets.shape[0] - 1
    if validate:
        _validate_offsets("query_offsets", query_offsets, Tq)
        _validate_offsets("document_offsets", document_offsets, Td)
        _validate_ids("pair_query_ids", pair_query_ids, Nq)
        _validate_ids("pair_document_ids", pair_document_ids, Nd)
    if max_query_length is None:
        # Argmax width / tiling bound: one host sync unless the caller says.
        # (At most Tq: offsets that describe no layout score NaN anyway.)
        max_query_length = min(int((query_offsets[1:] - query_offsets[:-1]).max()), Tq) if Nq else 0
    elif max_query_length < 0:
        raise ValueError(f"max_query_length must be >= 0, got {max_query_length}")
    lq = max(int(max_query_length), 0)
    # One op for the segments and the int32 pair ids; a query longer than lq
    # is an invalid segment (NaN).
    q_start, q_len, d_start, d_len, pair_q32, pair_d32 = _segments(
        [(query_offsets, Tq, lq), (document_offsets, Td, -1)],
        [(pair_query_ids, *_I32_RANGE), (pair_document_ids, *_I32_RANGE)])
    P = pair_query_ids.shape[0]
    dev = queries.device
    if P == 0:
        return _empty_result((0,), lq, queries, mode)
    kind = _argmax_kind(mode == "train", mode == "argmax", Td)
    scores, argmax = _run(queries, q_start, q_len, None, documents, d_start,
                          d_len, None, pair_q32, pair_d32, LIST, lq, kind, tf32, normalize)
    if mode == "argmax":
        return scores, _i32(argmax)
    return scores


def score_pairs_packed(queries: Tensor, query_offsets: Tensor, documents: Tensor,
                       document_offsets: Tensor, pair_query_ids: Tensor, pair_document_ids: Tensor, *,
                       max_query_length: Optional[int] = None, validate: bool = False,
                       tf32: bool = False, normalize: bool = False) -> Tensor:
    """Scores of arbitrary (query, document) pairs over packed ragged tokens -> fp32 ``[P]``.

    ``max_query_length`` (an upper bound on every query's length) avoids the
    one host sync that otherwise finds it; pass it under ``torch.compile`` or
    CUDA-graph capture. A query longer than it scores NaN.
    """
    return _pairs(queries, query_offsets, documents, document_offsets, pair_query_ids,
                  pair_document_ids, max_query_length, mode="score", validate=validate, tf32=tf32,
                  normalize=normalize)


def score_pairs_packed_with_argmax(queries, query_offsets, documents, document_offsets, pair_query_ids,
                                   pair_document_ids, *, max_query_length=None, validate=False, tf32=False,
                             normalize=False):
    """As :func:`score_pairs_packed`, plus int32 argmax ``[P, max_query_length]``
    (document-token index within the document, -1 past the query's length)."""
    return _pairs(queries, query_offsets, documents, document_offsets, pair_query_ids,
                  pair_document_ids, max_query_length, mode="argmax", validate=validate, tf32=tf32,
                  normalize=normalize)


def score_pairs_packed_train(queries, query_offsets, documents, document_offsets, pair_query_ids,
                             pair_document_ids, *, max_query_length=None, validate=False, tf32=False,
                             normalize=False):
    """Differentiable :func:`score_pairs_packed`."""
    return _pairs(queries, query_offsets, documents, document_offsets, pair_query_ids,
                  pair_document_ids, max_query_length, mode="train", validate=validate, tf32=tf32,
                  normalize=normalize)


# ----------------------------------------------------------------------------
# maxsim(): boolean masks, cross or per-query candidates, differentiable
# ----------------------------------------------------------------------------

def maxsim(Q: Tensor, D: Tensor, q_mask: Optional[Tensor] = None, d_mask: Optional[Tensor] = None, *,
           normalize: bool = False, tf32: bool = False) -> Tensor:
    """MaxSim of ``Q [Nq, Lq, d]`` against ``D [Nd, Ld, d]`` (every query x every
    document -> ``[Nq, Nd]``) or ``D [Nq, K, Ld, d]`` (each query's own K
    candidates -> ``[Nq, K]``). Masks are boolean, True = real token
    (``q_mask [Nq, Lq]``, ``d_mask`` shaped like ``D`` without its last dim).
    ``normalize=True`` scores L2-normalised tokens (cosine similarity), with the
    norms folded into the kernels: no normalised copy is made. Differentiable.
    """
    _check_float("Q", Q)
    _check_float("D", D)
    _check_rank("Q", Q, 3, "[Nq, Lq, d]")
    if D.dim() not in (3, 4):
        raise ValueError(f"D must be 3-D [Nd, Ld, d] or 4-D [Nq, K, Ld, d], got shape {tuple(D.shape)}")
    _check_dim("Q", Q, "D", D)
    Nq, Lq, _ = Q.shape
    if D.dim() == 4 and D.shape[0] != Nq:
        raise ValueError(f"D [Nq, K, Ld, d] must have Nq={Nq} in dim 0, got {D.shape[0]}")
    if q_mask is not None:
        _check_mask("q_mask", q_mask, Q.shape[:2])
    if d_mask is not None:
        _check_mask("d_mask", d_mask, D.shape[:-1])
    _check_same("Q", Q, "D", D, "q_mask", q_mask, "d_mask", d_mask)
    Ld = D.shape[-2]
    n_docs = D.shape[0] * (D.shape[1] if D.dim() == 4 else 1)
    out_shape = (Nq, D.shape[1] if D.dim() == 4 else D.shape[0])
    if Nq * n_docs == 0:
        return torch.zeros(out_shape, device=Q.device, dtype=_score_dtype(Q))
    dev = Q.device
    q_start, q_len = _padded_segments(Nq, Lq, None, dev)
    d_start, d_len = _padded_segments(n_docs, Ld, None, dev)
    train = torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    kind = _argmax_kind(train, False, Ld)
    scores, _ = _run(Q, q_start, q_len, _flat_mask(q_mask), D, d_start, d_len,
                     _flat_mask(d_mask), None, None, GROUPED if D.dim() == 4 else CROSS, Lq, kind, tf32,
                     normalize)
    return scores
