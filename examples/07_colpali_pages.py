"""ColPali-style page retrieval with colpali-engine's own scoring and losses,
once with colpali's MaxSim and once with maxsim's (``use_in_colpali()``).

No model is downloaded: pages are random multi-vector embeddings of about
1024 tokens (a ColPali page is 1030 patch and text tokens, dimension 128) and
each query is built from some of its page's tokens (see ``make_pages``), so
every query has one right page. A small trainable head (a linear map applied to every token, then
L2-normalised and multiplied by the attention mask, as colpali models do)
is trained with colpali's ``ColbertPairwiseNegativeCELoss`` (hard negatives)
and ``ColbertLoss`` (in-batch); pages are then ranked with
``BaseVisualRetrieverProcessor.score_multi_vector``.

Prints both loss curves and their largest difference, the time of each
training run and of the retrieval, recall@1 before and after training, and
whether the rankings are identical.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("LOCAL_KERNELS", f"maxsim-kernels/maxsim={ROOT}")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import kernels  # noqa: E402

maxsim = kernels.get_kernel("maxsim-kernels/maxsim", version=1, trust_remote_code=True)
ic = maxsim.integrations.colpali
maxsim.integrations.import_transformers()  # before colpali-engine: see there
from colpali_engine.loss.late_interaction_losses import ColbertLoss, ColbertPairwiseNegativeCELoss  # noqa: E402
from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor  # noqa: E402

DIM, SIGNAL = 128, 32


def make_pages(n_pages: int, page_tokens: int, query_tokens: int, device: str, seed: int = 0):
    """Pages ``[N, Lp, 128]`` zero-padded past their length (from 3/4 of
    ``page_tokens`` to all of it) with their masks, and one query per page,
    ``[N, Lq, 128]``: tokens of its page at random positions that keep the
    page's first ``SIGNAL`` dimensions (plus a little noise) while the other,
    larger ones are drawn afresh. An untrained head is misled by those; a
    trained one learns to project them out."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(DIM)
    scale[SIGNAL:] = 3.0
    pages = torch.randn(n_pages, page_tokens, DIM, generator=g) * scale
    lengths = torch.randint(3 * page_tokens // 4, page_tokens + 1, (n_pages,), generator=g)
    page_mask = torch.arange(page_tokens) < lengths[:, None]
    picks = (torch.rand(n_pages, query_tokens, generator=g) * lengths[:, None]).long()
    queries = pages.gather(1, picks[..., None].expand(-1, -1, DIM)).clone()
    queries[..., :SIGNAL] += 0.3 * torch.randn(n_pages, query_tokens, SIGNAL, generator=g)
    queries[..., SIGNAL:] = 3.0 * torch.randn(n_pages, query_tokens, DIM - SIGNAL, generator=g)
    query_mask = torch.ones(n_pages, query_tokens, dtype=torch.bool)
    query_mask[:, -query_tokens // 4:] = torch.rand(n_pages, 1, generator=g) < 0.5  # some shorter queries
    return (pages * page_mask[..., None]).to(device), page_mask.to(device), queries.to(device), query_mask.to(device)


class Head(torch.nn.Module):
    """What a ColPali model ends with: a projection, L2 normalisation, and
    the attention mask zeroing the padding."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(DIM, DIM)

    def forward(self, x, mask):
        return torch.nn.functional.normalize(self.proj(x), dim=-1) * mask[..., None]


def train(data, steps: int, batch_size: int, negatives: int, device: str, seed: int = 0):
    """Loss per step; the negatives of query i are the pages after i."""
    pages, page_mask, queries, query_mask = data
    n = pages.shape[0]
    torch.manual_seed(seed)
    head = Head().to(device)
    opt = torch.optim.Adam(head.parameters(), lr=2e-3)
    pairwise, inbatch = ColbertPairwiseNegativeCELoss(), ColbertLoss()
    g = torch.Generator().manual_seed(seed)
    curve = []
    for _ in range(steps):
        idx = torch.randperm(n, generator=g)[:batch_size]
        neg = (idx[:, None] + torch.arange(1, negatives + 1)) % n
        idx, neg = idx.to(device), neg.to(device)
        q = head(queries[idx], query_mask[idx])
        p = head(pages[idx], page_mask[idx])
        ng = head(pages[neg], page_mask[neg])
        loss = pairwise(q, p, ng) + inbatch(q, p)
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(loss.item())
    return head, curve


def page_lists(head, data):
    """Queries and pages as ragged lists of ``[L_i, 128]`` embeddings, as
    colpali's processors take them."""
    pages, page_mask, queries, query_mask = data
    with torch.no_grad():
        return ([t[m] for t, m in zip(head(queries, query_mask), query_mask)],
                [t[m] for t, m in zip(head(pages, page_mask), page_mask)])


def timed(fn, device):
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--page-tokens", type=int, default=1024)
    ap.add_argument("--query-tokens", type=int, default=24)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--negatives", type=int, default=3)
    ap.add_argument("--colpali-backend", default="torch", choices=("torch", "auto", "lik"),
                    help="colpali's scoring in the run compared with maxsim (torch: its exact fp32 path)")
    ap.add_argument("--ci", action="store_true", help="a small size for the CPU in CI")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.ci:
        args.pages, args.page_tokens, args.steps, args.batch_size, args.negatives = 48, 256, 12, 8, 2
    data = make_pages(args.pages, args.page_tokens, args.query_tokens, args.device)
    print(f"{args.pages} pages of <= {args.page_tokens} tokens, {args.steps} steps of batch {args.batch_size} "
          f"+ {args.negatives} negatives, device {args.device}, colpali backend {args.colpali_backend}")
    colpali_backend(args.colpali_backend)
    (head, own), t_own = timed(lambda: train(data, args.steps, args.batch_size, args.negatives, args.device),
                               args.device)
    ic.use_in_colpali()
    colpali_backend("auto")
    (_, ours), t_ours = timed(lambda: train(data, args.steps, args.batch_size, args.negatives, args.device),
                              args.device)
    ic.unuse_in_colpali()
    colpali_backend(args.colpali_backend)
    print("step  loss(colpali)  loss(maxsim)")
    for step, (a, b) in enumerate(zip(own, ours)):
        print(f"{step:4d}  {a:13.6f}  {b:12.6f}")
    print(f"max loss difference {max(abs(a - b) / max(1.0, abs(a)) for a, b in zip(own, ours)):.2e}")
    print(f"training time colpali {t_own:.2f} s, maxsim {t_ours:.2f} s")

    score = BaseVisualRetrieverProcessor.score_multi_vector
    untrained, _ = train(data, 0, args.batch_size, args.negatives, args.device)
    qs, ps = page_lists(untrained, data)
    recall_before = recall_at_1(score(qs, ps, batch_size=64, device=args.device))
    qs, ps = page_lists(head, data)
    ref, t_ref = timed(lambda: score(qs, ps, batch_size=64, device=args.device), args.device)
    ic.use_in_colpali()
    colpali_backend("auto")
    got, t_got = timed(lambda: score(qs, ps, batch_size=64, device=args.device), args.device)
    ic.unuse_in_colpali()
    k = min(10, args.pages)
    same = torch.equal(ref.topk(k).indices, got.topk(k).indices)
    print(f"retrieval time colpali {t_ref * 1e3:.1f} ms, maxsim {t_got * 1e3:.1f} ms")
    print(f"max score difference {((got - ref).abs().max() / ref.abs().max()).item():.2e}")
    print(f"recall@1 before training {recall_before:.3f}, after {recall_at_1(ref):.3f}; "
          f"top-{k} rankings identical {same}")


def colpali_backend(name: str) -> None:
    """colpali's ``COLPALI_SCORES_BACKEND``: while ``use_in_colpali()`` is on,
    ``auto`` is maxsim and ``torch`` / ``lik`` colpali's own code."""
    os.environ["COLPALI_SCORES_BACKEND"] = name


def recall_at_1(scores):
    return (scores.argmax(1) == torch.arange(scores.shape[0])).float().mean().item()


if __name__ == "__main__":
    main()
