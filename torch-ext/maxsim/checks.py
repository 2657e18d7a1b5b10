"""The input contract: argument checks, the validation mode, the error class.

Checks on types, ranks, shapes, dtypes and devices run on every call and
never synchronise with the device. Checks on tensor *values* (lengths inside
their padded extent, offsets that describe a layout, pair ids in range, a
``max_query_length`` that covers every query) need one host sync, so they run
only in validation mode: per call with ``validate=True``, or process-wide with
:func:`set_validation`, the :func:`validation` context manager or the
environment variable ``MAXSIM_VALIDATE=1`` (a per-call ``validate=`` wins).
Without it, an invalid value makes the affected scores NaN instead.

Under ``torch.compile`` tracing or CUDA-graph capture a host sync would break
the graph, so validation is skipped there (with a one-time warning).
"""

from __future__ import annotations

import contextlib
import operator
import os
import warnings
from typing import Iterator, Optional

import torch

Tensor = torch.Tensor
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)
INT64_MAX = (1 << 63) - 1

__all__ = ["InputError", "set_validation", "validation", "validation_enabled"]


class InputError(ValueError, RuntimeError):
    """An argument whose values (not its type or shape) break the contract,
    or tensors on different devices. Derives from both ValueError and
    RuntimeError so that code written for either convention catches it."""


def _env_default() -> bool:
    return os.environ.get("MAXSIM_VALIDATE", "").strip().lower() in ("1", "true", "yes", "on")


_mode = {"on": _env_default(), "warned": False}


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without its import of
    torch._dynamo (hundreds of modules, most of a cold import of this
    package): the decorator only sets this attribute, which Dynamo reads
    when it traces a call (tests/test_loading.py checks they agree)."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _skipped() -> bool:
    """False, with a one-time warning. Under torch.compile it runs while
    tracing (a constant result), so the warning breaks no graph."""
    if not _mode["warned"]:
        _mode["warned"] = True
        warnings.warn("maxsim: validation is skipped under torch.compile and CUDA-graph capture "
                      "(it needs a host sync); invalid values give NaN scores there", stacklevel=4)
    return False


def set_validation(enabled: bool) -> None:
    """Turn validation mode on or off for the whole process."""
    _mode["on"] = bool(enabled)


def validation_enabled() -> bool:
    """Whether validation mode is on (the default of every ``validate=``)."""
    return _mode["on"]


@contextlib.contextmanager
def validation(enabled: bool = True) -> Iterator[None]:
    """``with maxsim.validation():`` validation mode inside the block only."""
    before = _mode["on"]
    _mode["on"] = bool(enabled)
    try:
        yield
    finally:
        _mode["on"] = before


def _capturing() -> bool:
    # Initialised CUDA is a precondition of capture; the check keeps CPU-only
    # processes from touching the CUDA runtime.
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def should_validate(validate: Optional[bool]) -> bool:
    """The call's ``validate=`` (``None``: the process-wide mode), off while
    compiling or capturing."""
    wanted = _mode["on"] if validate is None else bool(validate)
    if not wanted:
        return False
    if torch.compiler.is_compiling() or _capturing():
        return _skipped()
    return True


# ----------------------------------------------------------------------------
# static checks (no host sync)
# ----------------------------------------------------------------------------

def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_values(*named) -> None:
    """``name, tensor, ...`` (None and non-tensors skipped): tensors whose
    values will be read on the host, so not meta tensors."""
    for i in range(1, len(named), 2):
        t = named[i]
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise InputError(f"{named[i - 1]} is on the meta device: it holds no values")


def check_float(name: str, t) -> None:
    check_tensor(name, t)
    if t.dtype == torch.float64 and t.device.type == "cpu":
        return  # exact fp64 path of the CPU backend (gradient checks, references)
    if t.dtype not in FLOATS:
        extra = " (float64 only on the CPU)" if t.dtype == torch.float64 else ""
        raise TypeError(f"{name} must be float32, float16 or bfloat16{extra}, got {t.dtype}")


def check_int(name: str, t, dim: int) -> None:
    check_tensor(name, t)
    if t.dtype not in INTS:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")


def check_lengths(name: str, t, shape: tuple) -> None:
    check_int(name, t, len(shape))
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(t.shape)}")


def check_mask(name: str, t, shape) -> None:
    check_tensor(name, t)
    if t.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = real token), got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_rank(name: str, t: Tensor, dim: int, layout: str) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D {layout}, got shape {tuple(t.shape)}")


def check_same(*named) -> None:
    """``name, tensor, name, tensor, ...`` (None skipped): one device, and one
    dtype among the floating-point ones. Runs on every call: kept lean."""
    first = t0 = fname = f0 = None
    for i in range(1, len(named), 2):
        t = named[i]
        if t is None:
            continue
        if t0 is None:
            first, t0 = named[i - 1], t
        elif t.device != t0.device:
            raise InputError(f"{named[i - 1]} is on {t.device} but {first} is on {t0.device}; "
                             "all tensors must be on one device")
        if t.dtype.is_floating_point:
            if f0 is None:
                fname, f0 = named[i - 1], t
            elif t.dtype != f0.dtype:
                raise TypeError(f"{named[i - 1]} has dtype {t.dtype} but {fname} has "
                                f"{f0.dtype}; queries and documents must share a dtype")


def check_dim(qname: str, q: Tensor, dname: str, d: Tensor) -> None:
    if q.shape[-1] != d.shape[-1]:
        raise ValueError(f"embedding dim mismatch: {qname} has {q.shape[-1]}, "
                         f"{dname} has {d.shape[-1]}")
    if q.shape[-1] == 0:
        raise ValueError(f"{qname} and {dname} have embedding dim 0; it must be at least 1")


def check_count(name: str, value, low: int = 0) -> int:
    """An integer (not a bool) in [low, 2**63 - 1], as a Python int."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got a bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < low or value > INT64_MAX:
        raise ValueError(f"{name} must lie in [{low}, 2**63 - 1], got {value}")
    return value


# ----------------------------------------------------------------------------
# value checks (one host sync; validation mode only)
# ----------------------------------------------------------------------------

def validate_lengths(name: str, lengths: Tensor, extent: int) -> None:
    bad = (lengths < 0) | (lengths > extent)
    if lengths.numel() and bool(bad.any()):
        raise InputError(f"{name} must lie in [0, {extent}] (the padded extent), "
                         f"found {lengths[bad][0].item()}")


def validate_offsets(name: str, offsets: Tensor, total: int) -> None:
    if offsets.numel() == 0:
        raise InputError(f"{name} must have at least one entry (0)")
    if int(offsets[0]) != 0:
        raise InputError(f"{name}[0] must be 0, got {int(offsets[0])}")
    if int(offsets[-1]) != total:
        raise InputError(f"{name}[-1] must equal the token count {total}, got {int(offsets[-1])}")
    if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        raise InputError(f"{name} must be non-decreasing")


def validate_ids(name: str, ids: Tensor, n: int) -> None:
    bad = (ids < 0) | (ids >= n)
    if ids.numel() and bool(bad.any()):
        raise InputError(f"{name} must lie in [0, {n}), found {ids[bad][0].item()}")


def validate_max_length(name: str, bound: int, offsets: Tensor) -> None:
    """``bound`` covers every segment of (already validated) ``offsets``."""
    if offsets.numel() > 1:
        longest = int((offsets[1:] - offsets[:-1]).max())
        if longest > bound:
            raise InputError(f"{name} ({bound}) is below the longest query ({longest} tokens)")
