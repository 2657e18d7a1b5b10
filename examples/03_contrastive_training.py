"""In-batch contrastive (InfoNCE) training of a small token encoder through
``score_contrastive_train``, side by side with a pure-PyTorch MaxSim scorer
on the same data and initial weights: the two loss curves should agree step
for step (up to the input dtype's rounding).

    python examples/03_contrastive_training.py [--steps 60] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("LOCAL_KERNELS", f"maxsim-kernels/maxsim={ROOT}")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_maxsim():
    import kernels

    return kernels.get_kernel("maxsim-kernels/maxsim", version=1, trust_remote_code=True)


class Encoder(torch.nn.Module):
    """Token embeddings + a small MLP, L2-normalised per token (ColBERT-style)."""

    def __init__(self, vocab=512, hidden=64, dim=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))

    def forward(self, tokens):
        return F.normalize(self.mlp(self.emb(tokens)), dim=-1)


_SYNONYM = torch.randperm(512, generator=torch.Generator().manual_seed(1234))


def make_batch(gen, batch=16, lq=12, vocab=512):
    """Queries are random token sets; each positive document contains
    *synonyms* (a fixed permutation of the vocabulary) of half its query's
    tokens among random distractors, with a ragged length. The encoder must
    learn that a token and its synonym match."""
    q = torch.randint(0, vocab, (batch, lq), generator=gen)
    docs, lens = [], []
    for b in range(batch):
        ld = int(torch.randint(lq + 4, 3 * lq, (1,), generator=gen))
        d = torch.randint(0, vocab, (ld,), generator=gen)
        pos = torch.randperm(ld, generator=gen)[: lq // 2]
        d[pos] = _SYNONYM[q[b, : lq // 2]]
        docs.append(d)
        lens.append(ld)
    offsets = torch.tensor([0] + lens).cumsum(0)
    return q, torch.cat(docs), offsets


def reference_scores(Q, D_tokens, offsets):
    """Plain PyTorch MaxSim over packed documents (the full similarity grid)."""
    out = []
    for b in range(offsets.numel() - 1):
        d = D_tokens[offsets[b]: offsets[b + 1]]
        out.append(torch.einsum("qid,jd->qij", Q.float(), d.float()).amax(-1).sum(-1))
    return torch.stack(out, dim=1)


def train(scorer: str, steps=40, device="cpu", dtype=torch.float32, seed=0, log=None):
    """Returns the loss per step. ``scorer`` is "maxsim" or "reference"."""
    torch.manual_seed(seed)
    model = Encoder().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    ms = load_maxsim() if scorer == "maxsim" else None
    losses = []
    for step in range(steps):
        q, d, offsets = make_batch(gen)
        q, d, offsets = q.to(device), d.to(device), offsets.to(device)
        Q = model(q).to(dtype)
        D = model(d).to(dtype)
        if ms is not None:
            scores = ms.score_contrastive_train(Q, D, offsets)
        else:
            scores = reference_scores(Q, D, offsets)
        loss = F.cross_entropy(scores / 0.05, torch.arange(Q.shape[0], device=device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log and (step % 10 == 0 or step == steps - 1):
            log(step, loss.item())
    return losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16" if torch.cuda.is_available() else "fp32")
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    print(f"training on {args.device} ({args.dtype}), {args.steps} steps of 16 queries x 16 in-batch documents")
    curves = {}
    for scorer in ("maxsim", "reference"):
        print(f"-- {scorer}")
        curves[scorer] = train(scorer, args.steps, args.device, dtype,
                               log=lambda s, l: print(f"   step {s:3d}  loss {l:.4f}", flush=True))
    diff = max(abs(a - b) for a, b in zip(curves["maxsim"], curves["reference"]))
    print(f"loss: {curves['maxsim'][0]:.3f} -> {curves['maxsim'][-1]:.3f}; "
          f"max |maxsim - reference| over the curve: {diff:.2e}")
    return 0 if curves["maxsim"][-1] < curves["maxsim"][0] else 1


if __name__ == "__main__":
    sys.exit(main())
