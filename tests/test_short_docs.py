"""Many short documents: scores and argmax against an fp64 oracle on every
device; on CUDA the packed short-document kernel (``plan::Family::kPacked``)
is checked to be the planner's choice for several queries over many short
shared documents, and forced (``maxsim.forcing("packed")``) for the layouts
it also serves: odd document lengths 1-127, lengths including 0, token masks
with holes, NaN tokens, ties, documents straddling column tiles and CTAs,
and CUDA-graph capture."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import assert_close, capture_cuda_graph, lengths_mask, rand

SHORT_DTYPES = [torch.float16, torch.bfloat16]


def _packed_on(ms, device):
    """Force the packed kernel on CUDA (a no-op elsewhere)."""
    return ms.forcing("packed") if device == "cuda" else contextlib.nullcontext()


def _check_argmax_cross(Q, Dp, dmask, qlen, am):
    """Cross layout: the chosen token attains the row max over the valid
    tokens (within 1e-5 of fp64), -1 where no token counts; ties can only be
    checked where values are distinct, so equal maxima are tested apart."""
    sims = torch.einsum("qid,njd->qnij", Q.double().cpu(), Dp.double().cpu())
    sims = sims.masked_fill(~dmask.cpu()[None, :, None, :], float("-inf"))
    best = sims.max(dim=3).values
    has = dmask.cpu().any(dim=1)[None, :, None] & lengths_mask(qlen.cpu(), Q.shape[1])[:, None, :]
    am = am.cpu().long()
    assert torch.all(am[~has] == -1)
    got = torch.gather(sims, 3, am.clamp(min=0)[..., None])[..., 0]
    assert torch.all(((got - best).abs() <= 1e-5 * best.abs().clamp_min(1.0))[has]), "argmax misses the max"


@pytest.mark.parametrize("dtype", SHORT_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("ld", [1, 3, 7, 15, 17, 33, 65, 127])
def test_shared_short_documents(ms, device, dtype, ld):
    """Several queries x many padded documents with prefix lengths (0
    included) and holes: the planner's own path (packed on CUDA for
    ld <= 32), then forced packed for every length."""
    dim = 64 if ld in (3, 17, 65) else 128
    g = torch.Generator().manual_seed(ld)
    nq, lq, nd = 9, 17, 701  # 17 rows -> 32-row slots, 4 per tile: a part-filled second M tile
    Q = rand(nq, lq, dim, dtype=dtype, device=device, gen=g)
    D = rand(nd, ld, dim, dtype=dtype, device=device, gen=g)
    dlen = torch.randint(0, ld + 1, (nd,), generator=g)
    dlen[:3] = torch.tensor([0, ld, 1])
    dm = lengths_mask(dlen, ld) & (torch.rand(nd, ld, generator=g) > 0.15)
    qm = lengths_mask(torch.randint(1, lq + 1, (nq,), generator=g), lq) & (torch.rand(nq, lq, generator=g) > 0.1)
    qm[:, 0] = True
    qm, dm = qm.to(device), dm.to(device)
    ref = ms.maxsim_reference(Q, D, qm, dm)
    if device == "cuda" and ld <= 32:
        assert ms.explain(Q, D)["family"] == "packed"
    assert_close(ms.maxsim(Q, D, qm, dm), ref, dtype)
    with _packed_on(ms, device):
        assert_close(ms.maxsim(Q, D, qm, dm), ref, dtype)
        assert_close(ms.maxsim(Q, D), ms.maxsim_reference(Q, D), dtype)


@pytest.mark.parametrize("dtype", SHORT_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("ld", [1, 2, 4, 8, 16, 32, 64, 128, 192])
@pytest.mark.parametrize("nq,lq", [(9, 32), (21, 5)])
def test_documents_of_one_length(ms, device, dtype, ld, nq, lq):
    """Every document of one length (the packed kernel's aligned epilogue:
    whole documents per lane, half or a quarter of one, or whole column
    tiles each), forced packed: token masks with holes and a fully masked
    document, query masks, a NaN token, 32- and 8-row query slots, shared
    documents and per-query candidates."""
    g = torch.Generator().manual_seed(ld * 100 + lq)
    nd, dim = 701 if ld <= 64 else 97, 128
    Q = rand(nq, lq, dim, dtype=dtype, device=device, gen=g)
    D = rand(nd, ld, dim, dtype=dtype, device=device, gen=g)
    D[5, ld // 2, 7] = float("nan")
    dm = torch.rand(nd, ld, generator=g) > 0.2
    dm[3] = False
    dm[5, ld // 2] = True
    qm = torch.rand(nq, lq, generator=g) > 0.1
    qm[:, 0] = True
    qm, dm = qm.to(device), dm.to(device)
    with _packed_on(ms, device):
        out = ms.maxsim(Q, D, qm, dm)
        plain = ms.maxsim(Q, D)
        K = nd // nq
        cand = ms.maxsim(Q, D[: nq * K].reshape(nq, K, ld, dim), qm, dm[: nq * K].reshape(nq, K, ld))
    ref = ms.maxsim_reference(Q, D, qm, dm)
    assert torch.isnan(plain.cpu()[:, 5]).all() and torch.isnan(out.cpu()[:, 5]).all()
    keep = torch.ones(nd, dtype=torch.bool)
    keep[5] = False
    assert_close(out.cpu()[:, keep], ref.cpu()[:, keep], dtype)
    assert torch.all(out.cpu()[:, 3] == 0)
    assert_close(plain.cpu()[:, keep], ms.maxsim_reference(Q, D).cpu()[:, keep], dtype)
    cref = torch.stack([ref[i, i * K:(i + 1) * K] for i in range(nq)])
    ckeep = torch.stack([keep[i * K:(i + 1) * K] for i in range(nq)])
    assert_close(cand.cpu()[ckeep], cref.cpu()[ckeep], dtype)


@pytest.mark.parametrize("dtype", SHORT_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("nq,lq", [(33, 8), (4, 32), (130, 1), (21, 12), (45, 3), (64, 2)])
def test_ragged_packed_documents_with_argmax(ms, device, dtype, nq, lq):
    """score_contrastive over 900 packed documents of 0-48 tokens (so the
    document table of a CTA and the column tiles end mid-document) with
    query lengths (slots of 1 to 32 rows); scores and argmax."""
    g = torch.Generator().manual_seed(nq + lq)
    nd, dim = 900, 128
    dlens = torch.randint(0, 49, (nd,), generator=g)
    dlens[10:14] = 0
    dlens[700] = 130  # one document longer than two column tiles
    doff = torch.cat([torch.zeros(1, dtype=torch.long), dlens.cumsum(0)])
    qlen = torch.randint(1, lq + 1, (nq,), generator=g)
    Q = rand(nq, lq, dim, dtype=dtype, device=device, gen=g)
    d = rand(int(doff[-1]), dim, dtype=dtype, device=device, gen=g)
    ld = int(dlens.max())
    dmask = lengths_mask(dlens, ld)
    Dp = torch.zeros(nd, ld, dim, dtype=dtype)
    Dp[dmask] = d.cpu()
    ref = ms.maxsim_reference(Q.cpu(), Dp, lengths_mask(qlen, lq), dmask)
    with _packed_on(ms, device):
        out = ms.score_contrastive(Q, d, doff.to(device), qlen.to(device))
        s2, am = ms.score_contrastive_with_argmax(Q, d, doff.to(device), qlen.to(device))
    assert_close(out, ref, dtype)
    assert_close(s2, ref, dtype)
    assert am.shape == (nq, nd, lq)
    assert torch.all(out.cpu()[:, dlens == 0] == 0)
    _check_argmax_cross(Q, Dp, dmask, qlen, am)


@pytest.mark.parametrize("dtype", SHORT_DTYPES, ids=["fp16", "bf16"])
def test_candidates_with_lengths(ms, device, dtype):
    """Per-query candidates (GROUPED) with document lengths, forced packed:
    each CTA takes part of one query's candidates."""
    g = torch.Generator().manual_seed(5)
    B, K, lq, ld, dim = 6, 333, 24, 24, 128
    Q = rand(B, lq, dim, dtype=dtype, device=device, gen=g)
    D = rand(B, K, ld, dim, dtype=dtype, device=device, gen=g)
    qlen = torch.randint(1, lq + 1, (B,), generator=g)
    dlen = torch.randint(0, ld + 1, (B, K), generator=g)
    ref = ms.maxsim_reference(Q, D, lengths_mask(qlen, lq), lengths_mask(dlen, ld).view(B, K, ld))
    with _packed_on(ms, device):
        if device == "cuda":
            assert ms.explain(Q, D, force="packed")["family"] == "packed"
        out = ms.score_candidates_padded(Q, D, qlen.to(device), dlen.to(device))
        s2, am = ms.score_candidates_padded_with_argmax(Q, D, qlen.to(device), dlen.to(device))
    assert_close(out, ref, dtype)
    assert_close(s2, ref, dtype)
    for b in range(B):
        _check_argmax_cross(Q[b:b + 1], D[b], lengths_mask(dlen[b], ld), qlen[b:b + 1], am[b:b + 1])


@pytest.mark.parametrize("dtype", SHORT_DTYPES, ids=["fp16", "bf16"])
def test_nan_ties_and_invalid(ms, device, dtype):
    """A NaN token makes its document's scores NaN (unless masked); equal
    maxima pick the lowest index; an invalid length makes its pair NaN."""
    g = torch.Generator().manual_seed(3)
    nq, lq, nd, ld, dim = 6, 32, 300, 8, 128
    Q = rand(nq, lq, dim, dtype=dtype, device=device, gen=g)
    D = rand(nd, ld, dim, dtype=dtype, device=device, gen=g)
    D[17, 5, 3] = float("nan")
    D[40, 2, 0] = float("nan")
    dm = torch.ones(nd, ld, dtype=torch.bool)
    dm[40, 2] = False
    D[99] = D[99, 2].clone()  # all tokens equal: argmax 0
    D[98, 4:] = D[98, 3].clone() * 4  # tokens 3 (scaled) < 4 == 5 == 6 == 7 in magnitude: ties from 4
    with _packed_on(ms, device):
        s = ms.maxsim(Q, D, None, dm.to(device)).cpu()
        docs = D.reshape(nd * ld, dim)
        off = torch.arange(0, nd * ld + 1, ld, device=device)
        s2, am = ms.score_contrastive_with_argmax(Q, docs, off)
    assert torch.isnan(s[:, 17]).all() and torch.isnan(s2.cpu()[:, 17]).all()
    keep = torch.ones(nd, dtype=torch.bool)
    keep[17] = False
    ref = ms.maxsim_reference(Q, D, None, dm.to(device))
    assert_close(s[:, keep], ref.cpu()[:, keep], dtype)
    assert torch.all(am.cpu()[:, 99] == 0)
    a98 = am.cpu()[:, 98]
    assert torch.all(a98 <= 4), a98  # never a later tie (5, 6, 7)
    dlen = torch.full((nq, 50), ld, device=device)
    dlen[1, 7] = -1  # an invalid length: that pair only is NaN
    with _packed_on(ms, device):
        s3 = ms.score_candidates_padded(Q, D[:nq * 50].reshape(nq, 50, ld, dim), None, dlen).cpu()
    nan = torch.zeros(nq, 50, dtype=torch.bool)
    nan[1, 7] = nan[0, 17] = nan[0, 40] = True  # and query 0's candidates 17 and 40 hold NaN tokens
    assert torch.equal(torch.isnan(s3), nan)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_packed_under_cuda_graph(ms):
    g = torch.Generator().manual_seed(9)
    Q = rand(40, 32, 128, dtype=torch.bfloat16, device="cuda", gen=g)
    D = rand(3000, 12, 128, dtype=torch.bfloat16, device="cuda", gen=g)
    assert ms.explain(Q, D)["family"] == "packed"
    eager = ms.maxsim(Q, D)
    graph, out = capture_cuda_graph(lambda: ms.maxsim(Q, D))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert_close(eager, ms.maxsim_reference(Q, D), torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_packed_many_documents_per_cta(ms):
    """Enough documents that each CTA's document table spans every thread's
    entries (hundreds of documents) and the last CTA a partial one."""
    g = torch.Generator().manual_seed(12)
    Q = rand(300, 1, 64, dtype=torch.float16, device="cuda", gen=g)  # one-row queries: 128 per tile
    D = rand(90001, 2, 64, dtype=torch.float16, device="cuda", gen=g)
    p = ms.explain(Q, D)
    assert p["family"] == "packed" and p["dpc"] > 256 and p["rows"] == 1, p
    assert p["dpc"] * p["cpg"] > 90001 > p["dpc"] * (p["cpg"] - 1), p
    ref = ms.maxsim_reference(Q, D)
    out = ms.maxsim(Q, D)
    assert not torch.isnan(out).any()
    assert_close(out, ref, torch.float16)


# ---- the register stream's runs of pairs (forward_stream_run.cuh) -----------
# One query's consecutive short documents (CROSS with one query, GROUPED
# candidates) in runs of pairs per warp: forced on ("stream_run", the longest
# runs, so even a few hundred documents span runs of 32 pairs and the steps
# in flight cross document and run boundaries) and off ("stream_pair": one
# pair per warp or split pairs), whose scores must be the same bits.

CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _bits(x):
    return x.float().contiguous().view(torch.int32)


def _stream_modes(ms, fn, Q, D, family="stream"):
    """fn() under forced runs and forced single pairs of a stream (``stream``
    or ``stream_wg``): (runs, pairs), after checking that each mode is the
    plan explain shows for (Q, D)."""
    with ms.forcing(f"{family}_run"):
        p = ms.explain(Q, D)
        assert p["family"] == family and p["run"] >= 1, p
        runs = fn()
    with ms.forcing(f"{family}_pair"):
        p = ms.explain(Q, D)
        assert p["family"] == family and p["run"] == 0, p
        pairs = fn()
    return runs, pairs


def _same_bits(a, b):
    """Scores (and argmax) equal bit for bit."""
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    for x, y in zip(a, b):
        assert torch.equal(_bits(x) if x.is_floating_point() else x, _bits(y) if y.is_floating_point() else y)


def _check_against(out, ref, dtype, nan_docs, zero_docs):
    """NaN exactly for nan_docs, 0 for zero_docs, the fp64 reference elsewhere."""
    out, ref = out.cpu(), ref.cpu()
    nan = torch.zeros(out.shape[-1], dtype=torch.bool)
    nan[nan_docs] = True
    assert torch.equal(torch.isnan(out[0]), nan)
    if zero_docs.any():
        assert torch.all(out[0, zero_docs] == 0)
    assert_close(out[:, ~nan], ref[:, ~nan], dtype)


@CUDA_ONLY
@pytest.mark.parametrize("dtype", SHORT_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("lq", [1, 7, 32])
@pytest.mark.parametrize("nd", [1, 7, 300, 5000])
@pytest.mark.parametrize("ld", [1, 3, 8, 15, 16, 24, 32])
def test_stream_runs_one_query(ms, dtype, dim, lq, nd, ld):
    """One query x nd documents of ld tokens, the register stream's runs
    against one pair per warp (_one_query_runs)."""
    _one_query_runs(ms, "stream", dtype, dim, lq, nd, ld, 1000 * ld + nd + lq + dim, argmax=False)


def _one_query_runs(ms, family, dtype, dim, lq, nd, ld, seed, argmax):
    """One query x nd documents of ld tokens: padded with token masks (holes,
    prefix lengths including 0, fully masked documents) and a NaN token (NaN
    for that document only); ragged with lengths including 0, and a NaN
    token or (argmax) the argmax rows. Runs of pairs of `family` against
    fp64 (the argmax attains the max), and bitwise against single pairs."""
    g = torch.Generator().manual_seed(seed)
    Q = rand(1, lq, dim, dtype=dtype, gen=g).cuda()
    qm = torch.rand(1, lq, generator=g) > 0.2
    qm[0, 0] = True
    # padded documents, token masks
    D = rand(nd, ld, dim, dtype=dtype, gen=g)
    dlen = torch.randint(0, ld + 1, (nd,), generator=g)
    dm = lengths_mask(dlen, ld) & (torch.rand(nd, ld, generator=g) > 0.2)
    dm[::5] = False  # fully masked documents score 0
    bad = nd // 2
    dm[bad, ld - 1] = True
    D[bad, ld - 1, dim // 3] = float("nan")
    D, dm, qm = D.cuda(), dm.cuda(), qm.cuda()
    ref = ms.maxsim_reference(Q, D, qm, dm)
    runs, pairs = _stream_modes(ms, lambda: ms.maxsim(Q, D, qm, dm), Q, D, family)
    _same_bits(runs, pairs)
    _check_against(runs, ref, dtype, [bad], ~dm.cpu().any(dim=1))
    # ragged documents, lengths (0 included), no masks
    dlens = torch.randint(0, ld + 1, (nd,), generator=g)
    dlens[::7] = 0
    dlens[bad] = ld
    doff = torch.cat([torch.zeros(1, dtype=torch.long), dlens.cumsum(0)])
    d = rand(int(doff[-1]), dim, dtype=dtype, gen=g)
    if not argmax:
        d[int(doff[bad]), 0] = float("nan")
    Dp = torch.zeros(nd, ld, dim, dtype=dtype)
    dmask = lengths_mask(dlens, ld)
    Dp[dmask] = d
    ref2 = ms.maxsim_reference(Q.cpu(), Dp, None, dmask)
    d, doff = d.cuda(), doff.cuda()
    score = ms.score_contrastive_with_argmax if argmax else ms.score_contrastive
    runs2, pairs2 = _stream_modes(ms, lambda: score(Q, d, doff), Q, Dp.to("meta"), family)
    _same_bits(runs2, pairs2)
    if argmax:
        assert_close(runs2[0], ref2, dtype)
        assert torch.all(runs2[0].cpu()[0, dlens == 0] == 0)
        _check_argmax_cross(Q, Dp, dmask, torch.tensor([lq]), runs2[1])
    else:
        _check_against(runs2, ref2, dtype, [bad], dlens == 0)


@CUDA_ONLY
@pytest.mark.parametrize("dtype", SHORT_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("dim", [64, 128])
def test_stream_runs_candidates(ms, dtype, dim):
    """The register stream's runs over B 3 x K 1000 x Ld 24 candidates (1000 =
    31 runs of 32 + 8; _candidates_runs)."""
    _candidates_runs(ms, "stream", dtype, 1000, 32, 24, dim, dim + 3, argmax=False)


def _candidates_runs(ms, family, dtype, K, lq, ld, dim, seed, argmax):
    """Per-query candidates (GROUPED), B 3 x K with query and document lengths
    (0 included, a full document on each side of the first run boundary, one
    invalid length: NaN for that pair): `family`'s runs never cross a query's
    candidates; bitwise the single pairs' scores (and argmax), against fp64
    (the argmax attains each row's max, -1 where no token counts)."""
    g = torch.Generator().manual_seed(seed)
    B = 3
    Q = rand(B, lq, dim, dtype=dtype, gen=g).cuda()
    D = rand(B, K, ld, dim, dtype=dtype, gen=g).cuda()
    qlen = torch.randint(1, lq + 1, (B,), generator=g)
    qlen[1] = 3
    dlen = torch.randint(0, ld + 1, (B, K), generator=g)
    dlen[:, :40:3] = 0
    dlen[0, 31:33] = ld
    qmask, dmask = lengths_mask(qlen, lq), lengths_mask(dlen.reshape(-1), ld).view(B, K, ld)
    ref = ms.maxsim_reference(Q, D, qmask.cuda(), dmask.cuda())
    qlen, dlen = qlen.cuda(), dlen.cuda()
    score = ms.score_candidates_padded_with_argmax if argmax else ms.score_candidates_padded
    runs, pairs = _stream_modes(ms, lambda: score(Q, D, qlen, dlen), Q, D, family)
    _same_bits(runs, pairs)
    scores = runs[0] if argmax else runs
    assert_close(scores, ref, dtype)
    assert torch.all(scores.cpu()[dlen.cpu() == 0] == 0)
    if argmax:
        sims = torch.einsum("bid,bkjd->bkij", Q.double().cpu(), D.double().cpu())
        sims = sims.masked_fill(~dmask[:, :, None, :], float("-inf"))
        has = dmask.any(dim=2)[:, :, None] & qmask[:, None, :]
        am = runs[1].cpu().long()
        assert torch.all(am[~has] == -1)
        got = torch.gather(sims, 3, am.clamp(min=0)[..., None])[..., 0]
        best = sims.max(dim=3).values
        assert torch.all(((got - best).abs() <= 1e-5 * best.abs().clamp_min(1.0))[has])
    bad = dlen.clone()
    bad[2, K // 2] = -1
    fn = lambda: ms.score_candidates_padded(Q, D, qlen, bad, validate=False)  # noqa: E731
    runs, pairs = _stream_modes(ms, fn, Q, D, family)
    _same_bits(runs, pairs)
    nan = torch.zeros(B, K, dtype=torch.bool)
    nan[2, K // 2] = True
    assert torch.equal(torch.isnan(runs.cpu()), nan)


def _runs_by_the_rule(ms, family, seed, lq, nd, ld, cand_ld, score_candidates):
    """One query x nd documents of ld tokens, and 64 queries x 1000 own
    candidates of up to cand_ld tokens (lengths 0 included), take `family`'s
    runs by the planner's own rule, bitwise the one-pair scores (and argmax),
    also replayed in a CUDA graph; 300-token documents take no runs."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    Q = torch.randn(1, lq, 128, device="cuda", generator=g).to(torch.bfloat16)
    D = torch.randn(nd, ld, 128, device="cuda", generator=g).to(torch.bfloat16)
    p = ms.explain(Q, D)
    assert (p["family"], p["run"] >= 2) == (family, True), p
    out = ms.maxsim(Q, D)
    with ms.forcing(f"{family}_pair"):
        _same_bits(out, ms.maxsim(Q, D))
    assert_close(out, ms.maxsim_reference(Q, D), torch.bfloat16)
    graph, graph_out = capture_cuda_graph(lambda: ms.maxsim(Q, D))
    graph_out.fill_(float("nan"))
    graph.replay()
    _same_bits(graph_out, out)
    p = ms.explain(Q, torch.empty(20000, 300, 128, dtype=torch.bfloat16, device="meta"))
    assert p.get("run", 0) == 0, p
    Qb = torch.randn(64, 32, 128, device="cuda", generator=g).to(torch.bfloat16)
    Db = torch.randn(64, 1000, cand_ld, 128, device="cuda", generator=g).to(torch.bfloat16)
    dlen = torch.randint(0, cand_ld + 1, (64, 1000), device="cuda", generator=g)
    p = ms.explain(Qb, Db)
    assert (p["family"], p["run"] >= 2) == (family, True), p
    outb = score_candidates(Qb, Db, None, dlen)
    with ms.forcing(f"{family}_pair"):
        _same_bits(outb, score_candidates(Qb, Db, None, dlen))
    ref = ms.maxsim_reference(Qb, Db, None, lengths_mask(dlen.reshape(-1), cand_ld).view(64, 1000, cand_ld))
    assert_close(outb[0] if isinstance(outb, tuple) else outb, ref, torch.bfloat16)


@CUDA_ONLY
def test_stream_runs_by_the_rule(ms):
    """The register stream's runs: 1 x 60000 documents of 8 tokens, candidates
    of up to 24 (_runs_by_the_rule)."""
    _runs_by_the_rule(ms, "stream", 31, 32, 60000, 8, 24, ms.score_candidates_padded)


# ---- the staged wgmma stream's runs of pairs (forward_stream_wg.cuh) --------
# sm_90a: one query's consecutive documents (CROSS) and a query's candidates
# (GROUPED) in runs of pairs per CTA, forced on ("stream_wg_run": the longest
# runs, so stages in flight cross document and run boundaries) and off
# ("stream_wg_pair": one pair per CTA): documents of one to several 64-token
# stages, lengths including 0, holes, NaN tokens, 1-128 query rows, argmax;
# the same bits either way.

SM90A = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                           reason="the staged wgmma stream needs an sm_90a GPU")


@SM90A
@pytest.mark.parametrize("dtype", SHORT_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("lq", [1, 17, 32, 33, 128])
@pytest.mark.parametrize("nd,ld", [(1, 64), (7, 1), (300, 64), (333, 65), (100, 130), (1500, 17), (40, 300)])
def test_stream_wg_runs_one_query(ms, dtype, dim, lq, nd, ld):
    """One query x nd documents of one to several stages, the staged wgmma
    stream's runs against one pair per CTA, with the argmax
    (_one_query_runs)."""
    _one_query_runs(ms, "stream_wg", dtype, dim, lq, nd, ld, 7 * ld + nd + lq + dim, argmax=True)


@SM90A
@pytest.mark.parametrize("dtype", SHORT_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("lq,ld", [(32, 64), (32, 150), (100, 70)])
def test_stream_wg_runs_candidates(ms, dtype, lq, ld):
    """The staged wgmma stream's runs over B 3 x K 100 candidates (100 = 3
    runs of 32 + 4), with the argmax (_candidates_runs)."""
    _candidates_runs(ms, "stream_wg", dtype, 100, lq, ld, 128, lq + ld, argmax=True)


@SM90A
def test_stream_wg_runs_by_the_rule(ms):
    """The staged wgmma stream's runs: 1 query of 64 rows x 20000 documents of
    64 tokens, candidates of up to 64 with the argmax (_runs_by_the_rule)."""
    _runs_by_the_rule(ms, "stream_wg", 37, 64, 20000, 64, 64, ms.score_candidates_padded_with_argmax)
