"""One GPU per rank: pick the device from the node-local rank (``MPI.COMM_TYPE_SHARED``)."""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from . import trace as T
from .collectives import raise_if_any
from .env import device_setting

__all__ = ["local_rank", "gpu_count", "select_device", "current_device", "use_device"]


def local_rank(comm: Any) -> tuple[int, int]:
    """Collective over ``comm``. ``(rank, size)`` among the ranks of ``comm`` on this node."""
    comm = getattr(comm, "comm", comm)
    e = T.begin(comm, "Comm_split_type", 0) if T.on and comm.Get_size() > 1 else None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    if e is not None:
        T.end(e)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def _torch_cuda() -> Any:
    """torch, if it is installed and sees a CUDA device; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _cupy() -> Any:
    """cupy, if it is installed and sees a CUDA device; else None."""
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # no cupy, or no driver
        return None


def gpu_count() -> int:
    """Local. CUDA devices visible to this process (0 without torch/cupy CUDA support)."""
    torch = _torch_cuda()
    if torch is not None:
        return int(torch.cuda.device_count())
    cupy = _cupy()
    return 0 if cupy is None else int(cupy.cuda.runtime.getDeviceCount())


def select_device(comm: Any) -> int | None:
    """Collective over ``comm``. Make GPU ``local_rank % gpu_count`` current for torch and cupy.

    With one visible GPU per rank (``CUDA_VISIBLE_DEVICES`` set by the launcher, see
    ``jobs/bind_gpu.sh``) this is device 0; with all node GPUs visible, ranks spread over them
    round-robin. ``HPCTP_DEVICE`` overrides the index.

    Returns
    -------
    int or None
        The selected device index, or None when no GPU is visible.

    Raises
    ------
    ValueError
        On every rank, if ``HPCTP_DEVICE`` is not a device index this rank can see.
    """
    lrank, _ = local_rank(comm)
    n = gpu_count()
    error: ValueError | None = None
    dev: int | None = None
    try:
        forced = device_setting()
        if n > 0:
            dev = lrank % n if forced is None else forced
            if dev >= n:
                raise ValueError(
                    f"HPCTP_DEVICE={dev} but rank {comm.Get_rank()} sees {n} GPU(s) (0..{n - 1}); "
                    f"unset it, or check CUDA_VISIBLE_DEVICES"
                )
    except ValueError as e:
        error = e
    raise_if_any(getattr(comm, "comm", comm), error)
    use_device(dev)
    return dev


def use_device(dev: int | None) -> None:
    """Local. Make GPU ``dev`` current for torch and cupy in the calling thread (None: no-op).

    The current device is per thread: a worker thread that creates device blocks (the
    prefetch thread of :class:`~hpctp.io.FieldLoader`) calls this with its parent's
    :func:`current_device` first.
    """
    if dev is None:
        return
    torch = _torch_cuda()
    if torch is not None:
        torch.cuda.set_device(dev)
    cupy = _cupy()
    if cupy is not None:
        cupy.cuda.Device(dev).use()


def current_device() -> int | None:
    """Local. The calling thread's current CUDA device (torch's, else cupy's); None without a GPU."""
    torch = _torch_cuda()
    if torch is not None:
        return int(torch.cuda.current_device())
    cupy = _cupy()
    return None if cupy is None else int(cupy.cuda.Device().id)
