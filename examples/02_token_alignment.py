"""Token alignment: which document token each query token matched.

MaxSim scores a query by letting every query token pick its most similar
document token; ``score_contrastive_with_argmax`` returns those picks. Toy
embeddings from a small vocabulary (synonyms share a concept vector) make the
alignment readable. Prints it and saves the similarity heat-map with the picks
marked as a PNG (``--out``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("LOCAL_KERNELS", f"maxsim-kernels/maxsim={ROOT}")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import kernels  # noqa: E402

maxsim = kernels.get_kernel("maxsim-kernels/maxsim", version=1, trust_remote_code=True)

# word -> concept; words sharing a concept are synonyms and end up close.
CONCEPTS = {"cheap": "cost", "low-cost": "cost", "flights": "fly", "airline": "fly", "to": "to",
            "paris": "paris", "france": "paris", "tickets": "ticket", "in": "in", "spring": "spring",
            "book": "book", "reserve": "book", "hotel": "hotel"}
QUERY = "book cheap flights to paris".split()
DOC = "reserve low-cost airline tickets to france in spring".split()


def embed(words, dim=32, seed=0):
    """Unit vectors: the word's concept direction plus a little word-specific noise."""
    g = torch.Generator().manual_seed(seed)
    names = sorted(set(CONCEPTS.values()))
    basis = torch.linalg.qr(torch.randn(dim, len(names), generator=g))[0].T  # orthonormal concepts
    concept = dict(zip(names, basis))
    noise = {w: torch.randn(dim, generator=g) * 0.08 for w in sorted(CONCEPTS)}
    return torch.nn.functional.normalize(torch.stack([concept[CONCEPTS[w]] + noise[w] for w in words]), dim=-1)


def align(device="cpu"):
    """-> (similarity [Lq, Ld], MaxSim score, argmax [Lq]) from the kernel."""
    Q, D = embed(QUERY).to(device), embed(DOC).to(device)
    offsets = torch.tensor([0, len(DOC)], device=device)
    scores, argmax = maxsim.score_contrastive_with_argmax(Q[None], D, offsets)  # [1, 1], [1, 1, Lq]
    return (Q @ D.T).cpu(), scores[0, 0].item(), argmax[0, 0].cpu()


def plot(sim, argmax, out):
    import matplotlib

    matplotlib.use("Agg")  # headless: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1 + 0.8 * len(DOC), 1 + 0.6 * len(QUERY)))
    im = ax.imshow(sim, cmap="viridis", vmin=-1, vmax=1)
    ax.scatter(argmax, range(len(QUERY)), marker="s", s=250, facecolors="none", edgecolors="red", lw=2)
    ax.set_xticks(range(len(DOC)), DOC, rotation=45, ha="right")
    ax.set_yticks(range(len(QUERY)), QUERY)
    ax.set_xlabel("document token")
    ax.set_ylabel("query token")
    ax.set_title("red box: the document token each query token picks (argmax)", fontsize=9)
    fig.colorbar(im, ax=ax, label="cosine similarity")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "examples" / "out" / "02_alignment.png")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sim, score, argmax = align(device)
    print(f"query: {' '.join(QUERY)}\ndocument: {' '.join(DOC)}\nMaxSim score: {score:.4f}")
    for i, j in enumerate(argmax.tolist()):
        print(f"  {QUERY[i]:>10} -> {DOC[j]:<10} (doc token {j}, sim {sim[i, j]:.3f})")
    plot(sim, argmax, args.out)
    print(f"heat-map: {args.out}")


if __name__ == "__main__":
    main()
