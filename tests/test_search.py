"""search() / Corpus: exact top-k against the fp64 reference, ties, masks,
storages (device, pinned streaming, cpu), quantised corpora."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, capture_cuda_graph, rand

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def quant_tol(kind, device):
    """Relative tolerance of 8-bit scores against the dequantised fp64
    reference: exact paths 1e-5; fp8 scores on Hopper's fp8 wgmma, whose
    accumulator keeps fewer bits than fp32 (measured 4.5e-5), 2e-4."""
    hopper = device == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    return 2e-4 if kind == "fp8" and hopper else 1e-5


def packed_corpus(n, dim, dtype, device, gen, max_len=40, min_len=0):
    lens = torch.randint(min_len, max_len + 1, (n,), generator=gen)
    off = torch.zeros(n + 1, dtype=torch.int64)
    off[1:] = lens.cumsum(0)
    docs = rand(int(off[-1]), dim, dtype=dtype, device=device, gen=gen)
    return docs, off.to(device)


def ref_scores(ms, Q, docs, off, q_len=None, q_mask=None, d_mask=None):
    """fp64 [Nq, N] MaxSim of padded queries against packed documents."""
    Nq, Lq, d = Q.shape
    q_start = torch.arange(Nq, dtype=torch.int32) * Lq
    ql = torch.full((Nq,), Lq, dtype=torch.int32) if q_len is None else q_len.to(torch.int32).cpu()
    off = off.cpu().long()
    s, _ = ms.reference.forward(
        Q.reshape(-1, d).cpu(), q_start, ql, None if q_mask is None else q_mask.reshape(-1).cpu(),
        docs.cpu(), off[:-1].to(torch.int32), (off[1:] - off[:-1]).to(torch.int32),
        None if d_mask is None else d_mask.cpu(), None, None, 0, Lq, 0, accum=torch.float64)
    return s.view(Nq, -1)


def ref_topk(scores: torch.Tensor, k: int):
    """Top-k by (score desc, id asc), from fp64 scores."""
    s = torch.where(torch.isnan(scores), float("-inf"), scores)
    return torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]


def check_topk(scores, ids, ref, k, tol):
    """ids hold a valid top-k of the fp64 scores: ranks agree up to near-ties."""
    ref_sorted = torch.sort(ref, dim=1, descending=True).values[:, :k]
    got = torch.gather(ref, 1, ids.cpu().long())
    scale = ref.abs().amax().clamp_min(1.0)
    # every returned doc is within tolerance of the true k-th best, in order
    assert torch.all((got - ref_sorted).abs() <= tol * scale), (got, ref_sorted)
    assert torch.allclose(scores.double().cpu(), got, rtol=0, atol=tol * float(scale))
    # no duplicates
    for row in ids.cpu():
        assert row.unique().numel() == row.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_search_matches_reference(ms, device, dtype):
    g = torch.Generator().manual_seed(11)
    docs, off = packed_corpus(300, 48, dtype, device, g)
    Q = rand(5, 17, 48, dtype=dtype, device=device, gen=g)
    ref = ref_scores(ms, Q, docs, off)
    for k in (1, 10, 33):
        scores, ids = ms.search(Q, (docs, off), k)
        assert scores.shape == (5, k) and ids.shape == (5, k) and ids.dtype == torch.int64
        check_topk(scores, ids, ref, k, TOL[dtype])
    if dtype == torch.float32:  # exact path: the exact ranking
        scores, ids = ms.search(Q, (docs, off), 20)
        assert torch.equal(ids.cpu(), ref_topk(ref, 20))


@pytest.mark.parametrize("device", DEVICES)
def test_search_blocks_and_ties(ms, device):
    """Duplicated documents tie exactly: lower id first, across block borders."""
    g = torch.Generator().manual_seed(3)
    base, off = packed_corpus(40, 32, torch.float32, "cpu", g, min_len=1)
    lens = (off[1:] - off[:-1]).tolist()
    parts = list(torch.split(base, lens))
    order = [i % 40 for i in range(120)]  # each doc three times
    docs = torch.cat([parts[i] for i in order]).to(device)
    off3 = torch.zeros(121, dtype=torch.int64)
    off3[1:] = torch.tensor([lens[i] for i in order]).cumsum(0)
    Q = rand(3, 9, 32, device=device, gen=g)
    full, fids = ms.search(Q, (docs, off3.to(device)), 30)
    for bd in (1, 7, 40, 1000):
        s, ids = ms.search(Q, ms.Corpus(docs, off3, device=device, storage="cpu" if device == "cpu" else "device"),
                           30, block_docs=bd)
        assert torch.equal(ids, fids) and torch.equal(s, full)
    ids = fids.cpu()
    for row, srow in zip(ids, full.cpu()):
        for j in range(0, 30, 3):  # each score appears as id x, x+40, x+80 in order
            assert torch.all(srow[j:j + 3] == srow[j])
            assert row[j + 1] == row[j] + 40 and row[j + 2] == row[j] + 80


@pytest.mark.parametrize("device", DEVICES)
def test_search_masks_lengths_padded_corpus(ms, device):
    g = torch.Generator().manual_seed(5)
    N, L, d = 64, 23, 40
    D = rand(N, L, d, device=device, gen=g)
    lengths = torch.randint(0, L + 1, (N,), generator=g)
    mask = torch.rand(N, L, generator=g) < 0.7
    Q = rand(4, 15, d, device=device, gen=g)
    qlen = torch.tensor([15, 1, 7, 0])
    qmask = torch.rand(4, 15, generator=g) < 0.8
    off = torch.arange(N + 1) * L
    flat = D.reshape(N * L, d)
    # lengths
    s, ids = ms.search(Q, ms.Corpus(D, lengths=lengths, device=device), 12, query_lengths=qlen.to(device))
    lmask = (torch.arange(L)[None] < lengths[:, None]).reshape(-1)
    ref = ref_scores(ms, Q, flat, off, q_len=qlen, d_mask=lmask)
    check_topk(s, ids, ref, 12, 1e-5)
    # masks
    s, ids = ms.search(Q, ms.Corpus(D, mask=mask.to(device), device=device), 12, query_mask=qmask.to(device))
    ref = ref_scores(ms, Q, flat, off, q_mask=qmask, d_mask=mask.reshape(-1))
    check_topk(s, ids, ref, 12, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_search_degenerate(ms, device):
    g = torch.Generator().manual_seed(8)
    docs, off = packed_corpus(5, 16, torch.float32, device, g, min_len=1)
    Q = rand(2, 4, 16, device=device, gen=g)
    s, ids = ms.search(Q, (docs, off), 8)  # k > number of documents: capped at 5
    assert s.shape == ids.shape == (2, 5)
    s, ids = ms.search(Q, (docs, off), 8, pad_to_k=True)  # padded tail on request
    assert torch.equal(ids[:, 5:].cpu(), torch.full((2, 3), -1))
    assert torch.all(torch.isneginf(s[:, 5:]))
    assert sorted(ids[0, :5].tolist()) == [0, 1, 2, 3, 4]
    s, ids = ms.search(Q, (docs, off), 0)
    assert s.shape == (2, 0) and ids.shape == (2, 0)
    s1, i1 = ms.search(Q[0], (docs, off), 3)  # one 2-D query
    assert s1.shape == (3,) and torch.equal(i1, ms.search(Q[:1], (docs, off), 3)[1][0])
    empty = ms.Corpus(docs[:0], torch.zeros(1, dtype=torch.int64), device=device)
    s, ids = ms.search(Q, empty, 2)
    assert s.shape == ids.shape == (2, 0)
    s, ids = ms.search(Q, empty, 2, pad_to_k=True)
    assert torch.equal(ids.cpu(), torch.full((2, 2), -1))
    with pytest.raises(ValueError, match="dim"):
        ms.search(rand(2, 4, 8, device=device), (docs, off), 2)
    with pytest.raises(ValueError, match="offsets"):
        ms.Corpus(docs, torch.tensor([0, 5, 3]), device=device)
    with pytest.raises(ValueError, match="k must"):
        ms.search(Q, (docs, off), -1)
    with pytest.raises(ValueError, match="storage"):
        ms.Corpus(docs, off, storage="disk")
    with pytest.raises(ValueError, match="scale_layout"):
        ms.Corpus(docs, off, device=device, quantization="int8", scale_layout="row")
    with pytest.raises(ValueError, match="scale_layout"):
        ms.Corpus(docs, off, device=device, scale_layout="document")  # nothing quantised


def test_keys_roundtrip(ms):
    s = torch.tensor([[1.5, -0.0, 0.0, float("nan"), float("-inf"), float("inf"), -2.25, 3e-39]])
    ids = torch.arange(8)[None]
    keys = ms.keys.encode_keys(s, ids)
    back, bid = ms.keys.decode_keys(keys)
    assert torch.equal(bid, ids)
    assert torch.equal(back[~torch.isnan(back)], (s + 0.0)[~torch.isnan(s)])
    assert torch.isnan(back[0, 3])
    top = ms.keys.decode_keys(ms.keys.merge_topk(keys, 10))
    assert top[1][0].tolist() == [5, 0, 7, 1, 2, 6, 4, 3, -1, -1]  # -0 == +0: lower id first; NaN last


@pytest.mark.parametrize("device", DEVICES)
def test_block_topk_op_matches_reference(ms, device):
    """ops.block_topk (on CUDA for k < 1024 a binned select per 12288-key
    chunk -- k <= 256 the shared-memory form, 256 or 512 threads by chunk
    length; above, the register form -- then rounds over the chunks'
    winners; one topk otherwise) equals encode + topk over every key: chunk
    edges, one to three rounds, ties across chunks, continuous scores, NaN /
    -inf / signed zeros, k = 0, k >= n, the k = 256 / 257 switch, explicit
    ids (negative = empty slot)."""
    g = torch.Generator().manual_seed(41)
    for R, n, k, id0, tied in ((1, 1, 5, 0, True), (2, 4095, 100, 7, True), (1, 4096, 4096, 0, True),
                               (3, 4097, 10, 3, True), (1, 10000, 100, 123456, True), (2, 9000, 0, 0, True),
                               (1, 20000, 1023, 0, True), (2, 20000, 1024, 5, True), (1, 12289, 400, 0, True),
                               (1, 12288, 1, 0, False), (2, 100000, 100, 0, False), (1, 300000, 1000, 9, False),
                               (1, 300000, 700, 0, True), (4, 24577, 13, 0, False), (1, 2048, 100, 0, True),
                               (2, 2049, 1000, 1, True), (1, 1000000, 100, 0, False), (3, 256, 100, 0, False),
                               (1, 257, 256, 0, True), (2, 12288, 256, 0, False), (1, 5000, 257, 0, False),
                               (2, 36865, 200, 2, True), (5, 33, 7, 0, False)):
        s = (torch.randn(R, n, generator=g) * 4).round() / 4 if tied else torch.randn(R, n, generator=g)
        if n > 10:
            s[:, 3] = float("nan")
            s[:, 5] = float("-inf")
            s[0, 6], s[0, 7] = -0.0, 0.0
            s[:, -1] = s.max() + 1  # the best key sits in the last chunk
        s = s.to(device)
        got = ms.ops.block_topk(s, id0, k)
        ids = torch.arange(id0, id0 + n, device=device)
        want = ms.keys.encode_keys(s, ids[None, :]).topk(min(k, n), dim=1).values
        assert torch.equal(got, want), (R, n, k)
        if n > 10 and k > 0:
            ids = torch.randperm(10 * n, generator=g)[:R * n].view(R, n)
            ids[:, ::7] = -1  # no candidate
            ids = ids.to(device)
            got = ms.ops.block_topk(s, 0, k, ids)
            want = ms.keys.encode_keys(s, ids).topk(min(k, n), dim=1).values
            assert torch.equal(got, want), (R, n, k, "ids")
    # a short row (sorted whole on CUDA), one whose keys are all equal
    # (repeated explicit id and score: the CUDA select's capped equal keys)
    # and equal scores under distinct ids (every key reaches the small
    # select's first bound: its all-keys fallback)
    for n, k, same, distinct in ((200, 100, False, True), (10000, 100, True, False), (10000, 100, True, True),
                                 (3000, 250, True, True)):
        s = torch.zeros(1, n) if same else torch.randn(1, n, generator=g)
        ids = torch.randperm(n, generator=g)[None] if distinct else torch.full((1, n), 5)
        s, ids = s.to(device), ids.to(device)
        got = ms.ops.block_topk(s, 0, k, ids)
        want = ms.keys.encode_keys(s, ids).topk(k, dim=1).values
        assert torch.equal(got, want), (n, k, same, distinct)


@pytest.mark.parametrize("dim,lq", [(50, 13), (200, 33), (128, 130)])
@pytest.mark.parametrize("layout", ["token", "document"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("device", DEVICES)
def test_quantized_corpus_exact_on_dequantized(ms, device, kind, layout, dim, lq):
    """The quantised kernels score exactly the dequantised tokens (one and
    two k chunks, query tiles of one and several M tiles; per-token and
    per-document scales, the latter applied to the row maxima on sm_90)."""
    if kind == "fp8" and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need sm_89+")
    g = torch.Generator().manual_seed(21)
    docs, off = packed_corpus(200, dim, torch.float32, device, g)
    Q = rand(3, lq, dim, device=device, gen=g)
    corpus = ms.Corpus(docs, off, device=device, quantization=kind, scale_layout=layout)
    assert corpus.tokens.shape[1] == (dim + 15) // 16 * 16
    assert corpus.scale_layout == layout and corpus.uniform_doc_scales == (layout == "document")
    s, ids = ms.search(Q, corpus, 25)
    qv, qs = ms.quantize_tokens(Q.reshape(-1, dim), kind)
    deq_q = ms.reference.dequantize(qv.cpu(), qs.cpu(), torch.float64)[:, :dim].reshape(3, lq, dim)
    deq_d = ms.reference.dequantize(corpus.tokens.cpu(), corpus.scales.cpu(), torch.float64)[:, :dim]
    ref = ref_scores(ms, deq_q, deq_d, off)
    check_topk(s, ids, ref, 25, quant_tol(kind, device))
    # and close to the unquantised scores
    exact = ref_scores(ms, Q.double(), docs.double(), off)
    got = torch.gather(exact, 1, ids.cpu().long())
    assert (got - s.double().cpu()).abs().max() < (0.02 if kind == "int8" else 0.15) * lq


@pytest.mark.parametrize("device", DEVICES)
def test_corpus_scale_layout(ms, device):
    """fp8 corpora share one scale per document (its largest finite
    magnitude / 448: a NaN or inf token does not set it) and say so; int8
    keeps per-token scales unless asked for per-document ones (largest
    magnitude / 127); prequantised corpora are checked as given."""
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 corpora need sm_89+")
    g = torch.Generator().manual_seed(5)
    docs, off = packed_corpus(40, 32, torch.float32, "cpu", g)
    offc = off.tolist()
    n_nan = next(n for n in range(40) if offc[n + 1] - offc[n] >= 3)
    docs[offc[n_nan] + 1, 3] = float("nan")
    docs[offc[n_nan] + 2, 5] = float("inf")
    c8 = ms.Corpus(docs.to(device), off.to(device), device=device, quantization="fp8")
    assert c8.uniform_doc_scales
    sc = c8.scales.cpu()
    for n in range(40):
        a, b = offc[n], offc[n + 1]
        if b > a:
            x = docs[a:b]
            amax = torch.where(torch.isfinite(x), x.abs(), torch.zeros(())).amax()
            assert torch.all(sc[a:b] == amax / torch.tensor(448.0)), n
    deq = ms.reference.dequantize(c8.tokens.cpu(), sc)[:, :32]
    fin = torch.isfinite(docs)
    err = (deq - docs).abs()[fin]
    assert torch.all(err <= docs.abs()[fin] * 2.0 ** -4 + (sc[:, None].expand_as(docs)[fin]) * 2.0 ** -10)
    assert torch.isnan(deq[offc[n_nan] + 1, 3])
    clean = docs.nan_to_num(0, 0, 0)
    ci = ms.Corpus(clean.to(device), off.to(device), device=device, quantization="int8")
    assert not ci.uniform_doc_scales and ci.scale_layout == "token"
    # int8 with one scale per document: its largest magnitude / 127, values
    # within half a step of the tokens
    cd = ms.Corpus(clean.to(device), off.to(device), device=device, quantization="int8", scale_layout="document")
    assert cd.uniform_doc_scales and cd.scale_layout == "document"
    sd = cd.scales.cpu()
    for n in range(40):
        a, b = offc[n], offc[n + 1]
        if b > a:
            assert torch.all(sd[a:b] == clean[a:b].abs().amax() / torch.tensor(127.0)), n
    err = (ms.reference.dequantize(cd.tokens.cpu(), sd)[:, :32] - clean).abs()
    assert torch.all(err <= sd[:, None] * (0.5 + 1e-5))
    assert not ms.Corpus(clean.to(device), off.to(device), device=device, quantization="fp8",
                         scale_layout="token").uniform_doc_scales
    pre_i = ms.Corpus(cd.tokens, off.to(device), scales=cd.scales, device=device)
    assert pre_i.uniform_doc_scales and pre_i.scale_layout == "document"
    pre = ms.Corpus(c8.tokens, off.to(device), scales=c8.scales, device=device)
    assert pre.uniform_doc_scales
    bad = c8.scales.clone()
    bad[offc[n_nan] + 1] *= 2
    assert not ms.Corpus(c8.tokens, off.to(device), scales=bad, device=device).uniform_doc_scales
    assert not ms.Corpus(c8.tokens, off.to(device), scales=-c8.scales, device=device).uniform_doc_scales


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_tokens(ms, device):
    g = torch.Generator().manual_seed(2)
    x = rand(100, 33, device=device, gen=g) * 3
    x[5] = 0
    v, s = ms.quantize_tokens(x, "int8")
    assert v.dtype == torch.int8 and v.shape == (100, 48) and torch.all(v[:, 33:] == 0)
    deq = ms.reference.dequantize(v, s)[:, :33]
    assert torch.all((deq - x).abs() <= s[:, None] * 0.5 + 1e-6)
    assert torch.all(v[5] == 0) and s[5] == 1
    assert v.abs().amax(1)[torch.arange(100) != 5].eq(127).all()
    with pytest.raises(ValueError):
        ms.quantize_tokens(x, "int4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize("device", DEVICES)
def test_quantize_op_matches_reference(ms, device, kind, dtype):
    """ops.quantize (one kernel) is bitwise the torch reference: odd dims,
    zero rows, a NaN row, values on rounding ties, non-contiguous input."""
    g = torch.Generator().manual_seed(31 + kind)
    for T, dim in ((1, 1), (37, 15), (64, 17), (5, 33), (300, 130), (3, 1000), (0, 8)):
        x = (torch.randn(T, dim, generator=g) * torch.rand(T, 1, generator=g) * 5).to(dtype)
        if T > 4:
            x[1] = 0
            x[2, :] = torch.arange(dim) - dim / 2  # exact halves after scaling hit round-half-even
            x[3, 0] = float("nan")
        if T > 4 and dim > 1:
            x = x.to(device)[:, : dim - 1] if dim % 2 else x.to(device)
        else:
            x = x.to(device)
        v, s = ms.ops.quantize(x, kind)
        rv, rs = ms.reference.quantize(x, kind)
        assert v.dtype == rv.dtype and v.shape == rv.shape == (x.shape[0], (x.shape[1] + 15) // 16 * 16)
        assert torch.equal(s, rs)
        assert torch.equal(v.view(torch.uint8), rv.view(torch.uint8))
        if T > 4:
            assert s[1] == 1 and s[3] == 1 and torch.all(v[1].view(torch.uint8) == 0)
        # Given scales (one per row; shared, smaller and larger than the rows' own,
        # so values saturate): bitwise the reference too, and the scales come back.
        given = (torch.rand(x.shape[0], generator=g) * 0.05 + 0.001).to(device)
        if T > 4:
            given[4] = 1e-6  # every value of row 4 saturates
        v, s = ms.ops.quantize(x, kind, given)
        rv, rs = ms.reference.quantize(x, kind, scales=given)
        assert torch.equal(s, given) and torch.equal(rs, given)
        assert T == 0 or s.data_ptr() != given.data_ptr()
        assert torch.equal(v.view(torch.uint8), rv.view(torch.uint8))
        if T > 4 and x.shape[1] > 1:
            row = v[4, : x.shape[1]].float()
            top = 127 if kind == 0 else 448
            nz = x[4].float() != 0
            assert torch.all(row[nz].abs() == top)


def test_quantize_given_scales_checked(ms):
    x = torch.randn(6, 16)
    for bad in (torch.ones(5), torch.ones(6, 1), torch.ones(6, dtype=torch.int32)):
        with pytest.raises((RuntimeError, ValueError)):
            ms.ops.quantize(x, 1, bad)
    with pytest.raises(ValueError):
        ms.quantize_tokens(x, "fp8", torch.ones(5))
    v, s = ms.quantize_tokens(x, "fp8", torch.full((6,), 0.5, dtype=torch.float64))
    assert s.dtype == torch.float32 and torch.equal(v.float()[:, :16], (x / 0.5).to(torch.float8_e4m3fn).float())


def test_quant_op_matches_reference_op(ms):
    """forward_quant on CPU vs its reference, all layouts of the op."""
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (30, 32), generator=g, dtype=torch.int8)
    d = torch.randint(-127, 128, (90, 32), generator=g, dtype=torch.int8)
    qs, ds = torch.rand(30, generator=g) + 0.1, torch.rand(90, generator=g) + 0.1
    q_start, q_len = torch.tensor([0, 10, 20], dtype=torch.int32), torch.tensor([10, 10, 7], dtype=torch.int32)
    d_start = torch.tensor([0, 30, 60], dtype=torch.int32)
    d_len = torch.tensor([30, 0, 29], dtype=torch.int32)
    for layout, pq, pd in ((0, None, None), (1, None, None),
                           (2, torch.tensor([2, 0, 1], dtype=torch.int32), torch.tensor([0, 2, 2], dtype=torch.int32))):
        got = ms.ops.forward_quant(q, qs, q_start, q_len, None, d, ds, d_start, d_len, None, pq, pd, layout, 10, 1)
        ref = ms.reference.forward_quant(q, qs, q_start, q_len, None, d, ds, d_start, d_len, None, pq, pd,
                                         layout, 10, 1, accum=torch.float64)
        torch.testing.assert_close(got[0].double(), ref[0], rtol=1e-5, atol=1e-4)
        assert torch.equal(got[1], ref[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tensor-core 8-bit paths need CUDA")
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dim,lq,nq", [(128, 130, 1), (64, 32, 8), (256, 200, 1), (48, 300, 2), (128, 32, 1),
                                       (64, 17, 1), (256, 9, 1), (128, 520, 1), (64, 17, 40)])
def test_quant_op_tensor_cores_match_reference(ms, kind, dim, lq, nq):
    """forward_quant on CUDA (mma.sync, wgmma on sm_90 once a tile holds >= 128
    query rows -- fp8 there for scores of rows <= 128 bytes, argmax on the
    exact mma.sync products -- and the register-streaming kernel for one
    query of <= 32 rows without argmax) vs the reference on the dequantised
    tokens: scores, argmax, masks, empty and invalid documents, CROSS /
    GROUPED / LIST; and scores with one scale per document promised
    (uniform_doc_scales: fp8 on sm_90 applies it to the row maxima)."""
    if kind == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need sm_89+")
    g = torch.Generator().manual_seed(23)
    lens = torch.randint(0, 400, (6,), generator=g)
    lens[2] = 0
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
    td = int(lens.sum())
    x_q = torch.randn(nq * lq, dim, generator=g)
    x_d = torch.randn(td, dim, generator=g)
    q, qs = ms.quantize_tokens(x_q.cuda(), kind)
    d, ds = ms.quantize_tokens(x_d.cuda(), kind)
    i32 = lambda t: t.to(torch.int32).cuda()  # noqa: E731
    q_start, q_len = i32(torch.arange(nq) * lq), i32(torch.full((nq,), lq))
    d_len = lens.clone()
    d_len[4] = -1  # an invalid document scores NaN
    d_start = i32(starts)
    dm = (torch.rand(td, generator=g) > 0.1).cuda()
    # one scale per document (as fp8 corpora store them), promised to the op
    ds_doc = torch.repeat_interleave(torch.rand(6, generator=g) * 0.02 + 0.001, lens).cuda()
    layouts = [(0, None, None), (2, i32(torch.tensor([0, 5, 3, 1]) % nq), i32(torch.tensor([1, 0, 5, 3])))]
    if nq == 1:
        layouts.append((1, None, None))  # the query's 6 candidates
    for layout, pq, pd in layouts:
        args = (q, qs, q_start, q_len, None, d, ds_doc, d_start, i32(d_len), dm, pq, pd, layout, lq, 0)
        got = ms.ops.forward_quant(*args, True)[0]
        ref = ms.reference.forward_quant(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args],
                                         accum=torch.float64)
        torch.testing.assert_close(got.double().cpu(), ref[0], rtol=quant_tol(kind, "cuda"), atol=1e-4,
                                   equal_nan=True)
        args = (q, qs, q_start, q_len, None, d, ds, d_start, i32(d_len), dm, pq, pd, layout, lq, 1)
        got = ms.ops.forward_quant(*args)
        ref = ms.reference.forward_quant(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args],
                                         accum=torch.float64)
        torch.testing.assert_close(got[0].double().cpu(), ref[0], rtol=1e-5, atol=1e-4, equal_nan=True)
        ok = ~torch.isnan(ref[0])
        assert torch.equal(got[1].cpu()[ok], ref[1][ok])
        plain = ms.ops.forward_quant(*args[:-1], 0)[0]  # scores only: the streaming kernel where it applies
        torch.testing.assert_close(plain.double().cpu(), ref[0], rtol=quant_tol(kind, "cuda"), atol=1e-4,
                                   equal_nan=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned streaming needs CUDA")
@pytest.mark.parametrize("kind", [None, "int8", "fp8"])
def test_pinned_streaming_matches_device(ms, kind):
    if kind == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 corpora need sm_89+")
    g = torch.Generator().manual_seed(9)
    docs, off = packed_corpus(3000, 64, torch.bfloat16, "cpu", g)
    Q = rand(4, 32, 64, dtype=torch.bfloat16, device="cuda", gen=g)
    dev = ms.Corpus(docs, off, device="cuda", quantization=kind)
    pin = ms.Corpus(docs, off, storage="pinned", quantization=kind, chunk_mib=1)
    assert len(pin._chunks) >= 4
    for _ in range(2):  # buffers reused across calls
        a = ms.search(Q, dev, 50)
        b = ms.search(Q, pin, 50)
        assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    cpu = ms.Corpus(docs, off, storage="cpu", quantization=kind)
    if kind is not None:  # quantised alike wherever the work ran
        assert torch.equal(cpu.tokens.view(torch.uint8), dev.tokens.cpu().view(torch.uint8))
        assert torch.equal(cpu.scales, dev.scales.cpu()) and torch.equal(pin.scales, cpu.scales)
        assert dev.uniform_doc_scales == pin.uniform_doc_scales == cpu.uniform_doc_scales == (kind == "fp8")
    c = ms.search(Q.cpu(), cpu, 50)
    ref = ref_scores(ms, Q.float().cpu(), docs.float(), off) if kind is None else None
    if ref is not None:
        check_topk(c[0], c[1], ref, 50, 1e-2)
        check_topk(b[0], b[1], ref, 50, 1e-2)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("device", DEVICES)
def test_rescored_quantized_search_is_exact(ms, device, kind):
    """A quantised corpus with kept originals re-scores its candidates from
    them: with every document a candidate the result is the exact search's,
    scores included; with the default oversampling the scores returned are
    exact for the ids returned."""
    if kind == "fp8" and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89+")
    g = torch.Generator().manual_seed(31)
    N, L, d = 70, 19, 48
    D = rand(N, L, d, device=device, gen=g)
    lengths = torch.randint(0, L + 1, (N,), generator=g)
    lengths[3] = 0
    mask = torch.rand(N, L, generator=g) < 0.8
    Q = rand(5, 11, d, device=device, gen=g)
    qmask = torch.rand(5, 11, generator=g) < 0.8
    flat = D.reshape(N * L, d)
    off = torch.arange(N + 1) * L
    lmask = (torch.arange(L)[None] < lengths[:, None]) & mask
    exact = ms.Corpus(D, mask=lmask.to(device), device=device)
    wheres = ("cpu", "device") + (("pinned",) if device == "cuda" else ())
    for where in wheres:
        c = ms.Corpus(D, mask=lmask.to(device), device=device, quantization=kind, rescore=where)
        # every document a candidate: identical to the exact search
        s, ids = ms.search(Q, c, 9, query_mask=qmask.to(device), oversample=N)
        s0, ids0 = ms.search(Q, exact, 9, query_mask=qmask.to(device))
        assert torch.equal(ids.cpu(), ids0.cpu())
        assert torch.allclose(s.cpu(), s0.cpu(), rtol=1e-6, atol=1e-6)
        # default oversampling: the returned scores are the exact fp64 ones
        s, ids = ms.search(Q, c, 9, query_mask=qmask.to(device))
        ref = ref_scores(ms, Q, flat, off, q_mask=qmask, d_mask=lmask.reshape(-1))
        got = torch.gather(ref, 1, ids.cpu().long())
        assert torch.allclose(s.double().cpu(), got, atol=1e-5)
        # k beyond the corpus: padded with (-inf, -1) on request, as the plain search
        assert ms.search(Q[:1], c, N + 5)[1].shape == (1, N)
        s, ids = ms.search(Q[:1], c, N + 5, pad_to_k=True)
        assert ids.shape == (1, N + 5) and (ids[0, N:] == -1).all() and (ids[0, :N] >= 0).all()


def test_rescore_argument_errors(ms):
    D = torch.randn(10, 4, 16)
    with pytest.raises(ValueError, match="rescore"):
        ms.Corpus(D, rescore="disk", storage="cpu")
    with pytest.raises(ValueError, match="rescore"):
        ms.Corpus(D, rescore="cpu", storage="cpu")  # nothing quantised to re-score
    c = ms.Corpus(D, storage="cpu", quantization="int8", rescore="cpu")
    with pytest.raises(ValueError, match="oversample"):
        ms.search(torch.randn(3, 16), c, 2, oversample=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind", [None, "int8", "int8+rescore"])
def test_search_cuda_graph_capture(ms, kind):
    """search() on a resident corpus does no host synchronisation: it captures
    in a CUDA graph (one block of chunk selects and, with rescore, the
    in-place re-score) and replays to the eager result on new queries."""
    g = torch.Generator().manual_seed(53)
    docs, off = packed_corpus(30000, 64, torch.bfloat16, "cuda", g, max_len=12, min_len=1)
    quant = None if kind is None else "int8"
    c = ms.Corpus(docs, off, device="cuda", quantization=quant, rescore="device" if kind == "int8+rescore" else None)
    # "cuda" resolves to the current device, so device-resident originals are
    # recognised as such (scored in place, not gathered)
    assert c.device == docs.device and (c.originals is None or c.originals[0].device == c.device)
    Q = rand(2, 9, 64, device="cuda", gen=g).bfloat16()
    graph, out = capture_cuda_graph(lambda: ms.search(Q, c, 37))
    Q.copy_(rand(2, 9, 64, device="cuda", gen=g).bfloat16())
    graph.replay()
    want = ms.search(Q, c, 37)
    assert torch.equal(out[1], want[1]) and torch.equal(out[0], want[0])


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("lq", [1, 17, 32])
@pytest.mark.parametrize("layout", ["token", "document"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("device", DEVICES)
def test_8bit_one_query_scan_exact(ms, device, kind, layout, dim, lq):
    """One short query over an int8 / fp8 corpus (rows of 64 / 128 / 256
    bytes, scales per token or per document; the register-streaming kernel
    on CUDA): exact against the dequantised fp64 reference, with empty
    documents, token-mask holes and a query mask."""
    if kind == "fp8" and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need sm_89+")
    g = torch.Generator().manual_seed(dim + lq)
    N, L = 260, 41
    D = rand(N, L, dim, device=device, gen=g)
    mask = torch.rand(N, L, generator=g) < 0.85
    mask[4] = False
    corpus = ms.Corpus(D, mask=mask.to(device), device=device, quantization=kind, scale_layout=layout)
    assert corpus.uniform_doc_scales == (layout == "document")
    Q = rand(1, lq, dim, device=device, gen=g)
    qmask = torch.rand(1, lq, generator=g) < 0.8
    qmask[0, 0] = True
    s, ids = ms.search(Q, corpus, 40, query_mask=qmask.to(device))
    qv, qs = ms.quantize_tokens(Q.reshape(-1, dim), kind)
    deq_q = ms.reference.dequantize(qv.cpu(), qs.cpu(), torch.float64)[:, :dim].reshape(1, lq, dim)
    deq_d = ms.reference.dequantize(corpus.tokens.cpu(), corpus.scales.cpu(), torch.float64)[:, :dim]
    off = torch.arange(N + 1) * L
    ref = ref_scores(ms, deq_q, deq_d, off, q_mask=qmask, d_mask=mask.reshape(-1))
    check_topk(s, ids, ref, 40, 1e-5)


def _rescore_case(ms, device, dtype, dim, lq, nq, kc, gen):
    """Packed documents (empty ones, a NaN token, two identical documents),
    queries with a mask, and candidate keys per query: distinct ids, an empty
    slot, an id past the documents and the two twins."""
    nd = 600
    lens = torch.randint(0, 41, (nd,), generator=gen)
    lens[5] = 0
    lens[8] = lens[9] = 17
    off = torch.zeros(nd + 1, dtype=torch.int64)
    off[1:] = lens.cumsum(0)
    docs = rand(int(off[-1]), dim, gen=gen)
    docs[off[9]:off[10]] = docs[off[8]:off[9]]  # documents 8 and 9 tie
    docs[off[11] + 1, 3] = float("nan")
    docs = docs.to(dtype)
    dmask = torch.rand(int(off[-1]), generator=gen) < 0.9
    dmask[off[9]:off[10]] = dmask[off[8]:off[9]]
    q = rand(nq * lq, dim, gen=gen).to(dtype)
    qmask = torch.rand(nq * lq, generator=gen) < 0.85
    qmask[::lq] = True
    ids = torch.stack([torch.randperm(nd - 12, generator=gen)[:kc] + 12 for _ in range(nq)])
    if kc >= 6:
        ids[0, :5] = torch.tensor([8, 9, 5, 11, nd + 3])  # twins, empty document, NaN, past the end
        ids[-1, 1] = -1  # an empty slot
    keys = ms.keys.encode_keys(torch.randn(nq, kc, generator=gen), ids)
    q_start = (torch.arange(nq, dtype=torch.int32) * lq)
    q_len = torch.full((nq,), lq, dtype=torch.int32)
    d_start, d_len = off[:-1].to(torch.int32), lens.to(torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return (to(q), to(q_start), to(q_len), to(qmask), to(docs), to(d_start), to(d_len), to(dmask), to(keys)), off


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim,lq", [(64, 32), (128, 17), (32, 1), (96, 9), (128, 40), (48, 32)])
@pytest.mark.parametrize("nq,kc,k", [(1, 100, 10), (3, 7, 12), (5, 97, 97), (9, 99, 30), (32, 120, 50), (2, 513, 5)])
@pytest.mark.parametrize("device", DEVICES)
def test_rescore_topk_op(ms, device, dtype, dim, lq, nq, kc, k):
    """rescore_topk (on CUDA one kernel for 16-bit rows of 64-256 bytes, lq <=
    32, <= 128 candidates, over grids of one to several waves; the
    composition elsewhere) equals the composition
    of decode_keys, the LIST forward, block_topk and decode_keys (bitwise
    but on sm_90a, whose LIST forward may take the staged wgmma kernel), and
    its scores are the fp64 reference's for the ids it returns: twins in id
    order, the NaN candidate after every number, the empty slot last,
    (-inf, -1) past the candidates."""
    g = torch.Generator().manual_seed(dim * 1000 + lq * 10 + kc)
    args, off = _rescore_case(ms, device, dtype, dim, lq, nq, kc, g)
    q, q_start, q_len, qmask, docs, d_start, d_len, dmask, keys = args
    s, ids = ms.ops.rescore_topk(*args, lq, k)
    assert s.shape == ids.shape == (nq, k) and s.dtype == torch.float32 and ids.dtype == torch.int64
    # the composition of the existing ops
    _, cand = ms.ops.decode_keys(keys)
    pd = torch.where(cand < d_start.numel(), cand, -1).reshape(-1).to(torch.int32)
    pq = torch.arange(nq, dtype=torch.int32, device=device).repeat_interleave(kc)
    sc, _ = ms.ops.forward(q, q_start, q_len, qmask, docs, d_start, d_len, dmask, pq, pd, 2, lq, 0, 0)
    top = ms.keys.merge_topk(ms.ops.block_topk(sc.view(nq, kc), 0, k, cand), k)
    s0, ids0 = ms.ops.decode_keys(top)
    assert torch.equal(ids.cpu(), ids0.cpu())
    if device == "cuda" and torch.cuda.get_device_capability() == (9, 0):
        # sm_90a scores pair lists on the staged wgmma kernel where it takes
        # them: its k order, not the fused re-score's (last bits)
        fin = ~torch.isnan(s0)
        assert torch.equal(torch.isnan(s), ~fin)
        assert torch.allclose(s[fin], s0[fin], rtol=4e-6, atol=4e-6 * float(s0[fin].abs().max().clamp_min(1)))
    else:
        assert torch.equal(s.cpu().view(torch.int32), s0.cpu().view(torch.int32))
    # against fp64: every returned id's score, in the keys' order
    ref, _ = ms.reference.forward(q.cpu(), q_start.cpu(), q_len.cpu(), qmask.cpu(), docs.cpu(), d_start.cpu(),
                                  d_len.cpu(), dmask.cpu(), pq.cpu(), pd.cpu(), 2, lq, 0, False,
                                  accum=torch.float64)
    ref = ref.view(nq, kc)
    ids_c, s_c, cand_c = ids.cpu(), s.cpu().double(), cand.cpu()
    tol = TOL[dtype] * float(torch.nan_to_num(ref, nan=0.0).abs().max().clamp_min(1.0))
    for n in range(nq):
        real = int(((cand_c[n] >= 0)).sum())
        assert (ids_c[n, real:] == -1).all() and torch.isneginf(s_c[n, real:]).all()
        for r in range(min(k, real)):
            c = int((cand_c[n] == ids_c[n, r]).nonzero()[0])
            want = ref[n, c]
            assert (torch.isnan(s_c[n, r]) and torch.isnan(want)) or abs(float(s_c[n, r] - want)) <= tol
        row = s_c[n, :min(k, real)]
        fin = row[~torch.isnan(row)]
        assert (fin[:-1] >= fin[1:]).all()  # best first
        nan_at = torch.isnan(row).nonzero()
        assert nan_at.numel() == 0 or int(nan_at[0]) == fin.numel()  # NaN after every number
    if kc >= 6 and (ids_c[0] == 8).any() and (ids_c[0] == 9).any():
        r8, r9 = int((ids_c[0] == 8).nonzero()[0]), int((ids_c[0] == 9).nonzero()[0])
        assert s_c[0, r8] == s_c[0, r9] and r9 == r8 + 1  # twins: equal scores, lower id first


def test_rescore_topk_op_errors(ms):
    args = [torch.zeros(4, 8), torch.zeros(1, dtype=torch.int32), torch.full((1,), 4, dtype=torch.int32), None,
            torch.zeros(6, 8), torch.zeros(2, dtype=torch.int32), torch.full((2,), 3, dtype=torch.int32), None]
    with pytest.raises(RuntimeError, match="keys"):
        ms.ops.rescore_topk(*args, torch.zeros(1, 3, dtype=torch.int32), 4, 2)
    with pytest.raises(RuntimeError, match="one row per query"):
        ms.ops.rescore_topk(*args, torch.zeros(2, 3, dtype=torch.int64), 4, 2)
    with pytest.raises(RuntimeError, match="k must be"):
        ms.ops.rescore_topk(*args, torch.zeros(1, 3, dtype=torch.int64), 4, -1)
