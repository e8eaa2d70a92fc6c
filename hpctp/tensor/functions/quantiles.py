"""Order statistics of DistTensors: ``quantile``, ``percentile`` and ``median`` (numpy semantics).

No rank sorts the tensor. Each needed order statistic (the ``k``-th smallest value of every
reduced slice) is found by bisection on the values' bit patterns, mapped to integers that sort
as the values do: per step each rank counts its elements at or below the trial value and the
counts are summed over the ranks holding the slice (one small all-reduce), at most 64 steps.
The result is then an element of the tensor, so numpy's interpolation between the two order
statistics around each quantile (``linear``, its default) and numpy's median (the mean of the
two middle values) give numpy's values. A NaN in a slice makes its result NaN, as in numpy.

Each step compares every element of the block with the trial values (for the two order
statistics around every quantile at once), so a quantile costs at most 64 passes over the
block. Blocks are searched on the host (device blocks are copied there); the result is on
the blocks' backend. Not differentiable: a tensor that requires grad is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ... import comm as C
from ..._util.backend import dtype_kind, from_numpy, to_numpy
from ...layout import Layout
from ...ops.reduce import allreduce_over_axes, normalize_axes
from ...ops.transfer import needs_grad
from ..core import DistTensor

__all__ = ["quantile", "percentile", "median", "sortable_keys", "from_keys"]


def sortable_keys(values: np.ndarray) -> np.ndarray:
    """Local. int64 keys that order as ``values`` do (floats: by their bit patterns, -0.0 just
    below +0.0, NaN above everything; ints and bools: the values)."""
    kind = values.dtype.kind
    if kind in "biu":
        return values.astype(np.int64)
    width = values.dtype.itemsize * 8
    bits = values.view(f"int{width}")
    keys = (bits ^ ((bits >> (width - 1)) & np.array((1 << (width - 1)) - 1, dtype=bits.dtype))).astype(np.int64)
    keys[np.isnan(values)] = np.iinfo(np.int64).max
    return keys


def from_keys(keys: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Local. The values of ``dtype`` whose :func:`sortable_keys` are ``keys``."""
    if dtype.kind in "biu":
        return keys.astype(dtype)
    width = dtype.itemsize * 8
    bits = keys.astype(f"int{width}")
    return (bits ^ ((bits >> (width - 1)) & np.array((1 << (width - 1)) - 1, dtype=bits.dtype))).view(dtype)


def _order_statistics(x: DistTensor, axes: tuple[int, ...], ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ``ranks[i]``-th smallest values (0-based) of every slice of ``x`` over ``axes``, for
    this rank's part of the result (reduced dims kept with size 1): an array of shape
    ``ranks.shape + kept block shape``; and whether each slice holds a NaN."""
    values = to_numpy(x.local)
    keys = sortable_keys(values)
    grid_axes = sorted({g for g in (x.split[d] for d in axes) if g is not None and x.grid.dims[g] > 1})
    kept = tuple(1 if d in axes else n for d, n in enumerate(keys.shape))
    big, small = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    stats = np.stack(  # each slice's minimum and -maximum: one all-reduce (the max is -min(-max))
        [
            keys.min(axis=axes, keepdims=True, initial=big),
            -np.maximum(keys.max(axis=axes, keepdims=True, initial=small), small + 1),
        ]
    )
    nans = np.isnan(values).sum(axis=axes, keepdims=True) if values.dtype.kind == "f" else np.zeros(kept, np.int64)
    allreduce_over_axes(x.grid, stats, "min", grid_axes)
    nans = np.ascontiguousarray(nans, dtype=np.int64)
    allreduce_over_axes(x.grid, nans, "sum", grid_axes)
    lo = np.broadcast_to(stats[0], ranks.shape + kept).copy()
    hi = np.broadcast_to(-stats[1], ranks.shape + kept).copy()
    need = ranks.reshape(ranks.shape + (1,) * len(kept)) + 1
    red = tuple(len(ranks.shape) + d for d in axes)
    while (lo < hi).any():  # (lo/hi are the same on every rank holding the slice: they stop together)
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        counts = np.ascontiguousarray((keys <= mid).sum(axis=red, keepdims=True))
        allreduce_over_axes(x.grid, counts, "sum", grid_axes)
        below = counts >= need
        hi = np.where(below, mid, hi)
        lo = np.where(below, lo, mid + 1)
    return from_keys(lo, values.dtype), nans > 0


def _lerp(a: np.ndarray, b: np.ndarray, t: Any) -> np.ndarray:
    """numpy's interpolation between ``a`` and ``b`` (exact at both ends), with numpy's dtype
    promotion: a Python-float ``t`` keeps float data's dtype, an array ``t`` gives float64."""
    diff = b - a
    return np.where(t >= 0.5, b - diff * (1 - t), a + diff * t)


def _result(x: DistTensor, axes: tuple[int, ...], keepdims: bool, values: np.ndarray, lead: int) -> DistTensor:
    """A DistTensor of ``values`` (``lead`` leading q dims, then the kept block shape), laid out
    as a reduction of ``x`` over ``axes``, on ``x``'s backend."""
    lay = x.layout
    shape = [1 if d in axes else n for d, n in enumerate(lay.global_shape)]
    split = [None if d in axes else s for d, s in enumerate(lay.split)]
    cuts = [None if d in axes else c for d, c in enumerate(lay.cuts)]
    keep = [d for d in range(x.ndim) if keepdims or d not in axes]
    block = values.reshape(values.shape[:lead] + tuple(values.shape[lead + d] for d in keep))
    layout = Layout(
        tuple(values.shape[:lead]) + tuple(shape[d] for d in keep),
        lay.grid_dims,
        (None,) * lead + tuple(split[d] for d in keep),
        (None,) * lead + tuple(cuts[d] for d in keep),
    )
    return DistTensor(from_numpy(np.asarray(block, order="C"), x.local), x.grid, layout)


def _checked(x: DistTensor, what: str, axis: object, q: object = None) -> tuple[tuple[int, ...], np.ndarray | None]:
    error: Exception | None = None
    axes: tuple[int, ...] = ()
    qs = None
    try:
        if not isinstance(x, DistTensor):
            raise TypeError(f"hpctp.{what} needs a DistTensor, got {type(x).__name__}")
        if dtype_kind(x.local) == "c":
            raise TypeError(f"{what}: a must be an array of real numbers")
        if needs_grad(x.local):
            raise TypeError(f"{what} of a tensor that requires grad is not differentiable; use x.detach()")
        axes = normalize_axes(axis, x.ndim)  # type: ignore[arg-type]
        if any(x.global_shape[d] == 0 for d in axes):
            raise ValueError(f"{what} of an empty tensor (shape {x.global_shape}) over axis {axis}")
        if q is not None:
            qs = np.asanyarray(q, dtype=np.float64)
            if qs.ndim > 1 or not ((qs >= 0) & (qs <= 1)).all():
                raise ValueError(f"{what}: quantiles must be in the range [0, 1] (a number or a 1-D sequence)")
    except (TypeError, ValueError) as e:
        error = e
    if not isinstance(x, DistTensor):
        raise error  # type: ignore[misc]
    C.agree_arguments(x.grid.comm, what, error, axis=axis, q=qs)
    return axes, qs


def quantile(
    x: DistTensor,
    q: float | Sequence[float] | np.ndarray,
    axis: int | Sequence[int] | None = None,
    method: str = "linear",
    keepdims: bool = False,
    *,
    weak: bool | None = None,
) -> DistTensor:
    """Collective over grid. The ``q``-th quantiles over ``axis`` (all dims if None), as
    ``numpy.quantile`` with its default ``method="linear"`` (also ``np.quantile(x, q)``).

    Parameters
    ----------
    x : DistTensor
        Real (ints and bools give float64, as numpy); not requiring grad.
    q : float or 1-D sequence of float
        In ``[0, 1]``, the same on every rank.
    axis : int, sequence of int or None
    method : {"linear"}
    keepdims : bool
    weak : bool, optional
        numpy's result dtype rule: a Python number ``q`` (the default test) keeps float data's
        dtype, an array ``q`` gives float64 (:func:`percentile` passes its own ``q``'s).

    Returns
    -------
    DistTensor
        Laid out as :meth:`DistTensor.sum` lays out its result, with a leading undivided dim
        of ``len(q)`` for a sequence ``q``.

    Raises
    ------
    TypeError
        On complex values or a tensor that requires grad.
    ValueError
        On another method, quantiles outside ``[0, 1]``, a bad or empty axis, or ranks that
        pass different arguments.
    """
    if method != "linear":
        raise ValueError(f"{method!r}: only numpy's default method, 'linear', is supported on DistTensors")
    weak = type(q) in (int, float) if weak is None else weak
    axes, qs = _checked(x, "quantile", axis, q)
    qs = np.asarray(qs)  # (set: agreed without error)
    n = int(np.prod([x.global_shape[d] for d in axes]))
    virtual = (n - 1) * qs  # numpy's linear method
    prev = np.floor(virtual).astype(np.int64)
    nxt = np.minimum(prev + 1, n - 1)
    flat = np.concatenate([prev.reshape(-1), nxt.reshape(-1)])
    stats, nan = _order_statistics(x, axes, flat)
    k = prev.size
    a, b = stats[:k], stats[k:]
    gamma = virtual - prev
    t: Any = float(gamma) if weak else gamma.reshape((k,) + (1,) * (a.ndim - 1))
    out = _lerp(a, b, t)  # (float: ints meet a float t)
    out = np.where(nan, out.dtype.type(np.nan), out)
    return _result(x, axes, keepdims, out.reshape(qs.shape + out.shape[1:]), qs.ndim)


def percentile(
    x: DistTensor,
    q: float | Sequence[float] | np.ndarray,
    axis: int | Sequence[int] | None = None,
    method: str = "linear",
    keepdims: bool = False,
) -> DistTensor:
    """Collective over grid. :func:`quantile` with ``q`` in percent (``numpy.percentile``; also
    ``np.percentile(x, q)``)."""
    qs = np.true_divide(np.asanyarray(q, dtype=np.float64), 100)
    if not ((qs >= 0) & (qs <= 1)).all():
        raise ValueError(f"percentile: percentiles must be in the range [0, 100], got {q!r}")
    return quantile(x, qs, axis, method, keepdims, weak=type(q) in (int, float))


def median(x: DistTensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> DistTensor:
    """Collective over grid. The median over ``axis``, as ``numpy.median`` (also ``np.median``):
    the middle value, or the mean of the two middle values; NaN where a slice holds one.

    Raises
    ------
    TypeError, ValueError
        As :func:`quantile`.
    """
    axes, _ = _checked(x, "median", axis)
    n = int(np.prod([x.global_shape[d] for d in axes]))
    ranks = np.array([(n - 1) // 2, n // 2], dtype=np.int64)
    stats, nan = _order_statistics(x, axes, ranks)
    dtype = stats.dtype if stats.dtype.kind == "f" else np.dtype(np.float64)
    a, b = stats[0].astype(dtype), stats[1].astype(dtype)
    out = (a + b) / dtype.type(2) if n % 2 == 0 else a
    out = np.where(nan, dtype.type(np.nan), out)
    return _result(x, axes, keepdims, out, 0)
