"""Many short documents: maxsim vs late-interaction-kernels (lik) and
flash-maxsim on the same inputs in one process (bf16, Lq 32, d 128).

Rows: shared padded documents (``maxsim.maxsim(Q, D)``; lik ``maxsim``,
flash-maxsim ``flash_maxsim_batched``), packed ragged documents of 4-48
tokens (``score_contrastive``; lik ``maxsim_varlen``, flash-maxsim
``flash_maxsim_packed`` for one query), per-query candidates with
document lengths (``score_candidates_padded``; lik ``maxsim`` with a
document mask), and training steps (forward with argmax + backward) over
short documents beside a long-document step (rows ``"pass": "fwd+bwd"``,
floor = the forward's FLOPs at the matmul rate). Where the planner does not pick the packed short-document
kernel, ``maxsim-packed`` times it forced (``maxsim.forcing("packed")``).
Every output is checked against an fp64 reference on its first documents
before it is timed. Timing and the floors (bytes / measured copy bandwidth,
FLOPs / measured bf16 matmul rate) are bench_gpu.py's. Writes
``{"meta": {...}, "rows": [{workload, nq, nd, ld, impl, ms, graph_ms,
floor_ms, relerr}]}`` to ``--out`` (default
``bench_results/<gpu>-short-docs.json``).

    python benchmarks/bench_short_docs.py [--only "32x50000 Ld8,packed Nq32"] [--out x.json]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import ceilings, eager_ms, graph_ms, load_maxsim, peers, write_results  # noqa: E402

DIM, LQ = 128, 32
DTYPE = torch.bfloat16
CHECK = 256  # documents (per query for candidates) checked against fp64
# (Nq, Nd, Ld) of shared padded documents.
SHARED = [(1, 200000, 8), (1, 200000, 16), (1, 100000, 32), (1, 50000, 64), (32, 50000, 8), (32, 50000, 16),
          (32, 50000, 32), (32, 25000, 64), (32, 12500, 128), (128, 20000, 16)]
PACKED = [(1, 100000), (32, 100000)]  # (Nq, Nd) of packed documents of 4-48 tokens
CANDIDATES = (64, 1000, 24)  # B, K, Ld (lengths 1..Ld)
# Training steps (forward with argmax + backward) of Nq queries x Nd shared
# documents: short documents against a long-document step, per FLOP.
TRAIN = [(256, 256, 16), (256, 256, 32), (256, 256, 48), (256, 256, 300)]


def unit(*shape, g):
    x = torch.randn(*shape, device="cuda", generator=g)
    return torch.nn.functional.normalize(x, dim=-1).to(DTYPE)


def floor_ms(doc_tokens, nq, pairs_tokens, bw, flops):
    """max(bytes / copy rate, FLOPs / matmul rate): documents and queries read
    once, fp32 scores written; 2 * Lq * d FLOPs per (query, document token)."""
    esz = torch.finfo(DTYPE).bits // 8
    nbytes = esz * DIM * (doc_tokens + nq * LQ) + 4 * pairs_tokens[0]
    return max(nbytes / bw, 2 * LQ * DIM * pairs_tokens[1] / flops) * 1e3


def shared_case(nq, nd, ld):
    g = torch.Generator(device="cuda").manual_seed(nq * 7 + ld)
    Q, D = unit(nq, LQ, DIM, g=g), unit(nd, ld, DIM, g=g)
    ref = torch.einsum("qid,njd->qnij", Q.double(), D[:CHECK].double()).amax(-1).sum(-1)
    return (Q, D), ref, (nd * ld, nq, (nq * nd, nq * nd * ld))


def shared_impls(ms, pe):
    impls = {"maxsim": lambda Q, D: ms.maxsim(Q, D)}
    if "lik" in pe:
        impls["lik"] = lambda Q, D: pe["lik"].maxsim(Q, D)
    if "flash-maxsim" in pe:
        impls["flash-maxsim"] = lambda Q, D: pe["flash-maxsim"].flash_maxsim_batched(Q, D)
    return impls


def packed_case(nq, nd):
    g = torch.Generator(device="cuda").manual_seed(nq + nd)
    lens = torch.randint(4, 49, (nd,), device="cuda", generator=g)
    off = torch.zeros(nd + 1, dtype=torch.long, device="cuda")
    off[1:] = lens.cumsum(0)
    Q, d = unit(nq, LQ, DIM, g=g), unit(int(off[-1]), DIM, g=g)
    # fp64 reference of the first CHECK documents, padded.
    lc = lens[:CHECK].cpu()
    Dp = torch.zeros(CHECK, 48, DIM, dtype=torch.float64, device="cuda")
    mask = torch.arange(48)[None, :] < lc[:, None]
    Dp[mask.cuda()] = d[: int(off[CHECK])].double()
    sims = torch.einsum("qid,njd->qnij", Q.double(), Dp).masked_fill(~mask.cuda()[None, :, None, :], float("-inf"))
    ref = sims.amax(-1).sum(-1)
    cu_q = torch.arange(0, (nq + 1) * LQ, LQ, device="cuda", dtype=torch.int32)
    return (Q, d, off, cu_q), ref, (int(off[-1]), nq, (nq * nd, nq * int(off[-1])))


def packed_impls(ms, pe, nq):
    impls = {"maxsim": lambda Q, d, off, cu_q: ms.score_contrastive(Q, d, off)}
    if "lik" in pe and hasattr(pe["lik"], "maxsim_varlen"):
        impls["lik"] = lambda Q, d, off, cu_q: pe["lik"].maxsim_varlen(
            Q.reshape(-1, DIM), d, cu_q, off.int(), LQ, 48)
    if "flash-maxsim" in pe and nq == 1 and hasattr(pe["flash-maxsim"], "flash_maxsim_packed"):
        impls["flash-maxsim"] = lambda Q, d, off, cu_q: pe["flash-maxsim"].flash_maxsim_packed(
            Q[0], d, off.int(), 48)[None]
    return impls


def candidates_case(b, k, ld):
    g = torch.Generator(device="cuda").manual_seed(b + k)
    Q, D = unit(b, LQ, DIM, g=g), unit(b, k, ld, DIM, g=g)
    dlen = torch.randint(1, ld + 1, (b, k), device="cuda", generator=g)
    dm = torch.arange(ld, device="cuda")[None, None, :] < dlen[..., None]
    sims = torch.einsum("bid,bkjd->bkij", Q.double(), D[:, :CHECK].double())
    ref = sims.masked_fill(~dm[:, :CHECK, None, :], float("-inf")).amax(-1).sum(-1)
    return (Q, D, dlen, dm), ref, (b * k * ld, b, (b * k, b * k * ld))


def candidates_impls(ms, pe):
    impls = {"maxsim": lambda Q, D, dlen, dm: ms.score_candidates_padded(Q, D, None, dlen)}
    if "lik" in pe:
        impls["lik"] = lambda Q, D, dlen, dm: pe["lik"].maxsim(Q, D, d_mask=dm)
    return impls


def workloads():
    """Several queries first, then per-query candidates, then one query."""
    b, k, ld = CANDIDATES
    rows = [(f"{nq}x{nd} Ld{ld}", nq, nd, ld, (lambda a=(nq, nd, ld): shared_case(*a)), "shared")
            for nq, nd, ld in SHARED]
    rows += [(f"packed {nd} docs 4-48 Nq{nq}", nq, nd, "4-48", (lambda a=(nq, nd): packed_case(*a)), "packed")
             for nq, nd in PACKED]
    rows.append((f"candidates B{b} K{k} Ld{ld} lengths", b, k, ld, lambda: candidates_case(b, k, ld), "candidates"))
    return sorted(rows, key=lambda r: (r[1] == 1, r[5] == "candidates"))


def run_train(ms, pe, flops, only):
    """fwd+bwd rows: ms / graph_ms of a step, floor_ms = the forward's FLOPs
    at the matmul rate (the backward adds gathers, not FLOPs)."""
    rows = []
    for nq, nd, ld in TRAIN:
        name = f"train {nq}x{nd} Ld{ld}"
        if only and name not in only:
            continue
        g = torch.Generator(device="cuda").manual_seed(ld)
        Q0, D0 = unit(nq, LQ, DIM, g=g), unit(nd, ld, DIM, g=g)
        gs = torch.randn(nq, nd, device="cuda", generator=g)
        fl = 2 * nq * nd * LQ * ld * DIM / flops * 1e3
        impls = {"maxsim": lambda Q, D: ms.maxsim(Q, D)}
        if "lik" in pe:
            impls["lik"] = lambda Q, D: pe["lik"].maxsim(Q, D)
        for impl, fn in impls.items():
            Q, D = Q0.clone().requires_grad_(), D0.clone().requires_grad_()

            def step():
                Q.grad = D.grad = None
                fn(Q, D).backward(gs)

            try:
                t, tg = eager_ms(step, rounds=3), graph_ms(step, calls=5)
            except Exception as e:  # noqa: BLE001
                print(f"{name:<34} {impl:<14} failed: {type(e).__name__}: {str(e)[:100]}")
                continue
            fam = ms.explain(Q, D)["family"] if impl == "maxsim" else ""
            gss = "-" if tg is None else f"{tg:.4f}"
            print(f"{name:<34} {impl:<14} {t:8.4f} {gss:>9} {fl:7.4f} {'':>9}  {fam}", flush=True)
            rows.append({"workload": name, "nq": nq, "nd": nd, "ld": ld, "impl": impl, "pass": "fwd+bwd", "ms": t,
                         "graph_ms": tg, "floor_ms": fl, "family": fam or None})
    return rows


def time_impl(fn, args, ref, check_cols):
    out = fn(*args)
    torch.cuda.synchronize()
    out = out.reshape(ref.shape[0], -1)[:, :check_cols].double()
    err = ((out - ref).norm() / ref.norm()).item()
    if not err < 1e-2:
        return None, None, err
    return eager_ms(lambda: fn(*args), rounds=3), graph_ms(lambda: fn(*args)), err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated workload names")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    ms = load_maxsim()
    pe = peers()
    gpu = torch.cuda.get_device_name()
    bw, flops = ceilings()
    print(f"{gpu}, torch {torch.__version__}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    print(f"{'workload':<34} {'impl':<14} {'ms':>8} {'graph ms':>9} {'floor':>7} {'relerr':>9}  plan")
    out = args.out or str(Path(__file__).resolve().parent.parent / "bench_results"
                          / f"{gpu.lower().replace(' ', '-')}-short-docs.json")

    def save(rows):  # after each workload, so that a run cut short keeps what it measured
        write_results(rows, out, "", copy_tb_s=bw / 1e12, matmul_tflop_s=flops / 1e12, dtype="bf16", lq=LQ, dim=DIM)

    rows = []
    for name, nq, nd, ld, make, kind in workloads():
        if only and name not in only:
            continue
        inputs, ref, (doc_tokens, nqq, pairs_tokens) = make()
        fl = floor_ms(doc_tokens, nqq, pairs_tokens, bw, flops)
        impls = {"shared": lambda: shared_impls(ms, pe), "packed": lambda: packed_impls(ms, pe, nq),
                 "candidates": lambda: candidates_impls(ms, pe)}[kind]()
        # explain() plans padded tensors; the packed rows follow the same rule (several queries: packed).
        plan = ms.explain(inputs[0], inputs[1]) if kind != "packed" else {"family": "packed" if nq > 1 else "stream"}
        # The packed kernel forced where the planner takes another family.
        forced = {"maxsim-packed": "packed"} if plan.get("family") != "packed" else {}
        impls.update({name_: impls["maxsim"] for name_ in forced})
        for impl, fn in impls.items():
            try:
                with ms.forcing(forced[impl]) if impl in forced else contextlib.nullcontext():
                    t, tg, err = time_impl(fn, inputs, ref, ref.shape[1])
            except Exception as e:  # noqa: BLE001
                print(f"{name:<34} {impl:<14} failed: {type(e).__name__}: {str(e)[:100]}")
                rows.append(dict(workload=name, nq=nq, nd=nd, ld=ld, impl=impl, ms=None, error=str(e)[:200]))
                torch.cuda.empty_cache()
                continue
            if t is None:
                print(f"{name:<34} {impl:<14} WRONG relerr {err:.2e}")
                rows.append(dict(workload=name, nq=nq, nd=nd, ld=ld, impl=impl, ms=None, relerr=err))
                continue
            gs = "-" if tg is None else f"{tg:.4f}"
            fam = plan.get("family", "") if impl == "maxsim" else ""
            print(f"{name:<34} {impl:<14} {t:8.4f} {gs:>9} {fl:7.4f} {err:9.1e}  {fam}", flush=True)
            rows.append(dict(workload=name, nq=nq, nd=nd, ld=ld, impl=impl, ms=t, graph_ms=tg, floor_ms=fl,
                             relerr=err, family=fam or None))
        del inputs, ref
        torch.cuda.empty_cache()
        save(rows)
    rows += run_train(ms, pe, flops, only)
    save(rows)


if __name__ == "__main__":
    main()
