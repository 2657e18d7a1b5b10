"""Render bench_results/*.json into the README's benchmark tables and charts.

Replaces the text between ``<!-- bench:begin -->`` and ``<!-- bench:end -->``
in README.md and draws bench_results/<name>-speed.png / -memory.png next to
each GPU result file (matplotlib, Agg). ``python benchmarks/render.py
[--check]``; ``--check`` compares the README only and draws nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
IMPLS = ["maxsim", "lik", "flash-maxsim", "naive"]
GOALS = {  # issue goals, ms
    "rerank-short": 0.030, "rerank-long": 0.095, "rerank-medium": 0.095, "rerank-colpali": 0.45,
    "corpus-10k": 0.26, "colpali-10k": 4.5, "allpairs-128": 0.10, "Rerank": 0.035, "HeavyRerank": 0.075,
    "Contrastive": 0.10, "LongDocs": 0.12, "BigBatch": 0.10, "train-128": 0.20, "colpali-train-32": 0.20,
}


def fmt(v, nd=3):
    return "-" if v is None else f"{v:.{nd}f}"


def _cells(by: dict, workload: str, key: str, graph_key: str) -> list[str]:
    """One table cell per implementation: "eager / graph" ms, or why not."""
    cells = []
    for i in IMPLS:
        r = by.get((workload, i))
        if r is None:
            cells.append("")
        elif r.get(key) is None:
            cells.append(r.get("error", "fails")[:12])
        else:
            cells.append(f"{fmt(r[key])} / {fmt(r.get(graph_key))}")
    return cells


def gpu_tables(path: Path) -> str:
    data = json.loads(path.read_text())
    m = data["meta"]
    rows = data["rows"]
    by = {(r["workload"], r["impl"]): r for r in rows}
    out = [f"**{m['gpu']}**, torch {m['torch']}, {m['date']}, commit `{m.get('commit', '')}`; measured "
           f"copy bandwidth {m['copy_tb_s']:.2f} TB/s, bf16 matmul {m['matmul_tflop_s']:.0f} TFLOP/s. bf16, d = 128.",
           "", "Forward, ms (median of five `triton.testing.do_bench` readings, L2 flushed before each call, "
           "Python overhead included) / device time from a CUDA graph of 20 calls. floor = max(bytes / copy "
           "bandwidth, FLOPs / matmul rate); copy = a device copy of the same bytes timed the same two ways "
           "(the byte floor as this harness measures it):", "",
           "| workload | goal | floor | copy | " + " | ".join(IMPLS) + " |",
           "|---|---|---|---|" + "---|" * len(IMPLS)]
    fwd = [w for w in dict.fromkeys(r["workload"] for r in rows) if (w, "maxsim") in by and "ms" in by[(w, "maxsim")]]
    for w in fwd:
        cells = _cells(by, w, "ms", "graph_ms")
        r = by[(w, "maxsim")]
        cp = f"{fmt(r['copy_ms'])} / {fmt(r.get('copy_graph_ms'))}" if r.get("copy_ms") is not None else "-"
        out.append(f"| {w} | {fmt(GOALS.get(w))} | {fmt(r.get('floor_ms'))} | {cp} | " + " | ".join(cells) + " |")
    train = [w for w in dict.fromkeys(r["workload"] for r in rows) if "fwd_bwd_ms" in by.get((w, "maxsim"), {})]
    if train:
        out += ["", "Training (forward + `scores.backward(g)`), ms eager (median of five do_bench readings; steps "
                "whose host time exceeds their GPU time measure the lent host's CPU) / device time from a CUDA graph; "
                "retained = memory held between forward and backward (MiB):", "",
                "| workload | goal | " + " | ".join(IMPLS) + " | retained maxsim / best peer |",
                "|---|---|" + "---|" * len(IMPLS) + "---|"]
        for w in train:
            cells = _cells(by, w, "fwd_bwd_ms", "fwd_bwd_graph_ms")
            peer_ret = [by[(w, i)].get("retained_mib") for i in ("lik", "flash-maxsim") if (w, i) in by]
            peer_ret = [v for v in peer_ret if v is not None and v > 0]
            ret = f"{fmt(by[(w, 'maxsim')].get('retained_mib'), 2)} / {fmt(min(peer_ret) if peer_ret else None, 2)}"
            out.append(f"| {w} | {fmt(GOALS.get(w))} | " + " | ".join(cells) + f" | {ret} |")
    return "\n".join(out)


def _forward(path: Path):
    """-> (meta, forward workloads, {(workload, impl): row}) of a GPU result file."""
    data = json.loads(path.read_text())
    by = {(r["workload"], r["impl"]): r for r in data["rows"]}
    ws = [w for w in dict.fromkeys(r["workload"] for r in data["rows"]) if by.get((w, "maxsim"), {}).get("ms")]
    return data["meta"], ws, by


def gpu_charts(path: Path) -> list[Path]:
    """Speed relative to maxsim and peak memory, per forward workload, one bar per impl."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    meta, ws, by = _forward(path)
    width = 0.8 / len(IMPLS)
    out = []
    for kind, key, ylabel in (("speed", "ms", "time / maxsim time (lower is faster)"),
                              ("memory", "peak_mib", "peak extra memory, MiB (log)")):
        fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(ws)), 3.8))
        for k, impl in enumerate(IMPLS):
            xs, ys = [], []
            for i, w in enumerate(ws):
                v = by.get((w, impl), {}).get(key)
                if v is not None:
                    xs.append(i + (k - (len(IMPLS) - 1) / 2) * width)
                    # Speed: a ratio, so workloads of very different sizes share one axis.
                    ys.append(v / by[(w, "maxsim")]["ms"] if kind == "speed" else max(v, 1e-3))
            ax.bar(xs, ys, width, label=impl)
        if kind == "speed":
            ax.axhline(1.0, color="black", lw=0.8)
        else:
            ax.set_yscale("log")
        ax.set_xticks(range(len(ws)), ws, rotation=30, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_title(f"forward, {meta['gpu']}, bf16, commit {meta.get('commit', '')}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, ncol=len(IMPLS))
        fig.tight_layout()
        p = path.with_name(f"{path.stem}-{kind}.png")
        fig.savefig(p, dpi=110, metadata={"Software": None})  # no version stamp: reruns give the same file
        plt.close(fig)
        out.append(p)
    return out


def chart_links(path: Path) -> str:
    return "\n".join(f"![{path.stem} {kind}](bench_results/{path.stem}-{kind}.png)" for kind in ("speed", "memory"))


def cold_table(path: Path) -> str:
    data = json.loads(path.read_text())
    m = data["meta"]
    out = [f"First call in a fresh process (32 queries x 1000 documents, Lq 32, Ld 300; {m['gpu']}, "
           f"commit `{m.get('commit', '')}`; load = import or `kernels.get_local_kernel`, "
           f"first call = the call after it):", "", "| impl | load ms | first call ms | second call ms |",
           "|---|---|---|---|"]
    for r in data["rows"]:
        load = f"{r['load_ms']:.0f}" if "load_ms" in r else "-"
        out.append(f"| {r['impl']} | {load} | {r['first_call_ms']:.0f} | {r['second_call_ms']:.2f} |")
    return "\n".join(out)


def cpu_table(path: Path) -> str:
    data = json.loads(path.read_text())
    m = data["meta"]
    out = [f"CPU ({m['cpu']}, {m['threads']} threads, torch {m['torch']}, {m['date']}), fp32, median ms and peak "
           "extra RSS (MiB, fresh process per implementation):", "",
           "| workload | impl | ms | peak MiB |", "|---|---|---|---|"]
    for r in data["rows"]:
        out.append(f"| {r['workload']} | {r['impl']} | {r['ms']:.1f} | {r['peak_extra_mib']:.1f} |")
    return "\n".join(out)


def search_table(path: Path) -> str:
    data = json.loads(path.read_text())
    m = data["meta"]
    out = [f"Search, top-{m.get('k', 100)} (**{m['gpu']}**, torch {m['torch']}, {m['date']}, commit "
           f"`{m['commit'].split()[0]}`; {m['timing']}; agreement = share of the exact bf16 top-k found):", "",
           "| workload | impl | ms | vs bf16 | graph ms | vs bf16 (graph) | top-10 | top-100 |",
           "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        if "top10" not in r:
            continue
        g = f"{r['graph_ms']:.3f}" if r.get("graph_ms") is not None else "-"
        out.append(f"| {r['workload']} | {r['impl']} | {r['ms']:.3f} | {fmt(r.get('vs_bf16'), 2) if 'vs_bf16' in r else '-'}"
                   f" | {g} | {fmt(r.get('vs_bf16_graph'), 2) if 'vs_bf16_graph' in r else '-'}"
                   f" | {r['top10']:.4f} | {r['top100']:.4f} |")
    for r in data["rows"]:
        if "gbps" in r:
            out += ["", f"Streaming: {r['workload']} ({r['corpus_gb']} GB in pinned host memory, GPU allocator "
                        f"capped at {r['gpu_cap_gib']} GiB): {r['ms']:.0f} ms per query, {r['gbps']} GB/s against "
                        f"{r['h2d_gbps']} GB/s measured host-to-device copy."]
    return "\n".join(out)


def distributed_table(path: Path) -> str:
    data = json.loads(path.read_text())
    m = data["meta"]
    out = [f"Multi-GPU ({m['gpu']}, {m['backend']}, torch {m['torch']}; {m['timing']}):", "",
           "| workload | GPUs | ms | queries/s |", "|---|---|---|---|"]
    for r in data["rows"]:
        out.append(f"| {r['workload']} | {r['world']} | {r['ms']:.2f} | {r['queries_per_s']} |")
    return "\n".join(out)


def normalize_table(path: Path) -> str:
    data = json.loads(path.read_text())
    m = data["meta"]
    out = [f"`normalize=True` (**{m['gpu']}**, torch {m['torch']}, {m['date']}, commit `{m['commit']}`; "
           "bf16 tokens of varied norms; fused = norms folded into the kernels, composed = the op on "
           "`F.normalize` copies; error = max relative error of scores and gradients vs fp64 autograd):", "",
           "| workload | impl | mode | ms | graph ms | peak MiB | error |", "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        err = "-" if r.get("relerr") is None else f"{r['relerr']:.1e}"
        out.append(f"| {r['workload']} | {r['impl']} | {r['mode']} | {r['ms']:.4f} | {fmt(r.get('graph_ms'), 4)} | "
                   f"{r['peak_mib']:.1f} | {err} |")
    return "\n".join(out)


def packed_table(path: Path) -> str:
    data = json.loads(path.read_text())
    m = data["meta"]
    by = {(r["workload"], r["case"], r["impl"]): r for r in data["rows"]}
    out = [f"Packed pairs vs padded (`benchmarks/bench_packed.py`; **{m['gpu']}**, torch {m['torch']}, {m['date']}, "
           f"commit `{m['commit']}`): `score_pairs_packed` against `score_candidates_padded` (candidates) or "
           "`maxsim` (one query x shared documents) on the same tokens, ms eager / graph; dense = every document "
           "at the padded length, ragged = lengths uniform in [1, Ld] (the padded side passes lengths or a mask):",
           "", "| workload | case | padded | packed | packed / padded | tokens padded / packed |",
           "|---|---|---|---|---|---|"]
    for (w, c, i), r in by.items():
        if i != "padded" or (w, c, "packed") not in by:
            continue
        k = by[(w, c, "packed")]
        graph = "-" if not (r.get("graph_ms") and k.get("graph_ms")) else f"{k['graph_ms'] / r['graph_ms']:.2f}"
        ratio = f"{k['ms'] / r['ms']:.2f} / {graph}"
        out.append(f"| {w} | {c} | {r['ms']:.4f} / {fmt(r.get('graph_ms'), 4)} | {k['ms']:.4f} / "
                   f"{fmt(k.get('graph_ms'), 4)} | {ratio} | {r['tokens']} / {k['tokens']} |")
    return "\n".join(out)


def read_floor_table(path: Path) -> str:
    data = json.loads(path.read_text())
    m = data["meta"]
    rows = data["rows"]
    out = [f"Read floor (`benchmarks/read_floor.py`; **{m['gpu']}**, torch {m['torch']}, {m['date']}, kernels of "
           f"`{m.get('commit', '')}`): the fastest read-only kernel over each row's document bytes (plain, `.cs` "
           "and `.nc` 16-byte loads, an even split or all warps sweeping the bytes together, 8 to 48 warps per "
           "SM, the best of each timing), timed as above, ms eager / graph. Any exact MaxSim reads those bytes "
           "once; this is the fastest of these read orders, not a bound proven for every order (the sweep "
           "beat the even split by 1-4 %), so a goal below it is out of reach of every read order tried:", "",
           "| workload | MB | goal | read floor | maxsim (same run) |", "|---|---|---|---|---|"]
    for w in dict.fromkeys(r["workload"] for r in rows):
        ours = next((r for r in rows if r["workload"] == w and r["impl"] == "maxsim"), None)
        reads = [r for r in rows if r["workload"] == w and r["impl"].startswith("read")]
        if ours is None or not reads:
            continue
        e = min(r["ms"] for r in reads)
        g = min(r["graph_ms"] for r in reads)
        out.append(f"| {w} | {ours['mb']:.1f} | {fmt(GOALS.get(w))} | {fmt(e, 4)} / {fmt(g, 4)} | "
                   f"{fmt(ours['ms'], 4)} / {fmt(ours['graph_ms'], 4)} |")
    return "\n".join(out)


def _not_gpu_table(name: str) -> bool:
    """JSON rendered elsewhere: cpu.json (its own table, last), the agreement
    bound and the read-only split replicas (perf notes)."""
    return name == "cpu.json" or name.startswith("agreement-bound") or name.endswith("-read-replica.json")


def _special(name: str) -> bool:
    return _not_gpu_table(name) or name.endswith(
        ("-cold-start.json", "-search.json", "-distributed.json", "-normalize.json", "-read-floor.json",
         "-packed.json"))


def render() -> str:
    parts = []
    res = ROOT / "bench_results"
    for p in sorted(res.glob("*.json")):
        if _not_gpu_table(p.name):
            continue
        if p.name.endswith("-search.json"):
            parts.append(search_table(p))
        elif p.name.endswith("-distributed.json"):
            parts.append(distributed_table(p))
        elif p.name.endswith("-cold-start.json"):
            parts.append(cold_table(p))
        elif p.name.endswith("-normalize.json"):
            parts.append(normalize_table(p))
        elif p.name.endswith("-read-floor.json"):
            parts.append(read_floor_table(p))
        elif p.name.endswith("-packed.json"):
            parts.append(packed_table(p))
        else:
            parts += [gpu_tables(p), chart_links(p)]
    if (res / "cpu.json").exists():
        parts.append(cpu_table(res / "cpu.json"))
    return "\n\n".join(parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="fail if README is out of date")
    args = ap.parse_args()
    readme = ROOT / "README.md"
    text = readme.read_text()
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = text[:a] + "\n" + render() + "\n" + text[b:]
    if args.check:
        raise SystemExit(0 if new == text else "README benchmark tables are out of date: run `just bench-render`")
    readme.write_text(new)
    for p in sorted((ROOT / "bench_results").glob("*.json")):
        if not _special(p.name):
            print("wrote", *(q.relative_to(ROOT) for q in gpu_charts(p)))
    print("README tables updated")


if __name__ == "__main__":
    main()
