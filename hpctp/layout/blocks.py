"""Balanced 1-D block decomposition: pure integer math, no MPI."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from .._util.ints import as_int

__all__ = ["block_range", "block_cuts", "block_sizes", "owner_of", "check_cuts"]


def block_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """Local. Half-open range ``[start, stop)`` of block ``index`` of ``n`` items cut into ``parts``.

    Blocks are balanced: their sizes differ by at most one, and the first ``n % parts``
    blocks are the larger ones. A block may be empty when ``n < parts``.

    Parameters
    ----------
    n : int
        Number of items (>= 0).
    parts : int
        Number of blocks (>= 1).
    index : int
        Block index, ``0 <= index < parts``.

    Returns
    -------
    tuple of int
        ``(start, stop)`` with ``0 <= start <= stop <= n``.

    Raises
    ------
    ValueError
        If ``n < 0``, ``parts < 1`` or ``index`` is outside ``[0, parts)``.
    TypeError
        If an argument is not an integer.
    """
    n = as_int(n, "n", 0)
    parts = as_int(parts, "parts", 1)
    index = as_int(index, "index", 0)
    if index >= parts:
        raise ValueError(f"index must be < parts={parts}, got {index}")
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def block_cuts(n: int, parts: int) -> tuple[int, ...]:
    """Local. The ``parts + 1`` boundaries of the balanced decomposition of ``n`` items.

    Parameters
    ----------
    n : int
        Number of items.
    parts : int
        Number of blocks.

    Returns
    -------
    tuple of int
        ``cuts`` with ``cuts[0] == 0``, ``cuts[-1] == n``; block ``i`` is ``[cuts[i], cuts[i+1])``.
    """
    return _block_cuts(as_int(n, "n", 0), as_int(parts, "parts", 1))


@functools.lru_cache(maxsize=4096)
def _block_cuts(n: int, parts: int) -> tuple[int, ...]:
    """:func:`block_cuts` of validated ints (remembered: every new layout asks for its dims' cuts)."""
    base, extra = divmod(n, parts)
    return tuple(i * base + min(i, extra) for i in range(parts + 1))


def block_sizes(cuts: Sequence[int]) -> tuple[int, ...]:
    """Local. Sizes of the blocks delimited by ``cuts``."""
    return tuple(b - a for a, b in zip(cuts[:-1], cuts[1:]))


def owner_of(cuts: Sequence[int], i: int) -> int:
    """Local. Index of the (non-empty) block of ``cuts`` that holds item ``i``.

    Raises
    ------
    ValueError
        If ``i`` is outside ``[0, cuts[-1])``.
    """
    if not 0 <= i < cuts[-1]:
        raise ValueError(f"item {i} is outside [0, {cuts[-1]})")
    lo, hi = 0, len(cuts) - 2
    while lo < hi:  # find the last block whose start <= i and that is non-empty
        mid = (lo + hi + 1) // 2
        if cuts[mid] <= i:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_cuts(cuts: Sequence[int], n: int, parts: int, what: str = "cuts") -> tuple[int, ...]:
    """Local. Validate explicit block boundaries and return them as a tuple of ints.

    Raises
    ------
    ValueError
        If ``cuts`` does not have ``parts + 1`` non-decreasing entries from 0 to ``n``.
    """
    out = tuple(as_int(c, what, 0) for c in cuts)
    if len(out) != parts + 1 or out[0] != 0 or out[-1] != n or any(b < a for a, b in zip(out[:-1], out[1:])):
        raise ValueError(
            f"{what}={out} must be {parts + 1} non-decreasing boundaries from 0 to {n} (one block per grid coordinate)"
        )
    return out
