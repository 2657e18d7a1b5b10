"""MaxSim straight from an encoder's hidden states through its projection head.

:func:`maxsim_from_hidden` scores ``Q`` against ``D = H @ W.T + b``
(optionally L2-normalised per token) without ever holding the projected
documents of the whole batch: documents are projected a chunk at a time
(about ``chunk_mib`` MiB of projected tokens) and scored by the compiled
MaxSim kernels. Differentiable in ``Q``, ``H``, ``W`` and ``b``. On an sm_90
GPU within the fused kernel's scope (fp16 / bf16, ``d_out == 128``,
``d_model`` a multiple of 64, at most 1024 query tokens in all, documents
shared by every query) the op ``head_forward`` projects, normalises and
scores each tile of hidden states without writing the projected documents
to memory. Training with few winners a hidden row keeps only the argmax
(from that op where in scope) and back-propagates through the winning rows
alone (:class:`_HeadFromWinners`); with many, it is the chunked composition
(cuBLAS projection, on CUDA one normalisation kernel each way, the MaxSim
kernels), each chunk checkpointed.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import reference
from ._ops import add_op_namespace_prefix, ops
from ._registry import meta_kernel, register_fallbacks, warn_fallback
from .checks import check_float
from .scoring import maxsim, maxsim_with_argmax_nograd

Tensor = torch.Tensor

_NORM_EPS = 1e-12  # F.normalize's
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the CUDA kernels' row types

__all__ = ["maxsim_from_hidden", "maxsim_from_hidden_reference"]


class _NormalizedRows(torch.autograd.Function):
    """x / max(|x|, eps) per row of a CUDA [T, d] tensor, one kernel each way
    (head_normalize), where F.normalize's autograd takes about a dozen."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return ops.head_normalize(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return ops.head_normalize_backward(grad.contiguous(), x)


def _normalized(D: Tensor) -> Tensor:
    if D.is_cuda and D.dtype in _KERNEL_DTYPES:
        return _NormalizedRows.apply(D.reshape(-1, D.shape[-1])).view(D.shape)
    # F.normalize reduces in fp32 without an fp32 copy of the projected tokens.
    return F.normalize(D, dim=-1, eps=_NORM_EPS)


def _project(H: Tensor, W: Tensor, b: Optional[Tensor], normalize: bool, dtype) -> Tensor:
    D = F.linear(H, W, b)
    return (_normalized(D) if normalize else D).to(dtype)


def _chunk_scores(Q, H, W, b, q_mask, d_mask, normalize):
    return maxsim(Q, _project(H, W, b, normalize, Q.dtype), q_mask, d_mask)


# Training from the winners: when a step has at most this many (query token,
# document) winners per hidden-state row, the backward projects only the
# winning rows (the gradient of every other row is zero) instead of the
# whole batch; with more, the composition's dense backward does less work.
_WINNERS_PER_ROW = 4


class _HeadFromWinners(torch.autograd.Function):
    """maxsim_from_hidden in training where the winners are few: the forward
    keeps only the argmax (from the fused kernel, or projecting and scoring
    a chunk of documents at a time); the backward re-projects the winning
    rows (gathered from H; or, with more winners than rows, every row once)
    and applies the chain rule per winner in one op (head_winner_grad), so
    its work scales with the winners, not the batch. head_scatter_rows
    writes every row of a document's gradient once from its winners, in a
    fixed order (deterministic, no atomics, no fill): the winners' gradients
    projected through W, or the rows' gradients of D then projected,
    whichever product is smaller. Dimension 1 of the argmax [Nq, n, Lq] is
    chunked: documents, or each query's candidates side by side."""

    @staticmethod
    def forward(ctx, Q3, H, W, b, q_mask, d_mask, normalize, per, per_backward, fused):
        candidates = H.dim() == 4
        n = H.shape[1] if candidates else H.shape[0]
        if fused:  # no projected tokens are held: one call
            scores, idx = ops.head_forward(Q3, H, W, b, q_mask, d_mask, normalize, True)
        else:
            parts, winners = [], []
            for n0 in range(0, max(n, 1), per):
                n1 = min(n, n0 + per)
                cut = (lambda t: t) if n1 - n0 == n else (lambda t: t[:, n0:n1] if candidates else t[n0:n1])
                s, a = maxsim_with_argmax_nograd(Q3, _project(cut(H), W, b, normalize, Q3.dtype), q_mask,
                                                 None if d_mask is None else cut(d_mask))
                parts.append(s)
                winners.append(a)
            scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            idx = winners[0] if len(winners) == 1 else torch.cat(winners, dim=1)
        ctx.save_for_backward(Q3, H, W, b, d_mask, idx)
        ctx.normalize, ctx.per = normalize, per_backward
        # Without masks every query token has a winner (Ld >= 1).
        ctx.masked = q_mask is not None or d_mask is not None
        return scores

    @staticmethod
    def backward(ctx, grad):
        Q3, H, W, b, d_mask, idx = ctx.saved_tensors
        need_q, need_h, need_w, need_b = ctx.needs_input_grad[:4]
        need_dp = need_h or need_w or need_b
        candidates = H.dim() == 4
        Nq, n, Lq = idx.shape
        Ld, d_model = H.shape[-2:]
        d_out = W.shape[0]
        Hrows = H.reshape(-1, d_model)
        chunks = range(0, n if Ld > 0 and Nq * Lq > 0 else 0, ctx.per)
        several = len(chunks) > 1
        winner_grad, scatter_rows = _winner_ops(H, d_out)
        Qf = Q3.float()
        # Winners a document holds: every query's tokens, or one query's.
        # More than its rows: every row is projected once (no gather of
        # hidden rows) and dW comes from the rows' summed gradients.
        per_document = Lq if candidates else Nq * Lq
        dense = per_document > Ld
        # Else dH projects the winners' gradients, then places them, unless
        # projecting the documents' rows is the smaller product.
        place_first = per_document * d_model >= Ld * d_out
        dQ = dH = dW = db = None
        if need_h and (several or not chunks):
            dH = (torch.empty if chunks else torch.zeros)(H.shape, device=H.device, dtype=H.dtype)
        for n0 in chunks:
            n1 = min(n, n0 + ctx.per)
            c = n1 - n0
            tok = idx[:, n0:n1]  # [Nq, c, Lq]
            cut = (lambda t: t[:, n0:n1]) if candidates else (lambda t: t[n0:n1])
            # Each winner's row: in the chunk's projected rows (dense), else in H.
            first_doc, docs_per_query = (0, c) if dense else (n0, n)
            first_row = torch.arange(first_doc * Ld, (first_doc + c) * Ld, Ld, device=idx.device)
            if candidates:
                first_row = first_row + torch.arange(Nq, device=idx.device)[:, None] * (docs_per_query * Ld)
            index = (first_row[..., None] + tok.clamp_min(0)).view(-1)
            if dense:
                Hc = cut(H)
                unit = F.linear(Hc, W, b).view(-1, d_out).index_select(0, index)
            else:
                Hw = Hrows.index_select(0, index)
                if ctx.masked and need_w:  # a query token without a winner read token 0, which may
                    # hold anything (a masked token): dW multiplies it by a zero gradient
                    Hw.masked_fill_((tok < 0).view(-1, 1), 0)
                unit = F.linear(Hw, W, b)
            dq, dP, db_part = winner_grad(unit.view(*tok.shape, d_out), Qf, grad[:, n0:n1], tok, ctx.normalize,
                                          need_dp)
            if need_q:
                dQ = dq if dQ is None else dQ.add_(dq)
            if not need_dp:
                continue
            if need_b:
                db = db_part if db is None else db.add_(db_part)
            if dense or (need_h and place_first):  # every row's gradient of D, summed from its winners
                placed = scatter_rows(dP, tok, Ld, candidates).view(-1, d_out)
            if need_w:
                if dense:  # masked rows may hold anything: they meet zero gradients here
                    Hm = Hc if d_mask is None else Hc.masked_fill(~cut(d_mask)[..., None], 0)
                    part = placed.t() @ Hm.reshape(-1, d_model)
                else:
                    part = dP.view(-1, d_out).t() @ Hw
                dW = part if not several else part.float() if dW is None else dW.add_(part.float())
            if need_h:
                if dense or place_first:  # project every row's gradient
                    rows = placed @ W
                else:  # few winners: project theirs, then place them
                    rows = scatter_rows((dP.view(-1, d_out) @ W).view(*tok.shape, d_model), tok, Ld, candidates)
                if dH is None:
                    dH = rows.view(H.shape)
                else:
                    block = cut(dH)
                    block.copy_(rows.view(block.shape))
        if need_q and dQ is None:
            dQ = torch.zeros_like(Q3)
        if need_w and dW is None:
            dW = torch.zeros_like(W)
        if need_b and db is None:
            db = torch.zeros_like(b)
        return (None if dQ is None else dQ.to(Q3.dtype), dH, None if dW is None else dW.to(W.dtype),
                None if db is None else db.to(b.dtype), None, None, None, None, None, None)


HEAD_WINNER_GRAD = add_op_namespace_prefix("head_winner_grad")
HEAD_SCATTER_ROWS = add_op_namespace_prefix("head_scatter_rows")
HEAD_NORMALIZE = add_op_namespace_prefix("head_normalize")
HEAD_NORMALIZE_BACKWARD = add_op_namespace_prefix("head_normalize_backward")


@meta_kernel(HEAD_NORMALIZE)
def _head_normalize_fake(x):
    return torch.empty_like(x)


@meta_kernel(HEAD_NORMALIZE_BACKWARD)
def _head_normalize_backward_fake(grad, x):
    return torch.empty_like(x)


def _reference_head_normalize(x):
    """head_normalize as tensor ops (the contract is in torch_binding.h)."""
    warn_fallback("head_normalize", x.device.type)
    return reference.normalize_rows(x, x.dtype).to(x.dtype)


def _reference_head_normalize_backward(grad, x):
    """head_normalize_backward as tensor ops."""
    warn_fallback("head_normalize_backward", x.device.type)
    return reference.normalize_backward(grad.to(torch.promote_types(x.dtype, torch.float32)), x).to(x.dtype)


@meta_kernel(HEAD_WINNER_GRAD)
def _head_winner_grad_fake(unit, q, grad, idx, normalize, need_dp):
    d_out = unit.shape[-1]
    return (q.new_empty(q.shape, dtype=torch.float32), unit.new_empty(unit.shape if need_dp else (0,)),
            q.new_empty((d_out,) if need_dp else (0,), dtype=torch.float32))


@meta_kernel(HEAD_SCATTER_ROWS)
def _head_scatter_rows_fake(rows, idx, ld, per_query):
    Nq, c, _, width = rows.shape
    return rows.new_empty((Nq, c, ld, width) if per_query else (c, ld, width))


def _reference_head_winner_grad(unit, q, grad, idx, normalize, need_dp):
    """head_winner_grad as tensor ops (the contract is in torch_binding.h)."""
    won = (idx >= 0)[..., None]
    u = torch.where(won, unit.float(), 0.0)  # a row without a winner is never read
    if normalize:  # rows as the forward scored them, in fp32
        norm = torch.linalg.vector_norm(u, dim=-1, keepdim=True)
        inv = norm.clamp_min(_NORM_EPS).reciprocal_()
        u.mul_(inv)
    w = torch.where(won, grad.float()[..., None, None], 0.0)  # [Nq, c, Lq, 1]
    dq = (w * u).sum(1)
    if not need_dp:
        return dq, unit.new_empty((0,)), dq.new_empty((0,))
    dp = w * q.float()[:, None]
    if normalize:  # the Jacobian of x / max(|x|, eps): (g - u <u, g>) / |x|
        along = (u * dp).sum(-1, keepdim=True).mul_(norm > _NORM_EPS)
        dp.sub_(u.mul_(along)).mul_(inv)
    return dq, dp.to(unit.dtype), dp.sum((0, 1, 2))


def _reference_head_scatter_rows(rows, idx, ld, per_query):
    """head_scatter_rows as tensor ops: index_add_ in row order, which is the
    kernel's ascending winner order within each document."""
    Nq, c, _, width = rows.shape
    doc = torch.arange(Nq * c if per_query else c, device=rows.device).view(Nq if per_query else 1, c)
    won = idx >= 0
    target = (doc[..., None] * ld + idx)[won]
    out = torch.zeros(doc.numel() * ld, width, device=rows.device, dtype=torch.float32)
    out.index_add_(0, target, rows[won].float())
    return out.to(rows.dtype).view((Nq, c, ld, width) if per_query else (c, ld, width))


_WINNER_GRAD_MAX_D_OUT = 1024  # head_backward.cu: a warp holds a row in registers


def _winner_ops(H: Tensor, d_out: int):
    """The backward's two steps: the ops (whose CUDA kernels take 32- and
    16-bit floats, head_winner_grad up to d_out 1024), else their
    compositions."""
    if H.dtype == torch.float64:
        return _reference_head_winner_grad, _reference_head_scatter_rows
    wide = d_out > _WINNER_GRAD_MAX_D_OUT
    return _reference_head_winner_grad if wide else ops.head_winner_grad, ops.head_scatter_rows


HEAD_FORWARD = add_op_namespace_prefix("head_forward")


@meta_kernel(HEAD_FORWARD)
def _head_forward_fake(q, h, w, b, q_mask, d_mask, normalize, with_argmax):
    argmax = (q.shape[0], h.shape[0], q.shape[1]) if with_argmax else (0,)
    return q.new_empty((q.shape[0], h.shape[0]), dtype=torch.float32), q.new_empty(argmax, dtype=torch.int32)


def _reference_head_forward(q, h, w, b, q_mask, d_mask, normalize, with_argmax):
    warn_fallback("head_forward", q.device.type)
    if not with_argmax:
        return _chunk_scores(q, h, w, b, q_mask, d_mask, normalize), q.new_empty((0,), dtype=torch.int32)
    return maxsim_with_argmax_nograd(q, _project(h, w, b, normalize, q.dtype), q_mask, d_mask)


# The op is compiled for CUDA only (the sm_90a kernel); elsewhere it is the
# composition, so it answers on every device.
register_fallbacks(((HEAD_FORWARD, _reference_head_forward), (HEAD_WINNER_GRAD, _reference_head_winner_grad),
                    (HEAD_SCATTER_ROWS, _reference_head_scatter_rows), (HEAD_NORMALIZE, _reference_head_normalize),
                    (HEAD_NORMALIZE_BACKWARD, _reference_head_normalize_backward)))

_FUSED_DTYPES = (torch.float16, torch.bfloat16)
_FUSED_MAX_QUERY_TOKENS = 1024  # head::kHeadMaxQ (head_fused.cuh)


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def _fused_ok(Q3: Tensor, H: Tensor, W: Tensor, b: Optional[Tensor], q_mask, d_mask) -> bool:
    """Whether ``head_forward``'s fused kernel takes this call (inference,
    or training's forward on the winners' path):
    an sm_90 GPU, fp16 / bf16 throughout, d_out 128, d_model a multiple of
    64, at most 1024 query tokens in all, shared documents (3-D H,
    contiguous, 16-byte aligned: it streams through TMA), boolean masks of
    the exact shapes."""
    if not (Q3.is_cuda and H.dim() == 3 and Q3.dtype in _FUSED_DTYPES):
        return False
    if any(t is not None and (t.dtype != Q3.dtype or t.device != Q3.device) for t in (H, W, b)):
        return False
    Nq, Lq, d_out = Q3.shape
    Nd, Ld, d_model = H.shape
    if d_out != 128 or d_model % 64 or d_model == 0 or Nq * Lq > _FUSED_MAX_QUERY_TOKENS:
        return False
    # The offset, not data_ptr(): fake tensors (torch.compile) have none. A
    # base pointer the caching allocator did not align costs the op a copy.
    if not H.is_contiguous() or H.storage_offset() * H.element_size() % 16:
        return False
    for m, shape in ((q_mask, (Nq, Lq)), (d_mask, (Nd, Ld))):
        if m is not None and (m.dtype != torch.bool or tuple(m.shape) != shape or m.device != Q3.device):
            return False
    return _sm90(Q3.device.index if Q3.device.index is not None else torch.cuda.current_device())


def maxsim_from_hidden(Q: Tensor, H: Tensor, W: Tensor, b: Optional[Tensor] = None,
                       d_mask: Optional[Tensor] = None, *, q_mask: Optional[Tensor] = None,
                       normalize: bool = True, chunk_mib: int = 256) -> Tensor:
    """MaxSim of ``Q [Nq, Lq, d_out]`` (already projected; ``[Lq, d_out]``
    for one query) against documents given as hidden states ``H [Nd, Ld,
    d_model]`` (every query x every document -> ``[Nq, Nd]``) or ``H [Nq, K,
    Ld, d_model]`` (each query's own K candidates -> ``[Nq, K]``) and the
    head ``W [d_out, d_model]``, ``b [d_out]`` (the ``torch.nn.Linear``
    convention): the same as
    ``maxsim(Q, F.normalize(F.linear(H, W, b), dim=-1), q_mask, d_mask)``
    (without the normalisation when ``normalize=False``; ``Q`` is used as
    given). The projected tokens take ``Q``'s dtype. Returns fp32 (``[Nd]``
    for a 2-D Q).
    """
    check_float("Q", Q)
    check_float("H", H)
    single = Q.dim() == 2
    Q3 = Q[None] if single else Q
    candidates = H.dim() == 4
    if Q3.dim() != 3 or H.dim() not in (3, 4) or (candidates and (single or H.shape[0] != Q3.shape[0])):
        raise ValueError("Q must be [Nq, Lq, d_out] and H [Nd, Ld, d_model] or [Nq, K, Ld, d_model] "
                         f"(a 2-D Q with a 3-D H only); got {tuple(Q.shape)}, {tuple(H.shape)}")
    if W.dim() != 2 or W.shape != (Q3.shape[-1], H.shape[-1]):
        raise ValueError(f"W must be [d_out={Q3.shape[-1]}, d_model={H.shape[-1]}], got {tuple(W.shape)}")
    if b is not None and b.shape != (Q3.shape[-1],):
        raise ValueError(f"b must be [d_out={Q3.shape[-1]}], got {tuple(b.shape)}")
    if q_mask is not None and single:
        q_mask = q_mask[None]
    # Chunks over documents (shared) or over queries with their candidates.
    n = H.shape[0]
    row_bytes = max(math.prod(H.shape[1:-1]) * max(Q3.shape[-1], 1) * 4, 1)
    per = max(1, (chunk_mib << 20) // row_bytes)
    train = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (Q3, H, W, b))
    Lq, Ld = Q3.shape[1], H.shape[-2]
    group = Lq if candidates else Q3.shape[0] * Lq  # winners a document (or candidate) gets
    if train and group <= _WINNERS_PER_ROW * Ld:
        # Chunks over documents (or each query's candidates, side by side).
        rows_per_step = Ld * (Q3.shape[0] if candidates else 1)
        per = max(1, (chunk_mib << 20) // max(rows_per_step * Q3.shape[-1] * 4, 1))
        # A winner's backward holds its hidden row twice (gathered, and its
        # gradient projected back) and a few rows of d_out.
        entry_bytes = (H.shape[-1] * 2 + Q3.shape[-1] * 2) * H.element_size() + Q3.shape[-1] * 8
        per_backward = max(1, (chunk_mib << 20) // max(Q3.shape[0] * Lq * entry_bytes, 1))
        fused = not candidates and _fused_ok(Q3, H, W, b, q_mask, d_mask)
        out = _HeadFromWinners.apply(Q3, H, W, b, q_mask, d_mask, normalize, per, per_backward, fused)
        return out[0] if single else out
    fused = not train and not candidates and _fused_ok(Q3, H, W, b, q_mask, d_mask)
    parts = []
    for n0 in range(0, max(n, 1), per):
        n1 = min(n, n0 + per)
        # One chunk takes the tensors themselves: a whole-tensor slice would
        # cost the backward a zero fill and a copy of the hidden states' size.
        cut = (lambda t: t) if n1 - n0 == n else (lambda t: t[n0:n1])
        Hc = cut(H)
        mc = None if d_mask is None else cut(d_mask)
        Qc, qm = (cut(Q3), None if q_mask is None else cut(q_mask)) if candidates else (Q3, q_mask)
        if fused:
            parts.append(ops.head_forward(Qc, Hc, W, b, qm, mc, normalize, False)[0])
        elif train and n1 - n0 < n:
            parts.append(checkpoint(_chunk_scores, Qc, Hc, W, b, qm, mc, normalize, use_reentrant=False))
        else:
            parts.append(_chunk_scores(Qc, Hc, W, b, qm, mc, normalize))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0 if candidates else 1)
    return out[0] if single else out


def maxsim_from_hidden_reference(Q: Tensor, H: Tensor, W: Tensor, b: Optional[Tensor] = None,
                                 d_mask: Optional[Tensor] = None, *, q_mask: Optional[Tensor] = None,
                                 normalize: bool = True) -> Tensor:
    """fp64 reference of :func:`maxsim_from_hidden` (differentiable)."""
    single = Q.dim() == 2
    q = (Q[None] if single else Q).double()
    D = F.linear(H.double(), W.double(), None if b is None else b.double())
    if normalize:
        D = D / D.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    if D.dim() == 4:  # each query's own candidates
        s = torch.einsum("isd,intd->inst", q, D)
        if d_mask is not None:
            s = s.masked_fill(~d_mask[:, :, None, :], float("-inf"))
    else:
        s = torch.einsum("isd,ntd->inst", q, D)
        if d_mask is not None:
            s = s.masked_fill(~d_mask[None, :, None, :], float("-inf"))
    m = s.amax(-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    if q_mask is not None:
        m = m * (q_mask if not single else q_mask[None])[:, None, :].double()
    out = m.sum(-1)
    return out[0] if single else out
