"""Halo / range-fetch plans: pure integer math, cached, no MPI.

A *fetch plan* says how one rank assembles an arbitrary global box of a block-distributed
tensor (its own block widened by halos, or any per-rank input range a strided window op
needs) from the blocks of its owners, including boundary conditions outside the global
index range. Halo exchange is the special case ``want = own block +- width``.

Along each tensor dim the wanted range ``[lo, hi)`` is cut into *segments*: maximal runs
of consecutive wanted indices that map to consecutive indices of one owner block (read
forwards, or backwards for reflections), or to the fill value. The N-D pieces are the
products of the per-dim segments; every piece is either filled, copied locally, or part of
exactly one message per peer (pieces for one peer are packed in a fixed order).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from .._util.ints import is_int
from ..layout import Layout, grid_coords, grid_rank

__all__ = [
    "BOUNDARIES",
    "FetchPlan",
    "Message",
    "Piece",
    "Segment",
    "dim_segments",
    "fetch_plan",
    "halo_wants",
    "normalize_boundary",
    "normalize_widths",
    "source_index",
]

BOUNDARIES = ("zero", "periodic", "reflect", "replicate")
Range = tuple[int, int]
Wants = tuple[tuple[Range, ...], ...]


@dataclass(frozen=True)
class Segment:
    """Local. One run of a wanted 1-D range.

    ``dst`` is relative to the start of the wanted range; ``owner`` the block index that
    holds the data (-1: boundary fill); ``src`` the increasing range relative to the
    owner block's start; ``flip`` True when ``dst`` runs backwards over ``src``; ``halo``
    True when ``dst`` lies outside the receiver's own block.
    """

    dst: Range
    owner: int
    src: Range
    flip: bool
    halo: bool


@dataclass(frozen=True)
class Piece:
    """Local. One N-D box: ``src`` slices in the owner's block, ``dst`` slices in the
    fetched array, ``flip`` the axes reversed between them, ``shape`` the source box shape."""

    src: tuple[slice, ...]
    dst: tuple[slice, ...]
    flip: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        """Local. Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class Message:
    """Local. All pieces exchanged with one peer, in packing order."""

    peer: int
    pieces: tuple[Piece, ...]

    @property
    def size(self) -> int:
        """Local. Number of elements."""
        return sum(p.size for p in self.pieces)


@dataclass(frozen=True)
class FetchPlan:
    """Local. How one rank fills its wanted box (``want``: global ranges, ``shape``).

    ``fills``: dst slices set to the fill value (zero boundary, star-stencil corners);
    ``local``: pieces copied from the rank's own block; ``recvs``/``sends``: one
    :class:`Message` per peer (receivers unpack recv pieces into ``dst``; senders pack
    send pieces from ``src``).
    """

    layout: Layout
    rank: int
    want: tuple[Range, ...]
    shape: tuple[int, ...]
    fills: tuple[tuple[slice, ...], ...]
    local: tuple[Piece, ...]
    recvs: tuple[Message, ...]
    sends: tuple[Message, ...]

    @property
    def send_elements(self) -> int:
        """Local. Elements this rank sends."""
        return sum(m.size for m in self.sends)

    @property
    def recv_elements(self) -> int:
        """Local. Elements this rank receives."""
        return sum(m.size for m in self.recvs)


def source_index(g: np.ndarray, n: int, boundary: str) -> np.ndarray:
    """Local. Global source index of each global index ``g`` under ``boundary`` (-1: fill).

    ``"reflect"`` mirrors without repeating the edge (numpy/torch ``reflect``),
    ``"replicate"`` clamps to the edge, ``"periodic"`` wraps, ``"zero"`` fills.
    """
    g = np.asarray(g, dtype=np.int64)
    inside = (g >= 0) & (g < n)
    if boundary == "zero" or n == 0:
        return np.where(inside, g, -1)
    if boundary == "periodic":
        return np.mod(g, n)
    if boundary == "replicate":
        return np.clip(g, 0, n - 1)
    if boundary == "reflect":
        if n == 1:
            return np.zeros_like(g)
        period = 2 * (n - 1)
        m = np.mod(g, period)
        return np.where(m < n, m, period - m)
    raise ValueError(f"boundary must be one of {BOUNDARIES}, got {boundary!r}")


@lru_cache(maxsize=4096)
def dim_segments(cuts: tuple[int, ...], index: int, lo: int, hi: int, boundary: str) -> tuple[Segment, ...]:
    """Local. Segments of the wanted range ``[lo, hi)`` of block ``index`` along one dim.

    Parameters
    ----------
    cuts : tuple of int
        Block boundaries of the dim (``cuts[-1]`` is the global size).
    index : int
        The receiving block (its range decides which segments are halo).
    lo, hi : int
        Wanted global range (may extend beyond ``[0, n)``); empty when ``hi <= lo``.
    boundary : str
        One of :data:`BOUNDARIES`.

    Returns
    -------
    tuple of Segment
    """
    if hi <= lo:
        return ()
    n = cuts[-1]
    a, b = cuts[index], cuts[index + 1]
    s = source_index(np.arange(lo, hi), n, boundary).tolist()
    cut_arr = np.asarray(cuts)
    owner = (np.searchsorted(cut_arr, np.asarray(s), side="right") - 1).tolist()
    out: list[Segment] = []
    start = 0
    step = 0
    for j in range(1, len(s) + 1):
        if j < len(s) and lo + j not in (a, b):  # runs also break at the own block's edges
            if s[j] >= 0 and s[start] >= 0 and owner[j] == owner[start]:
                d = s[j] - s[j - 1]
                if d in (1, -1) and (step == 0 or d == step):
                    step = d
                    continue
            elif s[j] < 0 and s[start] < 0:
                continue
        # close the run [start, j)
        g0, g1 = lo + start, lo + j
        halo = not (g0 >= a and g1 <= b)
        if s[start] < 0:
            out.append(Segment((start, j), -1, (0, 0), False, halo))
        else:
            o = owner[start]
            first, last = s[start], s[j - 1]
            lo_s, hi_s = min(first, last), max(first, last) + 1
            out.append(Segment((start, j), o, (lo_s - cuts[o], hi_s - cuts[o]), step < 0, halo))
        start, step = j, 0
    return tuple(out)


def normalize_boundary(boundary: object, ndim: int) -> tuple[str, ...]:
    """Local. One boundary condition per dim from a string or a sequence of strings.

    Raises
    ------
    ValueError
        On an unknown name or a wrong length.
    """
    items = (boundary,) * ndim if isinstance(boundary, str) else tuple(boundary)  # type: ignore[arg-type]
    if len(items) != ndim:
        raise ValueError(f"boundary has {len(items)} entries, expected one per dim ({ndim})")
    for b in items:
        if b not in BOUNDARIES:
            raise ValueError(f"boundary must be one of {BOUNDARIES}, got {b!r}")
    return items  # type: ignore[return-value]


def normalize_widths(width: object, split: Sequence[int | None]) -> tuple[Range, ...]:
    """Local. Per-dim ``(lo, hi)`` halo widths.

    An int ``w`` means ``(w, w)`` on every dim with a grid axis in ``split`` and 0 on the
    others; a sequence gives one entry per dim, each an int or a ``(lo, hi)`` pair.

    Raises
    ------
    ValueError
        On negative widths or a wrong length.
    TypeError
        On entries that are not ints.
    """
    ndim = len(split)

    def _int(v: object) -> int:
        if not is_int(v):
            raise TypeError(f"halo widths must be ints, got {v!r}")
        if v < 0:
            raise ValueError(f"halo widths must be >= 0, got {v}")
        return int(v)

    if is_int(width):
        w = _int(width)
        return tuple((w, w) if g is not None else (0, 0) for g in split)
    try:
        items: tuple[Any, ...] = tuple(width)  # type: ignore[call-overload, arg-type]
    except TypeError:
        raise TypeError(f"width must be an int or a sequence, got {type(width).__name__}") from None
    if len(items) != ndim:
        raise ValueError(f"width has {len(items)} entries but the block has {ndim} dims; give one per dim")
    out = []
    for it in items:
        if is_int(it):
            w = _int(it)
            out.append((w, w))
        else:
            pair = tuple(it)
            if len(pair) != 2:
                raise ValueError(f"a width entry must be an int or a (lo, hi) pair, got {it!r}")
            out.append((_int(pair[0]), _int(pair[1])))
    return tuple(out)


def halo_wants(layout: Layout, widths: Sequence[Range]) -> Wants:
    """Local. Wanted ranges (own block widened by ``widths``) for every block of every dim."""
    return tuple(
        tuple((c[i] - wl, c[i + 1] + wh) for i in range(len(c) - 1)) for c, (wl, wh) in zip(layout.dim_cuts, widths)
    )


def _slices(ranges: Sequence[Range]) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in ranges)


def _piece(segs: Sequence[Segment]) -> Piece:
    return Piece(
        _slices([s.src for s in segs]),
        _slices([s.dst for s in segs]),
        tuple(d for d, s in enumerate(segs) if s.flip),
        tuple(s.src[1] - s.src[0] for s in segs),
    )


def _keep(segs: Sequence[Segment], star: bool) -> bool:
    return not star or sum(s.halo for s in segs) <= 1


@lru_cache(maxsize=512)
def fetch_plan(layout: Layout, rank: int, wants: Wants, boundary: tuple[str, ...], stencil: str = "box") -> FetchPlan:
    """Local. Build (and cache) the plan of ``rank`` for fetching the boxes ``wants``.

    Parameters
    ----------
    layout : Layout
        Layout of the distributed tensor.
    rank : int
        Row-major grid rank of the calling process.
    wants : tuple
        ``wants[d][i] = (lo, hi)``: global range of dim ``d`` wanted by the ranks holding
        block ``i`` of that dim (``len(wants[d]) == layout.parts(d)``).
    boundary : tuple of str
        Boundary condition per dim (see :func:`source_index`).
    stencil : {"box", "star"}
        ``"star"`` skips pieces that are halo in more than one dim (edges and corners);
        they are filled instead.

    Returns
    -------
    FetchPlan

    Raises
    ------
    ValueError
        If ``wants``/``boundary`` do not match the layout or a reflection is impossible.
    """
    ndim = layout.ndim
    if len(wants) != ndim or len(boundary) != ndim:
        raise ValueError(f"wants and boundary need one entry per dim ({ndim})")
    if stencil not in ("box", "star"):
        raise ValueError(f"stencil must be 'box' or 'star', got {stencil!r}")
    for d in range(ndim):
        if len(wants[d]) != layout.parts(d):
            raise ValueError(f"wants[{d}] has {len(wants[d])} ranges, expected {layout.parts(d)}")
        if boundary[d] != "zero" and layout.global_shape[d] == 0 and any(hi > lo for lo, hi in wants[d]):
            raise ValueError(f"dim {d} is empty; only boundary='zero' can fill a halo of an empty dim")
    star = stencil == "star"
    me = grid_coords(rank, layout.grid_dims)
    idx = layout.block_index(me)
    cuts = layout.dim_cuts
    want = tuple(wants[d][idx[d]] for d in range(ndim))
    shape = tuple(max(hi - lo, 0) for lo, hi in want)
    per_dim = [dim_segments(cuts[d], idx[d], *want[d], boundary[d]) for d in range(ndim)]
    fills: list[tuple[slice, ...]] = []
    local: list[Piece] = []
    recvs: dict[int, list[Piece]] = {}
    for segs in itertools.product(*per_dim):
        if not _keep(segs, star) or any(s.owner < 0 for s in segs):
            fills.append(_slices([s.dst for s in segs]))
            continue
        coords = list(me)
        for d, s in enumerate(segs):
            if layout.split[d] is not None:
                coords[layout.split[d]] = s.owner  # type: ignore[index]
        peer = grid_rank(coords, layout.grid_dims)
        if peer == rank:
            local.append(_piece(segs))
        else:
            recvs.setdefault(peer, []).append(_piece(segs))
    # sends: for each dim, the receiving block indices whose segments read from my block
    mine: list[list[tuple[int, list[Segment]]]] = []
    for d in range(ndim):
        opts = []
        for j in range(layout.parts(d)):
            segs_j = [s for s in dim_segments(cuts[d], j, *wants[d][j], boundary[d]) if s.owner == idx[d]]
            if segs_j:
                opts.append((j, segs_j))
        mine.append(opts)
    sends: list[Message] = []
    for combo in itertools.product(*mine):
        coords = list(me)
        for d, (j, _) in enumerate(combo):
            if layout.split[d] is not None:
                coords[layout.split[d]] = j  # type: ignore[index]
        peer = grid_rank(coords, layout.grid_dims)
        if peer == rank:
            continue
        pieces = [_piece(segs) for segs in itertools.product(*[s for _, s in combo]) if _keep(segs, star)]
        if pieces:
            sends.append(Message(peer, tuple(pieces)))
    sends.sort(key=lambda m: m.peer)
    return FetchPlan(
        layout,
        rank,
        want,
        shape,
        tuple(fills),
        tuple(local),
        tuple(Message(p, tuple(v)) for p, v in sorted(recvs.items())),
        tuple(sends),
    )
