"""The table through which :class:`~hpctp.DistTensor`'s methods reach the modules built on it.

``x.var()``, ``x.cumsum()``, ``x @ y``, ``np.exp(x)`` and ``torch.relu(x)`` are implemented in
modules that import :class:`~hpctp.DistTensor` (the statistics, the scans, SUMMA, numpy's and
torch's protocols). Instead of importing them back inside its method bodies (an import cycle),
the class looks its implementations up here by name, and each implementing module registers
itself when it is imported (as PyTorch's DTensor registers its op strategies). This module is a
leaf: it imports nothing of hpctp.

Modules that need torch at import time are registered *lazily* (:func:`register_lazy`): the
package above them names the module, and the first lookup imports it, so ``import hpctp``
does not load torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["register", "register_lazy", "implementation", "registered"]

F = TypeVar("F", bound=Callable[..., Any])

_IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {}
_LAZY: dict[str, str] = {}


def register(name: str) -> Callable[[F], F]:
    """Local. Decorator: make ``fn`` the implementation of ``name``.

    Parameters
    ----------
    name : str
        The operation, e.g. ``"var"`` (what :class:`~hpctp.DistTensor` asks for).

    Returns
    -------
    callable
        The decorator; it returns ``fn`` unchanged.

    Raises
    ------
    ValueError
        If another function is already registered for ``name``.
    """

    def decorate(fn: F) -> F:
        old = _IMPLEMENTATIONS.get(name)
        if old is not None and old is not fn:
            raise ValueError(f"DistTensor operation {name!r} is registered twice: {old.__module__} and {fn.__module__}")
        _IMPLEMENTATIONS[name] = fn
        return fn

    return decorate


def register_lazy(name: str, module: str) -> None:
    """Local. Say that importing ``module`` registers ``name``; the first :func:`implementation`
    of ``name`` imports it.

    Parameters
    ----------
    name : str
        The operation.
    module : str
        Absolute module name, e.g. ``"hpctp.tensor.torch_protocol"``.
    """
    _LAZY[name] = module


def implementation(name: str) -> Callable[..., Any]:
    """Local. The function registered for ``name``.

    Parameters
    ----------
    name : str
        The operation.

    Returns
    -------
    callable

    Raises
    ------
    NotImplementedError
        If no loaded module registers ``name`` (its module was never imported: ``import hpctp``
        imports them all).
    """
    fn = _IMPLEMENTATIONS.get(name)
    if fn is None and name in _LAZY:
        importlib.import_module(_LAZY[name])
        fn = _IMPLEMENTATIONS.get(name)
    if fn is None:
        raise NotImplementedError(
            f"DistTensor operation {name!r} has no implementation loaded: `import hpctp` (it imports every module "
            "that implements DistTensor's operations)"
        )
    return fn


def registered() -> dict[str, str]:
    """Local. Every registered operation and the module implementing it (lazy ones included).

    Returns
    -------
    dict
        Operation name -> module name, sorted by name.
    """
    names = {name: fn.__module__ for name, fn in _IMPLEMENTATIONS.items()}
    for name, module in _LAZY.items():
        names.setdefault(name, module)
    return dict(sorted(names.items()))
