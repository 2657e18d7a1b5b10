"""How much top-k agreement 8-bit storage can keep, whatever the kernel.

Scores random unit tokens (the search bench's "random" data, corpus-10k
shape by default) exactly in fp32 on the CPU with each side's tokens either
exact or quantised by `quantize_tokens` (int8 / fp8 per token, fp8 one scale
per document), and reports the top-10 / top-100 agreement with the exact
ranking of the bf16 tokens. Separates the documents' rounding (what a stored
corpus costs) from the queries' (what the scan's query quantisation costs).

    python benchmarks/agreement_bound.py [--docs 10000] [--out bench_results/agreement-bound-cpu.json]
"""
import argparse
import datetime
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def unit(*shape, gen):
    x = torch.randn(*shape, generator=gen)
    return (x / x.norm(dim=-1, keepdim=True)).bfloat16().float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=10000)
    ap.add_argument("--doc-len", type=int, default=300)
    ap.add_argument("--query-len", type=int, default=32)
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "agreement-bound-cpu.json"))
    a = ap.parse_args()

    import kernels
    ms = kernels.get_local_kernel(ROOT)
    g = torch.Generator().manual_seed(0)
    N, Ld, d = a.docs, a.doc_len, a.dim
    D = unit(N, Ld, d, gen=g)
    Q = unit(a.queries, a.query_len, d, gen=g)

    def deq(x, kind, per_doc=False):
        flat = x.reshape(-1, d)
        given = None
        if per_doc:  # the scales Corpus(scale_layout="document") stores
            n, L = x.shape[0], x.shape[1]
            given = ms.quantization.doc_scales(flat, torch.arange(n) * L, torch.full((n,), L), flat.device, flat.shape[0],
                                             kind)
        v, s = ms.quantize_tokens(flat, kind, given)
        return (v[:, :d].float() * s[:, None]).reshape(x.shape)

    def scores(q, docs):
        out = torch.empty(q.shape[0], N)
        for s in range(0, N, 500):
            out[:, s:s + 500] = torch.einsum("qid,njd->qnij", q, docs[s:s + 500]).amax(-1).sum(-1)
        return out

    def agree(ref, got, k):
        k = min(k, N)
        hit = 0
        for x, y in zip(ref.topk(k, dim=1).indices, got.topk(k, dim=1).indices):
            hit += len(set(x.tolist()) & set(y.tolist()))
        return hit / (k * ref.shape[0])

    t0 = time.time()
    ref = scores(Q, D)
    Dq8, Df8, Df8d = deq(D, "int8"), deq(D, "fp8"), deq(D, "fp8", per_doc=True)
    Qq8, Qf8 = deq(Q, "int8"), deq(Q, "fp8")
    cases = [
        ("int8", "int8", "per token", scores(Qq8, Dq8)),
        ("int8", "exact", "per token", scores(Q, Dq8)),
        ("exact", "int8", "per token", scores(Qq8, D)),
        ("fp8", "fp8", "per token", scores(Qf8, Df8)),
        ("fp8", "exact", "per token", scores(Q, Df8)),
        ("fp8", "exact", "per document", scores(Q, Df8d)),
    ]
    rows = []
    print(f"{N} documents x {Ld} tokens, {a.queries} queries x {a.query_len} tokens, d {d}, random unit bf16 tokens "
          f"({time.time() - t0:.0f} s)")
    print(f"{'documents':>9} {'queries':>8} {'doc scales':>12} {'top-10':>7} {'top-100':>8} {'mean rel err':>13}")
    for dk, qk, layout, s in cases:
        row = dict(documents=dk, queries=qk, doc_scales=layout, top10=agree(ref, s, 10), top100=agree(ref, s, 100),
                   mean_relerr=((s - ref).abs() / ref.abs()).mean().item())
        rows.append(row)
        print(f"{dk:>9} {qk:>8} {layout:>12} {row['top10']:7.4f} {row['top100']:8.4f} {row['mean_relerr']:13.1e}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    meta = dict(device=f"CPU ({platform.machine()})", torch=torch.__version__, date=str(datetime.date.today()),
                commit=commit, docs=N, doc_len=Ld, queries=a.queries, query_len=a.query_len, dim=d)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
