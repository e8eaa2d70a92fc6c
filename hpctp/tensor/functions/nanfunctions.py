"""Reductions that skip NaNs: ``nansum``, ``nanmean``, ``nanmax``, ``nanmin``, ``nanvar``,
``nanstd`` (numpy semantics; also ``np.nansum(x)``, ...).

Written as numpy writes them, with the collective reductions: NaNs are replaced (by 0, or by
the extreme that cannot win) and counted, and a slice with no number left gives NaN (numpy
also warns then). Data without NaNs (ints, bools) takes the plain reductions. Differentiable
for torch blocks: a NaN's gradient is 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import numpy as np

from ..._util.backend import dtype_kind
from ...ops.reduce import normalize_axes
from ..core import DistTensor
from .statistics import check_ddof, squared_magnitude

__all__ = ["nansum", "nanmean", "nanmax", "nanmin", "nanvar", "nanstd"]


def _where(condition: DistTensor, a: object, b: object) -> DistTensor:
    return cast(DistTensor, np.where(condition, a, b))  # type: ignore[call-overload]  # (a DistTensor)


def _isnan(x: DistTensor) -> DistTensor:
    return cast(DistTensor, np.isnan(x))


def _drop_reduced(t: DistTensor, axes: tuple[int, ...]) -> DistTensor:
    """``t`` (reduced over ``axes`` with kept dims of size 1, whole on every rank) without them."""
    return t[tuple(0 if d in axes else slice(None) for d in range(t.ndim))]


def nansum(x: DistTensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> DistTensor:
    """Collective over grid. The sum over ``axis`` treating NaNs as zero, as ``numpy.nansum``."""
    if dtype_kind(x.local) not in "fc":
        return x.sum(axis, keepdims)
    return _where(_isnan(x), 0, x).sum(axis, keepdims)


def nanmean(x: DistTensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> DistTensor:
    """Collective over grid. The mean of the numbers over ``axis``, as ``numpy.nanmean``: NaN
    where a slice holds none."""
    if dtype_kind(x.local) not in "fc":
        return x.mean(axis, keepdims)
    nan = _isnan(x)
    total = _where(nan, 0, x).sum(axis, keepdims)
    count = (nan == 0).sum(axis, keepdims)
    return total / count.astype(total.local.dtype)


def _nanextreme(x: DistTensor, axis: int | Sequence[int] | None, keepdims: bool, op: str) -> DistTensor:
    if dtype_kind(x.local) != "f":
        return getattr(x, op)(axis, keepdims)  # type: ignore[no-any-return]
    nan = _isnan(x)
    loser = -math.inf if op == "max" else math.inf
    best = getattr(_where(nan, loser, x), op)(axis, keepdims)
    return _where(nan.all(axis, keepdims=keepdims), math.nan, best)


def nanmax(x: DistTensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> DistTensor:
    """Collective over grid. The maximum ignoring NaNs, as ``numpy.nanmax``: NaN where a slice
    holds no number."""
    return _nanextreme(x, axis, keepdims, "max")


def nanmin(x: DistTensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> DistTensor:
    """Collective over grid. The minimum ignoring NaNs, as ``numpy.nanmin``."""
    return _nanextreme(x, axis, keepdims, "min")


def nanvar(
    x: DistTensor, axis: int | Sequence[int] | None = None, ddof: float = 0, keepdims: bool = False
) -> DistTensor:
    """Collective over grid. The variance of the numbers over ``axis``, as ``numpy.nanvar``
    (numpy's two passes over the numbers; NaN where ``count - ddof <= 0``)."""
    if dtype_kind(x.local) not in "fc":
        return x.var(axis, ddof=ddof, keepdims=keepdims)
    check_ddof(ddof, "nanvar/nanstd")
    axes = normalize_axes(axis, x.ndim)
    nan = _isnan(x)
    zeroed = _where(nan, 0, x)
    count = (nan == 0).sum(axes, keepdims=True)
    mean = zeroed.sum(axes, keepdims=True) / count.astype(zeroed.local.dtype)
    sq = squared_magnitude(_where(nan, 0, zeroed - mean))
    dof = count - ddof
    var = sq.sum(axes, keepdims=True) / dof.astype(sq.local.dtype)
    var = _where(dof <= 0, math.nan, var)
    return var if keepdims else _drop_reduced(var, axes)


def nanstd(
    x: DistTensor, axis: int | Sequence[int] | None = None, ddof: float = 0, keepdims: bool = False
) -> DistTensor:
    """Collective over grid. ``sqrt(nanvar(x, axis, ddof, keepdims))``, as ``numpy.nanstd``."""
    return cast(DistTensor, np.sqrt(nanvar(x, axis, ddof, keepdims)))
