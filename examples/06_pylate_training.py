"""Train a small ColBERT with PyLate's own trainer, once with PyLate's scoring
and once with maxsim's, then retrieve with PyLate's rank API.

No download: the encoder is a 4-layer, 384-wide BERT with random weights and
the tokenizer a WordPiece vocabulary trained here on the generated corpus. The
corpus is made of topics (each a set of words); a query is a few words of its
document, a negative a document of another topic. Training runs PyLate's
``Contrastive`` loss (query, positive, negative), then its ``Distillation``
loss on teacher scores (word overlap). maxsim enters through the losses'
``score_metric`` argument (no patching) and, for ``rank.rerank``, which has no
such argument, through ``use_in_pylate()``.

Prints the loss of every step for both runs, their largest difference, the
retrieval quality (MRR@10, recall@10) of each trained model, and whether
PyLate's rerank gives the same rankings with its scoring and with maxsim's.
PyLate's side uses its exact fp32 ``torch`` backend unless
``--pylate-backend`` names another (on a GPU its ``auto`` picks flash-maxsim
or late-interaction-kernels when installed).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("LOCAL_KERNELS", f"maxsim-kernels/maxsim={ROOT}")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import kernels  # noqa: E402

maxsim = kernels.get_kernel("maxsim-kernels/maxsim", version=1, trust_remote_code=True)
ip = maxsim.integrations.pylate
maxsim.integrations.import_transformers()  # before PyLate: see there
from datasets import Dataset  # noqa: E402
from pylate import losses, models, rank, utils  # noqa: E402
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

QUERY_LENGTH, DOCUMENT_LENGTH = 32, 64


def make_corpus(n_docs: int, seed: int = 0):
    """Documents of ``topics`` with a few shared filler words; each document's
    query is four of its topic words."""
    rng = random.Random(seed)
    n_topics = max(8, n_docs // 4)
    topics = [[f"w{t}x{k}" for k in range(12)] for t in range(n_topics)]
    filler = [f"f{k}" for k in range(40)]
    docs, queries, topic_of = [], [], []
    for i in range(n_docs):
        t = i % n_topics
        words = rng.sample(topics[t], 8) + rng.sample(filler, 8) + [f"id{i}"]
        rng.shuffle(words)
        docs.append(" ".join(words))
        queries.append(" ".join(rng.sample([w for w in words if not w.startswith("f")], 4)))
        topic_of.append(t)
    return docs, queries, topic_of


def build_encoder(path: Path, texts: list[str], hidden: int = 384, layers: int = 4, seed: int = 0) -> None:
    """A random-weight BERT and a WordPiece tokenizer trained on ``texts``,
    saved where ``models.ColBERT(model_name_or_path=...)`` loads them."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(texts, vocab_size=2000, min_frequency=1,
                                  special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[Q]", "[D]"])
    path.mkdir(parents=True, exist_ok=True)
    BertTokenizerFast(vocab=wordpiece.get_vocab(), do_lower_case=True).save_pretrained(path)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=wordpiece.get_vocab_size(), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=hidden // 64, intermediate_size=4 * hidden, max_position_embeddings=128,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    BertModel(config).save_pretrained(path)


def load_colbert(path: Path, device: str, seed: int = 0):
    torch.manual_seed(seed)  # the projection layer PyLate adds is initialised here
    return models.ColBERT(model_name_or_path=str(path), device=device, embedding_size=128,
                          query_prefix="[Q] ", document_prefix="[D] ",
                          query_length=QUERY_LENGTH, document_length=DOCUMENT_LENGTH)


class LossLog(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def train(model, loss, dataset, steps: int, batch_size: int, out: str, seed: int = 0) -> list[float]:
    log = LossLog()
    args = SentenceTransformerTrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=3e-4,
        warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[], seed=seed, data_seed=seed,
        dataloader_num_workers=0, disable_tqdm=True, use_cpu=model.device.type == "cpu")
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss,
                                         data_collator=utils.ColBERTCollator(model.tokenize), callbacks=[log])
    trainer.train()
    return log.losses


def datasets(docs, queries, topic_of, n_negatives: int, seed: int = 0):
    rng = random.Random(seed)
    n = len(docs)

    def negative(i):
        while True:
            j = rng.randrange(n)
            if topic_of[j] != topic_of[i]:
                return j

    contrastive = Dataset.from_dict({"query": queries, "positive": docs,
                                     "negative": [docs[negative(i)] for i in range(n)]})
    rows = {"query": [], "documents": [], "scores": []}
    for i in range(n):
        ids = [i] + [negative(i) for _ in range(n_negatives)]
        qwords = set(queries[i].split())
        rows["query"].append(queries[i])
        rows["documents"].append([docs[j] for j in ids])
        rows["scores"].append([float(len(qwords & set(docs[j].split()))) for j in ids])
    return contrastive, Dataset.from_dict(rows)


def pylate_backend(name: str) -> None:
    """PyLate's ``PYLATE_SCORES_BACKEND``: while ``use_in_pylate()`` is on,
    ``auto`` is maxsim and an explicit backend PyLate's own code."""
    os.environ["PYLATE_SCORES_BACKEND"] = name


def run(scoring: str, encoder: Path, data, args, device: str, out: str):
    """Contrastive then distillation training with ``scoring`` ("pylate" or
    "maxsim") in the losses -> (trained model, loss per step, seconds)."""
    contrastive, distillation = data
    model = load_colbert(encoder, device)
    ours = scoring == "maxsim"
    t = time.perf_counter()
    pylate_backend("auto" if ours else args.pylate_backend)
    curve = train(model, losses.Contrastive(model, score_metric=ip.ColBERTScores() if ours else None),
                  contrastive, args.steps, args.batch_size, out)
    kd = losses.Distillation(model, score_metric=ip.colbert_kd_scores) if ours else losses.Distillation(model)
    curve += train(model, kd, distillation, args.steps, args.batch_size, out)
    return model, curve, time.perf_counter() - t


def encode(model, docs, queries):
    with torch.no_grad():
        d = model.encode(docs, is_query=False, batch_size=64, convert_to_tensor=False)
        q = model.encode(queries, is_query=True, batch_size=64, convert_to_tensor=False)
    return q, d


def retrieve(q, d, k: int = 10):
    """Every document a candidate of every query, ranked by PyLate's rerank."""
    ids = [list(range(len(d)))] * len(q)
    return [[r["id"] for r in hits[:k]] for hits in rank.rerank(documents_ids=ids, queries_embeddings=q,
                                                                 documents_embeddings=[d] * len(q))]


def quality(rankings, k: int = 10):
    mrr = sum(1.0 / (r.index(i) + 1) for i, r in enumerate(rankings) if i in r[:k]) / len(rankings)
    recall = sum(i in r[:k] for i, r in enumerate(rankings)) / len(rankings)
    return mrr, recall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=512)
    ap.add_argument("--steps", type=int, default=150, help="per loss (contrastive, then distillation)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--negatives", type=int, default=7, help="per query, for distillation")
    ap.add_argument("--hidden", type=int, default=384, help="encoder width (a multiple of 64)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pylate-backend", default="torch", choices=("torch", "auto", "flash", "lik"),
                    help="PyLate's scoring in the run compared with maxsim (torch: its exact fp32 path)")
    ap.add_argument("--ci", action="store_true", help="a small size for the CPU in CI")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.ci:
        args.docs, args.steps, args.batch_size, args.negatives, args.hidden, args.layers = 48, 6, 8, 3, 64, 2
    docs, queries, topic_of = make_corpus(args.docs)
    data = datasets(docs, queries, topic_of, args.negatives)
    with tempfile.TemporaryDirectory() as tmp:
        encoder = Path(tmp) / "encoder"
        build_encoder(encoder, docs + queries, args.hidden, args.layers)
        runs = {s: run(s, encoder, data, args, args.device, tmp) for s in ("pylate", "maxsim")}
    (_, own, t_own), (model, ours, t_ours) = runs["pylate"], runs["maxsim"]
    print(f"{len(own)} steps, batch {args.batch_size}, {args.docs} documents, encoder {args.layers} x {args.hidden}, "
          f"device {args.device}, PyLate backend {args.pylate_backend}")
    print("step  loss(pylate)  loss(maxsim)")
    for step, (a, b) in enumerate(zip(own, ours)):
        print(f"{step:4d}  {a:12.6f}  {b:12.6f}")
    print(f"max loss difference {max(abs(a - b) / max(1.0, abs(a)) for a, b in zip(own, ours)):.2e}")
    print(f"training time pylate {t_own:.1f} s, maxsim {t_ours:.1f} s")
    for name, (m, _, _) in runs.items():
        q, d = encode(m, docs, queries)
        pylate_backend(args.pylate_backend)
        own_rank = retrieve(q, d)
        ip.use_in_pylate()
        pylate_backend("auto")
        our_rank = retrieve(q, d)
        ip.unuse_in_pylate()
        mrr, recall = quality(own_rank)
        print(f"trained with {name}: MRR@10 {mrr:.3f} recall@10 {recall:.3f}; "
              f"rerank rankings identical with maxsim {our_rank == own_rank}")


if __name__ == "__main__":
    main()
