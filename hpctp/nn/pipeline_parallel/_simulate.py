"""A dry run of every rank's action list: start and end of each action, step time, bubbles, memory.

Each rank runs its list in order, one action at a time, and an action starts when the rank has
finished the one before it and the action's inputs exist (the longest path through the DAG that the
lists and the data dependencies form, so the result does not depend on the order ranks are visited):

* ``F(s, i)`` needs ``F(s-1, i)``; ``B(s, i)`` needs ``F(s, i)`` and ``B(s+1, i)``; ``W(s, i)`` needs
  ``B(s, i)``. A dependency on another rank's action adds the message ``latency``.
* ``SEND_F(s, i)`` needs ``F(s, i)`` and ``SEND_B(s, i)`` needs ``B(s, i)``; a send never waits for its
  receiver (the runtime posts it non-blocking and completes it before reusing the buffer).
* ``RECV_F(s, i)`` waits for ``SEND_F(s-1, i)`` and ``RECV_B(s, i)`` for ``SEND_B(s+1, i)``, plus
  ``latency``.

Lists with or without the messages of :func:`~hpctp.nn.pipeline_parallel.add_messages` both run: without
them the compute dependencies alone carry the latency. Costs default to one time unit per
computation and zero per message. When no rank can start its next action the lists deadlock, and
:func:`simulate` raises "not progressing" with the table of lists, the stuck actions marked.

The micro-batches in flight on a rank are those whose ``F`` has run and whose activations are still
held: until ``B`` (``W`` when the lists contain ``W`` actions, i.e. a zero-bubble schedule). With
several stages per rank each (stage, micro-batch) pair counts once, i.e. in units of one stage's
activations.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

from ._actions import Action, ActionKind, format_table

__all__ = ["Span", "Timeline", "simulate"]

# per-action durations: None (one unit per F, B, W; messages free), a mapping from kind (or its name) to a
# duration or to a sequence of durations per stage (kinds left out keep the default), or a callable
Costs: TypeAlias = Mapping[ActionKind | str, float | Sequence[float]] | Callable[[Action], float] | None

_Key: TypeAlias = tuple[ActionKind, int, int]


class Span(NamedTuple):
    """Local. When one action ran: ``start <= end``, in the cost unit."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Local. The result of :func:`simulate`: every rank's actions with start and end times.

    Attributes
    ----------
    spans : tuple of tuple of Span
        ``spans[r]``: rank ``r``'s actions in the order it ran them (its list's order).
    peaks : tuple of int
        ``peaks[r]``: the most micro-batches in flight on rank ``r`` (see :meth:`peak_in_flight`).
    latency : float
        The message latency the run used.
    """

    spans: tuple[tuple[Span, ...], ...]
    peaks: tuple[int, ...]
    latency: float = 0.0

    @property
    def p(self) -> int:
        """Local. The number of ranks."""
        return len(self.spans)

    @property
    def step(self) -> float:
        """Local. The step time (makespan): the last end over all ranks; every rank starts at 0."""
        return max((s.end for spans in self.spans for s in spans), default=0.0)

    def start(self, rank: int, action: Action) -> float:
        """Local. When ``action`` started on ``rank``.

        Parameters
        ----------
        rank : int
        action : Action

        Returns
        -------
        float

        Raises
        ------
        KeyError
            If ``rank`` did not run ``action``.
        """
        for span in self.spans[rank]:
            if span.action == action:
                return span.start
        raise KeyError(f"rank {rank} did not run {action}")

    def busy(self, rank: int) -> float:
        """Local. Time rank ``rank`` spent computing (``F``, ``B``, ``W``; messages not counted).

        Parameters
        ----------
        rank : int

        Returns
        -------
        float
        """
        return sum(s.end - s.start for s in self.spans[rank] if s.action.kind.is_compute)

    def idle(self, rank: int) -> float:
        """Local. The step time less the time rank ``rank`` computed: its bubbles, start and end included.

        Parameters
        ----------
        rank : int

        Returns
        -------
        float
        """
        return self.step - self.busy(rank)

    @property
    def bubble_fraction(self) -> float:
        """Local. Idle time over all ranks divided by ``p * step`` (0 for an empty run)."""
        step = self.step
        return sum(self.idle(r) for r in range(self.p)) / (self.p * step) if step > 0 else 0.0

    def peak_in_flight(self, rank: int) -> int:
        """Local. The most micro-batches whose activations rank ``rank`` held at once.

        Counted along the rank's list: one more at each ``F``, one less at the action that frees the
        activations (``B``; ``W`` in zero-bubble lists). With several stages per rank, one per
        (stage, micro-batch) pair.

        Parameters
        ----------
        rank : int

        Returns
        -------
        int
        """
        return self.peaks[rank]

    def table(self) -> str:
        """Local. The computations as a time x rank table: a row per start or end time, blanks for bubbles.

        A cell holds the action that starts at that row's time (``|`` while a longer one continues);
        zero-length actions starting together are joined by ``+``. Messages are not shown.

        Returns
        -------
        str
        """
        compute = [[s for s in spans if s.action.kind.is_compute] for spans in self.spans]
        times = sorted({t for spans in compute for s in spans for t in (s.start, s.end)})
        rows = times[:-1] if len(times) > 1 else times
        columns: list[list[str | None]] = []
        for spans in compute:
            column: list[str | None] = []
            for t in rows:
                starting = [str(s.action) for s in spans if s.start == t]
                running = any(s.start < t < s.end for s in spans)
                column.append("+".join(starting) if starting else ("|" if running else None))
            columns.append(column)
        return format_table(columns, row_labels=[f"{t:g}" for t in rows], corner="time")


def _cost_function(costs: Costs) -> Callable[[Action], float]:
    if costs is None or isinstance(costs, Mapping):
        table = {ActionKind(k) if isinstance(k, str) else k: v for k, v in (costs or {}).items()}

        def cost(action: Action) -> float:
            value = table.get(action.kind, 1.0 if action.kind.is_compute else 0.0)
            if isinstance(value, Sequence):
                if action.stage >= len(value):
                    raise ValueError(
                        f"costs[{action.kind}] has {len(value)} per-stage values, but {action} is on stage {action.stage}: give one per stage"
                    )
                return float(value[action.stage])
            return float(value)

        return cost
    if callable(costs):
        return costs
    raise TypeError(f"costs must be None, a mapping from kind to duration(s) or a callable, got {type(costs).__name__}")


def _dependencies(action: Action, last_stage: int) -> list[_Key]:
    """What ``action`` waits for, as (kind, stage, micro-batch) keys of other actions."""
    s, kind, i = action
    K = ActionKind
    if kind is K.F:
        return [(K.F, s - 1, i)] if s > 0 else []
    if kind is K.B:
        return [(K.F, s, i)] + ([(K.B, s + 1, i)] if s < last_stage else [])
    if kind is K.W:
        return [(K.B, s, i)]
    if kind is K.SEND_F:
        return [(K.F, s, i)]
    if kind is K.SEND_B:
        return [(K.B, s, i)]
    if kind is K.RECV_F:
        return [(K.SEND_F, s - 1, i)]
    return [(K.SEND_B, s + 1, i)]  # RECV_B


def _stage_ranks(lists: Sequence[Sequence[Action]]) -> dict[int, int]:
    """The rank of each stage: where its computations are (a stage computed on two ranks is an error)."""
    where: dict[int, int] = {}
    for rank, actions in enumerate(lists):
        for a in actions:
            if a.kind.is_compute and where.setdefault(a.stage, rank) != rank:
                raise ValueError(
                    f"stage {a.stage} computes on ranks {where[a.stage]} and {rank}: each stage lives on one rank\n{format_table(lists)}"
                )
    return where


def simulate(lists: Sequence[Sequence[Action]], costs: Costs = None, latency: float = 0.0) -> Timeline:
    """Local. Run every rank's action list with the given durations; see the module docstring for the rules.

    Parameters
    ----------
    lists : sequence of sequences of Action
        ``lists[r]``: rank ``r``'s actions, in order, with or without messages.
    costs : None, mapping or callable
        Action durations: None for one unit per ``F``, ``B``, ``W`` and zero per message; a mapping from
        kind (or its name) to a duration or to one duration per stage, kinds left out keeping the
        default: ``{"B": 2}`` for a backward that costs two forwards, ``{"F": [1, 1, 2], "B": [2, 2, 4]}``
        per stage; or a callable ``action -> duration``.
    latency : float
        Added to every dependency between actions on different ranks (a message's flight time).

    Returns
    -------
    Timeline

    Raises
    ------
    ValueError
        "not progressing" when no rank can start its next action (a deadlock), with the table of the
        lists and each rank's stuck action marked; a stage computed on two ranks; a negative or
        non-finite cost or latency.
    TypeError
        If ``costs`` is of none of the accepted types.
    """
    if not (math.isfinite(latency) and latency >= 0):
        raise ValueError(f"latency must be a finite number >= 0, got {latency!r}")
    cost = _cost_function(costs)
    stage_rank = _stage_ranks(lists)
    last_stage = max(stage_rank, default=0)
    frees = ActionKind.W if any(a.kind is ActionKind.W for actions in lists for a in actions) else ActionKind.B

    done: dict[_Key, float] = {}  # (kind, stage, micro-batch) -> end time
    position = [0] * len(lists)  # each rank's next action
    clock = [0.0] * len(lists)  # when each rank finished its last action
    spans: list[list[Span]] = [[] for _ in lists]

    def start_time(rank: int, action: Action) -> float | None:
        """When ``action`` can start on ``rank``; None while one of its inputs does not exist yet."""
        start = clock[rank]
        for key in _dependencies(action, last_stage):
            if key not in done:
                return None
            remote = key[0].is_send or stage_rank.get(key[1], rank) != rank
            start = max(start, done[key] + (latency if remote else 0.0))
        return start

    remaining = sum(len(actions) for actions in lists)
    while remaining:
        progressed = False
        for rank, actions in enumerate(lists):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                start = start_time(rank, action)
                if start is None:
                    break
                duration = cost(action)
                if not (math.isfinite(duration) and duration >= 0):
                    raise ValueError(f"the cost of {action} must be a finite number >= 0, got {duration!r}")
                done[(action.kind, action.stage, action.microbatch)] = clock[rank] = start + duration
                spans[rank].append(Span(action, start, start + duration))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [(r, position[r]) for r in range(len(lists)) if position[r] < len(lists[r])]
            waits = "; ".join(f"rank {r} at {lists[r][i]} (step {i})" for r, i in stuck)
            raise ValueError(
                f"not progressing: no rank can run its next action ({waits}); the lists deadlock\n{format_table(lists, marks=stuck)}"
            )

    peaks = []
    for rank_spans in spans:
        held = peak = 0
        for span in rank_spans:
            held += (span.action.kind is ActionKind.F) - (span.action.kind is frees)
            peak = max(peak, held)
        peaks.append(peak)
    return Timeline(tuple(tuple(s) for s in spans), tuple(peaks), float(latency))
