"""Reductions to one root, the MPI calls SUMMA's transposed variants need besides ``ibcast``.

Buffer-based (uppercase) mpi4py calls only; payload recorded in active
:class:`~hpctp.comm.CommCounter` objects with the convention of a broadcast reversed:
every non-root sends ``b`` bytes (one message), the root receives ``b * (size - 1)``.
"""

from __future__ import annotations

import contextlib

from mpi4py import MPI

from .._util.backend import Array
from . import trace as T
from .buffers import nbytes, reduction_buffer
from .collectives import Pending, _op
from .counter import record

__all__ = ["reduce", "ireduce"]


def _record(comm: MPI.Intracomm, name: str, x: Array, root: int) -> None:
    size = comm.Get_size()
    if size == 1:
        return
    n = nbytes(x)
    if comm.Get_rank() == root:
        record(comm, name, 0, n * (size - 1), 0)
    else:
        record(comm, name, n, 0, 1)


def reduce(comm: MPI.Intracomm, x: Array, root: int = 0, op: str = "sum") -> Array:
    """Collective over ``comm``. Element-wise reduce ``x`` onto ``root``, in place there.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
    x : array
        Contiguous block, same shape and dtype on every rank. On ``root`` it holds the
        root's contribution on entry and the result on return; elsewhere it is only read.
        bfloat16 is reduced in float32 and rounded back.
    root : int
        Rank receiving the result.
    op : {"sum", "max", "min", "prod"}

    Returns
    -------
    array
        ``x``.

    Raises
    ------
    ValueError
        On an unknown ``op`` or a non-contiguous ``x``.
    """
    mpi_op = _op(op)
    if comm.Get_size() > 1:
        e = T.begin(comm, "Reduce", nbytes(x), x, root=root) if T.on else None
        if comm.Get_rank() == root:
            with reduction_buffer(x, write=True) as buf:
                comm.Reduce(MPI.IN_PLACE, buf, op=mpi_op, root=root)
        else:
            with reduction_buffer(x, write=False) as buf:
                comm.Reduce(buf, None, op=mpi_op, root=root)
        if e is not None:
            T.end(e)
        _record(comm, "Reduce", x, root)
    return x


def ireduce(comm: MPI.Intracomm, x: Array, root: int = 0, op: str = "sum") -> Pending:
    """Collective over ``comm`` (non-blocking). Start reducing ``x`` onto ``root`` in place.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
    x : array
        As for :func:`reduce`; do not touch it until the operation completes.
    root : int
    op : {"sum", "max", "min", "prod"}

    Returns
    -------
    Pending
        ``wait()`` completes the reduction (the result is then in ``x`` on ``root``).

    Raises
    ------
    ValueError
        On an unknown ``op`` or a non-contiguous ``x``.
    """
    mpi_op = _op(op)
    e = T.begin(comm, "Ireduce", nbytes(x), x, root=root, blocking=False) if T.on and comm.Get_size() > 1 else None
    stack = contextlib.ExitStack()
    is_root = comm.Get_rank() == root
    buf = stack.enter_context(reduction_buffer(x, write=is_root))
    if is_root:
        req = comm.Ireduce(MPI.IN_PLACE, buf, op=mpi_op, root=root)
    else:
        req = comm.Ireduce(buf, None, op=mpi_op, root=root)
    _record(comm, "Ireduce", x, root)
    return Pending(req, stack, e)
