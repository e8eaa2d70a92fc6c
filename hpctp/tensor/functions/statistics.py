"""Statistics and truth tests over DistTensors: ``var``, ``std``, ``any``, ``all`` (numpy semantics).

Written with the collective reductions and the broadcasting of a smaller operand, as numpy
writes them: ``var`` is the mean of the squared deviations from the mean (two passes, numpy's
arithmetic: ``x - mean``, squared as ``d * d`` or ``re * re + im * im``, summed, divided by
``n - ddof``), so it is differentiable for torch blocks like the operations it is made of.
``any``/``all`` count the nonzero (or zero) elements, which also gives numpy's answer over an
empty extent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import numpy as np

from ..._util.backend import dtype_kind
from ...ops.reduce import normalize_axes
from ..core import DistTensor
from ..registry import register

__all__ = ["var", "std", "any_nonzero", "all_nonzero", "resolve_ddof", "check_ddof", "squared_magnitude"]


@register("resolve_ddof")
def resolve_ddof(ddof: float, correction: float | None, where: object = None, mean: object = None) -> float:
    """Local. numpy's ``ddof``/``correction`` of ``var``/``std`` (one of them); ``where=``/``mean=`` refused."""
    if where is not None or mean is not None:
        raise TypeError("var/std on DistTensors take no where= or mean=; select with x[key] first")
    if correction is None:
        return ddof
    if ddof != 0:
        raise ValueError("var/std: ddof and correction are the same argument; give one of them")
    return correction


def check_ddof(ddof: object, what: str) -> None:
    """Local. Raise a TypeError naming ``what`` unless ``ddof`` is a real number."""
    if isinstance(ddof, bool) or not isinstance(ddof, (int, float)):
        raise TypeError(f"{what}: ddof must be a real number, got {ddof!r}")


def squared_magnitude(d: DistTensor) -> DistTensor:
    """Local. ``|d|**2`` as numpy's ``var`` computes it: ``d * d``, or ``re * re + im * im``."""
    return d.real * d.real + d.imag * d.imag if dtype_kind(d.local) == "c" else d * d


@register("var")
def var(x: DistTensor, axis: int | Sequence[int] | None = None, ddof: float = 0, keepdims: bool = False) -> DistTensor:
    """Collective over grid. The variance over ``axis`` (all dims if None), as ``numpy.var``.

    Parameters
    ----------
    x : DistTensor
        Ints and bools are taken as float64; complex gives a real variance.
    axis : int, sequence of int or None
    ddof : number
        The divisor is ``n - ddof`` for ``n`` reduced elements (negative divisors count as 0,
        as numpy's).
    keepdims : bool

    Returns
    -------
    DistTensor
        Laid out as :meth:`DistTensor.sum` lays out its result.

    Raises
    ------
    TypeError
        If ``ddof`` is not a real number.
    ValueError
        On a bad axis (on every rank).
    """
    check_ddof(ddof, "var/std")
    axes = normalize_axes(axis, x.ndim)
    f = x if dtype_kind(x.local) in "fc" else x.astype("float64")
    sq = squared_magnitude(f - f.mean(axes, keepdims=True))
    n = math.prod(x.global_shape[a] for a in axes)
    return sq.sum(axes, keepdims) / max(n - ddof, 0)


@register("std")
def std(x: DistTensor, axis: int | Sequence[int] | None = None, ddof: float = 0, keepdims: bool = False) -> DistTensor:
    """Collective over grid. The standard deviation, ``sqrt(var(x, axis, ddof, keepdims))``, as
    ``numpy.std``; see :func:`var`."""
    return cast(DistTensor, np.sqrt(var(x, axis, ddof, keepdims)))  # (numpy's protocol: the blocks' sqrt)


@register("any")
def any_nonzero(x: DistTensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> DistTensor:
    """Collective over grid. Whether any element over ``axis`` is nonzero (NaN counts), as
    ``numpy.any``: a boolean tensor; False over an empty extent."""
    return (x != 0).sum(axis, keepdims) > 0


@register("all")
def all_nonzero(x: DistTensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> DistTensor:
    """Collective over grid. Whether every element over ``axis`` is nonzero, as ``numpy.all``:
    a boolean tensor; True over an empty extent."""
    return (x == 0).sum(axis, keepdims) == 0
