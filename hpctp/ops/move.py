"""Moving a block between layouts, recorded by autograd when the block needs it.

:func:`move_block` picks between the plain move (:func:`hpctp.ops.transfer.redistribute_block`)
and the autograd node :class:`hpctp.ops.autograd.Redistribute`; the latter's module imports torch,
so it is loaded only when a torch block that requires grad moves.
"""

from __future__ import annotations

from .._util.backend import Array
from ..comm import ProcessGrid
from ..layout import Layout, Remap
from .transfer import redistribute_block

__all__ = ["move_block"]


def move_block(block: Array, grid: ProcessGrid, src: Layout, dst: Layout, grad: bool, remap: Remap = ()) -> Array:
    """Collective over grid when data moves between ranks, else Local. :func:`redistribute_block`,
    differentiable when ``grad``.

    With ``grad`` (see :func:`needs_grad`; every rank must pass the same) the move is the
    autograd node :class:`hpctp.ops.autograd.Redistribute`, whose backward moves the
    gradient back from ``dst`` to ``src`` (undoing ``remap``).
    """
    if not grad:
        return redistribute_block(block, grid, src, dst, remap)
    from .autograd import Redistribute  # (imports torch: loaded only for blocks that need autograd)

    return Redistribute.apply(block.contiguous(), grid, src, dst, remap)  # type: ignore[union-attr]
