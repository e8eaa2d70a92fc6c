"""Redistribution plans between two layouts of one tensor: pure math, cached, no MPI."""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .._util.ints import is_int
from .layout import Layout, grid_coords, grid_rank

__all__ = [
    "Piece",
    "RedistributionPlan",
    "Remap",
    "check_remap",
    "flip_remap",
    "intersect",
    "inverse_remap",
    "moves_data",
    "redistribution_plan",
]

Ranges = tuple[tuple[int, int], ...]
DimMap = tuple[bool, int]  # (reverse, shift) of one dim: see redistribution_plan
Remap = tuple[DimMap, ...]


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

    ``peer`` is the other rank, ``box`` the global ``(start, stop)`` ranges of the source
    tensor, ``slices`` where the piece is in this rank's local block (the box in the source
    block for sends; its place in the destination block for receives, which differs from
    the box under a remap) and ``size`` its number of elements.
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

    Every element of the destination block is received exactly once (or copied locally:
    ``local`` pairs source-block and destination-block slices).
    For replicated sources the sender is the replica sharing the receiver's coordinates on
    the replicated axes, so data already on a rank is never sent to it.
    """

    src: Layout
    dst: Layout
    rank: int
    sends: tuple[Piece, ...]
    recvs: tuple[Piece, ...]
    local: tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]
    remap: Remap = ()

    @property
    def reversed_dims(self) -> tuple[int, ...]:
        """Dims whose pieces are reversed (sent, and copied locally, back to front)."""
        return tuple(d for d, (r, _) in enumerate(self.remap) if r)

    @property
    def send_elements(self) -> int:
        """Elements this rank sends to other ranks."""
        return sum(p.size for p in self.sends)

    @property
    def recv_elements(self) -> int:
        """Elements this rank receives from other ranks."""
        return sum(p.size for p in self.recvs)


def _runs(lo: int, hi: int, n: int, dmap: DimMap) -> list[tuple[int, int, int]]:
    """Destination indices ``[lo, hi)`` of one dim as contiguous source runs ``(a, b, j)``:
    source ``[a, b)`` fills the destination from index ``j`` on (backwards when reversed)."""
    reverse, shift = dmap
    out = []
    j = lo
    while j < hi:
        i = ((n - 1 - j) if reverse else j) - shift
        i %= n
        k = min(hi - j, i + 1) if reverse else min(hi - j, n - i)
        out.append((i - k + 1, i + 1, j) if reverse else (i, i + k, j))
        j += k
    return out


DimPiece = tuple[int, tuple[int, int], tuple[int, int]]  # source block index, source range, destination range


def _dim_pieces(src: Layout, d: int, lo: int, hi: int, dmap: DimMap) -> list[DimPiece]:
    """Dim ``d``'s destination ``[lo, hi)`` split by source block: ``(block index, source
    range, destination range)`` per piece."""
    cuts = src.dim_cuts[d]
    out = []
    for a, b, j in _runs(lo, hi, src.global_shape[d], dmap):
        for q in range(max(bisect_right(cuts, a) - 1, 0), len(cuts) - 1):
            if cuts[q] >= b:
                break
            a2, b2 = max(a, cuts[q]), min(b, cuts[q + 1])
            if a2 < b2:
                dst = (j + b - b2, j + b - a2) if dmap[0] else (j + a2 - a, j + b2 - a)
                out.append((q, (a2, b2), dst))
    return out


def _tables(src: Layout, dst: Layout, remap: Remap) -> list[list[list[DimPiece]]]:
    """Per dim and destination block index along it, the dim's pieces (see :func:`_dim_pieces`)."""
    maps = remap or ((False, 0),) * src.ndim
    return [
        [_dim_pieces(src, d, cuts[i], cuts[i + 1], maps[d]) for i in range(len(cuts) - 1)]
        for d, cuts in enumerate(dst.dim_cuts)
    ]


def _boxes(per_dim: list[list[DimPiece]]) -> Iterator[tuple[tuple[int, ...], Ranges, Ranges]]:
    """Every combination of one piece per dim: source block indices, source box, destination box."""
    for pieces in itertools.product(*per_dim):
        yield tuple(p[0] for p in pieces), tuple(p[1] for p in pieces), tuple(p[2] for p in pieces)


def check_remap(remap: object, shape: tuple[int, ...]) -> Remap:
    """Local. ``remap`` as one ``(reverse, shift)`` per dim (``()``: none).

    Raises
    ------
    ValueError
        If it does not give one ``(bool, int)`` pair per dim.
    """
    if remap == ():
        return ()
    items: tuple[Any, ...] = tuple(remap) if isinstance(remap, (tuple, list)) else (remap,)
    if len(items) != len(shape) or not all(
        isinstance(m, tuple) and len(m) == 2 and isinstance(m[0], bool) and is_int(m[1]) for m in items
    ):
        raise ValueError(f"remap={items!r} must give one (reverse: bool, shift: int) pair per dim of {shape}")
    out = tuple((bool(r), int(s) % n if n else 0) for (r, s), n in zip(items, shape))
    return () if all(m == (False, 0) for m in out) else out


def flip_remap(dims: Sequence[int], shape: tuple[int, ...]) -> Remap:
    """Local. The remap that reverses ``dims`` of a tensor of ``shape`` (``numpy.flip``)."""
    return check_remap(tuple((d in dims, 0) for d in range(len(shape))), shape)


def inverse_remap(remap: Remap) -> Remap:
    """Local. The remap that undoes ``remap``: a reversal is its own inverse, a shift goes back."""
    return tuple((r, s if r else -s) for r, s in remap)


def moves_data(src: Layout, dst: Layout, remap: Remap = ()) -> bool:
    """Local. False when every rank's destination block is made from its own source block
    (no messages): the layouts are equal and only undivided dims are remapped."""
    return src != dst or any(src.parts(d) > 1 for d, m in enumerate(remap) if m != (False, 0))


@lru_cache(maxsize=256)
def redistribution_plan(src: Layout, dst: Layout, rank: int, remap: Remap = ()) -> RedistributionPlan:
    """Local. Build (and cache) the plan for ``rank`` to move a tensor from ``src`` to ``dst``.

    With ``remap`` the destination is the source with its elements moved along each dim:
    ``y[..., j, ...] = x[..., m(j), ...]`` with ``m(j) = ((n - 1 - j) if reverse else j) - shift``
    modulo the dim's size ``n``, so ``(True, 0)`` flips the dim and ``(False, s)`` rolls it by
    ``s`` (``numpy.flip``, ``numpy.roll``). Pieces of reversed dims are sent reversed.

    Parameters
    ----------
    src, dst : Layout
        Layouts of the same global shape on grids of the same number of ranks. The grid
        shapes may differ (the same ranks in row-major order, e.g. two grid axes merged into
        one): a rank's coordinates on each grid follow from its rank.
    rank : int
        The row-major grid rank of the calling process.
    remap : tuple of (bool, int), optional
        One ``(reverse, shift)`` per dim (see :func:`check_remap`); ``()`` moves nothing.

    Returns
    -------
    RedistributionPlan
        Sends and receives in ``(peer, box)`` order, so several pieces between one pair of
        ranks pack and unpack alike.

    Raises
    ------
    ValueError
        If the layouts describe different tensors or grids of different sizes, or ``remap``
        is malformed.
    """
    if src.global_shape != dst.global_shape or src.nranks != dst.nranks:
        raise ValueError(
            f"cannot redistribute between {src} and {dst}: the global shapes and the numbers of ranks must match"
        )
    remap = check_remap(remap, src.global_shape)
    tables = _tables(src, dst, remap)
    me = grid_coords(rank, src.grid_dims)
    my_src = src.local_ranges(me)
    my_dst = dst.local_ranges(grid_coords(rank, dst.grid_dims))
    recvs: list[Piece] = []
    local = []
    wanted = dst.block_index(grid_coords(rank, dst.grid_dims))
    for blocks, box, at in _boxes([tables[d][i] for d, i in enumerate(wanted)]):
        sender = list(me)  # a replicated source is read from the replica sharing the receiver's coords
        for d, q in enumerate(blocks):
            if src.split[d] is not None:
                sender[src.split[d]] = q  # type: ignore[index]
        if tuple(sender) == me:
            local.append((_relative(box, my_src), _relative(at, my_dst)))
        else:
            recvs.append(Piece(grid_rank(sender, src.grid_dims), box, _relative(at, my_dst)))
    sends: list[Piece] = []
    mine = src.block_index(me)
    ours = [[[p for p in pieces if p[0] == mine[d]] for pieces in table] for d, table in enumerate(tables)]
    rep = src.replicated_axes
    for r in range(src.nranks):
        them = grid_coords(r, src.grid_dims)
        if r == rank or any(them[g] != me[g] for g in rep):
            continue  # a replica with the receiver's own coordinates serves it
        theirs = dst.block_index(grid_coords(r, dst.grid_dims))
        sends.extend(
            Piece(r, box, _relative(box, my_src)) for _, box, _ in _boxes([ours[d][i] for d, i in enumerate(theirs)])
        )
    order = lambda p: (p.peer, p.box)  # noqa: E731
    return RedistributionPlan(
        src, dst, rank, tuple(sorted(sends, key=order)), tuple(sorted(recvs, key=order)), tuple(local), remap
    )
