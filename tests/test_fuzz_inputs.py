"""Bad-input fuzz over every public entry point (docs/compatibility.md).

Each example starts from a valid call and corrupts some of its arguments: a
wrong type, rank, dtype or device, a zero or one-sized dim, a non-contiguous
view, NaN / inf values, lengths / offsets / ids out of range, huge declared
values (k, max_query_length, ids; never huge tensors, so nothing can run out
of memory). Every call must either return the documented result (shape,
dtype; no NaN from finite inputs when it validated) or raise TypeError /
ValueError whose message names an argument. A crash of the process fails the
whole run. The example budget is fixed (MAXSIM_FUZZ_EXAMPLES, derandomized:
MAXSIM_FUZZ_RANDOM=1 explores new ones).
"""

from __future__ import annotations

import inspect
import os
import warnings

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICES, MAXSIM as ms, rand

EXAMPLES = int(os.environ.get("MAXSIM_FUZZ_EXAMPLES", "40"))
DERANDOMIZE = not os.environ.get("MAXSIM_FUZZ_RANDOM")
HUGE = [(1 << 31) - 1, 1 << 31, 1 << 40, (1 << 62), (1 << 63) - 1]
SETTINGS = settings(max_examples=EXAMPLES * 5, deadline=None, derandomize=DERANDOMIZE,
                    suppress_health_check=list(HealthCheck))


# ----------------------------------------------------------------------------
# valid calls
# ----------------------------------------------------------------------------

def _offsets(lens, device):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], device=device)


def _valid_call(name, draw, device, dtype):
    """(function, positional args, keyword args) of a valid call."""
    # sampled_from, not integers: the derandomized draws would favour 0.
    nq, nd = draw(st.sampled_from([2, 1, 3, 0])), draw(st.sampled_from([3, 1, 2, 0]))
    lq, ld = draw(st.sampled_from([4, 1, 5, 0])), draw(st.sampled_from([5, 2, 6, 0]))
    dim = draw(st.sampled_from([8, 3, 16, 1, 0]))
    lens = lambda n, hi: [draw(st.integers(0, hi)) for _ in range(n)]  # noqa: E731
    if name == "maxsim":
        Q = rand(nq, lq, dim, dtype=dtype, device=device)
        D = rand(*((nd,) if draw(st.booleans()) else (nq, nd)), ld, dim, dtype=dtype, device=device)
        kw = {}
        if draw(st.booleans()):
            kw["q_mask"] = torch.rand(nq, lq, device=device) > 0.3
        if draw(st.booleans()):
            kw["d_mask"] = torch.rand(D.shape[:-1], device=device) > 0.3
        return ms.maxsim, [Q, D], kw
    if name.startswith("score_candidates_padded"):
        Q, D = rand(nq, lq, dim, dtype=dtype, device=device), rand(nq, nd, ld, dim, dtype=dtype, device=device)
        ql = torch.tensor(lens(nq, lq), dtype=torch.int64, device=device)
        dl = torch.tensor(lens(nq * nd, ld), dtype=torch.int64, device=device).view(nq, nd)
        return getattr(ms, name), [Q, D, ql, dl], {}
    if name.startswith("score_contrastive"):
        dlens = lens(nd, ld)
        Q, D = rand(nq, lq, dim, dtype=dtype, device=device), rand(sum(dlens), dim, dtype=dtype, device=device)
        args = [Q, D, _offsets(dlens, device)]
        if draw(st.booleans()):
            args.append(torch.tensor(lens(nq, lq), dtype=torch.int64, device=device))
        return getattr(ms, name), args, {}
    if name.startswith("score_pairs_packed"):
        qlens, dlens = lens(nq, lq), lens(nd, ld)
        q, d = rand(sum(qlens), dim, dtype=dtype, device=device), rand(sum(dlens), dim, dtype=dtype, device=device)
        p = draw(st.integers(0, 5))
        pq = torch.tensor([draw(st.integers(0, nq - 1)) for _ in range(p)] if nq and nd else [], dtype=torch.int64,
                          device=device)
        pd = torch.tensor([draw(st.integers(0, nd - 1)) for _ in range(len(pq))], dtype=torch.int64, device=device)
        kw = {}
        key = draw(st.sampled_from([None, "max_query_length", "max_q_len"]))
        if key:
            kw[key] = max(qlens, default=0) + draw(st.integers(0, 2))
        return getattr(ms, name), [q, _offsets(qlens, device), d, _offsets(dlens, device), pq, pd], kw
    if name == "search":
        dlens = lens(nd, ld)
        docs = rand(sum(dlens), dim, dtype=dtype, device=device)
        Q = rand(nq, lq, dim, dtype=dtype, device=device)
        kw = {}
        if draw(st.booleans()):
            kw["query_lengths"] = torch.tensor(lens(nq, lq), dtype=torch.int64, device=device)
        return ms.search, [Q, (docs, _offsets(dlens, device)), draw(st.integers(0, 6))], kw
    if name == "Corpus":
        dlens = lens(nd, ld)
        kw = {"device": device}
        if draw(st.booleans()) and dtype != torch.float64:
            kw["quantization"] = draw(st.sampled_from(["int8", "fp8"]))
        return ms.Corpus, [rand(sum(dlens), dim, dtype=dtype, device=device), _offsets(dlens, device)], kw
    if name == "quantize_tokens":
        return ms.quantize_tokens, [rand(nq * 3, dim, dtype=dtype, device=device),
                                    draw(st.sampled_from(["int8", "fp8"]))], {}
    raise AssertionError(name)


FUNCTIONS = ["maxsim", "score_candidates_padded", "score_candidates_padded_with_argmax",
             "score_candidates_padded_train", "score_contrastive", "score_contrastive_with_argmax",
             "score_contrastive_train", "score_pairs_packed", "score_pairs_packed_with_argmax",
             "score_pairs_packed_train", "search", "Corpus", "quantize_tokens"]


# ----------------------------------------------------------------------------
# corruptions
# ----------------------------------------------------------------------------

def _corrupt_tensor(x, draw, device):
    kind = draw(st.sampled_from(["rank+", "rank-", "dtype", "device", "list", "none", "empty", "one",
                                 "noncontig", "values"]))
    if kind == "rank+":
        return x[None]
    if kind == "rank-":
        return x[0] if x.dim() and x.shape[0] else x.reshape(-1)[:0]
    if kind == "dtype":
        return x.to(draw(st.sampled_from([torch.int32, torch.int64, torch.bool, torch.float64, torch.float16,
                                          torch.float32, torch.uint8])))
    if kind == "device":
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    if kind == "list":
        return x.tolist()
    if kind == "none":
        return None
    if kind in ("empty", "one") and x.dim():
        axis = draw(st.integers(0, x.dim() - 1))
        shape = list(x.shape)
        shape[axis] = 0 if kind == "empty" else 1
        return torch.zeros(shape, dtype=x.dtype, device=x.device)
    if kind == "noncontig" and x.dim():
        return torch.stack([x, x], dim=-1)[..., 0]  # same values, strided
    if x.numel() == 0:
        return x
    y = x.clone()
    flat = y.view(-1)
    i = draw(st.integers(0, flat.numel() - 1))
    if y.dtype.is_floating_point:
        flat[i] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e30]))
    elif y.dtype != torch.bool:
        flat[i] = draw(st.sampled_from([-1, -(1 << 31), *HUGE])) if y.dtype == torch.int64 else -1
    if y.dim() == 1 and y.numel() > 2 and draw(st.booleans()):
        y = y.flip(0)  # offsets that decrease
    return y


def _corrupt_scalar(value, draw, allocates):
    """``allocates``: the value sizes an output by request (an argmax as wide
    as a declared max_query_length): no huge values there."""
    small = [-1, 0, 1, True, 2.5, "3"]
    return draw(st.sampled_from(small if allocates else small + [*HUGE, 1 << 63, 10 ** 30]))


def _corrupt(args, kw, draw, device, argmax):
    """Corrupt some of the arguments (none at all in a few examples)."""
    args, kw = list(args), dict(kw)
    slots = [("a", i) for i in range(len(args))] + [("k", k) for k in kw]
    for where, key in slots:
        if not draw(st.sampled_from([False, False, False, True])):
            continue
        box = args if where == "a" else kw
        v = box[key]
        if isinstance(v, torch.Tensor):
            box[key] = _corrupt_tensor(v, draw, device)
        elif isinstance(v, tuple):
            box[key] = tuple(_corrupt_tensor(t, draw, device) for t in v)
        elif isinstance(v, bool) or v is None:
            continue
        elif isinstance(v, int):
            box[key] = _corrupt_scalar(v, draw, argmax and key in ("max_query_length", "max_q_len"))
        elif isinstance(v, str):
            box[key] = draw(st.sampled_from(["int4", "", "INT8"]))
    return args, kw


def _names(fn) -> set[str]:
    names = set(inspect.signature(fn).parameters) | {"max_q_len", "offsets", "lengths", "documents", "queries",
                                                     "dim", "scales", "quantization", "x"}
    return names


def _finite(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.device.type == "meta" or not obj.dtype.is_floating_point or bool(torch.isfinite(obj).all())
    if isinstance(obj, (tuple, list)):
        return all(_finite(o) for o in obj)
    return True


def _check_result(name, out, args, kw, validated):
    """The documented result of a call that returned."""
    if name == "Corpus":
        assert isinstance(out, ms.Corpus) and len(out) == out.starts.numel()
        return
    if name == "quantize_tokens":
        v, s = out
        assert v.shape[0] == s.shape[0] and v.shape[1] % 16 == 0 and s.dtype == torch.float32
        return
    scores = out[0] if isinstance(out, tuple) else out
    assert scores.dtype in (torch.float32, torch.float64)
    if name == "search":
        ids, k = out[1], args[2]
        assert ids.dtype == torch.int64 and ids.shape == scores.shape
        assert scores.shape[-1] == k if kw.get("pad_to_k") else scores.shape[-1] <= k
        return
    if name.endswith("_with_argmax"):
        assert out[1].dtype == torch.int32
    if validated and _finite(args) and _finite(kw) and scores.device.type != "meta":
        assert not torch.isnan(scores).any(), "a validated call with finite inputs gave NaN"


@SETTINGS
@given(data=st.data())
def test_fuzz_bad_inputs(data):
    draw = data.draw
    name = draw(st.sampled_from(FUNCTIONS))
    device = draw(st.sampled_from(DEVICES))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]
                                 + ([torch.float64] if device == "cpu" else [])))
    fn, args, kw = _valid_call(name, draw, device, dtype)
    args, kw = _corrupt(args, kw, draw, device, name.endswith("_with_argmax"))
    if name == "search" and isinstance(args[2], int) and 0 <= args[2] <= 6 and draw(st.booleans()):
        kw["pad_to_k"] = True  # allocates k columns by request: only with a small k
    params = inspect.signature(fn).parameters
    validated = draw(st.booleans()) and "validate" in params
    if validated:
        kw["validate"] = True
    elif "validate" in params and draw(st.booleans()):
        kw["validate"] = False
    train = name.endswith("_train") or (name == "maxsim" and draw(st.booleans()))
    if train:
        args = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.dtype.is_floating_point
                and a.device.type != "meta" else a for a in args]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fn(*args, **kw)
            if train and isinstance(out, torch.Tensor) and out.requires_grad and out.device.type != "meta":
                out.float().nan_to_num().sum().backward()
                for a in args:
                    if isinstance(a, torch.Tensor) and a.requires_grad:
                        assert a.grad is not None and a.grad.shape == a.shape
    except (TypeError, ValueError) as e:
        msg = str(e)
        assert any(n in msg for n in _names(fn)), f"{name}: {type(e).__name__} names no argument: {msg}"
        return
    _check_result(name, out, args, kw, validated)
