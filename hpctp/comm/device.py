"""One GPU per rank: pick the device from the node-local rank (``MPI.COMM_TYPE_SHARED``)."""

from __future__ import annotations

import os
from typing import Any

from mpi4py import MPI

__all__ = ["local_rank", "gpu_count", "select_device"]


def local_rank(comm: Any) -> tuple[int, int]:
    """Collective over ``comm``. ``(rank, size)`` among the ranks of ``comm`` on this node."""
    comm = getattr(comm, "comm", comm)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def gpu_count() -> int:
    """Local. CUDA devices visible to this process (0 without torch/cupy CUDA support)."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.device_count())
    except ImportError:
        pass
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, or no driver
        return 0


def select_device(comm: Any) -> int | None:
    """Collective over ``comm``. Make GPU ``local_rank % gpu_count`` current for torch and cupy.

    With one visible GPU per rank (``CUDA_VISIBLE_DEVICES`` set by the launcher, see
    ``jobs/bind_gpu.sh``) this is device 0; with all node GPUs visible, ranks spread over them
    round-robin. ``HPCTP_DEVICE`` overrides the index.

    Returns
    -------
    int or None
        The selected device index, or None when no GPU is visible.
    """
    lrank, _ = local_rank(comm)
    n = gpu_count()
    if n == 0:
        return None
    dev = int(os.environ.get("HPCTP_DEVICE", lrank % n))
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(dev)
    except ImportError:
        pass
    try:
        import cupy

        cupy.cuda.Device(dev).use()
    except Exception:  # cupy missing
        pass
    return dev
