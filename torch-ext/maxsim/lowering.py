"""From the public layouts to the one ``forward`` op: index tensors and the call.

Everything here runs on the device without a host sync; the scoring and
search front ends share it.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._registry import ops
from .reference import CROSS, GROUPED

Tensor = torch.Tensor
I16_MAX = 32767
I32_RANGE = (-(1 << 31), (1 << 31) - 1)

_INDEX_CACHE: dict = {}


def score_dtype(t: Tensor) -> torch.dtype:
    """Scores are fp32, or fp64 for fp64 inputs."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def cached_index(key: tuple, device, build):
    """``build()`` (index tensors that depend only on ``key``), cached per
    device: small launches here would cost more than a short forward kernel.
    Not cached while capturing a graph or compiling (those own their tensors)."""
    key = key + (str(device),)
    hit = _INDEX_CACHE.get(key)
    if hit is not None:
        return hit
    val = build()
    if torch.compiler.is_compiling():  # before the capture query, which a traced graph cannot hold
        return val
    capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing and len(_INDEX_CACHE) < 256:
        _INDEX_CACHE[key] = val
        _CACHED_IDS.add(id(val[0]))
    return val


_CACHED_IDS: set = set()


def index_cached(t: Tensor) -> bool:
    """Whether ``t`` came from the index cache (so a caller may keep it too)."""
    return id(t) in _CACHED_IDS


def uniform_segments(n: int, extent: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """(start, len) of n back-to-back segments of ``extent`` rows on ``like``'s
    device (cached; one op, so a process's first call loads no torch kernel)."""
    return cached_index(("segments", n, extent), like.device,
                        lambda: tuple(ops.uniform_segments(like, n, extent)))


def segments(offsets=(), ints=()) -> list:
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


def padded_segments(n: int, extent: int, lengths: Optional[Tensor], like: Tensor) -> tuple[Tensor, Tensor]:
    """(start, len) of n padded rows of ``extent`` tokens on ``like``'s device;
    ``lengths`` outside [0, extent] become -1 (an invalid segment: NaN score)."""
    start, full = uniform_segments(n, extent, like)
    if lengths is None:
        return start, full
    return start, segments(ints=[(lengths, 0, extent)])[0]


def flat(x: Tensor) -> Tensor:
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def flat_mask(m: Optional[Tensor]) -> Optional[Tensor]:
    return None if m is None else m.reshape(-1).contiguous()


def argmax_kind(train: bool, with_argmax: bool, doc_bound: int) -> int:
    if train:
        return 2 if doc_bound <= I16_MAX else 1
    return 1 if with_argmax else 0


# The op's ``precision`` codes (plan::Precision in forward_plan.h).
PRECISIONS = {"default": 0, "tf32": 1, "exact": 2}


def precision_code(precision: Optional[str], tf32: bool = False) -> int:
    """The op code of a public ``precision=`` (``None`` = "default");
    ``tf32=True`` is the older spelling of ``precision="tf32"``."""
    if tf32:
        if precision not in (None, "tf32"):
            raise ValueError(f"tf32=True conflicts with precision={precision!r} (tf32=True means "
                             "precision='tf32'; pass one of them)")
        precision = "tf32"
    name = "default" if precision is None else precision
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[name]


def needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def run(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d,
        layout, lq, kind, precision, normalize=False, train=None):
    """q / d: token tensors [..., dim]; precision: an op code (precision_code).
    Returns scores shaped by layout ([Nq, Nd] CROSS, [Nq, K] GROUPED, [P]
    LIST) and the argmax [P, lq]. ``train``: whether a gradient can flow
    (None: find out)."""
    q = q if q.is_contiguous() else q.contiguous()
    d = d if d.is_contiguous() else d.contiguous()
    if needs_grad(q, d) if train is None else train:
        # The autograd-carrying op only when a gradient can flow (it costs an
        # autograd node per call); it flattens and reshapes inside the node.
        scores, argmax, _ = ops.forward_train(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask,
                                              pair_q, pair_d, layout, lq, kind, precision, normalize)
        return scores, argmax
    scores, argmax = ops.forward(flat(q), q_start, q_len, q_mask, flat(d), d_start, d_len, d_mask,
                                 pair_q, pair_d, layout, lq, kind, precision, normalize)
    nq, nd = q_start.shape[0], d_start.shape[0]
    if layout == CROSS:
        scores = scores.view(nq, nd)
    elif layout == GROUPED and nq > 0:
        scores = scores.view(nq, nd // nq)
    return scores, argmax


def empty_scores(shape: tuple, queries: Tensor, documents: Tensor) -> Tensor:
    """Scores of a call with no pairs (``shape`` holds a 0). Connected to the
    autograd graph when a gradient can flow, so that ``backward()`` gives
    zero gradients of the inputs' shapes instead of failing."""
    s = torch.zeros(shape, device=queries.device, dtype=score_dtype(queries))
    if needs_grad(queries, documents):
        # Empty slices sum to an exact 0 whatever the values (NaN, inf).
        s = s + (queries.reshape(-1)[:0].sum() + documents.reshape(-1)[:0].sum()).to(s.dtype)
    return s


def empty_result(shape: tuple, lq: int, queries: Tensor, documents: Tensor, mode: str):
    """Result of a call with no pairs: zero scores (and -1 argmax)."""
    s = empty_scores(shape, queries, documents)
    if mode != "argmax":
        return s
    return s, torch.full(shape + (lq,), -1, device=queries.device, dtype=torch.int32)


def as_int32(argmax: Tensor) -> Tensor:
    return argmax if argmax.dtype == torch.int32 else argmax.to(torch.int32)
