"""Per-token (or per-document) symmetric int8 / fp8 quantisation of tokens."""

from __future__ import annotations

from typing import Optional

import torch

from ._registry import ops
from .checks import FLOATS

Tensor = torch.Tensor
QUANT_KINDS = {"int8": 0, "fp8": 1}  # ops.quantize's kind
QUANT_DTYPES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}

__all__ = ["quantize_tokens", "doc_scales", "uniform_doc_scales"]


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
    if kind not in QUANT_KINDS:
        raise ValueError(f"quantization must be 'int8' or 'fp8', got {kind!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in FLOATS:
        raise TypeError("quantize_tokens expects a float [T, d] tensor")
    if scales is not None:
        if not isinstance(scales, torch.Tensor) or scales.dim() != 1 or scales.shape[0] != x.shape[0]:
            raise ValueError(f"scales must be a [T] tensor with T = {x.shape[0]}")
        if scales.device != x.device:
            raise ValueError(f"scales must be on x's device ({x.device}), got {scales.device}")
        scales = scales.to(torch.float32)
    return ops.quantize(x, QUANT_KINDS[kind], scales)


def doc_rows(starts: Tensor, lens: Tensor) -> tuple[Tensor, Tensor]:
    """Token rows of every document in order, and the document of each."""
    lens = lens.to(torch.int64).clamp(min=0)
    doc = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    base = starts.to(torch.int64) - (torch.cumsum(lens, 0) - lens)
    return torch.arange(doc.numel(), device=lens.device) + base[doc], doc


def doc_scales(tokens: Tensor, starts: Tensor, lens: Tensor, work, step: int, kind: str) -> Tensor:
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
    rows, doc = doc_rows(starts.to(work), lens.to(work))
    dmax = amax.new_zeros(starts.numel()).scatter_reduce_(0, doc, amax[rows], "amax")
    scales[rows] = torch.where(dmax > 0, dmax / qmax, torch.ones_like(dmax))[doc]
    return scales


def uniform_doc_scales(scales: Tensor, starts: Tensor, lens: Tensor) -> bool:
    """Whether every document's tokens share one positive finite scale."""
    rows, doc = doc_rows(starts.to(scales.device), lens.to(scales.device))
    if rows.numel() == 0:
        return True
    s = scales[rows]
    first = scales[starts.to(scales.device, torch.int64).clamp(0, scales.numel() - 1)][doc]
    return bool(torch.equal(s, first) and (s > 0).all() and torch.isfinite(s).all())
