"""maxsim: exact MaxSim (late-interaction) scoring kernels.

``score(q, d) = sum_i max_j <q_i, d_j>`` over valid tokens, computed without
materialising the similarity grid, for inference and training. Load with
``kernels.get_kernel("<org>/maxsim")``.
"""

import importlib

from . import checks, keys, reference
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

# Optional parts (multi-GPU, the projection head, host-library integrations,
# kernels-hub layers, PLAID corpora) load on first use, so importing the
# package pays only for scoring and search.
_LAZY = {"distributed": None, "head": None, "integrations": None, "layers": None, "plaid": None,
         "maxsim_from_hidden": "head"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
