"""Collective inference of the layout of plain local blocks (one small allgather)."""

from __future__ import annotations

import itertools

from .. import comm as C
from ..comm import ProcessGrid
from ..layout import Layout, grid_coords, normalize_split

__all__ = ["infer_layout"]

_MAX_NDIM = 8


def infer_layout(shape: tuple[int, ...], grid: ProcessGrid, split: object) -> Layout:
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

    Returns
    -------
    Layout

    Raises
    ------
    ValueError
        On every rank, if the blocks do not tile a global tensor or ``split`` is invalid.
    """
    shape = tuple(int(s) for s in shape)
    info = [len(shape) if len(shape) <= _MAX_NDIM else -1] + list(shape[:_MAX_NDIM])
    info += [0] * (1 + _MAX_NDIM - len(info))
    table = C.allgather_ints(grid.comm, info)
    ndims = set(table[:, 0].tolist())
    if len(ndims) != 1 or -1 in ndims:
        raise ValueError(
            f"local blocks have different or too many dims on different ranks: {sorted(ndims)} (at most {_MAX_NDIM})"
        )
    ndim = ndims.pop()
    sp = normalize_split(split, ndim, grid.ndim)
    shapes = [tuple(int(v) for v in row[1 : 1 + ndim]) for row in table]
    gshape: list[int] = []
    cuts: list[tuple[int, ...] | None] = []
    for d in range(ndim):
        g = sp[d]
        if g is None:
            sizes = {s[d] for s in shapes}
            if len(sizes) != 1:
                raise ValueError(f"dim {d} is not split but its local size differs between ranks: {sorted(sizes)}")
            gshape.append(sizes.pop())
            cuts.append(None)
            continue
        per = [set() for _ in range(grid.dims[g])]  # type: list[set[int]]
        for r, s in enumerate(shapes):
            per[grid_coords(r, grid.dims)[g]].add(s[d])
        if any(len(p) != 1 for p in per):
            raise ValueError(
                f"blocks do not tile: dim {d} is split over grid axis {g} but ranks at one "
                f"coordinate of that axis disagree on its size: {[sorted(p) for p in per]}"
            )
        c = tuple(itertools.accumulate([next(iter(p)) for p in per], initial=0))
        cuts.append(c)
        gshape.append(c[-1])
    return Layout(tuple(gshape), grid.dims, sp, tuple(cuts))
