"""Finite differences and integrals of partitioned fields: ``diff``, ``gradient`` and
``trapezoid`` (numpy semantics).

Both are written with the DistTensor operations a numpy user would write: slices of one
tensor that are cut differently are aligned by one small move (only the rows between the
cuts travel), and ``roll`` moves one row per neighbour. The arithmetic is numpy's own, term
for term, so results equal ``numpy.diff`` / ``numpy.gradient`` on the gathered field to the
last bit. Coordinate arrays give ``gradient`` numpy's weights as profiles along the dim,
which broadcast against the field's blocks.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from ..._util.backend import dtype_kind, from_numpy
from ...layout import Layout
from ...ops.reduce import normalize_axes, ordered_axes
from ..core import DistTensor

__all__ = ["diff", "gradient", "trapezoid"]


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


def _spacings(varargs: Sequence[object], axes: tuple[int, ...], shape: tuple[int, ...]) -> list[float | np.ndarray]:
    """numpy's spacings: a number per axis, or a coordinate array's differences (numpy reduces
    coordinates with equal differences to that number)."""
    if not varargs:
        return [1.0] * len(axes)
    if len(varargs) == 1 and np.ndim(varargs[0]) == 0:  # type: ignore[arg-type]
        return [_number(varargs[0])] * len(axes)
    if len(varargs) != len(axes):
        raise TypeError(f"gradient: {len(varargs)} spacings given for {len(axes)} axes; give one, or one per axis")
    out: list[float | np.ndarray] = []
    for d, h in zip(axes, varargs):
        if isinstance(h, DistTensor):
            raise TypeError(
                "gradient: coordinates must be a 1-D numpy array (the same on every rank), not a DistTensor"
            )
        if np.ndim(h) == 0:  # type: ignore[arg-type]
            out.append(_number(h))
            continue
        x = np.asarray(h)
        if x.ndim != 1:
            raise ValueError(f"gradient: distances must be either scalars or 1d, got an array of shape {x.shape}")
        if len(x) != shape[d]:
            raise ValueError(
                f"gradient: when 1d, distances must match the length of the corresponding dimension "
                f"({len(x)} coordinates for dim {d} of length {shape[d]})"
            )
        if x.dtype.kind not in "iuf":
            raise TypeError(f"gradient: coordinates must be real numbers, got dtype {x.dtype}")
        dx = np.diff(x.astype(np.float64) if x.dtype.kind in "iu" else x)
        out.append(dx[0] if len(dx) and (dx == dx[0]).all() else dx)
    return out


def _number(h: object, what: str = "gradient") -> float:
    if not isinstance(h, (numbers.Real, np.generic)) or isinstance(h, (bool, np.bool_)):
        raise TypeError(f"{what}: a spacing must be a real number or a 1-D coordinate array, got {h!r}")
    return h  # type: ignore[return-value]  # (as numpy: an int spacing stays an int)


def _profile(coefs: np.ndarray, like: DistTensor, d: int) -> DistTensor:
    """The 1-D ``coefs`` along dim ``d`` (size 1 elsewhere), on every rank (it broadcasts
    against ``like``, whose blocks' backend it takes)."""
    shape = tuple(len(coefs) if e == d else 1 for e in range(like.ndim))
    block = from_numpy(np.ascontiguousarray(coefs.reshape(shape)), like.local)
    return DistTensor(block, like.grid, Layout(shape, like.grid.dims, (None,) * like.ndim))


def _one_axis(f: DistTensor, d: int, h: float | np.ndarray, edge_order: int) -> DistTensor:
    """numpy's gradient along dim ``d``: central differences inside (for a uniform spacing from
    two rolls, so the result keeps ``f``'s layout; else numpy's three weighted terms, the weights
    broadcast along ``d``), one-sided ones of ``edge_order`` at the ends."""
    n = f.shape[d]

    def at(i: int) -> DistTensor:
        return f[_along(f.ndim, d, i, i + 1 if i != -1 else None)]

    uniform = np.ndim(h) == 0
    if uniform:
        out = (f.roll(-1, d) - f.roll(1, d)) / (2.0 * h)
    else:
        dx1, dx2 = h[:-1], h[1:]  # type: ignore[index]
        out = f.copy()
        inner = [f[_along(f.ndim, d, lo, hi)] for lo, hi in ((None, -2), (1, -1), (2, None))]
        a, b, c = (
            _profile(w, inner[0], d)
            for w in (-dx2 / (dx1 * (dx1 + dx2)), (dx2 - dx1) / (dx1 * dx2), dx1 / (dx2 * (dx1 + dx2)))
        )
        out[_along(f.ndim, d, 1, -1)] = a * inner[0] + b * inner[1] + c * inner[2]
    if edge_order == 1:
        h0, hn = (h, h) if uniform else (h[0], h[-1])  # type: ignore[index]
        out[_along(f.ndim, d, 0, 1)] = (at(1) - at(0)) / h0
        out[_along(f.ndim, d, n - 1, n)] = (at(-1) - at(-2)) / hn
        return out
    if uniform:
        first, last = (-1.5 / h, 2.0 / h, -0.5 / h), (0.5 / h, -2.0 / h, 1.5 / h)
    else:
        d1, d2 = h[0], h[1]  # type: ignore[index]
        first = (-(2.0 * d1 + d2) / (d1 * (d1 + d2)), (d1 + d2) / (d1 * d2), -d1 / (d2 * (d1 + d2)))
        d1, d2 = h[-2], h[-1]  # type: ignore[index]
        last = (d2 / (d1 * (d1 + d2)), -(d2 + d1) / (d1 * d2), (2.0 * d2 + d1) / (d2 * (d1 + d2)))
    out[_along(f.ndim, d, 0, 1)] = first[0] * at(0) + first[1] * at(1) + first[2] * at(2)
    out[_along(f.ndim, d, n - 1, n)] = last[0] * at(-3) + last[1] * at(-2) + last[2] * at(-1)
    return out


def gradient(
    f: DistTensor, *varargs: object, axis: int | Sequence[int] | None = None, edge_order: int = 1
) -> DistTensor | tuple[DistTensor, ...]:
    """Collective over grid when a differentiated dim is divided, else Local. The gradient of
    ``f`` as ``numpy.gradient``: second-order central differences inside, first- or
    second-order one-sided differences at the ends, for uniform spacings or coordinates.

    Each derivative keeps ``f``'s layout. With a uniform spacing the interior comes from two
    rolls (one row moves between neighbouring blocks each way); with coordinates from numpy's
    three weighted slices (aligned: a row per neighbour), the weights broadcast along the dim.
    The two end rows come from small aligned slices. Differentiable for torch blocks.

    Parameters
    ----------
    f : DistTensor
    *varargs : number or 1-D array
        The spacing: none (1), one number for every axis, or one per axis in ``axis``: a
        number, or the coordinates along that dim (a 1-D array of its length, the same on
        every rank; equally spaced ones count as their spacing, as in numpy).
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
        On a spacing count that fits neither rule, a spacing that is neither a real number nor
        an array of them, or a DistTensor of coordinates.
    ValueError
        If ``edge_order`` is not 1 or 2, an axis is out of range or repeated, coordinates are
        not 1-D or not of the dim's length, or ``f`` has fewer than ``edge_order + 1``
        elements along a differentiated dim.
    """
    if edge_order not in (1, 2):
        raise ValueError(f"gradient: edge_order must be 1 or 2, got {edge_order!r}")
    axes = normalize_axes(axis, f.ndim) if axis is None else ordered_axes(axis, f.ndim)
    spacings = _spacings(varargs, axes, f.shape)
    for d in axes:
        if f.shape[d] < edge_order + 1:
            raise ValueError(
                f"gradient: shape {f.shape} is too small along dim {d} to calculate a numerical gradient: at least "
                f"(edge_order + 1) = {edge_order + 1} elements are required"
            )
    f = _inexact(f)
    out = tuple(_one_axis(f, d, h, edge_order) for d, h in zip(axes, spacings))
    return out[0] if len(out) == 1 else out


def trapezoid(y: DistTensor, x: object = None, dx: float = 1.0, axis: int = -1) -> DistTensor:
    """Collective over grid. The integral of ``y`` along ``axis`` by the trapezoidal rule, as
    ``numpy.trapezoid`` (also ``np.trapezoid(y, x)``): ``(d * (y[1:] + y[:-1]) / 2).sum(axis)``,
    with the slices aligned (a row per neighbouring block) and numpy's arithmetic.

    Parameters
    ----------
    y : DistTensor
    x : 1-D array or DistTensor, optional
        The sample points: a 1-D array along ``axis`` (the same on every rank; its
        differences broadcast along the dim), or a DistTensor of ``y``'s shape and split.
        Default: samples ``dx`` apart.
    dx : float
        The spacing when ``x`` is None.
    axis : int

    Returns
    -------
    DistTensor
        ``y`` without ``axis``, laid out as :meth:`DistTensor.sum` lays out its result.

    Raises
    ------
    TypeError
        If ``x`` is neither an array nor a DistTensor, or ``dx`` is not a number.
    ValueError
        If ``axis`` is out of range, ``y`` is 0-d, or ``x`` does not match ``y`` along ``axis``.
    """
    if y.ndim == 0:
        raise ValueError("trapezoid needs a tensor of at least one dim")
    d_ax = ordered_axes(axis, y.ndim)[0]
    n = y.shape[d_ax]
    d: object
    if x is None:
        d = _number(dx, "trapezoid")
    elif isinstance(x, DistTensor):
        if x.shape != y.shape:
            raise ValueError(f"trapezoid: sample points of shape {x.shape} for values of shape {y.shape}")
        d = diff(x, axis=d_ax)
    else:
        pts = np.asarray(x)
        if pts.ndim != 1 or len(pts) != n:
            raise ValueError(
                f"trapezoid: x must be 1-D with one point per sample along dim {d_ax} ({n}), got shape {pts.shape}"
            )
        if pts.dtype.kind not in "iuf":
            raise TypeError(f"trapezoid: sample points must be real numbers, got dtype {pts.dtype}")
        d = _profile(np.diff(pts), y[_along(y.ndim, d_ax, 1, None)], d_ax) if n > 1 else 0.0
    pairs = y[_along(y.ndim, d_ax, 1, None)] + y[_along(y.ndim, d_ax, None, -1)]
    return (d * pairs / 2.0).sum(d_ax)  # type: ignore[operator]
