"""Where an eager call's time goes on the host.

``--split`` (CPU or GPU): the host path of a maxsim training step taken
apart, in one process, against a baseline of the same shape (see
``split_row``). On the CPU the rows are tiny (host bound: the kernels take
a few microseconds); on a GPU they are the benchmark's training rows.

    python benchmarks/host_time.py --split [--device cpu|cuda] [--rows a,b] [--out f.json]

Without ``--split`` (GPU), the peers side by side: for each training workload (forward + ``scores.backward(g)``) and a few
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
from pathlib import Path

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
            seg["q"] = ms.lowering.uniform_segments(Q.shape[0], lq, Q)
            seg["d"] = ms.lowering.uniform_segments(D.shape[0], ld, D)
        return ms.ops.forward_train(Q, *seg["q"], None, D, *seg["d"], None, None, None,
                                    ms.reference.CROSS, lq, 2, 0, False)[0]

    impls["maxsim-op"] = op
    return impls


# ----------------------------------------------------------------------------
# --split: the host path of one maxsim training step, taken apart
# ----------------------------------------------------------------------------

# CPU rows: tiny shapes, so the step is host bound as a GPU step of the
# benchmark's size is; (kind, Nq, Nd or K, Lq, Ld, dim).
CPU_ROWS = {"tiny-cross 4x4 Lq8 Ld16": ("shared", 4, 4, 8, 16, 32),
            "tiny-kd 4x(1+3) Lq8 Ld16": ("padded", 4, 4, 8, 16, 32)}
GPU_ROWS = ["Contrastive", "BigBatch", "kd-32x32-Ld180", "hardneg-64x(1+7)-Ld180"]


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def clock(device):
    """Wall time on a GPU host; on the CPU (one intra-op thread) this
    thread's CPU time, which a shared, oversubscribed machine does not
    inflate by the time it spends descheduled."""
    return time.perf_counter if device == "cuda" else time.thread_time


def per_call_us(fn, device, n, rounds=7):
    """Host time per call of ``n`` calls issued back to back (no sync between
    them; the device catches up after), the fastest of ``rounds`` rounds:
    host microseconds on a shared machine only ever read high."""
    now = clock(device)
    for _ in range(max(3, n // 10)):
        fn()
    out = []
    for _ in range(rounds):
        sync(device)
        t0 = now()
        for _ in range(n):
            fn()
        out.append((now() - t0) / n * 1e6)
        sync(device)
    return min(out)


def fwd_bwd_us(fwd, bwd, device, n, rounds=7):
    """Host times of a forward and of its backward, each timed on its own
    (synchronised before each, so neither waits on the other's kernels); the
    fastest round of each."""
    now = clock(device)
    f, b = [], []
    for r in range(rounds + 1):
        tf = tb = 0.0
        for _ in range(n):
            sync(device)
            t0 = now()
            s = fwd()
            t1 = now()
            sync(device)
            t2 = now()
            bwd(s)
            tb += now() - t2
            tf += t1 - t0
        if r:
            f.append(tf / n * 1e6)
            b.append(tb / n * 1e6)
    sync(device)
    return min(f), min(b)


def build_baseline():
    """The baseline op (host_baseline.cpp), compiled once per torch into
    .cache/host_baseline (a minute the first time, cached after)."""
    from torch.utils import cpp_extension

    here = Path(__file__).resolve().parent
    build = here.parent / ".cache" / "host_baseline" / torch.__version__.replace("+", "_")
    build.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cpp_extension.load(name="maxsim_host_baseline", sources=[str(here / "host_baseline.cpp")],
                       extra_cflags=["-O2"], build_directory=str(build), is_python_module=False,
                       with_cuda=False, verbose=False)
    return time.perf_counter() - t0


def launches(fn, device):
    """Kernel launches per call of ``fn`` on a GPU (profiler's runtime launch
    events); 1 on the CPU (one kernel call)."""
    if device != "cuda":
        return 1
    from torch.profiler import ProfilerActivity, profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    names = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
    return max(1, sum(1 for e in p.events() if e.name in names))


def allocations(fn):
    """Tensors allocated per call of ``fn`` (profiler's aten::empty* events)."""
    from torch.profiler import ProfilerActivity, profile as prof

    fn()
    with prof(activities=[ProfilerActivity.CPU]) as p:
        fn()
    return sum(1 for e in p.events() if e.name in ("aten::empty", "aten::empty_strided", "aten::empty_like"))


def split_row(ms, name, kind, nq, nb, lq, ld, dim, device, dtype, normalize, n):
    """Host microseconds per training step (forward + ``scores.backward(g)``):

    - ``step``: the public call, ``maxsim(Q, D).backward(g)``;
    - ``op_step``: the same op call with the lowered arguments precomputed
      (``step - op_step`` = our Python: checks, lowering, the op call's
      argument handling in Python);
    - ``checks``: maxsim()'s argument checks alone (first call of a shape);
    - ``fwd_node``: forward_train (C++ autograd node) minus forward (same
      kernel, no node): the node's forward side;
    - ``bwd``: ``scores.backward(g)``; ``bwd_op``: the backward op called
      directly (``bwd - bwd_op`` = torch's engine plus our node's backward);
    - ``alloc``: allocations per step x the time of one ``torch.empty``;
    - ``baseline``: a trivial op with a C++ autograd node, the same outputs
      and launches per step (host_baseline.cpp); ``excess = step - baseline``.
    """
    g = torch.Generator(device="cpu").manual_seed(0)
    Q = torch.randn(nq, lq, dim, generator=g).to(device=device, dtype=dtype).requires_grad_()
    shape = (nb, ld, dim) if kind == "shared" else (nq, nb, ld, dim)
    D = torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(nq, nb, generator=g).to(device)
    ops, sc = ms.ops, ms.scoring
    q_start, q_len = ms.lowering.uniform_segments(nq, lq, Q)
    d_start, d_len = ms.lowering.uniform_segments(D[..., 0, 0].numel(), ld, Q)
    layout, Lq = (ms.reference.CROSS if kind == "shared" else ms.reference.GROUPED), lq
    args = (Q, q_start, q_len, None, D, d_start, d_len, None, None, None, layout, Lq, 2, 0, normalize)

    def step():
        Q.grad = D.grad = None
        ms.maxsim(Q, D, normalize=normalize).backward(grad)

    def op_step():
        Q.grad = D.grad = None
        ops.forward_train(*args)[0].backward(grad)

    def fwd_train():
        return ops.forward_train(*args)[0]

    Q2, D2 = Q.detach().reshape(-1, dim), D.detach().reshape(-1, dim)
    plain_args = (Q2,) + args[1:4] + (D2,) + args[5:]

    def fwd_plain():
        return ops.forward(*plain_args)

    _, argmax = fwd_plain()
    P = argmax.shape[0]
    g32 = grad.reshape(-1).float()
    inv_norms = ops.forward_train(*args)[2].detach()  # what a step's backward receives

    def bwd_op():
        return ops.backward(g32, Q2, q_start, q_len, D2, d_start, d_len, None, None, argmax, layout,
                            None, None, None, None, True, True, normalize, inv_norms)

    n_fwd = launches(fwd_train, device)
    n_bwd = launches(bwd_op, device)
    base_ops = torch.ops.maxsim_host_baseline

    def base_step():
        Q.grad = D.grad = None
        base_ops.step(Q, D, P, Lq, n_fwd, n_bwd)[0].backward(g32)

    t = dict(step=per_call_us(step, device, n), op_step=per_call_us(op_step, device, n),
             baseline=per_call_us(base_step, device, n))
    if hasattr(sc, "_check_maxsim"):
        t["checks"] = per_call_us(lambda: sc._check_maxsim(Q, D, None, None), device, n)
    t["fwd"], t["bwd"] = fwd_bwd_us(lambda: (setattr(Q, "grad", None), setattr(D, "grad", None),
                                             ms.maxsim(Q, D, normalize=normalize))[-1],
                                    lambda s: s.backward(grad), device, n)
    t["fwd_train"] = per_call_us(fwd_train, device, n)
    t["fwd_op"] = per_call_us(fwd_plain, device, n)
    t["bwd_op"] = per_call_us(bwd_op, device, n)
    n_alloc = allocations(step)
    t["alloc"] = n_alloc * per_call_us(lambda: torch.empty(P, device=device), device, n)
    t["python"] = t["step"] - t["op_step"]
    t["fwd_node"] = t["fwd_train"] - t["fwd_op"]
    t["engine_bwd"] = t["bwd"] - t["bwd_op"]
    t["excess"] = t["step"] - t["baseline"]
    return dict(workload=name + (" normalize" if normalize else ""), device=device, dtype=str(dtype).split(".")[-1],
                launches_fwd=n_fwd, launches_bwd=n_bwd, allocations=n_alloc,
                **{k + "_us": round(v, 2) for k, v in t.items()})


SPLIT_COLS = ["step", "baseline", "excess", "python", "checks", "fwd", "fwd_node", "fwd_op", "bwd",
              "engine_bwd", "bwd_op", "alloc"]


def split_main(args):
    if args.root:
        import kernels

        ms = kernels.get_local_kernel(Path(args.root))
    else:
        ms = bg.load_maxsim()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    secs = build_baseline()
    print(f"baseline op built/loaded in {secs:.1f} s; {device}, torch {torch.__version__}")
    if device == "cuda":
        rows = [(nm, kind, nq, nb, lq, ld, bg.DIM) for nm, kind, nq, nb, lq, ld in bg.train_rows()
                if nm in (args.rows.split(",") if args.rows else GPU_ROWS)]
        dtype, n = torch.bfloat16, 100
    else:
        rows = [(nm, *v) for nm, v in CPU_ROWS.items() if not args.rows or nm in args.rows.split(",")]
        dtype, n = torch.float32, 200
        torch.set_num_threads(1)
    print(f"{'workload':<34}" + "".join(f"{c:>10}" for c in SPLIT_COLS) + "  launches allocs   (us per step)")
    out = []
    for i, row in enumerate(rows):
        for normalize in ((False, True) if i == 0 else (False,)):
            r = split_row(ms, *row, device, dtype, normalize, n)
            out.append(r)
            print(f"{r['workload']:<34}" + "".join(f"{r.get(c + '_us', float('nan')):10.1f}" for c in SPLIT_COLS)
                  + f"  {r['launches_fwd']}+{r['launches_bwd']:<6} {r['allocations']}", flush=True)
    if args.out:
        dev = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores, 1 thread)"
        meta = dict(device=dev, torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                    commit=os.environ.get("MAXSIM_COMMIT", ""))
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=out), indent=1) + "\n")
        print(f"wrote {args.out}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impls", default="maxsim,maxsim-op,lik,flash-maxsim")
    ap.add_argument("--profile", default="")
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--split", action="store_true", help="take one maxsim training step's host path apart")
    ap.add_argument("--device", default="", help="--split: cpu or cuda (default: cuda when present)")
    ap.add_argument("--rows", default="", help="--split: comma-separated row names")
    ap.add_argument("--root", default="", help="--split: load the build/<variant> of this repository")
    args = ap.parse_args()
    if args.split:
        split_main(args)
        return
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
