"""Where the extremes are: ``argmax`` and ``argmin`` of DistTensors (numpy semantics).

Two collective reductions: the extreme value (``max``/``min``), then the smallest global
index holding it (``min`` of each element's index, or of a sentinel where the element is
not the extreme), which is numpy's rule of the first occurrence; a NaN counts as the
extreme, as in numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._util.backend import Array, array_module, dtype_kind, from_numpy, is_torch
from ..._util.ints import is_int
from ...ops.reduce import check_nonempty, ordered_axes
from ..core import DistTensor
from ..registry import register

__all__ = ["argmax", "argmin"]


def _index(x: DistTensor, axis: int | None) -> Array:
    """Each element's global index along ``axis`` (``None``: its C-order flat index), int64,
    on the block's backend and device, shaped to broadcast against the block."""
    ranges = x.layout.local_ranges(x.grid.coords)
    if axis is not None:
        a, b = ranges[axis]
        shape = [-1 if d == axis else 1 for d in range(x.ndim)]
        return from_numpy(np.arange(a, b, dtype=np.int64).reshape(shape), x.local)
    flat = np.zeros((1,) * x.ndim, dtype=np.int64)
    stride = 1
    for d in reversed(range(x.ndim)):
        a, b = ranges[d]
        shape = [-1 if e == d else 1 for e in range(x.ndim)]
        flat = flat + np.arange(a, b, dtype=np.int64).reshape(shape) * stride
        stride *= x.global_shape[d]
    return from_numpy(flat, x.local)


def _first_hit(block: Array, extreme: Array, index: Array, none: int) -> Array:
    """``index`` where ``block`` equals ``extreme`` (or is NaN), else ``none``."""
    inexact = dtype_kind(block) in "fc"
    if is_torch(block):
        import torch  # (loaded: the block is a torch tensor)

        hit = (block == extreme) | torch.isnan(block) if inexact else block == extreme
        return torch.where(hit, index, torch.full_like(index, none))
    xp = array_module(block)
    hit = (block == extreme) | xp.isnan(block) if inexact else block == extreme
    return xp.where(hit, index, none)


def _arg(x: DistTensor, op: str, axis: Any, keepdims: bool) -> DistTensor:
    what = f"arg{op}"
    if axis is not None and not is_int(axis):
        raise TypeError(f"{what} takes an int axis or None (as numpy), got {axis!r}")
    d = None if axis is None else ordered_axes(int(axis), x.ndim)[0]
    check_nonempty(x.global_shape, d, what)
    plain = x.with_local(x.local.detach()) if is_torch(x.local) else x  # (an index has no gradient)
    extreme = plain.max(d, True) if op == "max" else plain.min(d, True)
    none = x.size if d is None else x.global_shape[d]  # (beyond every index: never the minimum)
    index = _index(x, d)
    candidates = plain.with_local(_first_hit(plain.local, extreme.local, index, none))
    return candidates.min(d, keepdims)


@register("argmax")
def argmax(x: DistTensor, axis: int | None = None, keepdims: bool = False) -> DistTensor:
    """Collective over grid. Index of the largest element, as ``numpy.argmax`` (the first
    occurrence; a NaN counts as the largest).

    Parameters
    ----------
    x : DistTensor
    axis : int, optional
        Along this dim (the result keeps the other dims' split); None: the C-order flat
        index over the whole tensor, a replicated 0-d int64 tensor (``int(x.argmax())``).
    keepdims : bool
        Keep the reduced dim(s) with size 1.

    Returns
    -------
    DistTensor
        int64 indices, the same on every rank that holds them.

    Raises
    ------
    TypeError
        On a non-int axis or a complex tensor.
    ValueError
        On an empty tensor (or reduced dim) or an axis out of range.
    """
    return _arg(x, "max", axis, keepdims)


@register("argmin")
def argmin(x: DistTensor, axis: int | None = None, keepdims: bool = False) -> DistTensor:
    """Collective over grid. Index of the smallest element, as ``numpy.argmin``; see :func:`argmax`."""
    return _arg(x, "min", axis, keepdims)
