"""The examples run, and the contrastive training example's loss curve matches
the plain PyTorch reference step for step."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from conftest import ROOT


def _example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_contrastive_training_matches_reference(device, dtype):
    ex = _example("03_contrastive_training")
    # bf16 rounding differences compound through Adam: compare a shorter run.
    steps = 25 if dtype == torch.float32 else 15
    ours = ex.train("maxsim", steps=steps, device=device, dtype=dtype)
    ref = ex.train("reference", steps=steps, device=device, dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert abs(a - b) <= tol * max(1.0, abs(b)), f"step {step}: {a} vs {b}"
    assert ours[-1] < 0.7 * ours[0], "the model did not learn"


def test_quickstart_runs():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "01_quickstart.py")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "relative error vs fp64 reference" in r.stdout
    err = float(r.stdout.split("relative error vs fp64 reference:")[1].split()[0])
    assert err < 1e-2


def _run(name, *args):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py"), *map(str, args)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _is_png(path):
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_token_alignment(tmp_path):
    out = _run("02_token_alignment", "--out", tmp_path / "a.png")
    ex = _example("02_token_alignment")
    Q, D = ex.embed(ex.QUERY), ex.embed(ex.DOC)
    ref = (Q.double() @ D.double().T).argmax(-1).tolist()
    printed = [int(line.split("(doc token ")[1].split(",")[0]) for line in out.splitlines() if "(doc token " in line]
    assert printed == ref
    # The toy vocabulary is built so that each query word lands on its synonym.
    assert [ex.DOC[j] for j in printed] == ["reserve", "low-cost", "airline", "to", "france"]
    assert f"heat-map: {tmp_path / 'a.png'}" in out and _is_png(tmp_path / "a.png")


def test_memory_vs_naive(tmp_path):
    out = _run("04_memory_vs_naive", "--nd", 64, "--ld", 64, 512, "--out", tmp_path / "m.png")
    rows = {int(c[0]): (float(c[1]), float(c[2])) for c in (line.split() for line in out.splitlines())
            if len(c) == 3 and c[0].isdigit()}
    naive, ours = rows[512]
    # Naive materialises [8, 64, 32, 512] = 32 MiB in fp32 (16 in bf16 on GPU); maxsim only its [8, 64] output.
    assert naive > 8 and ours < naive / 10, rows
    assert rows[512][0] > rows[64][0]
    assert _is_png(tmp_path / "m.png")


def test_pylate_dropin():
    pytest.importorskip("pylate")  # CI installs it; on the GPU machine it comes from the carried wheels
    out = _run("05_pylate_dropin", "--queries", 4, "--docs", 32, "--candidates", 8, "--ld", 64)
    assert float(out.split("max relative difference")[1].split()[0]) < 1e-5
    assert "maxsim same order True" in out
    assert float(out.split("max score difference")[1].split()[0]) < 1e-4


def _losses(out):
    """The (host, maxsim) loss of every step from an example's loss table."""
    rows = [line.split() for line in out.splitlines()]
    return [(float(r[1]), float(r[2])) for r in rows if len(r) == 3 and r[0].isdigit()]


def _needs(package):
    # Checked without importing: PyLate and colpali-engine import transformers,
    # which needs maxsim.integrations.import_transformers() first (see there).
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")


def test_pylate_training():
    _needs("pylate")
    out = _run("06_pylate_training", "--ci")
    curve = _losses(out)
    assert len(curve) == 12, out  # 6 contrastive + 6 distillation steps
    # fp32 scores of two implementations can pick different tokens of a near
    # tie, and training then drifts apart a little (up to ~3e-4 seen, with
    # the tokenizer's vocabulary order changing from run to run); a wrong
    # gradient moves the loss by a step's change, ~1e-2 here.
    for step, (own, ours) in enumerate(curve):
        assert abs(own - ours) <= 2e-3 * max(1.0, abs(own)), f"step {step}: {own} vs {ours}"
    assert len({own for own, _ in curve}) == len(curve), "the parameters did not change"
    trained = [line for line in out.splitlines() if line.startswith("trained with")]
    assert len(trained) == 2 and all(line.endswith("identical with maxsim True") for line in trained), trained
    assert all(float(line.split("recall@10")[1].split(";")[0]) > 0.2 for line in trained), trained


def test_colpali_pages():
    _needs("colpali_engine")
    out = _run("07_colpali_pages", "--ci")
    curve = _losses(out)
    assert len(curve) == 12, out
    for step, (own, ours) in enumerate(curve):
        assert abs(own - ours) <= 1e-4 * max(1.0, abs(own)), f"step {step}: {own} vs {ours}"
    assert float(out.split("max score difference")[1].split()[0]) < 1e-5
    assert "rankings identical True" in out
    before, after = (float(x) for x in out.split("recall@1 before training ")[1].split(";")[0].split(", after "))
    assert after > 0.5 and after > before + 0.3, (before, after)  # the head learned to ignore the nuisance
