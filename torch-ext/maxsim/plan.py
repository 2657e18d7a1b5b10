"""Which CUDA kernel runs a call: ``explain`` shows the forward planner's plan.

The CUDA forward's path (kernel family, tile configuration, document split,
grid) is decided by one pure function, ``plan_forward`` in
``torch-ext/forward_plan.h``; the ``plan_forward`` op exposes it on every
backend, so the plan can be read (and tested) without a GPU.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Union

import torch
from torch import Tensor

from ._registry import ops
from .lowering import precision_code

_CROSS, _GROUPED = 0, 1
_DEFAULT_ARCH, _DEFAULT_SMS = 90, 132  # H100 / H200 (sm_90a)


def _arch_number(arch: Union[int, str]) -> int:
    """90 from 90, "9.0a", "sm_90a" or "90"."""
    if isinstance(arch, int):
        return arch
    text = str(arch).lower().removeprefix("sm_").rstrip("a")
    if "." in text:
        major, minor = text.split(".")
        return int(major) * 10 + int(minor)
    return int(text)


def _ptr_align(*tensors: Tensor) -> int:
    """The largest of 16, 8, 4, 2, 1 dividing every token pointer the kernels
    read (a non-contiguous or meta tensor: its fresh contiguous copy, 16)."""
    bits = 0
    for t in tensors:
        if t.is_contiguous() and t.device.type != "meta":
            bits |= t.data_ptr()
    for v in (16, 8, 4, 2):
        if bits % v == 0:
            return v
    return 1


def explain(Q: Tensor, D: Tensor, q_mask: Optional[Tensor] = None, d_mask: Optional[Tensor] = None, *,
            normalize: bool = False, precision: Optional[str] = None, tf32: bool = False,
            arch: Union[int, str, None] = None, sm_count: Optional[int] = None,
            force: Optional[str] = None) -> dict:
    """The CUDA forward plan of ``maxsim.maxsim(Q, D, q_mask, d_mask, normalize=, precision=)``.

    Returns a dict with ``family`` (``"stream"``, ``"stream_wg"``, ``"mma"``,
    ``"wgmma"``, ``"simt"``, ``"packed"`` or ``"none"``) and the plan's integers (e.g.
    ``cfg``, ``splits``, ``grid``; ``split`` 1 on ``"mma"`` when fp32 tokens
    take split 3xTF32 products, 0 for one TF32 product or 16/8-bit tokens;
    ``run`` on ``"stream"`` / ``"stream_wg"``: pairs per warp's (CTA's) run of
    one query's consecutive documents, 0 for one pair per warp (CTA) or split
    pairs).
    On a CUDA tensor with no override the plan is the device's own (its occupancy included). ``arch`` (``"9.0a"``,
    ``"8.0"``, or 90 / 80 / 86 / 89) and ``sm_count`` plan for another device,
    from a model of its shared memory and occupancy (default for CPU tensors:
    sm_90a with 132 SMs); ``force`` names a family to take where it can, or
    one of ``STREAM_MODES`` (default: the one ``forcing`` set, if any).
    Masks do not change the plan; meta tensors plan shapes without memory.
    """
    if D.dim() not in (3, 4) or Q.dim() != 3:
        raise ValueError("Q must be [Nq, Lq, d] and D [Nd, Ld, d] or [Nq, K, Ld, d]")
    Nq, Lq, dim = Q.shape
    n_docs = D.shape[0] * (D.shape[1] if D.dim() == 4 else 1)
    layout = _GROUPED if D.dim() == 4 else _CROSS
    pairs = n_docs if layout == _GROUPED else Nq * n_docs
    train = torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    if arch is None and Q.is_cuda:
        arch_n, sms = -1, -1 if sm_count is None else sm_count
    else:
        arch_n = _DEFAULT_ARCH if arch is None else _arch_number(arch)
        sms = (_DEFAULT_SMS if arch is None else -1) if sm_count is None else sm_count
    words = ops.plan_forward(layout, Nq, n_docs, Nq * Lq, n_docs * D.shape[-2], pairs, Lq, dim, Q.dtype,
                             False, False, train, precision_code(precision, tf32), normalize, _ptr_align(Q, D),
                             arch_n, sms, force or "")
    plan = {}
    for word in words.split():
        key, _, value = word.partition("=")
        plan[key] = value if key == "family" else int(value)
    return plan


FAMILIES = ("stream", "stream_wg", "mma", "wgmma", "simt", "packed")
# The register stream ("stream") and the staged wgmma stream ("stream_wg")
# with their runs of pairs forced on (the longest runs, wherever they can
# take the call) or off (one pair per warp or CTA).
STREAM_MODES = ("stream_run", "stream_pair", "stream_wg_run", "stream_wg_pair")


@contextmanager
def forcing(family: str) -> Iterator[None]:
    """Run the CUDA forward calls of this thread in ``family`` wherever it can
    take them (the planner's override, for benchmarks and tests): one of
    ``FAMILIES`` or ``STREAM_MODES``. Decisions are made when a call is issued, so a CUDA graph
    captured inside keeps the forced path. Nests; restores the previous
    override on exit.
    """
    if family not in FAMILIES + STREAM_MODES:
        raise ValueError(f"forcing: family must be one of {FAMILIES + STREAM_MODES}, not {family!r}")
    previous = ops.set_forced_family(family)
    try:
        yield
    finally:
        ops.set_forced_family(previous)
