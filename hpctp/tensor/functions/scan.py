"""Cumulative sums and products along a dim: ``cumsum`` and ``cumprod`` (numpy semantics).

Each rank scans its block with its backend's own ``cumsum``/``cumprod``. Along a divided dim
the blocks before it contribute an offset: every block's total (its sum or product along the
dim) is gathered along that grid axis (one move of one hyperplane per block), and each rank
combines the totals of the blocks before its own, in order. The result keeps the input's
layout. For torch blocks every step is recorded by autograd (the gathered totals' gradients
are summed over the ranks that used them).

Sums are associated per block (the block's scan, then the offset), so results equal numpy's
sequential ones to rounding, not to the bit.
"""

from __future__ import annotations

from typing import Any

from ... import comm as C
from ..._util.backend import Array, array_module, is_torch
from ..._util.ints import is_int
from ...layout import Layout
from ...ops.move import move_block
from ...ops.reduce import ordered_axes
from ...ops.transfer import needs_grad
from ..core import DistTensor
from ..registry import register

__all__ = ["cumsum", "cumprod"]


def _local(block: Array, op: str, axis: int) -> Array:
    if is_torch(block):
        import torch  # (loaded: the block is a torch tensor)

        return getattr(torch, op)(block, dim=axis)
    return getattr(array_module(block), op)(block, axis=axis)


def _total(block: Array, op: str, axis: int) -> Array:
    """The block's sum or product along ``axis``, with the dim kept (0 or 1 for an empty block)."""
    if is_torch(block):
        import torch

        if op == "cumsum":
            return torch.sum(block, dim=axis, keepdim=True)
        return torch.prod(block, dim=axis, keepdim=True)
    xp = array_module(block)
    return (xp.sum if op == "cumsum" else xp.prod)(block, axis=axis, keepdims=True)


def _before(totals: Array, op: str, axis: int, k: int) -> Array:
    """The sum or product of the first ``k`` totals along ``axis`` (dim kept), in order."""
    key = tuple(slice(0, k) if d == axis else slice(None) for d in range(totals.ndim))
    return _total(totals[key], op, axis)


def _scan(x: DistTensor, op: str, axis: object, dtype: object) -> DistTensor:
    what = op
    error: Exception | None = None
    d = 0
    try:
        if axis is None:
            if x.ndim != 1:
                raise ValueError(
                    f"{what}(axis=None) scans the flattened array, which a partitioned {x.ndim}-D tensor does not "
                    f"have; give an int axis"
                )
            axis = 0
        if not is_int(axis):
            raise TypeError(f"{what} takes an int axis or None, got {axis!r}")
        d = ordered_axes(int(axis), x.ndim)[0]  # type: ignore[call-overload]
    except (TypeError, ValueError) as e:
        error = e
    g = x.split[d] if error is None else None
    divided = g is not None and x.grid.dims[g] > 1
    if x.grid.size > 1:  # (ranks scanning along different dims would pair different moves)
        C.agree_arguments(x.grid.comm, what, error, axis=axis, dtype=dtype, requires_grad=needs_grad(x.local))
    elif error is not None:
        raise error
    if dtype is not None:
        x = x.astype(dtype)
    out = _local(x.local, op, d)
    if not divided:
        return x.with_local(out)
    # every block's total, one per block along dim d, gathered along grid axis g
    parts = x.grid.dims[g]  # type: ignore[index]
    shape = tuple(parts if e == d else n for e, n in enumerate(x.global_shape))
    cuts = tuple(None if e == d else c for e, c in enumerate(x.layout.cuts))
    src = Layout(shape, x.grid.dims, x.split, cuts)
    dst = Layout(shape, x.grid.dims, tuple(None if e == d else s for e, s in enumerate(x.split)), cuts)
    total = _total(x.local, op, d)
    grad = needs_grad(total)
    totals: Any = move_block(total, x.grid, src, dst, grad)
    if grad:  # each rank uses some of the gathered totals: their gradients add up over the axis
        from ...ops.autograd import sum_gradients  # (nn builds on this module)

        totals = sum_gradients(totals, x.grid, [g])  # type: ignore[list-item]
    offset = _before(totals, op, d, x.grid.coords[g])  # type: ignore[index]
    return x.with_local(out + offset if op == "cumsum" else out * offset)


@register("cumsum")
def cumsum(x: DistTensor, axis: int | None = None, dtype: object = None) -> DistTensor:
    """Collective over grid (on more than one rank). The cumulative sum along ``axis``, as
    ``numpy.cumsum`` (also ``np.cumsum(x, axis)``, ``x.cumsum(axis)``, ``torch.cumsum(x, dim)``).

    The result keeps ``x``'s layout. Along a divided dim each block adds the sum of the blocks
    before it (one gather of the blocks' totals along that grid axis). Differentiable for
    torch blocks.

    Parameters
    ----------
    x : DistTensor
    axis : int or None
        The dim; None only for a 1-D tensor (numpy's flattened scan).
    dtype : dtype, optional
        Convert the blocks first (numpy accumulates in ``dtype``). Ints and bools are
        summed in the backend's accumulating integer type, as numpy and torch do.

    Returns
    -------
    DistTensor

    Raises
    ------
    TypeError
        If ``axis`` is not an int (or None).
    ValueError
        If ``axis`` is out of range, None for a tensor of more than one dim, or ranks pass
        different arguments.
    """
    return _scan(x, "cumsum", axis, dtype)


@register("cumprod")
def cumprod(x: DistTensor, axis: int | None = None, dtype: object = None) -> DistTensor:
    """Collective over grid (on more than one rank). The cumulative product along ``axis``, as
    ``numpy.cumprod`` (also ``np.cumprod``, ``x.cumprod``, ``torch.cumprod``); each block
    multiplies by the product of the blocks before it. Arguments, result and errors as
    :func:`cumsum`."""
    return _scan(x, "cumprod", axis, dtype)
