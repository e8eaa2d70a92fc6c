"""The pipeline IR: one action is (stage, kind, micro-batch); a schedule is one list of actions per rank.

A model cut into ``n_stages`` stages by layers runs ``m`` micro-batches through them. Each rank
executes its own list of actions in order:

* compute: ``F`` (forward of one stage on one micro-batch), ``B`` (backward: the input gradient, and
  also the weight gradient unless the schedule splits the backward), ``W`` (the weight gradient, in
  zero-bubble schedules only);
* communication: ``SEND_F`` / ``RECV_F`` move a stage's output activations to the rank of the next
  stage, ``SEND_B`` / ``RECV_B`` move a stage's input gradient to the rank of the previous stage.

The stage of a communication action is the stage that runs on the rank holding the action: ``1SEND_F3``
sends stage 1's output of micro-batch 3 (to the rank of stage 2), ``2RECV_F3`` receives stage 2's input
of micro-batch 3 (from the rank of stage 1); ``2SEND_B3`` sends stage 2's input gradient (to the rank of
stage 1), ``1RECV_B3`` receives stage 1's output gradient (from the rank of stage 2). So ``sSEND_Fi``
matches ``(s+1)RECV_Fi`` and ``sSEND_Bi`` matches ``(s-1)RECV_Bi``.

The short form ``f"{stage}{kind}{microbatch}"`` (``"2F0"``, ``"1SEND_B3"``) round-trips through
:meth:`Action.parse`. :func:`format_table` prints lists side by side, one column per rank, and marks
the cells an error message points at.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Collection, Sequence
from typing import NamedTuple

__all__ = ["Action", "ActionKind", "format_table"]


class ActionKind(enum.StrEnum):
    """Local. What an action does: a computation (``F``, ``B``, ``W``) or one side of a message.

    A string enum: each member equals its name (``ActionKind.F == "F"``).

    Attributes
    ----------
    F
        The forward of one stage on one micro-batch.
    B
        The backward: the input and weight gradients in GPipe, 1F1B and interleaved 1F1B; only the input
        gradient in zero-bubble schedules.
    W
        The weight gradient (zero-bubble schedules only), after the ``B`` of the same stage and micro-batch.
    SEND_F, RECV_F
        A stage's output activations to the rank of the next stage; a stage's input from the rank of the
        previous one.
    SEND_B, RECV_B
        A stage's input gradient to the rank of the previous stage; a stage's output gradient from the
        rank of the next one.
    """

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        """Local. True for ``F``, ``B`` and ``W``."""
        return self in _COMPUTE

    @property
    def is_send(self) -> bool:
        """Local. True for ``SEND_F`` and ``SEND_B``."""
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def is_recv(self) -> bool:
        """Local. True for ``RECV_F`` and ``RECV_B``."""
        return self in (ActionKind.RECV_F, ActionKind.RECV_B)

    @property
    def carries(self) -> ActionKind:
        """Local. The computation whose result a message carries (``F`` or ``B``); a computation itself."""
        return _CARRIES.get(self, self)


_COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.W})
_CARRIES = {
    ActionKind.SEND_F: ActionKind.F,
    ActionKind.RECV_F: ActionKind.F,
    ActionKind.SEND_B: ActionKind.B,
    ActionKind.RECV_B: ActionKind.B,
}
# the longest kinds first, so that "SEND_F" is not read as "S..." (no kind is a prefix of another, but be safe)
_KINDS = "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
_PATTERN = re.compile(rf"(\d+)({_KINDS})(\d+)")


class Action(NamedTuple):
    """Local. One step of one rank: ``kind`` on ``stage`` for micro-batch ``microbatch``.

    Immutable and hashable. ``str(action)`` is the short form ``"2F0"`` / ``"1SEND_B3"``
    (stage, kind, micro-batch), which :meth:`parse` reads back.

    Attributes
    ----------
    stage : int
        The stage (model chunk) the action belongs to; for a message, the stage on this rank's side.
    kind : ActionKind
    microbatch : int
    """

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self.stage}, ActionKind.{self.kind.name}, {self.microbatch})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Local. The action written as ``"2F0"`` or ``"1SEND_B3"`` (the inverse of ``str``).

        Parameters
        ----------
        text : str
            Stage, kind and micro-batch, without separators; surrounding whitespace is ignored.

        Returns
        -------
        Action

        Raises
        ------
        ValueError
            If ``text`` is not of that form.
        """
        found = _PATTERN.fullmatch(text.strip())
        if found is None:
            kinds = ", ".join(k.value for k in ActionKind)
            raise ValueError(
                f"cannot read {text!r} as an action: write <stage><kind><microbatch> with kind in {kinds}, e.g. '2F0'"
            )
        return cls(int(found[1]), ActionKind(found[2]), int(found[3]))


def format_table(
    columns: Sequence[Sequence[Action | str | None]],
    *,
    marks: Collection[tuple[int, int]] = (),
    row_labels: Sequence[object] | None = None,
    corner: str = "step",
) -> str:
    """Local. Lists side by side: one column per rank, one row per step, blanks where a list is shorter or has None.

    Parameters
    ----------
    columns : sequence of sequences of Action, str or None
        ``columns[r][i]``: what rank ``r`` does at row ``i`` (None or ``""``: nothing, a bubble).
    marks : collection of (int, int)
        Cells ``(rank, row)`` to mark as ``>cell<`` (a row past the end of a list marks the empty cell
        there: an action is missing).
    row_labels : sequence, optional
        The label of each row (default: the row index).
    corner : str
        The heading of the label column.

    Returns
    -------
    str
        The table, rows separated by newlines, a header row of ``rank 0``, ``rank 1``, ... first.
    """
    marked = set(marks)
    n_rows = max([len(c) for c in columns] + [row + 1 for _, row in marked] + [0])
    labels = [str(label) for label in row_labels] if row_labels is not None else [str(i) for i in range(n_rows)]
    labels += [""] * (n_rows - len(labels))
    header = [corner] + [f"rank {r}" for r in range(len(columns))]
    body = []
    for i in range(n_rows):
        row = [labels[i]]
        for r, column in enumerate(columns):
            cell = column[i] if i < len(column) else None
            text = "" if cell is None else str(cell)
            row.append(f">{text}<" if (r, i) in marked else text)
        body.append(row)
    widths = [max(len(row[j]) for row in [header, *body]) for j in range(len(header))]
    lines = [
        "  ".join(text.rjust(w) if j == 0 else text.ljust(w) for j, (text, w) in enumerate(zip(row, widths))).rstrip()
        for row in [header, *body]
    ]
    return "\n".join(lines)
