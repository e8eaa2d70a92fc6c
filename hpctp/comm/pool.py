"""Communication buffers reused across calls: the pack, send and receive memory of planned moves.

A redistribution, an FFT transpose, a halo exchange or a gather packs pieces of blocks into one
flat send buffer and receives into another. Allocating those afresh on every call costs more
than the copies themselves for torch blocks on the host: a new large torch buffer is backed by
small pages, and its first write takes a page fault per 4 KiB (numpy's large arrays get huge
pages). The pool keeps the buffers of earlier calls and hands them out again, so the second call
of a planned move allocates nothing.

Buffers in use are out of the pool (a send and a receive buffer of one call never share memory);
:func:`release` puts them back. Results handed to the user are never pooled memory. The pool keeps
at most :data:`MAX_POOLED_BYTES` per backend and device, dropping the least recently used buffers
beyond that; :func:`clear` frees everything.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from .._util.backend import Array, backend_name, empty_host_bytes, empty_like_backend
from .counter import record_allocation

__all__ = ["MAX_POOLED_BYTES", "acquire", "release", "buffers", "clear", "pooled"]

MAX_POOLED_BYTES = 1 << 31
"""Bytes of free buffers the pool keeps per backend and device (2 GiB)."""

_MIN_BYTES = 4096

# (backend, device) -> capacity -> free buffers of that capacity; each dict's order is least recently used first
_free: dict[tuple[str, str], OrderedDict[int, list[Any]]] = {}
_held_bytes: dict[tuple[str, str], int] = {}


def _place(like: Array) -> tuple[str, str]:
    name = backend_name(like)
    device = str(getattr(like, "device", "cpu"))
    return name, device


def _capacity(n: int) -> int:
    """Buffers are allocated in 4 KiB multiples, so sizes that differ by a few bytes share them."""
    return max(_MIN_BYTES, -(-n // _MIN_BYTES) * _MIN_BYTES)


def _allocate(capacity: int, like: Array) -> Any:
    if backend_name(like) == "torch" and str(like.device) == "cpu":
        return empty_host_bytes(capacity, "torch")
    if backend_name(like) == "numpy":
        return empty_host_bytes(capacity, "numpy")
    return empty_like_backend((capacity,), "uint8", like)


def acquire(n: int, like: Array) -> Array:
    """Local. A flat ``uint8`` buffer of at least ``n`` bytes on ``like``'s backend and device.

    Taken from the pool when a free buffer of at least ``n`` bytes (and at most about twice that)
    is there, else allocated (counted by :class:`~hpctp.comm.CommCounter` as ``allocations``).
    Slice the ``n`` bytes you need (``buf[:n]``) and give the buffer itself back with
    :func:`release` once no message or view uses it; :func:`pooled` does both.

    Parameters
    ----------
    n : int
        Bytes needed (0 is allowed).
    like : array
        A block whose backend and device the buffer takes.

    Returns
    -------
    array
        The pooled buffer (its length is its capacity); its contents are undefined.
    """
    place = _place(like)
    free = _free.setdefault(place, OrderedDict())
    want = _capacity(n)
    for capacity in sorted(free):
        if want <= capacity <= 2 * want:
            buf = free[capacity].pop()
            if not free[capacity]:
                del free[capacity]
            _held_bytes[place] -= capacity
            return buf
    buf = _allocate(want, like)
    record_allocation(want)
    return buf


def release(buf: Array) -> None:
    """Local. Return a buffer from :func:`acquire` to the pool.

    Parameters
    ----------
    buf : array
        The buffer :func:`acquire` returned (not a slice of it).
    """
    capacity = int(buf.shape[0])
    place = _place(buf)
    free = _free.setdefault(place, OrderedDict())
    free.setdefault(capacity, []).append(buf)
    free.move_to_end(capacity)
    _held_bytes[place] = _held_bytes.get(place, 0) + capacity
    while _held_bytes[place] > MAX_POOLED_BYTES:
        oldest = next(iter(free))
        free[oldest].pop(0)
        if not free[oldest]:
            del free[oldest]
        _held_bytes[place] -= oldest


@contextlib.contextmanager
def pooled(n: int, like: Array) -> Iterator[Array]:
    """Local. :func:`acquire` ``n`` bytes for the ``with`` block, :func:`release` after it.

    Parameters
    ----------
    n : int
        Bytes needed.
    like : array
        A block whose backend and device the buffer takes.

    Yields
    ------
    array
        ``n`` bytes of a pooled buffer; its contents are undefined.
    """
    buf = acquire(n, like)
    try:
        yield buf[:n]
    finally:
        release(buf)


def buffers() -> tuple[int, int]:
    """Local. ``(buffers, bytes)`` held free in the pool, all backends and devices.

    Returns
    -------
    tuple of int
    """
    count = sum(len(v) for free in _free.values() for v in free.values())
    return count, sum(_held_bytes.values())


def clear() -> None:
    """Local. Drop every free buffer (buffers in use stay valid and are dropped when released)."""
    _free.clear()
    _held_bytes.clear()
