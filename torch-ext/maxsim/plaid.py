"""PLAID / ColBERTv2 residual-compressed documents.

A document token is stored as a centroid code (int32) plus ``nbits`` (2, 4
or 8) bits per feature: the bucket of the residual ``token - centroid``,
packed ``8 / nbits`` to a byte with the first feature in the lowest bits
(the layout late-interaction-kernels' PLAID kernels read;
``ceil(d * nbits / 8)`` bytes a token). A token decompresses to the fp32 sum
``centroids[code] + bucket_weights[bucket]`` per feature; the compiled ops
(``plaid_approx``, ``plaid_forward``, ``plaid_backward``; contract in
``torch_binding.h``) decompress in registers / shared memory and produce the
same bits as :func:`decompress`.

This module holds the codec (:func:`kmeans`, :func:`bucket_params`,
:func:`compress`, :func:`pack` / :func:`unpack`, :func:`decompress`), the
scoring functions (:func:`approx_scores`, :func:`maxsim_residual`,
:func:`maxsim_residual_varlen`), fp64 references, and :class:`PlaidIndex`,
the compressed store behind ``Corpus(..., quantization="plaid")``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._ops import add_op_namespace_prefix, ops
from ._registry import meta_kernel, register_fallbacks, warn_fallback

Tensor = torch.Tensor
NBITS = (2, 4, 8)

PLAID_APPROX = add_op_namespace_prefix("plaid_approx")
PLAID_FORWARD = add_op_namespace_prefix("plaid_forward")
PLAID_BACKWARD = add_op_namespace_prefix("plaid_backward")

__all__ = [
    "PlaidIndex",
    "approx_scores",
    "approx_scores_reference",
    "bucket_params",
    "compress",
    "decompress",
    "kmeans",
    "maxsim_residual",
    "maxsim_residual_reference",
    "maxsim_residual_varlen",
    "pack",
    "packed_bytes",
    "unpack",
]


def _check_nbits(nbits: int) -> int:
    if nbits not in NBITS:
        raise ValueError(f"nbits must be 2, 4 or 8, got {nbits!r}")
    return int(nbits)


def packed_bytes(dim: int, nbits: int) -> int:
    """Bytes of one token's packed residual: ``ceil(dim * nbits / 8)``."""
    return (dim * _check_nbits(nbits) + 7) // 8


# -- codec ---------------------------------------------------------------------

def pack(buckets: Tensor, nbits: int) -> Tensor:
    """Buckets ``[..., d]`` (ints in ``[0, 2^nbits)``) -> ``uint8 [..., ceil(d * nbits / 8)]``,
    feature f in bits ``(f % (8 / nbits)) * nbits`` of byte ``f // (8 / nbits)``."""
    per = 8 // _check_nbits(nbits)
    d = buckets.shape[-1]
    width = packed_bytes(d, nbits) * per
    b = buckets.to(torch.int32) & ((1 << nbits) - 1)
    if width != d:
        b = F.pad(b, (0, width - d))
    b = b.reshape(*b.shape[:-1], width // per, per)
    shifts = torch.arange(per, device=b.device, dtype=torch.int32) * nbits
    return (b << shifts).sum(-1).to(torch.uint8)


def unpack(residuals: Tensor, nbits: int, dim: int) -> Tensor:
    """Inverse of :func:`pack`: ``uint8 [..., P]`` -> int64 buckets ``[..., dim]``."""
    per = 8 // _check_nbits(nbits)
    shifts = torch.arange(per, device=residuals.device, dtype=torch.int32) * nbits
    b = (residuals.to(torch.int32)[..., None] >> shifts) & ((1 << nbits) - 1)
    return b.reshape(*residuals.shape[:-1], -1)[..., :dim].to(torch.int64)


def decompress(codes: Tensor, residuals: Tensor, centroids: Tensor, bucket_weights: Tensor, nbits: int) -> Tensor:
    """The reference decompression: fp32 tokens ``[..., d]``,
    ``centroids[code] + bucket_weights[bucket]`` (a code outside
    ``[0, C)`` reads centroid 0, as the kernels do)."""
    cent = centroids.float()
    c = codes.long()
    c = torch.where((c >= 0) & (c < cent.shape[0]), c, 0)
    return cent[c] + bucket_weights.float()[unpack(residuals, nbits, cent.shape[1])]


def _rows_per_chunk(n_centroids: int) -> int:
    """Rows scored against every centroid at once: ~2^28 scores (1 GiB fp32)."""
    return max(256, (1 << 28) // max(n_centroids, 1))


def kmeans(x: Tensor, k: int, *, iters: int = 10, seed: int = 0) -> Tensor:
    """Spherical k-means of the rows of ``x [T, d]`` on ``x``'s device (as
    ColBERTv2 trains its centroids): ``k`` unit-norm fp32 centroids ``[k, d]``,
    seeded with ``k`` distinct rows; an emptied cluster keeps its centroid."""
    if x.dim() != 2 or x.shape[0] == 0:
        raise ValueError("kmeans needs a non-empty [T, d] tensor")
    k = min(int(k), x.shape[0])
    g = torch.Generator(device="cpu").manual_seed(seed)
    xs = F.normalize(x.float(), dim=-1)
    cent = xs[torch.randperm(x.shape[0], generator=g)[:k].to(x.device)].clone()
    chunk = _rows_per_chunk(k)
    for _ in range(iters):
        sums = torch.zeros_like(cent)
        counts = torch.zeros(k, device=x.device, dtype=torch.float32)
        for r0 in range(0, xs.shape[0], chunk):
            part = xs[r0:r0 + chunk]
            a = (part @ cent.T).argmax(1)
            sums.index_add_(0, a, part)
            counts.index_add_(0, a, torch.ones_like(a, dtype=torch.float32))
        keep = counts == 0
        cent = torch.where(keep[:, None], cent, F.normalize(sums, dim=-1))
    return cent


def nearest_centroid(x: Tensor, centroids: Tensor) -> Tensor:
    """int32 codes ``[T]``: the centroid of largest inner product with each row."""
    cent = centroids.float()
    chunk = _rows_per_chunk(cent.shape[0])
    out = [(x[r0:r0 + chunk].float() @ cent.T).argmax(1) for r0 in range(0, x.shape[0], chunk)]
    return torch.cat(out).to(torch.int32) if out else x.new_empty((0,), dtype=torch.int32)


def bucket_params(residual_sample: Tensor, nbits: int) -> tuple[Tensor, Tensor]:
    """ColBERTv2's buckets from a sample of residual values: cutoffs
    ``[2^nbits - 1]`` at the quantiles ``j / 2^nbits`` and weights ``[2^nbits]``
    at the quantiles ``(j + 1/2) / 2^nbits`` (fp32)."""
    n = 1 << _check_nbits(nbits)
    v = residual_sample.float().reshape(-1)
    if v.numel() > (1 << 24):  # torch.quantile's input limit
        v = v[torch.randperm(v.numel(), device=v.device)[: 1 << 24]]
    grid = torch.arange(n, device=v.device, dtype=torch.float32)
    cutoffs = torch.quantile(v, grid[1:] / n)
    weights = torch.quantile(v, (grid + 0.5) / n)
    return cutoffs, weights


def compress(x: Tensor, centroids: Tensor, bucket_cutoffs: Tensor, nbits: int) -> tuple[Tensor, Tensor]:
    """Tokens ``x [T, d]`` -> (codes int32 [T], residuals uint8 [T, P]):
    the nearest centroid by inner product and the bucket of each residual
    feature (``searchsorted`` on the cutoffs, right side)."""
    _check_nbits(nbits)
    codes = nearest_centroid(x, centroids)
    cut = bucket_cutoffs.float().contiguous()
    chunk = 1 << 18
    parts = []
    for r0 in range(0, x.shape[0], chunk):
        r = x[r0:r0 + chunk].float() - centroids.float()[codes[r0:r0 + chunk].long()]
        parts.append(pack(torch.bucketize(r, cut, right=True), nbits))
    res = torch.cat(parts) if parts else x.new_empty((0, packed_bytes(x.shape[1], nbits)), dtype=torch.uint8)
    return codes, res


# -- op plumbing: fake kernels, references for devices without a kernel --------

@meta_kernel(PLAID_APPROX)
def _approx_fake(qcs, codes, d_start, d_len, keep=None):
    return qcs.new_empty((qcs.shape[0], d_start.shape[0]), dtype=torch.float32)


@meta_kernel(PLAID_FORWARD)
def _forward_fake(q, codes, residuals, centroids, bucket_weights, d_start, d_len, pair_q, nbits, normalize, argmax):
    nq, lq, nd = q.shape[0], q.shape[1], d_start.shape[0]
    shape = (nd,) if pair_q is not None else (nq, nd)
    am = q.new_empty(shape + (lq,), dtype=torch.int32) if argmax else q.new_empty((0,), dtype=torch.int32)
    return q.new_empty(shape), am


@meta_kernel(PLAID_BACKWARD)
def _backward_fake(grad, q, codes, residuals, centroids, bucket_weights, d_start, d_len, argmax, nbits, normalize):
    return torch.empty_like(q)


def _padded_tokens(values: Tensor, d_start: Tensor, d_len: Tensor, fill) -> tuple[Tensor, Tensor]:
    """Rows of every document as a padded block [Nd, L, ...] and its mask."""
    ln = d_len.long().clamp(min=0)
    L = int(ln.max()) if ln.numel() else 0
    cols = torch.arange(max(L, 1), device=values.device)
    valid = cols[None, :] < ln[:, None]
    rows = torch.where(valid, d_start.long()[:, None] + cols[None, :], 0)
    if values.shape[0] == 0:
        return values.new_full(rows.shape + values.shape[1:], fill), valid
    return values[rows.clamp(0, values.shape[0] - 1)], valid


def _reference_approx(qcs, codes, d_start, d_len, keep=None):
    if qcs.dtype in (torch.float16, torch.bfloat16):
        qcs = qcs.float()  # exact; the sums in fp32 as the kernels do
    nq, C, _ = qcs.shape
    c = codes.long()
    c = torch.where((c >= 0) & (c < C), c, 0)
    cc, valid = _padded_tokens(c, d_start, d_len, 0)  # [Nd, L]
    g = qcs[:, cc] if C else qcs.new_zeros((nq,) + cc.shape + (qcs.shape[2],))  # [Nq, Nd, L, Lq]
    live = valid[None].expand(nq, -1, -1)
    if keep is not None and C:
        live = live & (keep[:, cc] != 0)  # [Nq, Nd, L]: tokens of kept centroids
    g = g.masked_fill(~live[..., None], float("-inf")).amax(2)
    return torch.where(live.any(2)[..., None], g, 0.0).sum(-1).float()


def _reference_forward(q, codes, residuals, centroids, bucket_weights, d_start, d_len, pair_q, nbits, normalize,
                       argmax):
    tok = decompress(codes, residuals, centroids, bucket_weights, nbits)
    if normalize:
        tok = tok / tok.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    dt, valid = _padded_tokens(tok, d_start, d_len, 0.0)  # [Nd, L, d]
    if pair_q is not None:
        s = torch.einsum("nsd,ntd->nst", q[pair_q.long()], dt)
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
    else:
        s = torch.einsum("isd,ntd->inst", q, dt)
        s = s.masked_fill(~valid[None, :, None, :], float("-inf"))
    m, a = s.max(-1)
    has = torch.isfinite(m)
    scores = torch.where(has, m, 0.0).sum(-1).float()
    am = torch.where(has, a, -1).to(torch.int32) if argmax else q.new_empty((0,), dtype=torch.int32)
    return scores, am


def _reference_backward(grad, q, codes, residuals, centroids, bucket_weights, d_start, d_len, argmax, nbits,
                        normalize):
    tok = decompress(codes, residuals, centroids, bucket_weights, nbits)
    if normalize:
        tok = tok / tok.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    ok = argmax >= 0
    rows = torch.where(ok, d_start.long()[None, :, None] + argmax.long(), 0)
    win = tok[rows.clamp(0, max(tok.shape[0] - 1, 0))] if tok.shape[0] else q.new_zeros(rows.shape + q.shape[-1:])
    return torch.einsum("in,insd->isd", grad, win * ok[..., None]).float()


def _served_by(name: str, fn):
    """``fn`` as an op's fallback kernel: warns, then runs the reference."""
    def impl(*args):
        warn_fallback(name, args[0].device.type)
        return fn(*args)
    return impl


register_fallbacks(((PLAID_APPROX, _served_by("plaid_approx", _reference_approx)),
                    (PLAID_FORWARD, _served_by("plaid_forward", _reference_forward)),
                    (PLAID_BACKWARD, _served_by("plaid_backward", _reference_backward))))


# -- scoring -------------------------------------------------------------------

def _segments_padded(codes: Tensor, doc_lengths: Tensor) -> tuple[Tensor, Tensor]:
    Nd, L = codes.shape
    st = torch.arange(Nd, device=codes.device, dtype=torch.int32) * L
    ln = doc_lengths.to(codes.device).clamp(0, L).to(torch.int32)
    return st, ln


def _segments_varlen(cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    cu = cu_seqlens.to(torch.int32)
    return cu[:-1].contiguous(), (cu[1:] - cu[:-1]).contiguous()


def _table(centroids: Tensor, bucket_weights: Tensor, nbits: int) -> tuple[Tensor, Tensor]:
    if bucket_weights.shape != (1 << _check_nbits(nbits),):
        raise ValueError(f"bucket_weights must be [{1 << nbits}] for nbits={nbits}, got {tuple(bucket_weights.shape)}")
    return centroids.float().contiguous(), bucket_weights.float().contiguous()


class _ResidualFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qn, codes, residuals, centroids, bucket_weights, d_start, d_len, nbits, normalize):
        scores, argmax = ops.plaid_forward(qn, codes, residuals, centroids, bucket_weights, d_start, d_len, None,
                                           nbits, normalize, True)
        ctx.save_for_backward(qn, codes, residuals, centroids, bucket_weights, d_start, d_len, argmax)
        ctx.nbits, ctx.normalize = nbits, normalize
        ctx.mark_non_differentiable(argmax)
        return scores

    @staticmethod
    def backward(ctx, grad):
        qn, codes, residuals, centroids, bucket_weights, d_start, d_len, argmax = ctx.saved_tensors
        dq = ops.plaid_backward(grad.float().contiguous(), qn, codes, residuals, centroids, bucket_weights, d_start,
                                d_len, argmax, ctx.nbits, ctx.normalize)
        return (dq,) + (None,) * 8


def _score(Q, codes, residuals, d_start, d_len, centroids, bucket_weights, nbits, normalize, train: bool):
    single = Q.dim() == 2
    Q3 = Q[None] if single else Q
    if Q3.dim() != 3 or Q3.shape[-1] != centroids.shape[1]:
        raise ValueError(f"Q must be [Lq, d] or [Nq, Lq, d] with d = {centroids.shape[1]}, got {tuple(Q.shape)}")
    cent, bw = _table(centroids, bucket_weights, nbits)
    qn = Q3.float()
    if normalize:
        qn = qn / qn.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    qn = qn.contiguous()
    args = (codes, residuals, cent, bw, d_start, d_len)
    if train and torch.is_grad_enabled() and qn.requires_grad:
        out = _ResidualFn.apply(qn, *args, nbits, normalize)
    else:
        out, _ = ops.plaid_forward(qn, *args, None, nbits, normalize, False)
    return out[0] if single else out


def maxsim_residual(Q: Tensor, codes: Tensor, residuals: Tensor, doc_lengths: Tensor, centroids: Tensor,
                    bucket_weights: Tensor, nbits: int, *, normalize: bool = True) -> Tensor:
    """MaxSim of ``Q [Nq, Lq, d]`` (or ``[Lq, d]``) against padded compressed
    documents: ``codes [Nd, L]`` (int32), ``residuals [Nd, L, P]`` (uint8),
    ``doc_lengths [Nd]`` (tokens past a length are ignored; 0 = empty, scores
    0), ``centroids [C, d]``, ``bucket_weights [2^nbits]``. With ``normalize``
    the queries and the decompressed tokens are L2-normalised. Returns fp32
    ``[Nq, Nd]`` (``[Nd]`` for a 2-D Q), accumulated in fp32; differentiable
    in ``Q``."""
    if codes.dim() != 2 or residuals.dim() != 3 or residuals.shape[:2] != codes.shape:
        raise ValueError("codes must be [Nd, L] and residuals [Nd, L, P]")
    st, ln = _segments_padded(codes, doc_lengths)
    flat_c = codes.reshape(-1).to(torch.int32).contiguous()
    flat_r = residuals.reshape(-1, residuals.shape[-1]).contiguous()
    return _score(Q, flat_c, flat_r, st, ln, centroids, bucket_weights, nbits, normalize, True)


def maxsim_residual_varlen(Q: Tensor, codes: Tensor, residuals: Tensor, cu_seqlens: Tensor, centroids: Tensor,
                           bucket_weights: Tensor, nbits: int, *, normalize: bool = True) -> Tensor:
    """:func:`maxsim_residual` on the flat layout ColBERTv2 and fast-plaid
    write: ``codes [T]``, ``residuals [T, P]``, document n = tokens
    ``cu_seqlens[n] .. cu_seqlens[n+1]-1``. No host sync, no padding;
    differentiable in ``Q``."""
    if codes.dim() != 1 or residuals.dim() != 2 or residuals.shape[0] != codes.shape[0]:
        raise ValueError("codes must be [T] and residuals [T, P]")
    st, ln = _segments_varlen(cu_seqlens)
    return _score(Q, codes.to(torch.int32).contiguous(), residuals.contiguous(), st, ln, centroids, bucket_weights,
                  nbits, normalize, True)


def approx_scores(query_centroid_scores: Tensor, codes: Tensor, doc_lengths: Optional[Tensor] = None, *,
                  cu_seqlens: Optional[Tensor] = None, keep: Optional[Tensor] = None) -> Tensor:
    """PLAID's approximate scores: ``sum_s max_t qcs[codes[t], s]`` over each
    document's tokens. ``query_centroid_scores``: ``[C, Lq]`` (one query,
    e.g. ``centroids @ Q.T``) or ``[Nq, C, Lq]``; ``codes [Nd, L]`` with
    ``doc_lengths [Nd]``, or flat ``codes [T]`` with ``cu_seqlens [Nd+1]``.
    An empty document scores 0. ``keep`` (bool ``[C]`` / ``[Nq, C]``,
    PLAID's centroid pruning, e.g. ``qcs.amax(-1) >= 0.45``): only tokens of
    kept centroids count (the scan skips the others' score rows), and a
    query token that no kept token reaches adds 0. An fp16 / bf16 table is
    scanned as it is (half the bytes of fp32: the scan is bound by its
    gathers); other dtypes are cast to fp32. Returns fp32 ``[Nd]`` or
    ``[Nq, Nd]``."""
    qcs = query_centroid_scores
    single = qcs.dim() == 2
    qcs = qcs[None] if single else qcs
    if qcs.dtype not in (torch.float16, torch.bfloat16):
        qcs = qcs.float()
    qcs = qcs.contiguous()
    if keep is not None:
        keep = (keep[None] if keep.dim() == 1 else keep).to(torch.uint8).expand(qcs.shape[0], -1).contiguous()
    if cu_seqlens is not None:
        st, ln = _segments_varlen(cu_seqlens)
        flat = codes
    else:
        if codes.dim() != 2 or doc_lengths is None:
            raise ValueError("padded codes [Nd, L] need doc_lengths [Nd] (or pass flat codes with cu_seqlens)")
        st, ln = _segments_padded(codes, doc_lengths)
        flat = codes.reshape(-1)
    out = ops.plaid_approx(qcs, flat.to(torch.int32).contiguous(), st, ln, keep)
    return out[0] if single else out


# -- fp64 references -------------------------------------------------------------

def approx_scores_reference(query_centroid_scores: Tensor, codes: Tensor, doc_lengths: Tensor,
                            keep: Optional[Tensor] = None) -> Tensor:
    """Dense fp64 reference of :func:`approx_scores` (padded codes)."""
    qcs = query_centroid_scores.double()
    single = qcs.dim() == 2
    qcs = qcs[None] if single else qcs
    if keep is not None:
        keep = (keep[None] if keep.dim() == 1 else keep).expand(qcs.shape[0], -1)
    st, ln = _segments_padded(codes, doc_lengths)
    out = _reference_approx(qcs, codes.reshape(-1), st, ln, keep).double()
    return out[0] if single else out


def maxsim_residual_reference(Q: Tensor, codes: Tensor, residuals: Tensor, doc_lengths: Tensor, centroids: Tensor,
                              bucket_weights: Tensor, nbits: int, *, normalize: bool = True) -> Tensor:
    """fp64 reference of :func:`maxsim_residual` (differentiable in Q):
    decompress with :func:`decompress`, normalise, dense MaxSim."""
    single = Q.dim() == 2
    q = (Q[None] if single else Q).double()
    tok = decompress(codes, residuals, centroids, bucket_weights, nbits).double()  # [Nd, L, d]
    if normalize:
        q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        tok = tok / tok.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    L = codes.shape[1]
    valid = torch.arange(L, device=codes.device)[None, :] < doc_lengths.to(codes.device)[:, None]
    s = torch.einsum("isd,ntd->inst", q, tok).masked_fill(~valid[None, :, None, :], float("-inf"))
    m = s.amax(-1)
    out = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).sum(-1)
    return out[0] if single else out


# -- the compressed store ----------------------------------------------------------

class PlaidIndex:
    """A compressed collection: ``codes [T]`` int32, ``residuals [T, P]``
    uint8, ``centroids [C, d]`` fp32, ``bucket_weights [2^nbits]`` (and the
    cutoffs when built here), documents as ``starts`` / ``lengths`` int32
    ``[N]``, and the inverted lists (centroid -> documents, CSR) that
    :func:`search` probes."""

    def __init__(self, codes: Tensor, residuals: Tensor, centroids: Tensor, bucket_weights: Tensor, nbits: int,
                 starts: Tensor, lengths: Tensor, bucket_cutoffs: Optional[Tensor] = None):
        self.nbits = _check_nbits(nbits)
        self.codes = codes if codes.dtype == torch.int32 else codes.to(torch.int32)
        self.residuals = residuals
        self.centroids, self.bucket_weights = _table(centroids, bucket_weights, nbits)
        self.bucket_cutoffs = bucket_cutoffs
        self.starts = starts.to(torch.int32)
        self.lengths = lengths.to(torch.int32)
        self.dim = self.centroids.shape[1]
        if residuals.dim() != 2 or residuals.shape != (codes.shape[0], packed_bytes(self.dim, nbits)):
            raise ValueError(f"residuals must be uint8 [T, {packed_bytes(self.dim, nbits)}] for d={self.dim}, "
                             f"nbits={nbits}; got {tuple(residuals.shape)}")
        self._ivf = None

    @classmethod
    def build(cls, tokens: Tensor, starts: Tensor, lengths: Tensor, nbits: int, *, centroids: Optional[Tensor] = None,
              num_centroids: Optional[int] = None, kmeans_iters: int = 10, sample: Optional[int] = None,
              seed: int = 0) -> "PlaidIndex":
        """Compress ``tokens [T, d]`` (on their device): k-means centroids
        (``num_centroids``, default ``2^round(log2(16 sqrt(T)))`` as ColBERTv2,
        trained on ``sample`` tokens, default ``max(2^18, 16 x centroids)``)
        unless given, buckets from the residuals of the sample, then codes and
        packed residuals."""
        import math

        _check_nbits(nbits)
        T = tokens.shape[0]
        k = num_centroids or 2 ** max(1, round(math.log2(16 * math.sqrt(max(T, 1)))))
        # A few sample tokens per centroid leave most centroids on single
        # tokens and the residuals larger: 16 per centroid at least.
        sample = sample or max(1 << 18, 16 * k)
        g = torch.Generator(device="cpu").manual_seed(seed)
        pick = torch.randperm(T, generator=g)[: min(T, sample)].to(tokens.device)
        train = tokens[pick].float()
        if centroids is None:
            centroids = kmeans(train, k, iters=kmeans_iters, seed=seed)
        centroids = centroids.to(tokens.device).float()
        r = train - centroids[nearest_centroid(train, centroids).long()]
        cutoffs, weights = bucket_params(r, nbits)
        codes, res = compress(tokens, centroids, cutoffs, nbits)
        return cls(codes, res, centroids, weights, nbits, starts, lengths, bucket_cutoffs=cutoffs)

    @property
    def bytes_per_token(self) -> float:
        return 4 + self.residuals.shape[1]

    def decompress(self) -> Tensor:
        """Every token, decompressed (fp32 [T, d]); for tests and exports."""
        return decompress(self.codes, self.residuals, self.centroids, self.bucket_weights, self.nbits)

    def ivf(self) -> tuple[Tensor, Tensor]:
        """Inverted lists: (ptr [C+1] int64, docs [E] int64), the documents
        holding a token of each centroid, ascending. Built once (host syncs)."""
        if self._ivf is None:
            C = self.centroids.shape[0]
            lens = self.lengths.long().clamp(min=0)
            doc = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
            base = self.starts.long() - (torch.cumsum(lens, 0) - lens)
            rows = torch.arange(doc.numel(), device=lens.device) + base[doc]
            pairs = torch.unique(self.codes.long()[rows].clamp(0, max(C - 1, 0)) * max(lens.numel(), 1) + doc)
            cent = pairs // max(lens.numel(), 1)
            ptr = torch.zeros(C + 1, dtype=torch.int64, device=pairs.device)
            ptr[1:] = torch.cumsum(torch.bincount(cent, minlength=C), 0)
            self._ivf = (ptr, pairs % max(lens.numel(), 1))
        return self._ivf

    def to(self, device) -> "PlaidIndex":
        out = PlaidIndex(self.codes.to(device), self.residuals.to(device), self.centroids.to(device),
                         self.bucket_weights.to(device), self.nbits, self.starts.to(device), self.lengths.to(device),
                         None if self.bucket_cutoffs is None else self.bucket_cutoffs.to(device))
        return out

    def search(self, Q: Tensor, k: int, *, query_mask: Optional[Tensor] = None, nprobe: Optional[int] = None,
               candidates: Optional[int] = None, rerank: Optional[str] = "decompressed",
               originals=None, centroid_threshold: Optional[float] = None) -> tuple[Tensor, Tensor]:
        """See :func:`maxsim.search` on a ``quantization="plaid"`` corpus."""
        N = self.starts.numel()
        Nq, Lq, _ = Q.shape
        qn = Q.float()
        qn = qn / qn.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        if query_mask is not None:
            qn = qn * query_mask[..., None].to(qn.dtype)
        qn = qn.contiguous()
        qcs = torch.matmul(self.centroids, qn.transpose(1, 2)).contiguous()  # [Nq, C, Lq]
        keep = None
        if centroid_threshold is not None:
            # PLAID's centroid pruning: a centroid no query token scores at
            # least the threshold with is skipped by the scan.
            keep = (qcs.amax(2) >= centroid_threshold).to(torch.uint8)
        # The scan gathers one score row per token: an fp16 table halves its
        # bytes, and fp16's 11 bits only reorder near-ties the rerank settles.
        approx = ops.plaid_approx(qcs.half(), self.codes, self.starts, self.lengths, keep)  # [Nq, N]
        if nprobe is not None and nprobe < self.centroids.shape[0]:
            # IVF: only documents holding a token of one of the nprobe best
            # centroids of some query token stay candidates.
            ptr, docs = self.ivf()
            probe = qcs.topk(nprobe, dim=1).indices.reshape(Nq, -1)  # [Nq, nprobe * Lq]
            lo, hi = ptr[probe], ptr[probe + 1]
            cnt = (hi - lo).reshape(-1)
            total = int(cnt.sum())  # one host sync: the size of the gathered lists
            owner = torch.repeat_interleave(torch.arange(cnt.numel(), device=cnt.device), cnt, output_size=total)
            pos = torch.arange(total, device=cnt.device) - (torch.cumsum(cnt, 0) - cnt)[owner] + lo.reshape(-1)[owner]
            keep = torch.zeros(Nq, N, dtype=torch.bool, device=approx.device)
            keep[owner // probe.shape[1], docs[pos]] = True
            approx = approx.masked_fill(~keep, float("-inf"))
        nc = min(N, candidates or max(4 * k, 64))
        cand = approx.topk(nc, dim=1).indices  # [Nq, nc]
        first = approx.gather(1, cand)
        # a document no probe reached: an empty slot, (-inf, -1)
        ids = torch.where(torch.isneginf(first), -1, cand)
        if rerank is None:
            return ops.decode_keys(ops.block_topk(first, 0, min(k, nc), ids))
        flat = cand.reshape(-1)
        pair_q = torch.arange(Nq, device=cand.device, dtype=torch.int32).repeat_interleave(nc)
        if rerank == "decompressed":
            exact, _ = ops.plaid_forward(qn, self.codes, self.residuals, self.centroids, self.bucket_weights,
                                         self.starts[flat].contiguous(), self.lengths[flat].contiguous(), pair_q,
                                         self.nbits, True, False)
        else:
            exact = originals(Q, query_mask, flat, pair_q)
        return ops.decode_keys(ops.block_topk(exact.view(Nq, nc).float(), 0, min(k, nc), ids))
