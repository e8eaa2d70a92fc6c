"""Layouts for the tests: balanced or skewed blocks on a grid, and a hypothesis strategy of layouts."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

import hpctp
from hpctp.layout import Layout, block_cuts


def skewed_cuts(n: int, parts: int) -> tuple[int, ...]:
    """Local. Uneven cuts: a 1-cell first block (when possible), the rest balanced."""
    if parts == 1 or n < parts:
        return block_cuts(n, parts)
    rest = block_cuts(n - 1, parts - 1)
    return (0,) + tuple(1 + c for c in rest)


def make_layout(grid: hpctp.ProcessGrid, shape: Sequence[int], split: Sequence[int | None], skew: bool) -> Layout:
    """Local. ``shape`` divided over ``grid`` as ``split`` says: balanced blocks, or skewed ones
    (:func:`skewed_cuts`) if ``skew``."""
    cuts = None
    if skew:
        cuts = tuple(None if g is None else skewed_cuts(n, grid.dims[g]) for n, g in zip(shape, split))
    return Layout(tuple(shape), grid.dims, tuple(split), cuts or ())


@st.composite
def layouts(draw: st.DrawFn, max_ranks: int = 12) -> Layout:
    """Hypothesis strategy: a layout of 0-3 dims (0-9 long) on a grid of 1-3 axes (1-4 long), balanced blocks."""
    gdims = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    axes = draw(st.permutations(list(range(len(gdims))) + [None] * ndim))
    return Layout(shape, gdims, tuple(axes[:ndim]))
