"""PyLate-compatible scoring on maxsim kernels.

``colbert_scores``, ``colbert_scores_pairwise``, ``colbert_kd_scores`` and
``ColBERTScores`` take PyLate's arguments and return PyLate's values.
PyLate's masks are multiplicative (``sim * q_mask * d_mask``, then max and
sum), so a masked document token still competes in the max with similarity 0
and a masked query token adds 0. Multiplying the embeddings by the masks
gives exactly those products (``<q m, d n> = m n <q, d>``, for any mask
value) at the cost of one elementwise product, and gradients (to the masks
too) follow PyLate's. ``backend`` is accepted and ignored; errors are
RuntimeErrors, as from PyLate's einsum (see ``_patch.host_errors``).

Without patching, PyLate's losses take a scorer as ``score_metric``:
``Contrastive(model, score_metric=ColBERTScores())``,
``Distillation(model, score_metric=colbert_kd_scores)``. Scoring that has no
such argument (``rank.rerank``, evaluators, ``ColBERT.similarity``) is
switched by ``use_in_pylate()``; see there.
"""

from __future__ import annotations

import torch

from ..scoring import maxsim
from ._patch import Patcher, host_errors, host_precision, import_transformers


def _tensor(x) -> torch.Tensor:
    """PyLate's convert_to_tensor, plus ragged lists (padded; see _ragged)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        if len(x) == 0:
            return torch.tensor([], dtype=torch.float32)
        if isinstance(x[0], torch.Tensor):
            return torch.stack(list(x))
        if not hasattr(x[0], "__array__"):
            return torch.tensor(x, dtype=torch.float32)
        import numpy as np

        return torch.from_numpy(np.array(x, dtype=np.float32))
    return torch.as_tensor(x)


def _ragged(xs):
    """A list of [L_i, H] token matrices -> zero-padded [N, L, H] and a boolean
    validity mask (the kernel skips the padding: it is not part of any item)."""
    xs = [torch.as_tensor(x) for x in xs]
    lengths = torch.tensor([x.shape[0] for x in xs], device=xs[0].device)
    padded = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)
    return padded, torch.arange(padded.shape[1], device=padded.device) < lengths[:, None]


def _ragged_list(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and len({tuple(t.shape) for t in map(torch.as_tensor, x)}) > 1


def _masked(x: torch.Tensor, mask):
    return x if mask is None else x * mask.unsqueeze(-1).to(x.dtype)


def _out_dtype(*ts) -> torch.dtype:
    # PyLate's einsum then mask products: the usual promotion of all operands.
    dt = ts[0].dtype
    for t in ts[1:]:
        if t is not None:
            dt = torch.promote_types(dt, t.dtype)
    return dt


def _score(Q, D, queries_mask, documents_mask, pad_q=None, pad_d=None):
    queries_mask = None if queries_mask is None else _tensor(queries_mask)
    documents_mask = None if documents_mask is None else _tensor(documents_mask)
    out = maxsim(_masked(Q, queries_mask), _masked(D, documents_mask), pad_q, pad_d, precision=host_precision())
    return out.to(_out_dtype(Q, D, queries_mask, documents_mask))


@host_errors
def colbert_scores(queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                   backend=None) -> torch.Tensor:
    """``[A, S, H] x [B, T, H] -> [A, B]``; masks ``[A, S]``, ``[B, T]``."""
    pad_q = pad_d = None
    if _ragged_list(queries_embeddings):
        queries_embeddings, pad_q = _ragged(queries_embeddings)
    if _ragged_list(documents_embeddings):
        documents_embeddings, pad_d = _ragged(documents_embeddings)
    return _score(_tensor(queries_embeddings), _tensor(documents_embeddings), queries_mask, documents_mask,
                  pad_q, pad_d)


@host_errors
def colbert_kd_scores(queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                      backend=None) -> torch.Tensor:
    """``[A, S, H] x [A, B, T, H] -> [A, B]`` (each query's own candidates);
    masks ``[A, S]``, ``[A, B, T]``."""
    return _score(_tensor(queries_embeddings), _tensor(documents_embeddings), queries_mask, documents_mask)


@host_errors
def colbert_scores_pairwise(queries_embeddings, documents_embeddings, backend=None) -> torch.Tensor:
    """Score of query i against document i -> ``[N]``. Either argument may be a
    padded tensor or a list of (ragged) ``[L_i, H]`` tensors; no masks (PyLate
    scores every token it is given)."""
    if isinstance(queries_embeddings, torch.Tensor):
        Q, pad_q = queries_embeddings, None
    else:
        Q, pad_q = _ragged(queries_embeddings)
    if isinstance(documents_embeddings, torch.Tensor):
        D, pad_d = documents_embeddings, None
    else:
        D, pad_d = _ragged(documents_embeddings)
    pad_d = None if pad_d is None else pad_d.unsqueeze(1)
    return maxsim(Q, D.unsqueeze(1), pad_q, pad_d, precision=host_precision())[:, 0].to(_out_dtype(Q, D))


class ColBERTScores:
    """PyLate's contrastive scorer: ``Q [A, S, H]`` x groups ``D [G, N, T, H]``
    -> ``[A, G*N]`` with column ``g*N + k``, which is the row order of
    ``D.flatten(0, 1)``: one cross call instead of PyLate's N."""

    @host_errors
    def __call__(self, queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                 backend=None) -> torch.Tensor:
        D = _tensor(documents_embeddings)
        dm = None if documents_mask is None else _tensor(documents_mask).flatten(0, 1)
        return colbert_scores(queries_embeddings, D.flatten(0, 1), queries_mask, dm)


_PATCH = Patcher()


def use_in_pylate() -> None:
    """Make PyLate's own scoring functions (``pylate.scores.colbert_scores``,
    ``colbert_scores_pairwise``, ``colbert_kd_scores``, ``ColBERTScores``)
    run these, wherever they are referenced: losses and models built before
    or after the call, ``from pylate.scores import ...`` copies in any
    module, ``rank.rerank``, evaluators. Only PyLate's ``auto`` backend is
    replaced: an explicit ``backend="torch" | "flash" | "lik"`` (argument or
    ``PYLATE_SCORES_BACKEND``) runs PyLate's own code, and an invalid one
    raises PyLate's ValueError. Idempotent; ``unuse_in_pylate()`` undoes it."""
    if _PATCH.active:
        return
    import_transformers()
    from pylate.scores import colbert as pc

    resolve = getattr(pc, "_resolve_backend", None)  # PyLate >= 1.6 has backends
    for host, ours in ((pc.colbert_scores, colbert_scores), (pc.colbert_scores_pairwise, colbert_scores_pairwise),
                       (pc.colbert_kd_scores, colbert_kd_scores),
                       (pc.ColBERTScores.__call__, ColBERTScores.__call__)):
        _PATCH.reroute(host, ours, lambda kwargs: resolve is not None and resolve(kwargs.get("backend")) != "auto")


def unuse_in_pylate() -> None:
    """Undo ``use_in_pylate()``: every reference runs PyLate's code again."""
    _PATCH.restore()


__all__ = ["ColBERTScores", "colbert_kd_scores", "colbert_scores", "colbert_scores_pairwise",
           "unuse_in_pylate", "use_in_pylate"]
