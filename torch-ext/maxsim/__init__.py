"""maxsim: exact MaxSim (late-interaction) scoring kernels.

``score(q, d) = sum_i max_j <q_i, d_j>`` over valid tokens, computed without
materialising the similarity grid, for inference and training. Load with
``kernels.get_kernel("<org>/maxsim")``.
"""

from . import distributed, integrations, layers, reference
from ._registry import FALLBACKS, ops
from .plan import explain
from .reference import maxsim_reference
from .retrieval import Corpus, quantize_tokens, search
from .scoring import (
    maxsim,
    score_candidates_padded,
    score_candidates_padded_train,
    score_candidates_padded_with_argmax,
    score_contrastive,
    score_contrastive_train,
    score_contrastive_with_argmax,
    score_pairs_packed,
    score_pairs_packed_train,
    score_pairs_packed_with_argmax,
)

__all__ = [
    "Corpus",
    "FALLBACKS",
    "distributed",
    "explain",
    "integrations",
    "layers",
    "maxsim",
    "maxsim_reference",
    "ops",
    "quantize_tokens",
    "reference",
    "score_candidates_padded",
    "score_candidates_padded_train",
    "score_candidates_padded_with_argmax",
    "score_contrastive",
    "score_contrastive_train",
    "score_contrastive_with_argmax",
    "score_pairs_packed",
    "score_pairs_packed_train",
    "score_pairs_packed_with_argmax",
    "search",
]
