"""Shape-only kernels and reference fallbacks for the compiled op set.

The schemas live in ``torch_binding.cpp`` and the autograd of
``forward_train`` in ``autograd.cpp``; this module makes them usable under
``torch.compile(fullgraph=True)`` (shape-only kernels on the Meta key, which
FakeTensor runs for an op without a registered fake) and complete on every
device (a device
whose build lacks an op gets the pure-PyTorch reference for it, recorded in
``FALLBACKS`` so tests can insist there is none). ``forward`` and
``forward_train`` share one kernel; only the latter carries autograd (and
returns the inverse norms its backward reads under ``normalize`` on CUDA).

Both go through one ``torch.library.Library`` fragment: the decorators
``torch.library.register_fake`` / ``impl`` cost more than the rest of this
package's import (``register_fake`` records its caller's source line, which
makes ``inspect`` resolve every loaded module's path; ``impl`` makes a
library per call).
"""

from __future__ import annotations

import math
import warnings

import torch

from . import reference
from ._ops import add_op_namespace_prefix, ops
from .keys import decode_keys, encode_keys, merge_topk

FORWARD = add_op_namespace_prefix("forward")
FORWARD_TRAIN = add_op_namespace_prefix("forward_train")
FORWARD_QUANT = add_op_namespace_prefix("forward_quant")
QUANTIZE = add_op_namespace_prefix("quantize")
BLOCK_TOPK = add_op_namespace_prefix("block_topk")
DECODE_KEYS = add_op_namespace_prefix("decode_keys")
RESCORE_TOPK = add_op_namespace_prefix("rescore_topk")
BACKWARD = add_op_namespace_prefix("backward")
SEGMENTS = add_op_namespace_prefix("segments")
UNIFORM_SEGMENTS = add_op_namespace_prefix("uniform_segments")

#: (op name, dispatch key) pairs served by the Python reference.
FALLBACKS: set[tuple[str, str]] = set()

_LIB = torch.library.Library(FORWARD.split("::")[0], "FRAGMENT")


def meta_kernel(*qualnames):
    """Registers the decorated shape function as these ops' Meta kernel."""

    def register(fn):
        for name in qualnames:
            _LIB.impl(name.split("::")[1], fn, "Meta")
        return fn

    return register


def num_pairs(q_start, d_start, pair_q, layout: int) -> int:
    if layout == reference.CROSS:
        return q_start.shape[0] * d_start.shape[0]
    if layout == reference.GROUPED:
        return d_start.shape[0]
    return pair_q.shape[0]


def _argmax_empty(q, P, lq, argmax_kind):
    if argmax_kind == 0:
        return q.new_empty((0,), dtype=torch.int32)
    return q.new_empty((P, lq), dtype=torch.int16 if argmax_kind == 2 else torch.int32)


@meta_kernel(FORWARD)
def _forward_fake(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d,
                  layout, lq, argmax_kind, precision, normalize=False):
    P = num_pairs(q_start, d_start, pair_q, layout)
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((P,), dtype=sdt), _argmax_empty(q, P, lq, argmax_kind)


def _inv_norms_rows(q, d, normalize) -> int:
    """The length of forward_train's third output (torch_binding.h): the
    inverse norms of q's rows, then (from a multiple of 4) d's."""
    if not normalize:
        return 0
    tq, td = math.prod(q.shape[:-1]), math.prod(d.shape[:-1])
    return (tq + 3) // 4 * 4 + td


@meta_kernel(FORWARD_TRAIN)
def _forward_train_fake(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d,
                        layout, lq, argmax_kind, precision, normalize=False):
    scores, argmax = _forward_fake(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d,
                                   layout, lq, argmax_kind, precision, normalize)
    return scores, argmax, q.new_empty((_inv_norms_rows(q, d, normalize),), dtype=torch.float32)


@meta_kernel(FORWARD_QUANT)
def _forward_quant_fake(q, q_scale, q_start, q_len, q_mask, d, d_scale, d_start, d_len, d_mask,
                        pair_q, pair_d, layout, lq, argmax_kind, uniform_doc_scales=False):
    P = num_pairs(q_start, d_start, pair_q, layout)
    return q.new_empty((P,), dtype=torch.float32), _argmax_empty(q, P, lq, argmax_kind)


@meta_kernel(QUANTIZE)
def _quantize_fake(x, kind, scales=None):
    dp = (x.shape[1] + 15) // 16 * 16
    vt = torch.int8 if kind == 0 else torch.float8_e4m3fn
    return x.new_empty((x.shape[0], dp), dtype=vt), x.new_empty((x.shape[0],), dtype=torch.float32)


@meta_kernel(BLOCK_TOPK)
def _block_topk_fake(scores, id0, k, ids=None):
    return scores.new_empty((scores.shape[0], min(k, scores.shape[1])), dtype=torch.int64)


@meta_kernel(DECODE_KEYS)
def _decode_keys_fake(keys):
    return keys.new_empty(keys.shape, dtype=torch.float32), torch.empty_like(keys)


@meta_kernel(RESCORE_TOPK)
def _rescore_topk_fake(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, keys, lq, k):
    return keys.new_empty((keys.shape[0], k), dtype=torch.float32), keys.new_empty((keys.shape[0], k))


@meta_kernel(BACKWARD)
def _backward_fake(grad, q, q_start, q_len, d, d_start, d_len, pair_q, pair_d, argmax,
                   layout, q_ptr, q_pairs, d_ptr, d_pairs, need_dq, need_dd, normalize=False, inv_norms=None):
    dq = torch.empty_like(q) if need_dq else q.new_empty((0,))
    dd = torch.empty_like(d) if need_dd else d.new_empty((0,))
    return dq, dd


@meta_kernel(SEGMENTS)
def _segments_fake(offsets, totals, max_lens, ints, lo, hi):
    out = []
    for o in offsets:
        out += [o.new_empty((o.shape[0] - 1,), dtype=torch.int32) for _ in range(2)]
    return out + [t.new_empty(t.shape, dtype=torch.int32) for t in ints]


@meta_kernel(UNIFORM_SEGMENTS)
def _uniform_segments_fake(like, n, extent):
    return like.new_empty((n,), dtype=torch.int32), like.new_empty((n,), dtype=torch.int32)


def warn_fallback(op: str, key: str) -> None:
    warnings.warn(f"maxsim: no compiled {op} kernel for {key}; using the PyTorch reference",
                  stacklevel=3)


def _reference_forward(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d,
                       layout, lq, argmax_kind, precision, normalize=False):
    warn_fallback("forward", q.device.type)
    return reference.forward(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask,
                             pair_q, pair_d, layout, lq, argmax_kind, precision, normalize=normalize)


def _reference_forward_train(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d,
                             layout, lq, argmax_kind, precision, normalize=False):
    scores, argmax = _reference_forward(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d,
                                        layout, lq, argmax_kind, precision, normalize)
    inv = q.new_zeros((_inv_norms_rows(q, d, normalize),), dtype=torch.float32)
    if inv.numel():
        rows = [x.reshape(-1, x.shape[-1]).float() for x in (q, d)]
        norms = [torch.linalg.vector_norm(x, dim=-1).clamp_min(1e-12).reciprocal() for x in rows]
        inv[:norms[0].numel()] = norms[0]
        inv[inv.numel() - norms[1].numel():] = norms[1]
    return scores, argmax, inv


def _reference_forward_quant(q, q_scale, q_start, q_len, q_mask, d, d_scale, d_start, d_len, d_mask,
                             pair_q, pair_d, layout, lq, argmax_kind, uniform_doc_scales=False):
    warn_fallback("forward_quant", q.device.type)
    return reference.forward_quant(q, q_scale, q_start, q_len, q_mask, d, d_scale, d_start, d_len,
                                   d_mask, pair_q, pair_d, layout, lq, argmax_kind)


def _reference_quantize(x, kind, scales=None):
    warn_fallback("quantize", x.device.type)
    return reference.quantize(x, kind, scales=scales)


def _reference_block_topk(scores, id0, k, ids=None):
    warn_fallback("block_topk", scores.device.type)
    if ids is None:
        ids = torch.arange(id0, id0 + scores.shape[1], device=scores.device)[None, :]
    keys = encode_keys(scores, ids)
    return keys.topk(min(k, scores.shape[1]), dim=1).values


def _reference_decode_keys(keys):
    warn_fallback("decode_keys", keys.device.type)
    return decode_keys(keys)


def _reference_rescore_topk(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, keys, lq, k):
    warn_fallback("rescore_topk", q.device.type)
    _, ids = decode_keys(keys)
    nq, kc = keys.shape
    pair_d = torch.where(ids < d_start.shape[0], ids, -1).reshape(-1).to(torch.int32)
    pair_q = torch.arange(nq, device=keys.device, dtype=torch.int32).repeat_interleave(kc)
    s, _ = reference.forward(q, q_start, q_len, q_mask, d, d_start, d_len, d_mask, pair_q, pair_d,
                             reference.LIST, lq, 0, False)
    top = merge_topk(encode_keys(s.view(nq, kc).float(), ids), k)
    return decode_keys(top)


def _reference_backward(grad, q, q_start, q_len, d, d_start, d_len, pair_q, pair_d, argmax,
                        layout, q_ptr, q_pairs, d_ptr, d_pairs, need_dq, need_dd, normalize=False, inv_norms=None):
    warn_fallback("backward", q.device.type)
    return reference.backward(grad, q, q_start, q_len, d, d_start, d_len, pair_q, pair_d,
                              argmax, layout, q_ptr, q_pairs, d_ptr, d_pairs, need_dq, need_dd,
                              normalize=normalize)


def _reference_segments(offsets, totals, max_lens, ints, lo, hi):
    warn_fallback("segments", (offsets[0] if offsets else ints[0]).device.type)
    # An op's outputs may not alias its inputs (a start can be a view).
    return [t.clone() for t in reference.segments(offsets, totals, max_lens, ints, lo, hi)]


def _reference_uniform_segments(like, n, extent):
    warn_fallback("uniform_segments", like.device.type)
    return reference.uniform_segments(like, n, extent)


def register_fallbacks(impls) -> None:
    """Serves each ``(op, reference)`` pair from Python on the devices this
    build has no compiled kernel of the op for."""
    for key in ("CPU", "CUDA", "MPS"):
        for name, impl in impls:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
                _LIB.impl(name.split("::")[1], impl, key)
                FALLBACKS.add((name.split("::")[1], key))


register_fallbacks(((FORWARD, _reference_forward), (FORWARD_TRAIN, _reference_forward_train),
                    (FORWARD_QUANT, _reference_forward_quant), (QUANTIZE, _reference_quantize),
                    (BLOCK_TOPK, _reference_block_topk), (DECODE_KEYS, _reference_decode_keys),
                    (RESCORE_TOPK, _reference_rescore_topk), (BACKWARD, _reference_backward),
                    (SEGMENTS, _reference_segments), (UNIFORM_SEGMENTS, _reference_uniform_segments)))
