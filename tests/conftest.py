"""Shared fixtures: the package is imported the way users load it, through
``kernels`` from the local build (``build/<variant>/``, made by
``tools/build.py``), and every test runs on each device present."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _load():
    import kernels

    return kernels.get_local_kernel(ROOT)


MAXSIM = _load()

DEVICES = ["cpu"]
if torch.cuda.is_available():
    DEVICES.append("cuda")
if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
    DEVICES.append("mps")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative error bounds vs the fp64 reference on inputs already rounded to the
# dtype (only accumulation order differs), per accumulation path.
TOL = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float64: 1e-12}


@pytest.fixture(scope="session")
def ms():
    return MAXSIM


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(params=DTYPES, ids=["fp32", "fp16", "bf16"])
def dtype(request):
    return request.param


def rand(*shape, dtype=torch.float32, device="cpu", gen=None):
    """Fresh random unit-ish tokens (never zeros) rounded to ``dtype``."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6) if shape and shape[-1] > 0 else x
    return x.to(dtype).to(device)


def relerr(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """Norm-wise relative error; ``floor`` bounds the denominator below (scores
    that cancel to near zero carry the rounding of their terms, not of their sum)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not torch.isnan(out).any(), "NaN in output"
    den = max(ref.norm().item(), floor)
    return (out - ref).norm().item() / max(den, 1e-30)


def assert_close(out, ref, dtype, factor=1.0, floor=0.0):
    err = relerr(out, ref, floor)
    assert err <= TOL[dtype] * factor, f"relative error {err:.3e} > {TOL[dtype] * factor:.1e}"


def lengths_mask(lengths: torch.Tensor, extent: int) -> torch.Tensor:
    return torch.arange(extent, device=lengths.device)[None, :] < lengths.reshape(-1, 1)


def capture_cuda_graph(fn, warmup: int = 2):
    """Warm ``fn`` up on a side stream, then capture one call in a CUDA
    graph: (graph, the captured call's outputs, refreshed by replay)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
