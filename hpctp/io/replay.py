"""The decisions of online training, as pure functions of counts and a seed: which slot of the replay
buffer a training pair goes to (eviction), which slots a training step draws, which pairs are kept
aside for evaluation, and after how many simulation snapshots each training step may run.

Nothing here depends on the number of ranks, on timing or on the data: every trainer rank evaluates
the same functions of the same counts, so every rank stores and draws the same pairs, and a run on
2 trainer ranks draws exactly the samples of a run on 4 (:class:`hpctp.io.Stream` holds the data).

Eviction (:class:`ReplayPlan`)
    Pairs are numbered ``k = 0, 1, ...`` in the order they reach the buffer. ``"window"`` keeps the
    last ``capacity`` pairs (pair ``k`` replaces pair ``k - capacity`` in slot ``k % capacity``);
    ``"reservoir"`` keeps a uniform sample of every pair seen so far (Vitter's algorithm R: pair
    ``k >= capacity`` goes to slot ``j = floor(u_k (k + 1))`` if ``j < capacity``, else is not
    kept), with ``u_k`` the counter-based uniform of :mod:`hpctp.random` at index ``k``, so the
    decision for pair ``k`` needs no state.

Draws
    Step ``s`` draws ``min(batch_size, filled)`` distinct slots of the filled ones with
    ``numpy.random.default_rng([seed, 1, s])`` (as :class:`hpctp.io.FieldLoader` draws an epoch's
    order), sorted.

Schedule (:class:`TrainingSchedule`)
    ``steps`` optimizer steps spread over ``snapshots`` expected snapshots: step ``s`` runs once
    ``need(s) = min(snapshots, max(start, ceil((s + 1) snapshots / steps)))`` snapshots have been
    produced (evenly; ``ramp`` puts fewer steps on the first snapshots, ``tail`` keeps a share of the
    steps for after the last one). Dropped snapshots count, so thinning does not stall the trainer, and
    a simulation that stops after ``p`` snapshots leaves ``allowed(p)`` steps trained on what it produced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._util.ints import is_int
from ..tensor.random import block_uniform

__all__ = ["EVICTIONS", "ReplayPlan", "TrainingSchedule", "held_out", "pairs_before", "snapshots_for_pairs"]

EVICTIONS = ("reservoir", "window")
"""The eviction policies of :class:`ReplayPlan`."""

_INDEX_SPACE = 2**62  # the flat index space of the counter-based uniforms (pair numbers)


def _check_count(name: str, value: object, low: int) -> int:
    if not is_int(value) or int(value) < low:  # type: ignore[call-overload]
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)  # type: ignore[call-overload]


@dataclass(frozen=True)
class ReplayPlan:
    """Local. Where each training pair goes in a buffer of ``capacity`` slots, and what a step draws.

    Parameters
    ----------
    capacity : int
        Slots (pairs held at once), >= 1.
    eviction : {"reservoir", "window"}
        See the module docstring.
    seed : int
        Seed of the reservoir's and the draws' random numbers, in ``[0, 2**63)``.

    Raises
    ------
    ValueError
        On a capacity < 1, an unknown eviction or a bad seed.
    """

    capacity: int
    eviction: str = "reservoir"
    seed: int = 0

    def __post_init__(self) -> None:
        _check_count("capacity", self.capacity, 1)
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction={self.eviction!r} must be one of {EVICTIONS}")
        if not is_int(self.seed) or not 0 <= int(self.seed) < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")

    def slots(self, start: int, stop: int) -> np.ndarray:
        """Local. The slot of each pair ``k`` in ``[start, stop)`` (int64; -1: not kept)."""
        start, stop = _check_count("start", start, 0), _check_count("stop", stop, 0)
        k = np.arange(start, max(start, stop), dtype=np.int64)
        if self.eviction == "window":
            return k % self.capacity
        out = k.copy()
        late = k >= self.capacity
        if late.any():
            first = int(k[late][0])
            u = block_uniform((_INDEX_SPACE,), [(first, int(k[-1]) + 1)], self.seed)
            j = np.floor(u * (k[late] + 1).astype(np.float64)).astype(np.int64)
            out[late] = np.where(j < self.capacity, j, -1)
        return out

    def slot(self, k: int) -> int | None:
        """Local. The slot pair ``k`` goes to, or None if it is not kept (a reservoir's skip)."""
        s = int(self.slots(k, k + 1)[0])
        return None if s < 0 else s

    def filled(self, pairs: int) -> int:
        """Local. Slots holding a pair after ``pairs`` pairs arrived."""
        return min(_check_count("pairs", pairs, 0), self.capacity)

    def contents(self, pairs: int) -> np.ndarray:
        """Local. The pair number in each slot after ``pairs`` pairs arrived (-1: empty), replayed
        from the decisions (for tests and printing; the buffer keeps its own table)."""
        out = np.full(self.capacity, -1, dtype=np.int64)
        for k, s in enumerate(self.slots(0, pairs)):
            if s >= 0:
                out[s] = k
        return out

    def draw(self, step: int, pairs: int, batch_size: int) -> np.ndarray:
        """Local. The slots (sorted) that training step ``step`` reads when ``pairs`` pairs have arrived.

        Raises
        ------
        ValueError
            If the buffer is empty, or an argument is negative.
        """
        step = _check_count("step", step, 0)
        batch_size = _check_count("batch_size", batch_size, 1)
        filled = self.filled(pairs)
        if filled == 0:
            raise ValueError("the replay buffer is empty: no training pair has arrived yet")
        rng = np.random.default_rng([int(self.seed), 1, step])
        return np.sort(rng.choice(filled, size=min(batch_size, filled), replace=False)).astype(np.int64)


def held_out(index: int, every: int) -> bool:
    """Local. True if the pair starting at snapshot ``index`` is kept aside for evaluation: every
    ``every``-th pair (``index % every == every - 1``, as :func:`apps.surrogate.data.split_indices`
    with ``every = round(1 / holdout)``); ``every = 0`` keeps none aside."""
    return every > 0 and index % every == every - 1


def pairs_before(snapshots: int, horizon: int, every: int) -> int:
    """Local. Training pairs (not held out) formed from the first ``snapshots`` snapshots with targets
    ``horizon`` snapshots later (``horizon = 0``: each snapshot is a pair)."""
    n = max(0, snapshots - horizon)
    return n - (n // every if every > 0 else 0)


def snapshots_for_pairs(pairs: int, horizon: int, every: int) -> int:
    """Local. The fewest snapshots whose :func:`pairs_before` is at least ``pairs``."""
    if pairs <= 0:
        return 0
    p = pairs + horizon  # (a lower bound: each pair needs its target, `horizon` snapshots later)
    while pairs_before(p, horizon, every) < pairs:
        p += 1
    return p


@dataclass(frozen=True)
class TrainingSchedule:
    """Local. After how many produced snapshots each of ``steps`` training steps may run.

    Parameters
    ----------
    steps : int
        The budget of optimizer steps, >= 1.
    snapshots : int
        Snapshots the simulation is expected to produce, >= 1.
    start : int
        Snapshots needed before the first step (e.g. :func:`snapshots_for_pairs` of a batch).
    ramp : float
        ``>= 1``: step ``s`` needs ``snapshots ((s + 1) / steps) ** (1 / ramp)`` snapshots, so the
        steps per snapshot grow like ``snapshots ** (ramp - 1)``: 1 spreads them evenly, 2 in
        proportion to the pairs there are to draw from (fewer steps on the first few pairs).
    tail : float
        Share of the steps, in ``[0, 1)``, that run after the last expected snapshot (on the whole
        buffer); the others are spread over the snapshots.

    Raises
    ------
    ValueError
        On counts < 1 (``start`` < 0), ``ramp < 1`` or ``tail`` outside ``[0, 1)``.
    """

    steps: int
    snapshots: int
    start: int = 1
    ramp: float = 1.0
    tail: float = 0.0

    def __post_init__(self) -> None:
        _check_count("steps", self.steps, 1)
        _check_count("snapshots", self.snapshots, 1)
        _check_count("start", self.start, 0)
        if not (isinstance(self.ramp, (int, float)) and self.ramp >= 1.0):
            raise ValueError(f"ramp must be a number >= 1, got {self.ramp!r}")
        if not (isinstance(self.tail, (int, float)) and 0.0 <= self.tail < 1.0):
            raise ValueError(f"tail must be in [0, 1), got {self.tail!r}")

    @property
    def during(self) -> int:
        """Local. The steps spread over the snapshots (the others run after the last one)."""
        return max(1, self.steps - int(round(self.tail * self.steps)))

    def need(self, step: int) -> int:
        """Local. Snapshots produced before step ``step`` may run."""
        step = _check_count("step", step, 0)
        if step >= self.during:
            return self.snapshots
        if self.ramp == 1.0:  # (exact integers)
            even = -(-(step + 1) * self.snapshots // self.during)
        else:
            even = math.ceil(self.snapshots * ((step + 1) / self.during) ** (1.0 / self.ramp) - 1e-9)
        return min(self.snapshots, max(self.start, even))

    def allowed(self, produced: int) -> int:
        """Local. How many steps may have run once ``produced`` snapshots were produced (all
        ``steps`` once the expected count is reached): the steps ``s`` with ``need(s) <= produced``."""
        produced = _check_count("produced", produced, 0)
        if produced >= self.snapshots:
            return self.steps
        lo, hi = 0, self.steps  # need() does not decrease: the first step that needs more
        while lo < hi:
            mid = (lo + hi) // 2
            if self.need(mid) <= produced:
                lo = mid + 1
            else:
                hi = mid
        return lo
