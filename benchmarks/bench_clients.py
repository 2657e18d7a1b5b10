"""Inside PyLate and colpali-engine: a training step and retrieval with each
scoring backend the host offers, and with maxsim.

PyLate (a ColBERT on a random-weight 4-layer, 384-wide BERT, projection to
128): a ``Contrastive`` step (each query with 1 positive + 7 negatives) and a
``Distillation`` step (8 scored candidates per query), forward + backward +
AdamW, and ``rank.rerank`` of 1000 candidates per query. Backends: PyLate's
``torch``, ``flash`` (pip ``flash-maxsim``) and ``lik`` (pip
``late-interaction-kernels``), chosen with ``PYLATE_SCORES_BACKEND``, and
maxsim (the losses' ``score_metric``; ``use_in_pylate()`` for rerank).
colpali-engine (the same encoder, ColPali-sized pages of 1024 tokens): a
``ColbertPairwiseNegativeCELoss`` step and ``score_multi_vector`` over 1000
pages; backends colpali's ``torch`` and ``lik`` (``COLPALI_SCORES_BACKEND``)
and maxsim (``use_in_colpali()``). A backend whose package is missing (or
that needs a GPU) is skipped.

For every training step the scoring call alone (forward + backward on the
step's embeddings) is timed too, and its share of the step reported. Every
retrieval ranking is compared with the host's own torch path on fp32
embeddings (``same_ranking``); training losses of the first step with the
torch backend's (``loss_diff``).

    python benchmarks/bench_clients.py            # GPU, the sizes above, bf16
    python benchmarks/bench_clients.py --dtype fp32
    python benchmarks/bench_clients.py --smoke    # tiny sizes, runs on the CPU

Writes ``bench_results/<device>-clients.json`` (``{"meta": {...}, "rows":
[{"client", "task", "backend", "ms", "scoring_ms", "scoring_share",
"loss_diff", "same_ranking"}]}``; a failed backend's row has ``"error"``
instead of times) and a chart ``<device>-clients.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZES = {
    "full": dict(hidden=384, layers=4, heads=6, dim=128, batch=32, negatives=7, lq=32, ld=180,
                 rerank_queries=16, candidates=1000, colpali_batch=32, colpali_negatives=1, page=1024,
                 pages=1000, colpali_queries=32, reps=20),
    "smoke": dict(hidden=32, layers=1, heads=2, dim=16, batch=4, negatives=2, lq=8, ld=12,
                  rerank_queries=2, candidates=20, colpali_batch=3, colpali_negatives=1, page=24,
                  pages=10, colpali_queries=3, reps=2),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_maxsim():
    import kernels

    ms = kernels.get_local_kernel(ROOT)
    ms.integrations.import_transformers()  # before PyLate / colpali-engine: see there
    return ms


def import_colpali_scoring() -> None:
    """Import colpali-engine's scoring parts (``utils.maxsim``, the losses,
    the processors' base class). Its package ``__init__`` imports every
    model, and with transformers >= 5.4 the Qwen2-VL processors need
    torchvision, which a CUDA image may lack and which scoring never uses:
    if that import fails, the package is registered without running its
    ``__init__`` and the submodules are imported directly."""
    try:
        import colpali_engine  # noqa: F401
    except ImportError as e:
        print(f"colpali_engine's package __init__ failed ({e}); importing its scoring modules only")
        for name in [n for n in sys.modules if n == "colpali_engine" or n.startswith("colpali_engine.")]:
            del sys.modules[name]
        sys.modules["colpali_engine"] = importlib.util.module_from_spec(importlib.util.find_spec("colpali_engine"))
    import colpali_engine.loss.late_interaction_losses  # noqa: F401
    import colpali_engine.utils.processing_utils  # noqa: F401


def available(backend: str, device: str) -> bool:
    package = {"flash": "flash_maxsim", "lik": "late_interaction_kernels"}.get(backend)
    if package is None:
        return True
    if device == "cpu":
        return False
    return importlib.util.find_spec(package) is not None


@contextlib.contextmanager
def env(name: str, value: str | None):
    saved = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if saved is not None:
            os.environ[name] = saved


@contextlib.contextmanager
def failures_recorded(rows: list, client: str, task: str, backend: str):
    """A backend that fails (a shape, dtype or GPU a peer does not support)
    becomes a row with its error instead of ending the run."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"[:300]
        print(f"{client} {task} {backend} failed: {error}")
        rows.append(dict(client=client, task=task, backend=backend, error=error))


def interleaved_ms(calls: dict, device: str, reps: int) -> dict:
    """Median wall time of each ``calls[name] = (context, fn)`` over ``reps``
    rounds in which every call runs once inside its context, in an order
    rotated each round (so clock, cache and allocator drift falls on every
    backend alike), after two warm-up rounds. Returns {name: ms}."""
    names = list(calls)
    times = {name: [] for name in names}
    for i in range(reps + 2):
        for name in names[i % len(names):] + names[:i % len(names)]:
            context, fn = calls[name]
            with context():
                if device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                if device == "cuda":
                    torch.cuda.synchronize()
                if i >= 2:
                    times[name].append((time.perf_counter() - t) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


# ---------------------------------------------------------------------------
# The encoder: random weights, a word-level vocabulary, no download
# ---------------------------------------------------------------------------

VOCAB = 1000


def encoder_dir(path: Path, size: dict) -> Path:
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[Q]", "[D]"] + [f"w{i}" for i in range(VOCAB - 7)]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}).save_pretrained(path)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                        num_attention_heads=size["heads"], intermediate_size=4 * size["hidden"],
                        max_position_embeddings=max(512, size["page"] + 8))
    BertModel(config).save_pretrained(path)
    return path


def features(n: int, length: int, device: str, gen: torch.Generator) -> dict:
    """Tokenized-like inputs: random words, lengths from half to all of ``length``."""
    ids = torch.randint(7, VOCAB, (n, length), generator=gen)
    ids[:, 0] = 2  # [CLS]
    lengths = torch.randint(length // 2 + 1, length + 1, (n,), generator=gen)
    mask = (torch.arange(length) < lengths[:, None]).long()
    return {"input_ids": (ids * mask).to(device), "attention_mask": mask.to(device),
            "token_type_ids": torch.zeros_like(ids).to(device)}


# ---------------------------------------------------------------------------
# PyLate
# ---------------------------------------------------------------------------

def bench_pylate(ms, size, device, dtype, folder: Path) -> list[dict]:
    from pylate import losses, models, rank
    from pylate.losses.contrastive import extract_skiplist_mask
    from pylate.scores import colbert as pc

    ip = ms.integrations.pylate
    torch.manual_seed(0)
    model = models.ColBERT(model_name_or_path=str(folder), device=device, embedding_size=size["dim"],
                           query_prefix="[Q] ", document_prefix="[D] ").to(dtype)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    B, N = size["batch"], size["negatives"] + 1
    contrastive_in = [features(B, size["lq"], device, g)] + [features(B, size["ld"], device, g) for _ in range(N)]
    kd_in = [features(B, size["lq"], device, g), features(B * N, size["ld"], device, g)]
    kd_labels = torch.rand(B, N, generator=g).to(device)

    def embed(feats):
        with torch.no_grad():
            return [torch.nn.functional.normalize(model(f)["token_embeddings"], dim=-1) for f in feats]

    masks = extract_skiplist_mask(sentence_features=contrastive_in, skiplist=model.skiplist)
    emb = embed(contrastive_in)
    kd_masks = extract_skiplist_mask(sentence_features=kd_in, skiplist=model.skiplist)
    kd_emb = embed(kd_in)
    expanded = model.do_query_expansion  # PyLate's losses drop the query mask then
    # What each loss hands its score_metric: queries, documents and their masks.
    contrastive_scoring = (emb[0], torch.stack(emb[1:], dim=1), None if expanded else masks[0],
                           torch.stack(masks[1:], dim=1))
    kd_scoring = (kd_emb[0], kd_emb[1].view(B, N, *kd_emb[1].shape[1:]), None if expanded else kd_masks[0],
                  kd_masks[1].view(B, N, -1))

    rows = []
    backends = [b for b in ("torch", "flash", "lik", "maxsim") if available(b, device)]

    def backend_env(backend):
        return lambda: env("PYLATE_SCORES_BACKEND", None if backend == "maxsim" else backend)

    for task, make_loss, loss_args, scoring_args in (
        ("train-contrastive", lambda ours: losses.Contrastive(model, score_metric=ip.ColBERTScores() if ours else None),
         (contrastive_in, None), contrastive_scoring),
        ("train-distillation", lambda ours: losses.Distillation(model, score_metric=ip.colbert_kd_scores) if ours
         else losses.Distillation(model), (kd_in, kd_labels), kd_scoring),
    ):
        steps, scorings, first = {}, {}, {}
        for backend in backends:
            with backend_env(backend)(), failures_recorded(rows, "pylate", task, backend):
                loss_fn = make_loss(backend == "maxsim")
                model.load_state_dict(initial)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

                def step(loss_fn=loss_fn, opt=opt):
                    opt.zero_grad(set_to_none=True)
                    loss = loss_fn(*loss_args)
                    loss.backward()
                    opt.step()
                    return loss

                def scoring(loss_fn=loss_fn):
                    q, d = (t.detach().requires_grad_(True) for t in scoring_args[:2])
                    out = loss_fn.score_metric(q, d, *scoring_args[2:])
                    out.backward(torch.ones_like(out))

                first[backend] = step().item()
                steps[backend], scorings[backend] = (backend_env(backend), step), (backend_env(backend), scoring)
        model.load_state_dict(initial)
        ms_step = interleaved_ms(steps, device, size["reps"])
        ms_score = interleaved_ms(scorings, device, size["reps"])
        loss_ref = first.get("torch", next(iter(first.values()), 0.0))
        for backend in steps:
            rows.append(dict(client="pylate", task=task, backend=backend, ms=ms_step[backend],
                             scoring_ms=ms_score[backend], scoring_share=ms_score[backend] / ms_step[backend],
                             loss_diff=abs(first[backend] - loss_ref) / max(1.0, abs(loss_ref))))
    rows += pylate_rerank(ip, rank, pc, size, device, dtype, backends)
    return rows


def pylate_rerank(ip, rank, pc, size, device, dtype, backends) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    nq, nc, d = size["rerank_queries"], size["candidates"], size["dim"]
    unit = torch.nn.functional.normalize
    queries = unit(torch.randn(nq, size["lq"], d, generator=g), dim=-1)
    docs = [[unit(torch.randn(int(n), d, generator=g), dim=-1)
             for n in torch.randint(size["ld"] // 2, size["ld"] + 1, (nc,), generator=g)] for _ in range(nq)]
    ids = [list(range(nc))] * nq

    def on(dev, dt):
        return ([q.to(dev, dt) for q in queries], [[x.to(dev, dt) for x in ds] for ds in docs])

    def rankings(qs, ds):
        return [[r["id"] for r in hits] for hits in rank.rerank(documents_ids=ids, queries_embeddings=qs,
                                                                documents_embeddings=ds)]

    exact = on(device, torch.float32)
    with env("PYLATE_SCORES_BACKEND", "torch"):
        reference = rankings(*exact)
    qs, ds = on(device, dtype)
    padded = [torch.nn.utils.rnn.pad_sequence(x, batch_first=True) for x in ds]
    @contextlib.contextmanager
    def using(backend):
        ours = backend == "maxsim"
        with env("PYLATE_SCORES_BACKEND", None if ours else backend):
            if ours:
                ip.use_in_pylate()
            try:
                yield
            finally:
                if ours:
                    ip.unuse_in_pylate()

    rows, same, reranks, scorings = [], {}, {}, {}
    for backend in backends:
        with failures_recorded(rows, "pylate", f"rerank-{nc}", backend), using(backend):
            same[backend] = rankings(*exact) == reference
            reranks[backend] = (lambda b=backend: using(b), lambda: rankings(qs, ds))
            scorings[backend] = (lambda b=backend: using(b),
                                 lambda: [pc.colbert_scores(q[None], D) for q, D in zip(qs, padded)])
    ms_rerank = interleaved_ms(reranks, device, size["reps"])
    ms_score = interleaved_ms(scorings, device, size["reps"])
    for backend in reranks:
        rows.append(dict(client="pylate", task=f"rerank-{nc}", backend=backend, ms=ms_rerank[backend],
                         scoring_ms=ms_score[backend], scoring_share=ms_score[backend] / ms_rerank[backend],
                         same_ranking=same[backend]))
    return rows


# ---------------------------------------------------------------------------
# colpali-engine
# ---------------------------------------------------------------------------

class PageEncoder(torch.nn.Module):
    """A ColPali-style head on the encoder: projection to 128, L2
    normalisation, padding zeroed by the attention mask."""

    def __init__(self, folder: Path, dim: int):
        super().__init__()
        from transformers import BertModel

        self.bert = BertModel.from_pretrained(folder)
        self.proj = torch.nn.Linear(self.bert.config.hidden_size, dim)

    def forward(self, f):
        h = self.bert(**f).last_hidden_state
        return torch.nn.functional.normalize(self.proj(h), dim=-1) * f["attention_mask"][..., None].to(h.dtype)


def bench_colpali(ms, size, device, dtype, folder: Path) -> list[dict]:
    import_colpali_scoring()
    from colpali_engine.loss.late_interaction_losses import ColbertPairwiseNegativeCELoss
    from colpali_engine.utils import maxsim as cm
    from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor

    ic = ms.integrations.colpali
    torch.manual_seed(0)
    encoder = PageEncoder(folder, size["dim"]).to(device, dtype)
    initial = {k: v.clone() for k, v in encoder.state_dict().items()}
    g = torch.Generator().manual_seed(3)
    B, K = size["colpali_batch"], size["colpali_negatives"]
    q_in, p_in = features(B, size["lq"], device, g), features(B, size["page"], device, g)
    n_in = features(B * K, size["page"], device, g)
    with torch.no_grad():
        Q, P, Nn = encoder(q_in), encoder(p_in), encoder(n_in).view(B, K, size["page"], -1)
    loss_fn = ColbertPairwiseNegativeCELoss()

    unit = torch.nn.functional.normalize
    qs = [unit(torch.randn(int(n), size["dim"], generator=g), dim=-1)
          for n in torch.randint(size["lq"] // 2, size["lq"] + 1, (size["colpali_queries"],), generator=g)]
    ps = [unit(torch.randn(int(n), size["dim"], generator=g), dim=-1)
          for n in torch.randint(3 * size["page"] // 4, size["page"] + 1, (size["pages"],), generator=g)]

    def retrieve(dt):
        return BaseVisualRetrieverProcessor.score_multi_vector([q.to(dt) for q in qs], [p.to(dt) for p in ps],
                                                               device=device)

    with env("COLPALI_SCORES_BACKEND", "torch"):
        reference = retrieve(torch.float32).argsort(dim=1, descending=True, stable=True)
    @contextlib.contextmanager
    def using(backend):
        ours = backend == "maxsim"
        with env("COLPALI_SCORES_BACKEND", None if ours else backend):
            if ours:
                ic.use_in_colpali()
            try:
                yield
            finally:
                if ours:
                    ic.unuse_in_colpali()

    def scoring():  # the calls the loss routes through the backend
        q, p, n = (t.detach().requires_grad_(True) for t in (Q, P, Nn))
        (cm.maxsim_kd(q, n).sum() + cm.maxsim_inbatch(q, p).sum()).backward()

    rows, first, same = [], {}, {}
    steps, scorings, retrievals = {}, {}, {}
    task = f"retrieve-{size['pages']}-pages"
    for backend in (b for b in ("torch", "lik", "maxsim") if available(b, device)):
        with failures_recorded(rows, "colpali", "train-pairwise-negative", backend), using(backend):
            encoder.load_state_dict(initial)
            opt = torch.optim.AdamW(encoder.parameters(), lr=1e-5)

            def step(opt=opt):
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(encoder(q_in), encoder(p_in), encoder(n_in).view(B, K, size["page"], -1))
                loss.backward()
                opt.step()
                return loss

            first[backend] = step().item()
            steps[backend] = (lambda b=backend: using(b), step)
            scorings[backend] = (lambda b=backend: using(b), scoring)
        with failures_recorded(rows, "colpali", task, backend), using(backend):
            same[backend] = torch.equal(retrieve(torch.float32).argsort(dim=1, descending=True, stable=True),
                                        reference)
            retrievals[backend] = (lambda b=backend: using(b), lambda: retrieve(dtype))
    encoder.load_state_dict(initial)
    ms_step = interleaved_ms(steps, device, size["reps"])
    ms_score = interleaved_ms(scorings, device, size["reps"])
    loss_ref = first.get("torch", next(iter(first.values()), 0.0))
    for backend in steps:
        rows.append(dict(client="colpali", task="train-pairwise-negative", backend=backend, ms=ms_step[backend],
                         scoring_ms=ms_score[backend], scoring_share=ms_score[backend] / ms_step[backend],
                         loss_diff=abs(first[backend] - loss_ref) / max(1.0, abs(loss_ref))))
    ms_ret = interleaved_ms(retrievals, device, max(3, size["reps"] // 4))
    for backend in retrievals:
        rows.append(dict(client="colpali", task=task, backend=backend, ms=ms_ret[backend], same_ranking=same[backend]))
    return rows


# ---------------------------------------------------------------------------

def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else f"cpu-{platform.machine()}"


def print_table(rows):
    print(f"{'client':8} {'task':26} {'backend':8} {'ms':>10} {'scoring ms':>11} {'share':>6} "
          f"{'loss diff':>9} {'ranking':>8}")
    for r in rows:
        def cell(key, width, fmt):
            return format(r[key], fmt) if r.get(key) is not None else "-".rjust(width)

        ranking = "-" if "same_ranking" not in r else "same" if r["same_ranking"] else "DIFFERS"
        print(f"{r['client']:8} {r['task']:26} {r['backend']:8} {cell('ms', 10, '10.3f')} "
              f"{cell('scoring_ms', 11, '11.3f')} {cell('scoring_share', 6, '6.2f')} "
              f"{cell('loss_diff', 9, '9.1e')} {ranking:>8}" + (f"  FAILED {r['error']}" if "error" in r else ""))


def chart(rows, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys((r["client"], r["task"]) for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3.6), squeeze=False)
    for ax, (client, task) in zip(axes[0], tasks):
        sel = [r for r in rows if (r["client"], r["task"]) == (client, task)]
        x = range(len(sel))
        ax.bar(x, [r.get("ms") or 0 for r in sel], color="#9ecae1", label="whole call")
        ax.bar(x, [r.get("scoring_ms") or 0 for r in sel], color="#3182bd", label="scoring alone")
        ax.set_xticks(list(x), [r["backend"] for r in sel], rotation=30)
        ax.set_title(f"{client}\n{task}", fontsize=9)
        ax.set_ylabel("ms")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU)")
    ap.add_argument("--dtype", choices=DTYPES, default=None,
                    help="model and embedding dtype (default bf16 on a GPU, fp32 on the CPU)")
    ap.add_argument("--only", choices=("pylate", "colpali"), default=None)
    ap.add_argument("--out", default=None, help="JSON path (default bench_results/<device>-clients.json)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    size = SIZES["smoke" if args.smoke else "full"]
    ms = load_maxsim()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = encoder_dir(Path(tmp), size)
        if args.only in (None, "pylate"):
            rows += bench_pylate(ms, size, device, dtype, folder)
        if args.only in (None, "colpali"):
            rows += bench_colpali(ms, size, device, dtype, folder)
    print_table(rows)
    name = device_name(device)
    commit = os.environ.get("MAXSIM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    meta = dict(gpu=name, torch=torch.__version__, date=datetime.date.today().isoformat(), commit=commit,
                dtype=str(dtype).removeprefix("torch."), smoke=args.smoke, sizes=size,
                pylate=version("pylate"), colpali_engine=version("colpali-engine"), transformers=version("transformers"),
                python=sys.version.split()[0])
    out = Path(args.out or ROOT / "bench_results" / f"{name.lower().replace(' ', '-')}-clients.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    chart(rows, out.with_suffix(".png"), f"{name}, {meta['dtype']}, torch {torch.__version__}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
