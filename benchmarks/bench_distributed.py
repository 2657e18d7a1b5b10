"""Multi-GPU scaling of maxsim.distributed (NCCL): one contrastive training
step over a fixed global batch, and sharded corpus search, timed on however
many ranks torchrun starts. Rank 0 prints and appends rows to --out.

    python -m torch.distributed.run --nproc_per_node 1 benchmarks/bench_distributed.py --out r.json
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_distributed.py --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_search import timed as event_median  # noqa: E402


def timed(fn, reps=20, warmup=3):
    """Median CUDA-event ms on this rank, then the max over ranks (a step is
    as slow as its slowest rank)."""
    dist.barrier()
    t = torch.tensor([event_median(fn, reps=reps, warmup=warmup)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=256, help="global queries = global documents per step")
    ap.add_argument("--docs", type=int, default=1_000_000, help="global corpus size for search")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    import kernels

    ms = kernels.get_local_kernel(ROOT)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    rows = []
    dev = torch.device("cuda")

    # 1. contrastive step: the global batch split across ranks.
    B, Lq, Ld, d = args.batch, 32, 300, 128
    nb = B // world
    Q = torch.nn.functional.normalize(torch.randn(nb, Lq, d, device=dev, generator=gen), dim=-1)
    D = torch.nn.functional.normalize(torch.randn(nb, Ld, d, device=dev, generator=gen), dim=-1)
    Q = Q.to(torch.bfloat16).requires_grad_()
    D = D.to(torch.bfloat16).requires_grad_()
    labels = torch.arange(nb, device=dev) + rank * nb

    def step():
        s = ms.distributed.contrastive_scores(Q, D)
        loss = torch.nn.functional.cross_entropy(s / 0.05, labels)
        loss.backward()

    t = timed(step)
    rows.append({"workload": f"contrastive-step B{B} Lq{Lq} Ld{Ld}", "world": world, "ms": round(t, 3),
                 "queries_per_s": round(B / t * 1e3)})
    del Q, D

    # 2. sharded search: each rank scores its shard of the corpus.
    N = args.docs // world
    shard = torch.empty((N * Ld, d), dtype=torch.bfloat16, device=dev)
    step_rows = 1 << 22
    for r in range(0, N * Ld, step_rows):
        x = torch.randn(min(step_rows, N * Ld - r), d, device=dev, generator=gen)
        shard[r:r + x.shape[0]] = torch.nn.functional.normalize(x, dim=-1)
    del x
    off = torch.arange(N + 1, device=dev, dtype=torch.int64) * Ld
    corpus = ms.Corpus(shard, off, device=dev)
    qgen = torch.Generator(device="cuda").manual_seed(123)  # same queries on every rank
    queries = torch.nn.functional.normalize(torch.randn(32, Lq, d, device=dev, generator=qgen), dim=-1)
    queries = queries.to(torch.bfloat16)
    t = timed(lambda: ms.distributed.search(queries, corpus, 100), reps=5, warmup=1)
    rows.append({"workload": f"search Nq32 over {args.docs} docs Ld{Ld}", "world": world, "ms": round(t, 3),
                 "queries_per_s": round(32 / t * 1e3, 1)})
    if rank == 0:
        for r in rows:
            print(r, flush=True)
        out = Path(args.out)
        old = json.loads(out.read_text()) if out.exists() else {"meta": {}, "rows": []}
        old["meta"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "backend": "nccl", "timing": "median of CUDA-event times, max over ranks"}
        old["rows"] += rows
        out.write_text(json.dumps(old, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
