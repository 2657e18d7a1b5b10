"""GPU benchmark matrix: maxsim vs late-interaction-kernels (LIK), flash-maxsim
(FM) and naive PyTorch on the same inputs in one process.

Every implementation's output is checked against an fp64 reference first (a
mismatch is reported, not timed). Prints the floor (bytes / measured copy
bandwidth, FLOPs / measured bf16 matmul rate) and writes
``bench_results/<gpu>.json``:
``{"meta": {...}, "rows": [{"workload", "impl", "dtype", "ms", "peak_mib", "relerr"}]}``.

    python benchmarks/bench_gpu.py [--only rerank-short,...] [--cold-start] [--dtype float32]

``--dtype float32`` runs the matrix on fp32 tokens (rows ``"dtype": "fp32"``,
written to ``bench_results/<gpu>-fp32.json``): maxsim at each precision
(``maxsim`` = the default split 3xTF32, ``maxsim-exact``, ``maxsim-tf32``)
beside the peers on the same fp32 inputs; the byte floor counts 4-byte tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# name: (kind, Nq or B, Nd or K, Lq, Ld)
FORWARD = {
    "rerank-100": ("shared", 1, 100, 32, 300),
    "rerank-short": ("shared", 1, 1000, 32, 300),
    "rerank-long": ("shared", 1, 1000, 32, 1024),
    "rerank-medium": ("shared", 1, 1000, 128, 1024),
    "rerank-colpali": ("shared", 1, 1000, 1024, 1024),
    "corpus-10k": ("shared", 1, 10000, 32, 300),
    "colpali-10k": ("shared", 1, 10000, 1024, 1024),
    "allpairs-128": ("shared", 128, 128, 32, 300),
    "Rerank": ("padded", 32, 50, 32, 180),
    "HeavyRerank": ("padded", 32, 100, 32, 256),
}
DIM = 128
DTYPE = torch.bfloat16  # --dtype
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def dtype_label():
    return "fp32" if DTYPE == torch.float32 else "bf16"


def maxsim_variants(call):
    """maxsim's implementations of the run's dtype: fp32 at each precision."""
    if DTYPE != torch.float32:
        return {"maxsim": call(None)}
    return {"maxsim": call("default"), "maxsim-exact": call("exact"), "maxsim-tf32": call("tf32")}

# Training: MaxSim op alone, forward + backward via scores.backward(g).
# name: (Nq, Nd or K, Lq, Ld); shared documents D [Nd, Ld, d] -> [Nq, Nd].
TRAIN = {
    "Contrastive": (32, 32, 32, 80),
    "LongDocs": (32, 32, 32, 512),
    "BigBatch": (64, 64, 32, 128),
    "train-128": (128, 128, 32, 300),
    "colpali-train-32": (32, 32, 128, 1024),
    "colpali-train-128": (128, 128, 1024, 1024),
}
# Per-query candidates D [Nq, K, Ld, d] -> [Nq, K]: distillation (K teacher-
# scored candidates per query) and hard negatives (each query against its
# positive and its 7 mined negatives, no in-batch sharing).
TRAIN_GROUPED = {
    "kd-32x32-Ld180": (32, 32, 32, 180),
    "kd-16x64-Ld300": (16, 64, 32, 300),
    "hardneg-64x(1+7)-Ld180": (64, 8, 32, 180),
}


def load_maxsim():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import kernels

    return kernels.get_local_kernel(ROOT)


def peers():
    out = {}
    try:
        import late_interaction_kernels as lik

        out["lik"] = lik
    except Exception as e:  # noqa: BLE001
        print(f"late-interaction-kernels unavailable: {e}")
    try:
        import flash_maxsim as fm

        out["flash-maxsim"] = fm
    except Exception as e:  # noqa: BLE001
        print(f"flash-maxsim unavailable: {e}")
    return out


def make_inputs(kind, n, k, lq, ld, dtype=None, seed=0):
    dtype = dtype or DTYPE
    g = torch.Generator(device="cuda").manual_seed(seed)
    Q = torch.nn.functional.normalize(torch.randn(n, lq, DIM, device="cuda", generator=g), dim=-1).to(dtype)
    shape = (k, ld, DIM) if kind == "shared" else (n, k, ld, DIM)
    D = torch.randn(*shape, device="cuda", generator=g, dtype=dtype)
    D /= D.float().norm(dim=-1, keepdim=True).to(dtype)
    return Q, D


def implementations(ms, kind, pe):
    impls = {}
    if kind == "shared":
        impls.update(maxsim_variants(lambda p: lambda Q, D: ms.maxsim(Q, D, precision=p)))
        impls["naive"] = lambda Q, D: torch.einsum("qid,njd->qnij", Q, D).amax(-1).float().sum(-1)
        if "lik" in pe:
            impls["lik"] = lambda Q, D: pe["lik"].maxsim(Q, D)
        if "flash-maxsim" in pe:
            impls["flash-maxsim"] = lambda Q, D: pe["flash-maxsim"].flash_maxsim_batched(Q, D)
    else:
        impls.update(maxsim_variants(lambda p: lambda Q, D: ms.score_candidates_padded(Q, D, precision=p)))
        impls["naive"] = lambda Q, D: torch.einsum("bid,bkjd->bkij", Q, D).amax(-1).float().sum(-1)
        if "lik" in pe:
            impls["lik"] = lambda Q, D: pe["lik"].maxsim(Q, D)
        if "flash-maxsim" in pe:
            impls["flash-maxsim"] = lambda Q, D: pe["flash-maxsim"].flash_maxsim_rerank_padded(Q, D)
    return impls


CHECK_DOCS = 256  # outputs are verified on the first documents (fp64 is slow)


def reference(Q, D, kind):
    """fp64 scores of the first CHECK_DOCS documents (per query for padded)."""
    D = D[:CHECK_DOCS] if kind == "shared" else D[:, :CHECK_DOCS]
    out = []
    step = max(1, (1 << 28) // max(1, Q.shape[0] * Q.shape[1] * D.shape[-2]))
    Qd = Q.double()
    if kind == "shared":
        for s in range(0, D.shape[0], step):
            out.append(torch.einsum("qid,njd->qnij", Qd, D[s:s + step].double()).amax(-1).sum(-1))
        return torch.cat(out, dim=1)
    for s in range(0, D.shape[1], max(1, step // max(1, Q.shape[0]))):
        e = s + max(1, step // max(1, Q.shape[0]))
        out.append(torch.einsum("bid,bkjd->bkij", Qd, D[:, s:e].double()).amax(-1).sum(-1))
    return torch.cat(out, dim=1)


def bench(fn, reps_ms=200):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=reps_ms, return_mode="median")


def eager_ms(fn, rounds=5):
    """Median of ``rounds`` do_bench readings. Calls whose host time exceeds
    their GPU time (small shapes, training steps through the autograd engine)
    read up to 2x apart between readings in one process on a busy host;
    one reading would report that swing, not the implementation."""
    return statistics.median(bench(fn) for _ in range(rounds))


def graph_ms(fn, calls=20):
    """Per-call time of a CUDA graph holding ``calls`` back-to-back calls:
    device time without Python/launch overhead (and without do_bench's L2
    flush). None when the implementation cannot be captured."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        g.replay()
        torch.cuda.synchronize()
        t = bench(g.replay) / calls
        del g
        return t
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()
        return None


def ceilings():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    bw = 2 * x.numel() / (t * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = bench(lambda: a @ b)
    flops = 2 * 8192**3 / (t * 1e-3)
    del x, y, a, b
    torch.cuda.empty_cache()
    return bw, flops


def workload_bytes(kind, n, k, lq, ld):
    ndocs = k if kind == "shared" else n * k
    esz = torch.finfo(DTYPE).bits // 8
    return esz * (n * lq * DIM + ndocs * ld * DIM) + 4 * n * k


def floor_ms(kind, n, k, lq, ld, bw, flops):
    fl = 2 * n * k * lq * ld * DIM
    return max(workload_bytes(kind, n, k, lq, ld) / bw, fl / flops) * 1e3


def copy_floor(nbytes):
    """The byte floor timed the way the table is: a device copy moving the
    workload's bytes (half read, half written), under do_bench and in a
    CUDA graph. do_bench adds a few microseconds of its own to every call,
    which matters for workloads near 25 us."""
    x = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t, tg = bench(lambda: y.copy_(x)), graph_ms(lambda: y.copy_(x))
    del x, y
    return t, tg


def run_forward(ms, pe, only, bw, flops):
    rows = []
    print(f"{'workload':<16} {'impl':<14} {'ms':>8} {'graph ms':>8} {'floor':>7} {'peak MiB':>9} {'relerr':>9}")
    for name, (kind, n, k, lq, ld) in FORWARD.items():
        if only and name not in only:
            continue
        Q, D = make_inputs(kind, n, k, lq, ld)
        ref = reference(Q, D, kind)
        fl = floor_ms(kind, n, k, lq, ld, bw, flops)
        cp, cpg = copy_floor(workload_bytes(kind, n, k, lq, ld))
        print(f"{name:<16} {'copy (bytes)':<14} {cp:8.4f} {cpg:8.4f}")
        for impl, fn in implementations(ms, kind, pe).items():
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                out = fn(Q, D)
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                out = out.reshape(Q.shape[0], -1)[:, : ref.shape[1]]
                err = ((out.double() - ref).norm() / ref.norm()).item()
                max_err = ((out.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
                if not err < 1e-2:
                    print(f"{name:<16} {impl:<14} WRONG relerr {err:.2e}")
                    rows.append(dict(workload=name, impl=impl, dtype=dtype_label(), ms=None, peak_mib=peak, relerr=err))
                    continue
                del out
                t = eager_ms(lambda: fn(Q, D))
                tg = graph_ms(lambda: fn(Q, D))
            except torch.cuda.OutOfMemoryError:
                print(f"{name:<16} {impl:<14} out of memory")
                rows.append(dict(workload=name, impl=impl, dtype=dtype_label(), ms=None, error="oom"))
                torch.cuda.empty_cache()
                continue
            except Exception as e:  # noqa: BLE001
                print(f"{name:<16} {impl:<14} failed: {type(e).__name__}: {str(e)[:80]}")
                rows.append(dict(workload=name, impl=impl, dtype=dtype_label(), ms=None, error=str(e)[:200]))
                continue
            gs = "-" if tg is None else f"{tg:.4f}"
            print(f"{name:<16} {impl:<14} {t:8.4f} {gs:>8} {fl:7.4f} {peak:9.1f} {err:9.1e}", flush=True)
            rows.append(dict(workload=name, impl=impl, dtype=dtype_label(), ms=t, graph_ms=tg, floor_ms=fl,
                             copy_ms=cp, copy_graph_ms=cpg, peak_mib=peak, relerr=err,
                             max_relerr=max_err))
        del Q, D, ref
        torch.cuda.empty_cache()
    return rows


def train_impls(ms, pe, kind="shared"):
    """Differentiable calls per implementation. lik's ``maxsim`` and
    flash-maxsim's ``flash_maxsim_batched_train(shared_docs=False)`` are
    their per-query candidate (KD) entry points for ``padded``."""
    grid = "qid,njd->qnij" if kind == "shared" else "qid,qkjd->qkij"
    impls = maxsim_variants(lambda p: lambda Q, D: ms.maxsim(Q, D, precision=p))
    impls["naive"] = lambda Q, D: torch.einsum(grid, Q, D).amax(-1).float().sum(-1)
    if "lik" in pe:
        impls["lik"] = lambda Q, D: pe["lik"].maxsim(Q, D)
    if "flash-maxsim" in pe:
        shared = kind == "shared"
        impls["flash-maxsim"] = lambda Q, D: pe["flash-maxsim"].flash_maxsim_batched_train(Q, D, shared_docs=shared)
    return impls


def train_rows():
    """(name, kind, Nq, Nd or K, Lq, Ld) of every training row."""
    return ([(n, "shared", *v) for n, v in TRAIN.items()]
            + [(n, "padded", *v) for n, v in TRAIN_GROUPED.items()])


def run_train(ms, pe, only):
    rows = []
    print(f"{'train workload':<18} {'impl':<14} {'fwd+bwd ms':>10} {'graph ms':>8} {'retained MiB':>12} {'peak MiB':>9} {'grad err':>9}")
    for name, kind, nq, nb, lq, ld in train_rows():
        if only and name not in only:
            continue
        Q0, D0 = make_inputs(kind, nq, nb, lq, ld)
        g = torch.randn(nq, nb, device="cuda")
        ref = None
        if nq * nb * lq * ld <= 2**26:
            Qr, Dr = Q0.double().requires_grad_(), D0.double().requires_grad_()
            grid = "qid,njd->qnij" if kind == "shared" else "qid,qkjd->qkij"
            (torch.einsum(grid, Qr, Dr).amax(-1).sum(-1) * g.double()).sum().backward()
            ref = (Qr.grad, Dr.grad)
            del Qr, Dr
        for impl, fn in train_impls(ms, pe, kind).items():
            Q = Q0.clone().requires_grad_()
            D = D0.clone().requires_grad_()
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                s = fn(Q, D)
                torch.cuda.synchronize()
                retained = (torch.cuda.memory_allocated() - base - s.numel() * s.element_size()) / 2**20
                if retained < 0:  # the call freed memory allocated before it (a cache): not measurable this way
                    retained = None
                s.backward(g)
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                err = None
                if ref is not None:
                    err = max(((Q.grad.double() - ref[0]).norm() / ref[0].norm()).item(),
                              ((D.grad.double() - ref[1]).norm() / ref[1].norm()).item())
                    # naive rounds the similarity grid to bf16: coarse but not wrong
                    if not err < (0.2 if impl == "naive" else 2e-2):
                        print(f"{name:<18} {impl:<14} WRONG grad relerr {err:.2e}")
                        rows.append(dict(workload=name, impl=impl, dtype=dtype_label(), fwd_bwd_ms=None, relerr=err))
                        continue
                del s

                def step():
                    Q.grad = D.grad = None
                    fn(Q, D).backward(g)

                t = eager_ms(step)
                tg = graph_ms(step, calls=5)
            except torch.cuda.OutOfMemoryError:
                print(f"{name:<18} {impl:<14} out of memory")
                rows.append(dict(workload=name, impl=impl, dtype=dtype_label(), fwd_bwd_ms=None, error="oom"))
                Q = D = None
                torch.cuda.empty_cache()
                continue
            except Exception as e:  # noqa: BLE001
                print(f"{name:<18} {impl:<14} failed: {type(e).__name__}: {str(e)[:80]}")
                rows.append(dict(workload=name, impl=impl, dtype=dtype_label(), fwd_bwd_ms=None, error=str(e)[:200]))
                continue
            es = "-" if err is None else f"{err:.1e}"
            gs = "-" if tg is None else f"{tg:.4f}"
            rs = "-" if retained is None else f"{retained:.2f}"
            print(f"{name:<18} {impl:<14} {t:10.4f} {gs:>8} {rs:>12} {peak:9.1f} {es:>9}", flush=True)
            rows.append(dict(workload=name, impl=impl, dtype=dtype_label(), fwd_bwd_ms=t, fwd_bwd_graph_ms=tg,
                             retained_mib=retained, peak_mib=peak, relerr=err))
            Q = D = None
        torch.cuda.empty_cache()
    return rows


COLD = r"""
import os, sys, time, torch
impl = sys.argv[1]
Q = torch.randn(32, 32, 128, device="cuda", dtype=torch.bfloat16)
D = torch.randn(1000, 300, 128, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
t0 = time.perf_counter()
if impl == "maxsim":
    import kernels; from pathlib import Path
    ms = kernels.get_local_kernel(Path(sys.argv[2])); f = lambda: ms.maxsim(Q, D)
elif impl == "lik":
    import late_interaction_kernels as lik; f = lambda: lik.maxsim(Q, D)
elif impl == "flash-maxsim":
    import flash_maxsim as fm; f = lambda: fm.flash_maxsim_batched(Q, D)
else:
    f = lambda: torch.einsum("qid,njd->qnij", Q, D).amax(-1).float().sum(-1)
t1 = time.perf_counter()
f(); torch.cuda.synchronize(); t2 = time.perf_counter()
f(); torch.cuda.synchronize(); t3 = time.perf_counter()
print((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)
"""


def cold_start(impls):
    """Fresh process per impl (torch and CUDA already initialised): load =
    import / kernels.get_local_kernel, first call = the first call after it
    (Triton peers compile here), second call for comparison."""
    rows = []
    for impl in impls:
        env = dict(os.environ, TRITON_CACHE_DIR=f"/tmp/triton-cold-{impl}-{time.time_ns()}", HF_HUB_OFFLINE="1")
        r = subprocess.run([sys.executable, "-c", COLD, impl, str(ROOT)], capture_output=True, text=True, env=env)
        if r.returncode:
            print(f"cold start {impl}: failed {r.stderr.strip()[-200:]}")
            continue
        load, first, second = map(float, r.stdout.split()[-3:])
        print(f"cold start {impl:<14} load {load:8.1f} ms   first call {first:9.1f} ms   second {second:7.2f} ms")
        rows.append(dict(workload="cold-start 32x1000 Lq32 Ld300", impl=impl, dtype=dtype_label(),
                         load_ms=load, first_call_ms=first, second_call_ms=second))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--cold-start", action="store_true")
    ap.add_argument("--train", action="store_true", help="also the training (fwd+bwd) rows")
    ap.add_argument("--out", default="")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_NAMES), help="token dtype of every row")
    ap.add_argument("--force", default="", help="run maxsim's forward in this kernel family where it can "
                    "(maxsim.forcing: stream, stream_wg, mma, wgmma, simt)")
    args = ap.parse_args()
    global DTYPE
    DTYPE = DTYPE_NAMES[args.dtype]
    only = set(filter(None, args.only.split(",")))
    ms = load_maxsim()
    if args.force:
        ms.forcing(args.force).__enter__()  # for the whole run
    pe = peers()
    gpu = torch.cuda.get_device_name()
    bw, flops = ceilings()
    print(f"{gpu}, torch {torch.__version__}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    def save(rows):  # after each part, so that a run cut short keeps what it measured
        write_results(rows, args.out, "" if DTYPE == torch.bfloat16 else "-" + dtype_label(),
                      copy_tb_s=bw / 1e12, matmul_tflop_s=flops / 1e12, dtype=dtype_label())

    rows = run_forward(ms, pe, only, bw, flops)
    save(rows)
    if args.train:
        rows += run_train(ms, pe, only)
        save(rows)
    if args.cold_start:
        rows += cold_start(["naive", "maxsim"] + list(pe))
        save(rows)


def write_results(rows, out, suffix: str, **meta) -> None:
    """bench_results/<gpu><suffix>.json (or ``out``): {"meta": {gpu, torch,
    date, commit (MAXSIM_COMMIT or git HEAD), **meta}, "rows": rows}."""
    gpu = torch.cuda.get_device_name()
    commit = os.environ.get("MAXSIM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    meta = dict(gpu=gpu, torch=torch.__version__, date=datetime.date.today().isoformat(), commit=commit, **meta)
    out = Path(out or ROOT / "bench_results" / f"{gpu.lower().replace(' ', '-')}{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
