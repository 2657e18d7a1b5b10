"""Hypothesis fuzz over shapes, dtypes, masks and layouts against the oracle."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import DEVICES, MAXSIM as ms, assert_close, lengths_mask, rand

EXAMPLES = int(os.environ.get("MAXSIM_FUZZ_EXAMPLES", "40"))
dims = st.sampled_from([1, 3, 8, 15, 16, 17, 33, 64, 96, 128, 130])
lens = st.integers(1, 70)


def _floor(ref):
    """Scores of unit tokens that cancel to near zero are held to an absolute
    bound (1e-2 per score before the tolerance): their error is the rounding
    of terms of size ~1, not of the small sum."""
    return 1e-2 * ref.numel() ** 0.5


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
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
        assert_close(ms.maxsim(Q, D, qm, dm), ref, dtype, floor=_floor(ref))
        return
    qlen = torch.randint(0, lq + 1, (nq,), generator=g)
    if layout == "padded":
        D = rand(nq, nd, ld, dim, dtype=dtype, device=device, gen=g)
        dlen = torch.randint(0, ld + 1, (nq, nd), generator=g)
        ref = ms.maxsim_reference(Q, D, lengths_mask(qlen, lq), lengths_mask(dlen, ld).view(nq, nd, ld))
        out = ms.score_candidates_padded(Q, D, qlen.to(device), dlen.to(device))
        assert_close(out, ref, dtype, floor=_floor(ref))
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
    assert_close(out, full[pq, pd], dtype, floor=_floor(full[pq, pd]))
