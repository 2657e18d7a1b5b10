"""maxsim: exact MaxSim (late-interaction) scoring kernels.

``score(q, d) = sum_i max_j <q_i, d_j>`` over valid tokens, computed without
materialising the similarity grid, for inference and training. Load with
``kernels.get_kernel("<org>/maxsim")``.
"""

from . import checks, distributed, head, integrations, keys, layers, plaid, reference
from ._registry import FALLBACKS, ops
from .reference import (
    maxsim_reference,
    maxsim_reference_with_argmax,
    score_candidates_padded_reference,
    score_candidates_padded_with_argmax_reference,
    score_contrastive_reference,
    score_contrastive_with_argmax_reference,
    score_pairs_packed_reference,
    score_pairs_packed_with_argmax_reference,
)
from .corpus import Corpus
from .head import maxsim_from_hidden
from .plan import explain, forcing
from .quantization import quantize_tokens
from .retrieval import search
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
from .checks import InputError, set_validation, validation, validation_enabled

__all__ = [
    "Corpus",
    "FALLBACKS",
    "InputError",
    "checks",
    "distributed",
    "explain",
    "forcing",
    "head",
    "integrations",
    "keys",
    "layers",
    "maxsim",
    "maxsim_from_hidden",
    "maxsim_reference",
    "maxsim_reference_with_argmax",
    "ops",
    "plaid",
    "quantize_tokens",
    "reference",
    "score_candidates_padded",
    "score_candidates_padded_reference",
    "score_candidates_padded_train",
    "score_candidates_padded_with_argmax",
    "score_candidates_padded_with_argmax_reference",
    "score_contrastive",
    "score_contrastive_reference",
    "score_contrastive_train",
    "score_contrastive_with_argmax",
    "score_contrastive_with_argmax_reference",
    "score_pairs_packed",
    "score_pairs_packed_reference",
    "score_pairs_packed_train",
    "score_pairs_packed_with_argmax",
    "score_pairs_packed_with_argmax_reference",
    "search",
    "set_validation",
    "validation",
    "validation_enabled",
]
