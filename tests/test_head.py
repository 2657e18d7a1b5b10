"""maxsim_from_hidden: MaxSim through a projection head, against an fp64
reference, in one chunk and in many, forward and gradients of every input."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, relerr


def _inputs(device, Nq, Lq, Nd, Ld, dm, do, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q = torch.nn.functional.normalize(torch.randn(Nq, Lq, do, generator=g), dim=-1).to(device)
    H = torch.randn(Nd, Ld, dm, generator=g).to(device)
    W = (torch.randn(do, dm, generator=g) / dm ** 0.5).to(device)
    b = (0.1 * torch.randn(do, generator=g)).to(device) if bias else None
    return Q, H, W, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("chunk_mib", [256, 0])  # 0: one document per chunk
def test_from_hidden_forward_and_gradients(ms, device, bias, normalize, chunk_mib):
    Q, H, W, b = _inputs(device, 2, 17, 5, 33, 48, 15, bias)
    d_mask = torch.ones(5, 33, dtype=torch.bool, device=device)
    d_mask[1, 7:] = False
    d_mask[3] = False  # an empty document
    leaves = [t.clone().requires_grad_(True) for t in (Q, H, W) + ((b,) if bias else ())]
    out = ms.maxsim_from_hidden(*leaves[:3], leaves[3] if bias else None, d_mask, normalize=normalize,
                                chunk_mib=chunk_mib)
    refs = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = ms.head.maxsim_from_hidden_reference(*refs[:3], refs[3] if bias else None, d_mask, normalize=normalize)
    assert out.shape == (2, 5) and relerr(out, ref, floor=1.0) < 1e-5
    assert torch.all(out[:, 3] == 0)
    gout = torch.randn(2, 5, generator=torch.Generator().manual_seed(9)).to(device)
    (out * gout).sum().backward()
    (ref * gout.double()).sum().backward()
    for a, r, name in zip(leaves, refs, "QHWb"):
        assert relerr(a.grad, r.grad) < 1e-4, name


@pytest.mark.parametrize("device", DEVICES)
def test_from_hidden_bf16_and_2d_query(ms, device):
    Q, H, W, b = _inputs(device, 1, 9, 4, 20, 64, 32, True, seed=1)
    out = ms.maxsim_from_hidden(Q[0].bfloat16(), H.bfloat16(), W.bfloat16(), b.bfloat16())
    ref = ms.head.maxsim_from_hidden_reference(Q[0], H, W, b)
    assert out.shape == (4,) and relerr(out, ref, floor=1.0) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_hidden_shared_winners(ms, device, dtype):
    """Many query tokens picking the same few document rows, every gradient
    against fp64, and the same gradients twice (deterministic)."""
    Q, H, W, b = _inputs(device, 6, 40, 3, 4, 56, 24, True, seed=6)
    Q = Q.to(dtype)
    H, W, b = H.to(dtype), W.to(dtype), b.to(dtype)
    d_mask = torch.zeros(3, 4, dtype=torch.bool, device=device)
    d_mask[:, :2] = True
    d_mask[2, 1] = False  # a document of one token: every query token picks it
    q_mask = torch.ones(6, 40, dtype=torch.bool, device=device)
    q_mask[4, 3:] = False
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_(True) for t in (Q, H, W, b)]
        out = ms.maxsim_from_hidden(*leaves, d_mask, q_mask=q_mask)
        gout = torch.randn(6, 3, generator=torch.Generator().manual_seed(7)).to(device)
        (out * gout).sum().backward()
        grads.append([t.grad for t in leaves])
    refs = [t.detach().double().requires_grad_(True) for t in (Q, H, W, b)]
    ref = ms.head.maxsim_from_hidden_reference(*refs, d_mask, q_mask=q_mask)
    (ref * gout.double()).sum().backward()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert relerr(out, ref, floor=1.0) < tol / 10
    for a, a2, r, name in zip(grads[0], grads[1], refs, "QHWb"):
        assert a.dtype == dtype and relerr(a, r.grad) < tol, name
        assert torch.equal(a, a2), name
    assert torch.all(grads[0][1][:, 2:] == 0)  # masked rows get nothing


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_mib", [256, 0])  # 0: one query (and its candidates) per chunk
def test_from_hidden_candidates(ms, device, chunk_mib):
    """Each query's own K candidates, H [Nq, K, Ld, d_model] -> [Nq, K]:
    masks (an empty candidate, a padded query), forward and every gradient
    against fp64, in one chunk and one query per chunk."""
    g = torch.Generator().manual_seed(4)
    Nq, K, Lq, Ld, dm, do = 3, 4, 9, 17, 40, 15
    Q = torch.nn.functional.normalize(torch.randn(Nq, Lq, do, generator=g), dim=-1).to(device)
    H = torch.randn(Nq, K, Ld, dm, generator=g).to(device)
    W = (torch.randn(do, dm, generator=g) / dm ** 0.5).to(device)
    b = (0.1 * torch.randn(do, generator=g)).to(device)
    d_mask = torch.rand(Nq, K, Ld, generator=g).to(device) > 0.3
    d_mask[1, 2] = False
    q_mask = torch.ones(Nq, Lq, dtype=torch.bool, device=device)
    q_mask[2, 5:] = False
    leaves = [t.clone().requires_grad_(True) for t in (Q, H, W, b)]
    out = ms.maxsim_from_hidden(*leaves, d_mask, q_mask=q_mask, chunk_mib=chunk_mib)
    refs = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = ms.head.maxsim_from_hidden_reference(*refs, d_mask, q_mask=q_mask)
    assert out.shape == (Nq, K) and relerr(out, ref, floor=1.0) < 1e-5
    assert out[1, 2] == 0
    gout = torch.randn(Nq, K, generator=torch.Generator().manual_seed(5)).to(device)
    (out * gout).sum().backward()
    (ref * gout.double()).sum().backward()
    for a, r, name in zip(leaves, refs, "QHWb"):
        assert relerr(a.grad, r.grad) < 1e-4, name
    with pytest.raises(ValueError):
        ms.maxsim_from_hidden(Q[0], H, W, b)  # a 2-D query with per-query candidates
