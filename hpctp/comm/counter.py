"""Counters of the bytes and messages hpctp hands to MPI, per communicator."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Call", "CallLog", "CommCounter", "record", "record_allocation"]

_active: list[CommCounter | CallLog] = []


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

    def _add(self, comm: Any, comm_name: str, op: str, sent: int, recv: int, messages: int, peer: int) -> None:  # noqa: ARG002
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


class Call(NamedTuple):
    """Local. One data-moving call of :mod:`hpctp.comm` as this rank made it (see :class:`CommCounter` for the
    conventions of ``sent``, ``recv`` and ``messages``)."""

    op: str
    """The MPI operation (``"Allreduce"``, ``"Isend"``, ...)."""
    comm: str
    """The communicator's name (``"hpctp.grid.axis0"``, ...)."""
    size: int
    """Its ranks."""
    sent: int
    recv: int
    messages: int
    peer: int
    """The other rank of a point-to-point call (in ``comm``), else -1."""
    members: tuple[int, ...]
    """The world ranks of the communicator on a virtual grid (:mod:`hpctp.comm.virtual`), else ``()``."""


class CallLog:
    """Local. Context manager that keeps every data-moving call hpctp makes on this rank, in order, as a
    :class:`Call` (what :class:`CommCounter` sums): on a virtual grid, the messages a rank of any grid sends,
    which :mod:`hpctp.perf` prices.

    Examples
    --------
    >>> import torch, hpctp
    >>> grid = hpctp.ProcessGrid.virtual((4096,), rank=7)
    >>> with CallLog() as log:
    ...     _ = hpctp.comm.allreduce(grid.comm, torch.empty(1000, device="meta"))
    >>> [(c.op, c.size, c.sent) for c in log.calls]
    [('Allreduce', 4096, 4000)]
    >>> grid.free()
    """

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def _add(self, comm: Any, comm_name: str, op: str, sent: int, recv: int, messages: int, peer: int) -> None:
        members = getattr(comm, "members", ())
        self.calls.append(Call(op, comm_name, comm.Get_size(), sent, recv, messages, peer, members))

    def __enter__(self) -> CallLog:
        _active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.remove(self)


def record(comm: Any, op: str, sent: int = 0, recv: int = 0, messages: int = 0, peer: int = -1) -> None:
    """Local. Add one MPI call's logical payload to every active :class:`CommCounter` and :class:`CallLog`
    (``peer``: the other rank of a point-to-point call)."""
    if not _active:
        return
    name = comm.Get_name() or "unnamed"
    for c in _active:
        c._add(comm, name, op, int(sent), int(recv), int(messages), int(peer))


def record_allocation(nbytes: int) -> None:
    """Local. Count one newly allocated communication buffer of ``nbytes`` in every active :class:`CommCounter`."""
    for c in _active:
        if isinstance(c, CallLog):
            continue
        c.allocations += 1
        c.allocated_bytes += int(nbytes)
