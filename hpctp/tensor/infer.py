"""Collective inference of the layout of plain local blocks (one small allgather)."""

from __future__ import annotations

from .. import comm as C
from ..comm import ProcessGrid
from ..layout import Layout, tiled_layout

__all__ = ["infer_layout"]

_MAX_NDIM = 8


def infer_layout(shape: tuple[int, ...], grid: ProcessGrid, split: object, error: Exception | None = None) -> Layout:
    """Collective over grid. The layout tiled by every rank's local block ``shape``.

    Costs one ``Allgather`` of ``1 + 8`` int64 per rank. Blocks may be uneven; ranks that
    share a coordinate of a split grid axis must agree on that dim's size.

    Parameters
    ----------
    shape : tuple of int
        This rank's local block shape.
    grid : ProcessGrid
    split : split specification
        Grid axis per dim (see :func:`hpctp.layout.normalize_split`).
    error : Exception, optional
        A failed local check of the caller's: raised on every rank (the lowest failing
        rank's, as :func:`hpctp.comm.raise_if_any`) instead of inferring, in the same call.

    Returns
    -------
    Layout

    Raises
    ------
    ValueError
        On every rank, if the blocks do not tile a global tensor or ``split`` is invalid.
    Exception
        ``error`` of the lowest failing rank, on every rank.
    """
    shape = tuple(int(s) for s in shape)
    ndim = -2 if error is not None else len(shape) if len(shape) <= _MAX_NDIM else -1
    info = [ndim] + list(shape[:_MAX_NDIM]) + [0] * (_MAX_NDIM - min(len(shape), _MAX_NDIM))
    table = C.allgather_ints(grid.comm, info)
    ndims = set(table[:, 0].tolist())
    if -2 in ndims:
        C.raise_if_any(grid.comm, error)  # every rank saw the flag: every rank enters
    if len(ndims) != 1 or -1 in ndims:
        raise ValueError(
            f"local blocks have different or too many dims on different ranks: {sorted(ndims)} (at most {_MAX_NDIM})"
        )
    ndim = ndims.pop()
    return tiled_layout([row[1 : 1 + ndim] for row in table.tolist()], grid.dims, split)
