"""PLAID / ColBERTv2 compressed corpora and the projection head, every
implementation side by side in one process: maxsim's ops, late-interaction-
kernels' (``plaid``, ``fused_head``) and the plain compositions.

Rows (``workload``, ``impl``, ``ms``, and per row ``floor_ms`` / recall / bytes):
- rerank-<docs>-<nbits>b: 1 query x docs of 300 tokens, decompress + MaxSim
  (flat cu_seqlens layout; the peer's padded one too);
- approx-<docs>: PLAID's centroid scores over docs of 300 tokens (maxsim-fp16-table:
  the same scan of the fp16 table PlaidIndex.search scans);
- search-<docs>[-ld<tokens>]-<nbits>b: top-100 search on a plaid corpus vs
  exact bf16 search (latency of one query; recall@10 / @100 over 64 queries;
  bytes per token) on a planted corpus (:func:`planted`: topics, words,
  noisy tokens; queries drawn from a target document, :func:`planted_queries`),
  re-scoring the decompressed tokens or the kept originals (``+rescore``),
  with the default candidates (``max(4 k, 256)``), 1024, PLAID's centroid
  pruning (``-t0.5``: ``centroid_threshold=0.5``) or the inverted lists
  (``-p4``). Two corpora: 100k documents of 300 tokens (30M tokens,
  exact bf16 7.7 GB) and 1M documents of 32 tokens (the same 32M tokens
  spread over a million documents: 1M documents of 300 tokens need 77 GB of
  bf16 for the exact baseline and the originals, and their build
  -- nearest of 2^18 centroids for 3e8 tokens -- takes minutes);
- head-fwd / head-train: MaxSim from hidden states [Nd, Ld, 768] through a
  768 -> 128 head, forward and forward + backward (1 x 1000 x 300, 32 x 32
  x 180, 1 x 10000 x 300); ms eager, graph_ms the same calls in a CUDA graph
  (device time).

    python benchmarks/bench_plaid.py                 # GPU, the issue's sizes
    python benchmarks/bench_plaid.py --tiny          # seconds, CPU or GPU
    python benchmarks/bench_plaid.py --out $OUT/x.json
    python benchmarks/bench_plaid.py --only search --search 1000000x300

Prints rows as they are measured and writes the JSON after every section:
bench_results/<gpu>-plaid.json (``cpu-plaid.json`` on the CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import graph_ms, load_maxsim, write_results  # noqa: E402

D = 128
LD = 300
LQ = 32


def timer(dev):
    def run(fn, reps=10, warmup=2):
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(reps):
            if dev.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
        return round(statistics.median(ts), 4)
    return run


def bandwidth(dev):
    if dev.type != "cuda":
        return None
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = timer(dev)(lambda: y.copy_(x), reps=5)
    return 2 * (1 << 30) / ms / 1e6  # GB/s = bytes / ms / 1e6


def compressed_docs(n, nbits, C, dev, gen):
    """Random compressed documents of LD tokens (flat layout) + tables."""
    T = n * LD
    codes = torch.randint(0, C, (T,), device=dev, generator=gen, dtype=torch.int32)
    P = (D * nbits + 7) // 8
    res = torch.randint(0, 256, (T, P), device=dev, generator=gen, dtype=torch.int32).to(torch.uint8)
    cent = F.normalize(torch.randn(C, D, device=dev, generator=gen), dim=-1)
    bw = torch.sort(torch.randn(1 << nbits, device=dev, generator=gen) * 0.05).values
    cu = torch.arange(n + 1, device=dev, dtype=torch.int32) * LD
    return codes, res, cent, bw, cu


def row(rows, workload, impl, ms, **extra):
    r = dict(workload=workload, impl=impl, ms=ms, **extra)
    rows.append(r)
    extras = " ".join(f"{k}={v}" for k, v in extra.items())
    print(f"{workload:<22} {impl:<26} {ms:>10.4f} ms  {extras}", flush=True)


def try_row(rows, workload, impl, fn, run, **extra):
    try:
        row(rows, workload, impl, run(fn), **extra)
    except Exception as e:  # noqa: BLE001 -- a peer failing on a shape is a result, not a crash
        print(f"{workload:<22} {impl:<26} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        rows.append(dict(workload=workload, impl=impl, ms=None, error=f"{type(e).__name__}"))


def bench_rerank(ms, lik, rows, dev, run, sizes, bw_gbs):
    gen = torch.Generator(device=dev).manual_seed(0)
    Q = F.normalize(torch.randn(1, LQ, D, device=dev, generator=gen), dim=-1)
    for n in sizes:
        for nbits in (2, 4):
            codes, res, cent, bw, cu = compressed_docs(n, nbits, 1 << 14, dev, gen)
            wl = f"rerank-{n}-{nbits}b"
            nbytes = codes.numel() * 4 + res.numel()
            floor = round(nbytes / bw_gbs / 1e6, 4) if bw_gbs else None
            try_row(rows, wl, "maxsim", lambda: ms.plaid.maxsim_residual_varlen(Q, codes, res, cu, cent, bw, nbits),
                    run, floor_ms=floor, bytes_per_token=4 + res.shape[1])
            if lik is not None:
                from late_interaction_kernels import plaid as lp

                try_row(rows, wl, "lik-varlen",
                        lambda: lp.maxsim_residual_varlen(Q, codes, res, cu, cent, bw, nbits, max_seqlen_d=LD), run)
                pc, pr = codes.view(n, LD), res.view(n, LD, -1)
                lens = torch.full((n,), LD, device=dev, dtype=torch.int64)
                try_row(rows, wl, "lik-padded", lambda: lp.maxsim_residual(Q, pc, pr, lens, cent, bw, nbits), run)
            dec = ms.plaid.decompress(codes, res, cent, bw, nbits)
            dec = F.normalize(dec, dim=-1).to(torch.bfloat16 if dev.type == "cuda" else torch.float32).view(n, LD, D)
            qd = Q.to(dec.dtype)
            try_row(rows, wl, "maxsim-decompressed-bf16", lambda: ms.maxsim(qd, dec), run)
            del codes, res, dec


def bench_approx(ms, lik, rows, dev, run, n, bw_gbs):
    gen = torch.Generator(device=dev).manual_seed(1)
    C = 1 << 16 if dev.type == "cuda" else 1 << 10
    codes = torch.randint(0, C, (n * LD,), device=dev, generator=gen, dtype=torch.int32)
    cu = torch.arange(n + 1, device=dev, dtype=torch.int32) * LD
    qcs = torch.randn(C, LQ, device=dev, generator=gen)
    wl = f"approx-{n}"
    floor = round(codes.numel() * 4 / bw_gbs / 1e6, 4) if bw_gbs else None
    try_row(rows, wl, "maxsim", lambda: ms.plaid.approx_scores(qcs, codes, cu_seqlens=cu), run, floor_ms=floor)
    half = qcs.half()  # the table PlaidIndex.search scans
    try_row(rows, wl, "maxsim-fp16-table", lambda: ms.plaid.approx_scores(half, codes, cu_seqlens=cu), run,
            floor_ms=floor)
    if lik is not None:
        from late_interaction_kernels import plaid as lp

        lens = torch.full((n,), LD, device=dev, dtype=torch.int64)
        pc = codes.view(n, LD)
        try_row(rows, wl, "lik", lambda: lp.plaid_approx_score(qcs, pc, lens), run)


def planted(n, ld, dev, gen, topics_per_doc=4, words_per_topic=32, words_per_doc_topic=8, spread=0.5, noise=0.3):
    """A clustered corpus with a vocabulary, and queries drawn from it.

    Topics are random unit vectors, one per 7500 corpus tokens (4000 for
    100k documents of 300 tokens, each topic in about 100 documents); each
    topic has ``words_per_topic`` words, ``normalize(topic + spread * u)``
    (u a random unit vector: cosine 0.89 to the topic, 0.8 between words of
    a topic). A document takes ``topics_per_doc`` topics and
    ``words_per_doc_topic`` words of each; a token is one of its words plus
    noise, ``normalize(word + noise * u)`` (cosine 0.96 to the word).
    Returns the documents ``[n, ld, D]`` (bf16 on a GPU) and what
    :func:`planted_queries` needs."""
    T = n * ld
    topics = max(8, T // 7500)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tv = F.normalize(torch.randn(topics, D, device=dev, generator=gen), dim=-1)
    u = F.normalize(torch.randn(topics, words_per_topic, D, device=dev, generator=gen), dim=-1)
    words = F.normalize(tv[:, None] + spread * u, dim=-1).reshape(-1, D)  # word id = topic * W + w
    doc_topics = torch.randint(0, topics, (n, topics_per_doc), device=dev, generator=gen)
    doc_words = torch.randint(0, words_per_topic, (n, topics_per_doc, words_per_doc_topic), device=dev,
                              generator=gen)
    docs = torch.empty(n, ld, D, device=dev, dtype=dt)
    token_word = torch.empty(n, ld, device=dev, dtype=torch.int32)
    step = max(1, (1 << 25) // (ld * D))
    for i in range(0, n, step):
        m = min(step, n - i)
        slot = torch.randint(0, topics_per_doc, (m, ld), device=dev, generator=gen)
        pick = torch.randint(0, words_per_doc_topic, (m, ld), device=dev, generator=gen)
        t = doc_topics[i:i + m].gather(1, slot)
        w = doc_words[i:i + m].reshape(m, -1).gather(1, slot * words_per_doc_topic + pick)
        wid = t * words_per_topic + w
        x = words[wid] + noise * F.normalize(torch.randn(m, ld, D, device=dev, generator=gen), dim=-1)
        docs[i:i + m] = F.normalize(x, dim=-1).to(dt)
        token_word[i:i + m] = wid.to(torch.int32)
    return docs, dict(words=words, token_word=token_word, doc_topics=doc_topics, W=words_per_topic, noise=noise)


def planted_queries(world, nq, dev, gen, expand=0.25):
    """Queries of LQ tokens, each relevant to one target document as in a
    ColBERT evaluation: three quarters of the tokens are words of random
    tokens of the target (re-noised, as a paraphrase), the rest other words
    of the target's topics (query expansion). The target ranks first and the
    rest of the top-10 are documents sharing its topics and words, so the
    top-10 is separated rather than a draw among near-ties."""
    tw, words, W = world["token_word"], world["words"], world["W"]
    n, ld = tw.shape
    target = torch.randint(0, n, (nq,), device=dev, generator=gen)
    wid = tw[target[:, None], torch.randint(0, ld, (nq, LQ), device=dev, generator=gen)].long()
    topic = world["doc_topics"][target[:, None],
                                torch.randint(0, world["doc_topics"].shape[1], (nq, LQ), device=dev, generator=gen)]
    other = topic * W + torch.randint(0, W, (nq, LQ), device=dev, generator=gen)
    wid = torch.where(torch.rand(nq, LQ, device=dev, generator=gen) < expand, other, wid)
    q = words[wid] + world["noise"] * F.normalize(torch.randn(nq, LQ, D, device=dev, generator=gen), dim=-1)
    return F.normalize(q, dim=-1)


def recall(ids, ref, k):
    ids, ref = ids[:, :k].cpu(), ref[:, :k].cpu()
    return round(sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids, ref)) / ids.numel(), 4)


def bench_search(ms, rows, dev, run, n, ld, nq, reps, nbits_list=(2, 4), flush=None):
    """Latency of one query (top-100); recall over ``nq`` queries."""
    gen = torch.Generator(device=dev).manual_seed(2)
    docs, world = planted(n, ld, dev, gen)
    Q = planted_queries(world, nq, dev, gen).to(docs.dtype)
    del world
    Q1 = Q[:1]
    storage = "cpu" if dev.type == "cpu" else "device"
    exact = ms.Corpus(docs, device=dev, storage=storage)
    _, ref = ms.search(Q, exact, 100)
    size = f"{n // 10**6}m" if n % 10**6 == 0 else f"{n // 1000}k" if n % 1000 == 0 else str(n)
    wl = f"search-{size}" + ("" if ld == LD else f"-ld{ld}")
    row(rows, wl, "maxsim-exact-bf16", run(lambda: ms.search(Q1, exact, 100), reps=reps),
        recall10=1.0, recall100=1.0, bytes_per_token=D * docs.element_size())
    del exact
    centroids = None
    for nbits in nbits_list:
        t0 = time.perf_counter()
        opts = {} if centroids is None else {"centroids": centroids}
        pc = ms.Corpus(docs, device=dev, storage=storage, quantization="plaid", nbits=nbits, rescore="device",
                       plaid=opts)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        build_s = round(time.perf_counter() - t0, 2)
        centroids = pc.plaid.centroids
        # the same corpus re-scoring on its decompressed tokens, then on its originals
        originals = pc.originals
        for cands, nprobe, thr, orig in ((None, None, None, False), (None, None, None, True),
                                         (None, None, 0.5, False), (None, None, 0.5, True),
                                         (1024, None, None, False), (1024, None, None, True), (None, 4, None, True)):
            pc.originals = originals if orig else None
            opts = dict(candidates=cands, nprobe=nprobe, centroid_threshold=thr)
            _, ids = ms.search(Q, pc, 100, **opts)
            label = ("maxsim-plaid" + (f"-c{cands}" if cands else "") + (f"-p{nprobe}" if nprobe else "")
                     + (f"-t{thr}" if thr else "") + ("+rescore-device" if orig else ""))
            row(rows, f"{wl}-{nbits}b", label, run(lambda: ms.search(Q1, pc, 100, **opts), reps=reps),
                recall10=recall(ids, ref, 10), recall100=recall(ids, ref, 100),
                bytes_per_token=pc.plaid.bytes_per_token, build_s=build_s, centroids=pc.plaid.centroids.shape[0])
        del pc, originals
        if flush:
            flush()
    del docs


def bench_head(ms, lik, rows, dev, run, nq, nd, ld, dm=768):
    gen = torch.Generator(device=dev).manual_seed(3)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    Q = F.normalize(torch.randn(nq, LQ, D, device=dev, generator=gen), dim=-1).to(dt)
    H = torch.randn(nd, ld, dm, device=dev, generator=gen).to(dt)
    W = (torch.randn(D, dm, device=dev, generator=gen) / dm ** 0.5).to(dt)
    b = (0.01 * torch.randn(D, device=dev, generator=gen)).to(dt)

    def composed(Q, H, W, b):
        return ms.maxsim(Q, F.normalize(F.linear(H, W, b), dim=-1))

    impls = {"maxsim": lambda *a: ms.maxsim_from_hidden(*a), "projection+maxsim": composed}
    # The peer's fused kernel faults (illegal address) once the hidden states
    # pass 2^31 elements: it is left out there, since a fault ends the process.
    if lik is not None and H.numel() < 2 ** 31:
        from late_interaction_kernels.fused_head import maxsim_from_hidden as lik_head

        impls["lik"] = lambda *a: lik_head(*a)
    shape = f"{nq}x{nd}x{ld}"

    def device_ms(fn):  # a CUDA graph of the calls: device time, no host
        t = graph_ms(fn, calls=5) if dev.type == "cuda" else None
        return {} if t is None else {"graph_ms": round(t, 4)}

    for name, fn in impls.items():
        with torch.no_grad():
            fwd = lambda: fn(Q, H, W, b)  # noqa: E731
            try_row(rows, f"head-fwd-{shape}", name, fwd, run, **device_ms(fwd))
        leaves = [t.clone().requires_grad_(True) for t in (Q, H, W, b)]
        g = torch.randn(nq, nd, device=dev, generator=gen)

        def train():
            for t in leaves:
                t.grad = None
            (fn(*leaves).float() * g).sum().backward()
        try_row(rows, f"head-train-{shape}", name, train, run, **device_ms(train))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small sizes (CPU or GPU, seconds)")
    ap.add_argument("--only", default="rerank,approx,search,head")
    ap.add_argument("--search", default=None,
                    help="search corpora as DOCSxTOKENS,... (default 1000000x32,100000x300; tiny 200x60)")
    ap.add_argument("--search-docs", type=int, default=None, help="one search corpus of this many 300-token docs")
    ap.add_argument("--search-nbits", default=None, help="nbits of the search corpora, e.g. 2 (default: 2, and 2,4 "
                    "for the last corpus)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ms = load_maxsim()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run = timer(dev)
    lik = None
    if dev.type == "cuda":
        try:
            import late_interaction_kernels as lik
        except Exception as e:  # noqa: BLE001
            print(f"late-interaction-kernels unavailable: {e}")
    tiny = args.tiny or dev.type == "cpu"
    bw_gbs = bandwidth(dev)
    only = set(args.only.split(","))
    rows = []
    t_start = time.perf_counter()

    def flush():
        """Write what is measured so far (a later section failing or timing out keeps it)."""
        if dev.type == "cuda":
            write_results(rows, args.out, "-plaid", bandwidth_gbs=bw_gbs, tiny=tiny)
        else:
            import json

            out = Path(args.out or Path(__file__).resolve().parent.parent / "bench_results" / "cpu-plaid.json")
            out.write_text(json.dumps(dict(meta=dict(gpu="cpu", torch=torch.__version__, tiny=True), rows=rows),
                                      indent=2) + "\n")
            print(f"wrote {out}")
        print(f"-- {time.perf_counter() - t_start:.0f} s", flush=True)

    if "search" in only:
        spec = args.search or (f"{args.search_docs}x{LD}" if args.search_docs else
                               ("200x60" if tiny else "1000000x32,100000x300"))
        for i, part in enumerate(spec.split(",")):
            n, ld = (int(v) for v in part.split("x"))
            nbits = (tuple(int(b) for b in args.search_nbits.split(",")) if args.search_nbits else
                     (2, 4) if i == len(spec.split(",")) - 1 else (2,))
            bench_search(ms, rows, dev, run, n, ld, 8 if tiny else 64, 3 if tiny else 10, nbits, flush)
    if "rerank" in only:
        bench_rerank(ms, lik, rows, dev, run, [20] if tiny else [1000, 10000], bw_gbs)
        flush()
    if "approx" in only:
        bench_approx(ms, lik, rows, dev, run, 200 if tiny else 1_000_000, bw_gbs)
        flush()
    if "head" in only:
        if tiny:
            bench_head(ms, lik, rows, dev, run, 2, 8, 40, dm=64)
        else:
            bench_head(ms, lik, rows, dev, run, 1, 1000, 300)
            bench_head(ms, lik, rows, dev, run, 32, 32, 180)
            bench_head(ms, lik, rows, dev, run, 1, 10000, 300)
        flush()


if __name__ == "__main__":
    main()
