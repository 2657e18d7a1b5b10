"""nn.Module layers following the kernels-hub ``layers`` convention: each class
has a ``forward`` with the same arguments as the module it replaces, so
``kernels.kernelize`` / ``use_kernel_forward_from_hub("MaxSim")`` can swap it in."""

from __future__ import annotations

from typing import Optional

import torch

from .scoring import maxsim


class MaxSim(torch.nn.Module):
    """``forward(Q, D, q_mask=None, d_mask=None)`` -> ``maxsim(Q, D, q_mask, d_mask)``:
    ``[Nq, Nd]`` for ``D [Nd, Ld, d]``, ``[Nq, K]`` for ``D [Nq, K, Ld, d]``.
    Boolean masks (True = real token); differentiable."""

    # kernelize picks layers by these flags (Mode.TRAINING, Mode.TORCH_COMPILE);
    # kernels forbids any other member and an own __init__ (layers are stateless).
    has_backward = True
    can_torch_compile = True

    def forward(self, Q: torch.Tensor, D: torch.Tensor, q_mask: Optional[torch.Tensor] = None,
                d_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return maxsim(Q, D, q_mask, d_mask)


__all__ = ["MaxSim"]
