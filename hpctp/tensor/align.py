"""The operands of an elementwise operation on DistTensors, each as a block that combines with
the result's block.

A tensor of the result's shape and split whose cuts differ (``u[1:]`` next to ``u[:-1]``) is
moved into the result's layout by one redistribution that carries only the rows between the
cuts (:func:`aligned`). A smaller tensor broadcasts against the larger one as numpy broadcasts
(:func:`broadcast_operand`): its dims of the larger one's size take that one's split and cuts,
its size-1 and missing dims are whole, so it is replicated along the grid axes dividing them;
when autograd records it, its gradient is summed over those axes (:func:`broadcast_scalar`).
:func:`check_partner` refuses tensors on another grid or with blocks of another backend.

These are functions of the operands' blocks, grids and layouts (:class:`Operand`: a
:class:`~hpctp.DistTensor` is one); :mod:`.core` builds its operators, ``x[key] = value`` and
``clip`` on them (:func:`hpctp.tensor.core.operand_block`), and the function modules use them
directly (``broadcast_to``, ``concatenate``/``stack``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from .. import comm as C
from .._util.backend import Array, backend_name, broadcasts_to, is_device, is_torch
from ..comm import ProcessGrid
from ..layout import Layout, Remap, moves_data
from ..ops.move import move_block
from ..ops.transfer import needs_grad

__all__ = ["Operand", "aligned", "broadcast_operand", "broadcast_scalar", "check_partner", "place"]


class Operand(Protocol):
    """Local. What the helpers of this module read of a tensor operand (a
    :class:`~hpctp.DistTensor` is one): this rank's block, the grid and the layout."""

    local: Array
    grid: ProcessGrid
    layout: Layout


def place(block: Array) -> str:
    """Local. Backend and memory of a block, as :meth:`~hpctp.DistTensor.to` names them.

    Parameters
    ----------
    block : numpy.ndarray, torch.Tensor or cupy.ndarray

    Returns
    -------
    str
        ``"numpy"``, ``"torch"`` (CPU), ``"cuda"`` (torch on a GPU) or ``"cupy"``.

    Raises
    ------
    TypeError
        If ``block`` is not an array of a supported backend.
    """
    name = backend_name(block)
    return "cuda" if name == "torch" and is_device(block) else name


def check_partner(x: Operand, other: Operand, op: str) -> None:
    """Local. Raise unless ``other`` is on ``x``'s grid (or a grid on its communicator) with
    blocks of ``x``'s backend and memory.

    Parameters
    ----------
    x, other : Operand
        The tensors that ``op`` combines.
    op : str
        The operation, for the messages (``"+"``, ``"concatenate"``).

    Raises
    ------
    ValueError
        If ``other`` is on another grid.
    TypeError
        If the blocks' backends or memories differ (the message names the ``.to`` call that
        converts).
    """
    if other.grid is not x.grid and other.grid.comm != x.grid.comm:
        raise ValueError(f"'{op}' needs tensors on the same ProcessGrid")
    mine, theirs = place(x.local), place(other.local)
    if theirs != mine:
        raise TypeError(f"'{op}' needs blocks of one backend, got {mine} and {theirs}; convert one with .to({mine!r})")


def broadcast_scalar(x: Operand, block: Array, dims: Iterable[int] | None = None) -> Array:
    """Collective over grid (in backward) when autograd records ``block`` and a grid axis
    dividing ``dims`` has more than one rank, else Local. ``block``, replicated along the grid
    axes that divide ``dims`` of ``x`` (all dims if None), made ready to broadcast against
    ``x``'s blocks there (a 0-d tensor's block, a profile along some dims).

    When autograd records ``block``, each rank's gradient of it covers only that rank's block
    of ``x``: backward sums them over those grid axes (:func:`hpctp.ops.autograd.sum_gradients`),
    as the blocks' sum would be in one process.

    Parameters
    ----------
    x : Operand
        The tensor whose blocks ``block`` broadcasts against.
    block : array
        The same on every rank along those grid axes.
    dims : iterable of int, optional
        The dims of ``x`` that ``block`` is whole (size 1 or missing) along.

    Returns
    -------
    array
        ``block`` itself, or (torch blocks that require grad) its identity whose backward
        sums the gradient.
    """
    dims = range(x.layout.ndim) if dims is None else dims
    axes = [g for g in (x.layout.split[d] for d in dims) if g is not None and x.grid.dims[g] > 1]
    if not axes or not needs_grad(block):
        return block
    from ..ops.autograd import sum_gradients  # (torch is loaded: the block is a torch tensor)

    return sum_gradients(block, x.grid, axes)


def aligned(grid: ProcessGrid, other: Operand, layout: Layout, op: str, remap: Remap = (), check: bool = True) -> Array:
    """Collective over grid where data moves (every rank sees the same layouts), else Local.
    ``other``'s block in ``layout`` on ``grid``, when the two differ only in their cuts (as
    ``u[1:]`` and ``u[:-1]`` do; any layout of ``other``'s shape without ``check``).

    One redistribution (with ``remap``) that moves the rows between the cuts, recorded by
    autograd for torch blocks that require grad (the ranks agree on ``requires_grad`` first,
    so that the backward moves pair up).

    Parameters
    ----------
    grid : ProcessGrid
        The grid of the tensor ``other`` combines with (``other`` is on it:
        :func:`check_partner`).
    other : Operand
    layout : Layout
        The target layout.
    op : str
        The operation, for the message and the agreement.
    remap : tuple of (bool, int), optional
        Flips and rolls applied in the same move (see :func:`hpctp.layout.redistribution_plan`).
    check : bool
        Require the same shape, grid dims and split (default); False accepts any layout of
        ``other``'s shape.

    Returns
    -------
    array
        This rank's block of ``other`` in ``layout``.

    Raises
    ------
    ValueError
        With ``check``, if the layouts differ in more than their cuts (naming
        ``redistribute``), or if ranks pass different ``requires_grad``.
    """
    src = other.layout
    if check and (src.global_shape, src.grid_dims, src.split) != (
        layout.global_shape,
        layout.grid_dims,
        layout.split,
    ):
        raise ValueError(
            f"'{op}' needs tensors with the same layout, got {layout} and {src}; call other.redistribute(x.layout) "
            f"first (tensors of one shape and split, cut differently, are aligned automatically)"
        )
    grad = needs_grad(other.local)
    if is_torch(other.local) and moves_data(src, layout, remap):  # (only torch blocks record moves;
        C.agree_arguments(grid.comm, op, None, requires_grad=grad)  # their backward moves must pair up)
    return move_block(other.local, grid, src, layout, grad, remap)


def broadcast_operand(x: Operand, other: Operand, op: str) -> Array:
    """Collective over grid when ``other`` must move into the layout that broadcasts against
    ``x``'s (one redistribution), else Local. ``other``'s block to broadcast against ``x``'s,
    as numpy broadcasts a smaller array.

    ``other``'s dims of ``x``'s size take ``x``'s split and cuts; its size-1 and missing dims
    are whole, so it is replicated along the grid axes dividing them (and, when autograd
    records it, its gradient is summed over those axes: :func:`broadcast_scalar`).

    Parameters
    ----------
    x : Operand
        The larger tensor, whose layout the result of ``op`` takes.
    other : Operand
        A tensor whose shape broadcasts to ``x``'s.
    op : str
        The operation, for the messages.

    Returns
    -------
    array
        This rank's block of ``other`` in that layout.

    Raises
    ------
    ValueError
        If ``other``'s shape does not broadcast to ``x``'s (numpy's rule, one way).
    """
    shape, oshape = x.layout.global_shape, other.layout.global_shape
    if not broadcasts_to(oshape, shape):
        raise ValueError(
            f"'{op}': a tensor of shape {oshape} does not broadcast against one of shape {shape} (numpy's rule, "
            f"one way: the smaller operand broadcasts against the larger one's layout)"
        )
    lead = len(shape) - len(oshape)
    same = [e for e, n in enumerate(oshape) if n == shape[e + lead]]
    target = Layout(
        oshape,
        x.layout.grid_dims,
        tuple(x.layout.split[e + lead] if e in same else None for e in range(len(oshape))),
        tuple(x.layout.cuts[e + lead] if e in same else None for e in range(len(oshape))),
    )
    block = other.local if other.layout == target else aligned(x.grid, other, target, op, check=False)
    return broadcast_scalar(x, block, [d for d in range(len(shape)) if d - lead not in same])
