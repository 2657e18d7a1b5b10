"""Drop-in scoring for PyLate (``integrations.pylate``) and colpali-engine
(``integrations.colpali``). Importing these modules does not import either
library; only ``use_in_pylate()`` / ``use_in_colpali()`` do."""

from . import colpali, pylate

__all__ = ["colpali", "pylate"]
