"""numpy ufuncs on blocks of any backend: ``np.exp(x)`` for numpy, torch and cupy blocks alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._util.backend import Array, is_torch

__all__ = ["ufunc_for", "torch_operand"]

# numpy ufunc names whose torch function is spelt differently (or means something else:
# torch.equal compares whole tensors); the rest are torch's numpy-compatible aliases
_TORCH_NAMES = {
    "absolute": "abs",
    "fabs": "abs",
    "power": "pow",
    "conjugate": "conj_physical",
    "equal": "eq",
    "not_equal": "ne",
    "rint": "round",
    "invert": "bitwise_not",
    "left_shift": "bitwise_left_shift",
    "right_shift": "bitwise_right_shift",
}


def torch_operand(value: Any, like: Any, dtype: Any = None) -> Any:
    """Local. ``value`` as an operand of torch functions on blocks like ``like``: tensors pass
    through, numbers become 0-d tensors on ``like``'s device (in ``dtype`` if given)."""
    if is_torch(value):
        return value
    import torch

    return torch.as_tensor(value, device=like.device, dtype=dtype)


def ufunc_for(ufunc: np.ufunc, like: Array) -> Callable[..., Any]:
    """Local. ``ufunc`` as a function on blocks like ``like``.

    numpy blocks use the ufunc itself and cupy blocks too (cupy implements numpy's ufunc
    protocol); torch blocks the torch function of the same meaning, with scalar operands
    as 0-d tensors on the block's device (which keep the block's dtype, as numpy scalars do).

    Raises
    ------
    TypeError
        If torch has no counterpart of ``ufunc``.
    """
    if not is_torch(like):
        return ufunc
    import torch

    name = _TORCH_NAMES.get(ufunc.__name__, ufunc.__name__)
    fn = getattr(torch, name, None)
    if not callable(fn):
        raise TypeError(
            f"numpy.{ufunc.__name__} has no torch counterpart for torch blocks; apply a torch function to "
            f"x.local and wrap the result with x.with_local(...)"
        )

    def call(*args: Any) -> Any:
        return fn(*(torch_operand(a, like) for a in args))

    return call
