"""The build is a real kernels-hub variant: it loads through `kernels` the
ways users load it, its metadata digest matches, and the device's ops are
compiled kernels, not the reference fallback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT



def test_variant_metadata_and_digest():
    from kernels._rust import Digest, DigestAlgorithm, Metadata

    variants = sorted((ROOT / "build").glob("torch*"))
    assert variants, "no build variant; run `just build`"
    for v in variants:
        meta = Metadata.read_from_file(v / "metadata.json")
        assert str(meta.name) == "maxsim" or "maxsim" in repr(meta.name)
        meta.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, v))
        assert (v / f"{meta.id}.abi3.so").exists()
        assert (v / "maxsim" / "__init__.py").exists()


def test_get_kernel_with_local_kernels_env():
    code = (
        "import kernels, torch;"
        "m = kernels.get_kernel('maxsim-kernels/maxsim', version=1, trust_remote_code=True);"
        "q = torch.randn(2, 3, 8); print(m.maxsim(q, q).shape)"
    )
    env = dict(os.environ, LOCAL_KERNELS=f"maxsim-kernels/maxsim={ROOT}", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([2, 2])" in out.stdout


@pytest.mark.parametrize("op", ["forward", "backward", "rescore_topk", "plaid_approx", "plaid_forward", "plaid_backward"])
def test_compiled_kernels_serve_present_devices(ms, device, op):
    key = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS"}[device]
    if (op, key) == ("backward", "CUDA") and (op, key) in ms.FALLBACKS:
        pytest.xfail("the CUDA backward kernel is not built yet")
    assert (op, key) not in ms.FALLBACKS, f"{device} {op} falls back to the PyTorch reference"




def test_cpu_tensors_get_compiled_kernels_on_every_variant(ms):
    """The CPU kernels are [torch] sources, so a GPU install serves CPU
    tensors with them too: no fallback, no warning, the reference's scores
    and gradients."""
    import warnings

    for op in ("forward", "forward_train", "backward", "rescore_topk", "segments", "quantize", "plaid_approx",
               "plaid_forward", "plaid_backward"):
        assert (op, "CPU") not in ms.FALLBACKS
    g = torch.Generator().manual_seed(0)
    Q = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    D = torch.randn(4, 7, 16, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = ms.maxsim(Q, D)
    expected = ms.maxsim_reference(Q.detach(), D).to(scores.dtype)
    torch.testing.assert_close(scores, expected)
    scores.sum().backward()
    Qr = Q.detach().double().requires_grad_(True)
    ms.maxsim_reference(Qr, D.double()).sum().backward()
    torch.testing.assert_close(Q.grad, Qr.grad.float())


def test_import_does_no_optional_work():
    """A fresh process that loads the package imports neither torch._dynamo
    (most of a cold load) nor the integrations' hosts (PyLate, colpali-engine,
    transformers)."""
    code = (
        "import sys, kernels; from pathlib import Path;"
        f"m = kernels.get_local_kernel(Path({str(ROOT)!r}));"
        "print(sorted(n for n in ('torch._dynamo', 'pylate', 'colpali_engine', 'transformers') if n in sys.modules))"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_constant_result_mark_matches_torch(ms):
    """checks._assume_constant_result stands in for
    torch.compiler.assume_constant_result (which imports torch._dynamo):
    both must leave the same mark on a function."""

    def a():
        return False

    def b():
        return False

    torch.compiler.assume_constant_result(a)
    ms.checks._assume_constant_result(b)
    assert a.__dict__ == b.__dict__ == {"_dynamo_marked_constant": True}


def test_release_cuda_flags_in_both_builds():
    """tools/build.py and build.toml (the kernel-builder release build)
    compile CUDA with the same release flags, and neither with -lineinfo."""
    import importlib.util
    import tomllib

    spec = importlib.util.spec_from_file_location("maxsim_build_tool", ROOT / "tools" / "build.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cfg = tomllib.loads((ROOT / "build.toml").read_text())
    sections = [k for k in cfg["kernel"].values() if k["backend"] == "cuda"]
    assert sections and tool.RELEASE_CUDA_FLAGS
    for k in sections:
        flags = k.get("cuda-flags", [])
        assert all(f in flags for f in tool.RELEASE_CUDA_FLAGS), flags
        assert "-lineinfo" not in flags
