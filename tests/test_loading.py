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
