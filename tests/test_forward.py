"""Forward scores and argmax of every public surface against an fp64 oracle."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close, lengths_mask, rand, relerr

SHAPES = [  # (n, K, Lq, Ld, dim)
    (1, 1, 1, 1, 1),
    (2, 3, 15, 17, 33),
    (3, 2, 33, 15, 17),
    (2, 4, 32, 130, 128),
    (1, 2, 17, 1000, 64),
]


def _sims(Q, D):
    """fp64 similarity grid of padded per-query candidates [B, K, Lq, Ld]."""
    return torch.einsum("bid,bkjd->bkij", Q.double().cpu(), D.double().cpu())


def _check_argmax(Q, D, argmax, qlen, dlen):
    """The chosen token attains the row max (ties may pick any attaining index
    only if equal in fp64; the kernel must pick the lowest)."""
    sims = _sims(Q, D)
    B, K, Lq, Ld = sims.shape
    am = argmax.cpu().long()
    qmask = lengths_mask(qlen.cpu(), Lq)  # [B, Lq]
    dmask = lengths_mask(dlen.cpu(), Ld).view(B, K, Ld)
    sims = sims.masked_fill(~dmask[:, :, None, :], float("-inf"))
    best = sims.max(dim=3).values
    has = dmask.any(dim=2)[:, :, None] & qmask[:, None, :]
    assert torch.all(am[~has] == -1)
    chosen = am.clamp(min=0)
    got = torch.gather(sims, 3, chosen[..., None])[..., 0]
    scale = best.abs().clamp_min(1.0)
    assert torch.all(((got - best).abs() <= 1e-5 * scale)[has]), "argmax does not attain the max"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_candidates_padded(ms, device, dtype, shape):
    B, K, Lq, Ld, dim = shape
    g = torch.Generator().manual_seed(B * 1000 + Ld)
    Q = rand(B, Lq, dim, dtype=dtype, device=device, gen=g)
    D = rand(B, K, Ld, dim, dtype=dtype, device=device, gen=g)
    qlen = torch.randint(1, Lq + 1, (B,), generator=g).to(device)
    dlen = torch.randint(0, Ld + 1, (B, K), generator=g).to(device)
    ref = ms.maxsim_reference(Q, D, lengths_mask(qlen, Lq), lengths_mask(dlen, Ld).view(B, K, Ld))
    out = ms.score_candidates_padded(Q, D, qlen, dlen)
    assert out.dtype == torch.float32 and out.shape == (B, K) and out.device.type == device
    assert_close(out, ref, dtype)
    s2, am = ms.score_candidates_padded_with_argmax(Q, D, qlen.long(), dlen.int())
    assert am.dtype == torch.int32 and am.shape == (B, K, Lq)
    assert_close(s2, ref, dtype)
    _check_argmax(Q, D, am, qlen, dlen)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_contrastive(ms, device, dtype, shape):
    _contrastive_case(ms, device, dtype, shape)


# Short queries against many documents: on Hopper a 128-row tile holds
# several queries, which finish in their own kernel (scores, and argmax when
# the documents fit one doc tile); short and long documents, ragged lengths.
SEVERAL_PER_TILE = [(37, 23, 1, 77, 128), (20, 9, 7, 129, 64), (37, 23, 32, 80, 128), (11, 13, 33, 128, 96),
                    (9, 7, 64, 300, 128), (40, 6, 16, 1, 32)]


@pytest.mark.parametrize("shape", SEVERAL_PER_TILE, ids=lambda s: "x".join(map(str, s)))
def test_contrastive_several_queries_per_tile(ms, device, dtype, shape):
    _contrastive_case(ms, device, dtype, shape)
    Nq, Nb, Lq, Ld, dim = shape
    g = torch.Generator().manual_seed(3 + Lq)
    Q = rand(Nq, Lq, dim, dtype=dtype, device=device, gen=g)
    D = rand(Nb, Ld, dim, dtype=dtype, device=device, gen=g)
    qm = torch.rand(Nq, Lq, generator=g) > 0.2
    dm = torch.rand(Nb, Ld, generator=g) > 0.1
    ref = ms.maxsim_reference(Q.cpu(), D.cpu(), qm, dm)
    out = ms.maxsim(Q, D, qm.to(device), dm.to(device))
    assert out.shape == (Nq, Nb)
    assert_close(out, ref, dtype)


def _contrastive_case(ms, device, dtype, shape):
    Nq, Nb, Lq, Ld, dim = shape
    g = torch.Generator().manual_seed(7 + Lq)
    Q = rand(Nq, Lq, dim, dtype=dtype, device=device, gen=g)
    lens = torch.randint(0, Ld + 1, (Nb,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    docs = rand(int(offsets[-1]), dim, dtype=dtype, device=device, gen=g)
    qlen = torch.randint(1, Lq + 1, (Nq,), generator=g)
    # padded copy for the oracle
    Dp = torch.zeros(Nb, Ld, dim, dtype=dtype)
    for i in range(Nb):
        Dp[i, : lens[i]] = docs[offsets[i]: offsets[i + 1]].cpu()
    ref = ms.maxsim_reference(Q.cpu(), Dp, lengths_mask(qlen, Lq), lengths_mask(lens, Ld))
    out = ms.score_contrastive(Q, docs, offsets.to(device), qlen.to(device))
    assert out.shape == (Nq, Nb)
    assert_close(out, ref, dtype)
    out2 = ms.score_contrastive(Q, docs, offsets.int().to(device))
    ref2 = ms.maxsim_reference(Q.cpu(), Dp, None, lengths_mask(lens, Ld))
    assert_close(out2, ref2, dtype)
    s3, am = ms.score_contrastive_with_argmax(Q, docs, offsets.to(device), qlen.to(device))
    assert am.shape == (Nq, Nb, Lq)
    assert_close(s3, ref, dtype)
    Qe = Q.cpu()[:, None].expand(Nq, Nb, Lq, dim)
    _check_argmax(Qe.reshape(Nq * Nb, Lq, dim),
                  Dp[None].expand(Nq, Nb, Ld, dim).reshape(Nq * Nb, 1, Ld, dim),
                  am.reshape(Nq * Nb, 1, Lq), qlen.repeat_interleave(Nb), lens.repeat(Nq))


def _packed(ms, device, dtype, nq, nd, Lq, Ld, dim, g):
    qlens = torch.randint(0, Lq + 1, (nq,), generator=g)
    dlens = torch.randint(0, Ld + 1, (nd,), generator=g)
    qoff = torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)])
    doff = torch.cat([torch.zeros(1, dtype=torch.long), dlens.cumsum(0)])
    q = rand(int(qoff[-1]), dim, dtype=dtype, device=device, gen=g)
    d = rand(int(doff[-1]), dim, dtype=dtype, device=device, gen=g)
    return q, d, qlens, dlens, qoff, doff


@pytest.mark.parametrize("shape", [(3, 4, 17, 33, 15), (1, 5, 32, 300, 128), (5, 2, 1, 1, 1), (3, 4, 150, 301, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_pairs_packed(ms, device, dtype, shape):
    nq, nd, Lq, Ld, dim = shape
    g = torch.Generator().manual_seed(nq * 31 + Ld)
    q, d, qlens, dlens, qoff, doff = _packed(ms, device, dtype, nq, nd, Lq, Ld, dim, g)
    P = 2 * nq * nd + 1
    pq = torch.randint(0, nq, (P,), generator=g)
    pd = torch.randint(0, nd, (P,), generator=g)
    Qp = torch.zeros(nq, Lq, dim, dtype=dtype)
    Dp = torch.zeros(nd, Ld, dim, dtype=dtype)
    for i in range(nq):
        Qp[i, : qlens[i]] = q[qoff[i]: qoff[i + 1]].cpu()
    for i in range(nd):
        Dp[i, : dlens[i]] = d[doff[i]: doff[i + 1]].cpu()
    full = ms.maxsim_reference(Qp, Dp, lengths_mask(qlens, Lq), lengths_mask(dlens, Ld))
    ref = full[pq, pd]
    out = ms.score_pairs_packed(q, qoff.to(device), d, doff.to(device), pq.to(device), pd.int().to(device))
    assert out.shape == (P,)
    assert_close(out, ref, dtype)
    s2, am = ms.score_pairs_packed_with_argmax(q, qoff.to(device), d, doff.to(device), pq.to(device),
                                               pd.to(device), max_query_length=Lq)
    assert am.shape == (P, Lq)
    assert_close(s2, ref, dtype)
    _check_argmax(Qp[pq], Dp[pd][:, None], am[:, None], qlens[pq], dlens[pd][:, None])


@pytest.mark.parametrize("layout", ["cross", "grouped"])
def test_maxsim_masks(ms, device, dtype, layout):
    g = torch.Generator().manual_seed(11)
    Q = rand(3, 19, 40, dtype=dtype, device=device, gen=g)
    D = rand(*((4,) if layout == "cross" else (3, 4)), 23, 40, dtype=dtype, device=device, gen=g)
    qm = torch.rand(3, 19, generator=g) > 0.3
    dm = torch.rand(D.shape[:-1], generator=g) > 0.5  # holes, not prefixes
    dm.view(-1, 23)[0] = False  # a document with no valid token scores 0
    qm, dm = qm.to(device), dm.to(device)
    ref = ms.maxsim_reference(Q, D, qm, dm)
    assert_close(ms.maxsim(Q, D, qm, dm), ref, dtype)
    assert_close(ms.maxsim(Q, D), ms.maxsim_reference(Q, D), dtype)
    Qn = torch.nn.functional.normalize(Q.double() * 3, dim=-1)
    Dn = torch.nn.functional.normalize(D.double() * 2, dim=-1)
    out = ms.maxsim((Q.float() * 3).to(dtype), (D.float() * 2).to(dtype), qm, dm, normalize=True)
    assert relerr(out, ms.maxsim_reference(Qn, Dn, qm, dm)) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("nq,lq,dim", [(7, 40, 64), (3, 200, 128)])
def test_query_tiles_with_masks(ms, device, dtype, nq, lq, dim):
    """Query rows that fill 128-row tiles (the Hopper kernel's, which loads a
    tile of consecutive padded rows with one TMA): prefix lengths and holes
    in the query mask, rows past a query's end or past the batch must not
    count."""
    g = torch.Generator().manual_seed(nq * 7 + lq)
    Q = rand(nq, lq, dim, dtype=dtype, device=device, gen=g)
    D = rand(5, 150, dim, dtype=dtype, device=device, gen=g)
    lens = torch.randint(1, lq + 1, (nq,), generator=g)
    qm = lengths_mask(lens, lq) & (torch.rand(nq, lq, generator=g) > 0.2)
    qm[:, 0] = True
    dm = torch.rand(5, 150, generator=g) > 0.3
    qm, dm = qm.to(device), dm.to(device)
    assert_close(ms.maxsim(Q, D, qm, dm), ms.maxsim_reference(Q, D, qm, dm), dtype)
    assert_close(ms.maxsim(Q, D), ms.maxsim_reference(Q, D), dtype)


def test_ties_pick_lowest_index(ms, device, dtype):
    d = rand(1, 8, dtype=dtype, device=device)
    docs = torch.cat([rand(3, 8, dtype=dtype, device=device) * 0.01, d, d, d]).contiguous()
    Q = d.view(1, 1, 8).repeat(1, 5, 1)
    s, am = ms.score_contrastive_with_argmax(Q, docs, torch.tensor([0, 6], device=device))
    assert torch.all(am == 3)


def test_nan_propagates(ms, device, dtype):
    Q = rand(2, 4, 16, dtype=dtype, device=device)
    D = rand(3, 5, 16, dtype=dtype, device=device)
    D[1, 2, 3] = float("nan")
    s = ms.maxsim(Q, D)
    assert torch.isnan(s[:, 1]).all()
    assert not torch.isnan(s[:, [0, 2]]).any()


def test_masked_nan_token_is_ignored(ms, device, dtype):
    Q = rand(2, 4, 16, dtype=dtype, device=device)
    D = rand(3, 5, 16, dtype=dtype, device=device)
    D[1, 4] = float("nan")
    dm = torch.ones(3, 5, dtype=torch.bool, device=device)
    dm[1, 4] = False
    s = ms.maxsim(Q, D, d_mask=dm)
    assert_close(s, ms.maxsim_reference(Q, D, None, dm), dtype)


def test_empty_batches(ms, device):
    Q = rand(0, 4, 8, device=device)
    D = rand(0, 3, 5, 8, device=device)
    assert ms.score_candidates_padded(Q, D).shape == (0, 3)
    assert ms.score_contrastive(rand(2, 4, 8, device=device), rand(0, 8, device=device),
                                torch.zeros(1, dtype=torch.long, device=device)).shape == (2, 0)
    s = ms.score_pairs_packed(rand(3, 8, device=device), torch.tensor([0, 3], device=device),
                              rand(2, 8, device=device), torch.tensor([0, 2], device=device),
                              torch.zeros(0, dtype=torch.long, device=device),
                              torch.zeros(0, dtype=torch.long, device=device))
    assert s.shape == (0,)
    assert ms.maxsim(rand(2, 3, 8, device=device), rand(0, 5, 8, device=device)).shape == (2, 0)


def test_empty_documents_score_zero(ms, device, dtype):
    Q = rand(2, 3, 8, dtype=dtype, device=device)
    docs = rand(4, 8, dtype=dtype, device=device)
    off = torch.tensor([0, 0, 4, 4], device=device)
    s, am = ms.score_contrastive_with_argmax(Q, docs, off)
    assert torch.all(s[:, [0, 2]] == 0) and torch.all(am[:, [0, 2]] == -1)
    assert torch.all(s[:, 1] != 0)


def test_non_contiguous_inputs(ms, device, dtype):
    Qb = rand(3, 10, 64, dtype=dtype, device=device)
    Db = rand(5, 2, 12, 64, dtype=dtype, device=device)
    Q = Qb[:, ::2, :32]  # strided views
    D = Db.transpose(0, 1)[1][..., 32:]
    ref = ms.maxsim_reference(Q, D)
    assert_close(ms.maxsim(Q, D), ref, dtype)
    Dg = Db[:3]
    assert_close(ms.score_candidates_padded(Qb[:, ::2], Dg[:, :, ::3]),
                 ms.maxsim_reference(Qb[:, ::2], Dg[:, :, ::3]), dtype)


def test_large_shapes(ms, device):
    # Lq and Ld well past one tile; dim past 1000.
    g = torch.Generator().manual_seed(5)
    Q = rand(1, 300, 1030, device=device, gen=g)
    D = rand(2, 1100, 1030, device=device, gen=g)
    assert_close(ms.maxsim(Q, D), ms.maxsim_reference(Q, D), torch.float32)


def test_invalid_lengths_give_nan_without_validate(ms, device):
    Q = rand(2, 4, 8, device=device)
    D = rand(2, 3, 5, 8, device=device)
    s = ms.score_candidates_padded(Q, D, torch.tensor([4, 9], device=device),
                                   torch.tensor([[5, 5, -1], [1, 2, 3]], device=device))
    assert torch.isnan(s[0, 2]) and torch.isnan(s[1]).all()
    assert not torch.isnan(s[0, :2]).any()
    off_bad = torch.tensor([0, 3, 2], device=device)  # decreasing
    s = ms.score_contrastive(Q, rand(2, 8, device=device), off_bad)
    assert torch.isnan(s).all()
    s = ms.score_pairs_packed(rand(3, 8, device=device), torch.tensor([0, 3], device=device),
                              rand(2, 8, device=device), torch.tensor([0, 2], device=device),
                              torch.tensor([0, 0], device=device), torch.tensor([0, 5], device=device))
    assert not torch.isnan(s[0]) and torch.isnan(s[1])


def test_tf32_option(ms, device):
    Q = rand(2, 33, 128, device=device)
    D = rand(5, 70, 128, device=device)
    ref = ms.maxsim_reference(Q, D)
    out = ms.score_contrastive(Q, D.reshape(-1, 128), torch.arange(0, 351, 70, device=device), tf32=True)
    assert relerr(out, ref) < 2e-3


@pytest.mark.parametrize("dim", [32, 64, 96, 128])
@pytest.mark.parametrize("lq", [1, 15, 16, 17, 32])
def test_short_query_streaming_shapes(ms, device, dtype, dim, lq):
    """The shapes the CUDA register-streaming kernel takes (one fp16 / bf16
    query of lq <= 32, dim 32 / 64 / 96 / 128, no argmax) with token-mask
    holes (a document with none, one ending inside a tile of 8 tokens),
    query masks and a NaN token; per-query candidates and pair lists of the
    same shapes (tile kernels) agree with the reference too."""
    g = torch.Generator().manual_seed(dim * 100 + lq)
    Q = rand(1, lq, dim, dtype=dtype, device=device, gen=g)
    D = rand(37, 45, dim, dtype=dtype, device=device, gen=g)
    dm = torch.rand(37, 45, generator=g) > 0.2
    dm[3] = False  # no valid token: scores 0
    dm[5, 9:] = False  # a length that ends inside a tile of 8
    qm = torch.rand(1, lq, generator=g) > 0.25
    qm[0, 0] = True
    D[7, 4, 1] = float("nan")  # NaN in a counted token: NaN score
    dm[7, 4] = True
    qm_d, dm_d = qm.to(device), dm.to(device)
    ref = ms.maxsim_reference(Q, D, qm_d, dm_d)
    out = ms.maxsim(Q, D, qm_d, dm_d)
    assert torch.isnan(out[0, 7]) and torch.isnan(ref[0, 7])
    keep = torch.ones(37, dtype=torch.bool)
    keep[7] = False
    assert_close(out[:, keep], ref[:, keep], dtype)
    # per-query candidates: 3 queries x 12 docs with lengths (0 included)
    Qb = rand(3, lq, dim, dtype=dtype, device=device, gen=g)
    Db = rand(3, 12, 45, dim, dtype=dtype, device=device, gen=g)
    qlen = torch.randint(1, lq + 1, (3,), generator=g).to(device)
    dlen = torch.randint(0, 46, (3, 12), generator=g)
    dlen[0, 0] = 0
    dlen = dlen.to(device)
    ref = ms.maxsim_reference(Qb, Db, lengths_mask(qlen, lq), lengths_mask(dlen, 45).view(3, 12, 45))
    assert_close(ms.score_candidates_padded(Qb, Db, qlen, dlen), ref, dtype)
    s2, _ = ms.score_candidates_padded_with_argmax(Qb, Db, qlen, dlen)  # tile kernels
    assert_close(s2, ref, dtype)
    # pair list over packed tokens
    q, d, qlens, dlens, qoff, doff = _packed(ms, device, dtype, 4, 9, lq, 70, dim, g)
    pq = torch.randint(0, 4, (50,), generator=g)
    pd = torch.randint(0, 9, (50,), generator=g)
    Qp = torch.zeros(4, lq, dim, dtype=dtype)
    Dp = torch.zeros(9, 70, dim, dtype=dtype)
    for i in range(4):
        Qp[i, : qlens[i]] = q[qoff[i]: qoff[i + 1]].cpu()
    for i in range(9):
        Dp[i, : dlens[i]] = d[doff[i]: doff[i + 1]].cpu()
    ref = ms.maxsim_reference(Qp, Dp, lengths_mask(qlens, lq), lengths_mask(dlens, 70))[pq, pd]
    out = ms.score_pairs_packed(q, qoff.to(device), d, doff.to(device), pq.to(device), pd.to(device))
    assert_close(out, ref, dtype)


def test_one_query_corpus_larger_than_l2(ms, device, dtype):
    """One query against 268 MB of 16-bit documents: more than L2 on any
    GPU, so the CUDA streaming kernel reads them evict-first (smaller
    document sets, as in the tests above, take plain L2-keeping loads);
    token-mask holes and a NaN token included."""
    if device != "cuda" or dtype == torch.float32:
        pytest.skip("the load-policy switch is the CUDA streaming kernel's (16-bit tokens)")
    g = torch.Generator(device=device).manual_seed(17)
    nd, ld = 4096, 256
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, device=device, generator=g), dim=-1).to(dtype)
    Q, D = unit(1, 32, 128), unit(nd, ld, 128)
    dm = torch.rand(nd, ld, device=device, generator=g) > 0.2
    dm[11] = False
    D[4000, 7, 5] = float("nan")
    dm[4000, 7] = True
    out = ms.maxsim(Q, D, None, dm)
    ref = ms.maxsim_reference(Q, D, None, dm)
    assert torch.isnan(out[0, 4000]) and out[0, 11] == 0
    keep = torch.ones(nd, dtype=torch.bool, device=device)
    keep[4000] = False
    assert_close(out[:, keep], ref[:, keep], dtype)


@pytest.mark.parametrize("dim", [64, 128])
def test_one_query_many_documents(ms, device, dtype, dim):
    """More documents than a GPU keeps streaming warps resident (1056 on an
    H100), so the CUDA streaming kernel runs in several waves: ragged packed
    lengths with runs of empty documents (at both ends and inside), a NaN
    token, token masks on the padded layout, and per-query candidate lists
    of the same size."""
    g = torch.Generator().manual_seed(dim)
    nd, ld, lq = 3001, 40, 24
    dlens = torch.randint(0, ld + 1, (nd,), generator=g)
    dlens[:5] = 0
    dlens[-3:] = 0
    dlens[1000:1040] = 0
    dlens[17] = 9
    doff = torch.cat([torch.zeros(1, dtype=torch.long), dlens.cumsum(0)])
    Q = rand(1, lq, dim, dtype=dtype, device=device, gen=g)
    d = rand(int(doff[-1]), dim, dtype=dtype, device=device, gen=g)
    d[int(doff[17]) + 8, 3] = float("nan")
    Dp = torch.zeros(nd, ld, dim, dtype=dtype)
    for i in range(nd):
        Dp[i, : dlens[i]] = d[doff[i]: doff[i + 1]].cpu()
    dm = lengths_mask(dlens, ld)
    ref = ms.maxsim_reference(Q.cpu(), Dp, None, dm)
    out = ms.score_contrastive(Q, d, doff.to(device))
    assert torch.isnan(out[0, 17]) and torch.isnan(ref[0, 17])
    keep = torch.ones(nd, dtype=torch.bool)
    keep[17] = False
    assert_close(out[:, keep].cpu(), ref[:, keep], dtype)
    assert torch.all(out[0, dlens == 0] == 0)
    # padded layout with holes in the token mask
    Dd = Dp.to(device)
    dm2 = dm & (torch.rand(nd, ld, generator=g) > 0.3)
    ref2 = ms.maxsim_reference(Q.cpu(), Dp, None, dm2)
    out2 = ms.maxsim(Q, Dd, None, dm2.to(device))
    assert_close(out2[:, keep].cpu(), ref2[:, keep], dtype)
    # per-query candidates: 3 queries x 1000 documents each
    Qb = rand(3, lq, dim, dtype=dtype, device=device, gen=g)
    qlen = torch.randint(1, lq + 1, (3,), generator=g)
    Db = torch.nan_to_num(Dd[1:]).view(3, 1000, ld, dim)
    dlb = dlens[1:].view(3, 1000)
    dmb = lengths_mask(dlb.reshape(-1), ld).view(3, 1000, ld)
    refb = ms.maxsim_reference(Qb.cpu(), Db.cpu(), lengths_mask(qlen, lq), dmb)
    outb = ms.score_candidates_padded(Qb, Db, qlen.to(device), dlb.to(device))
    assert_close(outb.cpu(), refb, dtype)


def test_scan_of_many_waves(ms, device, dtype):
    """One query against 40000 short documents: on an H100 the CUDA streaming
    grid runs >= 12 waves, whose first wave loads plainly (16-bit) and the
    rest evict-first; ragged packed lengths (empty documents included) and a
    masked padded copy."""
    g = torch.Generator().manual_seed(23)
    nd, ld, lq, dim = 40000, 12, 8, 64
    dlens = torch.randint(0, ld + 1, (nd,), generator=g)
    doff = torch.cat([torch.zeros(1, dtype=torch.long), dlens.cumsum(0)])
    Q = rand(1, lq, dim, dtype=dtype, device=device, gen=g)
    d = rand(int(doff[-1]), dim, dtype=dtype, device=device, gen=g)
    Dp = torch.zeros(nd, ld, dim, dtype=dtype)
    mask = lengths_mask(dlens, ld)
    Dp[mask] = d.cpu()
    ref = ms.maxsim_reference(Q.cpu(), Dp, None, mask)
    assert_close(ms.score_contrastive(Q, d, doff.to(device)).cpu(), ref, dtype)
    holes = mask & (torch.rand(nd, ld, generator=g) > 0.25)
    ref2 = ms.maxsim_reference(Q.cpu(), Dp, None, holes)
    assert_close(ms.maxsim(Q, Dp.to(device), None, holes.to(device)).cpu(), ref2, dtype)


@pytest.mark.parametrize("dim", [64, 128])
def test_packed_documents_off_the_even_grid(ms, device, dtype, dim):
    """Packed documents whose token count is a multiple of their number, so
    the CUDA streaming kernel guesses each starts at id x extent and
    requests its first tiles before (start, len) arrive: documents on that
    grid, one on it but longer than the extent, ones shifted off it and back,
    empty ones and one with a NaN token. A wrong guess must refetch."""
    g = torch.Generator().manual_seed(31)
    nd, ext, lq = 1500, 24, 32
    dlens = torch.full((nd,), ext, dtype=torch.long)
    dlens[100], dlens[101] = ext + 7, ext - 7  # 100: on the grid, too long; 101: off it
    dlens[200], dlens[203] = ext - 13, ext + 13  # 201, 202, 203 start off the grid
    src = torch.randint(300, nd, (4000,), generator=g)
    dst = torch.randint(300, nd, (4000,), generator=g)
    for i, j in zip(src.tolist(), dst.tolist()):  # move tokens: the total stays nd x ext
        t = min(int(dlens[i]), 5)
        dlens[i] -= t
        dlens[j] += t
    dlens[400] += dlens[401]  # one long document next to an empty one
    dlens[401] = 0
    assert int(dlens.sum()) == nd * ext and int(dlens.max()) > ext
    doff = torch.cat([torch.zeros(1, dtype=torch.long), dlens.cumsum(0)])
    Q = rand(1, lq, dim, dtype=dtype, device=device, gen=g)
    d = rand(nd * ext, dim, dtype=dtype, device=device, gen=g)
    d[int(doff[101]) + 2, 9] = float("nan")
    # 200 starts on the grid and ends before its extent: its guessed tiles
    # read 201's first tokens, one NaN, which must not reach 200's score.
    d[int(doff[201]), 4] = float("nan")
    ld = int(dlens.max())
    Dp = torch.zeros(nd, ld, dim, dtype=dtype)
    mask = lengths_mask(dlens, ld)
    Dp[mask] = d.cpu()
    ref = ms.maxsim_reference(Q.cpu(), Dp, None, mask)
    out = ms.score_contrastive(Q, d, doff.to(device)).cpu()
    for i in (101, 201):
        assert torch.isnan(out[0, i]) and torch.isnan(ref[0, i])
    keep = torch.ones(nd, dtype=torch.bool)
    keep[[101, 201]] = False
    assert not torch.isnan(out[0, keep]).any()
    assert_close(out[:, keep], ref[:, keep], dtype)
    assert torch.all(out[0, dlens == 0] == 0)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("lq", [1, 8, 16, 17, 32, 33, 64, 100, 128])
def test_many_pairs_at_stage_edges(ms, device, dtype, dim, lq):
    """1200 pairs of one query of 1-128 rows: on an H100 at least one full
    wave of the sm_90a staged wgmma stream, which scores documents in stages of 64
    tokens through a ring of 3-5 shared-memory stages. Lengths at every
    stage edge (0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193) and long
    documents (1100 tokens: the ring wraps), token-mask holes, a document
    masked empty, a NaN token in a last partial stage; query masks (one
    query, packed documents, padded with masks) and lengths (per-query
    candidates), and a pair list with out-of-range ids (NaN scores)."""
    if device != "cuda" or dtype == torch.float32:
        pytest.skip("16-bit CUDA shapes (the other kernels are covered elsewhere)")
    g = torch.Generator().manual_seed(dim * 7 + lq)
    nd, ld = 1200, 1100
    edges = [0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193]
    dlens = torch.randint(0, 260, (nd,), generator=g)
    dlens[: len(edges)] = torch.tensor(edges)
    dlens[[20, 600, 1199]] = ld
    doff = torch.cat([torch.zeros(1, dtype=torch.long), dlens.cumsum(0)])
    Q = rand(1, lq, dim, dtype=dtype, device=device, gen=g)
    d = rand(int(doff[-1]), dim, dtype=dtype, device=device, gen=g)
    nan_doc = 9  # 129 tokens: token 128 is alone in its last stage
    d[int(doff[nan_doc]) + 128, 2] = float("nan")
    mask = lengths_mask(dlens, ld).to(device)
    Dp = torch.zeros(nd, ld, dim, dtype=dtype, device=device)
    Dp[mask] = d
    qm = torch.rand(1, lq, generator=g) > 0.3
    qm[0, 0] = True
    qm = qm.to(device)
    keep = torch.ones(nd, dtype=torch.bool, device=device)
    keep[nan_doc] = False
    ref = ms.maxsim_reference(Q, Dp, None, mask)
    out = ms.score_contrastive(Q, d, doff.to(device))
    assert torch.isnan(out[0, nan_doc]) and torch.isnan(ref[0, nan_doc])
    assert torch.all(out[0, (dlens == 0).to(device)] == 0)
    assert_close(out[:, keep], ref[:, keep], dtype)
    holes = mask & (torch.rand(nd, ld, generator=g) > 0.25).to(device)
    holes[40] = False
    ref2 = ms.maxsim_reference(Q, Dp, qm, holes)
    out2 = ms.maxsim(Q, Dp, qm, holes)
    assert out2[0, 40] == 0
    assert_close(out2[:, keep], ref2[:, keep], dtype)
    # per-query candidates: 3 queries x 400 documents with lengths
    Qb = rand(3, lq, dim, dtype=dtype, device=device, gen=g)
    qlen = torch.randint(1, lq + 1, (3,), generator=g).to(device)
    Db = torch.nan_to_num(Dp[:, :260]).view(3, 400, 260, dim)
    dlb = dlens.clamp(max=260).view(3, 400).to(device)
    refb = ms.maxsim_reference(Qb, Db, lengths_mask(qlen, lq), lengths_mask(dlb.reshape(-1), 260).view(3, 400, 260))
    assert_close(ms.score_candidates_padded(Qb, Db, qlen, dlb), refb, dtype)
    # a pair list over the packed documents; ids past the end score NaN
    P = 1300
    pd = torch.randint(0, nd, (P,), generator=g)
    pd[[5, 700]] = nd
    qoff = torch.tensor([0, lq], device=device)
    out3 = ms.score_pairs_packed(Q[0], qoff, d, doff.to(device), torch.zeros(P, dtype=torch.long, device=device),
                                 pd.to(device))
    bad = (pd == nd) | (pd == nan_doc)
    assert torch.all(torch.isnan(out3[bad.to(device)]))
    assert_close(out3[(~bad).to(device)], ref[0, pd[~bad].to(device)], dtype)
    # the candidates' queries packed at their lengths, paired freely; a query
    # id past the end scores NaN
    ql3 = qlen.cpu()
    qp = torch.cat([Qb[i, : ql3[i]] for i in range(3)])
    qoff3 = torch.cat([torch.zeros(1, dtype=torch.long), ql3.cumsum(0)]).to(device)
    pq = torch.randint(0, 3, (P,), generator=g)
    pq[[3, 900]] = 3
    out4 = ms.score_pairs_packed(qp, qoff3, d, doff.to(device), pq.to(device), pd.to(device), max_query_length=lq)
    bad4 = bad | (pq == 3)
    assert torch.all(torch.isnan(out4[bad4.to(device)]))
    ref4 = ms.maxsim_reference(Qb, Dp, lengths_mask(qlen, lq), mask)
    assert_close(out4[(~bad4).to(device)], ref4[pq[~bad4].to(device), pd[~bad4].to(device)], dtype)


@pytest.mark.parametrize("case", ["one-query-long", "grouped-2", "grouped-4", "few-pairs-d64"])
def test_streaming_split_pairs(ms, device, case):
    """Shapes where the CUDA streaming kernel splits each pair over 2, 4 or 8
    warps (every S-th tile of 8 tokens each, row maxima combined in shared
    memory; H100 heuristic): one query against long documents and few
    per-query candidates at d = 64 (one pair per 8-warp CTA: <= one CTA per
    SM, >= 32 tiles), and per-query candidates in several waves (S = 2 for
    ~25 tiles, S = 4 for ~50). Ragged lengths and mask holes put a document's
    end in any warp's tile or leave a warp no tile; a NaN token in a late
    tile must reach the score; 16-bit, lq 17 / 32 (two m tiles,
    the second partial)."""
    if device != "cuda":
        pytest.skip("CUDA heuristic shapes (the CPU kernel is covered elsewhere)")
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed({"one-query-long": 1, "grouped-2": 2, "grouped-4": 3, "few-pairs-d64": 4}[case])
    dim = 64 if case == "few-pairs-d64" else 128
    if case == "one-query-long":
        nq, k, lq, ld = 1, 60, 17, 1100
    elif case == "grouped-2":
        nq, k, lq, ld = 20, 100, 32, 200
    elif case == "few-pairs-d64":
        nq, k, lq, ld = 3, 40, 32, 300
    else:
        nq, k, lq, ld = 4, 500, 32, 400
    Q = rand(nq, lq, dim, dtype=dtype, gen=g)
    D = rand(nq, k, ld, dim, dtype=dtype, gen=g)
    dlen = torch.randint(0, ld + 1, (nq, k), generator=g)
    dlen[0, :3] = torch.tensor([0, 1, ld])
    dm = lengths_mask(dlen.reshape(-1), ld).view(nq, k, ld) & (torch.rand(nq, k, ld, generator=g) > 0.1)
    dm[0, 4] = False  # no valid token: score 0
    dlen[0, 5] = ld
    dm[0, 5] = True
    D[0, 5, ld - 3, 7] = float("nan")  # late token of a full-length doc: NaN score
    qlen = torch.randint(1, lq + 1, (nq,), generator=g)
    qm = lengths_mask(qlen, lq)
    ref = ms.maxsim_reference(Q, D, qm, dm)
    Qd, Dd = Q.to(device), D.to(device)
    if case == "one-query-long":
        out = ms.maxsim(Qd, Dd[0], qm.to(device), dm[0].to(device)).view(1, k)
    else:
        out = ms.maxsim(Qd, Dd, qm.to(device), dm.to(device))
    out = out.cpu()
    assert torch.isnan(out[0, 5]) and torch.isnan(ref[0, 5])
    assert out[0, 4] == 0
    keep = torch.ones(nq, k, dtype=torch.bool)
    keep[0, 5] = False
    assert_close(out[keep], ref[keep], dtype)
    # lengths instead of masks (the packed bounds, no mask reads)
    if case != "one-query-long":
        Dn = torch.nan_to_num(D)
        ref2 = ms.maxsim_reference(Q, Dn, qm, lengths_mask(dlen.reshape(-1), ld).view(nq, k, ld))
        out2 = ms.score_candidates_padded(Qd, Dn.to(device), qlen.to(device), dlen.to(device))
        assert_close(out2.cpu(), ref2, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["stream_wg", "mma", "wgmma", "simt", "packed"])
@pytest.mark.parametrize("lq,ld", [(1, 1), (17, 63), (32, 65), (33, 200), (32, 130)])
def test_argmax_of_each_family(ms, family, lq, ld):
    """Every family that writes argmax rows, forced: scores and argmax against
    fp64 with lengths (empty documents too), exact ties resolved to the lower
    token, and the first NaN token winning its rows."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(lq * 1000 + ld)
    B, K, dim = 3, 5, 128
    Q = rand(B, lq, dim, dtype=dtype, gen=g)
    D = rand(B, K, ld, dim, dtype=dtype, gen=g) * 0.25
    # Pair (0, 1): every query row's best token sits at two positions.
    j1, j2 = ld // 3, ld - 1
    D[0, 1, j1] = D[0, 1, j2] = Q[0, 0]
    Q[0, :] = Q[0, 0]
    # Pair (1, 2): NaN at two valid tokens; the lower one is every row's argmax.
    n1, n2 = ld // 2, ld - 1
    D[1, 2, n2, 5] = D[1, 2, n1, 3] = float("nan")
    qlen = torch.randint(1, lq + 1, (B,), generator=g)
    dlen = torch.randint(0, ld + 1, (B, K), generator=g)
    dlen[0, 1] = dlen[1, 2] = ld
    dlen[2, 3] = 0
    Qc, Dc = Q.cuda(), D.cuda()
    with ms.forcing(family):
        if ms.explain(Qc.detach().requires_grad_(), Dc)["family"] != family:  # a training plan: argmax
            pytest.skip(f"{family} cannot take this call on this device")
        s, am = ms.score_candidates_padded_with_argmax(Qc, Dc, qlen.cuda(), dlen.cuda())
    ref = ms.maxsim_reference(Q, D, lengths_mask(qlen, lq), lengths_mask(dlen, ld).view(B, K, ld))
    assert torch.isnan(s[1, 2]) and torch.isnan(ref[1, 2])
    keep = torch.ones(B, K, dtype=torch.bool)
    keep[1, 2] = False
    assert_close(s.cpu()[keep], ref[keep], dtype)
    am = am.cpu()
    assert torch.all(am[0, 1, : qlen[0]] == j1), am[0, 1]
    assert torch.all(am[1, 2, : qlen[1]] == n1), am[1, 2]
    assert torch.all(am[:, :, :][lengths_mask(qlen, lq)[:, None, :].expand(B, K, lq).logical_not()] == -1)
    assert torch.all(am[2, 3] == -1)
    Dn = D.clone()
    Dn[1, 2] = 0
    am[1, 2] = torch.where(am[1, 2] >= 0, 0, -1)
    _check_argmax(Q, Dn, am, qlen, dlen)
