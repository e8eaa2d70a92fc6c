"""Redistribution plans between two layouts of one tensor: pure math, cached, no MPI."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

from .layout import Layout, grid_coords, grid_rank

__all__ = ["Piece", "RedistributionPlan", "intersect", "redistribution_plan"]

Ranges = tuple[tuple[int, int], ...]


def intersect(a: Ranges, b: Ranges) -> Ranges | None:
    """Local. Intersection of two boxes given as ``(start, stop)`` per dimension, or None if empty."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    if any(lo >= hi for lo, hi in out):
        return None
    return out


def _relative(box: Ranges, origin: Ranges) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


@dataclass(frozen=True)
class Piece:
    """Local. One box moving between two ranks.

    ``peer`` is the other rank, ``box`` the global ``(start, stop)`` ranges, ``slices`` the
    same box relative to this rank's local block (source block for sends, destination
    block for receives) and ``size`` its number of elements.
    """

    peer: int
    box: Ranges
    slices: tuple[slice, ...]

    @property
    def size(self) -> int:
        return math.prod(hi - lo for lo, hi in self.box)


@dataclass(frozen=True)
class RedistributionPlan:
    """Local. What one rank sends, receives and copies locally to go from ``src`` to ``dst``.

    Every element of the destination block is received exactly once (or copied locally).
    For replicated sources the sender is the replica sharing the receiver's coordinates on
    the replicated axes, so data already on a rank is never sent to it.
    """

    src: Layout
    dst: Layout
    rank: int
    sends: tuple[Piece, ...]
    recvs: tuple[Piece, ...]
    local: tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]

    @property
    def send_elements(self) -> int:
        """Elements this rank sends to other ranks."""
        return sum(p.size for p in self.sends)

    @property
    def recv_elements(self) -> int:
        """Elements this rank receives from other ranks."""
        return sum(p.size for p in self.recvs)


def _sources(src: Layout, dst: Layout, rank: int) -> list[tuple[tuple[int, ...], Ranges]]:
    """Sender coords (on ``src``'s grid) and boxes that together cover ``rank``'s destination block."""
    want = dst.local_ranges(grid_coords(rank, dst.grid_dims))
    receiver = grid_coords(rank, src.grid_dims)
    if any(lo >= hi for lo, hi in want):
        return []
    per_dim: list[list[int]] = []
    for d, (lo, hi) in enumerate(want):
        cuts = src.dim_cuts[d]
        per_dim.append([i for i in range(len(cuts) - 1) if cuts[i] < hi and cuts[i + 1] > lo])
    out = []
    for idx in itertools.product(*per_dim):
        coords = list(receiver)
        for d, i in enumerate(idx):
            g = src.split[d]
            if g is not None:
                coords[g] = i
        sender = tuple(coords)
        box = intersect(src.local_ranges(sender), want)
        if box is not None:
            out.append((sender, box))
    return out


@lru_cache(maxsize=256)
def redistribution_plan(src: Layout, dst: Layout, rank: int) -> RedistributionPlan:
    """Local. Build (and cache) the plan for ``rank`` to move a tensor from ``src`` to ``dst``.

    Parameters
    ----------
    src, dst : Layout
        Layouts of the same global shape on grids of the same number of ranks. The grid
        shapes may differ (the same ranks in row-major order, e.g. two grid axes merged into
        one): a rank's coordinates on each grid follow from its rank.
    rank : int
        The row-major grid rank of the calling process.

    Returns
    -------
    RedistributionPlan

    Raises
    ------
    ValueError
        If the layouts describe different tensors or grids of different sizes.
    """
    if src.global_shape != dst.global_shape or src.nranks != dst.nranks:
        raise ValueError(
            f"cannot redistribute between {src} and {dst}: the global shapes and the numbers of ranks must match"
        )
    me = grid_coords(rank, src.grid_dims)
    my_src = src.local_ranges(me)
    my_dst = dst.local_ranges(grid_coords(rank, dst.grid_dims))
    recvs: list[Piece] = []
    local = []
    for sender, box in _sources(src, dst, rank):
        if sender == me:
            local.append((_relative(box, my_src), _relative(box, my_dst)))
        else:
            recvs.append(Piece(grid_rank(sender, src.grid_dims), box, _relative(box, my_dst)))
    sends: list[Piece] = []
    rep = src.replicated_axes
    for r in range(src.nranks):
        if r == rank:
            continue
        them = grid_coords(r, src.grid_dims)
        if any(them[g] != me[g] for g in rep):
            continue  # a replica with the receiver's own coordinates serves it
        common = intersect(my_src, dst.local_ranges(grid_coords(r, dst.grid_dims)))
        if common is not None:
            sends.append(Piece(r, common, _relative(common, my_src)))
    return RedistributionPlan(src, dst, rank, tuple(sends), tuple(recvs), tuple(local))
