"""Counters of the bytes and messages hpctp hands to MPI, per communicator."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CommCounter", "record", "record_allocation"]

_active: list[CommCounter] = []


@dataclass
class CommStats:
    """Local. Totals for one communicator (or for all of them)."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    messages: int = 0
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))


class CommCounter:
    """Local. Context manager that counts the payload hpctp passes to MPI on this rank.

    Counts are logical payload, independent of the MPI library's algorithms: a point-to-point
    message of ``b`` bytes adds ``b`` to the sender's ``bytes_sent`` and the receiver's
    ``bytes_recv``; a broadcast adds ``b`` to every non-root's ``bytes_recv`` and
    ``b * (size - 1)`` to the root's ``bytes_sent``; an all-reduce adds ``b`` both ways on
    every rank of a communicator of size > 1. Data a rank keeps (self-copies) is not
    counted. ``messages`` counts point-to-point messages to other ranks (collectives count
    one per rank they send to). A bfloat16 reduction counts bfloat16 bytes, the logical
    payload, though MPI reduces a float32 copy of it. The small message in which a collective
    call agrees on its arguments (:func:`hpctp.comm.agree_arguments`) is not counted.

    ``allocations`` and ``allocated_bytes`` count the communication buffers (pack, send,
    receive) that had to be allocated because :mod:`hpctp.comm.pool` had none free: a planned
    move called a second time with the same sizes allocates none.

    Examples
    --------
    >>> import numpy as np, hpctp
    >>> grid = hpctp.ProcessGrid([0])
    >>> x = hpctp.distribute(np.ones((8, 8)) if grid.rank == 0 else None, grid, (0, None))
    >>> with CommCounter() as c:
    ...     y = x.redistribute((None, 0))
    >>> c.bytes_sent == c.per_comm["hpctp.grid"].bytes_sent == 8 * 8 * 8 * (grid.size - 1) // grid.size**2
    True
    >>> grid.free()
    """

    def __init__(self) -> None:
        self.total = CommStats()
        self.per_comm: dict[str, CommStats] = defaultdict(CommStats)
        self.allocations = 0
        self.allocated_bytes = 0

    @property
    def bytes_sent(self) -> int:
        """Bytes sent to other ranks, all communicators."""
        return self.total.bytes_sent

    @property
    def bytes_recv(self) -> int:
        """Bytes received from other ranks, all communicators."""
        return self.total.bytes_recv

    @property
    def messages(self) -> int:
        """Messages sent to other ranks, all communicators."""
        return self.total.messages

    @property
    def calls(self) -> dict[str, int]:
        """Number of calls per operation name (e.g. ``"Alltoallv"``)."""
        return dict(self.total.calls)

    def _add(self, comm_name: str, op: str, sent: int, recv: int, messages: int) -> None:
        for s in (self.total, self.per_comm[comm_name]):
            s.bytes_sent += sent
            s.bytes_recv += recv
            s.messages += messages
            s.calls[op] += 1

    def __enter__(self) -> CommCounter:
        _active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.remove(self)

    def __repr__(self) -> str:
        return (
            f"CommCounter(bytes_sent={self.bytes_sent}, bytes_recv={self.bytes_recv}, "
            f"messages={self.messages}, calls={self.calls}, allocations={self.allocations})"
        )


def record(comm: Any, op: str, sent: int = 0, recv: int = 0, messages: int = 0) -> None:
    """Local. Add one MPI call's logical payload to every active :class:`CommCounter`."""
    if not _active:
        return
    name = comm.Get_name() or "unnamed"
    for c in _active:
        c._add(name, op, int(sent), int(recv), int(messages))


def record_allocation(nbytes: int) -> None:
    """Local. Count one newly allocated communication buffer of ``nbytes`` in every active :class:`CommCounter`."""
    for c in _active:
        c.allocations += 1
        c.allocated_bytes += int(nbytes)
