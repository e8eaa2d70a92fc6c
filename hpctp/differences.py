"""Finite differences of partitioned fields: ``diff`` and ``gradient`` (numpy semantics).

Both are written with the DistTensor operations a numpy user would write: slices of one
tensor that are cut differently are aligned by one small move (only the rows between the
cuts travel), and ``roll`` moves one row per neighbour. The arithmetic is numpy's own, term
for term, so results equal ``numpy.diff`` / ``numpy.gradient`` on the gathered field to the
last bit (for uniform spacings).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from .backend import dtype_kind
from .ops.reduce import normalize_axes, ordered_axes
from .tensor import DistTensor

__all__ = ["diff", "gradient"]


def _along(ndim: int, d: int, start: int | None, stop: int | None) -> tuple[slice, ...]:
    return tuple(slice(start, stop) if i == d else slice(None) for i in range(ndim))


def _inexact(f: DistTensor) -> DistTensor:
    """``f`` as floats where it holds ints or bools (numpy's gradient computes in float64)."""
    return f if dtype_kind(f.local) in "fc" else f.astype("float64")


def diff(a: DistTensor, n: int = 1, axis: int = -1) -> DistTensor:
    """Collective over grid when ``axis`` is divided, else Local. The ``n``-th discrete
    difference along ``axis``, as ``numpy.diff``: ``a[1:] - a[:-1]`` (along ``axis``), ``n``
    times, in the layout of ``a[1:]``.

    Parameters
    ----------
    a : DistTensor
    n : int
        How many times to difference (0 returns ``a``).
    axis : int
        The dim; negative counts from the end.

    Returns
    -------
    DistTensor
        One shorter along ``axis`` per difference.

    Raises
    ------
    TypeError
        If ``n`` or ``axis`` is not an int.
    ValueError
        If ``n`` is negative, ``axis`` out of range, or ``a`` is 0-d.
    """
    if not isinstance(n, numbers.Integral) or isinstance(n, bool):
        raise TypeError(f"diff: n must be an int, got {n!r}")
    if n < 0:
        raise ValueError(f"diff: order must be non-negative but got {n}")
    if a.ndim == 0:
        raise ValueError("diff requires input that is at least one dimensional")
    d = ordered_axes(axis, a.ndim)[0]
    for _ in range(int(n)):
        a = a[_along(a.ndim, d, 1, None)] - a[_along(a.ndim, d, None, -1)]
    return a


def _spacings(varargs: Sequence[object], axes: tuple[int, ...]) -> list[float]:
    if not varargs:
        return [1.0] * len(axes)
    if not all(isinstance(h, numbers.Real) and not isinstance(h, bool) for h in varargs):
        raise TypeError(
            "gradient on DistTensors takes uniform spacings as numbers (one, or one per axis); "
            "coordinate arrays are not supported"
        )
    if len(varargs) == 1:
        return [float(varargs[0])] * len(axes)  # type: ignore[arg-type]
    if len(varargs) != len(axes):
        raise TypeError(f"gradient: {len(varargs)} spacings given for {len(axes)} axes; give one, or one per axis")
    return [float(h) for h in varargs]  # type: ignore[arg-type]


def _one_axis(f: DistTensor, d: int, h: float, edge_order: int) -> DistTensor:
    """numpy's uniform-spacing gradient along dim ``d``: central differences inside (from two
    rolls, so the result keeps ``f``'s layout), one-sided ones of ``edge_order`` at the ends."""
    n = f.shape[d]
    out = (f.roll(-1, d) - f.roll(1, d)) / (2.0 * h)

    def at(i: int) -> DistTensor:
        return f[_along(f.ndim, d, i, i + 1 if i != -1 else None)]

    if edge_order == 1:
        out[_along(f.ndim, d, 0, 1)] = (at(1) - at(0)) / h
        out[_along(f.ndim, d, n - 1, n)] = (at(-1) - at(-2)) / h
    else:
        out[_along(f.ndim, d, 0, 1)] = -1.5 / h * at(0) + 2.0 / h * at(1) + -0.5 / h * at(2)
        out[_along(f.ndim, d, n - 1, n)] = 0.5 / h * at(-3) + -2.0 / h * at(-2) + 1.5 / h * at(-1)
    return out


def gradient(
    f: DistTensor, *varargs: float, axis: int | Sequence[int] | None = None, edge_order: int = 1
) -> DistTensor | tuple[DistTensor, ...]:
    """Collective over grid when a differentiated dim is divided, else Local. The gradient of
    ``f`` as ``numpy.gradient`` with uniform spacings: second-order central differences
    inside, first- or second-order one-sided differences at the ends.

    Each derivative keeps ``f``'s layout: the interior comes from two rolls (one row moves
    between neighbouring blocks each way), the two end rows from small aligned slices.
    Differentiable for torch blocks.

    Parameters
    ----------
    f : DistTensor
    *varargs : float
        The spacing: none (1), one for every axis, or one per axis in ``axis``.
    axis : int or sequence of int, optional
        The dims to differentiate along (all if None).
    edge_order : {1, 2}

    Returns
    -------
    DistTensor or tuple of DistTensor
        One derivative per axis; a single DistTensor when one axis is asked for (as numpy).

    Raises
    ------
    TypeError
        On coordinate arrays as spacings, or a spacing count that fits neither rule.
    ValueError
        If ``edge_order`` is not 1 or 2, an axis is out of range or repeated, or ``f`` has
        fewer than ``edge_order + 1`` elements along a differentiated dim.
    """
    if edge_order not in (1, 2):
        raise ValueError(f"gradient: edge_order must be 1 or 2, got {edge_order!r}")
    axes = normalize_axes(axis, f.ndim) if axis is None else ordered_axes(axis, f.ndim)
    spacings = _spacings(varargs, axes)
    for d in axes:
        if f.shape[d] < edge_order + 1:
            raise ValueError(
                f"gradient: shape {f.shape} is too small along dim {d} to calculate a numerical gradient: at least "
                f"(edge_order + 1) = {edge_order + 1} elements are required"
            )
    f = _inexact(f)
    out = tuple(_one_axis(f, d, h, edge_order) for d, h in zip(axes, spacings))
    return out[0] if len(out) == 1 else out
