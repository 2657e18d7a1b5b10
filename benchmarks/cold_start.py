"""First use of maxsim, split, in fresh processes (CPU or GPU).

Each run is a new interpreter that times, in order:

- ``import_torch``: ``import torch`` (not ours; for scale);
- ``context``: CUDA context creation and the inputs (GPU only; not ours);
- ``import_kernels``: ``import kernels`` (not ours);
- ``get_local_kernel``: ``kernels.get_local_kernel(repo)``, split with
  ``-X importtime`` into ``library`` (importing the compiled extension:
  dynamic loading, static initialisers, op registration), ``python`` (our
  package's Python modules and what they do at import) and ``kernels_lookup``
  (the rest: finding the variant, kernels' own bookkeeping);
- ``first_call`` / ``second_call``: ``maxsim(Q, D)`` (forward) and
  ``first_train`` / ``second_train``: a training step on its own inputs.

``ours`` = library + python + first_call: the number the load-time goal is
about. Prints the median over ``--runs`` runs and the slowest of our Python
modules (self time); writes JSON with ``--out``.

    python benchmarks/cold_start.py [--device cpu|cuda] [--runs 5] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import sys, time
from pathlib import Path
t = {}
t0 = time.perf_counter()
import torch
t["import_torch"] = time.perf_counter() - t0
device = sys.argv[2]
t0 = time.perf_counter()
if device == "cuda":
    shape = ((32, 32, 128), (1000, 300, 128), (32, 32, 128), (32, 80, 128))
    dt = torch.bfloat16
else:
    shape = ((4, 32, 128), (64, 64, 128), (4, 8, 128), (8, 32, 128))
    dt = torch.float32
Q = torch.randn(*shape[0], device=device, dtype=dt)
D = torch.randn(*shape[1], device=device, dtype=dt)
Qt = torch.randn(*shape[2], device=device, dtype=dt).requires_grad_()
Dt = torch.randn(*shape[3], device=device, dtype=dt).requires_grad_()
def sync():
    if device == "cuda":
        torch.cuda.synchronize()
sync()
t["context"] = time.perf_counter() - t0
t0 = time.perf_counter()
import kernels
t["import_kernels"] = time.perf_counter() - t0
t0 = time.perf_counter()
ms = kernels.get_local_kernel(Path(sys.argv[1]))
t["get_local_kernel"] = time.perf_counter() - t0
def call():
    ms.maxsim(Q, D)
    sync()
def train():
    Qt.grad = Dt.grad = None
    ms.maxsim(Qt, Dt).sum().backward()
    sync()
for name, fn in (("first_call", call), ("second_call", call), ("first_train", train), ("second_train", train)):
    t0 = time.perf_counter()
    fn()
    t[name] = time.perf_counter() - t0
print("COLD " + " ".join(f"{k}={v * 1e3:.3f}" for k, v in t.items()))
"""


def import_times(stderr: str, package: str):
    """(library ms, our Python ms, [(self ms, module)]) from ``-X importtime``
    lines: the extension module (``_<name>_<hash>``) and the rest of the
    variant's package (named ``package`` by kernels, which executes the
    package's ``__init__`` itself: its imports are the outermost entries)."""
    lib = 0.0
    own, outer = [], {}
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        parts = line[len("import time:"):].split("|")
        try:
            self_us, cum_us = int(parts[0]), int(parts[1])
        except ValueError:
            continue
        raw = parts[2].rstrip()
        name = raw.strip()
        if name.split(".")[0] != package:
            continue
        depth = len(raw) - len(raw.lstrip())
        outer.setdefault(depth, []).append(cum_us / 1e3)
        if name.split(".")[-1].startswith("_maxsim_"):
            lib = cum_us / 1e3
        own.append((self_us / 1e3, name))
    total = sum(outer[min(outer)]) if outer else 0.0
    return lib, total - lib, sorted(own, reverse=True)


def one_run(device: str, root: Path) -> dict:
    # Bytecode caching on, as in an installed package (a first run, not
    # counted, writes it).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["HF_HUB_OFFLINE"] = "1"
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", CHILD, str(root), device],
                       capture_output=True, text=True, env=env)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("COLD ")), None)
    if r.returncode or line is None:
        raise SystemExit(f"cold-start child failed:\n{r.stderr[-3000:]}")
    t = {k: float(v) for k, v in (w.split("=") for w in line.split()[1:])}
    # kernels imports the variant under a module name of its own: the
    # package that holds the extension module is ours.
    package = next((ln.split("|")[-1].strip().split(".")[0] for ln in r.stderr.splitlines()
                    if "|" in ln and ln.split("|")[-1].strip().split(".")[-1].startswith("_maxsim_")), "")
    lib, py, own = import_times(r.stderr, package)
    t["library"], t["python"] = lib, py
    t["kernels_lookup"] = t["get_local_kernel"] - lib - py
    t["ours"] = lib + py + t["first_call"]
    t["_modules"] = own[:8]
    return t


COLS = ["import_torch", "context", "import_kernels", "get_local_kernel", "library", "python", "kernels_lookup",
        "first_call", "second_call", "first_train", "second_train", "ours"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="", help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--root", default=str(ROOT), help="repository with build/<variant>")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    one_run(device, Path(args.root))
    runs = [one_run(device, Path(args.root)) for _ in range(args.runs)]
    med = {c: statistics.median(r[c] for r in runs) for c in COLS}
    print(f"first use on {device}, median of {args.runs} fresh processes (ms):")
    for c in COLS:
        print(f"  {c:<17} {med[c]:9.2f}")
    print("our slowest modules (self ms, last run): " + ", ".join(f"{n} {s:.1f}" for s, n in runs[-1]["_modules"]))
    if args.out:
        dev = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores)"
        meta = dict(device=dev, torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                    commit=os.environ.get("MAXSIM_COMMIT", ""), runs=args.runs)
        rows = [dict(workload="cold-start split", impl="maxsim", **{c + "_ms": round(med[c], 3) for c in COLS})]
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
