"""(score, document id) pairs as one ordered int64 key.

A key's order is "higher score, then lower id", which makes a top-k with
``torch.topk`` exact and deterministic (no tie ambiguity) and lets partial
results of blocks, streams or ranks merge by another ``topk``.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
INT64_MIN = -(1 << 63)  # the empty slot
_NAN_ORD = -(1 << 31)  # below the order code of -inf: NaN scores rank last
_LOW = (1 << 32) - 1

__all__ = ["encode_keys", "decode_keys", "merge_topk"]


def encode_keys(scores: Tensor, ids: Tensor) -> Tensor:
    """int64 keys ordered by (score descending, id ascending); NaN ranks below
    every number; id -1 marks an empty slot, which ranks below everything."""
    s = scores.to(torch.float32) + 0.0  # -0.0 -> +0.0: equal scores get equal codes
    bits = s.view(torch.int32).to(torch.int64)
    order = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    order = torch.where(torch.isnan(s), _NAN_ORD, order)
    ids = ids.to(torch.int64)
    keys = order * (1 << 32) + (_LOW - ids)
    return torch.where(ids < 0, INT64_MIN, keys)


def decode_keys(keys: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`encode_keys`: (fp32 scores, int64 ids); empty slots
    come back as (-inf, -1)."""
    order = keys >> 32
    ids = _LOW - (keys & _LOW)
    bits = torch.where(order >= 0, order, order ^ 0x7FFFFFFF).to(torch.int32)
    scores = bits.view(torch.float32)
    scores = torch.where(order == _NAN_ORD, float("nan"), scores)
    empty = keys == INT64_MIN
    return torch.where(empty, float("-inf"), scores), torch.where(empty, -1, ids)


def merge_topk(keys: Tensor, k: int) -> Tensor:
    """Top-k keys along dim 1 (descending), padded with empty slots when fewer."""
    if keys.shape[1] < k:
        pad = keys.new_full((keys.shape[0], k - keys.shape[1]), INT64_MIN)
        keys = torch.cat([keys, pad], dim=1)
    return keys.topk(k, dim=1).values
