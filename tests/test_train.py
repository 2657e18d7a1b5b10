"""Gradients of the _train variants and maxsim() against fp64 autograd."""

from __future__ import annotations

import pytest
import torch

from conftest import lengths_mask, rand, relerr

GRAD_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-3}


def _ref_grads(ms, Q, D, qmask, dmask, g):
    Qr = Q.detach().double().cpu().requires_grad_()
    Dr = D.detach().double().cpu().requires_grad_()
    s = ms.maxsim_reference(Qr, Dr, None if qmask is None else qmask.cpu(),
                            None if dmask is None else dmask.cpu())
    (s * g.double().cpu()).sum().backward()
    return s.detach(), Qr.grad, Dr.grad


def _cmp(out, ref, dtype):
    assert out.dtype == dtype
    err = relerr(out, ref)
    assert err <= GRAD_TOL[dtype], f"grad relative error {err:.2e}"


@pytest.mark.parametrize("shape", [(2, 3, 15, 17, 33), (3, 2, 32, 80, 128), (1, 1, 1, 1, 1)])
def test_candidates_train(ms, device, dtype, shape):
    B, K, Lq, Ld, dim = shape
    gen = torch.Generator().manual_seed(3)
    Q = rand(B, Lq, dim, dtype=dtype, device=device, gen=gen).requires_grad_()
    D = rand(B, K, Ld, dim, dtype=dtype, device=device, gen=gen).requires_grad_()
    qlen = torch.randint(1, Lq + 1, (B,), generator=gen)
    dlen = torch.randint(0, Ld + 1, (B, K), generator=gen)
    g = torch.randn(B, K, generator=gen)
    s = ms.score_candidates_padded_train(Q, D, qlen.to(device), dlen.to(device))
    (s * g.to(device)).sum().backward()
    qm, dm = lengths_mask(qlen, Lq), lengths_mask(dlen, Ld).view(B, K, Ld)
    sr, gq, gd = _ref_grads(ms, Q, D, qm, dm, g)
    assert relerr(s.detach(), sr) < 1e-5
    _cmp(Q.grad, gq, dtype)
    _cmp(D.grad, gd, dtype)
    # padding gets exactly zero gradient
    assert torch.all(Q.grad.cpu()[~qm] == 0)
    assert torch.all(D.grad.cpu()[~dm] == 0)


def test_contrastive_train(ms, device, dtype):
    gen = torch.Generator().manual_seed(4)
    Nq, Nb, Lq, Ld, dim = 4, 5, 9, 21, 48
    Q = rand(Nq, Lq, dim, dtype=dtype, device=device, gen=gen).requires_grad_()
    lens = torch.randint(1, Ld + 1, (Nb,), generator=gen)
    off = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    docs = rand(int(off[-1]), dim, dtype=dtype, device=device, gen=gen).requires_grad_()
    g = torch.randn(Nq, Nb, generator=gen)
    s = ms.score_contrastive_train(Q, docs, off.to(device))
    (s * g.to(device)).sum().backward()
    Dp = torch.zeros(Nb, Ld, dim, dtype=torch.float64)
    for i in range(Nb):
        Dp[i, : lens[i]] = docs.detach()[off[i]: off[i + 1]].double().cpu()
    Dp.requires_grad_()
    Qr = Q.detach().double().cpu().requires_grad_()
    sr = ms.maxsim_reference(Qr, Dp, None, lengths_mask(lens, Ld))
    (sr * g.double()).sum().backward()
    _cmp(Q.grad, Qr.grad, dtype)
    gd = torch.cat([Dp.grad[i, : lens[i]] for i in range(Nb)])
    _cmp(docs.grad, gd, dtype)


def test_pairs_train(ms, device, dtype):
    gen = torch.Generator().manual_seed(5)
    nq, nd, Lq, Ld, dim = 3, 4, 7, 13, 24
    qlens = torch.randint(1, Lq + 1, (nq,), generator=gen)
    dlens = torch.randint(1, Ld + 1, (nd,), generator=gen)
    qoff = torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)])
    doff = torch.cat([torch.zeros(1, dtype=torch.long), dlens.cumsum(0)])
    q = rand(int(qoff[-1]), dim, dtype=dtype, device=device, gen=gen).requires_grad_()
    d = rand(int(doff[-1]), dim, dtype=dtype, device=device, gen=gen).requires_grad_()
    pq = torch.tensor([2, 0, 1, 2, 0, 2])
    pd = torch.tensor([3, 3, 0, 1, 0, 3])
    g = torch.randn(6, generator=gen)
    s = ms.score_pairs_packed_train(q, qoff.to(device), d, doff.to(device), pq.to(device), pd.to(device))
    (s * g.to(device)).sum().backward()
    qr = q.detach().double().cpu().requires_grad_()
    dr = d.detach().double().cpu().requires_grad_()
    tot = 0
    for p in range(6):
        qs = qr[qoff[pq[p]]: qoff[pq[p] + 1]]
        ds = dr[doff[pd[p]]: doff[pd[p] + 1]]
        tot = tot + g[p].double() * (qs @ ds.T).max(dim=1).values.sum()
    tot.backward()
    _cmp(q.grad, qr.grad, dtype)
    _cmp(d.grad, dr.grad, dtype)


def test_maxsim_autograd_masks_and_normalize(ms, device, dtype):
    gen = torch.Generator().manual_seed(6)
    Q = (rand(3, 11, 32, dtype=torch.float64, gen=gen) * 2).to(dtype).to(device).requires_grad_()
    D = (rand(4, 14, 32, dtype=torch.float64, gen=gen) * 3).to(dtype).to(device).requires_grad_()
    qm = (torch.rand(3, 11, generator=gen) > 0.2).to(device)
    dm = (torch.rand(4, 14, generator=gen) > 0.4).to(device)
    g = torch.randn(3, 4, generator=gen)
    for normalize in (False, True):
        Q.grad = D.grad = None
        s = ms.maxsim(Q, D, qm, dm, normalize=normalize)
        (s * g.to(device)).sum().backward()
        Qr = Q.detach().double().cpu().requires_grad_()
        Dr = D.detach().double().cpu().requires_grad_()
        Qn = torch.nn.functional.normalize(Qr, dim=-1) if normalize else Qr
        Dn = torch.nn.functional.normalize(Dr, dim=-1) if normalize else Dr
        (ms.maxsim_reference(Qn, Dn, qm.cpu(), dm.cpu()) * g.double()).sum().backward()
        assert relerr(Q.grad, Qr.grad) <= GRAD_TOL[dtype]
        assert relerr(D.grad, Dr.grad) <= GRAD_TOL[dtype]


def _nrm(x):
    return torch.nn.functional.normalize(x, dim=-1)


@pytest.mark.parametrize("side", ["both", "q", "d"])
@pytest.mark.parametrize("surface", ["candidates", "contrastive", "pairs", "grouped_masks"])
def test_normalize_fused(ms, device, dtype, surface, side):
    """normalize=True on every surface: scores and the gradients of both sides
    or of one side against fp64 autograd through F.normalize, on tokens of
    very different norms."""
    gen = torch.Generator().manual_seed(61)

    def tokens(*shape):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64)
        return (x * torch.rand(*shape[:-1], 1, generator=gen, dtype=torch.float64).mul(20).add(0.05)).to(dtype)

    if surface in ("candidates", "grouped_masks"):
        B, K, Lq, Ld, dim = 3, 4, 17, 33, 40
        Q, D = tokens(B, Lq, dim), tokens(B, K, Ld, dim)
        if surface == "candidates":
            ql, dl = torch.randint(1, Lq + 1, (B,), generator=gen), torch.randint(0, Ld + 1, (B, K), generator=gen)
            qm, dm = lengths_mask(ql, Lq), lengths_mask(dl, Ld).view(B, K, Ld)
            fn = lambda q, d: ms.score_candidates_padded_train(  # noqa: E731
                q, d, ql.to(device), dl.to(device), normalize=True)
        else:
            qm, dm = torch.rand(B, Lq, generator=gen) > 0.3, torch.rand(B, K, Ld, generator=gen) > 0.3
            fn = lambda q, d: ms.maxsim(q, d, qm.to(device), dm.to(device), normalize=True)  # noqa: E731
        ref = lambda q, d: ms.maxsim_reference(_nrm(q), _nrm(d), qm, dm)  # noqa: E731
    elif surface == "contrastive":
        Nq, Lq, dim = 4, 9, 48
        lens = torch.tensor([5, 0, 21, 1, 13])
        off = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        Q, D = tokens(Nq, Lq, dim), tokens(int(off[-1]), dim)
        fn = lambda q, d: ms.score_contrastive_train(q, d, off.to(device), normalize=True)  # noqa: E731

        def ref(q, d):
            Dp = torch.zeros(len(lens), int(lens.max()), dim, dtype=d.dtype)
            Dp = torch.stack([torch.cat([_nrm(d[off[i]: off[i + 1]]), Dp[i, lens[i]:]]) for i in range(len(lens))])
            return ms.maxsim_reference(_nrm(q), Dp, None, lengths_mask(lens, Dp.shape[1]))
    else:
        qoff, doff = torch.tensor([0, 4, 11, 12]), torch.tensor([0, 6, 19, 20, 33])
        pq, pd = torch.tensor([2, 0, 1, 2, 0, 1]), torch.tensor([3, 3, 0, 1, 0, 2])
        Q, D = tokens(12, 24), tokens(33, 24)
        fn = lambda q, d: ms.score_pairs_packed_train(  # noqa: E731
            q, qoff.to(device), d, doff.to(device), pq.to(device), pd.to(device), normalize=True)

        def ref(q, d):
            out = []
            for p in range(len(pq)):
                qs, ds = _nrm(q[qoff[pq[p]]: qoff[pq[p] + 1]]), _nrm(d[doff[pd[p]]: doff[pd[p] + 1]])
                out.append((qs @ ds.T).max(dim=1).values.sum())
            return torch.stack(out)

    Qd = Q.clone().to(device).requires_grad_(side != "d")
    Dd = D.clone().to(device).requires_grad_(side != "q")
    s = fn(Qd, Dd)
    g = torch.randn(s.shape, generator=gen)
    (s * g.to(device)).sum().backward()
    Qr, Dr = Q.double().requires_grad_(), D.double().requires_grad_()
    sr = ref(Qr, Dr)
    (sr * g.double()).sum().backward()
    assert relerr(s.detach(), sr.detach()) < 1e-5
    if side != "d":
        _cmp(Qd.grad, Qr.grad, dtype)
    if side != "q":
        _cmp(Dd.grad, Dr.grad, dtype)
    assert (Qd.grad is None) == (side == "d") and (Dd.grad is None) == (side == "q")


@pytest.mark.parametrize("tf32", [False, True], ids=["exact", "tf32"])
@pytest.mark.parametrize("shape", [(2, 1, 5, 1), (3, 33, 70, 17), (2, 40, 300, 128), (1, 130, 90, 256),
                                   (5, 7, 1000, 64), (8, 32, 300, 128), (1, 130, 200, 128)])
def test_normalize_forward_shapes(ms, device, dtype, shape, tf32):
    """normalize=True over dims that take every kernel path (odd dims: SIMT;
    dim 256: two k chunks; lq 130: the 128-row tile; >= 128 query rows of
    16-bit tokens on sm_90: wgmma), with document masks; argmax too."""
    if tf32 and dtype != torch.float32:
        pytest.skip("tf32 applies to fp32")
    Nq, Lq, Ld, dim = shape
    gen = torch.Generator().manual_seed(62)
    Q = (torch.randn(Nq, Lq, dim, generator=gen) * 3).to(dtype)
    D = (torch.randn(4, Ld, dim, generator=gen) * torch.rand(4, Ld, 1, generator=gen) * 5).to(dtype)
    dm = torch.rand(4, Ld, generator=gen) > 0.25
    s, a = ms.score_candidates_padded_with_argmax(Q.to(device), D.to(device)[None].expand(Nq, -1, -1, -1),
                                                  normalize=True, tf32=tf32)
    ref = ms.maxsim_reference(_nrm(Q.double()), _nrm(D.double()))
    assert relerr(s, ref) < (2e-3 if tf32 else 1e-5)
    sim = torch.einsum("qid,njd->qnij", _nrm(Q.double()), _nrm(D.double()))
    top2 = sim.topk(min(2, Ld), dim=-1).values
    clear = (top2[..., 0] - top2[..., -1] > 1e-4) if Ld > 1 else torch.ones(top2.shape[:-1], dtype=torch.bool)
    if not tf32:
        assert torch.equal(a.cpu().long()[clear], sim.argmax(-1)[clear])
    s2 = ms.maxsim(Q.to(device), D.to(device), None, dm.to(device), normalize=True, tf32=tf32)
    ref2 = ms.maxsim_reference(_nrm(Q.double()), _nrm(D.double()), None, dm)
    assert relerr(s2, ref2) < (2e-3 if tf32 else 1e-5)


def test_normalize_zero_rows(ms, device):
    """A zero token normalises to zero (F.normalize's clamp): similarity 0, no NaN."""
    Q = rand(2, 3, 8, device=device) * 5
    D = rand(3, 4, 8, device=device) * 0.1
    Q[0, 1] = 0
    D[1] = 0
    s = ms.maxsim(Q, D, normalize=True)
    ref = ms.maxsim_reference(_nrm(Q.double().cpu()), _nrm(D.double().cpu()))
    assert relerr(s, ref) < 1e-5


@pytest.mark.parametrize("shape", [(3, 5, 7, 9), (1, 17, 4, 33), (2, 1, 3, 1)])
def test_normalize_backward_takes_the_forwards_norms(ms, device, dtype, shape):
    """forward_train's third output: the inverse norms of q's rows, then of
    d's from a multiple of 4, and its shape-only kernel's shape; the CUDA
    backward reads them instead of computing them again (the same gradient
    bits)."""
    nq, lq, nd, ld = shape
    Q = rand(nq, lq, 64, dtype=dtype, device=device) * 3
    D = rand(nd, ld, 64, dtype=dtype, device=device) * 0.5
    D[0, 0] = 0  # a row under the clamp
    qs, ql, ds, dl, layout, Lq, _ = ms.scoring._cached_maxsim_plan(Q, D, None, None)
    args = (qs, ql, None, D, ds, dl, None, None, None, layout, Lq, 2, 0, True)
    scores, argmax, inv = ms.ops.forward_train(Q, *args)
    fake = ms.ops.forward_train(Q.to("meta"), qs.to("meta"), ql.to("meta"), None, D.to("meta"), ds.to("meta"),
                                dl.to("meta"), None, None, None, layout, Lq, 2, 0, True)[2]
    tq, td = nq * lq, nd * ld
    b_at = (tq + 3) // 4 * 4
    assert inv.dtype == torch.float32 and inv.shape == fake.shape == (b_at + td,)
    want = torch.cat([x.reshape(-1, 64).double().norm(dim=-1).clamp_min(1e-12).reciprocal() for x in (Q, D)])
    assert relerr(torch.cat([inv[:tq], inv[b_at:]]), want) < 1e-6
    assert ms.ops.forward_train(Q, *args[:-1], False)[2].numel() == 0
    grad = torch.randn(nq * nd, device=device)
    rows = (Q.reshape(-1, 64), D.reshape(-1, 64))
    bwd = (grad, rows[0], qs, ql, rows[1], ds, dl, None, None, argmax, layout, None, None, None, None, True, True, True)
    saved = ms.ops.backward(*bwd, inv)
    again = ms.ops.backward(*bwd)
    assert all(torch.equal(a, b) for a, b in zip(saved, again))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory accounting")
def test_normalize_makes_no_copies(ms):
    """normalize=True is folded into the kernels: the forward and backward
    allocate O(rows) beyond their outputs, never a normalised copy of D."""
    Q = rand(16, 32, 128, dtype=torch.bfloat16, device="cuda").requires_grad_()
    D = (rand(512, 256, 128, dtype=torch.bfloat16, device="cuda") * 3).requires_grad_()
    ms.maxsim(Q, D, normalize=True).sum().backward()  # warm caches
    Q.grad = D.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    s = ms.maxsim(Q, D, normalize=True)
    fwd_peak = torch.cuda.max_memory_allocated() - base
    assert fwd_peak < D.numel() * D.element_size() / 8, fwd_peak
    s.sum().backward()
    # dD itself (rows of 128 features: the Jacobian in the kernels, no fp32
    # row sums), dQ and O(rows) inverse norms: no more.
    bwd_peak = torch.cuda.max_memory_allocated() - base
    assert bwd_peak < D.numel() * D.element_size() * 1.15, bwd_peak


# Feature counts taking each route of the backward's row stores: 16-byte
# vectors with a row in one lane group (the Jacobian in the kernel), rows of
# two dim chunks, and rows not of 16-byte vectors (both: fp32 row sums, then
# the Jacobian pass).
_ROUTE_DIMS = {torch.float32: (40, 132, 6), torch.float16: (40, 264, 12), torch.bfloat16: (40, 264, 12)}


@pytest.mark.parametrize("route", [0, 1, 2], ids=["one-chunk", "two-chunks", "scalar-rows"])
@pytest.mark.parametrize("layout", ["shared", "candidates", "one-query"])
def test_normalize_gradient_routes(ms, device, dtype, route, layout):
    """normalize=True gradients on every route of the row stores and every
    backward kernel form (shared documents, one pair per document), on tokens
    of very different norms, against fp64 autograd through F.normalize."""
    dim = _ROUTE_DIMS[dtype][route]
    gen = torch.Generator().manual_seed(63 + route)

    def tokens(*shape):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64)
        return (x * torch.rand(*shape[:-1], 1, generator=gen, dtype=torch.float64).mul(10).add(0.1)).to(dtype)

    Q = tokens(1 if layout == "one-query" else 3, 17, dim)
    D = tokens(3, 4, 33, dim) if layout == "candidates" else tokens(5, 33, dim)
    g = torch.randn(Q.shape[0], D.shape[-3], generator=gen)
    Qd, Dd = Q.clone().to(device).requires_grad_(), D.clone().to(device).requires_grad_()
    (ms.maxsim(Qd, Dd, normalize=True) * g.to(device)).sum().backward()
    Qr, Dr = Q.double().requires_grad_(), D.double().requires_grad_()
    (ms.maxsim_reference(_nrm(Qr), _nrm(Dr)) * g.double()).sum().backward()
    _cmp(Qd.grad, Qr.grad, dtype)
    _cmp(Dd.grad, Dr.grad, dtype)


def test_only_needed_grads(ms, device):
    Q = rand(2, 5, 16, device=device).requires_grad_()
    D = rand(2, 3, 7, 16, device=device)
    ms.score_candidates_padded_train(Q, D).sum().backward()
    assert Q.grad is not None and D.grad is None


@pytest.mark.parametrize("with_qmask", [False, True])
@pytest.mark.parametrize("which", ["q", "d"])
def test_one_sided_grads(ms, device, which, with_qmask):
    """Only the requested gradient is computed, and it is right, whatever
    optional inputs precede it in the op's signature."""
    gen = torch.Generator().manual_seed(11)
    Q = rand(3, 9, 24, gen=gen).to(device).requires_grad_(which == "q")
    D = rand(4, 13, 24, gen=gen).to(device).requires_grad_(which == "d")
    qm = (torch.rand(3, 9, generator=gen) > 0.3).to(device) if with_qmask else None
    dm = (torch.rand(4, 13, generator=gen) > 0.3).to(device)
    g = torch.randn(3, 4, generator=gen)
    (ms.maxsim(Q, D, qm, dm) * g.to(device)).sum().backward()
    _, gq, gd = _ref_grads(ms, Q, D, qm, dm, g)
    if which == "q":
        assert D.grad is None and relerr(Q.grad, gq) <= GRAD_TOL[torch.float32]
    else:
        assert Q.grad is None and relerr(D.grad, gd) <= GRAD_TOL[torch.float32]


def _backward_twice(ms, Q, D, g):
    """Two backward passes of maxsim(Q, D) weighted by g: bitwise equal."""
    grads = []
    for _ in range(2):
        Q.grad = D.grad = None
        (ms.maxsim(Q, D) * g).sum().backward()
        grads.append((Q.grad.clone(), D.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def _packed_grads_over_own_argmax(ms, Q, docs, off, g, qmask=None):
    """fp64 dq [nq, lq, dim], dd [T, dim] of Q against packed documents
    (offsets ``off``) summed over the forward's own argmax (so near-ties
    cannot move the reference), and that argmax [nq, nd, lq]."""
    nq, lq, dim = Q.shape
    qlen = None if qmask is None else qmask.sum(1).to(torch.int32)
    _, am = ms.score_contrastive_with_argmax(Q.detach(), docs.detach(), off, qlen)
    idx = am.long()
    ok = idx >= 0
    rows = torch.where(ok, off[:-1].long()[None, :, None] + idx, 0)
    w = g.double()[:, :, None] * ok
    dq = torch.einsum("qni,qnid->qid", w, docs.detach().double()[rows])
    dd = torch.zeros(docs.shape, device=docs.device, dtype=torch.float64)
    dd.index_add_(0, rows.reshape(-1), (w[..., None] * Q.detach().double()[:, None]).reshape(-1, dim))
    return idx, dq, dd


def _grads_over_own_argmax(ms, Q, D, g):
    """The same for Q [nq, lq, dim] x D [nd, ld, dim]: (argmax, dq, dd)."""
    nd, ld, dim = D.shape
    offsets = torch.arange(0, nd * ld + 1, ld, device=Q.device)
    idx, dq, dd = _packed_grads_over_own_argmax(ms, Q, D.reshape(-1, dim), offsets, g)
    return idx, dq, dd.view(nd, ld, dim)


def test_backward_is_deterministic(ms, device, dtype):
    gen = torch.Generator().manual_seed(9)
    Q = rand(8, 32, 64, dtype=dtype, device=device, gen=gen).requires_grad_()
    D = rand(8, 40, 64, dtype=dtype, device=device, gen=gen).requires_grad_()
    g = torch.randn(8, 8, generator=gen).to(device)
    _backward_twice(ms, Q, D, g)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused CUDA backward grid")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_grid_of_several_waves(ms, dtype):
    """dq and dd from one grid of more CTAs than the GPU holds at once (dd's
    first, then dq's), against fp64 sums over the forward's own argmax (so
    near-ties cannot move the reference)."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    nq, nd, lq, ld, dim = 96, 96, 32, 200, 128
    Q = torch.randn(nq, lq, dim, device="cuda", generator=gen).to(dtype).requires_grad_()
    D = torch.randn(nd, ld, dim, device="cuda", generator=gen).to(dtype).requires_grad_()
    g = torch.randn(nq, nd, device="cuda", generator=gen)
    (ms.maxsim(Q, D) * g).sum().backward()
    _, dq, dd = _grads_over_own_argmax(ms, Q, D, g)
    assert relerr(Q.grad, dq) <= GRAD_TOL[dtype]
    assert relerr(D.grad, dd) <= GRAD_TOL[dtype]


def _tokens_towards_rows(gen, q_shape, d_shape, rows, device, dtype):
    """Query tokens near one direction u and documents whose token rows
    `rows` point along 3u: every query token's argmax is one of those rows."""
    dim = q_shape[-1]
    u = torch.randn(dim, generator=gen)
    u /= u.norm()
    Q = torch.randn(*q_shape, generator=gen) * 0.1 + u
    D = torch.randn(*d_shape, generator=gen) * 0.1
    for r in rows:
        D[..., r, :] += 3 * u
    return (Q.to(device=device, dtype=dtype).requires_grad_(), D.to(device=device, dtype=dtype).requires_grad_())


def test_backward_rows_hit_by_many_tokens(ms, device, dtype):
    """Every query token picks one of three rows of each document, so dd's
    queues hold long runs of updates to one row (and rows 5 and 21 share an
    owner on the GPU): against fp64 sums over the forward's own argmax, and
    bitwise equal run to run."""
    gen = torch.Generator().manual_seed(12)
    nq, nd, lq, ld, dim = 24, 20, 32, 150, 64
    Q, D = _tokens_towards_rows(gen, (nq, lq, dim), (nd, ld, dim), (5, 21, 77), device, dtype)
    g = torch.randn(nq, nd, generator=gen).to(device)
    _backward_twice(ms, Q, D, g)
    idx, dq, dd = _grads_over_own_argmax(ms, Q, D, g)
    assert set(idx.unique().tolist()) <= {5, 21, 77} and idx.unique().numel() >= 2
    _cmp(Q.grad, dq, dtype)
    _cmp(D.grad, dd, dtype)


@pytest.mark.parametrize("nq,k,lq,ld,dim,hit_rows", [(3, 5, 100, 70, 64, (2, 33, 69)),
                                                      (2, 200, 8, 2600, 16, (1, 2047, 2048, 2599)),
                                                      (2, 200, 100, 2600, 16, (0, 700, 2047, 2048, 2599))],
                         ids=["many-entries", "long-documents", "long-documents-many-entries"])
def test_candidates_rows_hit_by_many_tokens(ms, device, dtype, nq, k, lq, ld, dim, hit_rows):
    """Per-query candidates (each document in one pair: the one-pair dd on
    the GPU) whose query tokens all pick one of a few rows: long runs of
    hits per row, over several ballot chunks (lq 100) and row parts, summed
    in entry order; 400 documents of 2600 rows (with 8 or 100 query tokens)
    take one row part each on the GPU, with hits thousands of rows apart.
    Against fp64 sums over the forward's own argmax, and bitwise equal run
    to run."""
    gen = torch.Generator().manual_seed(13)
    Q, D = _tokens_towards_rows(gen, (nq, lq, dim), (nq, k, ld, dim), hit_rows, device, dtype)
    g = torch.randn(nq, k, generator=gen).to(device)
    _backward_twice(ms, Q, D, g)
    _, am = ms.score_candidates_padded_with_argmax(Q.detach(), D.detach())
    idx = am.long().cpu()  # [nq, k, lq]
    assert set(idx.unique().tolist()) <= set(hit_rows) and idx.unique().numel() >= 2
    assert ld <= 2048 or ((idx < 2048).any() and (idx >= 2048).any())  # both ends of the long rows hit
    Qd, Dd, gd = Q.detach().double().cpu(), D.detach().double().cpu(), g.double().cpu()
    rows = (torch.arange(nq)[:, None, None] * k + torch.arange(k)[None, :, None]) * ld + idx
    dq = torch.einsum("qn,qnid->qid", gd, Dd.reshape(-1, dim)[rows])
    dd = torch.zeros(nq * k * ld, dim, dtype=torch.float64)
    dd.index_add_(0, rows.reshape(-1), (gd[:, :, None, None] * Qd[:, None]).reshape(-1, dim))
    _cmp(Q.grad, dq, dtype)
    _cmp(D.grad, dd.view(nq, k, ld, dim), dtype)


@pytest.mark.parametrize("layout", ["cross", "grouped", "pairs"])
def test_backward_queries_with_many_pairs(ms, device, dtype, layout):
    """A query with more pairs than dq stages at once (at most 512 per chunk
    on the GPU): several chunks, the last one partial, for every layout; a
    pair list adds empty documents, repeated pairs and a query with none.
    Against fp64 sums over the forward's own argmax (CROSS through
    _grads_over_own_argmax; the other layouts by their winners' rows)."""
    gen = torch.Generator().manual_seed(31)
    nq, lq, ld, dim, n = 3, 32, 4, 16, 1300
    if layout == "pairs":
        nd = 40
        qlen = torch.tensor([lq, 7, 5])
        dlen = torch.randint(0, ld + 1, (nd,), generator=gen)
        dlen[[3, 17]] = 0
        pq = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(3, dtype=torch.long)])
        pd = torch.randint(0, nd, (n + 3,), generator=gen)
        qoff = torch.cat([torch.zeros(1, dtype=torch.long), qlen.cumsum(0)])
        doff = torch.cat([torch.zeros(1, dtype=torch.long), dlen.cumsum(0)])
        q = rand(int(qoff[-1]), dim, dtype=dtype, device=device, gen=gen).requires_grad_()
        d = rand(int(doff[-1]), dim, dtype=dtype, device=device, gen=gen).requires_grad_()
        args = (qoff.to(device), d, doff.to(device), pq.to(device), pd.to(device))
        g = torch.randn(n + 3, generator=gen, dtype=torch.float64)
        (ms.score_pairs_packed_train(q, *args, max_query_length=lq) * g.to(device)).sum().backward()
        _, am = ms.score_pairs_packed_with_argmax(q.detach(), args[0], d.detach(), *args[2:], max_query_length=lq)
        qi = (qoff[pq][:, None] + torch.arange(lq)).clamp(max=int(qoff[-1]) - 1)  # [P, lq] query rows
        di = doff[pd][:, None] + am.long().cpu()  # [P, lq] document rows
        gq = g[:, None].expand(-1, lq)
        X, Y = q, d
    elif layout == "cross":
        X = rand(nq, lq, dim, dtype=dtype, device=device, gen=gen).requires_grad_()
        Y = rand(n, ld, dim, dtype=dtype, device=device, gen=gen).requires_grad_()
        g = torch.randn(nq, n, generator=gen).to(device)
        (ms.maxsim(X, Y) * g).sum().backward()
        _, dq, dd = _grads_over_own_argmax(ms, X, Y, g)
        _cmp(X.grad, dq, dtype)
        _cmp(Y.grad, dd, dtype)
        return
    else:
        X = rand(nq, lq, dim, dtype=dtype, device=device, gen=gen).requires_grad_()
        Y = rand(nq, n, ld, dim, dtype=dtype, device=device, gen=gen).requires_grad_()
        g = torch.randn(nq, n, generator=gen, dtype=torch.float64)
        (ms.score_candidates_padded_train(X, Y) * g.to(device)).sum().backward()
        _, am = ms.score_candidates_padded_with_argmax(X.detach(), Y.detach())
        base = (torch.arange(nq)[:, None, None] * n + torch.arange(n)[None, :, None]) * ld
        qi = (torch.arange(nq)[:, None, None] * lq + torch.arange(lq)).expand(nq, n, lq)
        di = base + am.long().cpu()
        gq = g[:, :, None].expand(nq, n, lq)
    Xd, Yd = X.detach().double().cpu().reshape(-1, dim), Y.detach().double().cpu().reshape(-1, dim)
    sel = am.long().cpu() >= 0
    if layout == "pairs":
        sel &= torch.arange(lq)[None, :] < qlen[pq][:, None]
    qi, di, w = qi[sel], di[sel], gq[sel]
    dq = torch.zeros_like(Xd).index_add_(0, qi, w[:, None] * Yd[di])
    dd = torch.zeros_like(Yd).index_add_(0, di, w[:, None] * Xd[qi])
    assert sel.float().mean() > 0.5  # most query tokens have a winner
    _cmp(X.grad.reshape(-1, dim), dq, dtype)
    _cmp(Y.grad.reshape(-1, dim), dd, dtype)
    if layout == "pairs":  # query 2 is in no pair: exactly zero
        assert not X.grad[int(qoff[2]):].any()


# ---------------------------------------------------------------------------
# fp64 on the CPU: the forward is exact in fp64, so torch.autograd.gradcheck
# can compare the backward kernel against finite differences.
# ---------------------------------------------------------------------------

def _f64(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def test_f64_forward_matches_reference(ms):
    gen = torch.Generator().manual_seed(21)
    Q, D = _f64(3, 7, 12, gen=gen), _f64(5, 9, 12, gen=gen)
    qm = torch.rand(3, 7, generator=gen) > 0.3
    dm = torch.rand(5, 9, generator=gen) > 0.3
    s = ms.maxsim(Q, D, qm, dm)
    assert s.dtype == torch.float64
    ref = ms.maxsim_reference(Q, D, qm, dm)
    assert torch.allclose(s, ref.to(torch.float64), rtol=1e-12, atol=1e-12)
    # argmax in fp64 too: ties and order as the fp32 path
    Dp = D.clone()
    Dp[2, 5] = Dp[2, 1]  # an exact tie: the lower index wins
    _, a = ms.score_candidates_padded_with_argmax(Q[:1], Dp[None])
    exp = torch.einsum("id,kjd->kij", Q[0], Dp).argmax(-1)
    assert a.dtype == torch.int32 and torch.equal(a[0], exp.to(torch.int32))


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalize"])
@pytest.mark.parametrize("surface", ["maxsim", "candidates", "contrastive", "pairs"])
def test_gradcheck_f64(ms, surface, normalize):
    gen = torch.Generator().manual_seed(22)
    if surface == "maxsim":
        Q, D = _f64(2, 5, 6, gen=gen), _f64(3, 7, 6, gen=gen)
        qm = torch.rand(2, 5, generator=gen) > 0.3
        dm = torch.rand(3, 7, generator=gen) > 0.3
        fn = lambda q, d: ms.maxsim(q, d, qm, dm, normalize=normalize)  # noqa: E731
    elif surface == "candidates":
        Q, D = _f64(2, 5, 6, gen=gen), _f64(2, 3, 7, 6, gen=gen)
        ql, dl = torch.tensor([5, 3]), torch.tensor([[7, 2, 0], [4, 7, 1]])
        fn = lambda q, d: ms.score_candidates_padded_train(q, d, ql, dl, normalize=normalize)  # noqa: E731
    elif surface == "contrastive":
        Q, D = _f64(3, 4, 6, gen=gen), _f64(11, 6, gen=gen)
        off = torch.tensor([0, 3, 3, 8, 11])
        fn = lambda q, d: ms.score_contrastive_train(q, d, off, normalize=normalize)  # noqa: E731
    else:
        Q, D = _f64(9, 6, gen=gen), _f64(12, 6, gen=gen)
        qo, do = torch.tensor([0, 4, 9]), torch.tensor([0, 5, 12])
        pq, pd = torch.tensor([0, 1, 1, 0]), torch.tensor([1, 0, 1, 0])
        fn = lambda q, d: ms.score_pairs_packed_train(q, qo, d, do, pq, pd, normalize=normalize)  # noqa: E731
    Q.requires_grad_(), D.requires_grad_()
    assert fn(Q, D).dtype == torch.float64
    assert torch.autograd.gradcheck(fn, (Q, D))


# -- short documents at training sizes (CUDA, bf16, d 64 / 128) ---------------
# 128 queries x 256 documents of <= 17 tokens, or packed corpora of that size;
# the fp64 references sum over the forward's own argmax, so near-ties cannot
# move them.

@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA training sizes")
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("ld,lq", [(1, 32), (7, 20), (16, 32), (17, 64)])
@pytest.mark.parametrize("side", ["both", "q", "d"])
def test_short_document_products(ms, dim, ld, lq, side):
    gen = torch.Generator(device="cuda").manual_seed(ld * 100 + lq + dim)
    nq, nd = 128, 256
    Q = torch.randn(nq, lq, dim, device="cuda", generator=gen).bfloat16().requires_grad_(side != "d")
    D = torch.randn(nd, ld, dim, device="cuda", generator=gen).bfloat16().requires_grad_(side != "q")
    g = torch.randn(nq, nd, device="cuda", generator=gen)
    (ms.maxsim(Q, D) * g).sum().backward()
    _, dq, dd = _grads_over_own_argmax(ms, Q, D, g)
    if side != "d":
        assert relerr(Q.grad, dq) <= GRAD_TOL[torch.bfloat16]
    if side != "q":
        assert relerr(D.grad, dd) <= GRAD_TOL[torch.bfloat16]
    if side == "both":
        _backward_twice(ms, Q, D, g)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA training sizes")
def test_short_documents_masked_garbage(ms):
    """inf / NaN in masked tokens of both sides change nothing (bitwise the
    gradients of zeroed tokens); gradients match fp64 over the own argmax."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    nq, nd, lq, ld, dim = 128, 256, 32, 16, 128
    Q0 = torch.randn(nq, lq, dim, device="cuda", generator=gen).bfloat16()
    D0 = torch.randn(nd, ld, dim, device="cuda", generator=gen).bfloat16()
    qm = torch.rand(nq, lq, device="cuda", generator=gen) > 0.2
    qm[:, 0] = True
    dm = torch.rand(nd, ld, device="cuda", generator=gen) > 0.3
    dm[::7] = False  # fully masked documents
    g = torch.randn(nq, nd, device="cuda", generator=gen)
    grads = []
    for fill in (0.0, float("nan"), float("inf")):
        Q = Q0.masked_fill(~qm[..., None], fill).requires_grad_()
        D = D0.masked_fill(~dm[..., None], fill).requires_grad_()
        (ms.maxsim(Q, D, qm, dm) * g).sum().backward()
        grads.append((Q.grad, D.grad))
    for gq, gd in grads[1:]:
        assert torch.equal(gq, grads[0][0]) and torch.equal(gd, grads[0][1])
    Qz = Q0.masked_fill(~qm[..., None], 0).requires_grad_()
    Dz = D0.masked_fill(~dm[..., None], 0).requires_grad_()
    _, rq, rd = _ref_grads(ms, Qz, Dz, qm, dm, g)
    assert relerr(grads[0][0], rq) <= GRAD_TOL[torch.bfloat16]
    assert relerr(grads[0][1], rd) <= GRAD_TOL[torch.bfloat16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA training sizes")
def test_short_documents_nonfinite_winner(ms):
    """An unmasked inf in a document token: the query rows it wins for get
    g * inf in that feature (NaN / inf exactly where fp64 has them), the
    other features and rows their finite sums."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    nq, nd, lq, ld, dim = 128, 256, 32, 16, 128
    Q = torch.randn(nq, lq, dim, device="cuda", generator=gen).bfloat16()
    D = torch.randn(nd, ld, dim, device="cuda", generator=gen).bfloat16()
    D[5, 3, 7] = float("inf")
    D[9, 0, 1] = float("-inf")
    Q.requires_grad_()
    D.requires_grad_()
    g = torch.randn(nq, nd, device="cuda", generator=gen)
    (ms.maxsim(Q, D) * g).sum().backward()
    _, dq, dd = _grads_over_own_argmax(ms, Q, D, g)
    assert bool(torch.isinf(dq).any())  # the inf tokens win somewhere
    for out, ref in ((Q.grad, dq), (D.grad, dd)):
        out = out.double()
        assert torch.equal(torch.isnan(out), torch.isnan(ref))
        assert torch.equal(torch.isinf(out), torch.isinf(ref))
        assert torch.equal(out[torch.isinf(ref)], ref[torch.isinf(ref)])
        fin = torch.isfinite(ref)
        assert relerr(out[fin], ref[fin]) <= GRAD_TOL[torch.bfloat16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA training sizes")
@pytest.mark.parametrize("dim", [64, 128])
def test_short_packed_documents_train(ms, dim):
    """Packed documents of 0-40 tokens with runs of empty ones and a few
    longer than a 64-row tile, queries with holes."""
    gen = torch.Generator().manual_seed(dim)
    nq, lq = 128, 32
    lens = torch.randint(0, 41, (700,), generator=gen)
    lens[100:200] = 0
    lens[300:303] = torch.tensor([150, 0, 65])
    lens[-50:] = 0
    off = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).cuda()
    T = int(off[-1])
    Q = torch.randn(nq, lq, dim, generator=gen).bfloat16().cuda().requires_grad_()
    docs = torch.randn(T, dim, generator=gen).bfloat16().cuda().requires_grad_()
    qmask = (torch.rand(nq, lq, generator=gen) > 0.25).cuda()
    qmask[:, :4] = True
    qmask = qmask.cumprod(1).bool()  # query lengths
    g = torch.randn(nq, lens.numel(), generator=gen).cuda()
    s = ms.score_contrastive_train(Q, docs, off, qmask.sum(1).to(torch.int32))
    (s * g).sum().backward()
    _, dq, dd = _packed_grads_over_own_argmax(ms, Q, docs, off, g, qmask)
    assert relerr(Q.grad, dq) <= GRAD_TOL[torch.bfloat16]
    assert relerr(docs.grad, dd) <= GRAD_TOL[torch.bfloat16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA training sizes")
def test_short_documents_normalize(ms):
    """normalize=True: the row sums through the normalisation Jacobian,
    against fp64 over the own argmax."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    nq, nd, lq, ld, dim = 128, 256, 32, 16, 128
    Q = (torch.randn(nq, lq, dim, device="cuda", generator=gen) * 3).bfloat16().requires_grad_()
    D = (torch.randn(nd, ld, dim, device="cuda", generator=gen) * 2).bfloat16().requires_grad_()
    g = torch.randn(nq, nd, device="cuda", generator=gen)
    (ms.maxsim(Q, D, normalize=True) * g).sum().backward()
    Qd, Dd = Q.detach().double(), D.detach().double()
    Qn, Dn = _nrm(Qd), _nrm(Dd)
    _, am = ms.score_contrastive_with_argmax(Q.detach(), D.detach().reshape(-1, dim),
                                             torch.arange(0, nd * ld + 1, ld, device="cuda"), normalize=True)
    rows = torch.arange(nd, device="cuda")[None, :, None] * ld + am.long()
    sq = torch.einsum("qn,qnid->qid", g.double(), Dn.reshape(-1, dim)[rows])
    sd = torch.zeros(nd * ld, dim, device="cuda", dtype=torch.float64)
    sd.index_add_(0, rows.reshape(-1), (g.double()[:, :, None, None] * Qn[:, None]).reshape(-1, dim))
    sd = sd.view(nd, ld, dim)

    def jac(s, x, xn):
        return (s - (s * xn).sum(-1, keepdim=True) * xn) / x.norm(dim=-1, keepdim=True)

    assert relerr(Q.grad, jac(sq, Qd, Qn)) <= GRAD_TOL[torch.bfloat16]
    assert relerr(D.grad, jac(sd, Dd, Dn)) <= GRAD_TOL[torch.bfloat16]
