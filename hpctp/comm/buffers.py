"""Turning local blocks into buffers MPI accepts, without pickling and without copies
where the memory allows it (numpy, torch CPU, device memory with CUDA-aware MPI)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._util.backend import Array, backend_name, byte_view, is_device, is_torch, numpy_dtype, shape_only
from .cuda import cuda_aware

__all__ = ["host_buffer", "mpi_buffer", "nbytes", "reduction_buffer", "staging_pool", "synchronize"]

_pinned: dict[int, list[np.ndarray]] = {}


def nbytes(x: Array) -> int:
    """Local. Size of a block in bytes."""
    if is_torch(x):
        return int(x.numel() * x.element_size())
    return int(x.nbytes)


def synchronize(x: Array) -> None:
    """Local. Wait until pending GPU work on ``x``'s device is done (no-op on the host)."""
    if not is_device(x):
        return
    if is_torch(x):
        import torch

        torch.cuda.current_stream(x.device).synchronize()
    else:
        import cupy as cp

        cp.cuda.get_current_stream().synchronize()


def _acquire_staging(n: int) -> np.ndarray:
    """A pinned (page-locked) host buffer of at least ``n`` bytes from a reuse pool.

    Buffers in use are taken out of the pool, so concurrent operations (a send and a
    receive buffer of one collective) never share memory; :func:`_release_staging`
    puts them back.
    """
    key = max(1 << (max(n, 1) - 1).bit_length(), 4096)
    free = _pinned.setdefault(key, [])
    if free:
        return free.pop()
    try:
        import torch

        return torch.empty(key, dtype=torch.uint8, pin_memory=True).numpy()
    except Exception:  # no CUDA runtime for pinning: plain host memory
        return np.empty(key, dtype=np.uint8)


def _release_staging(buf: np.ndarray) -> None:
    _pinned.setdefault(buf.size, []).append(buf)


def staging_pool() -> tuple[int, int]:
    """Local. ``(buffers, bytes)`` of host staging memory kept for reuse.

    Device blocks are staged through this pool when MPI is not CUDA-aware; it grows to the
    largest set of buffers one operation holds at once and is reused by later calls.
    """
    return sum(len(v) for v in _pinned.values()), sum(k * len(v) for k, v in _pinned.items())


def _torch_view(x: Any) -> Any:
    import torch

    t = x.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if t.is_complex() and t.is_conj():
        t = t.resolve_conj()
    return t


def host_buffer(x: Array) -> np.ndarray | None:
    """Local. ``x`` itself as a numpy array MPI can read and write in place, or None.

    The fast path of hot collectives (an all-reduce per layer call): a C-contiguous numpy
    array, or a contiguous CPU torch tensor that is neither bfloat16 (MPI cannot add it) nor
    a lazily conjugated view, needs no context manager. Anything else (device memory,
    bfloat16, conjugate views, non-contiguous blocks) gives None: use :func:`mpi_buffer` or
    :func:`reduction_buffer`, which stage, convert or raise.
    """
    if type(x) is np.ndarray:
        return x if x.flags.c_contiguous else None
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and isinstance(x, torch.Tensor)
        and x.device.type == "cpu"
        and x.dtype != torch.bfloat16
        and not x.is_conj()
        and x.is_contiguous()
    ):
        return x.detach().numpy()
    return None


@contextlib.contextmanager
def mpi_buffer(x: Array, *, read: bool = True, write: bool = False) -> Iterator[Any]:
    """Local. Yield a buffer for MPI that aliases the contiguous block ``x``.

    Parameters
    ----------
    x : array
        A C-contiguous numpy array, torch tensor or cupy array.
    read : bool
        MPI reads the buffer (send side): device data is copied to the staging buffer first.
    write : bool
        MPI writes the buffer (receive side): staged data is copied back to ``x`` on exit.

    Raises
    ------
    ValueError
        If ``x`` is not contiguous.
    """
    name = backend_name(x)
    if name == "numpy":
        if not x.flags.c_contiguous:
            raise ValueError("MPI buffers must be C-contiguous; use np.ascontiguousarray")
        yield x
        return
    if name == "torch" and not x.is_contiguous():
        raise ValueError("MPI buffers must be contiguous tensors; call .contiguous()")
    if name == "torch" and shape_only(x):  # (shapes only: a virtual grid's messages, which move nothing)
        yield x
        return
    if name == "cupy" and not x.flags.c_contiguous:
        raise ValueError("MPI buffers must be C-contiguous; use cupy.ascontiguousarray")
    if name == "torch" and not is_device(x):
        yield _torch_view(x).numpy()
        return
    # device memory
    dev = _torch_view(x) if name == "torch" else x
    synchronize(x)
    if cuda_aware():
        yield dev
        synchronize(x)
        return
    n = nbytes(x)
    pooled = _acquire_staging(n)
    host = pooled[:n]
    raw = byte_view(dev)
    try:
        if read:
            if name == "torch":
                import torch

                torch.from_numpy(host).copy_(raw)
            else:
                raw.get(out=host)
        yield host.view(numpy_dtype(dev.dtype)).reshape(tuple(x.shape))  # bfloat16 is viewed as int16
        if write:
            if name == "torch":
                import torch

                raw.copy_(torch.from_numpy(host))
            else:
                raw.set(host)
            synchronize(x)
    finally:
        _release_staging(pooled)


@contextlib.contextmanager
def reduction_buffer(x: Array, *, write: bool) -> Iterator[Any]:
    """Local. :func:`mpi_buffer` (``read=True``) for a reduction's contribution and result.

    MPI has no bfloat16 arithmetic (moving bfloat16 as int16 would add bit patterns), so a
    torch bfloat16 block is reduced as a float32 copy on its device and rounded back into
    ``x`` on exit when ``write``; every other block is reduced in place.
    """
    if not (is_torch(x) and str(x.dtype) == "torch.bfloat16"):
        with mpi_buffer(x, read=True, write=write) as buf:
            yield buf
        return
    import torch

    wide = x.detach().to(torch.float32)
    with mpi_buffer(wide, read=True, write=write) as buf:
        yield buf
    if write:
        with torch.no_grad():
            x.copy_(wide)
