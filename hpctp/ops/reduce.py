"""Reductions of distributed tensors: local reduce, then all-reduce along the split grid axes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from .. import comm as C
from .._util.backend import Array, array_module, as_contiguous, dtype_kind, is_torch, is_torch_dtype
from .._util.ints import is_int
from ..comm import ProcessGrid
from ..layout import Layout
from .transfer import needs_grad

__all__ = ["allreduce_over_axes", "check_nonempty", "normalize_axes", "reduce_block", "REDUCTIONS"]

REDUCTIONS = ("sum", "max", "min")


def ordered_axes(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """Local. Tensor dims (None: all; an int; a sequence; negative ones count from the end) as
    distinct non-negative ints, in the order given.

    Raises
    ------
    ValueError
        If an axis is out of range or repeated.
    TypeError
        If an entry is not an int.
    """
    if axis is None:
        return tuple(range(ndim))
    items = (axis,) if is_int(axis) else tuple(axis)
    out: list[int] = []
    for a in items:
        if not is_int(a):
            raise TypeError(f"axis entries must be ints, got {a!r}")
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a {ndim}-D tensor")
        a = int(a) % ndim
        if a in out:
            raise ValueError(f"axis {a} is repeated in axis={axis!r}")
        out.append(a)
    return tuple(out)


def normalize_axes(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """Local. Reduction axes as sorted non-negative ints (see :func:`ordered_axes`).

    Raises
    ------
    ValueError
        If an axis is out of range or repeated.
    """
    return tuple(sorted(ordered_axes(axis, ndim)))


def check_nonempty(shape: tuple[int, ...], axis: int | Sequence[int] | None, what: str) -> None:
    """Local. Raise unless every dim of ``shape`` that ``axis`` reduces is non-empty (the
    maximum, minimum or their index of no elements has no value).

    Parameters
    ----------
    shape : tuple of int
        The global shape of the reduced tensor.
    axis : int, sequence of int or None
        The reduced dims (None: all).
    what : str
        The reduction, for the message (``"max"``, ``"argmin"``).

    Raises
    ------
    ValueError
        If a reduced dim has size 0, or an axis is out of range or repeated.
    TypeError
        If an axis is not an int.
    """
    axes = normalize_axes(axis, len(shape))
    if any(shape[d] == 0 for d in axes):
        raise ValueError(f"{what} of an empty tensor (shape {shape}) over axis {axis}")


def _identity(op: str, dtype: object) -> object:
    if op == "sum":
        return 0
    if is_torch_dtype(dtype):
        import torch

        tdt = cast(torch.dtype, dtype)
        if tdt == torch.bool:
            return op == "min"
        if tdt.is_floating_point:
            return -math.inf if op == "max" else math.inf
        tinfo = torch.iinfo(tdt)
        return tinfo.min if op == "max" else tinfo.max
    dt = np.dtype(cast(Any, dtype))
    if dt == np.bool_:
        return op == "min"
    if dt.kind == "f":
        return -math.inf if op == "max" else math.inf
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return info.min if op == "max" else info.max
    raise TypeError(f"{op} is not defined for dtype {dt}")


def _bool_as_uint8(x: Array) -> Array:
    """A uint8 view of a boolean block (same memory), any other block as is."""
    if is_torch(x):
        import torch

        return x.view(torch.uint8) if x.dtype == torch.bool else x
    return x.view(np.uint8) if np.dtype(x.dtype) == np.bool_ else x


def _with_nan_flags(red: Array, op: str) -> Array:
    """For ``max``/``min`` of floats: the values (a NaN replaced by the op's identity), then one
    flag per value (``+1``/``-1`` where NaN, else 0), so one all-reduce with ``op`` also says
    where any rank had a NaN: MPI's MAX and MIN compare, and a NaN loses every comparison."""
    sign = 1.0 if op == "max" else -1.0
    if is_torch(red):
        import torch

        nan = torch.isnan(red)
        vals = torch.where(nan, torch.full_like(red, -sign * math.inf), red)
        return torch.cat([vals.reshape(-1), (nan.to(red.dtype) * sign).reshape(-1)])
    xp = array_module(red)
    nan = xp.isnan(red)
    vals = xp.where(nan, -sign * math.inf, red).astype(red.dtype, copy=False)
    return xp.concatenate([vals.reshape(-1), (nan * sign).astype(red.dtype).reshape(-1)])


def _nan_where_flagged(wire: Array, shape: tuple[int, ...]) -> Array:
    """The reduced values of :func:`_with_nan_flags`'s buffer, NaN where a rank had one (numpy's max)."""
    n = wire.shape[0] // 2
    vals, flags = wire[:n].reshape(shape), wire[n:].reshape(shape)
    if is_torch(wire):
        import torch

        return torch.where(flags != 0, torch.full_like(vals, math.nan), vals)
    return array_module(wire).where(flags != 0, math.nan, vals).astype(wire.dtype, copy=False)


def _local_reduce(x: Array, op: str, axes: tuple[int, ...]) -> Array:
    """Reduce with keepdims; empty extents give the op's identity."""
    out_shape = tuple(1 if d in axes else n for d, n in enumerate(x.shape))
    empty = any(x.shape[d] == 0 for d in axes)
    if is_torch(x):
        import torch

        if empty and op != "sum":  # (torch.sum gives the zeros itself, and keeps autograd's graph)
            return torch.full(out_shape, cast(Any, _identity(op, x.dtype)), dtype=x.dtype, device=x.device)
        if not axes:  # nothing to reduce (a 0-d tensor); sum still promotes bool/ints to int64, as torch.sum
            promote = op == "sum" and not (x.dtype.is_floating_point or x.dtype.is_complex)
            return x.to(torch.int64) if promote else x.clone()
        if op == "sum":
            return torch.sum(x, dim=axes, keepdim=True)
        fn = torch.amax if op == "max" else torch.amin
        return fn(x, dim=axes, keepdim=True)
    xp = array_module(x)
    if empty:
        dtype = np.sum(np.zeros(1, dtype=x.dtype)).dtype if op == "sum" else x.dtype
        return xp.full(out_shape, _identity(op, x.dtype), dtype=dtype)
    fn = {"sum": xp.sum, "max": xp.max, "min": xp.min}[op]
    return fn(x, axis=axes, keepdims=True)


def allreduce_over_axes(grid: ProcessGrid, buf: Array, op: str, grid_axes: Sequence[int]) -> None:
    """Collective over the grid axes ``grid_axes``. All-reduce ``buf`` in place over the ranks
    that differ only along those axes (ranks along the other axes, replicas, are not combined):
    one call on the whole grid when that is every axis, else one per axis."""
    if len(grid_axes) == grid.ndim and grid.ndim > 1:
        C.allreduce(grid.comm, buf, op)
    else:
        for g in grid_axes:
            C.allreduce(grid.sub(g), buf, op)


def reduce_block(
    local: Array,
    grid: ProcessGrid,
    layout: Layout,
    op: str,
    axis: int | Sequence[int] | None = None,
    keepdims: bool = False,
) -> tuple[Array, Layout]:
    """Collective over the grid axes that split a reduced dim. Reduce a distributed tensor.

    Parameters
    ----------
    op : {"sum", "max", "min"}
    axis : int, sequence of int or None
        Tensor dims to reduce (None: all).
    keepdims : bool
        Keep reduced dims with size 1.

    Returns
    -------
    (array, Layout)
        The local block of the result and its layout: reduced dims are dropped (or size
        1) and no longer split, so the result is replicated along the grid axes that
        split them; other dims keep their split.

    A torch block that requires grad is reduced differentiably (backward: every rank's
    gradient of the replicated result flows to its own block; for max/min to the elements equal
    to the result, shared evenly among them, as ``torch.amax``); every rank must agree on it.

    Raises
    ------
    ValueError
        On an unknown op or bad axis.
    TypeError
        On max/min of a complex tensor.
    """
    if op not in REDUCTIONS:
        raise ValueError(f"op must be one of {REDUCTIONS}, got {op!r}")
    axes = normalize_axes(axis, layout.ndim)
    if op != "sum" and dtype_kind(local) == "c":  # the dtype is the same on every rank: all raise
        raise TypeError(f"{op} of a complex tensor is not defined (no ordering); reduce abs(x) or x.real instead")
    grad = needs_grad(local)  # (agreed by the caller: every rank takes the same path)
    grid_axes = [g for g in (layout.split[d] for d in axes) if g is not None]  # (ranks holding other parts)
    if grad and op == "sum":
        from .autograd import allreduce_sum  # (nn builds on this module)

        red = as_contiguous(_local_reduce(local, op, axes))
        red = allreduce_sum(red, grid, grid_axes) if grid_axes else red  # backward: the replicated gradient
    else:
        red = as_contiguous(_local_reduce(local.detach() if grad else local, op, axes))
        nan_aware = op != "sum" and dtype_kind(red) == "f" and bool(grid_axes)
        # MPI has no MAX/MIN for booleans (0/1 bytes order the same way) and drops NaNs (flagged)
        wire = _with_nan_flags(red, op) if nan_aware else _bool_as_uint8(red)
        allreduce_over_axes(grid, wire, op, grid_axes)
        if nan_aware:
            red = _nan_where_flagged(wire, tuple(red.shape))
        if grad:  # max/min: the gradient goes to the elements equal to the result, shared evenly (torch.amax)
            from .autograd import extreme

            red = extreme(local, red, axes, lambda count: allreduce_over_axes(grid, count, "sum", grid_axes))
    shape = tuple(1 if d in axes else n for d, n in enumerate(layout.global_shape))
    split = tuple(None if d in axes else s for d, s in enumerate(layout.split))
    cuts = tuple(None if d in axes else c for d, c in enumerate(layout.cuts))
    if not keepdims:
        keep = [d for d in range(layout.ndim) if d not in axes]
        shape = tuple(shape[d] for d in keep)
        split = tuple(split[d] for d in keep)
        cuts = tuple(cuts[d] for d in keep)
        red = red.reshape(tuple(red.shape[d] for d in keep))
    return red, Layout(shape, layout.grid_dims, split, cuts)
