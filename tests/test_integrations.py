"""PyLate / colpali-engine integrations and the kernels-hub layer, checked
against the real libraries' own torch implementations (no model weights: the
losses run on a tiny embedding model built here)."""

from __future__ import annotations

import pytest
import torch
from conftest import MAXSIM, ROOT, assert_close, lengths_mask, rand

MAXSIM.integrations._patch.import_transformers()  # before pylate / colpali_engine: see there

from colpali_engine.loss.late_interaction_losses import ColbertLoss, ColbertPairwiseNegativeCELoss
from colpali_engine.utils import maxsim as cm
from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor
from pylate import losses as pl_losses
from pylate import rank as pl_rank
from pylate.scores import colbert as pc  # noqa: E402

F32 = torch.float32
MASK_DTYPES = [torch.bool, torch.int64, torch.float32]


@pytest.fixture
def ip(ms):
    yield ms.integrations.pylate
    ms.integrations.pylate.unuse_in_pylate()


@pytest.fixture
def ic(ms, monkeypatch):
    monkeypatch.setenv("COLPALI_SCORES_BACKEND", "torch")  # colpali's reference path
    yield ms.integrations.colpali
    ms.integrations.colpali.unuse_in_colpali()


def _mask(gen, *shape, dtype=torch.bool, device="cpu"):
    m = torch.rand(*shape, generator=gen) < 0.7
    m.view(-1, shape[-1])[0] = False  # one fully masked row
    m.view(-1, shape[-1])[1] = True
    return m.to(dtype).to(device)


def _noncontig(gen, *shape, device):
    # Every other token of a wider tensor: a strided view, as slicing gives.
    x = rand(*shape[:-2], 2 * shape[-2], shape[-1], gen=gen, device=device)[..., ::2, :]
    assert not x.is_contiguous()
    return x


def _f64(*ts):
    return [t.double() for t in ts]


# ---------------------------------------------------------------------------
# PyLate
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("mdtype", MASK_DTYPES, ids=["bool", "int64", "fp32"])
def test_pylate_colbert_scores(ms, ip, device, mdtype):
    g = torch.Generator().manual_seed(0)
    # Few, low-dimensional document tokens make all-negative maxima common, so
    # PyLate's "a masked token still scores 0" rule is exercised.
    Q, D = _noncontig(g, 5, 7, 8, device=device), _noncontig(g, 6, 4, 8, device=device)
    qm, dm = _mask(g, 5, 7, dtype=mdtype, device=device), _mask(g, 6, 4, dtype=mdtype, device=device)
    out = ip.colbert_scores(Q, D, qm, dm)
    ref = pc.colbert_scores(*_f64(Q, D), qm, dm, backend="torch")
    assert out.dtype == pc.colbert_scores(Q, D, qm, dm, backend="torch").dtype
    assert_close(out, ref, F32)
    assert not torch.allclose(out, ms.maxsim(Q, D, qm.bool(), dm.bool()))  # the rule mattered
    assert torch.equal(ip.colbert_scores(list(Q), list(D), qm, dm), out)  # lists of tensors
    assert_close(ip.colbert_scores(Q, D), pc.colbert_scores(*_f64(Q, D), backend="torch"), F32)


def test_pylate_colbert_scores_gradients(ip, device):
    g = torch.Generator().manual_seed(1)
    Q, D = rand(4, 6, 8, gen=g, device=device), rand(5, 3, 8, gen=g, device=device)
    qm, dm = _mask(g, 4, 6, device=device), _mask(g, 5, 3, device=device)
    w = torch.randn(4, 5, generator=g).to(device)
    Q.requires_grad_(True), D.requires_grad_(True)
    (ip.colbert_scores(Q, D, qm, dm) * w).sum().backward()
    Qr, Dr = (t.detach().double().requires_grad_(True) for t in (Q, D))
    (pc.colbert_scores(Qr, Dr, qm, dm, backend="torch") * w.double()).sum().backward()
    assert_close(Q.grad, Qr.grad, F32)
    assert_close(D.grad, Dr.grad, F32)


@pytest.mark.parametrize("mdtype", MASK_DTYPES, ids=["bool", "int64", "fp32"])
def test_pylate_kd_scores(ip, device, mdtype):
    g = torch.Generator().manual_seed(2)
    Q, D = rand(4, 6, 8, gen=g, device=device), _noncontig(g, 4, 3, 5, 8, device=device)
    qm, dm = _mask(g, 4, 6, dtype=mdtype, device=device), _mask(g, 4, 3, 5, dtype=mdtype, device=device)
    assert_close(ip.colbert_kd_scores(Q, D, qm, dm), pc.colbert_kd_scores(*_f64(Q, D), qm, dm, backend="torch"), F32)
    assert_close(ip.colbert_kd_scores(Q, D), pc.colbert_kd_scores(*_f64(Q, D), backend="torch"), F32)


def test_pylate_pairwise(ip, device):
    g = torch.Generator().manual_seed(3)
    Q, D = rand(5, 6, 8, gen=g, device=device), _noncontig(g, 5, 4, 8, device=device)
    assert_close(ip.colbert_scores_pairwise(Q, D), pc.colbert_scores_pairwise(*_f64(Q, D), backend="torch"), F32)
    # Ragged lists: every token of every item counts, padding does not exist.
    qs = [rand(n, 8, gen=g, device=device) for n in (3, 7, 1, 5)]
    ds = [rand(n, 8, gen=g, device=device) for n in (2, 9, 4, 1)]
    assert_close(ip.colbert_scores_pairwise(qs, ds),
                 pc.colbert_scores_pairwise(_f64(*qs), _f64(*ds), backend="torch"), F32)


def test_pylate_colbert_scores_class(ip, device):
    g = torch.Generator().manual_seed(4)
    Q, D = rand(4, 6, 8, gen=g, device=device), rand(4, 3, 5, 8, gen=g, device=device)
    qm, dm = _mask(g, 4, 6, device=device), _mask(g, 4, 3, 5, device=device)
    out = ip.ColBERTScores()(Q, D, qm, dm)
    assert out.shape == (4, 12)
    assert_close(out, pc.ColBERTScores()(*_f64(Q, D), qm, dm, backend="torch"), F32)


class _TinyColBERT(torch.nn.Module):
    """What PyLate's losses read from a model: token embeddings, skiplist and
    the query-expansion flag."""

    skiplist = [3]
    do_query_expansion = False

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8)

    def forward(self, features):
        return {"token_embeddings": self.emb(features["input_ids"])}


def _features(g, n, length):
    ids = torch.randint(0, 20, (n, length), generator=g)
    ids[:, 1] = 3  # a skiplisted token in every sequence
    am = torch.ones(n, length, dtype=torch.long)
    am[0, length // 2:] = 0  # padding
    return {"input_ids": ids, "attention_mask": am}


def _loss_and_grad(model, loss_fn, *args):
    model.zero_grad()
    loss = loss_fn(*args)
    loss.backward()
    return loss.detach(), model.emb.weight.grad.clone()


@pytest.mark.parametrize("loss_name", ["Contrastive", "Distillation"])
def test_pylate_loss_step(ip, loss_name):
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(0)
    model = _TinyColBERT()
    if loss_name == "Contrastive":
        args = ([_features(g, 4, 6), _features(g, 4, 9), _features(g, 4, 9)],)
    else:
        args = ([_features(g, 3, 6), _features(g, 3 * 4, 9)], torch.randn(3, 4, generator=g))
    loss_cls = getattr(pl_losses, loss_name)
    before = loss_cls(model)
    ref_loss, ref_grad = _loss_and_grad(model, before, *args)
    ip.use_in_pylate()
    for loss_fn in (before, loss_cls(model)):  # existing and new loss objects
        loss, grad = _loss_and_grad(model, loss_fn, *args)
        assert_close(loss, ref_loss, F32)
        assert_close(grad, ref_grad, F32)
    if loss_name == "Distillation":
        assert loss_cls(model).score_metric is ip.colbert_kd_scores
    ip.unuse_in_pylate()
    if loss_name == "Distillation":
        assert loss_cls(model).score_metric is pc.colbert_kd_scores
    assert pc.ColBERTScores.__call__ is not ip.ColBERTScores.__call__
    assert pl_rank.rank.colbert_scores is pc.colbert_scores


def test_pylate_rerank(ip):
    g = torch.Generator().manual_seed(6)
    qs = [rand(5, 8, gen=g) for _ in range(2)]
    docs = [[rand(n, 8, gen=g) for n in (3, 6, 2)], [rand(n, 8, gen=g) for n in (4, 1)]]
    ids = [["a", "b", "c"], ["d", "e"]]
    ref = pl_rank.rerank(documents_ids=ids, queries_embeddings=qs, documents_embeddings=docs)
    ip.use_in_pylate()
    ip.use_in_pylate()  # idempotent
    assert pl_rank.rank.colbert_scores is ip.colbert_scores
    out = pl_rank.rerank(documents_ids=ids, queries_embeddings=qs, documents_embeddings=docs)
    assert [[r["id"] for r in q] for q in out] == [[r["id"] for r in q] for q in ref]
    for a, b in zip(out, ref):
        assert_close(torch.tensor([r["score"] for r in a]), torch.tensor([r["score"] for r in b]), F32)


# ---------------------------------------------------------------------------
# colpali-engine
# ---------------------------------------------------------------------------

def test_colpali_score_multi_vector(ic, device):
    g = torch.Generator().manual_seed(7)
    # Ragged, zero-padded by colpali: padded document tokens score 0 and win
    # when every real token is negative, so short documents matter here.
    qs = [rand(n, 8, gen=g, device=device) for n in (5, 2, 7, 3, 6)]
    ps = [rand(n, 8, gen=g, device=device) for n in (1, 9, 3, 2, 6, 4, 8)]
    ref = BaseVisualRetrieverProcessor.score_multi_vector(_f64(*qs), _f64(*ps), batch_size=3, device=device)
    out = ic.score_multi_vector(qs, ps, batch_size=3, device=device)
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    assert_close(out, ref, F32)
    ic.use_in_colpali()
    assert torch.equal(BaseVisualRetrieverProcessor.score_multi_vector(qs, ps, batch_size=3, device=device), out)
    ic.unuse_in_colpali()
    assert cm.maxsim_inbatch is not ic.maxsim_inbatch


def test_colpali_kd(ic, device):
    g = torch.Generator().manual_seed(8)
    Q = rand(3, 6, 8, gen=g, device=device) * lengths_mask(torch.tensor([6, 2, 4]), 6).to(device)[..., None]
    D = rand(3, 4, 5, 8, gen=g, device=device)
    D[:, :, 3:] = 0  # zero padding
    assert_close(ic.maxsim_kd(Q, D), cm._torch_maxsim_kd(*_f64(Q, D)), F32)
    assert_close(ic.maxsim_inbatch(Q, D[:, 0]), cm._torch_maxsim(*_f64(Q, D[:, 0])), F32)


@pytest.mark.parametrize("loss_cls", [ColbertLoss, ColbertPairwiseNegativeCELoss])
def test_colpali_loss_step(ic, loss_cls):
    g = torch.Generator().manual_seed(9)
    q = rand(4, 6, 8, gen=g) * lengths_mask(torch.tensor([6, 3, 5, 2]), 6)[..., None]
    d = rand(4, 7, 8, gen=g) * lengths_mask(torch.tensor([7, 2, 4, 6]), 7)[..., None]
    neg = rand(4, 2, 5, 8, gen=g)
    args = (q, d) if loss_cls is ColbertLoss else (q, d, neg)

    def step():
        leaves = [a.detach().requires_grad_(True) for a in args]
        loss = loss_cls()(*leaves)
        loss.backward()
        return loss.detach(), [x.grad for x in leaves]

    ref_loss, ref_grads = step()
    ic.use_in_colpali()
    loss, grads = step()
    assert_close(loss, ref_loss, F32)
    # Gradients agree on every real token. On zero padding they may not: amax
    # splits a tied maximum evenly, the kernel gives it to the lowest index;
    # colpali models zero the padding (embeddings * attention mask), so those
    # gradients never reach parameters.
    for x, a, b in zip(args, grads, ref_grads):
        real = (x != 0).any(-1)
        assert_close(a[real], b[real], F32)


# ---------------------------------------------------------------------------
# layers.MaxSim
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("grouped", [False, True], ids=["cross", "grouped"])
def test_layer_forward_backward(ms, device, grouped):
    g = torch.Generator().manual_seed(10)
    Q = rand(3, 5, 16, gen=g, device=device).requires_grad_(True)
    dshape = (3, 2, 6) if grouped else (4, 6)
    D = rand(*dshape, 16, gen=g, device=device).requires_grad_(True)
    qm, dm = _mask(g, 3, 5, device=device), _mask(g, *dshape, device=device)
    layer = ms.layers.MaxSim()
    out = layer(Q, D, qm, dm)
    w = torch.randn(out.shape, generator=g).to(device)
    (out * w).sum().backward()
    Qr, Dr = (t.detach().cpu().double().requires_grad_(True) for t in (Q, D))
    ref = ms.maxsim_reference(Qr, Dr, qm.cpu(), dm.cpu())
    (ref * w.cpu().double()).sum().backward()
    assert_close(out, ref, F32)
    assert_close(Q.grad, Qr.grad, F32)
    assert_close(D.grad, Dr.grad, F32)


def test_layer_kernelize(ms):
    import kernels

    @kernels.use_kernel_forward_from_hub("MaxSim")
    class SlowMaxSim(torch.nn.Module):
        def forward(self, Q, D, q_mask=None, d_mask=None):
            raise AssertionError("kernelize did not replace forward")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.score = SlowMaxSim()

        def forward(self, Q, D):
            return self.score(Q, D)

    g = torch.Generator().manual_seed(11)
    Q, D = rand(2, 4, 8, gen=g), rand(3, 5, 8, gen=g)
    repo = kernels.LocalLayerRepository(repo_path=ROOT, layer_name="MaxSim")
    with kernels.use_kernel_mapping({"MaxSim": {"cpu": repo}}, inherit_mapping=False):
        for mode in (kernels.Mode.INFERENCE, kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE):
            model = kernels.kernelize(Model(), mode=mode, device="cpu", use_fallback=False)
            assert torch.equal(model(Q, D), ms.maxsim(Q, D))
