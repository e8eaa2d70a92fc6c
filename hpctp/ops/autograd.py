"""Autograd-aware collectives: the communication building blocks of distributed layers.

Two kinds of tensors meet in a spatially partitioned network:

* **partitioned** tensors (field blocks) whose gradient on a rank is the gradient of its
  own block, and
* **replicated** tensors (a loss value, a channel mean) held identically by every rank.

A replicated tensor's gradient can arrive in two forms. If every rank computes the same
thing from it (a loss scalar on which every rank calls ``backward()``), each rank already
holds the *full* gradient. If it feeds partitioned work (a mean subtracted from every
block), each rank holds only its block's *partial* gradient and the full gradient is
their sum. The two functions below are each other's adjoint and cover both cases:

=====================  ===================  =======================
function               forward              backward
=====================  ===================  =======================
:func:`allreduce_sum`  sum over ranks       identity
:func:`sum_gradients`  identity             sum over ranks
=====================  ===================  =======================

``sum_gradients(allreduce_sum(x))`` (sum forward and backward) turns partial sums into a
replicated value that then feeds partitioned work again (e.g. normalisation statistics).

``axes`` selects the grid axes along which ranks hold *different* data (default: all);
ranks along the remaining axes hold replicas and are not summed over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from mpi4py import MPI

from .. import comm as C
from .._util.ints import is_int
from ..comm import ProcessGrid, check_grid
from ..layout import Layout, Remap, check_remap, inverse_remap
from .transfer import redistribute_block

__all__ = [
    "allreduce_sum",
    "sum_gradients",
    "redistribute",
    "comms_for_axes",
    "normalize_axes",
    "AllReduceSum",
    "SumGradients",
    "Redistribute",
    "extreme",
]

Comms = tuple[MPI.Intracomm, ...]


def normalize_axes(grid: ProcessGrid, axes: Sequence[int] | None) -> tuple[int, ...]:
    """Local. Validate grid ``axes`` (None: every axis) and return them sorted.

    Parameters
    ----------
    grid : ProcessGrid
    axes : sequence of int or None
        Grid axes along which ranks hold different parts of the data.

    Returns
    -------
    tuple of int

    Raises
    ------
    ValueError
        If an axis is out of range or repeated.
    """
    if axes is None:
        return tuple(range(grid.ndim))
    if is_int(axes):
        axes = (int(axes),)
    out: list[int] = []
    for a in axes:
        if not is_int(a) or not 0 <= a < grid.ndim:
            raise ValueError(f"axes entry {a!r} is not an axis of a {grid.ndim}-D grid (0..{grid.ndim - 1})")
        if a in out:
            raise ValueError(f"axes={tuple(axes)} repeats grid axis {a}")
        out.append(int(a))
    return tuple(sorted(out))


def comms_for_axes(grid: ProcessGrid, axes: Sequence[int] | None) -> Comms:
    """Local. Communicators whose successive all-reduces sum over the grid ``axes``.

    The whole grid communicator when ``axes`` covers every grid axis (one call), else one
    sub-communicator per axis; communicators of a single rank are left out.

    Parameters
    ----------
    grid : ProcessGrid
    axes : sequence of int or None
        Grid axes to reduce over (None: all).

    Returns
    -------
    tuple of mpi4py.MPI.Intracomm
    """
    axes = normalize_axes(grid, axes)
    if grid.size == 1:
        return ()
    if len(axes) == grid.ndim:
        return (grid.comm,)
    return tuple(grid.sub(a) for a in axes if grid.dims[a] > 1)


def _contiguous_copy(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x.detach())


def reduce_sum_(buf: torch.Tensor, comms: Comms) -> torch.Tensor:
    """Collective over grid. Sum a contiguous tensor in place over each of ``comms`` in turn."""
    for c in comms:
        C.allreduce(c, buf, "sum")
    return buf


class AllReduceSum(torch.autograd.Function):
    """Collective over grid. Autograd node: forward sums over ranks, backward is the identity.

    Use through :func:`allreduce_sum`.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comms: Comms) -> torch.Tensor:  # type: ignore[override]
        return reduce_sum_(_contiguous_copy(x), comms)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class SumGradients(torch.autograd.Function):
    """Collective over grid. Autograd node: identity forward, backward sums over ranks.

    Use through :func:`sum_gradients`.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comms: Comms) -> torch.Tensor:  # type: ignore[override]
        ctx.comms = comms
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return reduce_sum_(_contiguous_copy(grad), ctx.comms), None


def allreduce_sum(x: torch.Tensor, grid: ProcessGrid, axes: Sequence[int] | None = None) -> torch.Tensor:
    """Collective over grid. Sum ``x`` over the ranks (replicated result); identity backward.

    Every rank then holds the same value. The backward pass passes the incoming gradient
    through unchanged, which is exact when every rank goes on to compute the same
    function of the result (a global loss on which every rank calls ``backward()``).

    Parameters
    ----------
    x : torch.Tensor
        Same shape and dtype on every rank.
    grid : ProcessGrid
    axes : sequence of int, optional
        Grid axes to sum over (default: all); ranks along other axes hold replicas.

    Returns
    -------
    torch.Tensor
        The sum, a new tensor.

    Raises
    ------
    TypeError
        If ``grid`` is not a ProcessGrid or ``x`` not a tensor.
    ValueError
        If ``axes`` is invalid.
    """
    return AllReduceSum.apply(x, _tensor_comms(x, grid, axes))


def sum_gradients(x: torch.Tensor, grid: ProcessGrid, axes: Sequence[int] | None = None) -> torch.Tensor:
    """Collective over grid. Identity forward (local); the backward sums the gradient over ranks.

    The adjoint of :func:`allreduce_sum`: use it where a replicated tensor enters
    partitioned computation, so that its partial gradients are summed.

    Parameters
    ----------
    x : torch.Tensor
        Replicated tensor (same value on every rank).
    grid : ProcessGrid
    axes : sequence of int, optional
        Grid axes to sum the gradient over (default: all).

    Returns
    -------
    torch.Tensor
        A view of ``x``.

    Raises
    ------
    TypeError
        If ``grid`` is not a ProcessGrid or ``x`` not a tensor.
    ValueError
        If ``axes`` is invalid.
    """
    return SumGradients.apply(x, _tensor_comms(x, grid, axes))


def _tensor_comms(x: object, grid: ProcessGrid, axes: Sequence[int] | None) -> Comms:
    """The sub-communicators of ``axes``, once ``grid`` and ``x`` are checked (the two adjoint collectives' checks)."""
    check_grid(grid)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    return comms_for_axes(grid, axes)


class Redistribute(torch.autograd.Function):
    """Collective over grid. Autograd node: move a block from ``src`` to ``dst`` (flipping or
    rolling dims by ``remap``, see :func:`hpctp.layout.redistribution_plan`); backward moves
    the gradient back and undoes the remap (the adjoint of a permutation is its inverse).

    Use through :func:`redistribute`.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, grid: ProcessGrid, src: Layout, dst: Layout, remap: Remap = ()
    ) -> torch.Tensor:
        ctx.grid, ctx.src, ctx.dst, ctx.back = grid, src, dst, inverse_remap(check_remap(remap, src.global_shape))
        return redistribute_block(x.detach(), grid, src, dst, remap)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return redistribute_block(grad.contiguous(), ctx.grid, ctx.dst, ctx.src, ctx.back), None, None, None, None


def redistribute(x: torch.Tensor, grid: ProcessGrid, src: Layout, dst: Layout) -> torch.Tensor:
    """Collective over grid. Differentiable redistribution of a block from layout ``src`` to ``dst``.

    The backward pass moves the gradient from ``dst`` back to ``src`` (the adjoint of a
    permutation of elements is its inverse).

    Parameters
    ----------
    x : torch.Tensor
        This rank's block of ``src``.
    grid : ProcessGrid
    src, dst : Layout
        Layouts of one global tensor on ``grid``.

    Returns
    -------
    torch.Tensor
        This rank's block of ``dst``.

    Raises
    ------
    ValueError
        If the layouts do not describe the same tensor on ``grid``, or ``x`` does not
        have the shape ``src`` expects on this rank (the latter checked collectively).
    """
    check_grid(grid)
    if src.global_shape != dst.global_shape or src.grid_dims != grid.dims or dst.grid_dims != grid.dims:
        raise ValueError(f"cannot redistribute from {src} to {dst} on a grid of dims {grid.dims}")
    err = None
    try:
        src.check_block(x.shape, grid.dims, grid.coords, "redistribute: block")
    except ValueError as e:
        err = e
    C.raise_if_any(grid.comm, err)
    return Redistribute.apply(x.contiguous(), grid, src, dst)


# ---------------------------------------------------------------- max/min
# The gradient of a distributed ``max``/``min``: torch's ``amax``/``amin`` rule, across ranks.
#
# The value is reduced without autograd (``hpctp.ops.reduce``). Its gradient flows to every element
# that equals it, shared evenly among them, as ``torch.amax`` shares it among ties; the ties are
# counted over the whole tensor (one all-reduce of the counts), so an element's share does not
# depend on how the tensor is cut. As for :func:`~hpctp.ops.autograd.allreduce_sum`, each rank
# receives the gradient of the replicated result (a global loss on which every rank calls
# ``backward()``) and keeps only its own elements' shares.


class _Extreme(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, block: torch.Tensor, value: torch.Tensor, hit: torch.Tensor, count: torch.Tensor) -> Any:
        ctx.save_for_backward(hit, count)
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        hit, count = ctx.saved_tensors
        share = grad / count.clamp(min=1).to(grad.dtype)  # (a reduced extent with no element: no share)
        return hit.to(grad.dtype) * share, None, None, None


def extreme(
    block: torch.Tensor, value: torch.Tensor, axes: tuple[int, ...], sum_over_ranks: Callable[[torch.Tensor], None]
) -> torch.Tensor:
    """Collective where ``sum_over_ranks`` communicates. ``value`` (the reduced max/min of the
    distributed tensor, with kept dims, the same on the ranks that share it) as the differentiable
    result of ``block``: backward gives each element equal to it (NaN counting as equal to a NaN)
    its share of the gradient.

    Parameters
    ----------
    block : torch.Tensor
        This rank's block, which requires grad.
    value : torch.Tensor
        The reduction over ``axes`` with kept dims (broadcasts against ``block``).
    axes : tuple of int
        The reduced dims of the block.
    sum_over_ranks : callable
        Sums an int64 tensor in place over the ranks that hold other parts of the reduced dims.

    Returns
    -------
    torch.Tensor
        ``value``, recorded by autograd.
    """
    x = block.detach()
    hit = (x == value) | (torch.isnan(x) & torch.isnan(value))
    count = hit.to(torch.int64).sum(dim=axes, keepdim=True) if axes else hit.to(torch.int64)
    count = count.contiguous()
    sum_over_ranks(count)
    return _Extreme.apply(block, value, hit, count)  # type: ignore[no-any-return]
