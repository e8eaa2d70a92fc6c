"""Portable dtype codes, so headers about blocks can travel as integers (no pickle)."""

from __future__ import annotations

import sys
from typing import Any, cast

import numpy as np

__all__ = ["DTYPE_NAMES", "dtype_name", "dtype_code", "dtype_from_code"]

DTYPE_NAMES: tuple[str, ...] = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", "bfloat16",
)  # fmt: skip


def dtype_name(dtype: object) -> str:
    """Local. Canonical name of a numpy/torch/cupy dtype, e.g. ``"float64"``.

    Raises
    ------
    TypeError
        If the dtype is not one hpctp can move between ranks.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
        name = {"bool": "bool", "cfloat": "complex64", "cdouble": "complex128"}.get(name, name)
    else:
        try:
            name = np.dtype(cast(Any, dtype)).name
        except TypeError:
            raise TypeError(f"unsupported dtype {dtype!r}") from None
    if name not in DTYPE_NAMES:
        raise TypeError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_NAMES)}")
    return name


def dtype_code(dtype: object) -> int:
    """Local. Small integer code of a dtype (index into :data:`DTYPE_NAMES`)."""
    return DTYPE_NAMES.index(dtype_name(dtype))


def dtype_from_code(code: int, backend: str) -> Any:
    """Local. The dtype with ``code`` as ``backend`` (``"numpy"``, ``"torch"``, ``"cupy"``) spells it."""
    name = DTYPE_NAMES[int(code)]
    if backend in ("torch", "cuda"):
        import torch

        return getattr(torch, name)
    if name == "bfloat16":
        raise TypeError("bfloat16 blocks need the torch backend")
    return np.dtype(name)
