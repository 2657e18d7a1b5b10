"""colpali-engine-compatible scoring on maxsim kernels.

colpali-engine scores zero-padded embeddings without masks: a padded document
token is a zero vector (similarity 0, it still competes in the max) and a
padded query token adds ``max_j 0 = 0``. Unmasked ``maxsim`` computes exactly
that, so no correction is needed. Gradients agree on every real token; on
the padding itself they can differ (a tied maximum: amax splits it evenly,
the kernel gives it to the lowest index), which colpali models never
propagate (they multiply embeddings by the attention mask). Errors are
RuntimeErrors, as from colpali's einsum. colpali-engine has no scorer
argument; ``use_in_colpali()`` switches ``maxsim_inbatch`` / ``maxsim_kd``
(processors' ``score_multi_vector``, the late-interaction losses) for its
``auto`` backend; ``unuse_in_colpali()`` restores them.
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch

from ..scoring import maxsim
from ._patch import Patcher, host_errors, host_precision, import_transformers


@host_errors
def maxsim_inbatch(query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """``[B_q, L_q, d] x [B_d, L_d, d] -> [B_q, B_d]`` (einsum dtype, as colpali)."""
    return maxsim(query, doc, precision=host_precision()).to(torch.promote_types(query.dtype, doc.dtype))


@host_errors
def maxsim_kd(query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """``[B, L_q, d] x [B, N, L_d, d] -> [B, N]`` (each query's own candidates)."""
    return maxsim(query, doc, precision=host_precision()).to(torch.promote_types(query.dtype, doc.dtype))


def _auto_device() -> str:
    # colpali_engine.utils.torch_utils.get_torch_device("auto")
    if torch.cuda.is_available():
        return "cuda:0"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def score_multi_vector(qs: Union[torch.Tensor, List[torch.Tensor]], ps: Union[torch.Tensor, List[torch.Tensor]],
                       batch_size: int = 128, device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """``BaseVisualRetrieverProcessor.score_multi_vector``: ``[n_queries, n_passages]``
    fp32 scores on the CPU from lists of ``[L_i, d]`` tensors or padded tensors."""
    device = device or _auto_device()
    if len(qs) == 0:
        raise ValueError("No queries provided")
    if len(ps) == 0:
        raise ValueError("No passages provided")
    pad = torch.nn.utils.rnn.pad_sequence
    rows = []
    for i in range(0, len(qs), batch_size):
        q = pad(qs[i:i + batch_size], batch_first=True, padding_value=0).to(device)
        rows.append(torch.cat([maxsim_inbatch(q, pad(ps[j:j + batch_size], batch_first=True, padding_value=0)
                                              .to(device)) for j in range(0, len(ps), batch_size)], dim=1).cpu())
    return torch.cat(rows, dim=0).to(torch.float32)


_PATCH = Patcher()


def use_in_colpali() -> None:
    """Make colpali-engine's ``maxsim_inbatch`` / ``maxsim_kd`` run these
    wherever they are referenced (losses, processors, ``from ... import``
    copies made before or after the call). Only the ``auto`` backend is
    replaced: ``COLPALI_SCORES_BACKEND=torch`` or ``lik`` runs colpali's own
    code and an invalid value raises colpali's ValueError. Idempotent."""
    if _PATCH.active:
        return
    import_transformers()
    from colpali_engine.utils import maxsim as cm

    resolve = getattr(cm, "_resolve_backend", None)  # colpali-engine >= 0.3.18 has backends
    for host, ours in ((cm.maxsim_inbatch, maxsim_inbatch), (cm.maxsim_kd, maxsim_kd)):
        _PATCH.reroute(host, ours, lambda kwargs: resolve is not None and resolve() != "auto")


def unuse_in_colpali() -> None:
    """Undo ``use_in_colpali()``."""
    _PATCH.restore()


__all__ = ["maxsim_inbatch", "maxsim_kd", "score_multi_vector", "unuse_in_colpali", "use_in_colpali"]
