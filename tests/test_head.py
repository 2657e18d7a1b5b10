"""maxsim_from_hidden: MaxSim through a projection head, against an fp64
reference, in one chunk and in many, forward and gradients of every input."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, relerr


# The two training paths: 0 winners per row sends every step to the
# composition's dense backward, a huge bound every step to the winners'.
TRAIN_PATHS = {"dense": 0, "winners": 10 ** 9}


@pytest.fixture(params=list(TRAIN_PATHS))
def train_path(request, ms, monkeypatch):
    monkeypatch.setattr(ms.head, "_WINNERS_PER_ROW", TRAIN_PATHS[request.param])
    return request.param


def _inputs(device, Nq, Lq, Nd, Ld, dm, do, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q = torch.nn.functional.normalize(torch.randn(Nq, Lq, do, generator=g), dim=-1).to(device)
    H = torch.randn(Nd, Ld, dm, generator=g).to(device)
    W = (torch.randn(do, dm, generator=g) / dm ** 0.5).to(device)
    b = (0.1 * torch.randn(do, generator=g)).to(device) if bias else None
    return Q, H, W, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("chunk_mib", [256, 0])  # 0: one document per chunk
def test_from_hidden_forward_and_gradients(ms, device, bias, normalize, chunk_mib, train_path):
    Q, H, W, b = _inputs(device, 2, 17, 5, 33, 48, 15, bias)
    d_mask = torch.ones(5, 33, dtype=torch.bool, device=device)
    d_mask[1, 7:] = False
    d_mask[3] = False  # an empty document
    leaves = [t.clone().requires_grad_(True) for t in (Q, H, W) + ((b,) if bias else ())]
    out = ms.maxsim_from_hidden(*leaves[:3], leaves[3] if bias else None, d_mask, normalize=normalize,
                                chunk_mib=chunk_mib)
    refs = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = ms.head.maxsim_from_hidden_reference(*refs[:3], refs[3] if bias else None, d_mask, normalize=normalize)
    assert out.shape == (2, 5) and relerr(out, ref, floor=1.0) < 1e-5
    assert torch.all(out[:, 3] == 0)
    gout = torch.randn(2, 5, generator=torch.Generator().manual_seed(9)).to(device)
    (out * gout).sum().backward()
    (ref * gout.double()).sum().backward()
    for a, r, name in zip(leaves, refs, "QHWb"):
        assert relerr(a.grad, r.grad) < 1e-4, name


@pytest.mark.parametrize("device", DEVICES)
def test_from_hidden_bf16_and_2d_query(ms, device):
    Q, H, W, b = _inputs(device, 1, 9, 4, 20, 64, 32, True, seed=1)
    out = ms.maxsim_from_hidden(Q[0].bfloat16(), H.bfloat16(), W.bfloat16(), b.bfloat16())
    ref = ms.head.maxsim_from_hidden_reference(Q[0], H, W, b)
    assert out.shape == (4,) and relerr(out, ref, floor=1.0) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_hidden_shared_winners(ms, device, dtype, train_path):
    """Many query tokens picking the same few document rows, every gradient
    against fp64, and the same gradients twice (deterministic)."""
    Q, H, W, b = _inputs(device, 6, 40, 3, 4, 56, 24, True, seed=6)
    Q = Q.to(dtype)
    H, W, b = H.to(dtype), W.to(dtype), b.to(dtype)
    d_mask = torch.zeros(3, 4, dtype=torch.bool, device=device)
    d_mask[:, :2] = True
    d_mask[2, 1] = False  # a document of one token: every query token picks it
    q_mask = torch.ones(6, 40, dtype=torch.bool, device=device)
    q_mask[4, 3:] = False
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_(True) for t in (Q, H, W, b)]
        out = ms.maxsim_from_hidden(*leaves, d_mask, q_mask=q_mask)
        gout = torch.randn(6, 3, generator=torch.Generator().manual_seed(7)).to(device)
        (out * gout).sum().backward()
        grads.append([t.grad for t in leaves])
    refs = [t.detach().double().requires_grad_(True) for t in (Q, H, W, b)]
    ref = ms.head.maxsim_from_hidden_reference(*refs, d_mask, q_mask=q_mask)
    (ref * gout.double()).sum().backward()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert relerr(out, ref, floor=1.0) < tol / 10
    for a, a2, r, name in zip(grads[0], grads[1], refs, "QHWb"):
        assert a.dtype == dtype and relerr(a, r.grad) < tol, name
        assert torch.equal(a, a2), name
    assert torch.all(grads[0][1][:, 2:] == 0)  # masked rows get nothing


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_mib", [256, 0])  # 0: one query (and its candidates) per chunk
def test_from_hidden_candidates(ms, device, chunk_mib, train_path):
    """Each query's own K candidates, H [Nq, K, Ld, d_model] -> [Nq, K]:
    masks (an empty candidate, a padded query), forward and every gradient
    against fp64, in one chunk and one query per chunk."""
    g = torch.Generator().manual_seed(4)
    Nq, K, Lq, Ld, dm, do = 3, 4, 9, 17, 40, 15
    Q = torch.nn.functional.normalize(torch.randn(Nq, Lq, do, generator=g), dim=-1).to(device)
    H = torch.randn(Nq, K, Ld, dm, generator=g).to(device)
    W = (torch.randn(do, dm, generator=g) / dm ** 0.5).to(device)
    b = (0.1 * torch.randn(do, generator=g)).to(device)
    d_mask = torch.rand(Nq, K, Ld, generator=g).to(device) > 0.3
    d_mask[1, 2] = False
    q_mask = torch.ones(Nq, Lq, dtype=torch.bool, device=device)
    q_mask[2, 5:] = False
    leaves = [t.clone().requires_grad_(True) for t in (Q, H, W, b)]
    out = ms.maxsim_from_hidden(*leaves, d_mask, q_mask=q_mask, chunk_mib=chunk_mib)
    refs = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = ms.head.maxsim_from_hidden_reference(*refs, d_mask, q_mask=q_mask)
    assert out.shape == (Nq, K) and relerr(out, ref, floor=1.0) < 1e-5
    assert out[1, 2] == 0
    gout = torch.randn(Nq, K, generator=torch.Generator().manual_seed(5)).to(device)
    (out * gout).sum().backward()
    (ref * gout.double()).sum().backward()
    for a, r, name in zip(leaves, refs, "QHWb"):
        assert relerr(a.grad, r.grad) < 1e-4, name
    with pytest.raises(ValueError):
        ms.maxsim_from_hidden(Q[0], H, W, b)  # a 2-D query with per-query candidates


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("candidates", [False, True])
def test_from_hidden_winners_poison_and_shapes(ms, device, dtype, candidates, train_path):
    """Odd shapes (Lq 1 / 15, Ld 1 / 33, d_model 17), garbage in masked
    hidden rows (their gradients stay exact zeros, every other gradient
    against fp64), documents without a valid token, a query with none,
    gradients of one input only. The winners' path never reads a masked row,
    so there the garbage is NaN and inf; the composition's dW is a product
    with every row, as torch's Linear backward is, so there it is finite."""
    g = torch.Generator().manual_seed(21)
    # Winners per document (Nq Lq shared, Lq candidates) few and many against
    # Ld: both orders of the backward (project the winners' gradients, then
    # place them; or place them, then project every row).
    for Nq, Lq, Nd, Ld in ((1, 1, 3, 1), (3, 15, 5, 33), (2, 15, 5, 33), (2, 17, 4, 7)):
        lead = (Nq, Nd) if candidates else (Nd,)
        Q = torch.nn.functional.normalize(torch.randn(Nq, Lq, 24, generator=g), dim=-1).to(device, dtype)
        H = torch.randn(*lead, Ld, 17, generator=g).to(device, dtype)
        W = (torch.randn(24, 17, generator=g) / 17 ** 0.5).to(device, dtype)
        b = (0.1 * torch.randn(24, generator=g)).to(device, dtype)
        d_mask = (torch.rand(*lead, Ld, generator=g) > 0.3).to(device)
        d_mask[..., 0] = True
        d_mask[..., -1, :] = False  # the last document (or each query's last candidate) is empty
        H = H.masked_fill(~d_mask[..., None], float("nan") if train_path == "winners" else 1e4)
        H[..., -1, 0, 0] = float("inf") if train_path == "winners" else -1e4  # a token of the empty document
        q_mask = torch.ones(Nq, Lq, dtype=torch.bool, device=device)
        q_mask[-1] = Lq == 1  # the last query has no valid token (unless it has only one)
        clean = H.masked_fill(~d_mask[..., None], 0)
        refs = [t.detach().double().requires_grad_(True) for t in (Q, clean, W, b)]
        ref = ms.head.maxsim_from_hidden_reference(*refs, d_mask, q_mask=q_mask)
        gout = torch.randn(ref.shape, generator=g).double().to(device)
        (ref * gout).sum().backward()
        for only in (None, 1, 2):  # every input; H only; W only
            leaves = [t.clone().requires_grad_(only is None or i == only) for i, t in enumerate((Q, H, W, b))]
            out = ms.maxsim_from_hidden(*leaves, d_mask, q_mask=q_mask)
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            assert out.shape == ref.shape and relerr(out, ref, floor=1.0) < tol / 10
            (out * gout).sum().backward()
            for i, (a, r) in enumerate(zip(leaves, refs)):
                if only is not None and i != only:
                    assert a.grad is None
                    continue
                assert a.grad.dtype == dtype and relerr(a.grad, r.grad) < tol, (Nq, Lq, Nd, Ld, "QHWb"[i])
            if only in (None, 1):
                masked = ~d_mask
                assert torch.all(leaves[1].grad[masked] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_from_hidden_winners_wide_and_fp64(ms, device, train_path):
    """d_out past the per-winner kernel's 1024 and fp64 inputs (the CPU's;
    CUDA refuses them, as maxsim does) train through the compositions of the
    backward's steps, against fp64."""
    for do, dtype in ((1030, torch.float32), (24, torch.float64)):
        Q, H, W, b = (t.to(dtype) for t in _inputs(device, 2, 3, 4, 5, 16, do, True, seed=do))
        leaves = [t.clone().requires_grad_(True) for t in (Q, H, W, b)]
        if dtype == torch.float64 and device == "cuda":
            with pytest.raises(TypeError, match="float64 only on the CPU"):
                ms.maxsim_from_hidden(*leaves)
            continue
        out = ms.maxsim_from_hidden(*leaves)
        refs = [t.detach().double().requires_grad_(True) for t in leaves]
        ref = ms.head.maxsim_from_hidden_reference(*refs)
        assert relerr(out, ref, floor=1.0) < 1e-5
        gout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(device)
        (out * gout).sum().backward()
        (ref * gout.double()).sum().backward()
        for a, r, name in zip(leaves, refs, "QHWb"):
            assert a.grad.dtype == dtype and relerr(a.grad, r.grad) < 1e-4, (do, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 3, 0, 5), (2, 0, 4, 5), (2, 3, 4, 0), (0, 3, 4, 5)],
                         ids=["no-docs", "no-query-tokens", "no-doc-tokens", "no-queries"])
def test_from_hidden_training_empty(ms, device, shape, train_path):
    """Empty extents: zero scores of the right shape and zero gradients of
    every input's shape, shared documents and candidates."""
    Nq, Lq, Nd, Ld = shape
    for lead in ((Nd,), (Nq, Nd)):
        leaves = [torch.randn(*s, device=device, requires_grad=True)
                  for s in ((Nq, Lq, 8), lead + (Ld, 16), (8, 16), (8,))]
        out = ms.maxsim_from_hidden(*leaves)
        assert out.shape == (Nq, Nd) and torch.all(out == 0)
        out.sum().backward()
        for t in leaves:
            assert t.grad.shape == t.shape and torch.all(t.grad == 0)


def _winners(Nq, c, Lq, Ld, g, device):
    """Random winners [Nq, c, Lq] with -1 (none) in a fifth, as a strided
    slice of a larger argmax (the backward's chunks are)."""
    idx = torch.randint(0, max(Ld, 1), (Nq, c + 2, Lq), generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    return idx.to(device)[:, 1:-1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("d_out", [15, 128, 200])
def test_head_winner_grad_op(ms, device, dtype, normalize, d_out):
    """head_winner_grad against fp64 autograd of sum(w <q, u(unit)>): dq,
    each row's gradient dp and db; rows without a winner are NaN and must
    not be read; the same bits twice."""
    ops = ms.head.ops  # importing the head registers the CPU composition
    g = torch.Generator().manual_seed(d_out)
    Nq, c, Lq = 3, 37, 5
    idx = _winners(Nq, c, Lq, 9, g, device)
    unit = torch.randn(Nq, c, Lq, d_out, generator=g).to(device, dtype)
    unit = unit.masked_fill((idx < 0)[..., None], float("nan"))
    q = torch.randn(Nq, Lq, d_out, generator=g).to(device)
    grad = torch.randn(Nq, c + 3, generator=g).to(device)[:, 2:-1]
    won = (idx >= 0)[..., None].double()
    u64 = torch.nan_to_num(unit.double(), nan=0.0).requires_grad_(True)
    u = torch.nn.functional.normalize(u64, dim=-1, eps=1e-12) if normalize else u64
    w = grad.double()[..., None, None] * won
    (w * u * q.double()[:, None]).sum().backward()
    dq_ref = (w * u).sum(1)
    for need_dp in (True, False):
        dq, dp, db = ops.head_winner_grad(unit, q, grad, idx, normalize, need_dp)
        assert dq.dtype == torch.float32 and relerr(dq, dq_ref) < 1e-5
        if not need_dp:
            assert dp.numel() == 0 and db.numel() == 0
            continue
        assert dp.dtype == dtype and dp.shape == unit.shape
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert relerr(dp, u64.grad) < tol and torch.all(dp[idx < 0] == 0)
        assert relerr(db, u64.grad.sum((0, 1, 2))) < 1e-4
        again = ops.head_winner_grad(unit, q, grad, idx, normalize, need_dp)
        assert all(torch.equal(a, b) for a, b in zip((dq, dp, db), again))
    if normalize:  # a zero row: x / max(|x|, eps) is x / eps there
        idx[0, 0, 0], unit[0, 0, 0] = 3, 0
        dp = ops.head_winner_grad(unit, q, grad, idx, normalize, True)[1]
        assert relerr(dp[0, 0, 0], grad[0, 0] * q[0, 0] / 1e-12) < tol
    meta = ops.head_winner_grad(*(t.to("meta") for t in (unit, q, grad, idx)), normalize, True)
    assert [t.shape for t in meta] == [q.shape, unit.shape, (d_out,)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_query", [False, True])
@pytest.mark.parametrize("width", [17, 64, 520])
def test_head_scatter_rows_op(ms, device, dtype, per_query, width):
    """head_scatter_rows against an fp64 sum: every row written (zeros
    included, over a poisoned allocator), winners summed per token; on CUDA
    the same bits as the CPU composition (one summation order)."""
    ops = ms.head.ops  # importing the head registers the CPU composition
    g = torch.Generator().manual_seed(width)
    # The last: more winners a document (shared) than the kernel stages in
    # shared memory (4096).
    for Nq, c, Lq, Ld in ((3, 7, 15, 6), (2, 5, 33, 40), (1, 1, 1, 1), (4, 3, 17, 1), (3, 2, 1500, 5)):
        idx = _winners(Nq, c, Lq, Ld, g, device)
        rows = torch.randn(Nq, c, Lq, width, generator=g).to(device, dtype)
        rows = rows.masked_fill((idx < 0)[..., None], float("nan"))  # never read
        if device == "cuda":
            torch.empty(Nq * c * Ld * width * 4, device=device).fill_(float("nan"))  # poison freed memory
        out = ops.head_scatter_rows(rows, idx, Ld, per_query)
        won = (idx >= 0).cpu()
        doc = torch.arange(Nq * c).view(Nq, c) if per_query else torch.arange(c).expand(Nq, c)
        ref = torch.zeros(doc.numel() * Ld if per_query else c * Ld, width, dtype=torch.float64).index_add_(
            0, (doc[..., None] * Ld + idx.cpu())[won], rows.cpu()[won].double())
        ref = ref.view((Nq, c, Ld, width) if per_query else (c, Ld, width))
        assert out.dtype == dtype and out.shape == ref.shape
        assert relerr(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2)
        assert torch.equal(out.cpu(), ms.head._reference_head_scatter_rows(rows.cpu(), idx.cpu(), Ld, per_query))
    assert ops.head_scatter_rows(rows.to("meta"), idx.to("meta"), 3, per_query).shape[-2:] == (3, width)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [1, 15, 128, 200])
def test_head_normalize_ops(ms, device, dtype, dim):
    """head_normalize and its backward against fp64 autograd through
    F.normalize: odd widths and row counts, a zero row (x / eps), every
    output element written over a poisoned allocator, the same bits twice."""
    import warnings

    ops = ms.head.ops  # importing the head registers the CPU composition
    g = torch.Generator().manual_seed(dim)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for rows in (0, 1, 33, 1000):
        x = (torch.randn(rows, dim, generator=g) * torch.rand(rows, 1, generator=g).mul(4).add(0.1)).to(device, dtype)
        if rows > 1 and dtype != torch.float16:  # its gradient, g / 1e-12, is past fp16's range
            x[1] = 0
        gy = torch.randn(rows, dim, generator=g).to(device, dtype)
        x64 = x.double().requires_grad_(True)
        y64 = torch.nn.functional.normalize(x64, dim=-1, eps=1e-12)
        (y64 * gy.double()).sum().backward()
        if device == "cuda":
            torch.empty(rows * dim * 4 + 64, device=device).fill_(float("nan"))  # poison freed memory
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the CPU composition says it is one
            y, dx = ops.head_normalize(x), ops.head_normalize_backward(gy, x)
            again = ops.head_normalize(x), ops.head_normalize_backward(gy, x)
        assert y.dtype == dx.dtype == dtype and y.shape == dx.shape == x.shape
        assert torch.isfinite(y).all() and torch.isfinite(dx).all()
        # the gradient's scale, |g| / |x| per row (it cancels to ~0 at dim 1)
        scale = (gy.double() / x64.detach().norm(dim=-1, keepdim=True).clamp_min(1e-12)).norm().item()
        assert relerr(y, y64) < tol and relerr(dx, x64.grad, floor=scale) < tol
        assert torch.equal(y, again[0]) and torch.equal(dx, again[1])
    assert ops.head_normalize(x.to("meta")).shape == x.shape
    assert ops.head_normalize_backward(gy.to("meta"), x.to("meta")).shape == x.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA build only")
def test_head_backward_ops_compiled_on_cuda(ms):
    for op in ("head_winner_grad", "head_scatter_rows", "head_normalize", "head_normalize_backward"):
        assert (op, "CUDA") not in ms.FALLBACKS


@pytest.mark.parametrize("device", DEVICES)
def test_from_hidden_training_compile_and_graph(ms, device, train_path):
    """A training step on either path: the same gradients under
    torch.compile(fullgraph=True) and (CUDA) in a captured graph."""
    Q, H, W, b = _inputs(device, 2, 9, 6, 40, 64, 32, True, seed=13)
    d_mask = torch.ones(6, 40, dtype=torch.bool, device=device)
    d_mask[2, 20:] = False
    gout = torch.randn(2, 6, generator=torch.Generator().manual_seed(2)).to(device)
    leaves = [t.clone().requires_grad_(True) for t in (Q, H, W, b)]

    def step():
        for t in leaves:
            t.grad = None
        (ms.maxsim_from_hidden(*leaves, d_mask) * gout).sum().backward()
        return [t.grad for t in leaves]

    eager = [t.clone() for t in step()]
    compiled = torch.compile(lambda *a: ms.maxsim_from_hidden(*a, d_mask), fullgraph=True)
    for t in leaves:
        t.grad = None
    (compiled(*leaves) * gout).sum().backward()
    for a, e, name in zip(leaves, eager, "QHWb"):
        assert relerr(a.grad, e) < 1e-5, name
    if device == "cuda":
        from conftest import capture_cuda_graph

        graph, grads = capture_cuda_graph(step)  # the grads the capture allocated
        for t in grads:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for a, e, name in zip(grads, eager, "QHWb"):
            assert torch.equal(a, e), name


# -- the fused inference kernel (head_forward, sm_90a) ---------------------------

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not SM90, reason="the fused head kernel needs an sm_90 GPU")
# Projected tokens are rounded to the 16-bit dtype before the dot product.
FUSED_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _fused_inputs(Nq, Lq, Nd, Ld, dm, dtype, bias, seed):
    Q, H, W, b = _inputs("cuda", Nq, Lq, Nd, Ld, dm, 128, bias, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    d_mask = (torch.rand(Nd, Ld, generator=g) > 0.2).cuda()
    d_mask[:, 0] = True
    if Nd > 2:
        d_mask[Nd // 2] = False  # an empty document: every query token adds 0
    q_mask = torch.ones(Nq, Lq, dtype=torch.bool, device="cuda")
    if Lq > 1:
        q_mask[-1, -1] = False  # a padded query token
    return (Q.to(dtype), H.to(dtype), W.to(dtype), None if b is None else b.to(dtype)), q_mask, d_mask


# (Nq, Lq, Nd, Ld, d_model): Nq * Lq of 1, 32 and 64 (one query chunk);
# odd document lengths (tiles of 128 rows end inside documents; Ld 300 spans
# three tiles); Nd not a multiple of anything. Then several chunks of 64
# query tokens: 65 and 100 (a partial last chunk), 128 (two full ones), 129
# (three: resident in the three chunk slots), 1024 (streamed; few tiles: the chunks split
# over several CTAs per tile; 32 x 180 the short-document case; 61 x 300
# enough tiles that each CTA takes all the chunks of its tiles).
FUSED_SHAPES = [(1, 1, 7, 1, 64), (1, 32, 13, 15, 768), (2, 16, 11, 17, 64), (4, 16, 9, 33, 768),
                (1, 32, 37, 300, 768), (2, 32, 5, 300, 64), (8, 8, 3, 129, 128),
                (5, 13, 9, 47, 768), (4, 25, 6, 300, 128), (2, 64, 13, 15, 64), (3, 43, 11, 71, 768),
                (32, 32, 7, 45, 768), (32, 32, 32, 180, 768), (16, 64, 61, 300, 128)]


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_head_forward(ms, dtype, bias, normalize, shape):
    Nq, Lq, Nd, Ld, dm = shape
    (Q, H, W, b), q_mask, d_mask = _fused_inputs(Nq, Lq, Nd, Ld, dm, dtype, bias, seed=Nd + Ld)
    out = ms.ops.head_forward(Q, H, W, b, q_mask, d_mask, normalize, False)[0]
    assert out.shape == (Nq, Nd) and out.dtype == torch.float32
    ref = ms.head.maxsim_from_hidden_reference(Q, H, W, b, d_mask, q_mask=q_mask, normalize=normalize)
    comp = ms.head._chunk_scores(Q, H, W, b, q_mask, d_mask, normalize)
    assert relerr(out, ref, floor=1.0) < FUSED_TOL[dtype]
    assert relerr(out, comp, floor=1.0) < FUSED_TOL[dtype]
    if Nd > 2:
        assert torch.all(out[:, Nd // 2] == 0)
    # The inference path of maxsim_from_hidden is this op (bitwise: the
    # kernel is deterministic), in one chunk and in one document per chunk.
    with torch.no_grad():
        for chunk_mib in (256, 0):
            routed = ms.maxsim_from_hidden(Q, H, W, b, d_mask, q_mask=q_mask, normalize=normalize,
                                           chunk_mib=chunk_mib)
            assert torch.equal(routed, out)
    # Without masks.
    out = ms.ops.head_forward(Q, H, W, b, None, None, normalize, False)[0]
    ref = ms.head.maxsim_from_hidden_reference(Q, H, W, b, normalize=normalize)
    assert relerr(out, ref, floor=1.0) < FUSED_TOL[dtype]


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_head_forward_argmax(ms, dtype, shape):
    """with_argmax: the same scores bitwise; each argmax a valid token of its
    document whose dot (fp64, the kernel's rounded token) is the maximum;
    ties to the lowest token (duplicated rows); -1 for masked query tokens
    and empty documents."""
    Nq, Lq, Nd, Ld, dm = shape
    (Q, H, W, b), q_mask, d_mask = _fused_inputs(Nq, Lq, Nd, Ld, dm, dtype, True, seed=Nd * Ld)
    if Ld > 2:
        H = H.clone()
        H[:, Ld - 1] = H[:, 0]  # a tie: token 0 must win it
        d_mask[:, Ld - 1] = d_mask[:, 0]
    plain, none = ms.ops.head_forward(Q, H, W, b, q_mask, d_mask, True, False)
    scores, argmax = ms.ops.head_forward(Q, H, W, b, q_mask, d_mask, True, True)
    assert none.numel() == 0 and torch.equal(scores, plain)
    assert argmax.shape == (Nq, Nd, Lq) and argmax.dtype == torch.int32
    D = torch.nn.functional.normalize(torch.nn.functional.linear(H.double(), W.double(), b.double()), dim=-1)
    dots = torch.einsum("isd,ntd->inst", Q.double(), D).masked_fill(~d_mask[None, :, None, :], float("-inf"))
    best = dots.amax(-1)
    has = torch.isfinite(best) & q_mask[:, None, :]
    assert torch.all((argmax >= 0) == has)
    picked = dots.gather(-1, argmax.clamp_min(0).long()[..., None])[..., 0]
    # the picked token is a maximum up to the 16-bit rounding of the tokens
    assert torch.all((best - picked)[has] <= 4 * FUSED_TOL[dtype])
    assert torch.all(d_mask[torch.arange(Nd, device="cuda")[None, :, None].expand_as(argmax)[has],
                            argmax[has].long()])
    if Ld > 2:
        assert not torch.any(argmax == Ld - 1)


@needs_sm90
@pytest.mark.parametrize("shape", [(1, 32, 37, 300, 768), (2, 16, 11, 17, 64), (4, 25, 6, 300, 128),
                                   (32, 32, 7, 45, 768)], ids=lambda s: "x".join(map(str, s)))
def test_from_hidden_training_fused_forward(ms, shape, monkeypatch):
    """Training on the winners' path takes its forward (scores and argmax)
    from the fused kernel: scores bitwise those of inference; every gradient
    against fp64 through the same winners (with 300 tokens a document, bf16
    rounding moves near-ties, each a whole token's gradient elsewhere);
    deterministic."""
    monkeypatch.setattr(ms.head, "_WINNERS_PER_ROW", 10 ** 9)
    Nq, Lq, Nd, Ld, dm = shape
    (Q, H, W, b), q_mask, d_mask = _fused_inputs(Nq, Lq, Nd, Ld, dm, torch.bfloat16, True, seed=Ld)
    with torch.no_grad():
        inference = ms.maxsim_from_hidden(Q, H, W, b, d_mask, q_mask=q_mask)
    gout = torch.randn(Nq, Nd, generator=torch.Generator().manual_seed(1)).cuda()
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_(True) for t in (Q, H, W, b)]
        out = ms.maxsim_from_hidden(*leaves, d_mask, q_mask=q_mask)
        assert torch.equal(out.detach(), inference)
        (out * gout).sum().backward()
        grads.append([t.grad for t in leaves])
    _, idx = ms.ops.head_forward(Q, H, W, b, q_mask, d_mask, True, True)
    refs = [t.detach().double().requires_grad_(True) for t in (Q, H, W, b)]
    D = torch.nn.functional.normalize(torch.nn.functional.linear(*refs[1:]), dim=-1)
    winners = D[torch.arange(Nd, device="cuda")[None, :, None], idx.clamp_min(0).long()]  # [Nq, Nd, Lq, d]
    ref = ((refs[0][:, None] * winners).sum(-1) * (idx >= 0)).sum(-1)
    assert relerr(ref, inference, floor=1.0) < FUSED_TOL[torch.bfloat16]
    (ref * gout.double()).sum().backward()
    for a, a2, r, name in zip(grads[0], grads[1], refs, "QHWb"):
        assert relerr(a, r.grad) < 2e-2, name
        assert torch.equal(a, a2), name


@needs_sm90
@pytest.mark.parametrize("nq_lq", [(2, 8), (5, 40)], ids=["16", "200"])  # one query chunk, four (streamed)
def test_fused_head_forward_nan_and_empty(ms, nq_lq):
    """NaN in a valid token reaches its document's score (masked, it does
    not); no documents, and no query tokens, give empty / zero scores."""
    Nq, Lq = nq_lq
    (Q, H, W, b), q_mask, _ = _fused_inputs(Nq, Lq, 6, 40, 128, torch.bfloat16, True, seed=3)
    d_mask = torch.ones(6, 40, dtype=torch.bool, device="cuda")
    H = H.clone()
    H[1, 39, 5] = float("nan")
    H[4, 7, 0] = float("nan")
    d_mask[4, 7] = False
    out = ms.ops.head_forward(Q, H, W, b, q_mask, d_mask, True, False)[0]
    nan = torch.isnan(out)
    assert nan[:, 1].all() and nan.sum() == Nq
    ref = ms.head.maxsim_from_hidden_reference(Q, H, W, b, d_mask, q_mask=q_mask)
    keep = [0, 2, 3, 4, 5]
    assert relerr(out[:, keep], ref[:, keep], floor=1.0) < FUSED_TOL[torch.bfloat16]
    assert ms.ops.head_forward(Q, H[:0], W, b, None, None, True, False)[0].shape == (Nq, 0)
    assert torch.equal(ms.ops.head_forward(Q[:, :0], H, W, b, None, None, True, False)[0],
                       torch.zeros(Nq, 6, device="cuda"))
    scores, argmax = ms.ops.head_forward(Q, H[:0], W, b, None, None, True, True)
    assert scores.shape == (Nq, 0) and argmax.shape == (Nq, 0, Lq)


@needs_sm90
def test_fused_head_forward_query_token_limit(ms):
    """1024 query tokens in all are the kernel's scope; one more is refused
    (maxsim_from_hidden routes such calls to the composition)."""
    (Q, H, W, b), _, _ = _fused_inputs(41, 25, 3, 20, 64, torch.bfloat16, True, seed=11)
    assert ms.ops.head_forward(Q[:, :24], H, W, b, None, None, True, False)[0].shape == (41, 3)  # 984 tokens
    with pytest.raises(RuntimeError, match="query tokens"):
        ms.ops.head_forward(Q, H, W, b, None, None, True, False)  # 1025


@needs_sm90
@pytest.mark.parametrize("nq", [1, 32])  # 32 x 32 query tokens: streamed chunks
def test_fused_head_forward_cuda_graph(ms, nq):
    from conftest import capture_cuda_graph

    (Q, H, W, b), q_mask, d_mask = _fused_inputs(nq, 32, 21, 50, 768, torch.bfloat16, True, seed=5)
    eager = ms.ops.head_forward(Q, H, W, b, q_mask, d_mask, True, False)[0]
    graph, (out, _) = capture_cuda_graph(lambda: ms.ops.head_forward(Q, H, W, b, q_mask, d_mask, True, False))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_hidden_outside_fused_scope(ms, device, dtype):
    """Inference calls outside the fused kernel's scope (d_out 96, too many
    query tokens, fp32) take the composition on every device."""
    for Nq, Lq, do in ((2, 9, 96), (33, 32, 128)):
        Q, H, W, b = (t.to(dtype) for t in _inputs(device, Nq, Lq, 5, 21, 64, do, True, seed=do))
        with torch.no_grad():
            out = ms.maxsim_from_hidden(Q, H, W, b)
        ref = ms.head.maxsim_from_hidden_reference(Q, H, W, b)
        assert out.shape == (Nq, 5) and relerr(out, ref, floor=1.0) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_head_forward_op_everywhere(ms, device):
    """The op answers on every device (the composition where no kernel is
    compiled) and has a shape-only kernel (meta / torch.compile)."""
    import warnings

    Q, H, W, b = _inputs(device, 2, 5, 4, 9, 64, 128, True, seed=8)
    tol = 1e-5
    if device == "cuda":  # the compiled kernel: sm_90, 16-bit tokens
        if not SM90:
            pytest.skip("the CUDA head_forward kernel needs an sm_90 GPU")
        Q, H, W, b, tol = Q.bfloat16(), H.bfloat16(), W.bfloat16(), b.bfloat16(), FUSED_TOL[torch.bfloat16]
    d_mask = torch.ones(4, 9, dtype=torch.bool, device=device)
    d_mask[2] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ms.ops.head_forward(Q, H, W, b, None, d_mask, True, False)[0]
    ref = ms.head.maxsim_from_hidden_reference(Q, H, W, b, d_mask)
    assert out.shape == (2, 4) and relerr(out, ref, floor=1.0) < tol
    meta = ms.ops.head_forward(*(t.to("meta") for t in (Q, H, W, b)), None, None, False, False)[0]
    assert meta.shape == (2, 4) and meta.dtype == torch.float32
