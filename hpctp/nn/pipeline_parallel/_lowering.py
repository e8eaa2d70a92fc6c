"""Lowering: from compute-only lists to lists with the messages between neighbouring stages.

:func:`add_messages` rewrites each rank's list of ``F``/``B``/``W`` actions. A stage's neighbour on the
same rank needs no message (one rank holding consecutive stages: ``p == 1``); for one on another rank:

* the producer's side: ``SEND_F`` right after each ``F`` of a stage with a next stage, ``SEND_B`` right
  after each ``B`` of a stage with a previous stage;
* the consumer's side: ``RECV_F`` before the ``F`` of a stage with a previous stage, ``RECV_B`` before
  the ``B`` of a stage with a next stage.

[Note: message order] Messages of one kind from rank ``a`` to rank ``b`` form a channel, and the
receives are written into ``b``'s list in the order ``a`` sends, so that the k-th send matches the
k-th receive (MPI's order for one source and tag) and no message waits in a queue behind one that
the receiver cannot take yet. Each receive goes right before the first computation on ``b`` that needs
it or any message sent after it on the channel: right before its own consumer when both ranks
handle the micro-batches in the same order, as every schedule of
:func:`~hpctp.nn.pipeline_parallel.pipeline_schedule` builds; earlier (into a buffer) otherwise. Receives that
land at the same place keep the order of the sends on their source.

The pass only inserts: the computations keep their order, so a list that runs without messages
runs with them (:func:`~hpctp.nn.pipeline_parallel.simulate` checks it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from ._actions import Action, ActionKind

__all__ = ["add_messages", "strip_messages"]

_Lists = tuple[tuple[Action, ...], ...]


def strip_messages(lists: Sequence[Sequence[Action]]) -> _Lists:
    """Local. The lists with only their computations (``F``, ``B``, ``W``): the inverse of :func:`add_messages`.

    Parameters
    ----------
    lists : sequence of sequences of Action

    Returns
    -------
    tuple of tuple of Action
    """
    return tuple(tuple(a for a in actions if a.kind.is_compute) for actions in lists)


def add_messages(lists: Sequence[Sequence[Action]], stage_ranks: Sequence[int]) -> _Lists:
    """Local. The compute-only ``lists`` with the sends and receives between stages on different ranks.

    Parameters
    ----------
    lists : sequence of sequences of Action
        ``lists[r]``: rank ``r``'s computations in order (``F``, ``B``, ``W`` only).
    stage_ranks : sequence of int
        ``stage_ranks[s]``: the rank that holds stage ``s`` (its length is the number of stages).

    Returns
    -------
    tuple of tuple of Action
        The lowered lists; see the module docstring for where each message goes.

    Raises
    ------
    ValueError
        If a list already has messages, or holds an action of a stage out of range or of another rank, or
        the number of lists is not the number of ranks in ``stage_ranks``.
    """
    n_stages = len(stage_ranks)
    if len(lists) != max(stage_ranks, default=-1) + 1:
        raise ValueError(f"{len(lists)} lists for stages placed on ranks {tuple(stage_ranks)}: give one list per rank")
    for rank, actions in enumerate(lists):
        for a in actions:
            if not a.kind.is_compute:
                raise ValueError(
                    f"rank {rank}'s list already has message {a}: lower compute-only lists (strip_messages first)"
                )
            if not 0 <= a.stage < n_stages or stage_ranks[a.stage] != rank:
                raise ValueError(
                    f"rank {rank}'s list has {a}, but stage {a.stage} is not on rank {rank} (stage ranks {tuple(stage_ranks)})"
                )

    # the producers' side, and each channel's sends in order: (receive kind, source, destination) ->
    # [(index of the producing computation on the source, the matching receive)]
    sends: list[list[Action | None]] = []
    channels: dict[tuple[ActionKind, int, int], list[tuple[int, Action]]] = defaultdict(list)
    for rank, actions in enumerate(lists):
        after: list[Action | None] = []
        for k, a in enumerate(actions):
            message = _message(a, rank, stage_ranks)
            after.append(None if message is None else message[0])
            if message is not None:
                _, recv, dest = message
                channels[(recv.kind, rank, dest)].append((k, recv))
        sends.append(after)

    # the consumers' side, [Note: message order]: each receive right before the first consumer of it
    # or of a later message on its channel
    inserts: list[dict[int, list[tuple[int, int, Action]]]] = [defaultdict(list) for _ in lists]
    for (_, source, dest), items in channels.items():
        position = {a: k for k, a in enumerate(lists[dest])}
        place = len(lists[dest])
        for k, recv in reversed(items):
            place = min(place, position.get(Action(recv.stage, recv.kind.carries, recv.microbatch), place))
            inserts[dest][place].append((k, source, recv))

    lowered = []
    for rank, actions in enumerate(lists):
        merged: list[Action] = []
        for k in range(len(actions) + 1):
            merged += [recv for _, _, recv in sorted(inserts[rank].get(k, ()), key=lambda item: item[:2])]
            if k < len(actions):
                merged.append(actions[k])
                send = sends[rank][k]
                if send is not None:
                    merged.append(send)
        lowered.append(tuple(merged))
    return tuple(lowered)


def _message(action: Action, rank: int, stage_ranks: Sequence[int]) -> tuple[Action, Action, int] | None:
    """(send, matching receive, destination rank) of the message after ``action`` on ``rank``, or None."""
    s, i = action.stage, action.microbatch
    if action.kind is ActionKind.F:
        peer = s + 1
        if peer < len(stage_ranks) and stage_ranks[peer] != rank:
            return Action(s, ActionKind.SEND_F, i), Action(peer, ActionKind.RECV_F, i), stage_ranks[peer]
    elif action.kind is ActionKind.B:
        peer = s - 1
        if peer >= 0 and stage_ranks[peer] != rank:
            return Action(s, ActionKind.SEND_B, i), Action(peer, ActionKind.RECV_B, i), stage_ranks[peer]
    return None
