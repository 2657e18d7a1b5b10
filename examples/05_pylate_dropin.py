"""PyLate drop-in: one call routes PyLate's scoring through maxsim.

``maxsim.integrations.pylate.use_in_pylate()`` replaces PyLate's
``colbert_scores`` (and what uses it: losses, ``rank.rerank``, evaluators).
This scores random ColBERT-style embeddings with PyLate's own functions and
with the patched ones, checks the results agree and times both paths.
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
ip = maxsim.integrations.pylate
ip.use_in_pylate()  # also imports transformers the way colpali/pylate need next to kernels
import pylate.rank  # noqa: E402
import pylate.scores  # noqa: E402


def timed(fn, device, reps=3):
    out = fn()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t) / reps * 1e3


def both(fn, device):
    """fn() with PyLate's own scoring, then with maxsim's -> (own, ms_own, ours, ms_ours)."""
    ip.unuse_in_pylate()
    own, t_own = timed(fn, device)
    ip.use_in_pylate()
    ours, t_ours = timed(fn, device)
    return own, t_own, ours, t_ours


def unit(*shape, device):
    return torch.nn.functional.normalize(torch.randn(*shape, device=device), dim=-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--docs", type=int, default=128)
    ap.add_argument("--candidates", type=int, default=32, help="per query, for rerank")
    ap.add_argument("--lq", type=int, default=32)
    ap.add_argument("--ld", type=int, default=180)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, fp32")

    # colbert_scores: every query against every (padded, masked) document.
    Q = unit(args.queries, args.lq, args.dim, device=device)
    D = unit(args.docs, args.ld, args.dim, device=device)
    d_mask = (torch.arange(args.ld, device=device) < torch.randint(args.ld // 4, args.ld + 1, (args.docs, 1),
                                                                     device=device)).float()
    own, t_own, ours, t_ours = both(lambda: pylate.scores.colbert_scores(Q, D, documents_mask=d_mask), device)
    # Reference: PyLate's own code on the CPU, exact IEEE fp32 (on a GPU its
    # matmul may run at reduced precision, e.g. TF32).
    ip.unuse_in_pylate()
    ref = pylate.scores.colbert_scores(Q.cpu(), D.cpu(), documents_mask=d_mask.cpu())
    ip.use_in_pylate()
    err = ((ours.cpu() - ref).abs().max() / ref.abs().max()).item()
    err_own = ((own.cpu() - ref).abs().max() / ref.abs().max()).item()
    print(f"colbert_scores [{args.queries} x {args.docs}, Lq {args.lq}, Ld {args.ld}]: maxsim vs PyLate on the "
          f"CPU (exact fp32): max relative difference {err:.1e} | PyLate on {device}: {err_own:.1e}")
    print(f"  PyLate {t_own:.2f} ms   maxsim {t_ours:.2f} ms   ({t_own / t_ours:.1f}x)")

    # rank.rerank: per query a list of ragged candidate documents (numpy, as PyLate's encoder returns).
    qs = [unit(args.lq, args.dim, device="cpu").numpy() for _ in range(args.queries)]
    ds = [[unit(int(n), args.dim, device="cpu").numpy() for n in torch.randint(8, args.ld + 1, (args.candidates,))]
          for _ in range(args.queries)]
    ids = [[f"q{i}-d{k}" for k in range(args.candidates)] for i in range(args.queries)]
    own, t_own, ours, t_ours = both(lambda: pylate.rank.rerank(ids, qs, ds, device=device), device)
    ip.unuse_in_pylate()
    ref = pylate.rank.rerank(ids, qs, ds, device="cpu")
    ip.use_in_pylate()

    def compare(a_lists, b_lists):
        same = all([r["id"] for r in a] == [r["id"] for r in b] for a, b in zip(a_lists, b_lists))
        diff = max(abs(x["score"] - y["score"]) for a, b in zip(a_lists, b_lists) for x, y in zip(a, b))
        return same, diff

    same, diff = compare(ours, ref)
    same_own, diff_own = compare(own, ref)
    print(f"rerank [{args.queries} queries x {args.candidates} candidates] vs PyLate on the CPU: maxsim same "
          f"order {same}, max score difference {diff:.1e} | PyLate on {device}: same order {same_own}, "
          f"{diff_own:.1e}")
    print(f"  PyLate {t_own:.2f} ms   maxsim {t_ours:.2f} ms   ({t_own / t_ours:.1f}x)")
    print(f"  query 0 top-3: {[(r['id'], round(r['score'], 3)) for r in ours[0][:3]]}")

if __name__ == "__main__":
    main()
