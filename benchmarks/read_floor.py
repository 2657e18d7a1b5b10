"""The read floor of the memory-bound rows: how fast a read-only kernel
touches each workload's document bytes once, timed exactly as
``bench_gpu.py`` times the implementations (eager: ``do_bench``, whose L2
flush is a 256 MB memset before every call; graph: 20 calls per replay),
next to maxsim on the same inputs.

An exact MaxSim reads every document byte at least once; the fastest of
these kernels estimates what that costs under this harness. The
kernels (``read_floor/read_floor.cu``) read with 16-byte loads, 8 in flight
per lane, in two orders: each warp one contiguous chunk (an even split), or
all warps sweeping the tensor together in blocks of 4 or 16 KB (``sweep``);
three load forms: plain, ``.cs`` (evict-first, the maxsim streaming
kernel's form) and ``.nc``; the grid is swept over warps per SM and the
best of each form is reported. The order can matter, so this is the
fastest of these kernels, not a bound proven for every access order.

    python benchmarks/read_floor.py [--only rerank-short,...] [--out F]
    python benchmarks/read_floor.py --replica [--only rerank-short,Rerank]

``--replica`` times the read-only kernel split the way the streaming
launcher can split the scan (S warps per pair, optionally the last slots / 2
pairs over 4 warps) at the streaming kernel's occupancy (3 CTAs of 4 warps
per SM, capped by shared memory), next to an even split at that occupancy:
what the split itself costs, apart from the work per tile. Also each pair
read by G = 1-32 consecutive warps taking every G-th tile of 2 KB (the
kernel's interleaved split, and wider ones that would span CTAs): whether
fewer pairs in flight, i.e. a narrower window of bytes, reads faster.

Writes ``bench_results/<gpu>-read-floor.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu as bg  # noqa: E402

ROWS = ["rerank-100", "rerank-short", "Rerank", "HeavyRerank", "rerank-long", "rerank-medium", "corpus-10k"]
POLICIES = {0: "plain", 1: ".cs", 2: ".nc"}
WARPS_PER_SM = (8, 12, 16, 32, 48)
# Read orders, by impl suffix: the even split (None), or a sweep in blocks of this many 16-byte vectors.
ORDERS = {"": None, " sweep 4K": 256, " sweep 16K": 1024}
GROUPS = (1, 2, 4, 8, 16, 32)  # --replica: warps per pair of the interleaved split


def load_ext():
    from torch.utils import cpp_extension

    major, minor = torch.cuda.get_device_capability()
    build = bg.ROOT / ".cache" / "read_floor"
    build.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name="read_floor", sources=[str(Path(__file__).resolve().parent / "read_floor" / "read_floor.cu")],
        extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"],
        build_directory=str(build), verbose=False)


def replica(rf, names, out):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    slots = sms * 3 * 4  # warps of the 16-bit d = 128 streaming kernel (3 CTAs of 4 per SM)
    smem = 60 * 1024  # 3 CTAs per SM
    rows = []
    for name in names:
        kind, n, k, lq, ld = bg.FORWARD[name]
        Q, D = bg.make_inputs(kind, n, k, lq, ld)
        pairs = k if kind == "shared" else n * k
        per16 = ld * D.shape[-1] * D.element_size() // 16
        n16 = pairs * per16
        splits = {"even over the slots": (slots // 4, -(-n16 // slots), 0, 0)}
        for S in (1, 2, 4):
            splits[f"S = {S}"] = (-(-pairs * S // 4), per16 // S, 0, 0)
            tail = slots // 2 if pairs * S > slots and S < 4 else 0
            if tail:
                head = pairs - tail
                splits[f"S = {S}, {tail} tail pairs at S = 4"] = (-(-head * S // 4), per16 // S, tail, per16 // 4)
        print(f"{name}: {pairs} pairs of {per16 * 16 / 1024:.1f} KB; eager / graph us")
        calls = {label: (lambda a=a: rf.read_units(D, sink, *a, smem)) for label, a in splits.items()}
        for G in GROUPS:  # every G-th tile of 2 KB per warp, G warps per pair (past 4: across CTAs)
            calls[f"interleaved, {G} warps per pair"] = lambda G=G: rf.read_groups(D, sink, pairs, per16, G, smem)
        for label, g in calls.items():
            r = dict(workload=name, impl=f"replica {label}", dtype="bf16", ms=bg.bench(g), graph_ms=bg.graph_ms(g))
            rows.append(r)
            print(f"  {label:36s} {r['ms'] * 1e3:8.2f} / {r['graph_ms'] * 1e3:8.2f}", flush=True)
        del Q, D
    bg.write_results(rows, out, "-read-replica")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="comma-separated rows (default: ROWS; rerank-short,Rerank "
                    "with --replica)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--replica", action="store_true")
    args = ap.parse_args()
    rf = load_ext()
    if args.replica:
        return replica(rf, args.only.split(",") if args.only else ["rerank-short", "Rerank"], args.out)
    names = args.only.split(",") if args.only else ROWS
    ms = bg.load_maxsim()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; eager / graph us")
    forms = [p + s for p in POLICIES.values() for s in ORDERS]
    print(f"{'workload':14s} {'MB':>7s} {'maxsim':>17s} " + " ".join(f"{p:>17s}" for p in forms))
    for name in names:
        kind, n, k, lq, ld = bg.FORWARD[name]
        Q, D = bg.make_inputs(kind, n, k, lq, ld)
        fn = (lambda: ms.maxsim(Q, D)) if kind == "shared" else (lambda: ms.score_candidates_padded(Q, D))
        mb = D.numel() * D.element_size() / 1e6
        m = dict(workload=name, impl="maxsim", dtype="bf16", mb=mb, ms=bg.bench(fn), graph_ms=bg.graph_ms(fn))
        rows.append(m)
        best = {}
        for pol, pname in POLICIES.items():
            for wps in WARPS_PER_SM:
                for suffix, blk in ORDERS.items():
                    g = ((lambda: rf.read_all(D, sink, pol, sms * wps)) if blk is None  # noqa: E731
                         else (lambda: rf.read_sweep(D, sink, pol, sms * wps, blk)))
                    form = pname + suffix
                    r = dict(workload=name, impl=f"read {form}", dtype="bf16", mb=mb, warps_per_sm=wps,
                             ms=bg.bench(g), graph_ms=bg.graph_ms(g))
                    rows.append(r)
                    b = best.setdefault(form, [r["ms"], r["graph_ms"]])
                    b[0], b[1] = min(b[0], r["ms"]), min(b[1], r["graph_ms"])
        print(f"{name:14s} {mb:7.1f} {m['ms'] * 1e3:8.2f}/{m['graph_ms'] * 1e3:8.2f} " +
              " ".join(f"{e * 1e3:8.2f}/{gr * 1e3:8.2f}" for e, gr in best.values()), flush=True)
        del Q, D
    print(f"\n{'workload':14s} {'read':6s} " + " ".join(f"{w:>5d} wps (eager/graph)" for w in WARPS_PER_SM))
    for name in names:
        for pname in forms:
            rs = [r for r in rows if r["workload"] == name and r["impl"] == f"read {pname}"]
            print(f"{name:14s} {pname:16s} " + " ".join(f"{r['ms'] * 1e3:10.2f}/{r['graph_ms'] * 1e3:8.2f}" for r in rs))
    bg.write_results(rows, args.out, "-read-floor")


if __name__ == "__main__":
    main()
