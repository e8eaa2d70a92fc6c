"""MPI calls used by :mod:`hpctp.io`: serialised turns (token passing) and byte broadcasts.

Kept apart from :mod:`hpctp.comm.collectives` so the IO pipeline's needs stay visible;
buffer-based mpi4py calls only (no pickle), recorded in active
:class:`~hpctp.comm.counter.CommCounter` objects like every other hpctp call.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import tags
from . import trace as T
from .collectives import bcast, bcast_ints
from .counter import record

__all__ = ["TURN_TAG", "wait_turn", "pass_turn", "bcast_bytes"]

TURN_TAG = tags.TURN  # the token of serialised HDF5 writes (the table of every tag: hpctp.comm.tags)


def wait_turn(comm: MPI.Intracomm, tag: int = TURN_TAG) -> bool:
    """Local (point-to-point). Wait until rank ``rank - 1`` hands this rank the token.

    Ranks take turns in rank order: rank 0 starts at once, rank ``r`` blocks until rank
    ``r - 1`` called :func:`pass_turn`. Every rank must call :func:`pass_turn` exactly
    once after its turn, even after a failure, or later ranks wait forever.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
    tag : int
        Message tag of the token.

    Returns
    -------
    bool
        True when every earlier rank reported success (always True on rank 0).
    """
    rank = comm.Get_rank()
    if rank == 0:
        return True
    token = np.zeros(1, dtype=np.int64)
    e = T.begin(comm, "Recv", token.nbytes, token, peer=rank - 1, tag=tag, p2p=True) if T.on else None
    comm.Recv(token, source=rank - 1, tag=tag)
    if e is not None:
        T.end(e)
    record(comm, "Recv", 0, token.nbytes, 0, rank - 1)
    return bool(token[0])


def pass_turn(comm: MPI.Intracomm, ok: bool, tag: int = TURN_TAG) -> None:
    """Local (point-to-point). Hand the token to rank ``rank + 1`` (no-op on the last rank).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
    ok : bool
        False when this rank or an earlier one failed; later ranks then skip their work.
    tag : int
        Message tag of the token.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank + 1 >= size:
        return
    token = np.array([1 if ok else 0], dtype=np.int64)
    e = T.begin(comm, "Send", token.nbytes, token, peer=rank + 1, tag=tag, p2p=True) if T.on else None
    comm.Send(token, dest=rank + 1, tag=tag)
    if e is not None:
        T.end(e)
    record(comm, "Send", token.nbytes, 0, 1, rank + 1)


def bcast_bytes(comm: MPI.Intracomm, data: bytes | None, root: int = 0) -> bytes:
    """Collective over ``comm``. Broadcast a byte string from ``root`` (others pass None).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
    data : bytes or None
        The payload on ``root``; ignored elsewhere.
    root : int

    Returns
    -------
    bytes
        The root's payload, on every rank.

    Raises
    ------
    TypeError
        If ``data`` on ``root`` is not bytes (raised on root only; call with valid data).
    """
    if comm.Get_rank() == root:
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"bcast_bytes: root must pass bytes, got {type(data).__name__}")
        n = len(data)
    else:
        n = 0
    size = int(bcast_ints(comm, [n] if comm.Get_rank() == root else None, 1, root)[0])
    buf = np.zeros(size, dtype=np.uint8)
    if comm.Get_rank() == root:
        buf[:] = np.frombuffer(bytes(data), dtype=np.uint8)  # type: ignore[arg-type]
    if size:
        bcast(comm, buf, root)
    return buf.tobytes()
