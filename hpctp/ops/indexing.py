"""``x[key]`` and ``x[key] = value`` on the blocks of a distributed tensor.

The block math is :mod:`hpctp.layout.indexing`; here each rank applies its share of a plan to
its own block, with one redistribution when an int selects along a divided dim.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from .._util.backend import Array, backend_name, broadcasts_to, flip, from_numpy, is_device, is_torch, to_numpy
from ..comm import ProcessGrid
from ..layout.indexing import IndexPlan
from .move import move_block

__all__ = ["take_block", "put_block", "value_block"]


def take_block(local: Array, grid: ProcessGrid, plan: IndexPlan, grad: bool) -> Array:
    """Collective over grid when ``plan.moves`` (then with the same ``grad`` on every rank), else
    Local. This rank's block of ``x[key]``: a view of ``local`` when nothing moves or is
    reversed (reversed numpy and cupy blocks are views too).

    Parameters
    ----------
    local : array
        This rank's block of ``plan.source``.
    grid : ProcessGrid
    plan : IndexPlan
    grad : bool
        Record the move for autograd (torch blocks that require grad).

    Returns
    -------
    array
        This rank's block of ``plan.result``, same backend and device.
    """
    block = local[plan.local_key(grid.coords)]
    if plan.moves:
        block = move_block(block, grid, plan.sliced, plan.gathered, grad, plan.remap)
    else:
        block = flip(block, plan.reverse)
    return block.reshape(plan.result.local_shape(grid.coords))


def _like(v: Any, local: Array) -> Any:
    """``v`` on ``local``'s backend and device (values pass through when they already are)."""
    if backend_name(v) == backend_name(local) and (not is_device(local) or v.device == local.device):
        return v
    if is_torch(v) and is_torch(local):
        return v.to(local.device)
    return from_numpy(to_numpy(v), local)


def value_block(value: Array, plan: IndexPlan, coords: tuple[int, ...]) -> Array:
    """Local. This rank's part of a global ``value`` broadcastable to ``x[key]``'s shape, shaped
    for ``local[plan.local_key(coords)] = part`` (size-1 dims broadcast on assignment).

    Raises
    ------
    ValueError
        If ``value`` does not broadcast to the selection's shape (numpy's rule).
    """
    want = plan.result.global_shape
    shape = tuple(int(s) for s in value.shape)
    if not broadcasts_to(shape, want):
        raise ValueError(f"could not broadcast a value of shape {shape} into x[key] of shape {want}")
    v = flip(value.reshape((1,) * (len(want) - len(shape)) + shape), plan.result_reverse)
    ranges = plan.result.local_ranges(coords)
    v = v[tuple(slice(None) if n == 1 else slice(a, b) for n, (a, b) in zip(v.shape, ranges))]
    return _to_selection(v, plan, coords)


def _to_selection(v: Array, plan: IndexPlan, coords: tuple[int, ...]) -> Array:
    """A result-shaped part ``v`` with the new dims removed and the int dims back (size 1, or 0
    on the ranks whose block does not hold the index)."""
    inner = [n for i, n in enumerate(v.shape) if i not in plan.insert]
    sizes = iter(inner)
    shape = [1 if d in plan.drop else next(sizes) for d in range(plan.sliced.ndim)]
    v = v.reshape(tuple(shape))
    have = plan.sliced.local_shape(coords)
    return v[tuple(slice(0, h) if d in plan.drop else slice(None) for d, h in enumerate(have))]


def put_block(local: Array, plan: IndexPlan, coords: tuple[int, ...], value: Any, kind: str) -> None:
    """Local. ``local``'s share of ``x[key] = value``.

    Parameters
    ----------
    local : array
        This rank's block of ``plan.source``, written in place.
    plan : IndexPlan
    coords : tuple of int
        This rank's grid coordinates.
    value : scalar or array
        ``kind`` says which: ``"scalar"`` (a number or 0-d block), ``"block"`` (this rank's
        block of a tensor in layout ``plan.result``) or ``"global"`` (the whole value,
        broadcastable to ``plan.result.global_shape``, the same on every rank).
    kind : str
    """
    key = plan.local_key(coords)
    if kind == "scalar":
        local[key] = value if isinstance(value, (numbers.Number, np.generic)) else _like(value, local)
        return
    part = _to_selection(value, plan, coords) if kind == "block" else value_block(value, plan, coords)
    local[key] = _like(part, local)
