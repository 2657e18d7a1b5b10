"""Swap functions inside an installed library and put them back."""

from __future__ import annotations

import importlib
import sys
import types


def import_transformers() -> None:
    """Import transformers' hub-kernels hook so that PyLate / colpali-engine can
    be imported next to ``kernels`` (always present: it loads this package).
    transformers 5.3, the one release both PyLate 1.6 and colpali-engine 0.3.18
    accept, builds ``kernels.LayerRepository`` objects without a version at
    import, which kernels >= 0.17 rejects with ValueError; hiding ``kernels``
    for that one import makes transformers take its no-kernels path."""
    try:
        import transformers.integrations.hub_kernels  # noqa: F401
    except ImportError:
        return
    except ValueError:
        saved = sys.modules.get("kernels")
        sys.modules["kernels"] = None
        try:
            import transformers.integrations.hub_kernels  # noqa: F401
        finally:
            if saved is None:
                del sys.modules["kernels"]
            else:
                sys.modules["kernels"] = saved


class Patcher:
    def __init__(self) -> None:
        self._saved: list[tuple[object, str, object]] = []

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def set(self, obj, attr: str, value) -> None:
        self._saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    def replace_everywhere(self, prefix: str, modules, table: dict) -> None:
        """Rebind every module-level name that refers to a key of ``table``
        (functions imported with ``from x import f`` are copies of the binding,
        so patching the defining module alone would miss them)."""
        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError:  # optional parts whose extras are not installed
                pass
        ids = {id(k): v for k, v in table.items()}
        for name, mod in list(sys.modules.items()):
            if mod is None or not (name == prefix or name.startswith(prefix + ".")):
                continue
            for attr, val in list(vars(mod).items()):
                if isinstance(val, types.FunctionType) and id(val) in ids:
                    self.set(mod, attr, ids[id(val)])

    def restore(self) -> None:
        while self._saved:
            obj, attr, old = self._saved.pop()
            setattr(obj, attr, old)
