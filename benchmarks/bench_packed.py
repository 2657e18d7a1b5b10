"""Packed pairs against the padded layouts on the same tokens.

``score_pairs_packed`` (queries and documents as packed ragged tokens plus
offsets, an explicit pair list) against the padded entry point of the same
workload: ``score_candidates_padded`` for per-query candidates and
``maxsim`` for one query x shared documents. Two cases per workload:

- ``dense``: every document at the padded length (the padded-equivalent
  workload: the packed path pays only its pair list and offsets);
- ``ragged``: document lengths uniform in [1, Ld]; the padded side keeps
  the [.., Ld, d] tensor and passes the lengths (candidates) or a mask
  (shared documents), the packed side holds only the real tokens.

Every output is compared with an fp64 reference on all pairs first.

    python benchmarks/bench_packed.py [--out FILE]

Writes ``bench_results/<gpu>-packed.json``: rows ``{"workload", "case",
"impl": "padded" | "packed", "ms", "graph_ms", "tokens", "relerr"}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import eager_ms, graph_ms, load_maxsim, write_results  # noqa: E402

# name: (kind, B or Nq, K or Nd, Lq, Ld)
WORKLOADS = {
    "Rerank": ("candidates", 32, 50, 32, 180),
    "HeavyRerank": ("candidates", 32, 100, 32, 256),
    "rerank-short": ("shared", 1, 1000, 32, 300),
    "rerank-long": ("shared", 1, 1000, 32, 1024),
}
DIM = 128


def reference(Q, D, dlen):
    """fp64 scores [B, K] of Q [B, Lq, d] against D [B, K, Ld, d] with doc lengths [B, K]."""
    out = []
    valid = torch.arange(D.shape[2], device=D.device) < dlen[..., None]  # [B, K, Ld]
    for b in range(Q.shape[0]):
        s = torch.einsum("id,kjd->kij", Q[b].double(), D[b].double())
        s = s.masked_fill(~valid[b][:, None, :], float("-inf")).amax(-1)
        out.append(torch.where(torch.isinf(s), 0.0, s).sum(-1))
    return torch.stack(out)


def build_case(kind, n, k, lq, ld, ragged, gen):
    q = torch.nn.functional.normalize(torch.randn(n, lq, DIM, device="cuda", generator=gen), dim=-1)
    q = q.to(torch.bfloat16)
    nb = n if kind == "candidates" else 1
    D = torch.randn(nb, k, ld, DIM, device="cuda", generator=gen)
    D = torch.nn.functional.normalize(D, dim=-1).to(torch.bfloat16)
    if ragged:
        dlen = torch.randint(1, ld + 1, (nb, k), device="cuda", generator=gen)
    else:
        dlen = torch.full((nb, k), ld, device="cuda")
    valid = torch.arange(ld, device="cuda") < dlen[..., None]
    docs = D[valid]  # packed real tokens, pair order
    doc_off = torch.cat([dlen.new_zeros(1), dlen.flatten().cumsum(0)])
    q_off = torch.arange(n + 1, device="cuda") * lq
    qp = q.reshape(n * lq, DIM)
    if kind == "candidates":
        pair_q = torch.arange(n, device="cuda").repeat_interleave(k)
        pair_d = torch.arange(n * k, device="cuda")
    else:
        pair_q = torch.zeros(k, dtype=torch.long, device="cuda")
        pair_d = torch.arange(k, device="cuda")
    ref = reference(q if kind == "candidates" else q[:1], D, dlen).flatten()
    return q, D, dlen, valid, qp, q_off, docs, doc_off, pair_q, pair_d, ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ms = load_maxsim()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, torch {torch.__version__}")
    print(f"{'workload':<14} {'case':<7} {'impl':<7} {'ms':>8} {'graph ms':>9} {'tokens':>9} {'relerr':>9}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (kind, n, k, lq, ld) in WORKLOADS.items():
        for case in ("dense", "ragged"):
            q, D, dlen, valid, qp, q_off, docs, doc_off, pair_q, pair_d, ref = build_case(
                kind, n, k, lq, ld, case == "ragged", gen)
            if kind == "candidates":
                lens = None if case == "dense" else dlen
                padded = lambda: ms.score_candidates_padded(q, D, None, lens)  # noqa: E731
            else:
                Dk, mask = D[0], (None if case == "dense" else valid[0])
                padded = lambda: ms.maxsim(q, Dk, None, mask)[0]  # noqa: E731
            packed = lambda: ms.score_pairs_packed(qp, q_off, docs, doc_off, pair_q, pair_d,  # noqa: E731
                                                   max_query_length=lq)
            for impl, fn, ntok in (("padded", padded, D[0].numel() // DIM * D.shape[0]),
                                   ("packed", packed, docs.shape[0])):
                out = fn().flatten().double()
                relerr = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                if not relerr < 1e-2:
                    raise SystemExit(f"{name} {case} {impl}: relative error {relerr:.2e}")
                r = dict(workload=name, case=case, impl=impl, dtype="bf16", ms=eager_ms(fn), graph_ms=graph_ms(fn),
                         tokens=int(ntok), relerr=relerr)
                rows.append(r)
                g = "-" if r["graph_ms"] is None else f"{r['graph_ms']:.4f}"
                print(f"{name:<14} {case:<7} {impl:<7} {r['ms']:8.4f} {g:>9} {ntok:9d} {relerr:9.1e}", flush=True)
    write_results(rows, args.out, "-packed")


if __name__ == "__main__":
    main()
