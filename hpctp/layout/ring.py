"""Ring plans for exact attention over tokens split on a process grid: pure block math, no MPI.

Attention inputs are ``[batch, heads, *tokens, head_dim]`` with one or more token dims (a
sequence, or the patch grid of a 2-D/3-D field) cut over grid axes. The ranks that share every
coordinate on the other grid axes hold the same batch and heads and different tokens: they form
this rank's *token sub-grid*, and a ring over it (row-major over the token axes) carries every
K/V block past every rank. At step ``s`` a rank holds the block of the member ``s`` places
before it in the ring; step 0 is its own block.

Tokens are numbered row-major over the token dims (the order of ``x.flatten(2, -2)``). Causal
attention lets query ``i`` see key ``j`` when ``j <= i``; a block is then wholly visible, wholly
hidden (skipped: no compute, still forwarded) or partly visible (masked), decided from the
first and last flattened index of the two boxes, so the plan needs no index arrays.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

from .layout import Layout, grid_coords, grid_rank

__all__ = [
    "RingPlan",
    "RingStep",
    "Visibility",
    "all_to_all_split",
    "flat_token_indices",
    "ring_plan",
    "token_axes",
    "token_dims",
]

Ranges = tuple[tuple[int, int], ...]
Visibility = Literal["all", "partial", "none"]


def token_dims(ndim: int) -> tuple[int, ...]:
    """Local. The token dims of an attention tensor ``[batch, heads, *tokens, head_dim]`` of ``ndim`` dims.

    Raises
    ------
    ValueError
        If ``ndim < 4`` (no token dim).
    """
    if ndim < 4:
        raise ValueError(
            f"an attention tensor has dims [batch, heads, *tokens, head_dim] with at least one token dim; "
            f"got {ndim} dims"
        )
    return tuple(range(2, ndim - 1))


def token_axes(layout: Layout) -> tuple[int, ...]:
    """Local. The sorted grid axes that split the token dims of ``layout``."""
    return tuple(sorted(g for d in token_dims(layout.ndim) if (g := layout.split[d]) is not None))


def _flat(index: Sequence[int], shape: Sequence[int]) -> int:
    out = 0
    for i, n in zip(index, shape):
        out = out * n + i
    return out


def flat_token_indices(ranges: Ranges, shape: Sequence[int]) -> np.ndarray:
    """Local. Row-major flattened indices (int64) of the token box ``ranges`` in a token grid of ``shape``.

    Parameters
    ----------
    ranges : tuple of (int, int)
        ``(start, stop)`` per token dim.
    shape : sequence of int
        The global token grid.

    Returns
    -------
    numpy.ndarray
        1-D, in the row-major order of the box (the order of the block's flattened tokens).
    """
    out = np.zeros((), dtype=np.int64)
    for (lo, hi), n in zip(ranges, shape):
        out = out[..., None] * n + np.arange(lo, hi, dtype=np.int64)
    return out.reshape(-1)


def _count(ranges: Ranges) -> int:
    return math.prod(hi - lo for lo, hi in ranges)


def _visibility(q: Ranges, q_shape: tuple[int, ...], k: Ranges, k_shape: tuple[int, ...], causal: bool) -> Visibility:
    if _count(q) == 0 or _count(k) == 0:
        return "none"
    if not causal:
        return "all"
    q_first = _flat([lo for lo, _ in q], q_shape)
    q_last = _flat([hi - 1 for _, hi in q], q_shape)
    k_first = _flat([lo for lo, _ in k], k_shape)
    k_last = _flat([hi - 1 for _, hi in k], k_shape)
    if k_first > q_last:
        return "none"
    if k_last <= q_first:
        return "all"
    return "partial"


@dataclass(frozen=True)
class RingStep:
    """Local. The K/V block one rank holds at one step of the ring.

    Attributes
    ----------
    member : int
        Ring position of the block's owner.
    owner : int
        Grid rank of the block's owner.
    ranges : tuple of (int, int)
        The block's global ``(start, stop)`` per token dim.
    shape : tuple of int
        The block's token shape.
    tokens : int
        Tokens in the block (``prod(shape)``).
    visibility : {"all", "partial", "none"}
        Which of the block's keys this rank's queries see: all (no mask), some (mask from the
        flattened indices), none (skipped; also when either block is empty).
    """

    member: int
    owner: int
    ranges: Ranges
    shape: tuple[int, ...]
    tokens: int
    visibility: Visibility


@dataclass(frozen=True)
class RingPlan:
    """Local. The ring schedule of one rank: who it sends to, receives from and what it holds when.

    Attributes
    ----------
    q_layout, kv_layout : Layout
        Layouts of the queries and of the keys (the values share the keys' token cuts).
    rank : int
        The grid rank this plan is for.
    causal : bool
    axes : tuple of int
        Sorted grid axes that split token dims (the ring's axes).
    ring : tuple of int
        Grid ranks of this rank's token sub-grid, row-major over ``axes``.
    position : int
        This rank's place in ``ring``.
    q_ranges : tuple of (int, int)
        Global token ranges of this rank's queries.
    q_shape, kv_shape : tuple of int
        Global token shapes of the queries and the keys.
    steps : tuple of RingStep
        ``steps[s]``: the block held at step ``s`` (``steps[0]`` is this rank's own).
    """

    q_layout: Layout
    kv_layout: Layout
    rank: int
    causal: bool
    axes: tuple[int, ...]
    ring: tuple[int, ...]
    position: int
    q_ranges: Ranges
    q_shape: tuple[int, ...]
    kv_shape: tuple[int, ...]
    steps: tuple[RingStep, ...]

    @property
    def size(self) -> int:
        """Ranks in the ring (1: no communication)."""
        return len(self.ring)

    @property
    def send_to(self) -> int:
        """Grid rank of the next member, to which blocks are forwarded."""
        return self.ring[(self.position + 1) % self.size]

    @property
    def recv_from(self) -> int:
        """Grid rank of the previous member, from which blocks arrive."""
        return self.ring[(self.position - 1) % self.size]

    @property
    def q_tokens(self) -> int:
        """This rank's number of queries."""
        return _count(self.q_ranges)

    @property
    def sent_tokens(self) -> int:
        """K/V tokens this rank sends in one forward pass: every block but its successor's."""
        return sum(step.tokens for step in self.steps[:-1])

    @property
    def recv_tokens(self) -> int:
        """K/V tokens this rank receives in one forward pass: every block but its own."""
        return sum(step.tokens for step in self.steps[1:])

    @property
    def computed_steps(self) -> tuple[int, ...]:
        """Steps whose block this rank computes with (visibility not ``"none"``)."""
        return tuple(s for s, step in enumerate(self.steps) if step.visibility != "none")


def _check_layouts(q: Layout, kv: Layout) -> None:
    if q.ndim != kv.ndim:
        raise ValueError(f"queries {q} and keys {kv} must have the same number of dims")
    dims = token_dims(q.ndim)
    if q.grid_dims != kv.grid_dims:
        raise ValueError(f"queries {q} and keys {kv} are on grids of different shapes")
    if q.split != kv.split:
        raise ValueError(
            f"queries (split={q.split}) and keys (split={kv.split}) must be split alike; "
            f"redistribute the keys and values to the queries' split"
        )
    if q.split[-1] is not None:
        raise ValueError(
            f"the head dim (last) must be whole on every rank, but split={q.split} divides it over grid axis "
            f"{q.split[-1]}; redistribute it with split[-1]=None"
        )
    for d, name in ((0, "batch"), (1, "heads")):
        if q.global_shape[d] != kv.global_shape[d] or q.dim_cuts[d] != kv.dim_cuts[d]:
            raise ValueError(
                f"the {name} dim (dim {d}) of the queries {q} and keys {kv} must have the same size and cuts"
            )
    if not all(n > 0 for n in (kv.global_shape[d] for d in dims)):
        raise ValueError(f"the keys {kv} hold no token: attention needs at least one key")


@lru_cache(maxsize=512)
def ring_plan(q_layout: Layout, kv_layout: Layout, rank: int, causal: bool = False) -> RingPlan:
    """Local. Build (and cache) the ring schedule of ``rank`` for attention of ``q_layout`` over ``kv_layout``.

    Parameters
    ----------
    q_layout : Layout
        Queries ``[batch, heads, *tokens, head_dim]``.
    kv_layout : Layout
        Keys, with the queries' split and the same batch/heads sizes and cuts (token sizes and
        cuts may differ); the values share the keys' token cuts.
    rank : int
        Row-major grid rank.
    causal : bool, optional
        Classify blocks for causal attention (query ``i`` sees keys ``j <= i`` in the
        flattened token order).

    Returns
    -------
    RingPlan

    Raises
    ------
    ValueError
        If the layouts have no token dim, differ in split, grid, batch or heads, split the
        head dim, the keys hold no token, or ``rank`` is not on the grid.
    """
    _check_layouts(q_layout, kv_layout)
    grid = q_layout.grid_dims
    if not 0 <= rank < math.prod(grid):
        raise ValueError(f"rank {rank} is not on a grid of dims {grid}")
    dims = token_dims(q_layout.ndim)
    axes = token_axes(q_layout)
    me = grid_coords(rank, grid)
    ring: list[int] = []
    for i in range(math.prod(grid[g] for g in axes)):
        sub = grid_coords(i, [grid[g] for g in axes])
        coords = list(me)
        for g, c in zip(axes, sub):
            coords[g] = c
        ring.append(grid_rank(coords, grid))
    position = ring.index(rank)
    q_shape = tuple(q_layout.global_shape[d] for d in dims)
    kv_shape = tuple(kv_layout.global_shape[d] for d in dims)
    q_ranges = tuple(q_layout.local_ranges(me)[d] for d in dims)
    steps = []
    for s in range(len(ring)):
        member = (position - s) % len(ring)
        owner = ring[member]
        ranges = tuple(kv_layout.local_ranges(grid_coords(owner, grid))[d] for d in dims)
        steps.append(
            RingStep(
                member=member,
                owner=owner,
                ranges=ranges,
                shape=tuple(hi - lo for lo, hi in ranges),
                tokens=_count(ranges),
                visibility=_visibility(q_ranges, q_shape, ranges, kv_shape, bool(causal)),
            )
        )
    return RingPlan(
        q_layout=q_layout,
        kv_layout=kv_layout,
        rank=int(rank),
        causal=bool(causal),
        axes=axes,
        ring=tuple(ring),
        position=position,
        q_ranges=q_ranges,
        q_shape=q_shape,
        kv_shape=kv_shape,
        steps=tuple(steps),
    )


def all_to_all_split(layout: Layout) -> tuple[tuple[int | None, ...] | None, str]:
    """Local. The split that gives every rank all tokens of some batches/heads (the all-to-all schedule).

    Each grid axis of more than one rank that splits a token dim moves to an undivided batch or
    heads dim (heads first; with two such axes, the pairing that leaves the fewest batch x heads
    per rank), so one redistribution turns the token split into a batch/heads split and every
    rank can attend over whole token sets. Token dims over single-rank axes keep their axis.

    Parameters
    ----------
    layout : Layout
        Queries, keys or values ``[batch, heads, *tokens, head_dim]``.

    Returns
    -------
    tuple
        ``(split, "")``, or ``(None, reason)`` when the token axes outnumber the undivided
        batch/heads dims.
    """
    dims = token_dims(layout.ndim)
    grid = layout.grid_dims
    moving = sorted((g for d in dims if (g := layout.split[d]) is not None and grid[g] > 1), key=lambda g: -grid[g])
    free = [d for d in (1, 0) if layout.split[d] is None]
    if len(moving) > len(free):
        return None, (
            f"{len(moving)} grid axes of more than one rank split the token dims of {layout} but only "
            f"{len(free)} of batch/heads are undivided to take them"
        )
    best: tuple[int | None, ...] | None = None
    best_work = -1
    for order in [free[: len(moving)]] if len(moving) < 2 else [free, free[::-1]]:
        split = list(layout.split)
        for d in dims:
            if split[d] in moving:
                split[d] = None
        for g, d in zip(moving, order):
            split[d] = g
        work = 1
        for d in (0, 1):
            g = split[d]
            n = layout.global_shape[d]
            work *= n if g is None else -(-n // grid[g])
        if best is None or work < best_work:
            best, best_work = tuple(split), work
    return best, ""
