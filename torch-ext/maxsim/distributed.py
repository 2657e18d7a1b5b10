"""Multi-process scoring on ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

``contrastive_scores`` scores each rank's queries against the documents of
every rank (global in-batch negatives). The document all-gather is
autograd-aware: each rank's loss sends gradient to every rank's documents, so
the backward sums the gathered gradient over ranks and hands each rank the
slice of its own documents, matching a single-process run on the
concatenated batch.

``search`` runs :func:`maxsim.search` on each rank's shard of a corpus and
merges the local top-k lists (one all-gather of ``Nq x k`` int64 keys) into
the exact global top-k with global document ids (shards in rank order).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ._registry import ops
from .checks import check_count
from .corpus import as_corpus
from .keys import encode_keys, merge_topk
from .retrieval import search as local_search
from .scoring import maxsim

__all__ = ["all_gather_with_grad", "contrastive_scores", "search"]


def _sizes(n: int, device, group) -> list[int]:
    """Dim-0 size of every rank (one small collective)."""
    world = dist.get_world_size(group)
    mine = torch.tensor([n], device=device, dtype=torch.int64)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [int(t) for t in out]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, sizes: list[int]):
        ctx.group, ctx.sizes, ctx.rank = group, sizes, dist.get_rank(group)
        width = max(sizes)
        # all_gather needs equal shapes: pad every rank's block to the widest.
        padded = x.new_zeros((width,) + tuple(x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        # Every rank's loss reaches every rank's rows: sum over ranks, keep ours.
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start: start + ctx.sizes[ctx.rank]], None, None


def all_gather_with_grad(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate ``x`` of every rank along dim 0 (sizes may differ), with a
    backward that returns this rank's share of the summed gradient."""
    return _AllGather.apply(x, group, _sizes(x.shape[0], x.device, group))


def _need_group():
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("maxsim.distributed needs an initialised torch.distributed process group")


def search(Q: torch.Tensor, local_corpus, k: int, *, group=None, pad_to_k: bool = False, **kwargs):
    """Exact global top-k over a corpus sharded across ranks.

    Every rank passes the same queries ``Q`` and ``k`` and its own shard
    (a :class:`maxsim.Corpus` or ``(documents, offsets)``); global document
    ids number the shards in rank order (rank r's document i is
    ``sum of earlier shards' sizes + i``). Returns ``(scores, ids)`` as
    :func:`maxsim.search` does (``min(k, N)`` columns, ``N`` the global
    document count, or ``k`` with ``pad_to_k=True``), identical on every
    rank. ``kwargs`` go to :func:`maxsim.search` (query lengths / mask,
    block size).
    """
    _need_group()
    local_corpus = as_corpus(local_corpus, Q.device)
    sizes = _sizes(len(local_corpus), local_corpus.device, group)
    k_global = min(check_count("k", k), sum(sizes))
    # Every rank's list padded to the same width: all_gather needs equal shapes.
    scores, ids = local_search(Q, local_corpus, k_global, pad_to_k=True, **kwargs)
    single = scores.dim() == 1
    if single:
        scores, ids = scores[None], ids[None]
    offset = sum(sizes[: dist.get_rank(group)])
    keys = encode_keys(scores, torch.where(ids >= 0, ids + offset, -1)).contiguous()
    parts = [torch.empty_like(keys) for _ in sizes]
    dist.all_gather(parts, keys, group=group)
    scores, ids = ops.decode_keys(merge_topk(torch.cat(parts, dim=1), k if pad_to_k else k_global))
    return (scores[0], ids[0]) if single else (scores, ids)


def contrastive_scores(Q: torch.Tensor, D: torch.Tensor, q_mask: Optional[torch.Tensor] = None,
                       d_mask: Optional[torch.Tensor] = None, *, group=None, normalize: bool = False,
                       precision: Optional[str] = None, tf32: bool = False) -> torch.Tensor:
    """This rank's queries ``Q [Nq, Lq, d]`` against the documents of all ranks
    (``D [Nd_r, Ld, d]`` here, same Ld everywhere) -> ``[Nq, sum_r Nd_r]``,
    columns in rank order. Masks as in :func:`maxsim.maxsim`. Differentiable
    with respect to ``Q`` and to every rank's ``D``.
    """
    _need_group()
    if D.dim() != 3:
        raise ValueError(f"D must be 3-D [Nd, Ld, d], got shape {tuple(D.shape)}")
    D_all = all_gather_with_grad(D, group)
    dm_all = None
    if d_mask is not None:
        dm_all = all_gather_with_grad(d_mask.to(torch.uint8), group).bool()
    return maxsim(Q, D_all, q_mask, dm_all, normalize=normalize, precision=precision, tf32=tf32)
