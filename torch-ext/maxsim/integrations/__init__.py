"""Drop-in scoring for PyLate (``integrations.pylate``) and colpali-engine
(``integrations.colpali``). Importing these modules does not import either
library; only ``use_in_pylate()`` / ``use_in_colpali()`` do.
``import_transformers()`` lets both be imported next to ``kernels`` >= 0.16
(call it first; see there)."""

from . import colpali, pylate
from ._patch import import_transformers

__all__ = ["colpali", "import_transformers", "pylate"]
