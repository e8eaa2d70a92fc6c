"""The layout that given block shapes tile: uneven decompositions a caller already holds (pure)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from .layout import Layout, grid_coords, normalize_split

__all__ = ["tiled_layout"]


def tiled_layout(shapes: Sequence[Sequence[int]], grid_dims: Sequence[int], split: object, prefix: str = "") -> Layout:
    """Local. The layout tiled by blocks of ``shapes``, one per grid rank (row-major).

    A split dim's block sizes may be uneven; ranks that share a coordinate of its grid axis
    must agree on them. An undivided dim has one size everywhere.

    Parameters
    ----------
    shapes : sequence of sequence of int
        Every rank's block shape, in rank order (all of one length).
    grid_dims : sequence of int
    split : split specification
        Grid axis per dim (see :func:`normalize_split`).
    prefix : str
        Put before each message (e.g. ``"from_local: "``).

    Returns
    -------
    Layout
        With the cuts the blocks imply.

    Raises
    ------
    ValueError
        If the blocks do not tile one global tensor, or ``split`` is invalid.
    """
    dims = tuple(int(g) for g in grid_dims)
    ndim = len(shapes[0]) if shapes else 0
    sp = normalize_split(split, ndim, len(dims))
    gshape: list[int] = []
    cuts: list[tuple[int, ...] | None] = []
    for d in range(ndim):
        g = sp[d]
        if g is None:
            sizes = {int(s[d]) for s in shapes}
            if len(sizes) != 1:
                raise ValueError(
                    f"{prefix}dim {d} is not split but its local size differs between ranks: {sorted(sizes)}"
                )
            gshape.append(sizes.pop())
            cuts.append(None)
            continue
        per: list[set[int]] = [set() for _ in range(dims[g])]
        for r, s in enumerate(shapes):
            per[grid_coords(r, dims)[g]].add(int(s[d]))
        for c, found in enumerate(per):
            if len(found) != 1:
                raise ValueError(
                    f"{prefix}blocks do not tile: dim {d} is split over grid axis {g}, but ranks at coordinate {c} "
                    f"of that axis have different sizes {sorted(found)} in dim {d}"
                )
        dim_cuts = tuple(itertools.accumulate([next(iter(p)) for p in per], initial=0))
        cuts.append(dim_cuts)
        gshape.append(dim_cuts[-1])
    return Layout(tuple(gshape), dims, sp, tuple(cuts))
