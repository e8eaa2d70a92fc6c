"""Pencil plans for distributed FFTs: which layout each 1-D transform runs in (pure, no MPI).

A 1-D FFT along a tensor dim needs that dim whole on every rank. When the grid divides
it, its grid axis is moved to another dim that is not divided (one all-to-all); the
classic pencil FFT of a 3-D field on a 2-D grid is the special case. The plan picks the
order of the transforms (undivided dims first: they cost nothing) and, for each move, the
dim that takes the grid axis: one already transformed, else one that is not transformed
at all (batch, channels), else one still to be transformed; the largest of them, so
blocks stay balanced.

When every dim is divided (a 2-D field on a 2-D grid, a 3-D field on a 3-D grid), no dim
can take the grid axis. The plan then merges it with a neighbouring grid axis, which keeps
the ranks' row-major order: on the merged grid one dim is divided over both axes' ranks
(slabs) and the other becomes whole. The steps from there run on that grid shape
(:attr:`FFTStep.grid_dims`); the tensor moves back to the caller's grid at the end. The dim
that held the outer of the two axes takes the merged one, cut nested (:func:`step_layout`:
each of its blocks into equal parts), so that first move stays within lines of the inner
axis; the dim that held the inner axis, now whole, is transformed first.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from .._util.ints import is_int
from ..layout import Layout, block_cuts
from ..ops.reduce import ordered_axes

__all__ = ["FFTStep", "fft_plan", "normalize_fft_axes", "step_layout"]


@dataclass(frozen=True)
class FFTStep:
    """Local. One 1-D transform along ``axis``, run with the tensor split as ``split``.

    ``grid_dims`` is None when the step runs on the tensor's own grid, else the shape of the
    merged grid (same ranks, row-major) that ``split`` refers to.
    """

    axis: int
    split: tuple[int | None, ...]
    grid_dims: tuple[int, ...] | None = None


def normalize_fft_axes(axes: object, ndim: int) -> tuple[int, ...]:
    """Local. ``axes`` (None: every dim; an int; a sequence) as distinct dims in ``0..ndim-1``,
    in the order given; negative entries count from the end, as numpy's.

    Raises
    ------
    ValueError
        If an axis is out of range or repeated, or there is none.
    TypeError
        If an entry is not an int, or ``axes`` is not a sequence.
    """
    if axes is not None and not is_int(axes) and not isinstance(axes, Iterable):
        raise TypeError(f"axes must be None, an int or a sequence of ints, got {type(axes).__name__}")
    out = ordered_axes(cast(Any, axes), ndim)
    if not out:
        raise ValueError("axes is empty: name at least one dim to transform")
    return out


def fft_plan(
    split: Sequence[int | None],
    shape: Sequence[int],
    grid_dims: Sequence[int],
    axes: Sequence[int],
    first: int | None = None,
    last: int | None = None,
) -> tuple[FFTStep, ...]:
    """Local. The 1-D transforms of an n-D FFT over ``axes`` and the split each one runs in.

    Cached: the same arguments return the same plan without recomputing it.

    Parameters
    ----------
    split : sequence of (int or None)
        The tensor's split (grid axis per dim) before the transform.
    shape : sequence of int
        Its global shape (the larger of two candidate dims takes a moved grid axis).
    grid_dims : sequence of int
        The grid's shape (a dim split over a grid axis of size 1 is whole already).
    axes : sequence of int
        Distinct dims to transform (see :func:`normalize_fft_axes`).
    first, last : int, optional
        A dim of ``axes`` that must be transformed first (``rfftn``'s half axis) or last
        (``irfftn``'s).

    Returns
    -------
    tuple of FFTStep
        In order; consecutive steps whose splits differ need one redistribution between
        them (and the first one from ``split``).

    Raises
    ------
    ValueError
        If a 1-D tensor divided by the grid must be transformed (no other dim can take the
        grid axis, even on a merged grid).
    """
    return _plan(tuple(split), tuple(shape), tuple(grid_dims), tuple(axes), first, last)


@functools.lru_cache(maxsize=256)
def _plan(
    split: tuple[int | None, ...],
    shape: tuple[int, ...],
    grid_dims: tuple[int, ...],
    axes: tuple[int, ...],
    first: int | None,
    last: int | None,
) -> tuple[FFTStep, ...]:
    cur = list(split)
    grid = list(grid_dims)
    done: set[int] = set()
    todo = [a for a in axes if a not in (first, last)]
    steps: list[FFTStep] = []

    def whole(a: int) -> bool:
        g = cur[a]
        return g is None or grid[g] == 1

    def rank(d: int) -> tuple[int, int, int]:  # which dim best takes a grid axis: smallest first
        pending = set(todo) | {x for x in (first, last) if x is not None and x not in done}
        return (0 if d in done else 2 if d in pending else 1, -shape[d], d)

    def merge(a: int) -> None:
        """Merge dim ``a``'s grid axis with a neighbouring one, handing the merged axis to the
        neighbour's dim if it has one (then ``a`` is whole), else keeping it on ``a``. The
        outer neighbour (``g - 1``) is preferred: its dim's blocks are then only cut finer
        (block ``i`` of ``P`` becomes blocks ``i Q .. i Q + Q - 1`` of ``P Q``), so the move
        stays within the ``Q`` ranks of one line of the inner axis."""
        g = cast(int, cur[a])
        near = [h for h in (g - 1, g + 1) if 0 <= h < len(grid)]
        if not near:
            raise ValueError(
                f"cannot transform dim {a} of a tensor of shape {tuple(shape)} split {tuple(split)} over a grid "
                f"of {math.prod(grid_dims)} ranks: no other dim can take its grid axis; give the tensor another "
                f"dim (batch, channels) or make dim {a} whole first (redistribute with split None there)"
            )
        owner = {cur[d]: d for d in range(len(cur)) if d != a and cur[d] is not None}

        def choice(h: int) -> tuple[int, int]:  # outer owned; outer of size 1 (walked through); the rest
            return (0 if h in owner else 1 if grid[h] == 1 else 2, h) if h == g - 1 else (2, h)

        h = min(near, key=choice)
        lo = min(g, h)
        grid[lo : lo + 2] = [grid[lo] * grid[lo + 1]]
        for d, x in enumerate(cur):
            if x is not None:
                cur[d] = x if x < lo else lo if x <= lo + 1 else x - 1
        if h in owner:
            cur[a] = None

    def first_to_merge() -> int:
        """With every dim divided: one whose grid axis's outer neighbour (past size-1 axes)
        divides another dim, so that ``merge`` only cuts that dim finer; else the first."""
        for a in todo:
            h = cast(int, cur[a]) - 1
            while h >= 0 and grid[h] == 1:
                h -= 1
            if h >= 0 and h in cur:
                return a
        return todo[0]

    def run(a: int) -> None:
        while not whole(a):
            g = cur[a]
            free = [d for d in range(len(cur)) if d != a and whole(d)]  # (a size-1 grid axis there is dropped)
            if free:
                b = min(free, key=rank)
                cur[a], cur[b] = None, g
            else:
                merge(a)
        merged = tuple(grid) if tuple(grid) != grid_dims else None
        steps.append(FFTStep(a, tuple(cur), merged))
        done.add(a)

    if first is not None:
        run(first)
    while todo:
        ready = [a for a in todo if whole(a)]
        free = [d for d in range(len(cur)) if whole(d)]
        a = ready[0] if ready else todo[0] if free else first_to_merge()
        todo.remove(a)
        run(a)
    if last is not None:
        run(last)
    return tuple(steps)


def _runs(old: Sequence[int], new: Sequence[int]) -> list[list[int]] | None:
    """The consecutive groups of ``old`` grid axes that ``new``'s axes merge (size-1 axes go
    with the group before them), or None if ``new`` is no such merge of ``old``."""
    runs: list[list[int]] = []
    i = 0
    for n in new:
        run: list[int] = []
        size = 1
        while i < len(old) and (not run or size < n or old[i] == 1) and size * old[i] <= n:
            run.append(i)
            size *= old[i]
            i += 1
        if size != n:
            return None
        runs.append(run)
    if runs and i < len(old) and all(old[j] == 1 for j in range(i, len(old))):
        runs[-1] += list(range(i, len(old)))
        i = len(old)
    return runs if i == len(old) else None


def step_layout(
    old: Layout, shape: Sequence[int], split: Sequence[int | None], grid_dims: Sequence[int] | None = None
) -> Layout:
    """Local. The layout of ``shape`` split as ``split`` on ``grid_dims`` (default: ``old``'s) that
    takes the fewest messages from ``old``.

    A dim of unchanged size whose new grid axis merges its old one with axes inside it (the
    old axis outermost, as :func:`fft_plan` merges) is cut nested: each of its old blocks into
    equal parts, so every rank keeps a piece of its own block and trades only with the ranks
    of its line of the inner axes. With nothing merged this keeps the old cuts. Other divided
    dims are balanced. (Pure and cached: a transform's steps are the same every call.)
    """
    dims = tuple(old.grid_dims if grid_dims is None else grid_dims)
    return _step_layout(old, tuple(int(n) for n in shape), tuple(split), dims)


@functools.lru_cache(maxsize=1024)
def _step_layout(old: Layout, shape: tuple[int, ...], split: tuple[int | None, ...], dims: tuple[int, ...]) -> Layout:
    runs = _runs(old.grid_dims, dims)
    cuts: list[tuple[int, ...] | None] = []
    for d, m in enumerate(split):
        k = old.split[d]
        if m is None or k is None or runs is None or k not in runs[m] or old.global_shape[d] != shape[d]:
            cuts.append(None)
            continue
        pos = runs[m].index(k)
        if any(old.grid_dims[j] > 1 for j in runs[m][:pos]):
            cuts.append(None)  # an outer axis of the merge varies first: not nested
            continue
        parts = math.prod(old.grid_dims[j] for j in runs[m][pos + 1 :])
        edges = old.dim_cuts[d]
        nested = [edges[0]]
        for lo, hi in zip(edges, edges[1:]):
            nested += [lo + c for c in block_cuts(hi - lo, parts)[1:]]
        cuts.append(tuple(nested))
    return Layout(tuple(shape), dims, tuple(split), tuple(cuts))
