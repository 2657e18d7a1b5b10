"""Exact MaxSim top-k search over a :class:`~maxsim.corpus.Corpus`, in bounded memory.

``search(Q, corpus, k)`` scores every query against every document block by
block with the compiled forward op and keeps a running top-k per query as
ordered int64 keys (:mod:`maxsim.keys`), so no more than ``Nq x block``
scores exist at once (never the full ``[Nq, Nd]`` matrix) and the results
hold ``Nq x min(k, N)`` entries. For a quantised corpus the queries are
quantised per token; with kept originals (``Corpus(..., rescore=...)``) the
best ``oversample x k`` candidates of the compressed scan are re-scored
exactly.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._registry import ops
from .corpus import Corpus, as_corpus
from .keys import merge_topk
from .lowering import padded_segments
from .quantization import quantize_tokens
from .reference import CROSS, GROUPED, LIST
from .checks import (
    FLOATS,
    check_count,
    check_float,
    check_lengths,
    check_mask,
    check_same,
    should_validate,
    validate_lengths,
)

Tensor = torch.Tensor
_SCORE_BUDGET = 1 << 23  # scores (Nq x docs) held at once per block

__all__ = ["search"]


def _queries(queries: Tensor, query_lengths, query_mask, device, validate):
    if queries.dtype not in FLOATS:
        raise TypeError(f"queries must be float32, float16 or bfloat16, got {queries.dtype}")
    if queries.dim() not in (2, 3):
        raise ValueError(f"queries must be [Lq, d] or [Nq, Lq, d], got shape {tuple(queries.shape)}")
    single = queries.dim() == 2
    Nq, Lq, d = (1,) + tuple(queries.shape) if single else queries.shape
    if query_lengths is not None:
        scalar = single and isinstance(query_lengths, torch.Tensor) and query_lengths.dim() == 0
        check_lengths("query_lengths", query_lengths, () if scalar else (Nq,))
    if query_mask is not None:
        check_mask("query_mask", query_mask, queries.shape[:-1])
    check_same("queries", queries, "query_lengths", query_lengths, "query_mask", query_mask)
    if single:
        # a view, not an op per call: every op here is host time in a one-query search
        queries = queries.view((1,) + tuple(queries.shape)) if queries.is_contiguous() else queries[None]
    if queries.device != device:
        queries = queries.to(device)
    ql = None
    if query_lengths is not None:
        ql = query_lengths.reshape(1) if single else query_lengths
        ql = ql.to(device)
        if should_validate(validate):
            validate_lengths("query_lengths", ql, Lq)
    q_start, q_len = padded_segments(Nq, Lq, ql, queries)
    qm = None if query_mask is None else query_mask.to(device).reshape(-1).contiguous()
    flat = queries.view(Nq * Lq, d) if queries.is_contiguous() else queries.reshape(Nq * Lq, d).contiguous()
    return single, flat, q_start, q_len, qm, Nq, Lq


def _rescore(q, q_start, q_len, qm, Nq, Lq, corpus, keys, k, dev) -> tuple[Tensor, Tensor]:
    """Exact scores of each query's candidate keys [Nq, kc] from the corpus'
    original tokens; -> the top k (scores, ids)."""
    kc = keys.shape[1]
    if kc == 0 or Nq == 0:
        return ops.decode_keys(merge_topk(keys[:, :0], k))
    orig = corpus.originals[0]
    q = q.to(orig.dtype)
    if orig.device == dev:
        # Originals where the compute is: the candidates are documents of the
        # corpus (same rows as the compressed tokens), scored in place and
        # ranked by one op (on CUDA one kernel for 16-bit tokens).
        return ops.rescore_topk(q, q_start, q_len, qm, orig, corpus.starts, corpus.lengths, corpus.originals[1],
                                keys, Lq, k)
    # Originals elsewhere (pinned / host): gather the candidates' tokens.
    _, cand = ops.decode_keys(keys)
    L = max(corpus.originals[4], 1)
    # Queries per group: gathered candidate tokens of about 256 MiB at most.
    per = max(1, (256 << 20) // max(1, kc * L * orig.shape[1] * orig.element_size()))
    parts = []
    for n0 in range(0, Nq, per):
        n1 = min(Nq, n0 + per)
        tok, m, st, ln = corpus._gather_originals(cand[n0:n1].reshape(-1), dev)
        qs, ql = q_start[n0:n1] - q_start[n0], q_len[n0:n1]
        rows = slice(n0 * Lq, n1 * Lq)
        part, _ = ops.forward(q[rows], qs, ql, None if qm is None else qm[rows], tok, st, ln, m,
                              None, None, GROUPED, Lq, 0, 0)
        parts.append(part.view(n1 - n0, kc))
    scores = parts[0] if len(parts) == 1 else torch.cat(parts)
    top = ops.block_topk(scores, 0, k, cand)  # id -1 (no candidate): empty slot; sorted
    return ops.decode_keys(top if top.shape[1] == k else merge_topk(top, k))


def _plaid_search(corpus, q, q_start, q_len, qm, Nq, Lq, single, k, oversample, pad_to_k, nprobe, candidates,
                  centroid_threshold=None):
    k_out = min(k, corpus.num_docs)
    mask = torch.arange(Lq, device=q.device)[None, :] < q_len[:, None]
    if qm is not None:
        mask = mask & qm.view(Nq, Lq)
    originals = None
    if corpus.originals is not None:
        orig, omask, ost, oln, _ = corpus.originals

        def originals(Q3, query_mask, ids, pair_q):
            s, _ = ops.forward(q.to(orig.dtype), q_start, q_len, qm, orig, ost.to(torch.int32),
                               oln.to(torch.int32), omask, pair_q, ids.to(torch.int32), LIST, Lq, 0, 0, True)
            return s
    if k_out and Nq:
        nc = candidates or max(oversample * k_out, 256)
        scores, ids = corpus.plaid.search(q.view(Nq, Lq, -1), k_out, query_mask=mask, nprobe=nprobe,
                                          candidates=nc, rerank="originals" if originals else "decompressed",
                                          originals=originals, centroid_threshold=centroid_threshold)
    else:
        scores = torch.empty((Nq, 0), dtype=torch.float32, device=q.device)
        ids = torch.empty((Nq, 0), dtype=torch.int64, device=q.device)
    if pad_to_k and k > scores.shape[1]:
        pad = k - scores.shape[1]
        scores = torch.cat([scores, scores.new_full((Nq, pad), float("-inf"))], dim=1)
        ids = torch.cat([ids, ids.new_full((Nq, pad), -1)], dim=1)
    return (scores[0], ids[0]) if single else (scores, ids)


def search(queries: Tensor, corpus, k: int, *, query_lengths: Optional[Tensor] = None,
           query_mask: Optional[Tensor] = None, block_docs: Optional[int] = None,
           oversample: int = 4, pad_to_k: bool = False,
           validate: Optional[bool] = None, nprobe: Optional[int] = None,
           candidates: Optional[int] = None, centroid_threshold: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """Exact MaxSim top-k of each query over ``corpus``.

    ``queries``: ``[Lq, d]`` or ``[Nq, Lq, d]`` (float), with optional
    ``query_lengths [Nq]`` or bool ``query_mask [Nq, Lq]``. ``corpus``: a
    :class:`Corpus`, or ``(documents, offsets)`` for a packed collection
    already on the queries' device. Queries share the dtype of an
    unquantised corpus (as in :func:`maxsim.maxsim`); a quantised corpus
    quantises them. Returns ``(scores, ids)``: fp32 and int64
    ``[Nq, min(k, N)]`` (``[min(k, N)]`` for one 2-D query; ``N`` the number
    of documents) on the corpus' compute device, best first, ties to the
    lower document id; ``pad_to_k=True`` pads them to ``k`` columns with
    (-inf, -1). A document whose score is NaN ranks last.
    ``block_docs`` caps the documents scored per block (default: about 8M
    scores per block). For a quantised corpus with kept originals
    (``Corpus(..., rescore=...)``) the compressed scan keeps ``oversample x
    k`` candidates, re-scored exactly from the originals; the scores returned
    are then the exact ones. ``validate`` (default: the process-wide
    validation mode) checks ``query_lengths`` against ``Lq`` (one host
    sync); otherwise a length outside ``[0, Lq]`` makes that query's scores
    NaN.

    On a ``quantization="plaid"`` corpus the search is approximate in its
    candidates: PLAID's centroid scores of every document (one fused scan of
    the codes) give ``candidates`` (default ``max(oversample x k, 256)``)
    per query, restricted with ``nprobe`` to the documents holding a token of
    one of the ``nprobe`` best centroids of some query token (the inverted
    lists; one host sync), and those are re-scored exactly on their
    decompressed tokens (or on the originals, kept with ``rescore="device"``),
    queries and tokens L2-normalised. ``centroid_threshold`` prunes the
    centroid scores as PLAID does: the scan skips the tokens of centroids
    that no query token scores at least that high with (cosine), a query
    token they alone would have matched adding 0 (faster; fewer exact
    candidates when set too high).
    """
    check_float("queries", queries)
    k = check_count("k", k)
    oversample = check_count("oversample", oversample, low=1)
    if block_docs is not None:
        block_docs = check_count("block_docs", block_docs, low=1)
    corpus = as_corpus(corpus, queries.device)
    dev = corpus.device
    single, q, q_start, q_len, qm, Nq, Lq = _queries(queries, query_lengths, query_mask, dev, validate)
    if q.shape[1] != corpus.dim:
        raise ValueError(f"embedding dim mismatch: queries have {q.shape[1]}, the corpus {corpus.dim}")
    quant = corpus.quantization
    if quant == "plaid":
        return _plaid_search(corpus, q, q_start, q_len, qm, Nq, Lq, single, k, oversample, pad_to_k, nprobe,
                             candidates, centroid_threshold)
    if quant is None and q.dtype != corpus.dtype:
        raise TypeError(f"queries have dtype {q.dtype} but the corpus has {corpus.dtype}; "
                        "queries and documents must share a dtype")
    k_out = min(k, corpus.num_docs)  # results held: never more than the corpus
    k_scan = k_out
    if corpus.originals is not None:
        k_scan = min(k_out * oversample, corpus.num_docs)
    if quant is not None:
        qv, qs = quantize_tokens(q, quant)
    keys = None
    per_block = block_docs or max(1, _SCORE_BUDGET // max(1, Nq))
    if k_scan and Nq:
        for d0, d1, tok, sc, tmask, starts in corpus.chunks():
            for b0 in range(0, d1 - d0, per_block):
                b1 = min(d1 - d0, b0 + per_block)
                whole = b0 == 0 and b1 == corpus.num_docs  # one block over a resident corpus: no slicing ops
                st = starts if whole else starts[b0:b1]
                ln = corpus.lengths if whole else corpus.lengths[d0 + b0:d0 + b1]
                if quant is not None:
                    scores, _ = ops.forward_quant(qv, qs, q_start, q_len, qm, tok, sc, st, ln, tmask,
                                                  None, None, CROSS, Lq, 0, corpus.uniform_doc_scales)
                else:
                    scores, _ = ops.forward(q, q_start, q_len, qm, tok, st, ln, tmask, None, None,
                                            CROSS, Lq, 0, 0)
                top = ops.block_topk(scores.view(Nq, b1 - b0), d0 + b0, k_scan)
                keys = top if keys is None else merge_topk(torch.cat([keys, top], dim=1), k_scan)
    if keys is None:
        keys = torch.empty((Nq, 0), dtype=torch.int64, device=dev)
    if keys.shape[1] < k_scan:
        keys = merge_topk(keys, k_scan)
    if corpus.originals is not None:
        scores, ids = _rescore(q, q_start, q_len, qm, Nq, Lq, corpus, keys, k_out, dev)
    else:
        scores, ids = ops.decode_keys(keys)
    if pad_to_k and k > k_out:
        pad = k - k_out
        scores = torch.cat([scores, scores.new_full((Nq, pad), float("-inf"))], dim=1)
        ids = torch.cat([ids, ids.new_full((Nq, pad), -1)], dim=1)
    return (scores[0], ids[0]) if single else (scores, ids)
