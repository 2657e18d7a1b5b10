"""Where an eager call's time goes on the host (GPU).

For each training workload (forward + ``scores.backward(g)``) and a few
forward rows, per implementation:

- ``host_us``: host time per call issued back to back without a sync (what
  a training loop pays when the GPU keeps up);
- ``fwd_host_us`` / ``bwd_host_us``: the forward call and the backward call
  alone, host side;
- ``loop_us``: device-event time per call of 200 calls back to back (the
  larger of host and device time per call);
- ``eager_ms``: ``do_bench`` median (L2 flushed before each call), as in
  bench_gpu.py; ``graph_ms``: per call of a captured graph;
- ``syncs``: whether the call synchronises with the host
  (``torch.cuda.set_sync_debug_mode``).

``--profile`` prints the profiler's host-side table of one implementation's
step (top entries by self CPU time). Writes JSON with ``--out``.

    python benchmarks/host_time.py [--impls maxsim,lik] [--profile maxsim] [--out f.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu as bg  # noqa: E402

FORWARD = {"rerank-short": ("shared", 1, 1000, 32, 300), "Rerank": ("padded", 32, 50, 32, 180)}


def host_per_call(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def loop_per_call(fn, n=200):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1e3


def syncs(fn):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def split_host(fwd, bwd, n=100):
    """Host time of the forward and of the backward, each on its own."""
    f = b = 0.0
    for i in range(n + 5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s = fwd()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        bwd(s)
        t3 = time.perf_counter()
        if i >= 5:
            f += t1 - t0
            b += t3 - t2
    torch.cuda.synchronize()
    return f / n * 1e6, b / n * 1e6


def profile(step, label):
    from torch.profiler import ProfilerActivity, profile as prof

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    print(f"--- profile: {label} (20 steps)")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def train_impls(ms, pe, lq, ld):
    """bench_gpu's training implementations plus ``maxsim-op``: the op called
    directly with precomputed segments (what the Python wrapper adds)."""
    impls = bg.train_impls(ms, pe)
    seg = {}

    def op(Q, D):
        if not seg:
            sc = ms.scoring
            seg["q"] = sc._uniform_segments(Q.shape[0], lq, Q.device)
            seg["d"] = sc._uniform_segments(D.shape[0], ld, D.device)
        return ms.ops.forward_train(Q, *seg["q"], None, D, *seg["d"], None, None, None,
                                    ms.reference.CROSS, lq, 2, 0, False)[0]

    impls["maxsim-op"] = op
    return impls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impls", default="maxsim,maxsim-op,lik,flash-maxsim")
    ap.add_argument("--profile", default="")
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ms, pe = bg.load_maxsim(), bg.peers()
    want = set(args.impls.split(","))
    only = set(args.only.split(",")) if args.only else None
    rows = []
    hdr = (f"{'workload':<18} {'impl':<13} {'host us':>8} {'fwd host':>8} {'bwd host':>8} {'loop us':>8} "
           f"{'eager ms':>8} {'graph ms':>8} sync")
    print(hdr)
    for name, (nq, nb, lq, ld) in bg.TRAIN.items():
        if name == "colpali-train-128" or (only and name not in only):
            continue
        Q0, D0 = bg.make_inputs("shared", nq, nb, lq, ld)
        g = torch.randn(nq, nb, device="cuda")
        for impl, fn in train_impls(ms, pe, lq, ld).items():
            if impl not in want:
                continue
            Q, D = Q0.clone().requires_grad_(), D0.clone().requires_grad_()

            def step(fn=fn, Q=Q, D=D):
                Q.grad = D.grad = None
                fn(Q, D).backward(g)

            def fwd(fn=fn, Q=Q, D=D):
                Q.grad = D.grad = None
                return fn(Q, D)

            h = host_per_call(step)
            fh, bh = split_host(fwd, lambda s: s.backward(g))
            lp = loop_per_call(step)
            e = bg.bench(step)
            tg = bg.graph_ms(step, calls=5)
            sy = syncs(step)
            row = dict(workload=name, impl=impl, mode="fwd_bwd", host_us=h, fwd_host_us=fh, bwd_host_us=bh,
                       loop_us=lp, eager_ms=e, graph_ms=tg, syncs=sy)
            rows.append(row)
            print(f"{name:<18} {impl:<13} {h:8.1f} {fh:8.1f} {bh:8.1f} {lp:8.1f} {e:8.4f} "
                  f"{'-' if tg is None else f'{tg:.4f}':>8} {sy}", flush=True)
            if args.profile == impl and name == "Contrastive":
                profile(step, f"{impl} {name}")
    for name, (kind, n, k, lq, ld) in FORWARD.items():
        if only and name not in only:
            continue
        Q, D = bg.make_inputs(kind, n, k, lq, ld)
        for impl, fn in bg.implementations(ms, kind, pe).items():
            if impl not in want:
                continue
            f = (lambda fn=fn: fn(Q, D))
            h = host_per_call(f)
            lp = loop_per_call(f)
            e = bg.bench(f)
            tg = bg.graph_ms(f)
            sy = syncs(f)
            rows.append(dict(workload=name, impl=impl, mode="fwd", host_us=h, loop_us=lp, eager_ms=e,
                             graph_ms=tg, syncs=sy))
            print(f"{name:<18} {impl:<13} {h:8.1f} {'':>8} {'':>8} {lp:8.1f} {e:8.4f} "
                  f"{'-' if tg is None else f'{tg:.4f}':>8} {sy}", flush=True)
            if args.profile == impl and name == "rerank-short":
                profile(f, f"{impl} {name}")
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
        with open(args.out, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
