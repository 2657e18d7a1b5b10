"""Exact MaxSim top-k search over a packed corpus, in bounded memory.

``search(Q, corpus, k)`` scores every query against every document of a
:class:`Corpus` block by block with the compiled forward op and keeps a
running top-k per query, so no more than ``Nq x block`` scores exist at once
(never the full ``[Nq, Nd]`` matrix). Each (score, document id) is packed into
one int64 key whose order is "higher score, then lower id", which makes the
top-k exact and deterministic with ``torch.topk`` (no tie ambiguity) and lets
partial results from blocks, streams or ranks merge by another ``topk``.

A corpus lives on the GPU, in pinned host memory (streamed to the GPU in
chunks on a copy stream, double-buffered against the scoring of the previous
chunk) or on the CPU (CPU kernels); it may be stored as int8 (per-token
symmetric scales, scored exactly in int32 on int8 tensor cores) or fp8 e4m3
(one scale per document, fp8 tensor cores on sm_89+), in which case the
queries are quantised per token. A quantised corpus may keep its original
tokens (``rescore=``, e.g. on the host) so that :func:`search` re-scores the
best ``oversample x k`` candidates of the compressed scan exactly.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from ._registry import ops
from .reference import CROSS, GROUPED
from .scoring import _padded_segments

Tensor = torch.Tensor
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INT64_MIN = -(1 << 63)
_NAN_ORD = -(1 << 31)  # below the order code of -inf: NaN scores rank last
_LOW = (1 << 32) - 1
_SCORE_BUDGET = 1 << 23  # scores (Nq x docs) held at once per block
_QKIND = {"int8": 0, "fp8": 1}  # ops.quantize's kind

__all__ = ["Corpus", "search", "quantize_tokens", "merge_topk", "encode_keys", "decode_keys"]


# ----------------------------------------------------------------------------
# (score, id) <-> ordered int64 key
# ----------------------------------------------------------------------------

def encode_keys(scores: Tensor, ids: Tensor) -> Tensor:
    """int64 keys ordered by (score descending, id ascending); NaN ranks below
    every number; id -1 marks an empty slot, which ranks below everything."""
    s = scores.to(torch.float32) + 0.0  # -0.0 -> +0.0: equal scores get equal codes
    bits = s.view(torch.int32).to(torch.int64)
    order = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    order = torch.where(torch.isnan(s), _NAN_ORD, order)
    ids = ids.to(torch.int64)
    keys = order * (1 << 32) + (_LOW - ids)
    return torch.where(ids < 0, _INT64_MIN, keys)


def decode_keys(keys: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`encode_keys`: (fp32 scores, int64 ids); empty slots
    come back as (-inf, -1)."""
    order = keys >> 32
    ids = _LOW - (keys & _LOW)
    bits = torch.where(order >= 0, order, order ^ 0x7FFFFFFF).to(torch.int32)
    scores = bits.view(torch.float32)
    scores = torch.where(order == _NAN_ORD, float("nan"), scores)
    empty = keys == _INT64_MIN
    return torch.where(empty, float("-inf"), scores), torch.where(empty, -1, ids)


def merge_topk(keys: Tensor, k: int) -> Tensor:
    """Top-k keys along dim 1 (descending), padded with empty slots when fewer."""
    if keys.shape[1] < k:
        pad = keys.new_full((keys.shape[0], k - keys.shape[1]), _INT64_MIN)
        keys = torch.cat([keys, pad], dim=1)
    return keys.topk(k, dim=1).values


# ----------------------------------------------------------------------------
# quantisation
# ----------------------------------------------------------------------------

def quantize_tokens(x: Tensor, kind: str, scales: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Per-token symmetric quantisation of ``x [T, d]``.

    ``kind`` is ``"int8"`` (round to nearest even, [-127, 127]) or ``"fp8"``
    (float8_e4m3fn, the row's max magnitude mapped to 448). The dim is
    zero-padded to a multiple of 16 (exact: zero columns add nothing).
    Returns ``(values [T, d_pad], scales [T] fp32)``; row r stands for
    ``scales[r] * values[r]`` (an all-zero row gets scale 1). ``scales [T]``
    (positive, on x's device), when given, are used instead of each row's
    own (values saturate as above), e.g. one scale per document. One kernel
    on CPU and CUDA (``ops.quantize``), no fp32 temporary.
    """
    if kind not in _QKIND:
        raise ValueError(f"quantization must be 'int8' or 'fp8', got {kind!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _FLOATS:
        raise TypeError("quantize_tokens expects a float [T, d] tensor")
    if scales is not None:
        if not isinstance(scales, torch.Tensor) or scales.dim() != 1 or scales.shape[0] != x.shape[0]:
            raise ValueError(f"scales must be a [T] tensor with T = {x.shape[0]}")
        if scales.device != x.device:
            raise ValueError(f"scales must be on x's device ({x.device}), got {scales.device}")
        scales = scales.to(torch.float32)
    return ops.quantize(x, _QKIND[kind], scales)


def _doc_rows(starts: Tensor, lens: Tensor) -> tuple[Tensor, Tensor]:
    """Token rows of every document in order, and the document of each."""
    lens = lens.to(torch.int64).clamp(min=0)
    doc = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    base = starts.to(torch.int64) - (torch.cumsum(lens, 0) - lens)
    return torch.arange(doc.numel(), device=lens.device) + base[doc], doc


def _doc_scales(tokens: Tensor, starts: Tensor, lens: Tensor, work, step: int, kind: str) -> Tensor:
    """Scales [T]: each document's largest finite magnitude / qmax (448 fp8,
    127 int8), shared by its tokens (rows outside every document keep their
    own), so that the scan can apply one scale per document to the row
    maxima instead of to every product. Tokens smaller than their
    document's largest lose resolution (H100, ColPali-sized random data,
    fp8: top-10 agreement 0.84 per token, 0.76 per document)."""
    if tokens.shape[0] == 0 or tokens.shape[1] == 0:
        return torch.ones(tokens.shape[0], dtype=torch.float32, device=work)
    amax = torch.cat([tokens[r0:r0 + step].to(work).float().abs().amax(1) for r0 in range(0, tokens.shape[0], step)])
    amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    qmax = amax.new_full((), 448.0 if kind == "fp8" else 127.0)
    one = torch.ones_like(amax)
    scales = torch.where(amax > 0, amax / qmax, one)
    rows, doc = _doc_rows(starts.to(work), lens.to(work))
    dmax = amax.new_zeros(starts.numel()).scatter_reduce_(0, doc, amax[rows], "amax")
    scales[rows] = torch.where(dmax > 0, dmax / qmax, torch.ones_like(dmax))[doc]
    return scales


def _uniform_doc_scales(scales: Tensor, starts: Tensor, lens: Tensor) -> bool:
    """Whether every document's tokens share one positive finite scale."""
    rows, doc = _doc_rows(starts.to(scales.device), lens.to(scales.device))
    if rows.numel() == 0:
        return True
    s = scales[rows]
    first = scales[starts.to(scales.device, torch.int64).clamp(0, scales.numel() - 1)][doc]
    return bool(torch.equal(s, first) and (s > 0).all() and torch.isfinite(s).all())


# ----------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------

_QTYPES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}


def _as_packed(documents: Tensor, offsets, lengths, mask):
    """(tokens [T, d], starts [N], lengths [N], token mask [T] or None) as
    int64 CPU index tensors; validated (one host sync, at construction)."""
    if not isinstance(documents, torch.Tensor) or documents.dtype not in _FLOATS + tuple(_QTYPES):
        raise TypeError("documents must be a float32 / float16 / bfloat16 tensor (or int8 / float8_e4m3fn "
                        "with scales)")
    if documents.dim() == 2:
        if offsets is None:
            raise ValueError("packed documents [T, d] need offsets [N+1]")
        if lengths is not None or mask is not None:
            raise ValueError("lengths / mask go with padded documents [N, L, d]; packed documents use offsets")
        off = torch.as_tensor(offsets).to("cpu", torch.int64).reshape(-1)
        T = documents.shape[0]
        if off.numel() < 1 or int(off[0]) != 0 or int(off[-1]) != T or bool((off[1:] < off[:-1]).any()):
            raise ValueError(f"offsets must start at 0, end at the token count {T} and never decrease")
        return documents, off[:-1].clone(), off[1:] - off[:-1], None
    if documents.dim() == 3:
        if offsets is not None:
            raise ValueError("padded documents [N, L, d] take lengths or mask, not offsets")
        N, L, d = documents.shape
        tokens = documents.reshape(N * L, d)
        starts = torch.arange(N, dtype=torch.int64) * L
        if lengths is not None:
            ln = torch.as_tensor(lengths).to("cpu", torch.int64).reshape(-1)
            if ln.numel() != N or bool(((ln < 0) | (ln > L)).any()):
                raise ValueError(f"lengths must be [N={N}] values in [0, {L}]")
        else:
            ln = torch.full((N,), L, dtype=torch.int64)
        tmask = None
        if mask is not None:
            if mask.dtype != torch.bool or tuple(mask.shape) != (N, L):
                raise ValueError(f"mask must be bool [N={N}, L={L}]")
            tmask = mask.reshape(-1)
        return tokens, starts, ln, tmask
    raise ValueError(f"documents must be packed [T, d] or padded [N, L, d], got shape {tuple(documents.shape)}")


class Corpus:
    """A document collection ready for :func:`search`.

    ``documents`` is packed ``[T, d]`` with ``offsets [N+1]``, or padded
    ``[N, L, d]`` with optional ``lengths [N]`` or bool ``mask [N, L]``.

    ``storage``: ``"device"`` (tokens on ``device``, default CUDA when
    available), ``"pinned"`` (pinned host memory, streamed to ``device`` in
    chunks of about ``chunk_mib`` MiB; for corpora larger than GPU memory) or
    ``"cpu"`` (scored by the CPU kernels). ``quantization``: ``None`` (keep
    the dtype), ``"int8"`` or ``"fp8"`` (e4m3; see :func:`quantize_tokens`).
    ``scale_layout``: ``"token"`` (each token's
    largest magnitude maps to the format's largest value) or ``"document"``
    (one scale per document, applied by the scan to the row maxima instead
    of to every product: faster, somewhat less accurate); default
    ``"token"`` for int8, ``"document"`` for fp8. Already quantised
    tokens (int8 / float8_e4m3fn, dim a multiple of 16) come with their
    per-token ``scales [T]`` and are kept as they are.
    ``rescore``: with ``quantization``, also keep the original tokens on
    ``"device"``, ``"pinned"`` or ``"cpu"`` memory; :func:`search` then
    scores the compressed corpus for ``oversample x k`` candidates per query
    and re-scores those exactly from the originals (the usual tiered set-up:
    the GPU holds the int8 corpus, the host the full-precision one).
    Construction validates the layout (host syncs allowed here; :func:`search`
    syncs only to gather host-resident originals). ``uniform_doc_scales``
    tells whether the documents each share one positive scale (by
    construction for ``scale_layout="document"``; checked for prequantised
    tokens): the scan then applies it to the row maxima.
    """

    def __init__(self, documents: Tensor, offsets=None, *, lengths=None, mask=None, storage: str = "device",
                 quantization: Optional[str] = None, scales: Optional[Tensor] = None, device=None,
                 chunk_mib: int = 256, rescore: Optional[str] = None, scale_layout: Optional[str] = None):
        if storage not in ("device", "pinned", "cpu"):
            raise ValueError(f"storage must be 'device', 'pinned' or 'cpu', got {storage!r}")
        if quantization not in (None, "int8", "fp8"):
            raise ValueError(f"quantization must be None, 'int8' or 'fp8', got {quantization!r}")
        if rescore not in (None, "device", "pinned", "cpu"):
            raise ValueError(f"rescore must be None, 'device', 'pinned' or 'cpu', got {rescore!r}")
        if scale_layout not in (None, "token", "document"):
            raise ValueError(f"scale_layout must be None, 'token' or 'document', got {scale_layout!r}")
        tokens, starts, lens, tmask = _as_packed(documents, offsets, lengths, mask)
        prequant = tokens.dtype in _QTYPES
        if scale_layout is not None and (quantization is None or prequant):
            raise ValueError("scale_layout applies to a corpus quantised here (quantization='int8' or 'fp8' "
                             "with float documents)")
        if rescore is not None and (quantization is None or prequant):
            raise ValueError("rescore keeps the original tokens of a corpus quantised here "
                             "(quantization='int8' or 'fp8' with float documents)")
        if prequant:
            if scales is None or scales.shape != (tokens.shape[0],):
                raise ValueError("quantised documents need scales [T] (one per token row)")
            if tokens.shape[1] % 16:
                raise ValueError("quantised documents need dim % 16 == 0 (zero-pad, as quantize_tokens does)")
            if quantization not in (None, _QTYPES[tokens.dtype]):
                raise ValueError(f"documents are {tokens.dtype}, quantization={quantization!r}")
            quantization = _QTYPES[tokens.dtype]
        elif scales is not None:
            raise ValueError("scales go with int8 / float8_e4m3fn documents")
        if storage == "cpu":
            dev = torch.device("cpu")
        elif device is not None:
            dev = torch.device(device)
        elif storage == "pinned" or documents.device.type == "cpu":
            dev = torch.device("cuda") if torch.cuda.is_available() else documents.device
        else:
            dev = documents.device
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())  # explicit: compared with tensors' devices
        if storage == "pinned" and dev.type != "cuda":
            raise ValueError("storage='pinned' streams to a CUDA device; none is available")
        if quantization == "fp8" and dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
            raise ValueError("fp8 corpora need a GPU of compute capability 8.9 or newer")
        self.device = dev
        self.storage = storage
        self.quantization = quantization
        self.dim = tokens.shape[1]
        self.dtype = tokens.dtype
        self.num_docs = starts.numel()
        self.num_tokens = tokens.shape[0]
        home = torch.device("cpu") if storage != "device" else dev
        self.originals = None
        if rescore is not None:
            ohome = dev if rescore == "device" else torch.device("cpu")
            orig = tokens.to(ohome).contiguous()
            omask = None if tmask is None else tmask.to(ohome).contiguous()
            if rescore == "pinned" and ohome.type == "cpu" and torch.cuda.is_available():
                orig = orig.pin_memory()
                omask = None if omask is None else omask.pin_memory()
            ost = starts.to(torch.int64).to(ohome)
            oln = lens.to(torch.int64).to(ohome).clamp(min=0)
            self.originals = (orig, omask, ost, oln, int(oln.max()) if oln.numel() else 0)
        # Quantise where the compute is (fast on a GPU), keep it where it is stored.
        if prequant:
            scales = scales.to(home, torch.float32).contiguous()
            tokens = tokens.to(home).contiguous()
        elif quantization is not None:
            work = dev if dev.type == "cuda" else tokens.device
            vals, scales = [], []
            rows = max(1, (256 << 20) // max(1, 2 * tokens.shape[1]))
            if scale_layout is None:
                scale_layout = "document" if quantization == "fp8" else "token"
            per_doc = None
            if scale_layout == "document":
                per_doc = _doc_scales(tokens, starts, lens, work, rows, quantization)
            for r0 in range(0, tokens.shape[0], rows):
                given = per_doc[r0:r0 + rows] if per_doc is not None else None
                v, s = quantize_tokens(tokens[r0:r0 + rows].to(work), quantization, given)
                vals.append(v.to(home))
                scales.append(s.to(home))
            tokens = torch.cat(vals) if vals else quantize_tokens(tokens.to(work), quantization)[0].to(home)
            scales = torch.cat(scales) if scales else torch.empty(0, dtype=torch.float32, device=home)
        else:
            scales = None
            tokens = tokens.to(home).contiguous()
        if tmask is not None:
            tmask = tmask.to(home).contiguous()
        if storage == "pinned":
            tokens, scales, tmask = (t if t is None or t.is_pinned() else t.pin_memory()
                                     for t in (tokens, scales, tmask))
        self.tokens, self.scales, self.token_mask = tokens, scales, tmask
        # One positive scale per document lets the Hopper scan apply it after
        # the max: true by construction for scale_layout="document", checked
        # once for prequantised tokens.
        if quantization is None:
            self.uniform_doc_scales = False
        elif prequant:
            self.uniform_doc_scales = _uniform_doc_scales(scales, starts, lens)
            scale_layout = "document" if self.uniform_doc_scales else "token"
        else:
            self.uniform_doc_scales = scale_layout == "document"
        self.scale_layout = scale_layout
        self.starts = starts.to(torch.int32).to(dev)
        self.lengths = lens.to(torch.int32).to(dev)
        self._chunks = None
        if storage == "pinned":
            self._plan_chunks(starts, lens, chunk_mib)

    def __len__(self) -> int:
        return self.num_docs

    def _gather_originals(self, ids: Tensor, dev) -> tuple:
        """Candidates ``ids [M]`` (-1 = none) as a padded block on ``dev``:
        (tokens [M * L, d], mask [M * L] or None, starts [M], lengths [M])."""
        orig, omask, ost, oln, L = self.originals
        ids = ids.to(orig.device)
        ok = ids >= 0
        safe = torch.where(ok, ids, 0)
        lens = torch.where(ok, oln[safe], 0)
        cols = torch.arange(max(L, 1), device=orig.device)[None, :]
        rows = ost[safe][:, None] + cols
        valid = cols < lens[:, None]
        rows = torch.where(valid, rows, 0).reshape(-1)
        tok = orig.index_select(0, rows) if orig.shape[0] else orig.new_zeros((rows.numel(), orig.shape[1]))
        m = valid.reshape(-1)
        if omask is not None:
            m = m & omask.index_select(0, rows) if omask.shape[0] else m
        M = ids.numel()
        starts = torch.arange(M, device=orig.device) * max(L, 1)
        lengths = torch.where(ok, lens, -1)  # no candidate: an invalid doc, NaN score, ranked out
        nb = dev.type == "cuda" and tok.device.type == "cpu"
        return (tok.to(dev, non_blocking=nb), m.to(dev, non_blocking=nb),
                starts.to(torch.int32).to(dev), lengths.to(torch.int32).to(dev))

    def __repr__(self) -> str:
        q = self.quantization or str(self.dtype).replace("torch.", "")
        return (f"Corpus({self.num_docs} docs, {self.num_tokens} tokens, dim {self.dim}, {q}, "
                f"storage={self.storage}, device={self.device})")

    # -- pinned streaming -------------------------------------------------------
    def _plan_chunks(self, starts: Tensor, lens: Tensor, chunk_mib: int) -> None:
        """Consecutive documents grouped into chunks of contiguous token rows."""
        row_bytes = self.tokens.shape[1] * self.tokens.element_size()
        cap = max(1, (chunk_mib << 20) // max(1, row_bytes))
        chunks, doc0 = [], 0
        st, ln = starts.tolist(), lens.tolist()
        tok0 = st[0] if st else 0
        for i in range(self.num_docs):
            end = st[i] + ln[i]
            if i > doc0 and end - tok0 > cap:
                chunks.append((doc0, i, tok0, st[i]))
                doc0, tok0 = i, st[i]
        if self.num_docs:
            chunks.append((doc0, self.num_docs, tok0, st[-1] + ln[-1]))
        self._chunks = chunks
        self._max_rows = max([t1 - t0 for _, _, t0, t1 in chunks] + [1])
        base = torch.zeros(self.num_docs, dtype=torch.int64)
        for d0, d1, t0, _ in chunks:
            base[d0:d1] = t0
        self._local_starts = (starts - base).to(torch.int32).to(self.device)
        self._buffers = None
        self._copy_stream = None

    def _stream(self) -> Iterator[tuple]:
        dev = self.device
        if self._buffers is None:
            def alloc(t):
                return None if t is None else torch.empty((self._max_rows,) + tuple(t.shape[1:]), dtype=t.dtype,
                                                          device=dev)
            self._buffers = [(alloc(self.tokens), alloc(self.scales), alloc(self.token_mask)) for _ in range(2)]
            self._copy_stream = torch.cuda.Stream(dev)
        cur = torch.cuda.current_stream(dev)
        cp = self._copy_stream
        copied = [torch.cuda.Event(), torch.cuda.Event()]
        freed: list = [None, None]
        cp.wait_stream(cur)  # buffers may still be read by an earlier search

        def issue(c: int) -> None:
            b = c % 2
            _, _, t0, t1 = self._chunks[c]
            with torch.cuda.stream(cp):
                if freed[b] is not None:
                    cp.wait_event(freed[b])
                for dst, src in zip(self._buffers[b], (self.tokens, self.scales, self.token_mask)):
                    if src is not None:
                        dst[:t1 - t0].copy_(src[t0:t1], non_blocking=True)
                copied[b].record(cp)

        n = len(self._chunks)
        if n:
            issue(0)
        for c in range(n):
            if c + 1 < n:
                issue(c + 1)
            cur.wait_event(copied[c % 2])
            d0, d1, t0, t1 = self._chunks[c]
            tok, sc, m = self._buffers[c % 2]
            yield (d0, d1, tok[:t1 - t0], None if sc is None else sc[:t1 - t0],
                   None if m is None else m[:t1 - t0], self._local_starts[d0:d1])
            ev = torch.cuda.Event()
            ev.record(cur)
            freed[c % 2] = ev

    def _resident(self) -> Iterator[tuple]:
        yield (0, self.num_docs, self.tokens, self.scales, self.token_mask, self.starts)

    def chunks(self) -> Iterator[tuple]:
        """(doc0, doc1, tokens, scales, token mask, starts of docs doc0..doc1-1
        into tokens) on the compute device, chunk by chunk."""
        return self._stream() if self.storage == "pinned" else self._resident()


# ----------------------------------------------------------------------------
# search
# ----------------------------------------------------------------------------

def _queries(queries: Tensor, query_lengths, query_mask, device):
    if not isinstance(queries, torch.Tensor) or queries.dtype not in _FLOATS:
        raise TypeError("queries must be a float32 / float16 / bfloat16 tensor")
    single = queries.dim() == 2
    if single:
        # a view, not an op per call: every op here is host time in a one-query search
        queries = queries.view((1,) + tuple(queries.shape)) if queries.is_contiguous() else queries[None]
        if query_mask is not None:
            query_mask = query_mask[None]
        if query_lengths is not None:
            query_lengths = torch.as_tensor(query_lengths).reshape(1)
    if queries.dim() != 3:
        raise ValueError(f"queries must be [Lq, d] or [Nq, Lq, d], got shape {tuple(queries.shape)}")
    Nq, Lq, d = queries.shape
    if queries.device != device:
        queries = queries.to(device)
    ql = None
    if query_lengths is not None:
        ql = torch.as_tensor(query_lengths).to(device)
        if ql.shape != (Nq,) or ql.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"query_lengths must be int [Nq={Nq}]")
    q_start, q_len = _padded_segments(Nq, Lq, ql, device)
    qm = None
    if query_mask is not None:
        if query_mask.dtype != torch.bool or tuple(query_mask.shape) != (Nq, Lq):
            raise ValueError(f"query_mask must be bool [Nq={Nq}, Lq={Lq}]")
        qm = query_mask.to(device).reshape(-1).contiguous()
    flat = queries.view(Nq * Lq, d) if queries.is_contiguous() else queries.reshape(Nq * Lq, d).contiguous()
    return single, flat, q_start, q_len, qm, Nq, Lq


def as_corpus(corpus, device) -> Corpus:
    """``corpus`` itself, or a :class:`Corpus` of a ``(documents, offsets)``
    tuple on ``device`` (CPU kernels for a CPU device)."""
    if isinstance(corpus, tuple):
        return Corpus(corpus[0], corpus[1], device=device, storage="cpu" if device.type == "cpu" else "device")
    if not isinstance(corpus, Corpus):
        raise TypeError("corpus must be a maxsim.Corpus or a (documents, offsets) tuple")
    return corpus


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
                              None, None, GROUPED, Lq, 0, False)
        parts.append(part.view(n1 - n0, kc))
    scores = parts[0] if len(parts) == 1 else torch.cat(parts)
    top = ops.block_topk(scores, 0, k, cand)  # id -1 (no candidate): empty slot; sorted
    return ops.decode_keys(top if top.shape[1] == k else merge_topk(top, k))


def search(queries: Tensor, corpus, k: int, *, query_lengths: Optional[Tensor] = None,
           query_mask: Optional[Tensor] = None, block_docs: Optional[int] = None,
           oversample: int = 4) -> tuple[Tensor, Tensor]:
    """Exact MaxSim top-k of each query over ``corpus``.

    ``queries``: ``[Lq, d]`` or ``[Nq, Lq, d]`` (float), with optional
    ``query_lengths [Nq]`` or bool ``query_mask [Nq, Lq]``. ``corpus``: a
    :class:`Corpus`, or ``(documents, offsets)`` for a packed collection
    already on the queries' device. Returns ``(scores, ids)``: fp32 and int64
    ``[Nq, k]`` (``[k]`` for one 2-D query) on the corpus' compute device,
    best first, ties to the lower document id. With fewer than k documents
    the tail is (-inf, -1). A document whose score is NaN ranks last.
    ``block_docs`` caps the documents scored per block (default: about 8M
    scores per block). For a quantised corpus with kept originals
    (``Corpus(..., rescore=...)``) the compressed scan keeps ``oversample x
    k`` candidates, re-scored exactly from the originals; the scores returned
    are then the exact ones.
    """
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be a non-negative int, got {k!r}")
    if not isinstance(oversample, int) or oversample < 1:
        raise ValueError(f"oversample must be an int >= 1, got {oversample!r}")
    corpus = as_corpus(corpus, queries.device)
    dev = corpus.device
    single, q, q_start, q_len, qm, Nq, Lq = _queries(queries, query_lengths, query_mask, dev)
    if q.shape[1] != corpus.dim:
        raise ValueError(f"embedding dim mismatch: queries have {q.shape[1]}, the corpus {corpus.dim}")
    quant = corpus.quantization
    k_final = k
    if corpus.originals is not None:
        k = min(k * oversample, corpus.num_docs) if k else 0
    if quant is not None:
        qv, qs = quantize_tokens(q, quant)
    elif q.dtype != corpus.dtype:
        q = q.to(corpus.dtype)
    keys = None
    per_block = block_docs or max(1, _SCORE_BUDGET // max(1, Nq))
    if k and Nq:
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
                                            CROSS, Lq, 0, False)
                top = ops.block_topk(scores.view(Nq, b1 - b0), d0 + b0, k)
                keys = top if keys is None else merge_topk(torch.cat([keys, top], dim=1), k)
    if keys is None:
        keys = torch.empty((Nq, 0), dtype=torch.int64, device=dev)
    if keys.shape[1] < k:
        keys = merge_topk(keys, k)
    if corpus.originals is not None:
        scores, ids = _rescore(q, q_start, q_len, qm, Nq, Lq, corpus, keys, k_final, dev)
        return (scores[0], ids[0]) if single else (scores, ids)
    if single:
        return ops.decode_keys(keys[0])
    return ops.decode_keys(keys)
