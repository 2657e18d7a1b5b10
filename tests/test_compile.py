"""torch.compile(fullgraph=True) over every public function (no graph breaks,
so no host sync in the traced path), and CUDA-graph capture on GPUs."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close, capture_cuda_graph, rand

BACKENDS = ["aot_eager", "inductor"]


def _inputs(device):
    gen = torch.Generator().manual_seed(1)
    Q = rand(2, 6, 16, device=device, gen=gen)
    D = rand(2, 3, 9, 16, device=device, gen=gen)
    qlen = torch.tensor([6, 3], device=device)
    dlen = torch.tensor([[9, 1, 0], [4, 9, 2]], device=device)
    docs = rand(20, 16, device=device, gen=gen)
    off = torch.tensor([0, 5, 5, 20], device=device)
    qoff = torch.tensor([0, 6, 9], device=device)
    pq = torch.tensor([1, 0, 1], device=device)
    pd = torch.tensor([2, 2, 0], device=device)
    return Q, D, qlen, dlen, docs, off, qoff, pq, pd


CALLS = {
    "candidates": lambda ms, Q, D, ql, dl, docs, off, qoff, pq, pd: ms.score_candidates_padded(Q, D, ql, dl),
    "candidates_argmax": lambda ms, Q, D, ql, dl, docs, off, qoff, pq, pd:
        ms.score_candidates_padded_with_argmax(Q, D, ql, dl)[1].float().sum() +
        ms.score_candidates_padded_with_argmax(Q, D, ql, dl)[0],
    "contrastive": lambda ms, Q, D, ql, dl, docs, off, qoff, pq, pd: ms.score_contrastive(Q, docs, off, ql),
    "contrastive_argmax": lambda ms, Q, D, ql, dl, docs, off, qoff, pq, pd:
        ms.score_contrastive_with_argmax(Q, docs, off)[0],
    "pairs": lambda ms, Q, D, ql, dl, docs, off, qoff, pq, pd:
        ms.score_pairs_packed(Q.reshape(-1, 16)[:9], qoff, docs, off, pq, pd, max_query_length=6),
    "pairs_argmax": lambda ms, Q, D, ql, dl, docs, off, qoff, pq, pd:
        ms.score_pairs_packed_with_argmax(Q.reshape(-1, 16)[:9], qoff, docs, off, pq, pd,
                                          max_query_length=6)[0],
    "maxsim_cross": lambda ms, Q, D, ql, dl, docs, off, qoff, pq, pd: ms.maxsim(Q, D[0], normalize=True),
    "maxsim_grouped": lambda ms, Q, D, ql, dl, docs, off, qoff, pq, pd: ms.maxsim(Q, D, d_mask=D[..., 0] > 0),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_compile_forward(ms, device, name):
    args = _inputs(device)
    fn = CALLS[name]
    eager = fn(ms, *args)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: fn(ms, *a), fullgraph=True, backend="aot_eager")
    assert_close(compiled(*args), eager, torch.float32)


def test_compile_rescore_topk(ms, device):
    """The search re-score op (fake kernel: [Nq, k] scores and ids) traces
    without a graph break; bf16 takes the fused kernel on CUDA."""
    gen = torch.Generator().manual_seed(2)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    q = rand(12, 32, device=device, gen=gen).to(dt)
    docs = rand(20, 32, device=device, gen=gen).to(dt)
    i32 = dict(device=device, dtype=torch.int32)
    qs, ql = torch.tensor([0, 6], **i32), torch.tensor([6, 5], **i32)
    ds, dl = torch.tensor([0, 5, 5, 12], **i32), torch.tensor([5, 0, 7, 8], **i32)
    keys = ms.keys.encode_keys(torch.zeros(2, 3, device=device),
                                    torch.tensor([[3, 0, 2], [1, -1, 3]], device=device))
    fn = lambda k: ms.ops.rescore_topk(q, qs, ql, None, docs, ds, dl, None, k, 6, 4)  # noqa: E731
    eager = fn(keys)
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(keys)
    assert torch.equal(got[1], eager[1]) and torch.equal(got[0], eager[0])
    assert eager[1].tolist()[1][2:] == [-1, -1] and eager[0].shape == (2, 4)


TRAIN = {
    "candidates": lambda ms, Q, D, ql, dl, docs, off, qoff, pq, pd: ms.score_candidates_padded_train(Q, D, ql, dl),
    "contrastive": lambda ms, Q, D, ql, dl, docs, off, qoff, pq, pd: ms.score_contrastive_train(Q, docs, off),
    "pairs": lambda ms, Q, D, ql, dl, docs, off, qoff, pq, pd:
        ms.score_pairs_packed_train(Q.reshape(-1, 16)[:9], qoff, docs, off, pq, pd, max_query_length=6),
    "maxsim": lambda ms, Q, D, ql, dl, docs, off, qoff, pq, pd: ms.maxsim(Q, D),
    "contrastive_normalize": lambda ms, Q, D, ql, dl, docs, off, qoff, pq, pd:
        ms.score_contrastive_train(Q, docs, off, normalize=True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(TRAIN))
def test_compile_train(ms, device, name, backend):
    if backend == "inductor" and name != "maxsim":
        pytest.skip("inductor is exercised once (slow to compile on small CI machines)")
    args = list(_inputs(device))
    args[0].requires_grad_()
    args[1].requires_grad_()
    args[4].requires_grad_()
    fn = TRAIN[name]

    def step(*a):
        s = fn(ms, *a)
        return (s * torch.linspace(-1, 1, s.numel(), device=s.device).view_as(s)).sum()

    eager = step(*args)
    ge = torch.autograd.grad(eager, [args[0], args[1], args[4]], allow_unused=True)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    out = compiled(*args)
    gc = torch.autograd.grad(out, [args[0], args[1], args[4]], allow_unused=True)
    assert_close(out, eager, torch.float32)
    for a, b in zip(gc, ge):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture(ms):
    Q, D, ql, dl, docs, off, qoff, pq, pd = _inputs("cuda")
    outs = {}
    static = {}
    for name, fn in CALLS.items():
        static[name] = fn(ms, Q, D, ql, dl, docs, off, qoff, pq, pd)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for name, fn in CALLS.items():
            outs[name] = fn(ms, Q, D, ql, dl, docs, off, qoff, pq, pd)
    Q.copy_(rand(*Q.shape, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    for name, fn in CALLS.items():
        assert_close(outs[name], fn(ms, Q, D, ql, dl, docs, off, qoff, pq, pd), torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("normalize", [False, True])
def test_cuda_graph_capture_train(ms, normalize):
    """A whole training step (forward + both gradients, whose kernels run on
    two streams) captured once and replayed on new inputs: bitwise the eager
    step's gradients."""
    gen = torch.Generator().manual_seed(2)
    Q = rand(5, 33, 64, device="cuda", gen=gen).bfloat16().requires_grad_()
    D = rand(7, 301, 64, device="cuda", gen=gen).bfloat16().requires_grad_()
    g = torch.randn(5, 7, generator=gen).cuda()

    def step():
        return torch.autograd.grad(ms.maxsim(Q, D, normalize=normalize), [Q, D], g)

    graph, (dq, dd) = capture_cuda_graph(step)
    with torch.no_grad():
        Q.copy_(rand(5, 33, 64, device="cuda", gen=gen))
        D.copy_(rand(7, 301, 64, device="cuda", gen=gen))
    graph.replay()
    torch.cuda.synchronize()
    eq, ed = step()
    assert torch.equal(dq, eq) and torch.equal(dd, ed)
    assert dq.abs().sum() > 0 and dd.abs().sum() > 0
