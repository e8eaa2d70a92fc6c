"""A virtual transport: a grid of any number of ranks emulated in one process that plays one of them.

A :class:`VirtualComm` is a communicator without processes behind it. It knows its size, the rank this
process plays in it, its Cartesian shape and which world ranks it holds (pure arithmetic, so a grid of 4096
ranks costs nothing), and it answers the calls of :mod:`hpctp.comm` without moving data:

* a message leaves its buffers as they are (a receive keeps what its buffer held; on ``meta`` tensors there is
  nothing to keep), and a non-blocking one is complete at once (``MPI.REQUEST_NULL``);
* a reduction's result is this rank's contribution, a broadcast's is this rank's buffer;
* an all-gather of values (``allgather_ints``, and the one by which :func:`hpctp.comm.agree_arguments` agrees
  on arguments and errors) gives every rank this rank's values: agreement checks agree with the local
  verdict, and a rank's sizes stand for its peers' (the rank played is the busiest, whose peers hold as much).

Every data-moving function of :mod:`hpctp.comm` records its payload (:func:`hpctp.comm.record`) whichever
communicator it gets, so :class:`hpctp.comm.CommCounter` and :class:`hpctp.comm.CallLog` count a virtual run
as they count a real one: the same functions, the same accounting, the transport chosen by the grid's
communicator. A layer cannot tell the difference, except by the data.

:func:`virtual_grid` makes a :class:`~hpctp.comm.ProcessGrid` on such a communicator. Communicator creation
that needs the other ranks' choices (``Split`` with colours from each rank, ``split_comm``) raises
:class:`NotImplementedError`; the grid's own communicators (its duplicate, its Cartesian sub-grids) are
computed. File IO needs real processes (MPI-IO) and fails with MPI's invalid-communicator error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .._util.ints import is_int
from ..layout import grid_coords, grid_rank

__all__ = ["VirtualComm", "is_virtual", "virtual_world"]


class VirtualComm(MPI.Cartcomm):
    """Local. A communicator of ``len(members)`` virtual ranks of which this process plays ``rank``.

    It stands where an ``mpi4py`` communicator stands (it is an ``MPI.Cartcomm`` to type checks) and
    implements the subset of its methods that hpctp calls; see the module docstring for what each returns.

    Parameters
    ----------
    members : sequence of int
        The world ranks of its ranks, in its rank order.
    rank : int
        The rank this process plays, ``0 <= rank < len(members)``.
    dims, periods : sequence, optional
        Its Cartesian shape (default: one axis of all ranks, not periodic).
    name : str
        Its name (:meth:`Get_name`), as an MPI communicator's.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> VirtualComm:  # noqa: ARG004 - mpi4py's __new__ takes a comm only
        return super().__new__(cls)

    def __init__(
        self,
        members: Sequence[int],
        rank: int,
        dims: Sequence[int] | None = None,
        periods: Sequence[bool] | None = None,
        name: str = "",
    ) -> None:
        self.members: tuple[int, ...] = tuple(int(m) for m in members)
        if not 0 <= rank < len(self.members):
            raise ValueError(f"rank {rank} is not one of {len(self.members)} ranks")
        self._rank = int(rank)
        self._dims = tuple(int(d) for d in (dims if dims is not None else (len(self.members),)))
        if math.prod(self._dims) != len(self.members):
            raise ValueError(f"dims {self._dims} hold {math.prod(self._dims)} ranks, not {len(self.members)}")
        self._periods = tuple(bool(p) for p in (periods or [False] * len(self._dims)))
        self._name = str(name)

    # (mpi4py's properties, which would read MPI's null handle)
    @property
    def rank(self) -> int:  # type: ignore[override]
        return self._rank

    @property
    def size(self) -> int:  # type: ignore[override]
        return len(self.members)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self._name

    @property
    def dims(self) -> list[int]:  # type: ignore[override]
        return list(self._dims)

    @property
    def periods(self) -> list[bool]:  # type: ignore[override]
        return list(self._periods)

    @property
    def coords(self) -> list[int]:  # type: ignore[override]
        return self.Get_coords(self._rank)

    # ------------------------------------------------------------- identity (not MPI's null handle)
    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    def __hash__(self) -> int:
        return id(self)

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"VirtualComm(size={len(self.members)}, rank={self._rank}, dims={self._dims}, name={self._name!r})"

    # ------------------------------------------------------------- queries
    def Get_size(self) -> int:  # noqa: N802 - mpi4py's names
        return len(self.members)

    def Get_rank(self) -> int:  # noqa: N802
        return self._rank

    def Get_name(self) -> str:  # noqa: N802
        return self._name

    def Set_name(self, name: str) -> None:  # noqa: N802
        self._name = str(name)

    def Get_coords(self, rank: int) -> list[int]:  # noqa: N802
        return list(grid_coords(int(rank), self._dims))

    def Get_cart_rank(self, coords: Sequence[int]) -> int:  # noqa: N802
        return grid_rank(coords, self._dims)

    def Get_dim(self) -> int:  # noqa: N802
        return len(self._dims)

    def Shift(self, direction: int, disp: int) -> tuple[int, int]:  # noqa: N802
        me = grid_coords(self._rank, self._dims)

        def moved(step: int) -> int:
            c = list(me)
            c[direction] += step
            if not 0 <= c[direction] < self._dims[direction]:
                if not self._periods[direction]:
                    return MPI.PROC_NULL
                c[direction] %= self._dims[direction]
            return grid_rank(c, self._dims)

        return moved(-int(disp)), moved(int(disp))

    # ------------------------------------------------------------- communicators
    def Dup(self, info: Any = None) -> VirtualComm:  # noqa: N802, ARG002
        return VirtualComm(self.members, self._rank, self._dims, self._periods)

    def Create_cart(  # noqa: N802
        self,
        dims: Sequence[int],
        periods: Sequence[bool] | None = None,
        reorder: bool = False,  # noqa: ARG002
    ) -> VirtualComm:
        return VirtualComm(self.members, self._rank, dims, periods)

    def Sub(self, remain_dims: Sequence[bool]) -> VirtualComm:  # noqa: N802
        keep = [bool(k) for k in remain_dims]
        me = grid_coords(self._rank, self._dims)
        dims = [d for d, k in zip(self._dims, keep) if k] or [1]
        members: list[int] = []
        rank = 0
        for sub in np.ndindex(*dims):
            it = iter(sub)
            coords = [next(it) if k else c for c, k in zip(me, keep)]
            if coords == list(me):
                rank = len(members)
            members.append(self.members[grid_rank(coords, self._dims)])
        periods = [p for p, k in zip(self._periods, keep) if k] or [False]
        return VirtualComm(members, rank, dims, periods)

    def Split(self, color: int = 0, key: int = 0) -> VirtualComm:  # noqa: N802, ARG002
        raise NotImplementedError(
            "Split on a virtual communicator: the other ranks' colours are unknown in one process; "
            "make groups of a virtual grid from its axes (ProcessGrid.axes_comm, subgrid)"
        )

    def Free(self) -> None:  # noqa: N802
        return None

    # ------------------------------------------------------------- data: nothing moves (see the module docstring)
    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> None:  # noqa: N802, ARG002
        return None

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> MPI.Request:  # noqa: N802, ARG002
        return MPI.REQUEST_NULL

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = None, root: int = 0) -> None:  # noqa: N802, ARG002
        return None

    def Ireduce(self, sendbuf: Any, recvbuf: Any, op: Any = None, root: int = 0) -> MPI.Request:  # noqa: N802, ARG002
        return MPI.REQUEST_NULL

    def Ireduce_scatter(  # noqa: N802
        self,
        sendbuf: Any,
        recvbuf: Any,
        recvcounts: Any = None,
        op: Any = None,  # noqa: ARG002
    ) -> MPI.Request:
        return MPI.REQUEST_NULL

    def Bcast(self, buf: Any, root: int = 0) -> None:  # noqa: N802, ARG002
        return None

    def Ibcast(self, buf: Any, root: int = 0) -> MPI.Request:  # noqa: N802, ARG002
        return MPI.REQUEST_NULL

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> MPI.Request:  # noqa: N802, ARG002
        return MPI.REQUEST_NULL

    def Irecv(self, buf: Any, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> MPI.Request:  # noqa: N802, ARG002
        return MPI.REQUEST_NULL

    def Iprobe(self, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, status: Any = None) -> bool:  # noqa: N802, ARG002
        return False

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802, ARG002
        return None

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:  # noqa: N802, ARG002
        return None

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:  # noqa: N802, ARG002
        return None

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802, ARG002
        return None

    def Iallgatherv(self, sendbuf: Any, recvbuf: Any) -> MPI.Request:  # noqa: N802, ARG002
        return MPI.REQUEST_NULL

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        if isinstance(sendbuf, np.ndarray) and isinstance(recvbuf, np.ndarray):
            recvbuf.reshape(len(self.members), -1)[:] = sendbuf.reshape(1, -1)

    def Barrier(self) -> None:  # noqa: N802
        return None


def is_virtual(comm: object) -> bool:
    """Local. True if ``comm`` is a :class:`VirtualComm` (a rank of a virtual grid)."""
    return isinstance(comm, VirtualComm)


def virtual_world(size: int, rank: int = 0) -> VirtualComm:
    """Local. A virtual ``COMM_WORLD`` of ``size`` ranks of which this process plays ``rank``.

    Parameters
    ----------
    size : int
        Ranks, ``>= 1`` (any number: nothing is allocated per rank but the member list).
    rank : int
        The rank played, ``0 <= rank < size``.

    Returns
    -------
    VirtualComm
        Named ``"virtual"``; build a grid on it with ``ProcessGrid(dims, comm=...)``.

    Raises
    ------
    ValueError
        If ``size < 1`` or ``rank`` is outside ``[0, size)``.
    """
    if not is_int(size) or size < 1:
        raise ValueError(f"a virtual world needs size >= 1, got {size!r}")
    if not is_int(rank) or not 0 <= rank < size:
        raise ValueError(f"rank={rank!r} is not a rank of a virtual world of {size} (0..{size - 1})")
    return VirtualComm(range(int(size)), int(rank), name="virtual")
