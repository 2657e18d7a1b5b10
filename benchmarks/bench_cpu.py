"""CPU benchmark: maxsim vs torch einsum / matmul+amax and the PyPI `maxsim-cpu`.

Prints a table and writes ``bench_results/cpu.json``. Times are medians of
``--reps`` runs after a warm-up; peak extra memory is the rise of the
resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) over
one call, in a fresh subprocess per implementation (Linux).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    # name: (layout, B or Nq, K or Nd, Lq, Ld, d)
    "rerank-B32-K100": ("grouped", 32, 100, 32, 256, 128),
    "corpus-1x1000": ("cross", 1, 1000, 32, 300, 128),
}


def load():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import kernels

    return kernels.get_local_kernel(ROOT)


def make(workload, seed=0):
    import torch

    layout, n, k, lq, ld, d = WORKLOADS[workload]
    g = torch.Generator().manual_seed(seed)
    Q = torch.nn.functional.normalize(torch.randn(n, lq, d, generator=g), dim=-1)
    shape = (n, k, ld, d) if layout == "grouped" else (k, ld, d)
    D = torch.nn.functional.normalize(torch.randn(*shape, generator=g), dim=-1)
    return Q, D


def impls(ms):
    import torch

    def einsum(Q, D):
        eq = "bid,bkjd->bkij" if D.dim() == 4 else "qid,njd->qnij"
        return torch.einsum(eq, Q, D).amax(-1).sum(-1)

    def matmul(Q, D):
        if D.dim() == 4:
            return torch.matmul(Q[:, None], D.transpose(-1, -2)).amax(-1).sum(-1)
        return torch.matmul(Q[:, None], D.transpose(-1, -2)[None]).amax(-1).sum(-1)

    out = {"maxsim": lambda Q, D: ms.maxsim(Q, D), "einsum": einsum, "matmul+amax": matmul}
    try:
        import maxsim_cpu  # PyPI package `maxsim-cpu`
        import numpy as np

        def pypi(Q, D):
            if D.dim() == 4:
                return [maxsim_cpu.maxsim_scores(Q[b].numpy(), D[b].numpy()) for b in range(Q.shape[0])]
            return maxsim_cpu.maxsim_scores(Q[0].numpy(), D.numpy())

        out["maxsim-cpu (PyPI)"] = pypi
    except Exception:
        pass
    return out


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(workload, impl, reps):
    """Time one implementation in this (fresh) process and report its peak RSS."""
    import torch

    ms = load()
    Q, D = make(workload)
    fn = impls(ms)[impl]
    fn(Q, D)  # warm-up: thread pools, allocator caches
    base = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets the VmHWM high-water mark
    fn(Q, D)
    peak = _rss_kib("VmHWM")
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(Q, D)
        times.append((time.perf_counter() - t) * 1e3)
    ref = ms.maxsim_reference(Q, D).float()
    got = torch.as_tensor(__import__("numpy").asarray(fn(Q, D)), dtype=torch.float32).reshape(ref.shape)
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    print(json.dumps({"ms": statistics.median(times), "peak_extra_mib": max(peak - base, 0) / 1024,
                      "relerr": err}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", nargs=2)
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "cpu.json"))
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.reps)
    import torch

    ms = load()
    rows = []
    print(f"CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'workload':<18} {'impl':<20} {'ms':>9} {'peak MiB':>9} {'relerr':>9}")
    for w in WORKLOADS:
        for name in impls(ms):
            r = subprocess.run([sys.executable, __file__, "--child", w, name, "--reps", str(args.reps)],
                               capture_output=True, text=True)
            if r.returncode:
                print(f"{w:<18} {name:<20} failed: {r.stderr.strip().splitlines()[-1:]}")
                continue
            res = json.loads(r.stdout.strip().splitlines()[-1])
            rows.append({"workload": w, "impl": name, "dtype": "fp32", **res})
            print(f"{w:<18} {name:<20} {res['ms']:9.2f} {res['peak_extra_mib']:9.1f} {res['relerr']:9.1e}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    meta = {"device": "cpu", "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "date": datetime.date.today().isoformat(), "commit": commit}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
