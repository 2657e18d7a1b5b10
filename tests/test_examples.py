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
