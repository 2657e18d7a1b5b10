"""``precision=`` of fp32 inputs: "default" (split 3xTF32 tensor cores on
CUDA), "exact" (scalar fp32), "tf32" (one TF32 product); the CPU is exact
whatever the choice. Errors against fp64 on every layout, near ties built on
purpose (the argmax must be the exact path's), NaN / inf, gradients."""

from __future__ import annotations

import pytest
import torch

from conftest import capture_cuda_graph, lengths_mask, rand, relerr

# Documented bounds (docs/api.md): relative error of the scores against fp64
# on unit-norm tokens. The CPU and the exact path meet the default's bound.
BOUND = {"default": 1e-6, "exact": 1e-6, "tf32": 2e-3}
PRECISIONS = list(BOUND)


def _on_tensor_cores(device):
    return device == "cuda"


def test_precision_keyword(ms):
    Q, D = rand(2, 3, 8), rand(4, 5, 8)
    ref = ms.maxsim(Q, D, precision="exact")
    for kw in (dict(precision="default"), dict(precision="tf32"), dict(tf32=True),
               dict(tf32=True, precision="tf32"), dict()):
        assert torch.equal(ms.maxsim(Q, D, **kw), ref), kw  # the CPU is exact whatever the choice
    with pytest.raises(ValueError, match="conflicts"):
        ms.maxsim(Q, D, tf32=True, precision="exact")
    with pytest.raises(ValueError, match="precision must be one of"):
        ms.maxsim(Q, D, precision="fast")
    with pytest.raises(ValueError, match="conflicts"):
        ms.score_contrastive(Q, D.reshape(-1, 8), torch.arange(0, 21, 5), tf32=True, precision="default")
    assert ms.explain(Q, D, precision="exact")["family"] == "simt"
    assert ms.explain(Q, D)["split"] == 1
    assert ms.explain(Q, D, tf32=True)["split"] == 0


def _layouts(ms, Q, D, qlen, dlen, precision, argmax):
    """(name, scores, argmax or None, fp64 reference scores) of every public
    layout on the same tokens: padded candidates, contrastive (packed
    documents), packed pairs, maxsim() with masks."""
    B, K, Ld, dim = D.shape
    Lq = Q.shape[1]
    qm = lengths_mask(qlen, Lq)
    dm = lengths_mask(dlen.reshape(-1), Ld).view(B, K, Ld)
    ref_g = ms.maxsim_reference(Q.double(), D.double(), qm, dm)
    out = []
    f = ms.score_candidates_padded_with_argmax if argmax else ms.score_candidates_padded
    r = f(Q, D, qlen, dlen, precision=precision)
    out.append(("padded", *(r if argmax else (r, None)), ref_g))
    # Contrastive over the first query group's documents, packed.
    docs = [D[0, k, :int(dlen[0, k])] for k in range(K)]
    packed = torch.cat(docs)
    off = torch.tensor([0] + [int(x) for x in dlen[0].cumsum(0)], device=Q.device)
    ref_c = torch.stack([ms.maxsim_reference(Q[b:b + 1, :int(qlen[b])].double(), D[0:1].double(),
                                             None, dm[0:1])[0] for b in range(B)])
    f = ms.score_contrastive_with_argmax if argmax else ms.score_contrastive
    r = f(Q, packed, off, qlen, precision=precision)
    out.append(("contrastive", *(r if argmax else (r, None)), ref_c.view(B, K)))
    # Pairs: each query with its own candidates (the padded layout's pairs).
    qpacked = torch.cat([Q[b, :int(qlen[b])] for b in range(B)])
    qoff = torch.tensor([0] + [int(x) for x in qlen.cumsum(0)], device=Q.device)
    dpacked = torch.cat([D[b, k, :int(dlen[b, k])] for b in range(B) for k in range(K)])
    doff = torch.tensor([0] + [int(x) for x in dlen.reshape(-1).cumsum(0)], device=Q.device)
    pq = torch.arange(B, device=Q.device).repeat_interleave(K)
    pd = torch.arange(B * K, device=Q.device)
    f = ms.score_pairs_packed_with_argmax if argmax else ms.score_pairs_packed
    r = f(qpacked, qoff, dpacked, doff, pq, pd, max_query_length=Lq, precision=precision)
    out.append(("pairs", *(r if argmax else (r, None)), ref_g.reshape(-1)))
    if not argmax:
        out.append(("maxsim-masks", ms.maxsim(Q, D, qm, dm, precision=precision), None, ref_g))
        out.append(("maxsim-normalize", ms.maxsim(Q * 3.0, D, qm, dm, normalize=True, precision=precision),
                    None, ref_g))
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (2, 3, 15, 17, 33), (3, 2, 33, 15, 17),
                                   (2, 3, 32, 300, 128), (1, 2, 17, 1031, 64), (2, 2, 129, 40, 128)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("argmax", [False, True], ids=["scores", "argmax"])
def test_layouts_against_fp64(ms, device, precision, shape, argmax):
    B, K, Lq, Ld, dim = shape
    g = torch.Generator().manual_seed(B * 7919 + Ld * 31 + dim)
    Q = rand(B, Lq, dim, device=device, gen=g)
    D = rand(B, K, Ld, dim, device=device, gen=g)
    qlen = torch.randint(1, Lq + 1, (B,), generator=g).to(device)
    dlen = torch.randint(1, Ld + 1, (B, K), generator=g).to(device)
    exact = dict((n, (s, a)) for n, s, a, _ in _layouts(ms, Q, D, qlen, dlen, "exact", argmax))
    for name, s, am, ref in _layouts(ms, Q, D, qlen, dlen, precision, argmax):
        assert s.dtype == torch.float32
        err = relerr(s, ref)
        assert err <= BOUND[precision], f"{name}: relative error {err:.2e} > {BOUND[precision]:.0e}"
        if am is not None and precision == "default":
            # Random unit tokens: no near ties at this size, so the same argmax.
            assert torch.equal(am.cpu(), exact[name][1].cpu()), name


def _near_ties(n_rows, dim, gap, gen):
    """Queries [n_rows, 1, dim] and documents [n_rows, 4, dim] where tokens a
    and b of each document have dots with the query q that differ by +-gap
    (b wins in even rows, a in odd ones), the winner's index alternating
    low / high; the other tokens score far lower. Token b = a + a component
    along q giving the gap + noise orthogonal to q of size 1e-3, so that a
    TF32 rounding of the two tokens differs by ~1e-4 in the dot."""
    q = torch.randn(n_rows, dim, generator=gen, dtype=torch.float64)
    q = q / q.norm(dim=1, keepdim=True)
    a = 0.9 * q + 0.3 * torch.randn(n_rows, dim, generator=gen, dtype=torch.float64) / dim ** 0.5
    noise = torch.randn(n_rows, dim, generator=gen, dtype=torch.float64)
    noise = noise - (noise * q).sum(1, keepdim=True) * q
    noise = 1e-3 * noise / noise.norm(dim=1, keepdim=True)
    sign = torch.where(torch.arange(n_rows) % 2 == 0, 1.0, -1.0).double()[:, None]
    b = a + sign * gap * q + noise
    a, b, q = a.float(), b.float(), q.float()
    # The dots of the rounded fp32 tokens, in fp64: the gap must survive rounding.
    da = (a.double() * q.double()).sum(1)
    db = (b.double() * q.double()).sum(1)
    filler = 0.05 * torch.randn(n_rows, 2, dim, generator=gen, dtype=torch.float64).float()
    D = torch.stack([a, filler[:, 0], b, filler[:, 1]], dim=1)
    swap = torch.arange(n_rows) % 4 >= 2  # winner at index 0 or 2
    D[swap, 0], D[swap, 2] = b[swap], a[swap]
    win_b = db > da
    want = torch.where(win_b ^ swap, 2, 0)
    return q[:, None, :], D, want, (db - da).abs()


def test_near_ties_argmax(ms, device):
    """Two document tokens whose dots differ by 2e-5 (below the TF32 bound,
    far above the split one): the default path's argmax is the exact one."""
    g = torch.Generator().manual_seed(51)
    n = 4096
    Q, D, want, gap = _near_ties(n, 128, 2e-5, g)
    assert bool((gap > 1e-5).all())
    Q, D = Q.to(device), D.to(device)
    s_ex, a_ex = ms.score_candidates_padded_with_argmax(Q, D[:, None], precision="exact")
    assert torch.equal(a_ex.view(n).cpu().long(), want)
    s, a = ms.score_candidates_padded_with_argmax(Q, D[:, None], precision="default")
    assert torch.equal(a.view(n).cpu(), a_ex.view(n).cpu())
    ref = (Q.double().cpu() @ D.double().cpu().transpose(1, 2)).amax(-1).view(n, 1)
    assert relerr(s, ref) <= 2e-6  # single dots: the per-dot bound (docs/api.md), no averaging over rows
    # The same rows through the contrastive and packed-pair layouts.
    off = torch.arange(0, 4 * n + 1, 4, device=device)
    _, a2 = ms.score_pairs_packed_with_argmax(Q.reshape(n, -1), torch.arange(n + 1, device=device),
                                              D.reshape(-1, 128), off, torch.arange(n, device=device),
                                              torch.arange(n, device=device), max_query_length=1)
    assert torch.equal(a2.view(n).cpu(), a_ex.view(n).cpu())
    if _on_tensor_cores(device):
        # The test can fail: one TF32 product gets a share of these rows wrong.
        _, a32 = ms.score_candidates_padded_with_argmax(Q, D[:, None], precision="tf32")
        assert (a32.view(n).cpu() != a_ex.view(n).cpu()).sum() > n // 50


@pytest.mark.parametrize("precision", PRECISIONS)
def test_nan_inf(ms, device, precision):
    """NaN in a product makes the score NaN, as on the exact path; an inf
    token gives the exact path's +-inf or, on the tensor cores, NaN (an inf
    times a split part that is 0: docs/api.md); finite scores agree."""
    Q = rand(3, 17, 64, device=device)
    D = rand(4, 40, 64, device=device)
    D[1, 7, 3] = float("nan")
    D[2, 5, :] = float("inf")  # +inf dot unless the query row sums to a NaN
    Q[2, 4, 9] = float("-inf")
    out = ms.maxsim(Q, D, precision=precision)
    ex = ms.maxsim(Q, D, precision="exact")
    assert bool(torch.isnan(ex).any()) and bool(torch.isinf(ex).any())  # the test covers both
    assert bool(torch.isnan(out[torch.isnan(ex)]).all())
    inf = torch.isinf(ex)
    assert bool(((out[inf] == ex[inf]) | torch.isnan(out[inf])).all())
    if not _on_tensor_cores(device) or precision == "exact":
        assert torch.equal(out[inf], ex[inf])
    fin = torch.isfinite(ex)
    assert bool(torch.isfinite(out[fin]).all())
    assert relerr(out[fin], ex[fin].double()) <= BOUND[precision]


@pytest.mark.parametrize("precision", ["default", "exact"])  # tf32 may flip argmax on near ties
@pytest.mark.parametrize("layout", ["contrastive", "padded", "pairs"])
def test_gradients_fp64(ms, device, precision, layout):
    """fp32 training: scores and gradients within 1e-5 of fp64 (the backward
    gathers the saved argmax's rows exactly; the forward is the chosen path)."""
    g = torch.Generator().manual_seed(5)
    B, K, Lq, Ld, dim = 4, 3, 32, 180, 128
    Q = rand(B, Lq, dim, gen=g)
    D = rand(B, K, Ld, dim, gen=g)
    w = torch.randn(B, K, generator=g, dtype=torch.float64)

    def run(Q, D, dev):
        Qd = Q.clone().to(dev).requires_grad_()
        Dd = D.clone().to(dev).requires_grad_()
        if layout == "padded":
            s = ms.score_candidates_padded_train(Qd, Dd, precision=precision)
        elif layout == "contrastive":
            # Query b against every document; its own candidates are columns b*K .. b*K+K-1.
            off = torch.arange(0, B * K * Ld + 1, Ld, device=dev)
            s = ms.score_contrastive_train(Qd, Dd.reshape(-1, dim), off, precision=precision)
            s = s.view(B, B, K)[torch.arange(B), torch.arange(B)]
        else:
            s = ms.score_pairs_packed_train(
                Qd.reshape(-1, dim), torch.arange(0, B * Lq + 1, Lq, device=dev), Dd.reshape(-1, dim),
                torch.arange(0, B * K * Ld + 1, Ld, device=dev),
                torch.arange(B, device=dev).repeat_interleave(K), torch.arange(B * K, device=dev),
                max_query_length=Lq, precision=precision).view(B, K)
        (s.double() * w.to(dev)).sum().backward()
        return s.detach().double().cpu(), Qd.grad.double().cpu(), Dd.grad.double().cpu()

    s, gq, gd = run(Q, D, device)
    s64, gq64, gd64 = run(Q.double(), D.double(), "cpu")  # fp64: the CPU's exact path
    assert relerr(s, s64) <= 1e-6
    assert relerr(gq, gq64) <= 1e-5 and relerr(gd, gd64) <= 1e-5


@pytest.mark.parametrize("precision", ["default", "exact"])
def test_compile_and_graph(ms, device, precision):
    """precision= under torch.compile(fullgraph=True) (fake impls), from a
    cold index cache (shapes no other test uses), and in a CUDA graph."""
    Q, D = rand(2, 9, 32, device=device), rand(5, 20, 32, device=device)
    ref = ms.maxsim_reference(Q.double(), D.double())
    f = torch.compile(lambda q, d: ms.maxsim(q, d, precision=precision), fullgraph=True, backend="aot_eager")
    assert relerr(f(Q, D), ref) <= 1e-6
    if device == "cuda":
        Q2, D2 = Q.clone(), D.clone()
        graph, out = capture_cuda_graph(lambda: ms.score_contrastive_with_argmax(
            Q2, D2.reshape(-1, 32), torch.arange(0, 101, 20, device=device), precision=precision))
        Q2.copy_(rand(2, 9, 32, device=device))
        graph.replay()
        s, am = ms.score_contrastive_with_argmax(Q2, D2.reshape(-1, 32), torch.arange(0, 101, 20, device=device),
                                                 precision=precision)
        assert torch.equal(out[0], s) and torch.equal(out[1], am)
