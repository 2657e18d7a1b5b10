"""The CUDA forward planner (torch-ext/forward_plan.h), checked on the CPU
through the plan_forward op and ``maxsim.explain``: the benchmark matrix maps
to the kernels the CUDA forward runs for it on sm_90a (132 SMs) and sm_80
(108 SMs), and every tile configuration the planner can return is built."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_gpu import DIM, FORWARD, TRAIN, TRAIN_GROUPED  # noqa: E402

CROSS, GROUPED, LIST = 0, 1, 2
PRECISION = {"default": 0, "tf32": 1, "exact": 2}  # the op's codes (plan::Precision)


def plan(ms, layout, nq, nd, lq, ld, *, dim=128, dtype=torch.bfloat16, arch=90, sms=None, argmax=False,
         precision="default", normalize=False, quant=False, uniform_doc_scales=False, align=16, force=""):
    """The plan of nq queries of lq rows against nd documents of ld tokens
    (GROUPED: nd documents in all, nd / nq per query; LIST: nd pairs)."""
    pairs = nq * nd if layout == CROSS else nd
    words = ms.ops.plan_forward(layout, nq, nd, nq * lq, nd * ld, pairs, lq, dim, dtype, quant,
                                uniform_doc_scales, argmax, PRECISION[precision], normalize, align, arch,
                                -1 if sms is None else sms, force)
    out = {}
    for word in words.split():
        key, _, value = word.partition("=")
        out[key] = value if key == "family" else int(value)
    return out


# The benchmark matrix (benchmarks/bench_gpu.py, dim 128 bf16) and the
# (family, mma config) each architecture runs for it: forward rows, and the
# training rows' forward (scores with argmax for the backward).
BENCH_DIM = 128
ON_SM90A = {"rerank-colpali": ("wgmma", -1), "colpali-10k": ("wgmma", -1), "allpairs-128": ("wgmma", -1)}
ON_SM80 = {"rerank-medium": ("mma", 2), "rerank-colpali": ("mma", 2), "colpali-10k": ("mma", 2),
           "allpairs-128": ("mma", 2)}


def _expected(name, arch):
    if arch == 90:
        return ON_SM90A.get(name, ("stream_wg", -1))
    return ON_SM80.get(name, ("stream", -1))


def _bench_plan(ms, shape, arch, sms, argmax=False):
    kind, n, k, lq, ld = shape
    if kind == "shared":
        return plan(ms, CROSS, n, k, lq, ld, arch=arch, sms=sms, argmax=argmax)
    return plan(ms, GROUPED, n, n * k, lq, ld, arch=arch, sms=sms, argmax=argmax)


@pytest.mark.parametrize("name", FORWARD)
@pytest.mark.parametrize("arch,sms", [(90, 132), (80, 108)], ids=["sm90a-132", "sm80-108"])
def test_benchmark_forward_kernels(ms, name, arch, sms):
    assert DIM == BENCH_DIM
    p = _bench_plan(ms, FORWARD[name], arch, sms)
    assert (p["family"], p.get("cfg", -1)) == _expected(name, arch), p
    assert p["arch"] == arch and p["sm_count"] == sms


@pytest.mark.parametrize("name", TRAIN)
@pytest.mark.parametrize("arch,sms", [(90, 132), (80, 108)], ids=["sm90a-132", "sm80-108"])
def test_benchmark_train_kernels(ms, name, arch, sms):
    nq, nd, lq, ld = TRAIN[name]
    p = plan(ms, CROSS, nq, nd, lq, ld, arch=arch, sms=sms, argmax=True)
    assert (p["family"], p.get("cfg", -1)) == (("wgmma", -1) if arch == 90 else ("mma", 2)), p


@pytest.mark.parametrize("name", TRAIN_GROUPED)
@pytest.mark.parametrize("arch,sms", [(90, 132), (80, 108)], ids=["sm90a-132", "sm80-108"])
def test_benchmark_grouped_train_kernels(ms, name, arch, sms):
    # Per-query candidates with the argmax the backward needs: the staged
    # wgmma stream on sm_90a (one pair per CTA; 512 pairs, 1.3 waves: runs
    # of two); elsewhere 32 query rows per pair take the 32x64 mma.sync
    # tiles (the mma.sync stream keeps no argmax), several documents per CTA.
    nq, k, lq, ld = TRAIN_GROUPED[name]
    p = plan(ms, GROUPED, nq, nq * k, lq, ld, arch=arch, sms=sms, argmax=True)
    if arch == 90:
        run = 2 if nq * k == 512 else 0
        assert (p["family"], p["nq"], p["run"], p["grid"]) == ("stream_wg", 32, run, nq * k // max(run, 1)), p
        return
    assert (p["family"], p["cfg"], p["bm"], p["row_mode"]) == ("mma", 0, 32, 0), p
    assert p["dpc"] >= 1 and p["items"] * p["dpc"] >= nq * k, p


def test_bench_details_sm90(ms):
    # The staged stream's kernel shape: 256-byte rows (8 k steps), 32 query rows.
    p = _bench_plan(ms, FORWARD["rerank-short"], 90, 132)
    assert (p["ks"], p["nq"], p["stages"], p["grid"]) == (8, 32, 4, 1000)
    p = _bench_plan(ms, FORWARD["rerank-medium"], 90, 132)
    assert (p["ks"], p["nq"]) == (8, 128)
    # Stacked CROSS queries finish in the several-queries instantiation.
    p = _bench_plan(ms, FORWARD["allpairs-128"], 90, 132)
    assert (p["qpt"], p["multi"], p["nkb"], p["scale"], p["row_mode"]) == (4, 1, 2, 0, 0), p
    # colpali: 8 tiles of 128 query rows per (query, document), summed by the finalize kernel.
    p = _bench_plan(ms, FORWARD["colpali-10k"], 90, 132)
    assert (p["tpq"], p["row_mode"], p["splits"], p["items"]) == (8, 1, 1, 80000), p


def test_stream_rules(ms):
    # Documents shorter than a stage, and fewer than 32 pairs, stay on the mma.sync stream.
    assert plan(ms, CROSS, 1, 1000, 32, 32)["family"] == "stream"
    assert plan(ms, CROSS, 1, 16, 32, 300)["family"] == "stream"
    assert plan(ms, CROSS, 1, 64, 32, 300)["family"] == "stream_wg"
    # Pair lists of 16-bit tokens stream; several CROSS queries take the tile kernels.
    assert plan(ms, LIST, 8, 500, 32, 300)["family"] == "stream_wg"
    assert plan(ms, LIST, 8, 500, 32, 300, arch=80)["family"] == "stream"
    assert plan(ms, CROSS, 4, 500, 32, 300, arch=80) == plan(ms, CROSS, 4, 500, 32, 300, arch=80, force="")
    assert plan(ms, CROSS, 4, 500, 32, 300, arch=80)["family"] == "mma"
    # Longer documents than the streaming kernels take: the tile kernels' splits.
    assert plan(ms, CROSS, 1, 8, 32, 8192, arch=80)["family"] == "mma"
    # normalize and fp32 never stream; argmax rows only on the staged wgmma stream.
    for kw in (dict(normalize=True), dict(dtype=torch.float32), dict(argmax=True, arch=80)):
        assert plan(ms, CROSS, 1, 1000, 32, 300, **kw)["family"] not in ("stream", "stream_wg"), kw
    assert plan(ms, CROSS, 1, 1000, 32, 300, argmax=True)["family"] == "stream_wg"
    assert plan(ms, CROSS, 1, 1000, 32, 32, argmax=True)["family"] == "mma"
    # Rows the streaming kernels cannot read: odd widths, unaligned tokens.
    assert plan(ms, CROSS, 1, 1000, 32, 300, dim=96 // 2 * 3)["family"] == "mma"
    assert plan(ms, CROSS, 1, 1000, 32, 300, align=8)["family"] == "mma"


def test_long_query_stream_rule(ms):
    # lq 33-128, one query: the staged stream, except few pairs of documents past 1024 tokens.
    assert plan(ms, CROSS, 1, 16, 48, 2048)["family"] == "mma"
    assert plan(ms, CROSS, 1, 16, 48, 2048)["cfg"] == 1
    p = plan(ms, CROSS, 1, 40, 48, 4096)
    assert (p["family"], p["nq"]) == ("stream_wg", 64)
    assert plan(ms, CROSS, 1, 1000, 100, 300)["nq"] == 128


def test_quantized_paths(ms):
    i8 = dict(dtype=torch.int8, quant=True)
    # One query streams 8-bit documents; per-query candidates of 8-bit tokens take the tile kernels.
    p = plan(ms, CROSS, 1, 10000, 32, 300, **i8)
    assert (p["family"], p["ks"]) == ("stream", 4), p
    assert plan(ms, GROUPED, 32, 1600, 32, 180, **i8)["family"] == "mma"
    # Full 128-row tiles on sm_90a: wgmma, one scale per document where promised (scores only).
    p = plan(ms, CROSS, 8, 1000, 32, 300, uniform_doc_scales=True, **i8)
    assert (p["family"], p["scale"]) == ("wgmma", 2), p
    assert plan(ms, CROSS, 8, 1000, 32, 300, argmax=True, uniform_doc_scales=True, **i8)["scale"] == 1
    assert plan(ms, CROSS, 8, 1000, 32, 300, **i8)["scale"] == 1
    # fp8 argmax stays on mma.sync (exact products).
    e4 = dict(dtype=torch.float8_e4m3fn, quant=True)
    assert plan(ms, CROSS, 8, 1000, 32, 300, **e4)["family"] == "wgmma"
    assert plan(ms, CROSS, 8, 1000, 32, 300, argmax=True, **e4)["family"] == "mma"
    # 8-bit rows must be 4-byte aligned.
    with pytest.raises(RuntimeError, match="4-byte aligned"):
        plan(ms, CROSS, 8, 1000, 32, 300, dim=126, **i8)


def test_tile_kernel_rules(ms):
    # fp32: split 3xTF32 on the mma.sync kernel by default, one TF32 product
    # for tf32, SIMT for exact; never wgmma or the streams (no fp32 kernels).
    f32 = dict(dtype=torch.float32)
    p = plan(ms, CROSS, 8, 100, 32, 300, **f32)
    assert (p["family"], p["cfg"], p["split"]) == ("mma", 2, 1), p
    p = plan(ms, CROSS, 8, 100, 32, 300, precision="tf32", arch=80, **f32)
    assert (p["family"], p["cfg"], p["split"]) == ("mma", 2, 0), p
    assert plan(ms, CROSS, 8, 100, 32, 300, precision="exact", **f32)["family"] == "simt"
    # The bench's fp32 rows: the stream / wgmma rows of bf16 take mma.sync.
    for layout, nq, nd, lq, ld in ((CROSS, 1, 1000, 32, 300), (CROSS, 1, 10000, 32, 300),
                                   (CROSS, 128, 128, 32, 300), (CROSS, 1, 1000, 1024, 1024),
                                   (GROUPED, 32, 32 * 100, 32, 180), (LIST, 64, 640, 32, 300)):
        for argmax in (False, True):
            for normalize in (False, True):
                p = plan(ms, layout, nq, nd, lq, ld, argmax=argmax, normalize=normalize, **f32)
                assert (p["family"], p["split"]) == ("mma", 1), (layout, nq, nd, lq, ld, p)
    # Unaligned fp32 rows (no 4-byte vector loads): SIMT at every precision.
    assert plan(ms, CROSS, 1, 100, 32, 300, align=2, **f32)["family"] == "simt"
    # Other dtypes ignore precision.
    for prec in PRECISION:
        p = plan(ms, CROSS, 8, 100, 32, 300, precision=prec, arch=80)
        assert (p["family"], p["split"]) == ("mma", 0), p
    with pytest.raises(RuntimeError, match="bad precision"):
        ms.ops.plan_forward(CROSS, 1, 1, 1, 1, 1, 1, 8, torch.float32, False, False, False, 3, False, 16, 90,
                            -1, "")
    # Stacked CROSS queries pick the narrowest tile holding them.
    assert plan(ms, CROSS, 2, 100, 16, 300, arch=80)["cfg"] == 0
    assert plan(ms, CROSS, 2, 100, 32, 300, arch=80)["cfg"] == 1
    assert plan(ms, CROSS, 2, 100, 48, 300, arch=80)["cfg"] == 2
    # A resident query tile too wide for shared memory: narrower tiles, then SIMT.
    assert plan(ms, CROSS, 1, 100, 128, 300, dim=1024, arch=90)["cfg"] == 1
    assert plan(ms, CROSS, 1, 100, 128, 300, dim=1024, arch=86)["family"] == "simt"
    # normalize: the query tile's rows scaled, the documents' norms from the
    # mma.sync kernel's fragments (no pre-pass) or a pre-pass (wgmma).
    assert plan(ms, CROSS, 1, 1000, 32, 300, normalize=True)["family"] == "mma"
    assert plan(ms, CROSS, 8, 1000, 32, 300, normalize=True)["scale"] == 1
    # Few work items, long documents: split over the SMs into per-row partials.
    p = plan(ms, CROSS, 2, 2, 48, 4096, arch=80)
    assert p["splits"] > 1 and p["row_mode"] == 2, p



@pytest.mark.parametrize("arch,sms", [(90, 132), (80, 108)], ids=["sm90a-132", "sm80-108"])
def test_stream_run_rules(ms, arch, sms):
    # Many short documents of one query: the register stream in runs of
    # pairs per warp (2-32 pairs, in whole waves of runs).
    for nd, ld in ((200000, 8), (200000, 16), (100000, 32), (40000, 12)):
        for dim, lq in ((128, 32), (64, 7), (128, 1)):
            p = plan(ms, CROSS, 1, nd, lq, ld, dim=dim, arch=arch, sms=sms)
            assert p["family"] == "stream" and 2 <= p["run"] <= 32, (nd, ld, dim, lq, p)
            assert p["split"] == 1 and p["tail"] == 0 and p["grid"] == -(-nd // p["run"] // 4), p
    # Per-query candidates: runs within a query's K candidates.
    p = plan(ms, GROUPED, 64, 64000, 32, 24, arch=arch, sms=sms)
    assert p["family"] == "stream" and 2 <= p["run"] <= 32, p
    assert p["grid"] == -(-64 * -(-1000 // p["run"]) // 4), p
    assert plan(ms, GROUPED, 64, 64000, 32, 24, arch=arch, sms=sms, dtype=torch.float16)["run"] >= 2
    # Not: long documents, few pairs, several queries, 8-bit rows, rows of
    # 64 / 192 bytes, pair lists, one candidate per query, argmax, fp32.
    assert plan(ms, CROSS, 1, 200000, 32, 64, arch=arch, sms=sms).get("run", 0) == 0
    assert plan(ms, CROSS, 1, 20000, 32, 300, arch=arch, sms=sms).get("run", 0) == 0
    assert plan(ms, CROSS, 1, 100000, 32, 40, arch=arch, sms=sms).get("run", 0) == 0
    assert plan(ms, CROSS, 1, 1000, 32, 8, arch=arch, sms=sms)["run"] == 0
    assert plan(ms, CROSS, 1, 5000, 32, 8, arch=arch, sms=sms)["run"] == 0
    assert plan(ms, CROSS, 32, 50000, 32, 8, arch=arch, sms=sms)["family"] == "packed"
    assert plan(ms, CROSS, 1, 200000, 32, 8, dtype=torch.int8, quant=True, arch=arch, sms=sms)["run"] == 0
    for dim in (32, 96):
        assert plan(ms, CROSS, 1, 200000, 32, 8, dim=dim, arch=arch, sms=sms)["run"] == 0
    assert plan(ms, LIST, 1, 200000, 32, 8, arch=arch, sms=sms).get("run", 0) == 0
    assert plan(ms, GROUPED, 64000, 64000, 32, 24, arch=arch, sms=sms).get("run", 0) == 0
    assert plan(ms, CROSS, 1, 200000, 32, 8, argmax=True, arch=arch, sms=sms).get("run", 0) == 0
    assert plan(ms, CROSS, 1, 200000, 32, 8, dtype=torch.float32, arch=arch, sms=sms).get("run", 0) == 0


def test_stream_run_forcing(ms):
    # Forced runs: the longest (32 pairs, capped by the group), wherever the
    # run kernel can read the call -- long documents and few pairs included.
    assert plan(ms, CROSS, 1, 300, 32, 8, force="stream_run")["run"] == 32
    assert plan(ms, CROSS, 1, 7, 7, 3, dim=64, force="stream_run")["run"] == 7
    assert plan(ms, CROSS, 1, 1, 1, 1, force="stream_run")["run"] == 1
    assert plan(ms, CROSS, 1, 2000, 32, 300, force="stream_run")["run"] == 32
    p = plan(ms, GROUPED, 3, 3000, 32, 24, force="stream_run")
    assert (p["family"], p["run"], p["grid"]) == ("stream", 32, -(-3 * 32 // 4)), p
    assert plan(ms, GROUPED, 4, 40, 32, 24, force="stream_run")["run"] == 10
    # ... and where it cannot: the register stream one pair per warp.
    p = plan(ms, CROSS, 1, 300, 32, 8, dim=96, force="stream_run")
    assert (p["family"], p["run"]) == ("stream", 0), p
    assert plan(ms, LIST, 4, 300, 32, 8, force="stream_run")["run"] == 0
    # Forced off; "stream" keeps the rule.
    p = plan(ms, CROSS, 1, 200000, 32, 8, force="stream_pair")
    assert (p["family"], p["run"]) == ("stream", 0), p
    assert plan(ms, CROSS, 1, 200000, 32, 8, force="stream")["run"] >= 2
    assert plan(ms, CROSS, 1, 200000, 32, 8, force="packed")["family"] == "packed"
    # The thread's override: nests and restores the run modes too.
    Q = torch.randn(1, 32, 128, dtype=torch.bfloat16)
    D = torch.empty(200000, 8, 128, dtype=torch.bfloat16, device="meta")
    assert ms.explain(Q, D)["run"] >= 2
    with ms.forcing("stream_pair"):
        assert ms.explain(Q, D)["run"] == 0
        with ms.forcing("simt"):
            assert ms.explain(Q, D)["family"] == "simt"
        assert (ms.explain(Q, D)["family"], ms.explain(Q, D)["run"]) == ("stream", 0)
        with ms.forcing("stream_run"):
            assert ms.explain(Q, D)["run"] == 32
        assert ms.explain(Q, D)["run"] == 0
    assert ms.explain(Q, D)["run"] >= 2
    assert ms.explain(Q, D, force="stream_run")["run"] == 32

def test_stream_wg_run_rules(ms):
    # One query's documents of one or two 64-token stages (more than 32
    # query rows, or with the argmax), and candidates, >= 4 waves of pairs:
    # the staged wgmma stream in runs of 2-32 pairs per CTA, whole waves of
    # runs; the grid counts runs.
    for nd, ld, lq, argmax in ((50000, 64, 100, False), (30000, 128, 64, False), (50000, 64, 32, True),
                               (50000, 70, 16, True)):
        p = plan(ms, CROSS, 1, nd, lq, ld, argmax=argmax)
        assert p["family"] == "stream_wg" and 2 <= p["run"] <= 32, (nd, ld, lq, p)
        assert p["grid"] == -(-nd // p["run"]), p
    p = plan(ms, GROUPED, 64, 64000, 32, 100)
    assert p["family"] == "stream_wg" and 2 <= p["run"] <= 32, p
    assert p["grid"] == 64 * -(-1000 // p["run"]), p
    p = plan(ms, GROUPED, 64, 64000, 32, 100, argmax=True)
    assert p["family"] == "stream_wg" and p["run"] >= 2, p
    # Between one wave of pairs (396 CTAs of 256-byte rows on 132 SMs) and
    # 4/3 of one, any document length: runs of two in one wave.
    for layout, nq, nd, lq, ld, argmax in ((GROUPED, 64, 512, 32, 180, True), (GROUPED, 64, 512, 32, 300, False),
                                           (GROUPED, 50, 500, 32, 256, False), (GROUPED, 7, 525, 32, 180, True),
                                           (CROSS, 1, 500, 32, 512, False)):
        p = plan(ms, layout, nq, nd, lq, ld, argmax=argmax)
        rpg = -(-(nd // nq) // 2)
        assert (p["family"], p["run"], p["grid"]) == ("stream_wg", 2, nq * rpg), (nq, nd, ld, p)
    for nd in (396, 600, 640):
        assert plan(ms, GROUPED, 8, 8 * (nd // 8), 32, 180, argmax=True)["run"] == 0, nd
    # Not: longer documents, few pairs, pair lists, sm_80; one query's
    # documents of up to 128 tokens and <= 32 query rows without the argmax,
    # and short documents: the register stream.
    assert (plan(ms, CROSS, 1, 20000, 32, 300)["family"], plan(ms, CROSS, 1, 20000, 32, 300)["run"]) == \
        ("stream_wg", 0)
    assert plan(ms, CROSS, 1, 1000, 64, 64)["run"] == 0
    assert plan(ms, LIST, 1, 50000, 64, 64)["run"] == 0
    assert plan(ms, CROSS, 1, 50000, 64, 64, arch=80)["family"] != "stream_wg"
    for ld in (32, 64, 128):
        assert plan(ms, CROSS, 1, 50000, 32, ld)["family"] == "stream", ld
    # Forced: the longest runs (capped by the group) wherever the layout
    # allows, none for pair lists; forced off: one pair per CTA.
    assert plan(ms, CROSS, 1, 20000, 32, 300, force="stream_wg_run")["run"] == 32
    assert plan(ms, CROSS, 1, 7, 7, 3, force="stream_wg_run")["run"] == 7
    p = plan(ms, GROUPED, 3, 300, 100, 70, force="stream_wg_run")
    assert (p["family"], p["run"], p["grid"]) == ("stream_wg", 32, 3 * 4), p
    p = plan(ms, LIST, 4, 300, 32, 64, force="stream_wg_run")
    assert (p["family"], p["run"], p["grid"]) == ("stream_wg", 0, 300), p
    p = plan(ms, CROSS, 1, 50000, 32, 64, force="stream_wg_pair")
    assert (p["family"], p["run"], p["grid"]) == ("stream_wg", 0, 50000), p
    assert plan(ms, CROSS, 1, 50000, 32, 64, force="stream_wg")["run"] >= 2
    # The thread's override restores a run mode.
    Q = torch.randn(1, 64, 128, dtype=torch.bfloat16)
    D = torch.empty(50000, 64, 128, dtype=torch.bfloat16, device="meta")
    with ms.forcing("stream_wg_pair"):
        with ms.forcing("mma"):
            assert ms.explain(Q, D)["family"] == "mma"
        assert (ms.explain(Q, D)["family"], ms.explain(Q, D)["run"]) == ("stream_wg", 0)
    assert ms.explain(Q, D)["run"] >= 2


# The short-document rows of benchmarks/bench_short_docs.py: (Nq, Nd, Ld).
SHORT_SHARED = [(32, 50000, 8), (32, 50000, 16), (32, 50000, 32), (128, 20000, 16)]


@pytest.mark.parametrize("arch,sms", [(90, 132), (80, 108)], ids=["sm90a-132", "sm80-108"])
def test_packed_rules(ms, arch, sms):
    # Several queries over many short shared documents: the packed kernel,
    # 32-row query slots (4 per 128-row tile), <= 512 documents per CTA,
    # every (tile, document) covered once.
    for nq, nd, ld in SHORT_SHARED:
        for argmax in (False, True):
            p = plan(ms, CROSS, nq, nd, 32, ld, arch=arch, sms=sms, argmax=argmax)
            if argmax and arch == 90 and ld > 20:  # the training forward: wgmma's flat tile cost wins
                assert p["family"] == "wgmma", p
                continue
            assert (p["family"], p["rows"], p["qpt"], p["ks"]) == ("packed", 32, 4, 8), p
            assert 1 <= p["dpc"] <= 512 and p["cpg"] * p["dpc"] >= nd > (p["cpg"] - 1) * p["dpc"], p
            assert p["items"] == p["grid"] == -(-nq // 4) * p["cpg"], p
    # Query slots are the power of two >= lq; 64-wide rows take 4 k steps.
    p = plan(ms, CROSS, 8, 5000, 17, 8, dim=64, arch=arch, sms=sms)
    assert (p["family"], p["rows"], p["qpt"], p["ks"]) == ("packed", 32, 4, 4), p
    assert plan(ms, CROSS, 200, 5000, 1, 8, arch=arch, sms=sms)["rows"] == 1
    assert plan(ms, CROSS, 8, 5000, 5, 8, arch=arch, sms=sms)["rows"] == 8
    # Not by the rule: one query (the streams), few or longer documents,
    # queries past 32 rows, fp32, normalize, odd widths, per-query candidates.
    for ld in (8, 16, 32):
        assert plan(ms, CROSS, 1, 200000, 32, ld, arch=arch, sms=sms)["family"] in ("stream", "stream_wg")
    # Padded 64-token documents: packed on sm_90a (one length: the aligned
    # epilogue), not with an argmax (the training forward) nor on sm_80.
    p64 = plan(ms, CROSS, 32, 25000, 32, 64, arch=arch, sms=sms)["family"]
    assert (p64 == "packed") == (arch == 90), p64
    assert plan(ms, CROSS, 32, 25000, 32, 64, argmax=True, arch=arch, sms=sms)["family"] != "packed"
    assert plan(ms, CROSS, 32, 25000, 32, 48, arch=arch, sms=sms)["family"] != "packed"
    assert plan(ms, CROSS, 32, 12500, 32, 128, arch=arch, sms=sms)["family"] != "packed"
    assert plan(ms, CROSS, 32, 32, 32, 16, arch=arch, sms=sms)["family"] != "packed"
    assert plan(ms, CROSS, 32, 5000, 33, 8, arch=arch, sms=sms)["family"] != "packed"
    assert plan(ms, CROSS, 32, 5000, 32, 8, dtype=torch.float32, arch=arch, sms=sms)["family"] != "packed"
    assert plan(ms, CROSS, 32, 5000, 32, 8, normalize=True, arch=arch, sms=sms)["family"] != "packed"
    assert plan(ms, CROSS, 32, 5000, 32, 8, dim=96, arch=arch, sms=sms)["family"] != "packed"
    assert plan(ms, CROSS, 32, 5000, 32, 8, align=8, arch=arch, sms=sms)["family"] != "packed"
    assert plan(ms, GROUPED, 64, 64000, 32, 24, arch=arch, sms=sms)["family"] != "packed"
    # Forced: per-query candidates (one query per tile, CTAs within its K
    # documents) and longer documents; never where it cannot read the rows.
    p = plan(ms, CROSS, 1, 200000, 32, 8, arch=arch, sms=sms, force="packed")
    assert (p["family"], p["qpt"], p["items"]) == ("packed", 4, p["cpg"]), p
    p = plan(ms, GROUPED, 64, 64000, 32, 24, arch=arch, sms=sms, force="packed")
    assert (p["family"], p["qpt"]) == ("packed", 1) and p["items"] == 64 * p["cpg"], p
    assert p["cpg"] * p["dpc"] >= 1000 > (p["cpg"] - 1) * p["dpc"], p
    assert plan(ms, CROSS, 32, 12500, 32, 128, arch=arch, sms=sms, force="packed")["family"] == "packed"
    assert plan(ms, LIST, 32, 5000, 32, 8, arch=arch, sms=sms, force="packed")["family"] != "packed"
    assert plan(ms, CROSS, 32, 5000, 32, 8, dtype=torch.float32, force="packed")["family"] != "packed"


def test_force(ms):
    assert plan(ms, CROSS, 4, 500, 32, 300, force="stream")["family"] == "stream"
    assert plan(ms, CROSS, 1, 1000, 32, 300, force="stream")["family"] == "stream"
    assert plan(ms, CROSS, 1, 1000, 32, 300, force="simt")["family"] == "simt"
    assert plan(ms, CROSS, 1, 10, 32, 300, force="wgmma")["family"] == "wgmma"
    assert plan(ms, CROSS, 1, 10, 32, 300, force="stream_wg")["family"] == "stream_wg"
    with pytest.raises(RuntimeError, match="unknown family"):
        plan(ms, CROSS, 1, 10, 32, 300, force="fast")


def test_every_plan_is_built(ms):
    """The planner returns only tile configurations and stream stages that are
    instantiated (plan::kMmaConfigs, plan::kStreamWgStages)."""
    seen = set()
    dims = (16, 64, 96, 128, 256, 1024)
    grid = itertools.product((90, 86, 80), (CROSS, GROUPED, LIST), (1, 2, 3, 5, 64),
                             (1, 8, 16, 17, 32, 33, 48, 64, 65, 96, 128, 129, 300), dims,
                             (torch.bfloat16, torch.float32), (False, True))
    for arch, layout, nq, lq, dim, dtype, argmax in grid:
        p = plan(ms, layout, nq, nq * 10, lq, 200, dim=dim, dtype=dtype, arch=arch, argmax=argmax,
                 precision="tf32" if lq % 2 else "default")
        if p["family"] in ("mma",):
            assert 0 <= p["cfg"] < p["mma_configs"], p
            seen.add(p["cfg"])
        if p["family"] == "stream_wg":
            assert p["stages"] == 4
    assert seen == set(range(3)), seen


def test_explain(ms):
    Q = torch.randn(1, 32, 128, dtype=torch.bfloat16)
    D = torch.randn(1000, 300, 128, dtype=torch.bfloat16, device="meta")
    assert ms.explain(Q, D)["family"] == "stream_wg"
    assert ms.explain(Q, D, arch="8.0", sm_count=108)["family"] == "stream"
    assert ms.explain(Q, D, arch="sm_80")["sm_count"] == 108
    assert ms.explain(Q, D, force="simt")["family"] == "simt"
    Qs = torch.randn(32, 32, 128, dtype=torch.bfloat16, requires_grad=True)
    Ds = torch.randn(32, 80, 128, dtype=torch.bfloat16)
    p = ms.explain(Qs, Ds)
    assert p["family"] == "wgmma"
    with torch.no_grad():
        assert ms.explain(Qs, Ds)["family"] == "wgmma"
    # Candidates per query ([Nq, K, Ld, d]) plan as the padded layout.
    Dk = torch.randn(32, 50, 180, 128, dtype=torch.bfloat16, device="meta")
    assert ms.explain(torch.randn(32, 32, 128, dtype=torch.bfloat16), Dk)["family"] == "stream_wg"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_explain_on_device(ms):
    """On a CUDA tensor the plan is the device's (runtime occupancy)."""
    Q = torch.randn(1, 32, 128, dtype=torch.bfloat16, device="cuda")
    D = torch.randn(100, 300, 128, dtype=torch.bfloat16, device="cuda")
    p = ms.explain(Q, D)
    major, minor = torch.cuda.get_device_capability()
    assert p["arch"] == major * 10 + minor
    assert p["sm_count"] == torch.cuda.get_device_properties(0).multi_processor_count
    assert p["family"] in ("stream", "stream_wg")


def test_forcing_scopes_the_override(ms):
    """maxsim.forcing sets the thread's override for every plan made inside
    it (explain's force= still wins), nests and restores on exit."""
    Q = torch.randn(1, 32, 128, dtype=torch.bfloat16)
    D = torch.randn(1000, 300, 128, dtype=torch.bfloat16, device="meta")
    assert ms.explain(Q, D)["family"] == "stream_wg"
    with ms.forcing("simt"):
        assert ms.explain(Q, D)["family"] == "simt"
        assert ms.explain(Q, D, force="mma")["family"] == "mma"
        with ms.forcing("stream"):
            assert ms.explain(Q, D)["family"] == "stream"
        assert ms.explain(Q, D)["family"] == "simt"
    assert ms.explain(Q, D)["family"] == "stream_wg"
    with pytest.raises(ValueError, match="family must be one of"):
        with ms.forcing("fast"):
            pass
    with pytest.raises(KeyError):
        with ms.forcing("mma"):
            raise KeyError("inside")
    assert ms.explain(Q, D)["family"] == "stream_wg"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["stream", "stream_wg", "mma", "wgmma", "simt"])
def test_forcing_runs_the_family(ms, family):
    """A forced family computes the same scores (bf16 inputs, fp32 sums) on
    the device, in eager mode and in a captured CUDA graph."""
    g = torch.Generator(device="cuda").manual_seed(7)
    Q = torch.randn(3, 33, 128, dtype=torch.bfloat16, device="cuda", generator=g)
    D = torch.randn(40, 77, 128, dtype=torch.bfloat16, device="cuda", generator=g)
    ref = torch.einsum("qid,njd->qnij", Q.double(), D.double()).amax(-1).sum(-1)
    with ms.forcing(family):
        if ms.explain(Q, D)["family"] != family:
            pytest.skip(f"{family} cannot take this call on this device")
        out = ms.maxsim(Q, D)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ms.maxsim(Q, D)
    graph.replay()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(captured, out, rtol=0, atol=0)
