"""Pipeline schedules: which computation each rank runs in which order, for ``p`` ranks and ``m`` micro-batches.

The model is cut into ``n_stages = p * v`` stages; stage ``s`` lives on rank ``s % p`` (looped placement,
as Megatron: rank ``r`` holds stages ``r, r + p, r + 2p, ...``, its ``v`` model chunks). A builder is a
pure function of ``(p, m, v)`` returning one compute-only list per rank; :func:`pipeline_schedule`
picks one by name, and :class:`Schedule` validates it, adds the messages
(:func:`~hpctp.nn.pipeline_parallel.add_messages`) and validates the result. The step times below are for
unit costs (every ``F``, ``B``, ``W`` one unit; messages free), which
:func:`~hpctp.nn.pipeline_parallel.simulate` reproduces exactly; ``busy`` is each rank's
computation, the bubble fraction is ``1 - busy / step``.

``"gpipe"``
    All forwards, then all backwards (in the same micro-batch order). Step ``2 (m + p - 1)``, busy
    ``2m``: bubble ``(p - 1) / (m + p - 1)``; all ``m`` micro-batches in flight.
``"1f1b"``
    Rank ``r`` runs ``min(p - r - 1, m)`` warm-up forwards, then alternates one forward and one backward,
    then runs the remaining backwards. Same step and bubble as GPipe, at most ``min(p - r, m)``
    micro-batches in flight on rank ``r``.
``"interleaved"``
    Interleaved 1F1B over ``v`` chunks per rank (Narayanan et al. 2021). The micro-batches go in groups of
    at least ``p`` (``m // p`` groups, sizes as even as possible, larger first; one group of ``m`` when
    ``m < p``); inside a group, every chunk in turn runs the whole group. Rank ``r``'s forward order
    runs the groups one after the other, its backward order is the same with the chunks reversed, and
    it runs ``(p - r - 1) + (v - 1) g`` warm-up forwards (``g``: the first group's size), then one
    forward, one backward, then the remaining backwards (Megatron-LM warms up ``2 (p - r - 1) + (v - 1) p``
    forwards: the same step at unit costs when ``p`` divides ``m``, more chunks in flight). With a
    unit-time ``F`` and ``B`` per chunk the
    step is ``2 (v m + p - 1)`` for every ``m >= p`` (bubble ``(p - 1) / (v m + p - 1)``: ``v`` times
    less idle time than 1F1B's), and ``2 (v p + m - 1)`` for ``m < p`` (one micro-batch's path through
    all ``v p`` stages and back is then the bound). Chunk activations in flight on rank 0:
    ``min(v m, p + (v - 1) g)``, i.e. ``v p`` (``p`` stages' worth) when ``p`` divides ``m``.
``"zero_bubble"``
    ZB-H1 (Qi et al. 2024, arXiv 2401.10241): ``B`` computes the input gradient only and ``W`` the
    weight gradient. Rank ``r`` runs 1F1B's order of ``F`` and ``B``; it writes no ``W`` in its first
    ``r`` steady (forward, backward) pairs, then one after every ``B`` (for the oldest micro-batch
    waiting), and the ``r`` left over at the end. So every rank holds up to ``min(p, m)`` micro-batches
    (activations freed at ``W``), as many as 1F1B's rank 0, and the late ``W``'s fill 1F1B's cool-down
    bubbles. With ``F = B = W = 1`` the step is ``2m + p - 1 + max(m, p)``: ``3m + p - 1`` for
    ``m >= p`` (bubble ``(p - 1) / (3m + p - 1)``: a third of 1F1B's idle time at equal work, 1F1B's
    ``B`` costing ``B + W = 2`` and its step being ``3 (m + p - 1)``), and ``2 (m + p) - 1`` for ``m < p``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from ..._util.ints import is_int
from ._actions import Action, ActionKind
from ._lowering import add_messages
from ._simulate import Costs, Timeline, simulate
from ._validate import validate

__all__ = ["SCHEDULES", "Schedule", "pipeline_schedule"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
"""The names :func:`pipeline_schedule` builds."""

_Lists = tuple[tuple[Action, ...], ...]
_F, _B, _W = ActionKind.F, ActionKind.B, ActionKind.W


def _gpipe(p: int, m: int, v: int) -> _Lists:
    return tuple(
        tuple(Action(r, _F, i) for i in range(m)) + tuple(Action(r, _B, i) for i in range(m)) for r in range(p)
    )


def _one_f_one_b(p: int, m: int, v: int) -> _Lists:
    out = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        actions = [Action(r, _F, i) for i in range(warmup)]
        for k in range(m - warmup):
            actions += [Action(r, _F, warmup + k), Action(r, _B, k)]
        actions += [Action(r, _B, k) for k in range(m - warmup, m)]
        out.append(tuple(actions))
    return tuple(out)


def _groups(p: int, m: int) -> list[int]:
    """Sizes of the interleaved schedule's micro-batch groups: ``m // p`` groups of ``>= p``, larger first."""
    count = max(m // p, 1)
    size, extra = divmod(m, count)
    return [size + (g < extra) for g in range(count)]


def _interleaved(p: int, m: int, v: int) -> _Lists:
    sizes = _groups(p, m)
    forward: list[tuple[int, int]] = []  # (chunk, micro-batch), the same order on every rank
    first = 0
    for size in sizes:
        forward += [(c, i) for c in range(v) for i in range(first, first + size)]
        first += size
    backward = [(v - 1 - c, i) for c, i in forward]
    out = []
    for r in range(p):
        total = v * m
        warmup = min(p - r - 1 + (v - 1) * sizes[0], total)
        actions = [Action(c * p + r, _F, i) for c, i in forward[:warmup]]
        for (cf, i), (cb, j) in zip(forward[warmup:], backward):
            actions += [Action(cf * p + r, _F, i), Action(cb * p + r, _B, j)]
        actions += [Action(c * p + r, _B, i) for c, i in backward[total - warmup :]]
        out.append(tuple(actions))
    return tuple(out)


def _zero_bubble(p: int, m: int, v: int) -> _Lists:
    out = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        actions = [Action(r, _F, i) for i in range(warmup)]
        weights = 0  # W's written so far, in micro-batch order
        for k in range(m - warmup):
            actions += [Action(r, _F, warmup + k), Action(r, _B, k)]
            if k >= r:  # rank r delays its W's by r steady pairs: min(p, m) in flight on every rank
                actions.append(Action(r, _W, weights))
                weights += 1
        for k in range(m - warmup, m):
            actions += [Action(r, _B, k), Action(r, _W, weights)]
            weights += 1
        actions += [Action(r, _W, i) for i in range(weights, m)]
        out.append(tuple(actions))
    return tuple(out)


_BUILDERS: dict[str, Callable[[int, int, int], _Lists]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved": _interleaved,
    "zero_bubble": _zero_bubble,
}


@dataclass(frozen=True)
class Schedule:
    """Local. A validated pipeline schedule: each rank's computations, and the same with their messages.

    Build one with :func:`pipeline_schedule`; constructing one from hand-written ``compute_lists`` is
    allowed (any ``name``) and validated the same way. ``str(schedule)`` prints its table
    (:meth:`table`).

    Attributes
    ----------
    name : str
    p : int
        The number of ranks of the pipeline.
    m : int
        Micro-batches per step.
    v : int
        Stages (model chunks) per rank; stage ``s`` is on rank ``s % p``.
    compute_lists : tuple of tuple of Action
        ``compute_lists[r]``: rank ``r``'s ``F``, ``B`` (and ``W``) actions in order.
    action_lists : tuple of tuple of Action
        ``action_lists[r]``: the same with the sends and receives
        (:func:`~hpctp.nn.pipeline_parallel.add_messages`), what the runtime runs.

    Raises
    ------
    ValueError
        If the lists fail :func:`~hpctp.nn.pipeline_parallel.validate`, compute-only or lowered.
    """

    name: str
    p: int
    m: int
    v: int
    compute_lists: _Lists = field(repr=False)
    action_lists: _Lists = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_sizes(self.p, self.m, self.v)
        compute = tuple(tuple(actions) for actions in self.compute_lists)
        object.__setattr__(self, "compute_lists", compute)
        validate(compute, self.stage_ranks, self.m, lowered=False)
        lowered = add_messages(compute, self.stage_ranks)
        validate(lowered, self.stage_ranks, self.m, lowered=True)
        object.__setattr__(self, "action_lists", lowered)

    @property
    def n_stages(self) -> int:
        """Local. The number of stages, ``p * v``."""
        return self.p * self.v

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """Local. ``stage_ranks[s]``: the rank holding stage ``s`` (``s % p``)."""
        return tuple(s % self.p for s in range(self.n_stages))

    @cached_property
    def split_backward(self) -> bool:
        """Local. True when ``B`` is the input gradient only and ``W`` actions compute the weight gradients (found once:
        the runtime asks at every action)."""
        return any(a.kind is _W for actions in self.compute_lists for a in actions)

    def rank_of(self, stage: int) -> int:
        """Local. The rank holding ``stage``.

        Parameters
        ----------
        stage : int
            In ``range(n_stages)``.

        Returns
        -------
        int

        Raises
        ------
        ValueError
            If ``stage`` is out of range.
        """
        if not (is_int(stage) and 0 <= stage < self.n_stages):
            raise ValueError(
                f"stage must be an int in 0 .. {self.n_stages - 1} (p={self.p} ranks x v={self.v} chunks), got {stage!r}"
            )
        return int(stage) % self.p

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Local. The stages on ``rank``, in order: ``rank, rank + p, ...`` (its model chunks 0 .. v-1).

        Parameters
        ----------
        rank : int
            In ``range(p)``.

        Returns
        -------
        tuple of int

        Raises
        ------
        ValueError
            If ``rank`` is out of range.
        """
        return tuple(range(self._rank(rank), self.n_stages, self.p))

    def actions(self, rank: int) -> tuple[Action, ...]:
        """Local. Rank ``rank``'s actions with the messages: what its runtime executes, in order.

        Parameters
        ----------
        rank : int

        Returns
        -------
        tuple of Action

        Raises
        ------
        ValueError
            If ``rank`` is out of range.
        """
        return self.action_lists[self._rank(rank)]

    def compute(self, rank: int) -> tuple[Action, ...]:
        """Local. Rank ``rank``'s computations only (``F``, ``B``, ``W``), in order.

        Parameters
        ----------
        rank : int

        Returns
        -------
        tuple of Action

        Raises
        ------
        ValueError
            If ``rank`` is out of range.
        """
        return self.compute_lists[self._rank(rank)]

    def gradients_done(self, stage: int) -> Action:
        """Local. The action after which ``stage``'s weight gradients are complete on its rank.

        Its last ``W`` when the schedule splits the backward, else its last ``B``: from there on the
        runtime may reduce the stage's gradients (data parallel, ZeRO) while later actions run.

        Parameters
        ----------
        stage : int
            In ``range(n_stages)``.

        Returns
        -------
        Action

        Raises
        ------
        ValueError
            If ``stage`` is out of range.
        """
        last = _W if self.split_backward else _B
        return next(a for a in reversed(self.compute(self.rank_of(stage))) if a.stage == stage and a.kind is last)

    def simulate(self, costs: Costs = None, latency: float = 0.0) -> Timeline:
        """Local. The dry run of the lowered lists (:func:`~hpctp.nn.pipeline_parallel.simulate`).

        Parameters
        ----------
        costs : None, mapping or callable
            Action durations, as :func:`~hpctp.nn.pipeline_parallel.simulate` takes them; default
            one unit per ``F``, ``B``, ``W``.
        latency : float
            A message's flight time.

        Returns
        -------
        Timeline
        """
        return simulate(self.action_lists, costs, latency)

    def table(self) -> str:
        """Local. The computations as a time x rank table at unit costs, bubbles blank.

        Returns
        -------
        str
        """
        return self.simulate().table()

    def _rank(self, rank: int) -> int:
        if not (is_int(rank) and 0 <= rank < self.p):
            raise ValueError(f"rank must be an int in 0 .. {self.p - 1}, got {rank!r}")
        return int(rank)

    def __str__(self) -> str:
        return f"{self.name} schedule: p={self.p} ranks, m={self.m} micro-batches, v={self.v} stages per rank\n{self.table()}"


def _check_sizes(p: object, m: object, v: object) -> None:
    for name, value, what in (("p", p, "ranks"), ("m", m, "micro-batches"), ("v", v, "stages (model chunks) per rank")):
        if not is_int(value):
            raise TypeError(f"{name} (the number of {what}) must be an int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name} (the number of {what}) must be >= 1, got {value}: use {name} >= 1")


def pipeline_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Local. The named schedule for ``p`` ranks, ``m`` micro-batches and ``v`` stages per rank, validated.

    Pure and cached: every rank computes the same schedule from the same arguments. Every schedule runs
    any ``m >= 1``; :mod:`hpctp.nn.pipeline_parallel.schedules` describes each one and its step time.

    Parameters
    ----------
    name : {"gpipe", "1f1b", "interleaved", "zero_bubble"}
        The schedule (:data:`SCHEDULES`).
    p : int
        Ranks, ``>= 1``.
    m : int
        Micro-batches per step, ``>= 1``.
    v : int
        Stages (model chunks) per rank, ``>= 1``; only ``"interleaved"`` takes ``v > 1``.

    Returns
    -------
    Schedule

    Raises
    ------
    ValueError
        For an unknown ``name``, ``p``, ``m`` or ``v`` below 1, or ``v > 1`` with a schedule other than
        ``"interleaved"``.
    TypeError
        If ``p``, ``m`` or ``v`` is not an int.
    """
    if not isinstance(name, str) or name not in _BUILDERS:
        raise ValueError(f"unknown pipeline schedule {name!r}: use one of {', '.join(SCHEDULES)}")
    _check_sizes(p, m, v)
    if v > 1 and name != "interleaved":
        raise ValueError(
            f"the {name!r} schedule holds one stage per rank, got v={v}: use v=1, or name='interleaved' for {v} stages per rank"
        )
    return _schedule(name, int(p), int(m), int(v))


@lru_cache(maxsize=64)
def _schedule(name: str, p: int, m: int, v: int) -> Schedule:
    return Schedule(name, p, m, v, _BUILDERS[name](p, m, v))
