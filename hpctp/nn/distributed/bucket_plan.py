"""Which parameters share a flat bucket of :class:`~hpctp.nn.ShardedDataParallel`: pure functions of the
parameters' kinds and sizes, which the wrapper runs and :mod:`hpctp.perf` prices (one rule, not a copy).

A parameter's *kind* is what a bucket must share (the wrapper's: device, dtype and the grid axes its gradient is
summed over; the planner's: its element size and whether the spatial axes sum it too). Stages 0-2 fill buckets
walking the parameters in reverse, the order backward produces their gradients, and close a kind's bucket once it
holds ``cap`` bytes (one parameter may exceed it); stage 3 keeps one bucket per kind in each unit.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

__all__ = ["fill_buckets", "group_by_kind"]

K = TypeVar("K", bound=Hashable)


def fill_buckets(kinds: Sequence[K], nbytes: Sequence[int], cap: float) -> list[tuple[K, list[int]]]:
    """Local. The buckets of stages 0-2: ``(kind, indices)`` in the order they fill, each of the parameters of
    ``kinds[i]`` taken in reverse (the bucket's place: where its first parameter comes).

    Parameters
    ----------
    kinds : sequence of hashable
        Each parameter's kind, in the model's parameter order.
    nbytes : sequence of int
        Each parameter's bytes.
    cap : float
        A kind's bucket closes once it holds this many bytes.

    Returns
    -------
    list of (kind, list of int)
    """
    filling: dict[K, list[int]] = {}
    size: dict[K, int] = {}
    made: list[tuple[K, list[int]]] = []
    for i in reversed(range(len(kinds))):
        key = kinds[i]
        if key not in filling:
            filling[key], size[key] = [], 0
            made.append((key, filling[key]))
        filling[key].append(i)
        size[key] += int(nbytes[i])
        if size[key] >= cap:
            del filling[key]
    return made


def group_by_kind(kinds: Sequence[K]) -> list[tuple[K, list[int]]]:
    """Local. The buckets of one stage-3 unit: ``(kind, indices)`` per kind in the order kinds first appear, each
    of its parameters in order."""
    groups: dict[K, list[int]] = {}
    for i, key in enumerate(kinds):
        groups.setdefault(key, []).append(i)
    return list(groups.items())
