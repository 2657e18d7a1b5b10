"""PyLate / colpali-engine integrations and the kernels-hub layer, checked
against the real libraries' own torch implementations (no model weights: the
losses run on a tiny embedding model built here)."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
import types

import pytest
import torch
from conftest import MAXSIM, ROOT, assert_close, lengths_mask, rand

if importlib.util.find_spec("pylate") is None or importlib.util.find_spec("colpali_engine") is None:
    # scripts/setup.sh installs both; a bare environment skips this module
    # instead of failing its collection.
    pytest.skip("pylate and colpali-engine are not installed", allow_module_level=True)

MAXSIM.integrations.import_transformers()  # before pylate / colpali_engine: see there

from colpali_engine.loss.late_interaction_losses import ColbertLoss, ColbertPairwiseNegativeCELoss
from colpali_engine.utils import maxsim as cm
from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor
from pylate import losses as pl_losses
from pylate import models as pl_models
from pylate import rank as pl_rank
from pylate.scores import colbert as pc  # noqa: E402

F32 = torch.float32
MASK_DTYPES = [torch.bool, torch.int64, torch.float32]


@pytest.fixture(autouse=True)
def hosts_auto_is_exact(monkeypatch):
    """The hosts' ``auto`` backend is their exact torch code here: on a GPU it
    would otherwise pick flash-maxsim / late-interaction-kernels where
    installed (TF32-level error), and these tests compare with the host's
    exact fp32 path. Done through the hosts' own availability checks."""
    from colpali_engine.utils import _lik_backend as colpali_lik
    from pylate.scores import _flash_backend as pylate_flash
    from pylate.scores import _lik_backend as pylate_lik

    for mod in (colpali_lik, pylate_flash, pylate_lik):
        monkeypatch.setattr(mod, "is_available", lambda: False)


@pytest.fixture
def ip(ms):
    yield ms.integrations.pylate
    ms.integrations.pylate.unuse_in_pylate()


@pytest.fixture
def ic(ms, monkeypatch):
    monkeypatch.delenv("COLPALI_SCORES_BACKEND", raising=False)  # auto: colpali's torch path on the CPU
    yield ms.integrations.colpali
    ms.integrations.colpali.unuse_in_colpali()


@pytest.fixture
def calls(ms, monkeypatch):
    """Counts the integrations' calls into maxsim: which code scored."""
    log = []
    for mod in (ms.integrations.pylate, ms.integrations.colpali):
        def counted(*args, _maxsim=mod.maxsim, **kwargs):
            log.append(1)
            return _maxsim(*args, **kwargs)

        monkeypatch.setattr(mod, "maxsim", counted)
    return log


def _ran_maxsim(calls, fn):
    """fn()'s result, and whether it went through maxsim."""
    before = len(calls)
    out = fn()
    return out, len(calls) > before


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
def test_pylate_loss_step(ip, calls, loss_name):
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(0)
    model = _TinyColBERT()
    if loss_name == "Contrastive":
        args = ([_features(g, 4, 6), _features(g, 4, 9), _features(g, 4, 9)],)
    else:
        args = ([_features(g, 3, 6), _features(g, 3 * 4, 9)], torch.randn(3, 4, generator=g))
    loss_cls = getattr(pl_losses, loss_name)
    defaults = loss_cls.__init__.__defaults__
    before = loss_cls(model)
    ref_loss, ref_grad = _loss_and_grad(model, before, *args)
    ip.use_in_pylate()
    # Existing and new loss objects, and one given maxsim's scorer as score_metric.
    ours = ip.ColBERTScores() if loss_name == "Contrastive" else ip.colbert_kd_scores
    for loss_fn in (before, loss_cls(model), loss_cls(model, score_metric=ours)):
        (loss, grad), ran = _ran_maxsim(calls, lambda: _loss_and_grad(model, loss_fn, *args))
        assert ran
        assert_close(loss, ref_loss, F32)
        assert_close(grad, ref_grad, F32)
    assert loss_cls.__init__.__defaults__ is defaults  # PyLate's defaults are not touched
    ip.unuse_in_pylate()
    for loss_fn in (before, loss_cls(model)):
        (loss, _), ran = _ran_maxsim(calls, lambda: _loss_and_grad(model, loss_fn, *args))
        assert not ran
        assert torch.equal(loss, ref_loss)
    (loss, _), ran = _ran_maxsim(calls, lambda: _loss_and_grad(model, loss_cls(model, score_metric=ours), *args))
    assert ran  # the extension point needs no patch
    assert_close(loss, ref_loss, F32)


@pytest.fixture(scope="module")
def colbert_dir(tmp_path_factory):
    """A random-weight BERT and a word-level vocabulary: what
    ``models.ColBERT(model_name_or_path=...)`` loads, no download."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path = tmp_path_factory.mktemp("colbert")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[Q]", "[D]"] + [f"w{i}" for i in range(50)]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}).save_pretrained(path)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(path)
    return path


def test_pylate_models_built_before_and_after(ip, calls, colbert_dir):
    def colbert():
        torch.manual_seed(0)
        return pl_models.ColBERT(model_name_or_path=str(colbert_dir), device="cpu", embedding_size=16,
                                 query_prefix="[Q] ", document_prefix="[D] ")

    before = colbert()
    q = before.encode(["w1 w2 w3", "w4 w5"], is_query=True, convert_to_tensor=True)
    d = before.encode(["w1 w9 w7", "w5 w6 w2", "w8 w8 w2"], is_query=False, convert_to_tensor=True)
    ref, ran = _ran_maxsim(calls, lambda: before.similarity(q, d))
    assert not ran
    ip.use_in_pylate()
    for model in (before, colbert()):
        out, ran = _ran_maxsim(calls, lambda: model.similarity(q, d))
        assert ran
        assert_close(out, ref.double(), F32)
    ip.unuse_in_pylate()
    out, ran = _ran_maxsim(calls, lambda: before.similarity(q, d))
    assert not ran and torch.equal(out, ref)


def _importer(source):
    module = types.ModuleType("user_module")
    exec(source, module.__dict__)
    return module


def test_pylate_from_import_users(ip, calls):
    """``from pylate.scores import ...`` made before the patch follows it;
    one made while patched runs PyLate's code after ``unuse_in_pylate()``."""
    g = torch.Generator().manual_seed(12)
    Q, D, Dkd = rand(3, 5, 8, gen=g), rand(4, 6, 8, gen=g), rand(3, 2, 6, 8, gen=g)
    src = "from pylate.scores import colbert_scores, colbert_kd_scores, colbert_scores_pairwise, ColBERTScores"
    early = _importer(src)
    ip.use_in_pylate()
    late = _importer(src)

    def run_all(m):
        return [m.colbert_scores(Q, D), m.colbert_kd_scores(Q, Dkd), m.colbert_scores_pairwise(Q, D[:3]),
                m.ColBERTScores()(Q, Dkd)]

    ref = [pc.colbert_scores(Q, D, backend="torch"), pc.colbert_kd_scores(Q, Dkd, backend="torch"),
           pc.colbert_scores_pairwise(Q, D[:3], backend="torch"), pc.ColBERTScores()(Q, Dkd, backend="torch")]
    for m in (early, late):
        outs, ran = _ran_maxsim(calls, lambda: run_all(m))
        assert ran
        for out, want in zip(outs, ref):
            assert_close(out, want.double(), F32)
    ip.unuse_in_pylate()
    for m in (early, late):
        outs, ran = _ran_maxsim(calls, lambda: run_all(m))
        assert not ran
        assert all(torch.equal(a, b) for a, b in zip(outs, ref))


def test_pylate_explicit_backend_runs_pylate(ip, calls, monkeypatch):
    g = torch.Generator().manual_seed(13)
    Q, D = rand(3, 5, 8, gen=g), rand(4, 6, 8, gen=g)
    ip.use_in_pylate()
    monkeypatch.delenv("PYLATE_SCORES_BACKEND", raising=False)
    _, ran = _ran_maxsim(calls, lambda: pc.colbert_scores(Q, D))
    assert ran
    _, ran = _ran_maxsim(calls, lambda: pc.colbert_scores(Q, D, backend="AUTO"))
    assert ran
    ref = pc.colbert_scores(Q, D, backend="torch")
    assert len(calls) == 2
    ip.unuse_in_pylate()
    assert torch.equal(ref, pc.colbert_scores(Q, D, backend="torch"))
    ip.use_in_pylate()
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "torch")
    for fn in (lambda: pc.colbert_scores(Q, D), lambda: pc.ColBERTScores()(Q, D[None]),
               lambda: pc.colbert_kd_scores(Q, D[None].expand(3, -1, -1, -1)),
               lambda: pc.colbert_scores_pairwise(Q, D[:3])):
        _, ran = _ran_maxsim(calls, fn)
        assert not ran
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "bogus")
    with pytest.raises(ValueError, match="backend must be one of"):
        pc.colbert_scores(Q, D)
    monkeypatch.delenv("PYLATE_SCORES_BACKEND")
    with pytest.raises(ValueError, match="backend must be one of"):
        pc.colbert_scores(Q, D, backend="fast")
    if not torch.cuda.is_available():  # PyLate's own error: its kernels need CUDA tensors
        with pytest.raises(RuntimeError, match="requires CUDA"):
            pc.colbert_scores(Q, D, backend="flash")


@pytest.mark.parametrize("patched", [False, True], ids=["direct", "patched"])
def test_pylate_errors_keep_pylates_classes(ip, patched):
    g = torch.Generator().manual_seed(14)
    Q, D = rand(3, 5, 8, gen=g), rand(4, 6, 7, gen=g)
    if patched:
        ip.use_in_pylate()
    fns = (pc.colbert_scores, pc.colbert_kd_scores) if patched else (ip.colbert_scores, ip.colbert_kd_scores)
    with pytest.raises(RuntimeError):
        pc.colbert_scores(Q, D, backend="torch")  # PyLate's own class for mismatched dims
    with pytest.raises(RuntimeError):
        fns[0](Q, D)
    with pytest.raises(RuntimeError):
        fns[1](Q, D[:3, None])
    with pytest.raises(RuntimeError):
        fns[0](Q, D[..., :8].expand(4, 6, 8), documents_mask=torch.ones(4, 5, dtype=torch.bool))


def test_pylate_unuse_restores_everything(ip):
    hosts = (pc.colbert_scores, pc.colbert_scores_pairwise, pc.colbert_kd_scores, pc.ColBERTScores.__call__)
    codes = [h.__code__ for h in hosts]
    sigs = [inspect.signature(h) for h in hosts]
    ip.use_in_pylate()
    assert all(h.__code__ is not c for h, c in zip(hosts, codes))
    assert [inspect.signature(h) for h in hosts] == sigs
    ip.unuse_in_pylate()
    ip.unuse_in_pylate()  # a second undo changes nothing
    assert all(h.__code__ is c for h, c in zip(hosts, codes))
    assert not any(k.startswith("__maxsim") for k in vars(pc))


def test_reroute_any_signature(ms):
    """Keyword-only and positional-only parameters, no defaults at all
    (``__defaults__`` None), *args / **kwargs: the host keeps its signature
    and defaults while rerouted and gets its code back after."""
    ns = _importer(
        "def kwonly(q, d, *, mask=None, backend='auto'): return ('host', q, d, mask, backend)\n"
        "def nodefaults(q, d): return ('host', q, d)\n"
        "def varargs(q, /, *rest, backend=None, **extra): return ('host', q, rest, backend, extra)\n")
    patcher = ms.integrations._patch.Patcher()
    sigs = {n: inspect.signature(getattr(ns, n)) for n in ("kwonly", "nodefaults", "varargs")}
    assert ns.nodefaults.__defaults__ is None
    for name in sigs:
        patcher.reroute(getattr(ns, name), lambda *a, **k: ("ours", a, k), lambda k: k.get("backend") == "torch")
    assert {n: inspect.signature(getattr(ns, n)) for n in sigs} == sigs
    assert ns.kwonly(1, 2) == ("ours", (), {"q": 1, "d": 2, "mask": None, "backend": "auto"})
    assert ns.kwonly(1, 2, backend="torch") == ("host", 1, 2, None, "torch")
    assert ns.nodefaults(1, d=2) == ("ours", (), {"q": 1, "d": 2})
    with pytest.raises(TypeError):
        ns.nodefaults(1)
    assert ns.varargs(1, 2, 3, z=4) == ("ours", (1, 2, 3), {"backend": None, "z": 4})
    assert ns.varargs(1, 2, backend="torch") == ("host", 1, (2,), "torch", {})
    patcher.restore()
    assert ns.kwonly(1, 2) == ("host", 1, 2, None, "auto")
    assert "__maxsim_routes__" not in vars(ns)


def test_import_transformers_keeps_hub_kernels():
    """transformers 5.3 builds unpinned kernel repositories, which kernels >=
    0.16 rejects; after ``import_transformers()`` transformers imports with
    its hub kernels enabled (not hidden), and ``kernels`` is left as it was.
    Releases without the clash (newer transformers, whose hub-kernel internals
    differ) only have to import."""
    script = f"""
from pathlib import Path
import kernels
import_transformers = kernels.get_local_kernel(Path({str(ROOT)!r})).integrations.import_transformers
classes = kernels.LayerRepository, getattr(kernels, "FuncRepository", None)
try:
    import transformers.integrations.hub_kernels
    clash = False
except ValueError:
    clash = True
print("clash", clash)
import_transformers()
import transformers.integrations.hub_kernels as hub
assert (kernels.LayerRepository, getattr(kernels, "FuncRepository", None)) == classes
if clash:  # the release this works around: check its hub kernels stay on
    assert hub._kernels_available and hub._kernels_enabled, "hub kernels disabled"
    assert hub.get_kernel_hub is kernels.get_kernel
    repo = hub._KERNEL_MAPPING["MultiScaleDeformableAttention"]["cuda"]
    assert isinstance(repo, kernels.LayerRepository)
    print("revision", repo._revision, repo._version)
import pylate.scores, colpali_engine.utils.maxsim
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == "ok"
    if "clash True" in r.stdout:
        assert "revision main None" in r.stdout
def test_pylate_rerank(ip, calls):
    g = torch.Generator().manual_seed(6)
    qs = [rand(5, 8, gen=g) for _ in range(2)]
    docs = [[rand(n, 8, gen=g) for n in (3, 6, 2)], [rand(n, 8, gen=g) for n in (4, 1)]]
    ids = [["a", "b", "c"], ["d", "e"]]
    ref = pl_rank.rerank(documents_ids=ids, queries_embeddings=qs, documents_embeddings=docs)
    ip.use_in_pylate()
    ip.use_in_pylate()  # idempotent
    out, ran = _ran_maxsim(calls, lambda: pl_rank.rerank(documents_ids=ids, queries_embeddings=qs,
                                                         documents_embeddings=docs))
    assert ran
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
    assert torch.equal(BaseVisualRetrieverProcessor.score_multi_vector(_f64(*qs), _f64(*ps), batch_size=3,
                                                                       device=device), ref)


def test_colpali_kd(ic, device):
    g = torch.Generator().manual_seed(8)
    Q = rand(3, 6, 8, gen=g, device=device) * lengths_mask(torch.tensor([6, 2, 4]), 6).to(device)[..., None]
    D = rand(3, 4, 5, 8, gen=g, device=device)
    D[:, :, 3:] = 0  # zero padding
    assert_close(ic.maxsim_kd(Q, D), cm._torch_maxsim_kd(*_f64(Q, D)), F32)
    assert_close(ic.maxsim_inbatch(Q, D[:, 0]), cm._torch_maxsim(*_f64(Q, D[:, 0])), F32)


def test_colpali_backends_and_imports(ic, calls, monkeypatch):
    """Loss objects and ``from ... import`` copies made before or while
    patched follow ``use`` / ``unuse``; COLPALI_SCORES_BACKEND=torch runs
    colpali's code; an invalid value raises colpali's ValueError."""
    g = torch.Generator().manual_seed(15)
    q, d, neg = rand(4, 6, 8, gen=g), rand(4, 7, 8, gen=g), rand(4, 2, 5, 8, gen=g)
    src = "from colpali_engine.utils.maxsim import maxsim_inbatch, maxsim_kd"
    early, loss = _importer(src), ColbertPairwiseNegativeCELoss()
    ref = (cm.maxsim_inbatch(q, d), cm.maxsim_kd(q, neg), loss(q, d, neg))
    ic.use_in_colpali()
    late = _importer(src)

    def run_all(m):
        return m.maxsim_inbatch(q, d), m.maxsim_kd(q, neg), loss(q, d, neg)

    for m in (early, late, cm):
        outs, ran = _ran_maxsim(calls, lambda: run_all(m))
        assert ran
        for a, b in zip(outs, ref):
            assert_close(a, b.double(), F32)
    monkeypatch.setenv("COLPALI_SCORES_BACKEND", "torch")
    outs, ran = _ran_maxsim(calls, lambda: run_all(early))
    assert not ran and all(torch.equal(a, b) for a, b in zip(outs, ref))
    monkeypatch.setenv("COLPALI_SCORES_BACKEND", "fast")
    with pytest.raises(ValueError, match="COLPALI_SCORES_BACKEND must be one of"):
        loss(q, d, neg)
    monkeypatch.delenv("COLPALI_SCORES_BACKEND")
    with pytest.raises(RuntimeError):  # colpali's own class for mismatched dims
        ic.maxsim_inbatch(q, d[..., :7])
    with pytest.raises(RuntimeError):
        cm.maxsim_kd(q, neg[..., :7])
    codes = (cm.maxsim_inbatch.__code__, cm.maxsim_kd.__code__)
    ic.unuse_in_colpali()
    assert codes[0] is not cm.maxsim_inbatch.__code__ and codes[1] is not cm.maxsim_kd.__code__
    for m in (early, late, cm):
        outs, ran = _ran_maxsim(calls, lambda: run_all(m))
        assert not ran and all(torch.equal(a, b) for a, b in zip(outs, ref))
    with pytest.raises(RuntimeError):
        cm.maxsim_kd(q, neg[..., :7])
    assert not any(k.startswith("__maxsim") for k in vars(cm))


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


def test_fp32_precision_follows_the_hosts_matmul_setting(ms, ip, ic, monkeypatch):
    """fp32 scores run at the precision of the host's own fp32 einsum: exact
    while torch keeps fp32 matmuls exact (the default), the split tensor-core
    path once the user allows TF32 (then the host is the less exact one)."""
    seen = []
    real = ms.scoring.maxsim

    def spy(*args, **kwargs):
        seen.append(kwargs.get("precision"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ms.integrations.pylate, "maxsim", spy)
    monkeypatch.setattr(ms.integrations.colpali, "maxsim", spy)
    Q, D = rand(2, 5, 16, dtype=F32, device="cpu"), rand(3, 7, 16, dtype=F32, device="cpu")
    previous = torch.get_float32_matmul_precision()
    try:
        for setting, expected in (("highest", "exact"), ("high", "default")):
            torch.set_float32_matmul_precision(setting)
            seen.clear()
            ip.colbert_scores(Q, D)
            ic.maxsim_inbatch(Q, D)
            assert seen == [expected, expected], (setting, seen)
    finally:
        torch.set_float32_matmul_precision(previous)
