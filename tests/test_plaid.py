"""PLAID / ColBERTv2 compressed documents: the codec, the compiled ops against
fp64 references (odd shapes, nbits 2 / 4 / 8, d not a multiple of the
packing, empty documents, out-of-range codes), gradients, the fake kernels,
and search on a plaid corpus."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, relerr

NBITS = [2, 4, 8]


def _codec(ms, T, d, C, nbits, device, seed=0):
    """Random compressed tokens: codes (a few out of range), residual bytes,
    centroids and sorted bucket weights."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, C, (T,), generator=g, dtype=torch.int32)
    if T > 2:
        codes[1] = C + 3  # out of range: reads centroid 0
        codes[2] = -1
    P = ms.plaid.packed_bytes(d, nbits)
    res = torch.randint(0, 256, (T, P), generator=g, dtype=torch.int32).to(torch.uint8)
    cent = torch.randn(C, d, generator=g)
    cent = cent / cent.norm(dim=-1, keepdim=True)
    bw = torch.sort(torch.randn(1 << nbits, generator=g) * 0.1).values
    return codes.to(device), res.to(device), cent.to(device), bw.to(device)


@pytest.mark.parametrize("nbits", NBITS)
@pytest.mark.parametrize("d", [1, 3, 15, 17, 128])
def test_pack_roundtrip_and_bit_order(ms, nbits, d):
    g = torch.Generator().manual_seed(d * nbits)
    b = torch.randint(0, 1 << nbits, (5, d), generator=g)
    packed = ms.plaid.pack(b, nbits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, (d * nbits + 7) // 8)
    assert torch.equal(ms.plaid.unpack(packed, nbits, d), b)
    # the layout late-interaction-kernels reads: feature f in bits
    # (f % per) * nbits of byte f // per, lowest bits first
    per = 8 // nbits
    for f in range(d):
        got = (packed[:, f // per].long() >> ((f % per) * nbits)) & ((1 << nbits) - 1)
        assert torch.equal(got, b[:, f])
    if nbits == 2 and d >= 4:
        one = ms.plaid.pack(torch.tensor([[1, 2, 3, 0] + [0] * (d - 4)]), 2)
        assert one[0, 0].item() == 0b00111001


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nbits", NBITS)
def test_compress_decompress(ms, device, nbits):
    g = torch.Generator().manual_seed(nbits)
    x = torch.randn(600, 33, generator=g).to(device)
    cent = ms.plaid.kmeans(x, 16, iters=4)
    assert cent.shape == (16, 33) and torch.allclose(cent.norm(dim=-1), torch.ones(16, device=device), atol=1e-5)
    r = x - cent[ms.plaid.nearest_centroid(x, cent).long()]
    cut, w = ms.plaid.bucket_params(r, nbits)
    assert cut.shape == ((1 << nbits) - 1,) and w.shape == (1 << nbits,)
    assert bool((cut[1:] >= cut[:-1]).all()) and bool((w[1:] >= w[:-1]).all())
    codes, res = ms.plaid.compress(x, cent, cut, nbits)
    assert codes.dtype == torch.int32 and torch.equal(codes, (x @ cent.T).argmax(1).to(torch.int32))
    y = ms.plaid.decompress(codes, res, cent, w, nbits)
    err = ((y - x).norm() / x.norm()).item()
    bound = {2: 0.6, 4: 0.2, 8: 0.05}[nbits]
    assert err < bound, err
    # more bits, smaller error
    if nbits < 8:
        cut8, w8 = ms.plaid.bucket_params(r, 8)
        y8 = ms.plaid.decompress(*ms.plaid.compress(x, cent, cut8, 8), cent, w8, 8)
        assert (y8 - x).norm() < (y - x).norm()


def _padded(codes, res, lengths, L):
    """Flat codec tensors laid out padded [Nd, L(, P)] (junk past each length)."""
    Nd = lengths.numel()
    g = torch.Generator().manual_seed(7)
    pc = torch.randint(0, 5, (Nd, L), generator=g, dtype=torch.int32).to(codes.device)
    pr = torch.randint(0, 256, (Nd, L, res.shape[1]), generator=g, dtype=torch.int32).to(torch.uint8).to(res.device)
    off = 0
    for n, ln in enumerate(lengths.tolist()):
        pc[n, :ln] = codes[off:off + ln]
        pr[n, :ln] = res[off:off + ln]
        off += ln
    return pc, pr


SHAPES = [  # Nq, Lq, lengths, d
    (1, 1, [1], 1),
    (2, 17, [0, 5, 17, 1], 15),
    (3, 33, [40, 0, 33, 7, 1], 17),
    (1, 32, [300, 12, 0, 65], 128),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nbits", NBITS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"nq{s[0]}-lq{s[1]}-nd{len(s[2])}-d{s[3]}")
@pytest.mark.parametrize("normalize", [True, False])
def test_maxsim_residual_matches_reference(ms, device, nbits, shape, normalize):
    Nq, Lq, lens, d = shape
    lengths = torch.tensor(lens)
    codes, res, cent, bw = _codec(ms, int(lengths.sum()), d, 11, nbits, device, seed=Lq + d)
    L = max(max(lens), 1)
    pc, pr = _padded(codes, res, lengths, L)
    Q = torch.randn(Nq, Lq, d, generator=torch.Generator().manual_seed(1)).to(device)
    ref = ms.plaid.maxsim_residual_reference(Q, pc, pr, lengths.to(device), cent, bw, nbits, normalize=normalize)
    out = ms.plaid.maxsim_residual(Q, pc, pr, lengths.to(device), cent, bw, nbits, normalize=normalize)
    assert out.dtype == torch.float32 and out.shape == (Nq, len(lens))
    assert relerr(out, ref, floor=1.0) < 2e-5
    assert torch.all(out[:, lengths == 0] == 0)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    var = ms.plaid.maxsim_residual_varlen(Q, codes, res, cu.to(device), cent, bw, nbits, normalize=normalize)
    assert relerr(var, ref, floor=1.0) < 2e-5
    one = ms.plaid.maxsim_residual_varlen(Q[0], codes, res, cu.to(device), cent, bw, nbits, normalize=normalize)
    assert one.shape == (len(lens),) and relerr(one, ref[0], floor=1.0) < 2e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nbits", NBITS)
def test_kernel_tokens_bitwise_equal_reference_decompression(ms, device, nbits):
    """plaid_backward with a one-hot gradient returns the winners' tokens
    (1 * token + 0 * others is exact): they must be the reference's bits."""
    d, lens = 37, [0, 9, 130]
    codes, res, cent, bw = _codec(ms, sum(lens), d, 7, nbits, device, seed=nbits)
    st = torch.tensor([0, 0, 9], dtype=torch.int32, device=device)
    ln = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = ms.plaid.decompress(codes, res, cent, bw, nbits)
    for n in (1, 2):
        Lq = lens[n]
        q = torch.zeros(1, Lq, d, device=device)
        am = torch.full((1, 3, Lq), -1, dtype=torch.int32, device=device)
        am[0, n] = torch.arange(Lq, dtype=torch.int32, device=device)
        grad = torch.zeros(1, 3, device=device)
        grad[0, n] = 1.0
        dq = ms.ops.plaid_backward(grad, q, codes, res, cent, bw, st, ln, am, nbits, False)
        assert torch.equal(dq[0], ref[int(st[n]):int(st[n]) + Lq])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nbits", [2, 8])
@pytest.mark.parametrize("normalize", [True, False])
def test_maxsim_residual_gradient(ms, device, nbits, normalize):
    lens = [5, 0, 17, 33]
    d, Nq, Lq = 19, 2, 15
    lengths = torch.tensor(lens)
    codes, res, cent, bw = _codec(ms, sum(lens), d, 9, nbits, device, seed=3)
    pc, pr = _padded(codes, res, lengths, max(lens))
    Q = torch.randn(Nq, Lq, d, generator=torch.Generator().manual_seed(5)).to(device)
    Qa = Q.clone().requires_grad_(True)
    Qr = Q.double().clone().requires_grad_(True)
    gout = torch.randn(Nq, len(lens), generator=torch.Generator().manual_seed(6)).to(device)
    out = ms.plaid.maxsim_residual(Qa, pc, pr, lengths.to(device), cent, bw, nbits, normalize=normalize)
    (out * gout).sum().backward()
    ref = ms.plaid.maxsim_residual_reference(Qr, pc, pr, lengths.to(device), cent, bw, nbits, normalize=normalize)
    (ref * gout.double()).sum().backward()
    assert relerr(Qa.grad, Qr.grad) < 1e-5
    # the flat layout, same gradient
    Qv = Q.clone().requires_grad_(True)
    cu = torch.tensor([0] + torch.cumsum(lengths, 0).tolist(), dtype=torch.int32, device=device)
    (ms.plaid.maxsim_residual_varlen(Qv, codes, res, cu, cent, bw, nbits, normalize=normalize) * gout).sum().backward()
    assert relerr(Qv.grad, Qr.grad) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lq", [1, 17, 32, 33])
def test_approx_scores_match_reference(ms, device, lq):
    lens = [0, 1, 15, 40, 301]
    C = 23
    lengths = torch.tensor(lens)
    codes, res, cent, bw = _codec(ms, sum(lens), 8, C, 2, device, seed=lq)
    pc, _ = _padded(codes, res, lengths, max(lens))
    qcs = torch.randn(2, C, lq, generator=torch.Generator().manual_seed(lq)).to(device)
    ref = ms.plaid.approx_scores_reference(qcs, pc, lengths.to(device))
    out = ms.plaid.approx_scores(qcs, pc, lengths.to(device))
    assert out.shape == (2, len(lens)) and relerr(out, ref, floor=1.0) < 1e-6
    assert torch.all(out[:, 0] == 0)
    cu = torch.tensor([0] + torch.cumsum(lengths, 0).tolist(), dtype=torch.int32, device=device)
    assert relerr(ms.plaid.approx_scores(qcs[1], codes, cu_seqlens=cu), ref[1], floor=1.0) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lq", [1, 32, 33])
def test_approx_scores_centroid_pruning(ms, device, lq):
    """keep: only tokens of kept centroids count, per query; a query token
    no kept token reaches adds 0; all kept = no pruning."""
    lens = [0, 1, 15, 40, 301, 7]
    C = 23
    lengths = torch.tensor(lens)
    codes, res, cent, bw = _codec(ms, sum(lens), 8, C, 2, device, seed=lq + 5)
    pc, _ = _padded(codes, res, lengths, max(lens))
    g = torch.Generator().manual_seed(lq)
    qcs = torch.randn(3, C, lq, generator=g).to(device)
    keep = torch.rand(3, C, generator=g) < 0.3
    keep[2] = False  # nothing kept: every document scores 0
    keep = keep.to(device)
    ref = ms.plaid.approx_scores_reference(qcs, pc, lengths.to(device), keep)
    out = ms.plaid.approx_scores(qcs, pc, lengths.to(device), keep=keep)
    assert relerr(out, ref, floor=1.0) < 1e-6
    assert torch.all(out[2] == 0) and torch.all(out[:, 0] == 0)
    # brute force for one document: the kept tokens' best score per query token
    c = pc[4, :301].long().clamp(0, C - 1)
    c = torch.where((codes[sum(lens[:4]):sum(lens[:5])].long() >= 0)
                    & (codes[sum(lens[:4]):sum(lens[:5])].long() < C), c, 0)
    live = keep[0][c]
    want = qcs[0][c[live]].amax(0).sum() if bool(live.any()) else torch.zeros(())
    assert abs(out[0, 4].item() - want.item()) < 1e-4
    assert bool((out[:2] != ms.plaid.approx_scores(qcs[:2], pc, lengths.to(device))).any())  # pruning changes scores
    cu = torch.tensor([0] + torch.cumsum(lengths, 0).tolist(), dtype=torch.int32, device=device)
    # all kept = no pruning (the two scans sum the query tokens in different orders)
    assert relerr(ms.plaid.approx_scores(qcs, codes, cu_seqlens=cu, keep=torch.ones(C, dtype=torch.bool,
                                                                                     device=device)),
                  ms.plaid.approx_scores(qcs, codes, cu_seqlens=cu), floor=1.0) < 1e-6
    assert relerr(ms.plaid.approx_scores(qcs[1], codes, cu_seqlens=cu, keep=keep[1]), ref[1], floor=1.0) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lq", [1, 17, 32, 36, 64])
def test_approx_scores_16bit_tables(ms, device, dtype, lq):
    """A 16-bit table scores as its exact fp32 widening (maxima exact, fp32
    sums), with and without centroid pruning, on both layouts; Lq not a
    multiple of 8 and a table at an odd offset take the unvectorised loads."""
    lens = [0, 1, 15, 40, 301, 7]
    C = 23
    lengths = torch.tensor(lens)
    codes, res, cent, bw = _codec(ms, sum(lens), 8, C, 2, device, seed=lq + 11)
    pc, _ = _padded(codes, res, lengths, max(lens))
    g = torch.Generator().manual_seed(lq + 3)
    qcs = torch.randn(3, C, lq, generator=g).to(dtype).to(device)
    keep = (torch.rand(3, C, generator=g) < 0.4).to(device)
    ref = ms.plaid.approx_scores_reference(qcs.double(), pc, lengths.to(device))
    out = ms.plaid.approx_scores(qcs, pc, lengths.to(device))
    assert out.dtype == torch.float32 and relerr(out, ref, floor=1.0) < 1e-6
    assert relerr(ms.plaid.approx_scores(qcs, pc, lengths.to(device), keep=keep),
                  ms.plaid.approx_scores_reference(qcs.double(), pc, lengths.to(device), keep), floor=1.0) < 1e-6
    cu = torch.tensor([0] + torch.cumsum(lengths, 0).tolist(), dtype=torch.int32, device=device)
    shifted = torch.empty(qcs.numel() + 1, dtype=dtype, device=device)[1:].view_as(qcs)
    shifted.copy_(qcs)
    assert relerr(ms.plaid.approx_scores(shifted, codes, cu_seqlens=cu), ref, floor=1.0) < 1e-6
    # the fp32 widening gives the same scores: the 16-bit scan reads the same values
    assert relerr(out, ms.plaid.approx_scores(qcs.float(), pc, lengths.to(device)), floor=1.0) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_forward_pairs_and_argmax(ms, device):
    """plaid_forward's pair layout (search re-scoring) and argmax against the
    cross layout."""
    lens = [4, 0, 21, 9]
    d, nbits = 24, 4
    codes, res, cent, bw = _codec(ms, sum(lens), d, 5, nbits, device, seed=11)
    st = torch.tensor([0, 4, 4, 25], dtype=torch.int32, device=device)
    ln = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.nn.functional.normalize(torch.randn(3, 7, d, generator=torch.Generator().manual_seed(2)), dim=-1).to(device)
    cross, am = ms.ops.plaid_forward(q, codes, res, cent, bw, st, ln, None, nbits, True, True)
    assert am.shape == (3, 4, 7) and torch.all(am[:, 1] == -1) and torch.all(am[:, 0] < 4) and torch.all(am >= -1)
    pq = torch.tensor([2, 0, 1, 1, 2], dtype=torch.int32, device=device)
    docs = torch.tensor([3, 1, 2, 0, 2], device=device)
    pairs, pam = ms.ops.plaid_forward(q, codes, res, cent, bw, st[docs], ln[docs], pq, nbits, True, True)
    assert torch.allclose(pairs, cross[pq.long(), docs], rtol=1e-6, atol=1e-6)
    assert torch.equal(pam, am[pq.long(), docs])
    # a document range outside the tokens scores NaN
    bad, _ = ms.ops.plaid_forward(q, codes, res, cent, bw, st[:1] + 100, ln[:1], None, nbits, True, False)
    assert torch.isnan(bad).all()


def test_opcheck_fake_kernels(ms):
    codes, res, cent, bw = _codec(ms, 30, 10, 6, 4, "cpu")
    st = torch.tensor([0, 10, 10], dtype=torch.int32)
    ln = torch.tensor([10, 0, 20], dtype=torch.int32)
    q = torch.randn(2, 5, 10)
    torch.library.opcheck(ms.ops.plaid_approx.default, (torch.randn(2, 6, 5), codes, st, ln))
    torch.library.opcheck(ms.ops.plaid_approx.default, (torch.randn(2, 6, 5, dtype=torch.float16), codes, st, ln))
    torch.library.opcheck(ms.ops.plaid_approx.default,
                          (torch.randn(2, 6, 5), codes, st, ln, torch.tensor([[1, 0, 1, 0, 1, 1]] * 2,
                                                                             dtype=torch.uint8)))
    torch.library.opcheck(ms.ops.plaid_forward.default, (q, codes, res, cent, bw, st, ln, None, 4, True, True))
    _, am = ms.ops.plaid_forward(q, codes, res, cent, bw, st, ln, None, 4, True, True)
    torch.library.opcheck(ms.ops.plaid_backward.default,
                          (torch.randn(2, 3), q, codes, res, cent, bw, st, ln, am, 4, True))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_fullgraph(ms, device):
    codes, res, cent, bw = _codec(ms, 40, 16, 6, 2, device)
    cu = torch.tensor([0, 10, 10, 40], dtype=torch.int32, device=device)
    Q = torch.randn(2, 5, 16, device=device)
    f = torch.compile(lambda Q: ms.plaid.maxsim_residual_varlen(Q, codes, res, cu, cent, bw, 2), fullgraph=True)
    assert torch.allclose(f(Q), ms.plaid.maxsim_residual_varlen(Q, codes, res, cu, cent, bw, 2), rtol=1e-6, atol=1e-6)


def _clustered(T_docs, L, d, topics, gen, noise=0.3):
    centers = torch.nn.functional.normalize(torch.randn(topics, d, generator=gen), dim=-1)
    assign = torch.randint(0, topics, (T_docs, L), generator=gen)
    x = centers[assign] + noise * torch.randn(T_docs, L, d, generator=gen) / d ** 0.5
    return torch.nn.functional.normalize(x, dim=-1), centers


@pytest.mark.parametrize("device", DEVICES)
def test_plaid_corpus_search_recall(ms, device):
    g = torch.Generator().manual_seed(0)
    N, L, d = 400, 24, 32
    docs, centers = _clustered(N, L, d, 24, g)
    lengths = torch.randint(1, L + 1, (N,), generator=g)
    lengths[5] = 0
    Q = torch.nn.functional.normalize(centers[torch.randint(0, 24, (6, 8), generator=g)]
                                      + 0.2 * torch.randn(6, 8, d, generator=g), dim=-1)
    exact = ms.Corpus(docs, lengths=lengths, device=device, storage="cpu" if device == "cpu" else "device")
    _, ids_exact = ms.search(Q.to(device), exact, 10)
    corpus = ms.Corpus(docs, lengths=lengths, device=device, storage="cpu" if device == "cpu" else "device",
                       quantization="plaid", nbits=4, plaid={"num_centroids": 64})
    assert corpus.quantization == "plaid" and corpus.plaid.bytes_per_token == 4 + 16
    scores, ids = ms.search(Q.to(device), corpus, 10, candidates=100)
    assert ids.shape == (6, 10) and scores.dtype == torch.float32
    recall = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids.cpu(), ids_exact.cpu())) / 60
    assert recall >= 0.9, recall
    # the scores returned are the exact scores of the decompressed tokens
    tok = corpus.plaid.decompress()
    st, ln = corpus.plaid.starts.long(), corpus.plaid.lengths.long()
    for i in range(2):
        for s, n in zip(scores[i].tolist()[:3], ids[i].tolist()[:3]):
            D = torch.nn.functional.normalize(tok[st[n]:st[n] + ln[n]].double(), dim=-1)
            ref = (Q[i].double().to(device) @ D.T).amax(1).sum().item()
            assert abs(s - ref) < 1e-4
    # sorted best first, ties to the lower id
    assert torch.all(scores[:, 1:] <= scores[:, :-1])
    # probing the inverted lists, and re-scoring on the originals
    _, ids_p = ms.search(Q.to(device), corpus, 10, candidates=100, nprobe=8)
    recall_p = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids_p.cpu(), ids_exact.cpu())) / 60
    assert recall_p >= 0.85, recall_p
    keep = ms.Corpus(docs, lengths=lengths, device=device, storage="cpu" if device == "cpu" else "device",
                     quantization="plaid", nbits=2, rescore="device", plaid={"num_centroids": 64})
    s_o, ids_o = ms.search(Q.to(device), keep, 10, candidates=200)
    s_e, _ = ms.search(Q.to(device), exact, 10)
    assert (s_o - s_e).abs().max().item() < 1e-3  # exact scores of the originals (cosine)


def _planted(N, L, d, gen, topics=60, W=16, per_doc=3, words=4, Nq=12, Lq=32):
    """A corpus of topics and words (tokens: a word of one of the document's
    topics plus noise) and queries drawn from a target document's words, as
    benchmarks/bench_plaid.py generates them: the top-10 is separated."""
    nrm = torch.nn.functional.normalize
    tv = nrm(torch.randn(topics, d, generator=gen), dim=-1)
    vocab = nrm(tv[:, None] + 0.5 * nrm(torch.randn(topics, W, d, generator=gen), dim=-1), dim=-1).reshape(-1, d)
    dt = torch.randint(0, topics, (N, per_doc), generator=gen)
    dw = torch.randint(0, W, (N, per_doc, words), generator=gen)
    slot = torch.randint(0, per_doc, (N, L), generator=gen)
    wid = dt.gather(1, slot) * W + dw.reshape(N, -1).gather(1, slot * words + torch.randint(0, words, (N, L),
                                                                                              generator=gen))
    docs = nrm(vocab[wid] + 0.3 * nrm(torch.randn(N, L, d, generator=gen), dim=-1), dim=-1)
    target = torch.randperm(N, generator=gen)[:Nq]
    qw = wid[target[:, None], torch.randint(0, L, (Nq, Lq), generator=gen)]
    Q = nrm(vocab[qw] + 0.3 * nrm(torch.randn(Nq, Lq, d, generator=gen), dim=-1), dim=-1)
    return docs, Q, target


@pytest.mark.parametrize("device", DEVICES)
def test_plaid_search_planted_recall_exact_with_originals(ms, device):
    """On a corpus whose queries are relevant to a few documents, the
    approximate stage's candidates (4k of 5000 documents) hold the whole
    exact top-k, so re-scoring the originals returns the exact top-k; the
    2-bit re-score finds nearly all of it."""
    g = torch.Generator().manual_seed(3)
    docs, Q, target = _planted(5000, 20, 32, g)
    storage = "cpu" if device == "cpu" else "device"
    exact = ms.Corpus(docs, device=device, storage=storage)
    s_ref, ref = ms.search(Q.to(device), exact, 10)
    assert torch.equal(ref[:, 0].cpu(), target)  # the planted document ranks first
    keep = ms.Corpus(docs, device=device, storage=storage, quantization="plaid", nbits=2, rescore="device",
                     plaid={"num_centroids": 256})
    s, ids = ms.search(Q.to(device), keep, 10, candidates=40)
    assert torch.equal(ids.cpu(), ref.cpu())
    assert (s - s_ref).abs().max().item() < 1e-3
    # the approximate scores alone rank the planted document first
    qcs = keep.plaid.centroids @ torch.nn.functional.normalize(Q.to(device).float(), dim=-1).transpose(1, 2)
    approx = ms.plaid.approx_scores(qcs, keep.plaid.codes, cu_seqlens=torch.arange(0, 5001 * 20, 20,
                                                                                      device=device))
    assert torch.equal(approx.argmax(1).cpu(), target)
    # PLAID's centroid pruning keeps the candidates while skipping most
    # tokens (at d = 32 unrelated cosines spread 4x wider than at d = 128,
    # where PLAID uses 0.4-0.5)
    kept = (qcs.amax(2) >= 0.3)[:, keep.plaid.codes.long()].float().mean().item()
    assert kept < 0.5, kept
    s_t, ids_t = ms.search(Q.to(device), keep, 10, candidates=40, centroid_threshold=0.3)
    assert torch.equal(ids_t.cpu(), ref.cpu())
    keep.originals = None
    _, ids2 = ms.search(Q.to(device), keep, 10, candidates=40)
    hit = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids2.cpu(), ref.cpu())) / ref.numel()
    assert hit >= 0.8, hit


@pytest.mark.parametrize("device", DEVICES)
def test_from_plaid_wraps_without_copy(ms, device):
    codes, res, cent, bw = _codec(ms, 50, 16, 8, 2, device)
    off = torch.tensor([0, 20, 20, 50], device=device)
    corpus = ms.Corpus.from_plaid(codes, res, cent, bw, 2, off)
    assert corpus.plaid.codes.data_ptr() == codes.data_ptr()
    assert corpus.plaid.residuals.data_ptr() == res.data_ptr()
    assert corpus.plaid.centroids.data_ptr() == cent.data_ptr()
    assert len(corpus) == 3
    Q = torch.randn(4, 16, device=device)
    scores, ids = ms.search(Q, corpus, 3)
    cu = off.to(torch.int32)
    ref = ms.plaid.maxsim_residual_varlen(Q, codes, res, cu, cent, bw, 2)
    assert torch.allclose(scores, ref[ids], rtol=1e-6, atol=1e-6)
    assert sorted(ids.tolist()) == [0, 1, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture(ms):
    """The flat-layout scoring and a plaid search without nprobe make no host sync."""
    from conftest import capture_cuda_graph

    codes, res, cent, bw = _codec(ms, 300, 64, 16, 2, "cuda")
    cu = torch.tensor([0, 100, 100, 300], dtype=torch.int32, device="cuda")
    Q = torch.randn(2, 9, 64, device="cuda")
    qcs = torch.randn(16, 9, device="cuda")
    graph, (s, a) = capture_cuda_graph(lambda: (ms.plaid.maxsim_residual_varlen(Q, codes, res, cu, cent, bw, 2),
                                                ms.plaid.approx_scores(qcs, codes, cu_seqlens=cu)))
    Q.copy_(torch.randn_like(Q))
    graph.replay()
    assert torch.allclose(s, ms.plaid.maxsim_residual_varlen(Q, codes, res, cu, cent, bw, 2), rtol=1e-6, atol=1e-6)
    corpus = ms.Corpus.from_plaid(codes, res, cent, bw, 2, cu)
    graph, (sc, ids) = capture_cuda_graph(lambda: ms.search(Q, corpus, 2))
    graph.replay()
    ref_s, ref_ids = ms.search(Q, corpus, 2)
    assert torch.equal(ids, ref_ids) and torch.allclose(sc, ref_s)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_raise(ms, device):
    codes, res, cent, bw = _codec(ms, 20, 16, 4, 2, device)
    cu = torch.tensor([0, 20], dtype=torch.int32, device=device)
    Q = torch.randn(1, 3, 16, device=device)
    with pytest.raises(ValueError, match="nbits"):
        ms.plaid.maxsim_residual_varlen(Q, codes, res, cu, cent, bw, 3)
    with pytest.raises(ValueError, match="bucket_weights"):
        ms.plaid.maxsim_residual_varlen(Q, codes, res, cu, cent, bw, 4)  # 4 weights for 4 bits
    with pytest.raises(RuntimeError, match="bytes per token"):
        ms.plaid.maxsim_residual_varlen(Q, codes, res[:, :3], cu, cent, bw, 2)
    st, ln = cu[:1], cu[1:]
    with pytest.raises(RuntimeError, match="d >= 1"):
        ms.ops.plaid_forward(Q[..., :0], codes, res[:, :0], cent[:, :0], bw, st, ln, None, 2, True, False)


def _fp64_forward(ms, Q, codes, res, cent, bw, nbits, starts, lens, normalize=True):
    """fp64 MaxSim of each query against each token range of the reference
    decompression: scores [Nq, Nd] and, per document, the token scores [Nq, Lq, L]."""
    tok = ms.plaid.decompress(codes, res, cent, bw, nbits).double().cpu()
    if normalize:
        tok = tok / tok.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    q = Q.double().cpu()
    out, sims = torch.zeros(q.shape[0], len(lens), dtype=torch.float64), []
    for n, (s, ln) in enumerate(zip(starts, lens)):
        sim = torch.einsum("isd,td->ist", q, tok[s:s + ln])
        sims.append(sim)
        if ln:
            out[:, n] = sim.amax(-1).sum(-1)
    return out, sims


TILE_LENS = [1, 31, 32, 33, 63, 64, 65, 300, 0]  # around the kernels' 32- and 64-token tiles


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nbits", NBITS)
@pytest.mark.parametrize("d", [1, 17, 100, 128, 130])
@pytest.mark.parametrize("lq", [1, 17, 33])
def test_forward_tile_edges(ms, device, nbits, d, lq):
    """Every document length around the token tiles, query lengths around
    the 32-token chunks, d around the 4-feature groups: scores against fp64,
    and each argmax a winner (its fp64 score within rounding of the max)."""
    lens = TILE_LENS
    codes, res, cent, bw = _codec(ms, sum(lens), d, 37, nbits, device, seed=d * 7 + lq + nbits)
    starts = [0] + torch.cumsum(torch.tensor(lens), 0).tolist()[:-1]
    st = torch.tensor(starts, dtype=torch.int32, device=device)
    ln = torch.tensor(lens, dtype=torch.int32, device=device)
    Q = torch.nn.functional.normalize(torch.randn(2, lq, d, generator=torch.Generator().manual_seed(d + lq)), dim=-1)
    ref, sims = _fp64_forward(ms, Q, codes, res, cent, bw, nbits, starts, lens)
    out, am = ms.ops.plaid_forward(Q.to(device), codes, res, cent, bw, st, ln, None, nbits, True, True)
    assert relerr(out, ref, floor=1.0) < 2e-5
    am = am.cpu().long()
    for n, sim in enumerate(sims):
        if lens[n] == 0:
            assert torch.all(am[:, n] == -1) and torch.all(out[:, n].cpu() == 0)
            continue
        assert bool(((am[:, n] >= 0) & (am[:, n] < lens[n])).all())
        got = sim.gather(-1, am[:, n, :, None]).squeeze(-1)
        assert (sim.amax(-1) - got).abs().max().item() < 1e-5
    # the flat op without normalisation, against fp64 too
    raw, _ = ms.ops.plaid_forward(Q.to(device), codes, res, cent, bw, st, ln, None, nbits, False, False)
    assert relerr(raw, _fp64_forward(ms, Q, codes, res, cent, bw, nbits, starts, lens, normalize=False)[0],
                  floor=1.0) < 2e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nbits", [2, 8])
def test_forward_argmax_ties_lowest_token(ms, device, nbits):
    """Copies of the best token at 40, 63, 64 (across a 64-token tile edge)
    and 129 score the same bits: the argmax is the first copy; with every
    token equal it is token 0."""
    d, L = 128, 130
    codes, res, cent, bw = _codec(ms, 2 * L, d, 16, nbits, device, seed=nbits)
    for t in (63, 64, 129):
        codes[t], res[t] = codes[40], res[40]
    codes[L:], res[L:] = codes[L + 7].clone(), res[L + 7].clone()
    tok = ms.plaid.decompress(codes, res, cent, bw, nbits)
    Q = torch.nn.functional.normalize(tok[40].float(), dim=-1).expand(1, 17, d).contiguous()
    st = torch.tensor([0, L], dtype=torch.int32, device=device)
    ln = torch.tensor([L, L], dtype=torch.int32, device=device)
    _, am = ms.ops.plaid_forward(Q, codes, res, cent, bw, st, ln, None, nbits, True, True)
    assert torch.all(am[0, 0] == 40), am[0, 0]
    assert torch.all(am[0, 1] == 0), am[0, 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lq", [1, 32, 33])
def test_approx_scores_near_ties(ms, device, lq):
    """Centroid scores 2^-12 apart (1 + k 2^-12, k < 16: equal in their top
    16 bits), negative ones and exact duplicates, on documents of 0 to 70000
    tokens: every summation order gives the same bits here, so the scores
    must equal the reference's exactly (a max taken at lower precision, or
    a missed token, shows)."""
    g = torch.Generator().manual_seed(lq)
    for C, lens in ((23, [0, 1, 15, 40, 301, 64]), (400, [3, 33, 1, 17]), (23, [5, 70000, 2])):
        lengths = torch.tensor(lens)
        codes = torch.randint(0, C, (sum(lens),), generator=g, dtype=torch.int32)
        qcs = 1 + torch.randint(0, 16, (2, C, lq), generator=g).float() * 2.0 ** -12
        qcs[1] = -qcs[1]  # negative scores
        qcs[:, :3] = 1 + 15 * 2.0 ** -12  # exact duplicates of the top value
        pc, _ = _padded(codes, codes[:, None].to(torch.uint8), lengths, max(lens))
        ref = ms.plaid.approx_scores_reference(qcs.to(device), pc.to(device), lengths.to(device))
        out = ms.plaid.approx_scores(qcs.to(device), pc.to(device), lengths.to(device))
        # on a 2^-12 grid below 64 every partial sum is exact: any order gives the same bits
        assert torch.equal(out.double().cpu(), ref.double().cpu())
