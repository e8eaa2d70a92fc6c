"""A stage boundary that changes a field's layout: the redistribution fused into the pipeline's send (pure layout math).

When the next stage starts with :class:`hpctp.nn.Redistribute` (another split of the field, or another shape of the
same model ranks), the previous stage does not send its block to its counterpart for the next stage to move it
again: each rank sends every piece of its block straight to the rank of the next stage that keeps it under the new
layout, one message per piece, and the next stage's first layer then has nothing to do. Backward moves the
gradient's pieces the opposite way. :func:`boundary_moves` lists, for one rank of the model grid, the pieces it sends
and receives, as :func:`hpctp.layout.redistribution_plan` cuts them (the ranks of both layouts are the model grid's,
in row-major order); a piece that stays on the same model rank is a message too, to the counterpart on the other
stage. The lists are in the order both sides of each pair of ranks use, so messages of one tag match in order.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...layout import Layout, grid_coords, redistribution_plan

__all__ = ["Move", "boundary_moves"]

Piece = tuple[int, tuple[slice, ...], tuple[tuple[int, int], ...]]


@dataclass(frozen=True)
class Move:
    """Local. What one model rank sends and receives to move a block from ``src`` to ``dst`` across a boundary.

    ``sends``: ``(peer model rank, slices of this rank's src block, global box)``; ``recvs``: ``(peer model rank,
    slices of this rank's dst block, global box)``, the peers being the other stage's ranks of those model
    coordinates, the box the piece's global ``(start, stop)`` ranges.
    """

    src: Layout
    dst: Layout
    sends: tuple[Piece, ...]
    recvs: tuple[Piece, ...]


def boundary_moves(src: Layout, dst: Layout, rank: int) -> tuple[Move, Move]:
    """Local. The forward move (``src`` to ``dst``) and the backward one (the gradient, ``dst`` to ``src``) of ``rank``.

    Parameters
    ----------
    src, dst : Layout
        The sending stage's layout and the receiving stage's, of one global shape on model grids of the same ranks
        (their shapes may differ).
    rank : int
        This rank's row-major rank on the model grid.

    Raises
    ------
    ValueError
        If the layouts describe different tensors or grids of different sizes.
    """
    return _move(src, dst, rank), _move(dst, src, rank)


def _move(src: Layout, dst: Layout, rank: int) -> Move:
    out = redistribution_plan(src, dst, rank)  # (pieces in (peer, box) order on both sides of a pair)
    mine = src.local_ranges(grid_coords(rank, src.grid_dims))
    kept = [tuple((lo + s.start, lo + s.stop) for (lo, _), s in zip(mine, a)) for a, _ in out.local]
    sends = [(p.peer, p.slices, p.box) for p in out.sends] + [(rank, a, k) for (a, _), k in zip(out.local, kept)]
    recvs = [(p.peer, p.slices, p.box) for p in out.recvs] + [(rank, b, k) for (_, b), k in zip(out.local, kept)]
    return Move(src, dst, tuple(sends), tuple(recvs))
