"""A document collection ready for :func:`maxsim.search`.

A corpus lives on the GPU, in pinned host memory (streamed to the GPU in
chunks on a copy stream, double-buffered against the scoring of the previous
chunk) or on the CPU (CPU kernels); it may be stored as int8 (per-token
symmetric scales, scored exactly in int32 on int8 tensor cores) or fp8 e4m3
(one scale per document, fp8 tensor cores on sm_89+). A quantised corpus may
keep its original tokens (``rescore=``, e.g. on the host) for an exact
re-scoring of the best candidates.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from .quantization import QUANT_DTYPES, doc_scales, quantize_tokens, uniform_doc_scales
from .checks import FLOATS, INTS, check_values, validate_lengths, validate_offsets

Tensor = torch.Tensor

__all__ = ["Corpus", "as_corpus"]


def _as_packed(documents: Tensor, offsets, lengths, mask):
    """(tokens [T, d], starts [N], lengths [N], token mask [T] or None) as
    int64 CPU index tensors; validated (one host sync, at construction)."""
    if not isinstance(documents, torch.Tensor) or documents.dtype not in FLOATS + tuple(QUANT_DTYPES):
        raise TypeError("documents must be a float32 / float16 / bfloat16 tensor (or int8 / float8_e4m3fn "
                        "with scales)")
    if documents.dim() == 2:
        if offsets is None:
            raise ValueError("packed documents [T, d] need offsets [N+1]")
        if lengths is not None or mask is not None:
            raise ValueError("lengths / mask go with padded documents [N, L, d]; packed documents use offsets")
        off = torch.as_tensor(offsets)
        if off.dtype not in INTS or off.dim() != 1:
            raise TypeError(f"offsets must be a 1-D int32 / int64 tensor, got {off.dtype} of shape {tuple(off.shape)}")
        off = off.to("cpu", torch.int64)
        validate_offsets("offsets", off, documents.shape[0])
        return documents, off[:-1].clone(), off[1:] - off[:-1], None
    if documents.dim() == 3:
        if offsets is not None:
            raise ValueError("padded documents [N, L, d] take lengths or mask, not offsets")
        N, L, d = documents.shape
        tokens = documents.reshape(N * L, d)
        starts = torch.arange(N, dtype=torch.int64) * L
        if lengths is not None:
            ln = torch.as_tensor(lengths)
            if ln.dtype not in INTS or tuple(ln.shape) != (N,):
                raise ValueError(f"lengths must be int [N={N}], got {ln.dtype} of shape {tuple(ln.shape)}")
            ln = ln.to("cpu", torch.int64)
            validate_lengths("lengths", ln, L)
        else:
            ln = torch.full((N,), L, dtype=torch.int64)
        tmask = None
        if mask is not None:
            if mask.dtype != torch.bool or tuple(mask.shape) != (N, L):
                raise ValueError(f"mask must be bool [N={N}, L={L}]")
            tmask = mask.reshape(-1)
        return tokens, starts, ln, tmask
    raise ValueError(f"documents must be packed [T, d] or padded [N, L, d], got shape {tuple(documents.shape)}")


def _check_dim(tokens: Tensor) -> None:
    if tokens.shape[1] == 0:
        raise ValueError("documents have embedding dim 0; it must be at least 1")


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
                 chunk_mib: int = 256, rescore: Optional[str] = None, scale_layout: Optional[str] = None,
                 nbits: int = 2, plaid: Optional[dict] = None):
        if quantization == "plaid":
            self._init_plaid(documents, offsets, lengths, mask, storage, device, rescore, nbits, plaid or {})
            return
        if storage not in ("device", "pinned", "cpu"):
            raise ValueError(f"storage must be 'device', 'pinned' or 'cpu', got {storage!r}")
        if quantization not in (None, "int8", "fp8"):
            raise ValueError(f"quantization must be None, 'int8', 'fp8' or 'plaid', got {quantization!r}")
        if rescore not in (None, "device", "pinned", "cpu"):
            raise ValueError(f"rescore must be None, 'device', 'pinned' or 'cpu', got {rescore!r}")
        if scale_layout not in (None, "token", "document"):
            raise ValueError(f"scale_layout must be None, 'token' or 'document', got {scale_layout!r}")
        check_values("documents", documents, "offsets", offsets, "lengths", lengths, "mask", mask,
                     "scales", scales)
        tokens, starts, lens, tmask = _as_packed(documents, offsets, lengths, mask)
        _check_dim(tokens)
        prequant = tokens.dtype in QUANT_DTYPES
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
            if quantization not in (None, QUANT_DTYPES[tokens.dtype]):
                raise ValueError(f"documents are {tokens.dtype}, quantization={quantization!r}")
            quantization = QUANT_DTYPES[tokens.dtype]
        elif scales is not None:
            raise ValueError("scales go with int8 / float8_e4m3fn documents")
        if storage == "cpu":
            dev = torch.device("cpu")
        elif device is not None:
            try:
                dev = torch.device(device)
            except (RuntimeError, TypeError):
                raise ValueError(f"device must name a torch device, got {device!r}") from None
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
                per_doc = doc_scales(tokens, starts, lens, work, rows, quantization)
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
            self.uniform_doc_scales = uniform_doc_scales(scales, starts, lens)
            scale_layout = "document" if self.uniform_doc_scales else "token"
        else:
            self.uniform_doc_scales = scale_layout == "document"
        self.scale_layout = scale_layout
        self.starts = starts.to(torch.int32).to(dev)
        self.lengths = lens.to(torch.int32).to(dev)
        self._chunks = None
        if storage == "pinned":
            self._plan_chunks(starts, lens, chunk_mib)

    # -- PLAID / ColBERTv2 residual compression -------------------------------------
    def _init_plaid(self, documents, offsets, lengths, mask, storage, device, rescore, nbits, options) -> None:
        from .plaid import PlaidIndex

        if storage not in ("device", "cpu"):
            raise ValueError("a plaid corpus is stored on 'device' or 'cpu'")
        if rescore not in (None, "device"):
            raise ValueError("a plaid corpus keeps its originals (rescore=) on 'device' only")
        if mask is not None:
            raise ValueError("a plaid corpus takes lengths or offsets, not a token mask")
        check_values("documents", documents, "offsets", offsets, "lengths", lengths)
        tokens, starts, lens, _ = _as_packed(documents, offsets, lengths, None)
        _check_dim(tokens)
        if tokens.dtype not in FLOATS:
            raise TypeError("a plaid corpus compresses float documents")
        dev = self._plaid_device(storage, device, tokens)
        index = PlaidIndex.build(tokens.to(dev), starts.to(dev), lens.to(dev), nbits, **options)
        self._adopt_plaid(index, tokens.shape[0], tokens.dtype)
        if rescore is not None:
            self.originals = (tokens.to(dev).contiguous(), None, starts.to(dev), lens.to(dev),
                              int(lens.max()) if lens.numel() else 0)

    @staticmethod
    def _plaid_device(storage, device, like) -> torch.device:
        if storage == "cpu":
            return torch.device("cpu")
        dev = torch.device(device) if device is not None else (
            torch.device("cuda") if torch.cuda.is_available() else like.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    def _adopt_plaid(self, index, num_tokens: int, dtype) -> None:
        self.plaid = index
        self.device = index.codes.device
        self.storage = "device" if self.device.type != "cpu" else "cpu"
        self.quantization = "plaid"
        self.scale_layout = None
        self.uniform_doc_scales = False
        self.dim = index.dim
        self.dtype = dtype
        self.num_docs = index.starts.numel()
        self.num_tokens = num_tokens
        self.tokens = self.scales = self.token_mask = None
        self.originals = None
        self.starts, self.lengths = index.starts, index.lengths
        self._chunks = None

    @classmethod
    def from_plaid(cls, codes: Tensor, residuals: Tensor, centroids: Tensor, bucket_weights: Tensor, nbits: int,
                   offsets: Tensor) -> "Corpus":
        """A corpus over an existing ColBERTv2 / fast-plaid compressed layout
        (flat ``codes [T]``, ``residuals [T, ceil(d * nbits / 8)]`` uint8,
        ``centroids [C, d]``, ``bucket_weights [2^nbits]``, document n =
        tokens ``offsets[n] .. offsets[n+1]-1``), used in place: int32 codes
        and fp32 tables are not copied (int64 codes / fp16 centroids are
        converted once)."""
        from .plaid import PlaidIndex

        off = torch.as_tensor(offsets).to(codes.device)
        if off.dim() != 1 or off.dtype not in INTS:
            raise TypeError("offsets must be a 1-D int32 / int64 tensor [N+1]")
        validate_offsets("offsets", off.to("cpu", torch.int64), codes.shape[0])
        index = PlaidIndex(codes, residuals, centroids, bucket_weights, nbits, off[:-1], off[1:] - off[:-1])
        self = cls.__new__(cls)
        self._adopt_plaid(index, codes.shape[0], torch.float32)
        return self

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
        if self.quantization == "plaid":
            return (f"Corpus({self.num_docs} docs, {self.num_tokens} tokens, dim {self.dim}, plaid "
                    f"{self.plaid.nbits}-bit, {self.plaid.centroids.shape[0]} centroids, device={self.device})")
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


def as_corpus(corpus, device) -> Corpus:
    """``corpus`` itself, or a :class:`Corpus` of a ``(documents, offsets)``
    tuple on ``device`` (CPU kernels for a CPU device)."""
    if isinstance(corpus, tuple):
        return Corpus(corpus[0], corpus[1], device=device, storage="cpu" if device.type == "cpu" else "device")
    if not isinstance(corpus, Corpus):
        raise TypeError("corpus must be a maxsim.Corpus or a (documents, offsets) tuple")
    return corpus
