"""Splitting one job's ranks into groups (a simulation and a trainer, say), and polling for the
messages between them: the communicator calls."""

from __future__ import annotations

from mpi4py import MPI

from .._util.ints import is_int
from .agree import agree_arguments

__all__ = ["free_comm", "iprobe", "split_comm"]


def split_comm(comm: MPI.Intracomm, color: int, key: int | None = None) -> MPI.Intracomm:
    """Collective over ``comm``. The ranks of ``comm`` with the same ``color`` as a new communicator
    (``MPI_Comm_split``), ordered by ``key`` (default: the rank in ``comm``).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
    color : int
        Group of this rank, ``>= 0``.
    key : int, optional
        Order inside the group (ties: the rank in ``comm``).

    Returns
    -------
    mpi4py.MPI.Intracomm
        This rank's group; free it with :func:`free_comm`.

    Raises
    ------
    ValueError, TypeError
        On every rank, if a rank's ``color`` or ``key`` is not an int (``color >= 0``).
    """
    error: Exception | None = None
    if not is_int(color) or int(color) < 0:
        error = ValueError(f"split_comm: color={color!r} must be an int >= 0")
    elif key is not None and not is_int(key):
        error = TypeError(f"split_comm: key={key!r} must be an int or None")
    agree_arguments(comm, "split_comm", error)
    new: MPI.Intracomm = comm.Split(int(color), comm.Get_rank() if key is None else int(key))  # type: ignore[assignment]
    new.Set_name(f"hpctp.group{int(color)}")
    return new


def free_comm(comm: MPI.Intracomm) -> None:
    """Collective over ``comm``. Release a communicator made by :func:`split_comm`."""
    if comm != MPI.COMM_NULL:
        comm.Free()


def iprobe(comm: MPI.Comm, source: int, tag: int) -> bool:
    """Local (point-to-point). True if a message from ``source`` with ``tag`` waits to be received
    (receive it with :func:`hpctp.comm.irecv`: it is there, so the receive completes). Lets a rank
    poll for a message without leaving a posted receive behind."""
    return bool(comm.Iprobe(source=source, tag=tag))
