"""Programmatic dependent launch (CUDA, sm_90+; maxsim-cuda/common/pdl.cuh): every
kernel starts while the previous one in the stream finishes and waits for it
before touching memory. These tests chain the ops so that each consumes the
previous kernel's output at once and the allocator recycles freed inputs
into the next outputs, eagerly and in a CUDA graph, and compare every result
with ordinary launches (MAXSIM_PDL=0, in a child process) bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, capture_cuda_graph, rand

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CHILD = r"""
import os, sys, torch
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from conftest import MAXSIM
import test_dependent_launch as t
torch.save({k: v.cpu() for k, v in t.pipeline(MAXSIM).items()}, sys.argv[2])
"""


def pipeline(ms) -> dict[str, torch.Tensor]:
    """Chains of dependent ops on fixed random inputs; every intermediate is
    dropped as soon as it is consumed, so its memory is reused."""
    gen = torch.Generator().manual_seed(7)
    dev = "cuda"
    out = {}
    Q = rand(3, 17, 128, dtype=torch.bfloat16, device=dev, gen=gen)
    D = rand(700, 33, 128, dtype=torch.bfloat16, device=dev, gen=gen)
    # forward -> select -> decode, repeated with the scores freed in between
    for i in range(6):
        s = ms.maxsim(Q, D[i * 50:i * 50 + 400])
        keys = ms.ops.block_topk(s, 0, 37)
        del s
        sc, ids = ms.ops.decode_keys(keys)
        del keys
        out[f"fwd{i}_s"], out[f"fwd{i}_ids"] = sc, ids
    # search over an int8 corpus with the exact re-score: quantise -> scan ->
    # select -> zero -> fused re-score, back to back
    flat = D.reshape(-1, 128)
    off = torch.arange(0, flat.shape[0] + 1, 33, device=dev)
    corpus = ms.Corpus(flat, off, device=dev, quantization="int8", scale_layout="document", rescore="device")
    for i in range(3):
        s, ids = ms.search(Q[i % 3, : 5 + 6 * i], corpus, 20, oversample=1 + i)
        out[f"search{i}_s"], out[f"search{i}_ids"] = s, ids
    # training step: forward with argmax -> backward (dq and dd)
    Qg = Q.float().requires_grad_()
    Dg = D[:40].float().requires_grad_()
    g = torch.randn(3, 40, generator=gen).to(dev)
    ms.maxsim(Qg, Dg, normalize=True).backward(g)
    out["dq"], out["dd"] = Qg.grad, Dg.grad
    return out


def test_dependent_launches_match_ordinary_launches(ms, tmp_path):
    got = pipeline(ms)
    path = tmp_path / "ordinary.pt"
    env = dict(os.environ, MAXSIM_PDL="0")
    r = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(path)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    ref = torch.load(path)
    assert got.keys() == ref.keys()
    for k in got:
        assert torch.equal(got[k].cpu(), ref[k]), k


def test_dependent_launches_in_a_graph(ms):
    """The same chain captured in one CUDA graph and replayed on new inputs
    equals the eager results (the graph's programmatic edges keep the order)."""
    gen = torch.Generator().manual_seed(3)
    Q = rand(2, 32, 128, dtype=torch.bfloat16, device="cuda", gen=gen)
    D = rand(300, 40, 128, dtype=torch.bfloat16, device="cuda", gen=gen)

    def chain():
        s = ms.maxsim(Q, D)  # [2, 300]
        t = ms.maxsim(Q, D[:150] * 1)  # a torch kernel, then ours on its output
        return s, t, torch.topk(s, 10, dim=1).indices

    graph, outs = capture_cuda_graph(chain)
    for _ in range(3):
        Q.copy_(rand(2, 32, 128, dtype=torch.bfloat16, device="cuda", gen=gen))
        D.copy_(rand(300, 40, 128, dtype=torch.bfloat16, device="cuda", gen=gen))
        graph.replay()
        ref = chain()
        for a, b in zip(outs, ref):
            assert torch.equal(a, b)
