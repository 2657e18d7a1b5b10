"""Quickstart: rerank candidates and take one contrastive training step.

Runs on the GPU when there is one, else on the CPU. The package is loaded the
way users load it: ``kernels.get_kernel`` (here pointed at the local build
through ``LOCAL_KERNELS``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("LOCAL_KERNELS", f"maxsim-kernels/maxsim={ROOT}")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import kernels  # noqa: E402

maxsim = kernels.get_kernel("maxsim-kernels/maxsim", version=1, trust_remote_code=True)


def bench(fn, device, reps=10):
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, dtype: {dtype}")

    # --- rerank: 32 queries, 100 candidates each, ragged document lengths ----
    B, K, Lq, Ld, dim = 32, 100, 32, 256, 128
    Q = torch.nn.functional.normalize(torch.randn(B, Lq, dim, device=device), dim=-1).to(dtype)
    D = torch.nn.functional.normalize(torch.randn(B, K, Ld, dim, device=device), dim=-1).to(dtype)
    doc_lengths = torch.randint(Ld // 2, Ld + 1, (B, K), device=device)
    scores = maxsim.score_candidates_padded(Q, D, None, doc_lengths)
    top = scores.topk(5, dim=1)
    print(f"rerank [B={B}, K={K}, Lq={Lq}, Ld={Ld}, d={dim}] -> scores {tuple(scores.shape)}")
    print(f"  query 0 top-5 candidates: {top.indices[0].tolist()}  scores {[round(v, 3) for v in top.values[0].tolist()]}")
    mask = torch.arange(Ld, device=device) < doc_lengths[..., None]
    ref = maxsim.maxsim_reference(Q, D, None, mask)
    err = ((scores.double() - ref).norm() / ref.norm()).item()
    print(f"  relative error vs fp64 reference: {err:.2e}")

    def naive():
        s = torch.einsum("bid,bkjd->bkij", Q, D).float()
        s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
        return s.amax(-1).sum(-1)

    t_ours = bench(lambda: maxsim.score_candidates_padded(Q, D, None, doc_lengths), device)
    t_naive = bench(naive, device)
    print(f"  maxsim {t_ours:.3f} ms   naive einsum {t_naive:.3f} ms   ({t_naive / t_ours:.1f}x)")

    # --- one in-batch contrastive (InfoNCE) training step --------------------
    Nq, Nb, Ld2 = 16, 16, 80
    q = torch.randn(Nq, Lq, dim, device=device, dtype=dtype, requires_grad=True)
    lens = torch.randint(20, Ld2 + 1, (Nb,), device=device)
    offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    docs = torch.randn(int(offsets[-1]), dim, device=device, dtype=dtype, requires_grad=True)
    s = maxsim.score_contrastive_train(torch.nn.functional.normalize(q, dim=-1),
                                       torch.nn.functional.normalize(docs, dim=-1), offsets)
    loss = torch.nn.functional.cross_entropy(s / 0.05, torch.arange(Nq, device=device))
    loss.backward()
    print(f"contrastive step: scores {tuple(s.shape)}, loss {loss.item():.4f}, "
          f"|grad q| {q.grad.float().norm():.4f}, |grad docs| {docs.grad.float().norm():.4f}")


if __name__ == "__main__":
    main()
