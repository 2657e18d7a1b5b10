"""Peak extra memory of maxsim vs the naive einsum as documents grow.

The naive path materialises the full similarity tensor [Nq, Nd, Lq, Ld]
before the max; maxsim keeps only running maxima, so its extra memory is the
[Nq, Nd] output. CPU: rise of the resident-set high-water mark (VmHWM, reset
through /proc/self/clear_refs, Linux) over one call, one fresh subprocess per
implementation so allocator caches of one do not hide the other. GPU:
torch.cuda.max_memory_allocated over one call. Prints a table and plots it
(``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("LOCAL_KERNELS", f"maxsim-kernels/maxsim={ROOT}")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(impl, nq, nd, lq, lds, dim):
    """Peak extra MiB of one call per Ld, in this process; prints JSON."""
    import kernels

    ms = kernels.get_kernel("maxsim-kernels/maxsim", version=1, trust_remote_code=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    fn = ms.maxsim if impl == "maxsim" else lambda Q, D: torch.einsum("qid,njd->qnij", Q, D).amax(-1).sum(-1)
    out = {}
    for ld in lds:
        Q = torch.randn(nq, lq, dim, device=device, dtype=dtype)
        D = torch.randn(nd, ld, dim, device=device, dtype=dtype)
        fn(Q, D)  # warm-up: thread pools, kernel caches
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn(Q, D)
            torch.cuda.synchronize()
            out[ld] = (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            base = _kib("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            fn(Q, D)
            out[ld] = max(_kib("VmHWM") - base, 0) / 1024
        del Q, D
    print(json.dumps(out))


def plot(lds, res, out, title):
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for impl, marker in (("naive", "o"), ("maxsim", "s")):
        # Clamp at 0.01 MiB: the log axis cannot show the ~0 of maxsim's page-granular RSS rise.
        ax.plot(lds, [max(res[impl][ld], 1e-2) for ld in lds], marker=marker, label=impl)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("document length Ld (tokens)")
    ax.set_ylabel("peak extra memory (MiB)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nq", type=int, default=8)
    ap.add_argument("--nd", type=int, default=128)
    ap.add_argument("--lq", type=int, default=32)
    ap.add_argument("--ld", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--out", type=Path, default=ROOT / "examples" / "out" / "04_memory.png")
    ap.add_argument("--child")
    args = ap.parse_args()
    dims = (args.nq, args.nd, args.lq, args.ld, args.dim)
    if args.child:
        return child(args.child, *dims)
    # Both children at once: each measures only its own process.
    procs = {impl: subprocess.Popen([sys.executable, __file__, "--child", impl, "--nq", str(args.nq),
                                     "--nd", str(args.nd), "--lq", str(args.lq), "--dim", str(args.dim),
                                     "--ld", *map(str, args.ld)], stdout=subprocess.PIPE, text=True)
             for impl in ("naive", "maxsim")}
    res = {}
    for impl, p in procs.items():
        stdout, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"{impl} child failed")
        res[impl] = {int(k): v for k, v in json.loads(stdout.strip().splitlines()[-1]).items()}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    title = f"{device}: {args.nq} queries x {args.nd} docs, Lq {args.lq}, d {args.dim}"
    print(title)
    print(f"{'Ld':>6} {'naive MiB':>10} {'maxsim MiB':>11}")
    for ld in args.ld:
        print(f"{ld:>6} {res['naive'][ld]:10.2f} {res['maxsim'][ld]:11.2f}")
    plot(args.ld, res, args.out, title)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
