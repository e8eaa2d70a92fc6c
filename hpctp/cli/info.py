"""What this installation can do: MPI library, ranks, grid, CUDA-aware MPI, array backends."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from typing import Any

from mpi4py import MPI

from ..comm import allgather_ints, cuda_aware_reason, gpu_count, local_rank, raise_if_any, select_device
from ..comm.env import DEBUG_VARIABLES, environment_error

__all__ = ["runtime_info", "format_info"]


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _module_version(module: str) -> str | None:
    """Version of the distribution that provides ``module`` (e.g. cupy-cuda12x or cupy-cuda13x)."""
    for dist in importlib.metadata.packages_distributions().get(module, []):
        version = _version(dist)
        if version is not None:
            return version
    return None


def runtime_info(comm: Any = None) -> dict[str, Any]:
    """Collective over ``comm``. A dict describing the MPI runtime, backends and GPUs.

    ``gpu_per_rank`` lists, for every rank, the device it selects (``-1``: none), so a
    job can check its one-GPU-per-rank binding. The debugging variables (``HPCTP_TRACE``,
    ``HPCTP_WATCHDOG``, ``HPCTP_CHECK``, ``HPCTP_TRACE_DIR``; see :mod:`hpctp.debug`) are listed
    with their values on this rank.
    """
    comm = MPI.COMM_WORLD if comm is None else getattr(comm, "comm", comm)
    raise_if_any(comm, environment_error())  # a bad HPCTP_* value on one rank raises on every rank
    lrank, lsize = local_rank(comm)
    dev = select_device(comm)
    devices = allgather_ints(comm, [-1 if dev is None else dev])[:, 0].tolist()
    aware, why = cuda_aware_reason()
    info: dict[str, Any] = {
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi4py": _version("mpi4py"),
        "ranks": comm.Get_size(),
        "default_grid_2d": tuple(MPI.Compute_dims(comm.Get_size(), 2)),
        "ranks_on_this_node": lsize,
        "gpus_visible": gpu_count(),
        "gpu_per_rank": devices,
        "cuda_aware_mpi": aware,
        "cuda_aware_reason": why,
        "mpi_cuda_support": cuda_aware_reason(override=False)[0],
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "cupy": _module_version("cupy"),
        "h5py": _version("h5py"),
    }
    try:
        h5py = importlib.import_module("h5py")
        info["h5py_mpi"] = bool(h5py.get_config().mpi)
    except ImportError:
        info["h5py_mpi"] = False
    for name in DEBUG_VARIABLES:
        info[name] = os.environ.get(name, "") or _UNSET[name]
    return info


_UNSET = {
    "HPCTP_TRACE": "unset (flight recorder off; N: keep the last N MPI calls per rank, dumps at exit)",
    "HPCTP_WATCHDOG": "unset (no hang watchdog; seconds: report and end a job waiting that long in one call)",
    "HPCTP_CHECK": "unset (off; 1: compare each collective's operation, size, dtype and root first)",
    "HPCTP_TRACE_DIR": "unset (dumps and reports in ./hpctp-trace)",
}


def format_info(info: dict[str, Any]) -> str:
    """Local. ``runtime_info`` as aligned ``key: value`` lines."""
    width = max(len(k) for k in info)
    return "\n".join(f"{k.ljust(width)} : {v}" for k, v in info.items())
