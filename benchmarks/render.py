"""Render bench_results/*.json into the tables of README.md (a summary),
docs/performance.md and docs/search.md, and draw
bench_results/<gpu>-speed.png / -memory.png.

Each target file holds its tables between ``<!-- bench:begin -->`` and
``<!-- bench:end -->``. ``python benchmarks/render.py [--check]``;
``--check`` compares the docs only and draws nothing.

GPU result files (``<gpu>.json``) hold forward rows (``ms``), training rows
(``fwd_bwd_ms``) and first-call rows (``first_call_ms``) of maxsim and its
peers; ``<gpu>-search.json``, ``-normalize.json``, ``-packed.json``,
``-read-floor.json``, ``-distributed.json`` and ``cpu.json`` have their own
tables. Every file's ``meta`` names the GPU, torch, commit and date.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench_results"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
IMPLS = ["maxsim", "lik", "flash-maxsim", "naive"]
# Files with their own tables (or none: the read-only replicas of read_floor.py --replica;
# the client benchmark, tabled in docs/integrations.md).
SPECIAL = ("-search.json", "-normalize.json", "-packed.json", "-read-floor.json", "-distributed.json",
           "-read-replica.json", "-clients.json", "-fp32.json", "-plaid.json", "-short-docs.json")


def fmt(v, nd=3):
    return "-" if v is None else f"{v:.{nd}f}"


def load(path: Path):
    data = json.loads(path.read_text())
    return data["meta"], data["rows"]


def provenance(m: dict) -> str:
    return f"{m['gpu'] if 'gpu' in m else m.get('cpu', 'CPU')}, torch {m['torch']}, commit `{m['commit']}`, {m['date']}"


def gpu_files() -> list[Path]:
    return [p for p in sorted(RESULTS.glob("nvidia-*.json")) if not p.name.endswith(SPECIAL)]


def impl_rows(by: dict, workloads: list, impls: list, cell) -> list[str]:
    """The forward then the training rows of a table, one column per
    implementation: ``cell(row, key, graph_key)`` formats a measured cell."""
    out = []
    for kind, key, graph in (("fwd", "ms", "graph_ms"), ("fwd+bwd", "fwd_bwd_ms", "fwd_bwd_graph_ms")):
        for w in workloads:
            if key not in by.get((w, "maxsim"), {}):
                continue
            cells = []
            for impl in impls:
                r = by.get((w, impl))
                if r is None:
                    cells.append("")
                elif r.get(key) is None:
                    wrong = r.get("relerr") is not None and "error" not in r
                    cells.append(f"wrong ({r['relerr']:.1e})" if wrong else r.get("error", "fails"))
                else:
                    cells.append(cell(r, key, graph))
            floor = by[(w, "maxsim")].get("floor_ms") if kind == "fwd" else None
            out.append(f"| {w} | {kind} | {fmt(floor)} | " + " | ".join(cells) + " |")
    return out


def gpu_table(path: Path) -> str:
    """One table per GPU: forward and training rows, the peers side by side."""
    m, rows = load(path)
    by = {(r["workload"], r["impl"]): r for r in rows}
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    out = [f"**{provenance(m)}**" + (f"; measured copy {float(m['copy_tb_s']):.2f} TB/s, bf16 matmul "
                                     f"{float(m['matmul_tflop_s']):.0f} TFLOP/s" if "copy_tb_s" in m else "") + ".",
           "", "| workload | pass | floor | " + " | ".join(IMPLS) + " |", "|---|---|---|" + "---|" * len(IMPLS)]
    out += impl_rows(by, workloads, IMPLS, lambda r, key, graph: f"{fmt(r[key])} / {fmt(r.get(graph))}")
    cold = [r for r in rows if "first_call_ms" in r]
    if cold:
        out += ["", f"First use in a fresh process ({cold[0]['workload']}; load = import or "
                    "`kernels.get_local_kernel`), ms:", "",
                "| impl | load | first call | second call |", "|---|---|---|---|"]
        out += [f"| {r['impl']} | {r['load_ms']:.0f} | {r['first_call_ms']:.0f} | {r['second_call_ms']:.2f} |"
                for r in cold]
    return "\n".join(out)


FP32_IMPLS = ["maxsim", "maxsim-exact", "maxsim-tf32", "lik", "flash-maxsim", "naive"]


def fp32_table(path: Path) -> str:
    """fp32 tokens: each implementation's graph ms and relative error against
    fp64 (maxsim = the default split 3xTF32 path)."""
    m, rows = load(path)
    by = {(r["workload"], r["impl"]): r for r in rows}
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    out = [f"fp32 tokens, **{provenance(m)}**; cells: graph ms (relative error vs fp64); the floor counts "
           "4-byte tokens.", "", "| workload | pass | floor | " + " | ".join(FP32_IMPLS) + " |",
           "|---|---|---|" + "---|" * len(FP32_IMPLS)]
    def cell(r, key, graph):
        t = r.get(graph) if r.get(graph) is not None else r[key]
        return fmt(t) + ("" if r.get("relerr") is None else f" ({r['relerr']:.1e})")

    out += impl_rows(by, workloads, FP32_IMPLS, cell)
    return "\n".join(out)


SHORT_IMPLS = ["maxsim", "maxsim-packed", "lik", "flash-maxsim"]


def short_docs_table(path: Path) -> str:
    """Many short documents (bench_short_docs.py): ms eager / graph per
    implementation; maxsim-packed: the packed kernel forced where the
    planner takes another family."""
    m, rows = load(path)
    by = {(r["workload"], r["impl"]): r for r in rows}
    out = [f"Many short documents (**{provenance(m)}**; bf16, Lq {m['lq']}, d {m['dim']}), ms eager / graph; "
           "eager = median of three readings; the family the planner picks for maxsim in brackets:", "",
           "| workload | floor | " + " | ".join(SHORT_IMPLS) + " |", "|---|---|" + "---|" * len(SHORT_IMPLS)]
    for w in dict.fromkeys(r["workload"] for r in rows if "pass" not in r):  # training rows: JSON only
        cells = []
        for impl in SHORT_IMPLS:
            r = by.get((w, impl))
            if r is None:
                cells.append("")
            elif r.get("ms") is None:
                cells.append("fails")
            else:
                cells.append(f"{fmt(r['ms'])} / {fmt(r.get('graph_ms'))}" + (f" ({r['family']})" if r.get("family") else ""))
        floor = next(r.get("floor_ms") for r in rows if r["workload"] == w)
        out.append(f"| {w} | {fmt(floor)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def search_table(path: Path) -> str:
    """Search time (CUDA-graph ms where measured, else eager) and top-10 agreement per corpus form."""
    m, rows = load(path)
    impls = list(dict.fromkeys(r["impl"] for r in rows if "top10" in r))
    by = {(r["workload"], r["impl"]): r for r in rows}
    workloads = list(dict.fromkeys(r["workload"] for r in rows if "top10" in r))
    out = [f"Top-{m.get('k', 100)} search, one query (**{provenance(m)}**): ms (graph time where a CUDA graph "
           "was timed, else eager, marked e) and top-10 agreement with the exact bf16 result.", "",
           "| corpus | " + " | ".join(i.removeprefix("maxsim-") if i != "maxsim" else "bf16" for i in impls) + " |",
           "|---|" + "---|" * len(impls)]
    for w in workloads:
        cells = []
        for i in impls:
            r = by.get((w, i))
            if r is None:
                cells.append("")
            else:
                t = f"{r['graph_ms']:.3f}" if r.get("graph_ms") is not None else f"{r['ms']:.3f}e"
                cells.append(f"{t} ({r['top10']:.2f})")
        out.append(f"| {w} | " + " | ".join(cells) + " |")
    for r in rows:
        if "gbps" in r:
            out += ["", f"Streaming from pinned host memory ({r['workload']}, {r['corpus_gb']} GB, GPU allocator "
                        f"capped at {r['gpu_cap_gib']} GiB): {r['ms']:.0f} ms per query, {r['gbps']} GB/s against "
                        f"{r['h2d_gbps']} GB/s measured host-to-device copy."]
    return "\n".join(out)


def normalize_table(path: Path) -> str:
    m, rows = load(path)
    out = [f"`normalize=True` (**{provenance(m)}**): fused = norms folded into the kernels, composed = the op on "
           "`F.normalize` copies; ms eager / graph, error = max relative error of scores (and gradients) vs fp64:",
           "", "| workload | pass | fused | composed | unnormalised | error fused / composed |", "|---|---|---|---|---|---|"]
    by = {(r["workload"], r["impl"]): r for r in rows}
    for w in dict.fromkeys(r["workload"] for r in rows):
        f, c, u = by[(w, "fused")], by[(w, "F.normalize+maxsim")], by[(w, "unnormalised")]
        cell = lambda r: f"{r['ms']:.3f} / {r['graph_ms']:.3f}"  # noqa: E731
        out.append(f"| {w} | {f['mode'].replace('_', '+')} | {cell(f)} | {cell(c)} | {cell(u)} | "
                   f"{f['relerr']:.1e} / {c['relerr']:.1e} |")
    return "\n".join(out)


def read_floor_table(path: Path) -> str:
    m, rows = load(path)
    out = [f"Read floor (**{provenance(m)}**): the fastest read-only kernel found over each row's document bytes "
           "(several load flavours, split orders and warps per SM), timed like the benchmark, ms eager / graph:", "",
           "| workload | MB | read floor | maxsim (same run) |", "|---|---|---|---|"]
    for w in dict.fromkeys(r["workload"] for r in rows):
        ours = next((r for r in rows if r["workload"] == w and r["impl"] == "maxsim"), None)
        reads = [r for r in rows if r["workload"] == w and r["impl"].startswith("read")]
        if ours and reads:
            out.append(f"| {w} | {ours['mb']:.1f} | {min(r['ms'] for r in reads):.4f} / "
                       f"{min(r['graph_ms'] for r in reads):.4f} | {ours['ms']:.4f} / {ours['graph_ms']:.4f} |")
    return "\n".join(out)


def distributed_table(path: Path) -> str:
    m, rows = load(path)
    out = [f"Several GPUs (**{provenance(m)}**, {m['backend']}; {m['timing']}):", "",
           "| workload | GPUs | ms | queries/s |", "|---|---|---|---|"]
    out += [f"| {r['workload']} | {r['world']} | {r['ms']:.2f} | {r['queries_per_s']} |" for r in rows]
    return "\n".join(out)


def cpu_table(path: Path) -> str:
    m, rows = load(path)
    out = [f"CPU ({m['cpu']}, {m['threads']} threads, torch {m['torch']}, commit `{m['commit']}`, {m['date']}; "
           f"{m.get('build', '')}), fp32, median ms and peak extra memory (MiB):", "",
           "| workload | impl | ms | peak MiB |", "|---|---|---|---|"]
    out += [f"| {r['workload']} | {r['impl']} | {r['ms']:.1f} | {r['peak_extra_mib']:.1f} |" for r in rows]
    return "\n".join(out)


CHARTS = (("speed", "ms", "time / maxsim time (lower is faster)"),
          ("memory", "peak_mib", "peak extra memory, MiB (log)"))


def chart_kinds(path: Path) -> list[tuple[str, str, str]]:
    """The charts a GPU file has data for (the memory chart needs the forward
    rows' peak_mib)."""
    _, rows = load(path)
    return [c for c in CHARTS if any(r["impl"] == "maxsim" and r.get("ms") and r.get(c[1]) for r in rows)]


def chart_links(path: Path) -> str:
    return "\n".join(f"![{path.stem} {kind}](../bench_results/{path.stem}-{kind}.png)" for kind, _, _ in chart_kinds(path))


def performance_section() -> str:
    parts = []
    for p in gpu_files():
        parts += [gpu_table(p), chart_links(p)]
    for suffix, table in (("-fp32.json", fp32_table), ("-short-docs.json", short_docs_table),
                          ("-normalize.json", normalize_table),
                          ("-read-floor.json", read_floor_table), ("-distributed.json", distributed_table)):
        parts += [table(p) for p in sorted(RESULTS.glob(f"*{suffix}"))]
    if (RESULTS / "cpu.json").exists():
        parts.append(cpu_table(RESULTS / "cpu.json"))
    return "\n\n".join(parts)


def plaid_table(path: Path) -> str:
    """PLAID corpora and the projection head (bench_plaid.py): ms per
    implementation and row (eager, and in a CUDA graph where measured), the
    byte floor, search recall against exact bf16."""
    m, rows = load(path)
    out = [f"PLAID corpora and the projection head (**{provenance(m)}**), ms (eager / CUDA graph where both); "
           "recall@10 / @100 against exact bf16 search:", "",
           "| workload | impl | ms | floor | recall@10 / @100 | bytes / token |", "|---|---|---|---|---|---|"]
    for r in rows:
        rec = f"{r['recall10']:.3f} / {r['recall100']:.3f}" if r.get("recall10") is not None else ""
        ms = fmt(r.get("ms"), 4) if r.get("ms") is not None else r.get("error", "fails")
        if r.get("graph_ms") is not None and r.get("ms") is not None:
            ms += f" / {fmt(r['graph_ms'], 4)}"
        floor = fmt(r["floor_ms"], 4) if r.get("floor_ms") is not None else ""
        out.append(f"| {r['workload']} | {r['impl']} | {ms} | {floor} | {rec} | {r.get('bytes_per_token', '')} |")
    return "\n".join(out)


def search_section() -> str:
    return "\n\n".join([search_table(p) for p in sorted(RESULTS.glob("*-search.json"))]
                       + [plaid_table(p) for p in sorted(RESULTS.glob("*-plaid.json"))])


# The README's summary: device time of a few representative workloads on one GPU.
SUMMARY_GPU = "nvidia-h200.json"
SUMMARY = {"rerank-short": "1 query x 1000 docs, Lq 32, Ld 300", "corpus-10k": "1 query x 10k docs, Lq 32, Ld 300",
           "rerank-colpali": "1 query x 1000 pages, Lq 1024, Ld 1024", "allpairs-128": "128 x 128, Lq 32, Ld 300",
           "Contrastive": "training step, 32 x 32, Lq 32, Ld 80", "train-128": "training step, 128 x 128, Lq 32, Ld 300"}


def summary_section() -> str:
    m, rows = load(RESULTS / SUMMARY_GPU)
    by = {(r["workload"], r["impl"]): r for r in rows}
    out = [f"Device time per call in a CUDA graph, ms, bf16, d = 128 ({provenance(m)}; lower is better):", "",
           "| workload | shape | " + " | ".join(IMPLS) + " |", "|---|---|" + "---|" * len(IMPLS)]
    for w, what in SUMMARY.items():
        key = "graph_ms" if "graph_ms" in by[(w, "maxsim")] else "fwd_bwd_graph_ms"
        out.append(f"| {w} | {what} | " + " | ".join(fmt(by.get((w, i), {}).get(key)) for i in IMPLS) + " |")
    return "\n".join(out)


TARGETS = {"README.md": summary_section, "docs/performance.md": performance_section, "docs/search.md": search_section}


def gpu_charts(path: Path) -> list[Path]:
    """Speed relative to maxsim and peak memory, per forward workload, one bar per impl."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    meta, rows = load(path)
    by = {(r["workload"], r["impl"]): r for r in rows}
    ws = [w for w in dict.fromkeys(r["workload"] for r in rows) if by.get((w, "maxsim"), {}).get("ms")]
    width = 0.8 / len(IMPLS)
    out = []
    for kind, key, ylabel in chart_kinds(path):
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
        ax.set_title(f"forward, {meta['gpu']}, bf16, commit {meta['commit']}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, ncol=len(IMPLS))
        fig.tight_layout()
        p = path.with_name(f"{path.stem}-{kind}.png")
        fig.savefig(p, dpi=110, metadata={"Software": None})  # no version stamp: reruns give the same file
        plt.close(fig)
        out.append(p)
    return out


def rendered(target: str) -> tuple[str, str]:
    """-> (current text, text with fresh tables) of one target file."""
    text = (ROOT / target).read_text()
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text, text[:a] + "\n" + TARGETS[target]() + "\n" + text[b:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="fail if a doc's tables are out of date")
    args = ap.parse_args()
    stale = []
    for target in TARGETS:
        old, new = rendered(target)
        if args.check:
            stale += [target] if new != old else []
        else:
            (ROOT / target).write_text(new)
            print("tables updated:", target)
    if args.check:
        raise SystemExit(f"out of date: {', '.join(stale)}; run `just bench-render`" if stale else 0)
    for p in gpu_files():
        print("wrote", *(q.relative_to(ROOT) for q in gpu_charts(p)))


if __name__ == "__main__":
    main()
