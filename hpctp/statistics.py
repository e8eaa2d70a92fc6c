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

from .backend import array_module, dtype_kind
from .ops.reduce import normalize_axes
from .tensor import DistTensor

__all__ = ["var", "std", "any_nonzero", "all_nonzero"]


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
    if isinstance(ddof, bool) or not isinstance(ddof, (int, float)):
        raise TypeError(f"var/std: ddof must be a real number, got {ddof!r}")
    axes = normalize_axes(axis, x.ndim)
    f = x if x._is_inexact() else x.astype("float64")
    d = f - f.mean(axes, keepdims=True)
    sq = d.real * d.real + d.imag * d.imag if dtype_kind(d.local) == "c" else d * d
    n = math.prod(x.global_shape[a] for a in axes)
    return sq.sum(axes, keepdims) / max(n - ddof, 0)


def std(x: DistTensor, axis: int | Sequence[int] | None = None, ddof: float = 0, keepdims: bool = False) -> DistTensor:
    """Collective over grid. The standard deviation, ``sqrt(var(x, axis, ddof, keepdims))``, as
    ``numpy.std``; see :func:`var`."""
    v = var(x, axis, ddof, keepdims)
    return v._new(v.local.sqrt() if v.backend == "torch" else array_module(v.local).sqrt(v.local))


def any_nonzero(x: DistTensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> DistTensor:
    """Collective over grid. Whether any element over ``axis`` is nonzero (NaN counts), as
    ``numpy.any``: a boolean tensor; False over an empty extent."""
    return (x != 0).sum(axis, keepdims) > 0


def all_nonzero(x: DistTensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> DistTensor:
    """Collective over grid. Whether every element over ``axis`` is nonzero, as ``numpy.all``:
    a boolean tensor; True over an empty extent."""
    return (x == 0).sum(axis, keepdims) == 0
