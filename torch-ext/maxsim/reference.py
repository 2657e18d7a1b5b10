"""Pure-PyTorch exact reference for the maxsim op set.

Two roles: the test oracle (run in fp64 with ``accum=torch.float64``) and the
fallback for any op a backend lacks. It follows the op contract written in
``torch_binding.h`` exactly, and never holds more than a bounded slice of the
similarity grid: pairs are processed in chunks of at most ``_GRID_BUDGET``
similarity entries.
"""

from __future__ import annotations

import torch

CROSS, GROUPED, LIST = 0, 1, 2
_GRID_BUDGET = 1 << 22  # similarity entries held at once


def pair_ids(layout: int, nq: int, nd: int, pair_q=None, pair_d=None, device=None):
    """(query id, document id) of every pair, as int64 tensors."""
    if layout == CROSS:
        p = torch.arange(nq * nd, device=device)
        return p // max(nd, 1), p % max(nd, 1)
    if layout == GROUPED:
        k = nd // nq if nq else 0
        p = torch.arange(nd, device=device)
        return p // max(k, 1), p
    return pair_q.long(), pair_d.long()


def uniform_segments(like, n, extent):
    """n back-to-back segments of ``extent`` rows on ``like``'s device: int32
    start and length (the op's fallback where a build has no kernel)."""
    start = torch.arange(n, device=like.device, dtype=torch.int64) * extent
    return start.to(torch.int32), torch.full((n,), extent, device=like.device, dtype=torch.int32)


def segments(offsets, totals, max_lens, ints, lo, hi):
    """Offsets -> (start, length) int32 segments, and int32 copies of ints
    with values outside [lo, hi] set to -1 (contract in torch_binding.h):
    the op's fallback where a build has no kernel (MPS). A start may be a
    view of int32 offsets."""
    out = []
    for off, total, max_len in zip(offsets, totals, max_lens):
        length = off[1:] - off[:-1]
        ok = (off[0] == 0) & (off[-1] == total) & (length >= 0).all()
        start, length = off[:-1], torch.where(ok, length, -1)
        if max_len >= 0:
            length = torch.where(length > max_len, -1, length)
        if off.dtype != torch.int32:
            start, length = start.to(torch.int32), length.to(torch.int32)
        out += [start, length]
    for t, a, b in zip(ints, lo, hi):
        info = torch.iinfo(t.dtype)  # bounds past the dtype compare as its limits
        a, b = max(a, info.min), min(b, info.max)
        out.append(torch.where((t < a) | (t > b), -1, t).to(torch.int32))
    return out


def _segments(start, length, n_rows, width, mask):
    """Row indices [N, width] and validity [N, width] of each segment."""
    ar = torch.arange(width, device=start.device)
    rows = start.long()[:, None] + ar[None, :]
    valid = ar[None, :] < length.long()[:, None]
    rows = torch.where(valid, rows, torch.zeros_like(rows)).clamp_(0, max(n_rows - 1, 0))
    if mask is not None and n_rows > 0:
        valid = valid & mask[rows]
    return rows, valid


def forward(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d,
            layout: int, lq: int, argmax_kind: int, precision: int = 0,
            accum: torch.dtype = torch.float32, normalize: bool = False):
    """Reference for ``ops.forward``: returns (scores [P] fp32 (or ``accum``), argmax).
    ``precision`` is ignored: the reference is exact on every backend."""
    if normalize:
        q, d = normalize_rows(q, accum), normalize_rows(d, accum)
    device = q.device
    nq, nd = q_start.numel(), d_start.numel()
    qi, di = pair_ids(layout, nq, nd, pair_q, pair_d, device)
    P = qi.numel()
    bad = (qi < 0) | (qi >= nq) | (di < 0) | (di >= nd)
    qi_c = qi.clamp(0, max(nq - 1, 0))
    di_c = di.clamp(0, max(nd - 1, 0))
    out_dtype = torch.float32 if accum == torch.float32 else accum
    scores = torch.zeros(P, dtype=out_dtype, device=device)
    am_dtype = torch.int16 if argmax_kind == 2 else torch.int32
    argmax = torch.full((P, lq) if argmax_kind else (0,), -1, dtype=am_dtype, device=device)
    if P == 0:
        return scores, argmax
    # Widest document: one sync, acceptable in the oracle/fallback only.
    ld = int(d_len.clamp(min=0).max().item()) if nd else 0
    ld = max(ld, 1)
    qf = q.to(accum)
    df = d.to(accum)
    chunk = max(1, _GRID_BUDGET // max(1, lq * ld))
    for s in range(0, P, chunk):
        e = min(P, s + chunk)
        qa, da = qi_c[s:e], di_c[s:e]
        qrows, qvalid = _segments(q_start[qa], q_len[qa], q.shape[0], lq, q_mask)
        drows, dvalid = _segments(d_start[da], d_len[da], d.shape[0], ld, d_mask)
        qt = qf[qrows] if q.shape[0] else qf.new_zeros(qrows.shape + (q.shape[1],))
        dt = df[drows] if d.shape[0] else df.new_zeros(drows.shape + (d.shape[1],))
        sim = torch.einsum("pid,pjd->pij", qt, dt)
        sim = sim.masked_fill(~dvalid[:, None, :], float("-inf"))
        best, arg = sim.max(dim=2)
        has_doc = dvalid.any(dim=1)[:, None]
        best = torch.where(has_doc & qvalid, best, torch.zeros_like(best))
        arg = torch.where(has_doc & qvalid, arg, torch.full_like(arg, -1))
        sc = best.sum(dim=1)
        invalid = bad[s:e] | (q_len[qa] < 0) | (d_len[da] < 0)
        scores[s:e] = torch.where(invalid, torch.full_like(sc, float("nan")), sc).to(out_dtype)
        if argmax_kind:
            argmax[s:e] = arg.to(am_dtype)
    return scores, argmax


def normalize_rows(x, dtype=torch.float32):
    """x / max(|x|, 1e-12) per row, in ``dtype`` (at least fp32): the ``normalize`` flag."""
    xf = x.to(torch.promote_types(dtype, torch.float32))
    return xf / torch.linalg.vector_norm(xf, dim=1, keepdim=True).clamp_min(1e-12)


def normalize_backward(g, x):
    """dL/dx from g = dL/dx^ (x^ = normalize_rows(x)), in g's dtype."""
    xf = x.to(g.dtype)
    norm = torch.linalg.vector_norm(xf, dim=1, keepdim=True)
    inv = norm.clamp_min(1e-12).reciprocal()
    xh = xf * inv
    c = (xh * g).sum(1, keepdim=True) * (norm >= 1e-12)
    return (g - xh * c) * inv


def quantize(x, kind: int, rows_per_block: int = 0, scales=None):
    """Reference for ``ops.quantize`` (kind 0 int8, 1 fp8 e4m3): per-row
    symmetric scales ``amax / qmax`` (1 for a zero or NaN row) unless
    ``scales`` [T] are given, values rounded to nearest even (int8 clamped
    to +-127, NaN -> 0; fp8 saturating to +-448), the dim zero-padded to a
    multiple of 16. Works in blocks of rows to bound the fp32 temporary."""
    T, d = x.shape
    dp = (d + 15) // 16 * 16
    qmax = 127.0 if kind == 0 else 448.0
    values = torch.zeros((T, dp), dtype=torch.int8 if kind == 0 else torch.float8_e4m3fn, device=x.device)
    given = scales
    if given is not None and (given.dim() != 1 or given.shape[0] != T):
        raise RuntimeError(f"maxsim: quantize scales must be [T] with T = x.shape[0] = {T}")
    scales = torch.empty((T,), dtype=torch.float32, device=x.device) if given is None else given.float().clone()
    step = rows_per_block or max(1, (64 << 20) // max(1, 4 * dp))
    for r0 in range(0, T, step):
        xb = x[r0:r0 + step].to(torch.float32)
        if given is None:
            amax = xb.abs().amax(dim=1) if d else xb.new_zeros(xb.shape[0])
            # a true division (torch turns division by a Python scalar into a
            # multiplication by its reciprocal on CUDA, one ulp off the kernels)
            s = torch.where(amax > 0, amax / amax.new_full((), qmax), torch.ones_like(amax))
        else:
            s = scales[r0:r0 + step]
        y = xb / s[:, None]
        if kind == 0:
            y = torch.nan_to_num(y.round_(), nan=0.0).clamp_(-127, 127)
        else:
            y = torch.where(torch.isnan(y), y, y.clamp(-448, 448))
        values[r0:r0 + step, :d] = y.to(values.dtype)
        scales[r0:r0 + step] = s
    return values, scales


def dequantize(x, scale, dtype=torch.float32):
    """Token rows stored as int8 / float8 with per-row scales -> ``dtype``."""
    return x.to(dtype) * scale.to(dtype)[:, None]


def forward_quant(q, q_scale, q_start, q_len, q_mask, d, d_scale, d_start, d_len, d_mask, pair_q,
                  pair_d, layout: int, lq: int, argmax_kind: int, uniform_doc_scales: bool = False,
                  accum: torch.dtype = torch.float32):
    """Reference for ``ops.forward_quant``: the forward of the dequantised tokens
    (``uniform_doc_scales`` only lets kernels apply a document's one scale
    after the max; the result is the same)."""
    return forward(dequantize(q, q_scale, accum), q_start, q_len, q_mask, dequantize(d, d_scale, accum),
                   d_start, d_len, d_mask, pair_q, pair_d, layout, lq, argmax_kind, accum=accum)


def backward(grad, q, q_start, q_len, d, d_start, d_len, pair_q, pair_d, argmax,
             layout: int, q_ptr=None, q_pairs=None, d_ptr=None, d_pairs=None,
             need_dq: bool = True, need_dd: bool = True,
             accum: torch.dtype = torch.float32, normalize: bool = False):
    """Reference for ``ops.backward``: (dq, dd) from the saved argmax."""
    if normalize:
        acc = torch.promote_types(accum, torch.float32)
        dq, dd = backward(grad, normalize_rows(q, acc), q_start, q_len, normalize_rows(d, acc), d_start,
                          d_len, pair_q, pair_d, argmax, layout, q_ptr, q_pairs, d_ptr, d_pairs,
                          need_dq, need_dd, accum=acc)
        dq = normalize_backward(dq, q).to(q.dtype if accum == torch.float32 else acc) if need_dq else q.new_empty(0)
        dd = normalize_backward(dd, d).to(d.dtype if accum == torch.float32 else acc) if need_dd else d.new_empty(0)
        return dq, dd
    device = q.device
    nq, nd = q_start.numel(), d_start.numel()
    qi, di = pair_ids(layout, nq, nd, pair_q, pair_d, device)
    P, lq = argmax.shape[0], (argmax.shape[1] if argmax.dim() == 2 else 0)
    dq = torch.zeros(q.shape, dtype=accum, device=device) if need_dq else q.new_empty(0)
    dd = torch.zeros(d.shape, dtype=accum, device=device) if need_dd else d.new_empty(0)
    if P and lq:
        ok = (qi >= 0) & (qi < nq) & (di >= 0) & (di < nd)
        qi_c, di_c = qi.clamp(0, max(nq - 1, 0)), di.clamp(0, max(nd - 1, 0))
        ok = ok & (q_len[qi_c] >= 0) & (d_len[di_c] >= 0)
        a = argmax.long()
        ar = torch.arange(lq, device=device)
        sel = ok[:, None] & (a >= 0) & (ar[None, :] < q_len[qi_c].long()[:, None])
        qrow = (q_start[qi_c].long()[:, None] + ar[None, :])[sel]
        drow = (d_start[di_c].long()[:, None] + a)[sel]
        g = grad.to(accum)[:, None].expand(P, lq)[sel]
        if need_dq:
            dq.index_add_(0, qrow, g[:, None] * d.to(accum)[drow])
        if need_dd:
            dd.index_add_(0, drow, g[:, None] * q.to(accum)[qrow])
    if accum == torch.float32:
        dq = dq.to(q.dtype) if need_dq else dq
        dd = dd.to(d.dtype) if need_dd else dd
    return dq, dd


# ----------------------------------------------------------------------------
# User-level references (plain padded tensors), handy in tests and examples.
# ----------------------------------------------------------------------------

def maxsim_reference(Q, D, q_mask=None, d_mask=None, accum=torch.float64):
    """Q [Nq, Lq, d] x D [Nd, Ld, d] -> [Nq, Nd], or D [Nq, K, Ld, d] -> [Nq, K];
    one pair Q [Lq, d] x D [Ld, d] -> a 0-d score.

    Masks are boolean (True = real token). Computed in ``accum`` precision with
    the full grid: for small inputs only.
    """
    if Q.dim() == 2 and D.dim() == 2:
        return maxsim_reference(Q[None], D[None], None if q_mask is None else q_mask[None],
                                None if d_mask is None else d_mask[None], accum)[0, 0]
    Qf, Df = Q.to(accum), D.to(accum)
    q_mask = None if q_mask is None else q_mask.to(Q.device)
    d_mask = None if d_mask is None else d_mask.to(Q.device)
    if D.dim() == 3:
        sim = torch.einsum("qid,njd->qnij", Qf, Df)
        dm = None if d_mask is None else d_mask[None, :, None, :]
    else:
        sim = torch.einsum("qid,qkjd->qkij", Qf, Df)
        dm = None if d_mask is None else d_mask[:, :, None, :]
    if dm is not None:
        sim = sim.masked_fill(~dm, float("-inf"))
    best = sim.max(dim=3).values if sim.shape[3] else sim.new_full(sim.shape[:3], float("-inf"))
    best = torch.where(torch.isneginf(best), torch.zeros_like(best), best)
    if q_mask is not None:
        best = torch.where(q_mask[:, None, :], best, torch.zeros_like(best))
    return best.sum(dim=2)


# ----------------------------------------------------------------------------
# erikkaum/maxsim's reference names and call forms (fp32 results; argmax -1,
# not 0, where no document token wins). Each lowers to :func:`forward`.
# ----------------------------------------------------------------------------

def _offset_segments(offsets):
    off = offsets.to(torch.int64)
    return off[:-1].to(torch.int32), (off[1:] - off[:-1]).to(torch.int32)


def maxsim_reference_with_argmax(q, d):
    """One pair ``q [Lq, d]`` x ``d [Ld, d]`` -> (fp32 0-d score, int32 argmax [Lq])."""
    zero = torch.zeros(1, dtype=torch.int32, device=q.device)
    s, a = forward(q, zero, zero + q.shape[0], None, d, zero, zero + d.shape[0], None, None, None,
                   CROSS, q.shape[0], 1)
    return s[0], a[0]


def score_pairs_packed_with_argmax_reference(queries, query_offsets, documents, document_offsets,
                                             pair_query_ids, pair_document_ids, max_q_len=None):
    """Packed pairs -> (fp32 scores [P], int32 argmax [P, max_q_len])."""
    q_start, q_len = _offset_segments(query_offsets)
    d_start, d_len = _offset_segments(document_offsets)
    if max_q_len is None:
        max_q_len = int(q_len.max()) if q_len.numel() else 0
    return forward(queries, q_start, q_len, None, documents, d_start, d_len, None, pair_query_ids,
                   pair_document_ids, LIST, int(max_q_len), 1)


def score_pairs_packed_reference(queries, query_offsets, documents, document_offsets, pair_query_ids,
                                 pair_document_ids):
    """Packed pairs -> fp32 scores [P]."""
    return score_pairs_packed_with_argmax_reference(queries, query_offsets, documents, document_offsets,
                                                    pair_query_ids, pair_document_ids)[0]


def score_candidates_padded_with_argmax_reference(queries, documents, query_lengths, doc_lengths):
    """Padded ``[B, Lq, d]`` x ``[B, C, Ld, d]`` -> (fp32 [B, C], int32 argmax [B, C, Lq])."""
    B, Lq, dim = queries.shape
    C, Ld = documents.shape[1], documents.shape[2]
    dev = queries.device
    q_start = torch.arange(B, dtype=torch.int32, device=dev) * Lq
    d_start = torch.arange(B * C, dtype=torch.int32, device=dev) * Ld
    s, a = forward(queries.reshape(-1, dim), q_start, query_lengths.reshape(-1).to(torch.int32), None,
                   documents.reshape(-1, dim), d_start, doc_lengths.reshape(-1).to(torch.int32), None,
                   None, None, GROUPED, Lq, 1)
    return s.view(B, C), a.view(B, C, Lq)


def score_candidates_padded_reference(queries, documents, query_lengths, doc_lengths):
    """Padded candidates -> fp32 [B, C]."""
    return score_candidates_padded_with_argmax_reference(queries, documents, query_lengths, doc_lengths)[0]


def score_contrastive_with_argmax_reference(queries, documents, document_offsets):
    """Every query ``[Nq, Lq, d]`` x every packed document -> (fp32 [Nq, Nb], int32 argmax [Nq, Nb, Lq])."""
    Nq, Lq, dim = queries.shape
    q_start = torch.arange(Nq, dtype=torch.int32, device=queries.device) * Lq
    d_start, d_len = _offset_segments(document_offsets)
    s, a = forward(queries.reshape(-1, dim), q_start, torch.full_like(q_start, Lq), None, documents,
                   d_start, d_len, None, None, None, CROSS, Lq, 1)
    return s.view(Nq, -1), a.view(Nq, d_start.numel(), Lq)


def score_contrastive_reference(queries, documents, document_offsets):
    """Every query x every packed document -> fp32 [Nq, Nb]."""
    return score_contrastive_with_argmax_reference(queries, documents, document_offsets)[0]
