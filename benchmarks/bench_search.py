"""Corpus search benchmark (GPU): maxsim.search (bf16 / int8 / fp8, resident
and pinned-streamed corpora) side by side with late-interaction-kernels'
``retrieve`` and flash-maxsim's ``flash_maxsim_topk`` (INT8 coarse scan +
fp16 re-score), plus top-10 / top-100 agreement of every approximate path
with the exact bf16 result on random and clustered data. Prints a table and
writes ``bench_results/<gpu>-search.json``.

    python benchmarks/bench_search.py            # the full matrix
    python benchmarks/bench_search.py --quick    # small sizes only
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from bench_gpu import graph_ms, load_maxsim as load, peers, write_results  # the matrix script's helpers

D = 128


def timed(fn, reps=20, warmup=3):
    """Median ms over reps (CUDA events; the inputs stay resident)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def make_docs(n, ld, kind, gen, out=None, dtype=torch.bfloat16):
    """[n, ld, D] unit tokens on the GPU, generated in blocks (in place into
    ``out`` when given). clustered: 512 topics, tokens = topic + noise."""
    docs = out if out is not None else torch.empty((n, ld, D), dtype=dtype, device="cuda")
    cent = torch.nn.functional.normalize(torch.randn(512, D, device="cuda", generator=gen), dim=-1)
    step = max(1, (1 << 27) // (ld * D))
    for i in range(0, n, step):
        m = min(step, n - i)
        x = torch.randn(m, ld, D, device="cuda", generator=gen)
        if kind == "clustered":
            topic = torch.randint(0, 512, (m, 1), device="cuda", generator=gen)
            x = cent[topic].expand(m, ld, D) * 4.0 + x / D ** 0.5 * 4.0
        docs[i:i + m] = torch.nn.functional.normalize(x, dim=-1).to(docs.dtype)
    return docs, cent


def make_queries(nq, lq, kind, cent, gen):
    x = torch.randn(nq, lq, D, device="cuda", generator=gen)
    if kind == "clustered":
        topic = torch.randint(0, 512, (nq, 1), device="cuda", generator=gen)
        x = cent[topic].expand(nq, lq, D) * 4.0 + x / D ** 0.5 * 4.0
    return torch.nn.functional.normalize(x, dim=-1).to(torch.bfloat16)


def agreement(ids, ref, k):
    ids, ref = ids[..., :k].reshape(-1, k).cpu(), ref[..., :k].reshape(-1, k).cpu()
    hit = [len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(ids, ref)]
    return sum(hit) / len(hit)


def h2d_bandwidth():
    x = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    y = torch.empty_like(x, device="cuda")
    ms = timed(lambda: y.copy_(x, non_blocking=True), reps=5, warmup=1)
    del x, y
    return (1 << 30) / ms / 1e6  # GB/s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-stream", action="store_true")
    ap.add_argument("--skip-rescore", action="store_true")
    ap.add_argument("--skip-peers", action="store_true", help="maxsim rows only")
    ap.add_argument("--only", default=None, help="comma list of workload prefixes (and/or 'stream')")
    args = ap.parse_args()
    ms_ = load()
    P = {} if args.skip_peers else peers()
    rows = []

    def row(**kw):
        rows.append(kw)
        extra = " ".join(f"{k}={v}" for k, v in kw.items() if k not in ("workload", "impl", "ms"))
        print(f"{kw['workload']:>22} {kw['impl']:>14} {kw.get('ms', float('nan')):9.3f} ms  {extra}", flush=True)

    def graph(fn):
        """Per-call ms of 5 searches in one CUDA graph (device time, no host
        overhead); None when the path syncs (host-resident originals)."""
        t = graph_ms(fn, calls=5)
        return None if t is None else round(t, 4)

    def quant_row(wl, quant, qc, Qs, q1, ref_ids, t_bf, g_bf, impl=None, oversample=4):
        _, ids = ms_.search(Qs, qc, k, oversample=oversample)
        t = timed(lambda: ms_.search(q1, qc, k, oversample=oversample))
        host_orig = qc.originals is not None and qc.originals[0].device.type == "cpu"  # gathers: syncs
        g = None if host_orig else graph(lambda: ms_.search(q1, qc, k, oversample=oversample))
        extra = {} if g is None or g_bf is None else dict(graph_ms=g, vs_bf16_graph=round(g / g_bf, 3))
        row(workload=wl, impl=impl or f"maxsim-{quant}", ms=t, vs_bf16=round(t / t_bf, 3), **extra,
            top10=round(agreement(ids, ref_ids, 10), 4), top100=round(agreement(ids, ref_ids, 100), 4))

    gen = torch.Generator(device="cuda").manual_seed(0)
    k = 100
    # (name, Nd, Lq, Ld): search latency for one query; agreement over 32 queries.
    shapes = [("search-10k", 10_000, 32, 300), ("search-100k", 100_000, 32, 300),
              ("colpali-10k", 10_000, 1024, 1024)]
    if not args.quick:
        shapes += [("colpali-100k", 100_000, 32, 1024), ("search-1m", 1_000_000, 32, 300)]
    only = args.only.split(",") if args.only else None
    if only:
        shapes = [s for s in shapes if any(s[0].startswith(o) for o in only)]
    for name, nd, lq, ld in shapes:
        for data in (("random", "clustered") if nd <= 100_000 and lq == 32 else ("random",)):
            wl = f"{name}/{data}"
            torch.cuda.empty_cache()
            docs, cent = make_docs(nd, ld, data, gen)
            off = torch.arange(nd + 1, device="cuda", dtype=torch.int64) * ld
            flat = docs.view(nd * ld, D)
            Qs = make_queries(32, lq, data, cent, gen)
            q1 = Qs[0]
            base = torch.cuda.memory_allocated()
            corpus = ms_.Corpus(flat, off, device="cuda")
            ref_s, ref_ids = ms_.search(Qs, corpus, k)  # exact (bf16 inputs, fp32 accumulation)
            torch.cuda.reset_peak_memory_stats()
            t = timed(lambda: ms_.search(q1, corpus, k))
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            g_bf = graph(lambda: ms_.search(q1, corpus, k))
            row(workload=wl, impl="maxsim", ms=t, graph_ms=g_bf, peak_mib=round(peak, 1), top10=1.0, top100=1.0)
            t_bf = t
            big = nd * ld * D * 2 > 24 * 2**30  # bf16 and a quantised copy do not fit together
            staged = {}
            # (format, scale layout, impl): int8 per token (default) and per
            # document (the integer-max scan on sm_90), fp8 per document (default)
            variants = [("int8", None, None)] if big else [("int8", None, None),
                                                           ("int8", "document", "maxsim-int8-doc"),
                                                           ("fp8", None, None)]
            for quant, layout, impl in variants:  # host RAM holds one staged copy
                if big:  # quantise to the host now, score once the bf16 corpus is freed
                    vt = torch.int8 if quant == "int8" else torch.float8_e4m3fn
                    hv = torch.empty((nd * ld, D), dtype=vt)
                    hs = torch.empty((nd * ld,), dtype=torch.float32)
                    step = 1 << 22
                    for r in range(0, nd * ld, step):
                        v, sc = ms_.quantize_tokens(flat[r:r + step], quant)
                        hv[r:r + step].copy_(v)
                        hs[r:r + step].copy_(sc)
                    staged[quant] = (hv, hs)
                    continue
                qc = ms_.Corpus(flat, off, device="cuda", quantization=quant, scale_layout=layout)
                quant_row(wl, quant, qc, Qs, q1, ref_ids, t_bf, g_bf, impl=impl)
                del qc
                if quant == "int8" and not args.skip_rescore:
                    # tiered: int8 scan, exact re-score of 4 x k candidates from bf16
                    # originals kept on the GPU or in pinned host memory
                    for where in ("device", "pinned") if layout is None else ("device",):
                        qc = ms_.Corpus(flat, off, device="cuda", quantization=quant, rescore=where,
                                        scale_layout=layout)
                        quant_row(wl, quant, qc, Qs, q1, ref_ids, t_bf, g_bf,
                                  impl=f"{impl or 'maxsim-int8'}+rescore-{where}")
                        if layout == "document" and where == "device":  # the smallest re-score
                            quant_row(wl, quant, qc, Qs, q1, ref_ids, t_bf, g_bf,
                                      impl=f"{impl}+rescore-{where}-oversample1", oversample=1)
                        del qc
                        torch.cuda.empty_cache()
            if "lik" in P and nd * ld <= 100_000 * 1024:
                lik = P["lik"]
                try:
                    f = lambda: lik.retrieve(q1, docs, top_k=k, normalize=False, chunk=16384)
                    s, ids = lik.retrieve(Qs, docs, top_k=k, normalize=False, chunk=16384)
                    t = timed(f, reps=10)
                    row(workload=wl, impl="lik", ms=t, top10=round(agreement(ids, ref_ids, 10), 4),
                        top100=round(agreement(ids, ref_ids, 100), 4))
                except Exception as e:  # noqa: BLE001
                    row(workload=wl, impl="lik", error=str(e)[:120])
            if "flash-maxsim" in P and nd * ld <= 10_000 * 1024:
                fm = P["flash-maxsim"]
                try:
                    dh = docs.to(torch.float16)
                    d8, sc, mn = fm.quantize_int8(dh)
                    qh = Qs.to(torch.float16)
                    f = lambda: fm.flash_maxsim_topk(qh[0], dh, k, D_int8=d8, scales=sc, mins=mn)
                    ids = torch.stack([fm.flash_maxsim_topk(qh[i], dh, k, D_int8=d8, scales=sc, mins=mn)[1]
                                       for i in range(qh.shape[0])])
                    t = timed(f, reps=10)
                    row(workload=wl, impl="flash-maxsim", ms=t, top10=round(agreement(ids, ref_ids, 10), 4),
                        top100=round(agreement(ids, ref_ids, 100), 4))
                    del dh, d8, sc, mn
                except Exception as e:  # noqa: BLE001
                    row(workload=wl, impl="flash-maxsim", error=str(e)[:120])
            del docs, flat, corpus
            gc.collect()
            torch.cuda.empty_cache()
            for quant, (hv, hs) in staged.items():
                qc = ms_.Corpus(hv, off.cpu(), scales=hs, device="cuda")
                quant_row(wl, quant, qc, Qs, q1, ref_ids, t_bf, g_bf)
                del qc
                torch.cuda.empty_cache()
            del staged, Qs

    if not args.skip_stream and not args.quick and (only is None or "stream" in only):
        # Pinned-host corpus streamed through a capped GPU allocator: an int8
        # corpus of 300k docs (11.5 GB) against 2 GiB of GPU memory (the
        # machine would not pin 38 GB for the 1M-doc corpus).
        torch.cuda.empty_cache()
        bw = h2d_bandwidth()
        nd, ld = 300_000, 300
        host = torch.empty((nd * ld, D), dtype=torch.int8).pin_memory()
        scales = torch.empty((nd * ld,), dtype=torch.float32).pin_memory()
        step = 20_000
        cent = None
        for i in range(0, nd, step):
            x, cent = make_docs(step, ld, "random", gen, dtype=torch.float32)
            v, s = ms_.quantize_tokens(x.view(-1, D), "int8")
            host[i * ld:(i + step) * ld].copy_(v)
            scales[i * ld:(i + step) * ld].copy_(s)
        torch.cuda.synchronize()
        del x, v, s
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(2 * 2**30 / total)
        off = torch.arange(nd + 1, dtype=torch.int64) * ld
        torch.cuda.reset_peak_memory_stats()
        pc = ms_.Corpus(host, off, scales=scales, storage="pinned", chunk_mib=512)
        q = make_queries(1, 32, "random", cent, gen)
        ms_.search(q, pc, k)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reps = 3
        for _ in range(reps):
            ms_.search(q, pc, k)
        torch.cuda.synchronize()
        t = (time.perf_counter() - t0) / reps * 1e3
        gb = host.numel() / 1e9
        row(workload="stream-300k-int8", impl="maxsim-int8-pinned", ms=t, corpus_gb=round(gb, 2),
            gpu_cap_gib=2, gbps=round(gb / (t / 1e3), 1), h2d_gbps=round(bw, 1),
            peak_mib=round(torch.cuda.max_memory_allocated() / 2**20, 1))

    write_results(rows, args.out, "-search", k=k, dim=D,
                  timing=("median of CUDA-event times per call (ms) and per-call time of 5 calls in one "
                          "CUDA graph (graph ms), one query, inputs resident"))


if __name__ == "__main__":
    sys.exit(main())
