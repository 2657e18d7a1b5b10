"""Reroute a host library's scoring functions and put them back; import
transformers next to a recent ``kernels``."""

from __future__ import annotations

import functools
import inspect
import types
from typing import Callable

import torch

# The one global a rerouted function's code reads in its own module.
_ROUTES = "__maxsim_routes__"


def host_precision() -> str:
    """The ``precision=`` matching the host's own fp32 einsum: ``"exact"``
    while torch keeps fp32 matmuls in full fp32 (its default, "highest"),
    so rankings equal the host's; ``"default"`` (split 3xTF32 on the tensor
    cores) once the user lets fp32 matmuls use TF32
    (``torch.set_float32_matmul_precision("high")``), which makes the host's
    einsum less exact than ours. Only fp32 inputs on CUDA are affected."""
    return "exact" if torch.get_float32_matmul_precision() == "highest" else "default"


def import_transformers() -> None:
    """Import transformers' hub-kernels module so that PyLate / colpali-engine
    (which import transformers) can be imported next to ``kernels`` >= 0.16.

    transformers 5.3 (the newest release PyLate 1.6 accepts) declares
    ``kernels>=0.10.2,<0.11`` in its extras only, and at import builds its
    default mapping with ``LayerRepository(repo_id=..., layer_name=...)``,
    without a revision or version. kernels 0.16 made one of the two mandatory
    and raises ValueError, which transformers' ``except ImportError`` does not
    catch, so ``import transformers.integrations.hub_kernels`` (and through it
    PyLate, colpali-engine, peft) fails. For that one import the repository
    classes default to the ``main`` branch, the meaning an unpinned repository
    had before; transformers' hub kernels stay enabled. Releases that pin a
    version import on the first try and are left alone."""
    try:
        import transformers.integrations.hub_kernels  # noqa: F401
    except ImportError:
        return
    except ValueError:
        import kernels

        saved = {name: getattr(kernels, name) for name in ("LayerRepository", "FuncRepository")
                 if hasattr(kernels, name)}
        for name, cls in saved.items():
            setattr(kernels, name, _default_to_main(cls))
        try:
            import transformers.integrations.hub_kernels  # noqa: F401,F811
        finally:
            for name, cls in saved.items():
                setattr(kernels, name, cls)


def _default_to_main(cls: type) -> type:
    class Unpinned(cls):
        def __init__(self, *args, revision=None, version=None, **kwargs):
            if revision is None and version is None:
                revision = "main"
            super().__init__(*args, revision=revision, version=version, **kwargs)

    Unpinned.__name__ = Unpinned.__qualname__ = cls.__name__
    Unpinned.__module__ = cls.__module__
    return Unpinned


def host_errors(fn: Callable) -> Callable:
    """PyLate's and colpali-engine's torch paths fail inside einsum or
    broadcasting with RuntimeError; maxsim validates its arguments with
    ValueError / TypeError. Raise an exception that is both, so that handlers
    written for either library keep working."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as e:
            if isinstance(e, RuntimeError):
                raise
            raise _runtime_twin(type(e))(*e.args) from e

    return wrapper


@functools.lru_cache(maxsize=None)
def _runtime_twin(cls: type) -> type:
    return type(cls.__name__, (RuntimeError, cls), {"__module__": __name__})


def _trampoline(host: types.FunctionType, key: str) -> types.CodeType:
    """Code with ``host``'s exact parameters (names, kinds; defaults live on
    the function object and stay) whose body calls ``__maxsim_routes__[key]``
    with them."""
    code = host.__code__
    names = code.co_varnames
    npos, nkw, nposonly = code.co_argcount, code.co_kwonlyargcount, code.co_posonlyargcount
    has_var = bool(code.co_flags & inspect.CO_VARARGS)
    has_varkw = bool(code.co_flags & inspect.CO_VARKEYWORDS)
    pos, kwonly = names[:npos], names[npos:npos + nkw]
    i = npos + nkw
    var = names[i] if has_var else None
    varkw = names[i + has_var] if has_varkw else None
    params = list(pos[:nposonly]) + (["/"] if nposonly else []) + list(pos[nposonly:])
    params += [f"*{var}"] if var else (["*"] if kwonly else [])
    params += list(kwonly) + ([f"**{varkw}"] if varkw else [])
    # Parameters go on by keyword (so the route sees them by name), except
    # positional-only ones and, before a *args, all positional ones.
    by_position = pos if var else pos[:nposonly]
    call = list(by_position) + [f"*{var}"] * bool(var)
    call += [f"{n}={n}" for n in pos[len(by_position):] + kwonly] + [f"**{varkw}"] * bool(varkw)
    src = f"def {code.co_name}({', '.join(params)}):\n    return {_ROUTES}[{key!r}]({', '.join(call)})\n"
    namespace: dict = {}
    exec(compile(src, f"<maxsim route to {key}>", "exec"), namespace)
    renamed = {"co_name": code.co_name}
    if hasattr(code, "co_qualname"):  # Python >= 3.11
        renamed["co_qualname"] = code.co_qualname
    return namespace[code.co_name].__code__.replace(**renamed)


def host_copy(host: types.FunctionType) -> types.FunctionType:
    """A function running ``host``'s own code, unaffected by a reroute."""
    copy = types.FunctionType(host.__code__, host.__globals__, host.__name__, host.__defaults__, host.__closure__)
    copy.__kwdefaults__ = host.__kwdefaults__
    copy.__qualname__ = host.__qualname__
    return copy


class Patcher:
    """Reroutes host functions by swapping their code objects.

    Every reference to a host function is the same function object: the
    defining module's binding, ``from x import f`` copies in any module
    (imported before or after), default arguments, callables stored on
    existing objects (a loss's ``score_metric``, a model's similarity
    function). Swapping ``__code__`` therefore reroutes them all at once, and
    swapping it back restores them all, whatever was imported meanwhile."""

    def __init__(self) -> None:
        self._saved: list[tuple[types.FunctionType, types.CodeType]] = []
        self._modules: list[dict] = []

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def reroute(self, host: types.FunctionType, ours: Callable, use_host: Callable[[dict], bool]) -> None:
        """Until ``restore()``, calls of ``host`` (same parameters, same
        defaults) run ``ours``, or ``host``'s own code when
        ``use_host(keyword_arguments)`` says so (the host's backend choice)."""
        if host.__closure__:
            raise TypeError(f"{host.__qualname__} is a closure; its code cannot be swapped")
        hosts = host_copy(host)

        def route(*args, **kwargs):
            return (hosts if use_host(kwargs) else ours)(*args, **kwargs)

        key = f"{host.__module__}.{host.__qualname__}"
        module_globals = host.__globals__
        if _ROUTES not in module_globals:
            module_globals[_ROUTES] = {}
            self._modules.append(module_globals)
        module_globals[_ROUTES][key] = route
        self._saved.append((host, host.__code__))
        host.__code__ = _trampoline(host, key)

    def restore(self) -> None:
        while self._saved:
            host, code = self._saved.pop()
            host.__code__ = code
        while self._modules:
            self._modules.pop().pop(_ROUTES, None)
