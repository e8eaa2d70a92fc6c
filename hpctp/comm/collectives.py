"""All MPI calls of hpctp: buffer-based (uppercase) mpi4py calls only, never pickle.

Each function takes the communicator explicitly, accepts numpy arrays, torch tensors and
cupy arrays (device memory goes directly to a CUDA-aware MPI, else through pinned host
staging, see :mod:`hpctp.comm.buffers`) and records its payload in active
:class:`~hpctp.comm.counter.CommCounter` objects. While the flight recorder runs
(:mod:`hpctp.comm.trace`), each call is entered before MPI sees it and retired when it
completes: a blocking call on return, a non-blocking one in :meth:`Pending.wait`,
:meth:`Pending.test` or :func:`waitall` (the one branch ``if T.on`` when it is off).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import numpy as np
from mpi4py import MPI

from .._util.backend import Array
from . import trace as T
from .buffers import host_buffer, mpi_buffer, nbytes, reduction_buffer
from .counter import record
from .virtual import VirtualComm

__all__ = [
    "Pending",
    "allreduce",
    "bcast",
    "ibcast",
    "isend",
    "irecv",
    "waitall",
    "alltoallv",
    "gatherv",
    "allgatherv",
    "iallreduce",
    "ireduce_scatter",
    "iallgatherv",
    "scatterv",
    "allgather_ints",
    "bcast_ints",
    "all_true",
    "raise_if_any",
    "barrier",
    "slowest_seconds",
]

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}


class Pending:
    """Local. A posted non-blocking operation; :meth:`wait` completes it (and unstages buffers)."""

    def __init__(self, request: MPI.Request, stack: contextlib.ExitStack, entry: T.Entry | None = None) -> None:
        self._request = request
        self._stack = stack
        self._done = False
        self._entry = entry  # the flight recorder's entry, retired on completion

    def wait(self) -> None:
        """Local. Block until the operation is complete; idempotent."""
        if not self._done:
            e = self._entry
            if e is not None:
                T.waiting((e,))
            self._request.Wait()
            self._stack.close()
            self._done = True
            if e is not None:
                T.end(e)

    def test(self) -> bool:
        """Local. True (and completed) if the operation has finished."""
        if self._done:
            return True
        if self._request.Test():
            self._stack.close()
            self._done = True
            if self._entry is not None:
                T.end(self._entry)
        return self._done


_DONE = Pending(MPI.REQUEST_NULL, contextlib.ExitStack())
_DONE._done = True  # (the completed message of a virtual grid: waiting on it returns at once)


def waitall(pending: Sequence[Pending]) -> None:
    """Local. Wait for every pending operation."""
    open_ = [p for p in pending if not p._done]
    if not open_:
        return
    if T.on:
        traced = [p._entry for p in open_ if p._entry is not None]
        if traced:
            T.waiting(traced)
    MPI.Request.Waitall([p._request for p in open_])
    for p in open_:
        p._stack.close()
        p._done = True
        if p._entry is not None:
            T.end(p._entry)


def _op(op: str) -> MPI.Op:
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}") from None


def allreduce(comm: MPI.Intracomm, x: Array, op: str = "sum") -> Array:
    """Collective over ``comm``. Element-wise reduce ``x`` in place across ranks; returns ``x``.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
    x : array
        Contiguous block, same shape and dtype on every rank (bfloat16 is reduced in
        float32 and rounded back).
    op : {"sum", "max", "min", "prod"}
    """
    mpi_op = _op(op)
    size = comm.Get_size()
    if size > 1:
        n = nbytes(x)
        e = T.begin(comm, "Allreduce", n, x) if T.on else None
        host = host_buffer(x)  # (the common case without a context manager: a layer's all-reduce per call)
        if host is not None:
            comm.Allreduce(MPI.IN_PLACE, host, op=mpi_op)
        else:
            with reduction_buffer(x, write=True) as buf:
                comm.Allreduce(MPI.IN_PLACE, buf, op=mpi_op)
        if e is not None:
            T.end(e)
        record(comm, "Allreduce", n, n, 1)
    return x


def bcast(comm: MPI.Intracomm, x: Array, root: int = 0) -> Array:
    """Collective over ``comm``. Broadcast ``x`` from ``root`` in place; returns ``x``."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size > 1:
        n = nbytes(x)
        e = T.begin(comm, "Bcast", n, x, root=root) if T.on else None
        with mpi_buffer(x, read=rank == root, write=rank != root) as buf:
            comm.Bcast(buf, root=root)
        if e is not None:
            T.end(e)
        if rank == root:
            record(comm, "Bcast", n * (size - 1), 0, size - 1)
        else:
            record(comm, "Bcast", 0, n, 0)
    return x


def ibcast(comm: MPI.Intracomm, x: Array, root: int = 0) -> Pending:
    """Collective over ``comm`` (non-blocking). Start broadcasting ``x`` from ``root``.

    Returns
    -------
    Pending
        Call ``wait()`` before reading ``x`` (non-roots) or changing it (root).
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    n = nbytes(x)
    e = T.begin(comm, "Ibcast", n, x, root=root, blocking=False) if T.on and size > 1 else None
    stack = contextlib.ExitStack()
    buf = stack.enter_context(mpi_buffer(x, read=rank == root, write=rank != root))
    req = comm.Ibcast(buf, root=root)
    if size > 1:
        if rank == root:
            record(comm, "Ibcast", n * (size - 1), 0, size - 1)
        else:
            record(comm, "Ibcast", 0, n, 0)
    return Pending(req, stack, e)


def isend(comm: MPI.Comm, x: Array, dest: int, tag: int = 0) -> Pending:
    """Local (point-to-point). Start sending contiguous ``x`` to ``dest``."""
    if type(comm) is VirtualComm:  # (nothing to post: counted as on MPI, a tenth of the cost)
        if dest != comm.Get_rank():
            record(comm, "Isend", nbytes(x), 0, 1, dest)
        return _DONE
    other = dest != comm.Get_rank()
    e = T.begin(comm, "Isend", nbytes(x), x, peer=dest, tag=tag, p2p=True, blocking=False) if T.on and other else None
    stack = contextlib.ExitStack()
    buf = stack.enter_context(mpi_buffer(x, read=True, write=False))
    req = comm.Isend(buf, dest=dest, tag=tag)
    if other:
        record(comm, "Isend", nbytes(x), 0, 1, dest)
    return Pending(req, stack, e)


def irecv(comm: MPI.Comm, x: Array, source: int, tag: int = 0) -> Pending:
    """Local (point-to-point). Start receiving into contiguous ``x`` from ``source``."""
    if type(comm) is VirtualComm:
        if source != comm.Get_rank():
            record(comm, "Irecv", 0, nbytes(x), 0, source)
        return _DONE
    other = source != comm.Get_rank()
    e = T.begin(comm, "Irecv", nbytes(x), x, peer=source, tag=tag, p2p=True, blocking=False) if T.on and other else None
    stack = contextlib.ExitStack()
    buf = stack.enter_context(mpi_buffer(x, read=False, write=True))
    req = comm.Irecv(buf, source=source, tag=tag)
    if other:
        record(comm, "Irecv", 0, nbytes(x), 0, source)
    return Pending(req, stack, e)


def _displs(counts: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += int(c)
    return out


def _others(counts: Sequence[int], rank: int) -> tuple[int, int]:
    total = sum(int(c) for i, c in enumerate(counts) if i != rank)
    msgs = sum(1 for i, c in enumerate(counts) if i != rank and c)
    return total, msgs


def alltoallv(
    comm: MPI.Intracomm,
    sendbuf: Array,
    sendcounts: Sequence[int],
    recvbuf: Array,
    recvcounts: Sequence[int],
) -> None:
    """Collective over ``comm``. Personalised all-to-all of flat buffers.

    ``sendcounts[r]`` consecutive elements of ``sendbuf`` go to rank ``r``;
    ``recvcounts[r]`` elements from rank ``r`` land consecutively in ``recvbuf``.
    """
    rank = comm.Get_rank()
    sc = [int(c) for c in sendcounts]
    rc = [int(c) for c in recvcounts]
    item = _itemsize(sendbuf)
    e = T.begin(comm, "Alltoallv", sum(sc) * item, sendbuf, compare_size=False) if T.on else None
    with mpi_buffer(sendbuf, read=True) as sb, mpi_buffer(recvbuf, read=False, write=True) as rb:
        comm.Alltoallv([sb, (sc, _displs(sc))], [rb, (rc, _displs(rc))])
    if e is not None:
        T.end(e)
    sent, msgs = _others(sc, rank)
    recv, _ = _others(rc, rank)
    record(comm, "Alltoallv", sent * item, recv * item, msgs)


def _size(x: Array) -> int:
    return int(np.prod(tuple(x.shape)))


def gatherv(comm: MPI.Intracomm, sendbuf: Array, recvbuf: Array | None, counts: Sequence[int], root: int = 0) -> None:
    """Collective over ``comm``. Gather flat ``sendbuf`` pieces of ``counts[r]`` elements at ``root``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    c = [int(v) for v in counts]
    e = T.begin(comm, "Gatherv", sum(c) * _itemsize(sendbuf), sendbuf, root=root) if T.on and size > 1 else None
    with contextlib.ExitStack() as stack:
        sb = stack.enter_context(mpi_buffer(sendbuf, read=True))
        if rank == root:
            rb = stack.enter_context(mpi_buffer(recvbuf, read=False, write=True))
            comm.Gatherv(sb, [rb, (c, _displs(c))], root=root)
        else:
            comm.Gatherv(sb, None, root=root)
    if e is not None:
        T.end(e)
    if size > 1:
        item = _itemsize(sendbuf)
        if rank == root:
            recv, _ = _others(c, rank)
            record(comm, "Gatherv", 0, recv * item, 0)
        else:
            record(comm, "Gatherv", c[rank] * item, 0, 1 if c[rank] else 0)


def allgatherv(comm: MPI.Intracomm, sendbuf: Array, recvbuf: Array, counts: Sequence[int]) -> None:
    """Collective over ``comm``. Every rank receives all ``counts[r]``-element pieces, in rank order."""
    rank, size = comm.Get_rank(), comm.Get_size()
    c = [int(v) for v in counts]
    e = T.begin(comm, "Allgatherv", sum(c) * _itemsize(recvbuf), recvbuf) if T.on and size > 1 else None
    with mpi_buffer(sendbuf, read=True) as sb, mpi_buffer(recvbuf, read=False, write=True) as rb:
        comm.Allgatherv(sb, [rb, (c, _displs(c))])
    if e is not None:
        T.end(e)
    if size > 1:
        item = _itemsize(sendbuf)
        recv, _ = _others(c, rank)
        record(comm, "Allgatherv", c[rank] * item * (size - 1), recv * item, size - 1 if c[rank] else 0)


def iallreduce(comm: MPI.Intracomm, x: Array, op: str = "sum") -> Pending:
    """Collective over ``comm`` (non-blocking). Start reducing ``x`` in place across ranks.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
    x : array
        As for :func:`allreduce`; do not touch it until the operation completes.
    op : {"sum", "max", "min", "prod"}

    Returns
    -------
    Pending
        ``wait()`` completes the reduction (the result is then in ``x``).

    Raises
    ------
    ValueError
        On an unknown ``op`` or a non-contiguous ``x``.
    """
    mpi_op = _op(op)
    multi = comm.Get_size() > 1
    e = T.begin(comm, "Iallreduce", nbytes(x), x, blocking=False) if T.on and multi else None
    stack = contextlib.ExitStack()
    buf = stack.enter_context(reduction_buffer(x, write=True))
    req = comm.Iallreduce(MPI.IN_PLACE, buf, op=mpi_op)
    if multi:
        n = nbytes(x)
        record(comm, "Iallreduce", n, n, 1)
    return Pending(req, stack, e)


def ireduce_scatter(
    comm: MPI.Intracomm, sendbuf: Array, recvbuf: Array, counts: Sequence[int], op: str = "sum"
) -> Pending:
    """Collective over ``comm`` (non-blocking). Start reducing flat ``sendbuf`` and scattering the result.

    Rank ``r`` receives the ``counts[r]`` elements after the first ``sum(counts[:r])`` of the
    element-wise reduction of every rank's ``sendbuf`` (``sum(counts)`` elements).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
    sendbuf : array
        Contiguous, ``sum(counts)`` elements, the same dtype on every rank; only read.
    recvbuf : array
        Contiguous, ``counts[rank]`` elements.
    counts : sequence of int
        Elements per rank (uneven counts and zeros allowed), the same on every rank.
    op : {"sum", "max", "min", "prod"}

    Returns
    -------
    Pending
        ``wait()`` completes it (the result is then in ``recvbuf``); leave both buffers alone until then.

    Raises
    ------
    ValueError
        On an unknown ``op`` or non-contiguous buffers.
    """
    mpi_op = _op(op)
    rank, size = comm.Get_rank(), comm.Get_size()
    c = [int(v) for v in counts]
    e = None
    if T.on and size > 1:
        e = T.begin(comm, "Ireduce_scatter", sum(c) * _itemsize(sendbuf), sendbuf, blocking=False)
    stack = contextlib.ExitStack()
    sb = stack.enter_context(reduction_buffer(sendbuf, write=False))
    rb = stack.enter_context(reduction_buffer(recvbuf, write=True))
    req = comm.Ireduce_scatter(sb, rb, recvcounts=c, op=mpi_op)
    if size > 1:
        item = _itemsize(sendbuf)
        sent, msgs = _others(c, rank)
        record(comm, "Ireduce_scatter", sent * item, c[rank] * item * (size - 1), msgs)
    return Pending(req, stack, e)


def iallgatherv(comm: MPI.Intracomm, sendbuf: Array, recvbuf: Array, counts: Sequence[int]) -> Pending:
    """Collective over ``comm`` (non-blocking). Start :func:`allgatherv`: every rank receives all pieces.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
    sendbuf : array
        Contiguous, ``counts[rank]`` elements.
    recvbuf : array
        Contiguous, ``sum(counts)`` elements; rank ``r``'s piece lands after the first ``sum(counts[:r])``.
    counts : sequence of int
        Elements per rank, the same on every rank.

    Returns
    -------
    Pending
        ``wait()`` completes it; leave both buffers alone until then.

    Raises
    ------
    ValueError
        On non-contiguous buffers.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    c = [int(v) for v in counts]
    e = None
    if T.on and size > 1:
        e = T.begin(comm, "Iallgatherv", sum(c) * _itemsize(recvbuf), recvbuf, blocking=False)
    stack = contextlib.ExitStack()
    sb = stack.enter_context(mpi_buffer(sendbuf, read=True))
    rb = stack.enter_context(mpi_buffer(recvbuf, read=False, write=True))
    req = comm.Iallgatherv(sb, [rb, (c, _displs(c))])
    if size > 1:
        item = _itemsize(sendbuf) if _size(sendbuf) else _itemsize(recvbuf)
        recv, _ = _others(c, rank)
        record(comm, "Iallgatherv", c[rank] * item * (size - 1), recv * item, size - 1 if c[rank] else 0)
    return Pending(req, stack, e)


def scatterv(comm: MPI.Intracomm, sendbuf: Array | None, counts: Sequence[int], recvbuf: Array, root: int = 0) -> None:
    """Collective over ``comm``. ``root`` sends ``counts[r]`` consecutive elements of ``sendbuf`` to rank ``r``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    c = [int(v) for v in counts]
    e = T.begin(comm, "Scatterv", sum(c) * _itemsize(recvbuf), recvbuf, root=root) if T.on and size > 1 else None
    with contextlib.ExitStack() as stack:
        rb = stack.enter_context(mpi_buffer(recvbuf, read=False, write=True))
        if rank == root:
            sb = stack.enter_context(mpi_buffer(sendbuf, read=True))
            comm.Scatterv([sb, (c, _displs(c))], rb, root=root)
        else:
            comm.Scatterv(None, rb, root=root)
    if e is not None:
        T.end(e)
    if size > 1:
        item = _itemsize(recvbuf)
        if rank == root:
            sent, msgs = _others(c, rank)
            record(comm, "Scatterv", sent * item, 0, msgs)
        else:
            record(comm, "Scatterv", 0, c[rank] * item, 0)


def _itemsize(x: Array) -> int:
    n = _size(x)
    return nbytes(x) // n if n else 1


def allgather_ints(comm: MPI.Intracomm, values: Sequence[int]) -> np.ndarray:
    """Collective over ``comm``. Gather ``k`` int64 values from every rank: shape ``(size, k)``."""
    mine = np.asarray(values, dtype=np.int64).reshape(-1)
    out = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    e = T.begin(comm, "Allgather", mine.nbytes, mine) if T.on and comm.Get_size() > 1 else None
    comm.Allgather(mine, out)
    if e is not None:
        T.end(e)
    if comm.Get_size() > 1:
        record(comm, "Allgather", mine.nbytes * (comm.Get_size() - 1), out.nbytes - mine.nbytes, 1)
    return out


def bcast_ints(comm: MPI.Intracomm, values: Sequence[int] | None, count: int, root: int = 0) -> np.ndarray:
    """Collective over ``comm``. Broadcast ``count`` int64 values from ``root`` (others pass None)."""
    buf = np.zeros(count, dtype=np.int64)
    if comm.Get_rank() == root:
        vals = np.asarray(values, dtype=np.int64).reshape(-1)
        if vals.size != count:
            raise ValueError(f"bcast_ints: root gave {vals.size} values, expected {count}")
        buf[:] = vals
    return bcast(comm, buf, root)


def all_true(comm: MPI.Intracomm, ok: bool) -> bool:
    """Collective over ``comm``. True on every rank iff ``ok`` is true on every rank."""
    flag = np.array([1 if ok else 0], dtype=np.int32)
    return bool(allreduce(comm, flag, "min")[0])


# Exception types that travel by their index (append only); another rank raises the most specific
# one the failing rank's exception derives from, else RuntimeError.
_ERRORS: tuple[type[Exception], ...] = (
    ValueError, TypeError, FileNotFoundError, KeyError, OSError, AssertionError, FileExistsError,
    IsADirectoryError, NotADirectoryError, PermissionError, AttributeError, IndexError, LookupError,
    OverflowError, ZeroDivisionError, ArithmeticError, NotImplementedError, RuntimeError, BufferError,
    MemoryError, UnicodeError,
)  # fmt: skip


def raise_if_any(comm: MPI.Intracomm, error: Exception | None) -> None:
    """Collective over ``comm``. Raise the first failing rank's error on every rank.

    Every rank passes its local validation result (an exception, or None). If any rank
    failed, all ranks raise an exception of the same type with the lowest failing rank's
    message, so none is left waiting in a later collective.
    """
    size = comm.Get_size()
    code = np.array([comm.Get_rank() if error is not None else size], dtype=np.int64)
    if size > 1:
        code = allreduce(comm, code, "min")
    first = int(code[0])
    if first == size:
        return
    if size == 1:
        raise error  # type: ignore[misc]
    kind = -1
    msg = b""
    if error is not None and comm.Get_rank() == first:
        kind = next((_ERRORS.index(t) for t in type(error).__mro__ if t in _ERRORS), -1)
        # KeyError's str() quotes its message; use the message itself
        text_ = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
        msg = text_.encode()[:4000]
    head = bcast_ints(comm, [kind, len(msg)], 2, root=first)
    text = np.zeros(int(head[1]), dtype=np.uint8)
    if comm.Get_rank() == first:
        text[:] = np.frombuffer(msg, dtype=np.uint8)
    bcast(comm, text, root=first)
    etype = _ERRORS[int(head[0])] if int(head[0]) >= 0 else RuntimeError
    if comm.Get_rank() == first and error is not None:
        raise error
    raise etype(text.tobytes().decode(errors="replace") + f" (reported by rank {first})")


def barrier(comm: MPI.Intracomm) -> None:
    """Collective over ``comm``. Synchronise all ranks."""
    e = T.begin(comm, "Barrier", 0) if T.on and comm.Get_size() > 1 else None
    comm.Barrier()
    if e is not None:
        T.end(e)


def slowest_seconds(comm: MPI.Intracomm, fn: Callable[[], object]) -> float:
    """Collective over ``comm``. Wall seconds of one call of ``fn`` started after a barrier, on the slowest rank.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
    fn : callable
        Called once on every rank (it may be collective over ``comm``).

    Returns
    -------
    float
        The largest time over the ranks, the same on every rank.
    """
    barrier(comm)
    t = time.perf_counter()
    fn()
    slowest = np.array([time.perf_counter() - t])
    allreduce(comm, slowest, "max")
    return float(slowest[0])
