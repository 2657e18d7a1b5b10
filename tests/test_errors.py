"""Every bad input gets a Python exception whose message names the argument."""

from __future__ import annotations

import pytest
import torch

from conftest import rand


def _padded(device, dtype=torch.float32):
    return rand(2, 4, 8, dtype=dtype, device=device), rand(2, 3, 5, 8, dtype=dtype, device=device)


def raises(exc, match, fn, *a, **k):
    with pytest.raises(exc, match=match):
        fn(*a, **k)


def test_rank_errors(ms, device):
    Q, D = _padded(device)
    raises(ValueError, "queries", ms.score_candidates_padded, Q[0], D)
    raises(ValueError, "documents", ms.score_candidates_padded, Q, D[0])
    raises(ValueError, "documents", ms.score_contrastive, Q, D, torch.tensor([0, 2], device=device))
    raises(ValueError, "document_offsets", ms.score_contrastive, Q, D[0, 0],
           torch.tensor([[0, 2]], device=device))
    raises(ValueError, "queries", ms.score_pairs_packed, Q, torch.tensor([0, 4], device=device), D[0, 0],
           torch.tensor([0, 5], device=device), torch.tensor([0], device=device),
           torch.tensor([0], device=device))
    raises(ValueError, "D", ms.maxsim, Q, D[0, 0])
    raises(ValueError, "Q", ms.maxsim, Q[0], D)


def test_dim_mismatch(ms, device):
    Q, D = _padded(device)
    raises(ValueError, "dim mismatch", ms.score_candidates_padded, Q, D[..., :7])
    raises(ValueError, "dim mismatch", ms.maxsim, Q, D[0, ..., :4])
    raises(ValueError, "batch mismatch", ms.score_candidates_padded, Q[:1], D)
    raises(ValueError, "Nq", ms.maxsim, Q[:1], D)


def test_dtype_errors(ms, device):
    Q, D = _padded(device)
    raises(TypeError, "documents", ms.score_candidates_padded, Q, D.half())
    raises(TypeError, "queries", ms.score_candidates_padded, Q.long(), D)
    if device == "cpu":  # fp64 is the CPU's exact path; mixed with fp32 it is an error
        raises(TypeError, "share a dtype", ms.maxsim, Q.double(), D[0])
    else:
        raises(TypeError, "float64 only on the CPU", ms.maxsim, Q.double(), D[0].double())
    raises(TypeError, "query_lengths", ms.score_candidates_padded, Q, D, torch.ones(2, device=device))
    raises(TypeError, "doc_lengths", ms.score_candidates_padded, Q, D, None,
           torch.ones(2, 3, device=device))
    raises(TypeError, "document_offsets", ms.score_contrastive, Q, D[0, 0],
           torch.tensor([0.0, 5.0], device=device))
    raises(TypeError, "q_mask", ms.maxsim, Q, D[0], torch.ones(2, 4, device=device))
    raises(TypeError, "queries", ms.score_contrastive, [1, 2], D[0, 0], torch.tensor([0, 5]))


def test_shape_errors(ms, device):
    Q, D = _padded(device)
    raises(ValueError, "query_lengths", ms.score_candidates_padded, Q, D,
           torch.ones(3, dtype=torch.long, device=device))
    raises(ValueError, "doc_lengths", ms.score_candidates_padded, Q, D, None,
           torch.ones(2, 2, dtype=torch.long, device=device))
    raises(ValueError, "d_mask", ms.maxsim, Q, D[0], None, torch.ones(3, 4, dtype=torch.bool, device=device))
    raises(ValueError, "pair_query_ids", ms.score_pairs_packed, Q[0], torch.tensor([0, 4], device=device),
           D[0, 0], torch.tensor([0, 5], device=device), torch.tensor([0, 0], device=device),
           torch.tensor([0], device=device))


def test_validate_lengths(ms, device):
    Q, D = _padded(device)
    raises(ValueError, "query_lengths", ms.score_candidates_padded, Q, D,
           torch.tensor([4, 5], device=device), validate=True)
    raises(ValueError, "doc_lengths", ms.score_candidates_padded, Q, D, None,
           torch.tensor([[1, 2, -1], [1, 1, 1]], device=device), validate=True)
    raises(ValueError, "query_lengths", ms.score_contrastive, Q, D[0, 0], torch.tensor([0, 5], device=device),
           torch.tensor([-1, 2], device=device), validate=True)
    s = ms.score_candidates_padded(Q, D, torch.tensor([4, 1], device=device),
                                   torch.tensor([[0, 5, 3], [1, 1, 1]], device=device), validate=True)
    assert not torch.isnan(s).any()


def test_validate_offsets(ms, device):
    Q, D = _padded(device)
    docs = D[0, 0]  # 5 tokens
    for off, match in (([1, 5], r"\[0\] must be 0"), ([0, 4], "token count"), ([0, 3, 2, 5], "non-decreasing")):
        raises(ValueError, match, ms.score_contrastive, Q, docs, torch.tensor(off, device=device), validate=True)
    q = Q[0]
    good_q, good_d = torch.tensor([0, 4], device=device), torch.tensor([0, 5], device=device)
    ids = torch.tensor([0], device=device)
    raises(ValueError, "query_offsets", ms.score_pairs_packed, q, torch.tensor([0, 3], device=device), docs,
           good_d, ids, ids, validate=True)
    raises(ValueError, "document_offsets", ms.score_pairs_packed, q, good_q, docs,
           torch.tensor([0, 6], device=device), ids, ids, validate=True)
    raises(ValueError, "pair_query_ids", ms.score_pairs_packed, q, good_q, docs, good_d,
           torch.tensor([1], device=device), ids, validate=True)
    raises(ValueError, "pair_document_ids", ms.score_pairs_packed, q, good_q, docs, good_d, ids,
           torch.tensor([-1], device=device), validate=True)
    raises(ValueError, "max_query_length", ms.score_pairs_packed, q, good_q, docs, good_d, ids, ids,
           max_query_length=-1)


def test_too_short_max_query_length_is_nan(ms, device):
    q, d = rand(4, 8, device=device), rand(5, 8, device=device)
    ids = torch.tensor([0], device=device)
    s = ms.score_pairs_packed(q, torch.tensor([0, 4], device=device), d, torch.tensor([0, 5], device=device),
                              ids, ids, max_query_length=3)
    assert torch.isnan(s).all()


def test_device_mismatch(ms):
    if not torch.cuda.is_available():
        # Meta tensors stand in for a second device on CPU-only machines.
        Q, D = rand(2, 4, 8), torch.empty(2, 3, 5, 8, device="meta")
    else:
        Q, D = rand(2, 4, 8), rand(2, 3, 5, 8, device="cuda")
    raises(ValueError, "documents is on", ms.score_candidates_padded, Q, D)
    raises(ValueError, "D is on", ms.maxsim, Q, D[0])
    raises(ValueError, "query_lengths is on", ms.score_candidates_padded, Q, Q.new_empty(2, 3, 5, 8),
           torch.ones(2, dtype=torch.long, device=D.device))


def test_train_without_argmax_is_a_clear_error(ms, device):
    Q = rand(2, 4, 8, device=device).requires_grad_()
    D = rand(3, 5, 8, device=device)
    s = ms.score_contrastive(Q, D.reshape(-1, 8), torch.tensor([0, 5, 10, 15], device=device))
    with pytest.raises(RuntimeError, match="_train"):
        s.sum().backward()


def test_op_level_checks_raise(ms, device):
    """The ops' own checks (reached only by calling ``ops.*`` directly) raise
    RuntimeError with their formatted message, on every backend."""
    q, d = rand(4, 8, device=device), rand(6, 8, device=device)

    def i32(*v):
        return torch.tensor(v, dtype=torch.int32, device=device)

    args = [q, i32(0), i32(4), None, d, i32(0), i32(6), None, None, None, 0, 4, 0, 0, False]
    bad_start = list(args)
    bad_start[1] = i32(0).long()
    raises(RuntimeError, "q_start must be a contiguous 1-D int32", ms.ops.forward, *bad_start)
    bad_layout = list(args)
    bad_layout[10] = 7
    raises(RuntimeError, "layout", ms.ops.forward, *bad_layout)
    raises(RuntimeError, "T = x.shape.0. = 4", ms.ops.quantize, q, 0, torch.ones(3, device=device))


_I32 = (-(1 << 31), (1 << 31) - 1)


def _segments_oracle(off, total, max_len):
    off = [int(v) for v in off]
    ok = off[0] == 0 and off[-1] == total and all(b >= a for a, b in zip(off, off[1:]))
    lens = [b - a if ok and (max_len < 0 or b - a <= max_len) else -1 for a, b in zip(off, off[1:])]
    return off[:-1], lens


@pytest.mark.parametrize("n", [0, 1, 17, 1000, 70000])
@pytest.mark.parametrize("itype", [torch.int32, torch.int64])
def test_segments_op(ms, device, n, itype):
    """ops.segments (the packed layouts' offsets -> start / length and int32
    pair ids in one launch on CUDA; past 65536 segments the check + write
    grids): valid offsets, each way of describing no layout, the length cap,
    ids past int32."""
    g = torch.Generator().manual_seed(n)
    lens = torch.randint(0, 9, (n,), generator=g)
    good = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    total = int(good[-1])
    cases = [(good, total, -1), (good, total, 4), (good + 1, total + 1, -1), (good, total + 1, -1)]
    if n >= 2:
        dec = good.clone()
        dec[n // 2] = dec[n // 2 + 1] + 1  # one decrease in the middle
        cases.append((dec, total, -1))
    ids = torch.randint(-3, 50, (n + 5,), generator=g)
    if itype == torch.int64:
        ids[:3] = torch.tensor([1 << 32, -(1 << 33), (1 << 31) - 1])
    for off, tot, cap in cases:
        args = ([off.to(itype).to(device)], [tot], [cap], [ids.to(itype).to(device)], [_I32[0]], [_I32[1]])
        start, length = _segments_oracle(off, tot, cap)
        want = [v if _I32[0] <= v <= _I32[1] else -1 for v in ids.tolist()]
        # The kernel; the composed ops (the fallback of builds without it).
        for out in (ms.ops.segments(*args), ms.reference.segments(*args)):
            assert [t.dtype for t in out] == [torch.int32] * 3
            assert out[0].cpu().tolist() == start and out[1].cpu().tolist() == length
            assert out[2].cpu().tolist() == want
    # Two offsets and two int tensors in one call (a packed-pairs call; a
    # [lo, hi] range as for lengths).
    out = ms.ops.segments([good.to(itype).to(device), good[: n // 2 + 1].to(itype).to(device)],
                          [total, int(good[n // 2])], [3, -1], [ids.to(device), ids[:2].to(device)],
                          [0, _I32[0]], [40, _I32[1]])
    assert len(out) == 6
    assert out[1].cpu().tolist() == _segments_oracle(good, total, 3)[1]
    assert out[3].cpu().tolist() == _segments_oracle(good[: n // 2 + 1], int(good[n // 2]), -1)[1]
    assert out[4].cpu().tolist() == [v if 0 <= v <= 40 else -1 for v in ids.tolist()]
    assert out[5].cpu().tolist() == [v if _I32[0] <= v <= _I32[1] else -1 for v in ids[:2].tolist()]


@pytest.mark.parametrize("n,extent", [(0, 5), (1, 1), (17, 300), (300000, 3), (5, 0)])
def test_uniform_segments_op(ms, device, n, extent):
    """ops.uniform_segments (the padded layouts' start / length, one launch
    on CUDA) against arange, and the Python fallback of builds without it."""
    like = torch.empty(0, device=device)
    for start, length in (ms.ops.uniform_segments(like, n, extent), ms.reference.uniform_segments(like, n, extent)):
        assert start.dtype == length.dtype == torch.int32 and start.device.type == device
        assert torch.equal(start.cpu(), torch.arange(n, dtype=torch.int32) * extent)
        assert torch.equal(length.cpu(), torch.full((n,), extent, dtype=torch.int32))


def test_pair_id_past_int32_is_nan(ms, device):
    # 2**32 used to wrap onto pair id 0 and score a real pair.
    q, d = rand(4, 8, device=device), rand(5, 8, device=device)
    off_q, off_d = torch.tensor([0, 4], device=device), torch.tensor([0, 5], device=device)
    s = ms.score_pairs_packed(q, off_q, d, off_d, torch.tensor([0, 0], device=device),
                              torch.tensor([0, 1 << 32], device=device), max_query_length=4)
    assert not torch.isnan(s[0]) and torch.isnan(s[1])


def test_wild_query_offsets_stay_bounded(ms, device):
    # Without max_query_length the argmax width comes from the offsets; wild
    # ones must give NaN, not a [P, 2**40] allocation.
    q, d = rand(3, 8, device=device), rand(5, 8, device=device)
    ids = torch.tensor([0, 1], device=device)
    s, a = ms.score_pairs_packed_with_argmax(q, torch.tensor([0, 1 << 40, 3], device=device), d,
                                             torch.tensor([0, 5], device=device), ids, ids * 0)
    assert torch.isnan(s).all() and a.shape[1] <= 3


def test_maxsim_checks_once_per_shape(ms, device):
    # maxsim() keeps its per-shape decisions: a repeated call skips the
    # checks, so every input a check reads must be part of the key. Each
    # bad call below shares all but one property with a cached good one.
    Q, D = _padded(device)
    qm = torch.ones(2, 4, dtype=torch.bool, device=device)
    for args in ((Q, D[0]), (Q, D), (Q, D[0], qm), (Q, D[0], None, torch.ones(3, 5, dtype=torch.bool, device=device))):
        first = ms.maxsim(*args)
        assert torch.equal(ms.maxsim(*args), first)
    plans = ms.scoring._MAXSIM_PLANS
    n = len(plans)
    ms.maxsim(Q, D[0])
    assert len(plans) == n  # a hit
    raises(TypeError, "share a dtype", ms.maxsim, Q, D[0].half())
    raises(TypeError, "q_mask", ms.maxsim, Q, D[0], qm.float())
    raises(ValueError, "q_mask", ms.maxsim, Q, D[0], qm[:, :3])
    raises(ValueError, "d_mask", ms.maxsim, Q, D[0], None, qm)
    raises(ValueError, "Nq", ms.maxsim, Q[:1], D)
    raises(TypeError, "must be a torch.Tensor", ms.maxsim, Q, D[0].tolist())
    if device != "cpu":
        raises(ms.InputError, "one device", ms.maxsim, Q, D[0].cpu())
        raises(ms.InputError, "one device", ms.maxsim, Q, D[0], qm.cpu())
    # A hit still follows the inputs: gradients on or off, other values.
    Qg = Q.clone().requires_grad_()
    s = ms.maxsim(Qg, D[0])
    s.sum().backward()
    assert Qg.grad is not None and torch.equal(s.detach(), ms.maxsim(Q, D[0]))
    assert not torch.equal(ms.maxsim(Q * 2, D[0]), ms.maxsim(Q, D[0]))
