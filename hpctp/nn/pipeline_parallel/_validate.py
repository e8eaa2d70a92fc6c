"""The validator: checks per-rank action lists before anything runs them.

:func:`validate` raises a :class:`ValueError` on the first problem, its message naming the rank, the
step and the actions involved, followed by the lists as a table (:func:`~hpctp.nn.pipeline_parallel.format_table`)
with the failing cells marked ``>like this<``. In order:

1. every rank has a list, and every rank holds a stage;
2. every action names a stage of this rank and a micro-batch in ``range(m)``; compute-only lists hold
   no messages;
3. every (stage, micro-batch) has exactly one ``F`` and one ``B``, and either every one or none has a
   ``W`` (a zero-bubble schedule splits every backward);
4. on the stage's rank, ``F`` comes before ``B``, and ``B`` before ``W``;
5. lowered lists only: every message that :func:`~hpctp.nn.pipeline_parallel.add_messages`
   would write is there exactly once, and no other: a send after the computation whose result it
   carries, a receive before the computation that uses it;
6. lowered lists only: on each channel (messages of one kind from one rank to another) the sends and
   the receives name the same micro-batches in the same order ([Note: message order] in the lowering,
   :func:`~hpctp.nn.pipeline_parallel.add_messages`);
7. the data dependencies are satisfiable in the lists' orders: the dry run of
   :func:`~hpctp.nn.pipeline_parallel.simulate` progresses to the end.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from ._actions import Action, ActionKind, format_table
from ._simulate import simulate

__all__ = ["validate"]

_K = ActionKind


def _fail(message: str, columns: Sequence[Sequence[Action]], marks: Sequence[tuple[int, int]] = ()) -> ValueError:
    return ValueError(f"invalid pipeline schedule: {message}\n{format_table(columns, marks=marks)}")


def validate(
    lists: Sequence[Sequence[Action]] | Mapping[int, Sequence[Action]],
    stage_ranks: Sequence[int],
    m: int,
    *,
    lowered: bool,
) -> None:
    """Local. Check per-rank action lists; see the module docstring for what is checked and in which order.

    Parameters
    ----------
    lists : sequence of sequences of Action, or mapping from rank to sequence
        Each rank's actions in order; a mapping must have every rank ``0 .. p-1`` as a key.
    stage_ranks : sequence of int
        ``stage_ranks[s]``: the rank holding stage ``s``; ranks are ``0 .. p-1``.
    m : int
        The number of micro-batches.
    lowered : bool
        True for lists with messages (checked for exactly the messages that the stages' placement
        needs), False for compute-only lists (a message in them is an error).

    Raises
    ------
    ValueError
        On the first problem found, with the table of the lists and the failing steps marked.
    """
    p = max(stage_ranks, default=-1) + 1
    if isinstance(lists, Mapping):
        missing = [r for r in range(p) if r not in lists]
        if missing:
            raise ValueError(
                f"invalid pipeline schedule: no list for rank(s) {missing}; give one list per rank 0 .. {p - 1}"
            )
        extra = sorted(set(lists) - set(range(p)))
        if extra:
            raise ValueError(
                f"invalid pipeline schedule: lists for rank(s) {extra}, which hold no stage (stage ranks {tuple(stage_ranks)})"
            )
        columns = [tuple(lists[r]) for r in range(p)]
    else:
        columns = [tuple(actions) for actions in lists]
    if len(columns) != p or sorted(set(stage_ranks)) != list(range(p)):
        raise _fail(
            f"{len(columns)} lists for stages placed on ranks {tuple(stage_ranks)}: give one list per rank 0 .. {p - 1}, and every rank at least one stage",
            columns,
        )
    n_stages = len(stage_ranks)

    # 2. each action belongs where it is
    where: dict[Action, list[tuple[int, int]]] = defaultdict(list)
    for rank, actions in enumerate(columns):
        for step, a in enumerate(actions):
            if not isinstance(a, Action):
                raise TypeError(f"rank {rank} step {step}: {a!r} is not an Action")
            if not 0 <= a.stage < n_stages:
                raise _fail(
                    f"rank {rank} step {step}: {a} names stage {a.stage}, but the stages are 0 .. {n_stages - 1}",
                    columns,
                    [(rank, step)],
                )
            if stage_ranks[a.stage] != rank:
                raise _fail(
                    f"rank {rank} step {step}: {a} is on stage {a.stage}, which rank {stage_ranks[a.stage]} holds",
                    columns,
                    [(rank, step)],
                )
            if not 0 <= a.microbatch < m:
                raise _fail(
                    f"rank {rank} step {step}: {a} names micro-batch {a.microbatch}, but the micro-batches are 0 .. {m - 1}",
                    columns,
                    [(rank, step)],
                )
            if not lowered and not a.kind.is_compute:
                raise _fail(f"rank {rank} step {step}: message {a} in a compute-only list", columns, [(rank, step)])
            where[a].append((rank, step))

    # 3. one F, one B and none or one W per (stage, micro-batch)
    for a, places in where.items():
        if len(places) > 1:
            raise _fail(
                f"{a} appears {len(places)} times (steps {[s for _, s in places]} of rank {places[0][0]}); each action runs once",
                columns,
                places,
            )
    split = any(a.kind is _K.W for a in where)
    kinds = (_K.F, _K.B, _K.W) if split else (_K.F, _K.B)
    for s in range(n_stages):
        rank = stage_ranks[s]
        for i in range(m):
            for kind in kinds:
                if Action(s, kind, i) not in where:
                    why = " (the lists split the backward: every B needs its W)" if kind is _K.W else ""
                    raise _fail(f"rank {rank} has no {Action(s, kind, i)}{why}", columns, [(rank, len(columns[rank]))])

    # 4. F before B before W on the stage's rank
    for s in range(n_stages):
        for i in range(m):
            steps = [where[Action(s, kind, i)][0] for kind in kinds]
            for (rank, before), (_, after), first, then in zip(steps, steps[1:], kinds, kinds[1:]):
                if after < before:
                    raise _fail(
                        f"rank {rank} step {after}: {Action(s, then, i)} comes before {Action(s, first, i)} (step {before})",
                        columns,
                        [(rank, after), (rank, before)],
                    )

    if lowered:
        _check_messages(columns, stage_ranks, m, where)

    # 7. the dependencies can be met in the lists' orders (raises "not progressing" with the table)
    simulate(columns)


def _expected_messages(stage_ranks: Sequence[int], m: int) -> list[tuple[Action, Action, Action, Action]]:
    """(producer, send, receive, consumer) of every message the placement needs."""
    out = []
    for s in range(len(stage_ranks) - 1):
        if stage_ranks[s] == stage_ranks[s + 1]:
            continue
        for i in range(m):
            out.append(
                (Action(s, _K.F, i), Action(s, _K.SEND_F, i), Action(s + 1, _K.RECV_F, i), Action(s + 1, _K.F, i))
            )
            out.append(
                (Action(s + 1, _K.B, i), Action(s + 1, _K.SEND_B, i), Action(s, _K.RECV_B, i), Action(s, _K.B, i))
            )
    return out


def _check_messages(
    columns: Sequence[Sequence[Action]],
    stage_ranks: Sequence[int],
    m: int,
    where: Mapping[Action, list[tuple[int, int]]],
) -> None:
    # 5. exactly the needed messages, each between its producer and its consumer
    expected = _expected_messages(stage_ranks, m)
    needed = {a for _, send, recv, _ in expected for a in (send, recv)}
    for a, places in where.items():
        if not a.kind.is_compute and a not in needed:
            rank, step = places[0]
            raise _fail(
                f"rank {rank} step {step}: {a} is not needed (its peer stage is on the same rank, or there is none)",
                columns,
                places,
            )
    for producer, send, recv, consumer in expected:
        for message, compute, after in ((send, producer, True), (recv, consumer, False)):
            rank, compute_step = where[compute][0]
            if message not in where:
                raise _fail(
                    f"rank {rank} has no {message} {'after' if after else 'before'} {compute} (step {compute_step})",
                    columns,
                    [(rank, compute_step)],
                )
            step = where[message][0][1]
            if (step < compute_step) if after else (step > compute_step):
                order = "after" if after else "before"
                raise _fail(
                    f"rank {rank} step {step}: {message} must come {order} {compute} (step {compute_step})",
                    columns,
                    [(rank, step), (rank, compute_step)],
                )

    # 6. sends and receives in the same order on every channel
    sends: dict[tuple[ActionKind, int, int], list[tuple[Action, int]]] = defaultdict(list)
    recvs: dict[tuple[ActionKind, int, int], list[tuple[Action, int]]] = defaultdict(list)
    for rank, actions in enumerate(columns):
        for step, a in enumerate(actions):
            if a.kind.is_send:
                peer = a.stage + 1 if a.kind is _K.SEND_F else a.stage - 1
                recv = Action(peer, _K.RECV_F if a.kind is _K.SEND_F else _K.RECV_B, a.microbatch)
                sends[(a.kind.carries, rank, stage_ranks[peer])].append((recv, step))
            elif a.kind.is_recv:
                peer = a.stage - 1 if a.kind is _K.RECV_F else a.stage + 1
                recvs[(a.kind.carries, stage_ranks[peer], rank)].append((a, step))
    for channel, sent in sends.items():
        kind, source, dest = channel
        got = recvs[channel]
        for (want, send_step), (recv, recv_step) in zip(sent, got):
            if want != recv:
                raise _fail(
                    f"the {kind} messages from rank {source} to rank {dest} are received in another order than sent: "
                    f"rank {source} step {send_step} sends the message that {want} receives, but at that place in the "
                    f"channel rank {dest} receives {recv} (step {recv_step}); receive in the order of the sends",
                    columns,
                    [(source, send_step), (dest, recv_step)],
                )
