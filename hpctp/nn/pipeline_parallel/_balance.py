"""Stage balancing: cut a sequence of modules into contiguous stages of equal cost, exactly.

The runtime cuts an ``nn.Sequential`` of ``n`` modules into ``parts = p * v`` stages. Given each
module's cost (time, or parameters), :func:`balanced_cuts` returns the cut points
``0 = c_0 < c_1 < ... < c_parts = n`` (stage ``k`` is modules ``c_k .. c_{k+1} - 1``) that, in order:

1. minimise the largest stage cost (a pipeline runs at the pace of its slowest stage);
2. then, if ``secondary`` costs are given (e.g. activation bytes), the largest stage secondary cost;
3. then the number of modules on the first and last stages together (they also hold the input and the
   loss, and their ranks hold more activations);
4. then the first stage's number of modules, then the earliest cuts (so the result is unique).

Each level is an exact dynamic programme over prefixes or suffixes, ``O(parts * n**2)`` additions and
comparisons: a level's optimum is one of the stage costs themselves, so the next level's "stage within
the optimum" test compares the same sums and floating-point rounding cannot lose the optimum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..._util.ints import is_int

__all__ = ["balanced_cuts"]

_INF = math.inf


def _prefix(values: Sequence[float], name: str) -> list[float]:
    sums = [0.0]
    for k, value in enumerate(values):
        x = float(value)
        if not (math.isfinite(x) and x >= 0):
            raise ValueError(f"{name}[{k}] must be a finite number >= 0, got {value!r}")
        sums.append(sums[-1] + x)
    return sums


def _min_max(n: int, parts: int, ok: list[list[bool]], cost: list[float]) -> float:
    """The smallest largest ``cost`` of a part over the cuts of ``0..n`` into ``parts`` parts ``ok`` allows.

    ``ok[i][j]``: part ``[i, j)`` allowed; ``cost`` the prefix sums.
    """
    best = [0.0] + [_INF] * n  # best[j]: over cuts of [0, j) into k parts
    for _ in range(parts):
        best = [
            min((max(best[i], cost[j] - cost[i]) for i in range(j) if ok[i][j] and best[i] < _INF), default=_INF)
            for j in range(n + 1)
        ]
    return best[n]


def _splits(lo: int, hi: int, parts: int, ok: list[list[bool]]) -> list[list[bool]]:
    """``can[k][i]``: ``[i, hi)`` cuts into ``k`` allowed parts (``lo <= i <= hi``)."""
    can = [[False] * (hi + 1) for _ in range(parts + 1)]
    can[0][hi] = True
    for k in range(1, parts + 1):
        for i in range(lo, hi + 1):
            can[k][i] = any(ok[i][j] and can[k - 1][j] for j in range(i + 1, hi + 1))
    return can


def balanced_cuts(
    costs: Sequence[float], parts: int, min_per_part: int = 1, secondary: Sequence[float] | None = None
) -> tuple[int, ...]:
    """Local. Cut points of ``costs`` into ``parts`` contiguous parts of minimal largest cost; ties as the module docstring says.

    Parameters
    ----------
    costs : sequence of float
        Each module's cost, ``>= 0``.
    parts : int
        The number of parts (stages), ``1 <= parts <= len(costs) // min_per_part``.
    min_per_part : int
        The fewest modules in a part, ``>= 1``.
    secondary : sequence of float, optional
        A second cost per module (e.g. activation bytes), balanced among the cuts of equal largest cost.

    Returns
    -------
    tuple of int
        ``parts + 1`` increasing indices from ``0`` to ``len(costs)``; part ``k`` is
        ``costs[cuts[k]:cuts[k + 1]]``.

    Raises
    ------
    ValueError
        If a part would be empty or below ``min_per_part`` (``parts * min_per_part > len(costs)``), a cost is
        negative or not finite, or ``secondary`` has another length than ``costs``.
    TypeError
        If ``parts`` or ``min_per_part`` is not an int.
    """
    for name, value in (("parts", parts), ("min_per_part", min_per_part)):
        if not is_int(value):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    n, parts, min_per_part = len(costs), int(parts), int(min_per_part)
    if parts * min_per_part > n:
        raise ValueError(
            f"cannot cut {n} modules into {parts} parts of at least {min_per_part} module(s): a stage would be empty; "
            f"use at most {n // min_per_part} parts (fewer ranks p or stages per rank v), or a model of more, smaller modules"
        )
    cost = _prefix(costs, "costs")
    if secondary is not None and len(secondary) != n:
        raise ValueError(f"secondary has {len(secondary)} values for {n} modules: give one per module")
    extra = _prefix(secondary, "secondary") if secondary is not None else None

    # 1. and 2.: the smallest largest cost, then the smallest largest secondary cost among those cuts
    ok = [[j - i >= min_per_part for j in range(n + 1)] for i in range(n + 1)]
    top = _min_max(n, parts, ok, cost)
    ok = [[ok[i][j] and cost[j] - cost[i] <= top for j in range(n + 1)] for i in range(n + 1)]
    if extra is not None:
        top_extra = _min_max(n, parts, ok, extra)
        ok = [[ok[i][j] and extra[j] - extra[i] <= top_extra for j in range(n + 1)] for i in range(n + 1)]
    if parts == 1:
        return (0, n)

    # 3. and 4.: the first and last parts [0, a) and [e, n) with the fewest modules a + n - e, then the
    # smallest a; the middle parts with the earliest cuts. last[i]: the latest e such that [i, e) cuts
    # into k allowed parts and [e, n) is allowed (-1: none), for k = 0 .. parts - 2
    last = [i if ok[i][n] else -1 for i in range(n + 1)]
    for _ in range(parts - 2):
        last = [max((last[j] for j in range(i + 1, n + 1) if ok[i][j]), default=-1) for i in range(n + 1)]
    _, a = min((a + n - last[a], a) for a in range(1, n + 1) if ok[0][a] and last[a] >= 0)
    e = last[a]
    can = _splits(a, e, parts - 2, ok)
    cuts = [0, a]
    for k in range(parts - 2, 0, -1):
        cuts.append(next(j for j in range(cuts[-1] + 1, e + 1) if ok[cuts[-1]][j] and can[k - 1][j]))
    return (*cuts, n)
