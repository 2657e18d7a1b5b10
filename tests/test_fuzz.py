"""Hypothesis fuzz over shapes, dtypes, masks and layouts against the oracle."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import DEVICES, MAXSIM as ms, assert_close, lengths_mask, rand

EXAMPLES = int(os.environ.get("MAXSIM_FUZZ_EXAMPLES", "40"))
# The suite (and CI) runs a fixed, reproducible set of examples; set
# MAXSIM_FUZZ_RANDOM=1 (with many examples) to explore new ones.
DERANDOMIZE = not os.environ.get("MAXSIM_FUZZ_RANDOM")
dims = st.sampled_from([1, 3, 8, 15, 16, 17, 33, 64, 96, 128, 130])
lens = st.integers(1, 70)


def _floor(ref, lq=1, term=1.0):
    """Scores that cancel to near zero are held to an absolute bound: their
    error is the rounding of their lq terms (size <= ``term``: 1 for unit
    tokens), which accumulates like sqrt(lq), not the rounding of the small
    sum. 1e-2 per score and unit term before the tolerance. (Found by a
    random run: a 51-row sum of cosines of 0.0145, off by 3e-7 in fp32.)"""
    return 1e-2 * (ref.numel() * lq) ** 0.5 * term


@settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE, suppress_health_check=list(HealthCheck))
@given(
    device=st.sampled_from(DEVICES),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    layout=st.sampled_from(["cross", "grouped", "padded", "pairs"]),
    nq=st.integers(1, 4), nd=st.integers(1, 5), lq=lens, ld=lens, dim=dims,
    masked=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_forward(device, dtype, layout, nq, nd, lq, ld, dim, masked, seed):
    assume(dtype != torch.float64 or device == "cpu")  # fp64: the CPU's exact path
    g = torch.Generator().manual_seed(seed)
    Q = rand(nq, lq, dim, dtype=dtype, device=device, gen=g)
    qm = (torch.rand(nq, lq, generator=g) > 0.3).to(device) if masked else None
    if layout in ("cross", "grouped"):
        D = rand(*((nd,) if layout == "cross" else (nq, nd)), ld, dim, dtype=dtype, device=device, gen=g)
        dm = (torch.rand(D.shape[:-1], generator=g) > 0.3).to(device) if masked else None
        ref = ms.maxsim_reference(Q, D, qm, dm)
        assert_close(ms.maxsim(Q, D, qm, dm), ref, dtype, floor=_floor(ref, lq))
        return
    qlen = torch.randint(0, lq + 1, (nq,), generator=g)
    if layout == "padded":
        D = rand(nq, nd, ld, dim, dtype=dtype, device=device, gen=g)
        dlen = torch.randint(0, ld + 1, (nq, nd), generator=g)
        ref = ms.maxsim_reference(Q, D, lengths_mask(qlen, lq), lengths_mask(dlen, ld).view(nq, nd, ld))
        out = ms.score_candidates_padded(Q, D, qlen.to(device), dlen.to(device))
        assert_close(out, ref, dtype, floor=_floor(ref, lq))
        return
    dlen = torch.randint(0, ld + 1, (nd,), generator=g)
    qoff = torch.cat([torch.zeros(1, dtype=torch.long), qlen.cumsum(0)])
    doff = torch.cat([torch.zeros(1, dtype=torch.long), dlen.cumsum(0)])
    q = torch.cat([Q[i, : qlen[i]] for i in range(nq)])
    D = rand(nd, ld, dim, dtype=dtype, device=device, gen=g)
    d = torch.cat([D[i, : dlen[i]] for i in range(nd)])
    P = int(torch.randint(1, 3 * nq * nd + 1, (1,), generator=g))
    pq = torch.randint(0, nq, (P,), generator=g)
    pd = torch.randint(0, nd, (P,), generator=g)
    full = ms.maxsim_reference(Q, D, lengths_mask(qlen, lq), lengths_mask(dlen, ld))
    out = ms.score_pairs_packed(q, qoff.to(device), d, doff.to(device), pq.to(device), pd.to(device))
    assert_close(out, full[pq, pd], dtype, floor=_floor(full[pq, pd], lq))


# Gradients: bf16 / fp16 outputs are rounded once, so a few-element gradient
# can sit a full rounding step from the fp64 value.
# fp32: 3e-5 here (1e-5 in test_train on typical data): fuzzed gradients sum up
# to ~100 fp32 products of mixed sign per element, and a norm-wise relative
# error of a cancelling sum exceeds 1e-5 with correct fp32 accumulation
# (CPU example: pairs, lq 46, dim 3: 1.4e-5).
GRAD_TOL = {torch.float32: 3e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def _nrm(x, on):
    return torch.nn.functional.normalize(x, dim=-1) if on else x


@settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE, suppress_health_check=list(HealthCheck))
@given(
    device=st.sampled_from(DEVICES),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    layout=st.sampled_from(["cross", "grouped", "padded", "pairs"]),
    nq=st.integers(1, 4), nd=st.integers(1, 5), lq=lens, ld=lens, dim=dims,
    masked=st.booleans(), normalize=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_train(device, dtype, layout, nq, nd, lq, ld, dim, masked, normalize, seed):
    """Both gradients of every _train surface (and maxsim()) against fp64
    autograd through the reference, with masks / lengths and normalize."""
    g = torch.Generator().manual_seed(seed)
    Q0 = (torch.randn(nq, lq, dim, generator=g) * (3 if normalize else 1)).to(dtype)
    if layout == "cross":
        D0 = torch.randn(nd, ld, dim, generator=g).to(dtype)
    else:
        D0 = torch.randn(nq, nd, ld, dim, generator=g).to(dtype)
    qm = torch.rand(nq, lq, generator=g) > 0.3 if masked else None
    dm = torch.rand(D0.shape[:-1], generator=g) > 0.3 if masked else None
    qlen = torch.randint(0, lq + 1, (nq,), generator=g)
    dlen = torch.randint(0, ld + 1, D0.shape[:-2], generator=g)
    Q, D = Q0.clone().to(device).requires_grad_(), D0.clone().to(device).requires_grad_()
    Qr, Dr = Q0.double().requires_grad_(), D0.double().requires_grad_()
    Qn, Dn = _nrm(Qr, normalize), _nrm(Dr, normalize)
    if layout in ("cross", "grouped"):
        out = ms.maxsim(Q, D, None if qm is None else qm.to(device), None if dm is None else dm.to(device),
                        normalize=normalize)
        ref = ms.maxsim_reference(Qn, Dn, qm, dm)
    elif layout == "padded":
        out = ms.score_candidates_padded_train(Q, D, qlen.to(device), dlen.to(device), normalize=normalize)
        ref = ms.maxsim_reference(Qn, Dn, lengths_mask(qlen, lq), lengths_mask(dlen, ld).view(nq, nd, ld))
    else:  # packed pairs over the first lengths of each query / document
        dlen = dlen[0]
        qoff = torch.cat([torch.zeros(1, dtype=torch.long), qlen.cumsum(0)])
        doff = torch.cat([torch.zeros(1, dtype=torch.long), dlen.cumsum(0)])
        P = int(torch.randint(1, 3 * nq * nd + 1, (1,), generator=g))
        pq, pd = torch.randint(0, nq, (P,), generator=g), torch.randint(0, nd, (P,), generator=g)
        q = torch.cat([Q0[i, : qlen[i]] for i in range(nq)]).to(device).requires_grad_()
        d = torch.cat([D0[0, j, : dlen[j]] for j in range(nd)]).to(device).requires_grad_()
        Q, D = q, d  # the tensors whose gradients are checked
        qr = torch.cat([Q0[i, : qlen[i]] for i in range(nq)]).double().requires_grad_()
        dr = torch.cat([D0[0, j, : dlen[j]] for j in range(nd)]).double().requires_grad_()
        Qr, Dr = qr, dr
        qn, dn = _nrm(qr, normalize), _nrm(dr, normalize)
        out = ms.score_pairs_packed_train(q, qoff.to(device), d, doff.to(device), pq.to(device), pd.to(device),
                                          max_query_length=lq, normalize=normalize)
        sims = []
        for p in range(P):
            a, b = qn[qoff[pq[p]]: qoff[pq[p] + 1]], dn[doff[pd[p]]: doff[pd[p] + 1]]
            sims.append((a @ b.T).max(dim=1).values.sum() if len(a) and len(b) else qn.sum() * 0)
        ref = torch.stack(sims)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * w.to(device)).sum().backward()
    (ref * w).sum().backward()
    term = 1.0 if normalize else (Q0.double().norm(dim=-1).max() * D0.double().norm(dim=-1).max()).item()
    assert_close(out.detach(), ref.detach(), torch.float32, floor=_floor(ref, lq, max(term, 1e-6)))
    for got, exp, x in ((Q.grad, Qr.grad, Qr), (D.grad, Dr.grad, Dr)):
        assert got.dtype == dtype
        exp = torch.zeros(got.shape, dtype=torch.float64) if exp is None else exp  # nothing selected
        # With normalize, a row's gradient is (g - x^ <x^, g>) / |x|: terms of
        # size |g| / |x| that can cancel to ~0 (always for dim 1), so the bound
        # is absolute at that scale (fp32 rounding of the terms, not of the sum).
        scale = 1.0
        if normalize and x.numel():
            scale = max(1.0, (1.0 / x.detach().norm(dim=-1).clamp_min(1e-12)).max().item())
        floor = 1e-2 if scale == 1.0 else 4e-2 * scale
        err = ((got.double().cpu() - exp).norm() / max(exp.norm().item(), floor)).item()
        assert err <= GRAD_TOL[dtype], f"grad relative error {err:.2e}"
