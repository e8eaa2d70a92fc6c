"""Detection of CUDA-aware MPI (device pointers accepted by the MPI library)."""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

from .env import cuda_aware_setting, flag_set

__all__ = ["cuda_aware", "cuda_aware_reason"]


def _loaded_mpi_libraries() -> list[str]:
    """Paths of the MPI libraries mapped into this process (Linux ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps}
    except OSError:  # no procfs (macOS): only the global namespace is searched
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith("libmpi") and ".so" in p)


@lru_cache(maxsize=1)
def _query_library() -> tuple[bool | None, str]:
    """Ask the loaded MPI library (``MPIX_Query_cuda_support``) when it exports the query.

    Python loads mpi4py (and so the MPI library) with ``RTLD_LOCAL``, so the symbol is
    looked up in each mapped ``libmpi*`` as well as in the global namespace.
    """
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:  # newer mpi4py wraps the MPIX query
        return bool(query()), "mpi4py MPI.Query_cuda_support()"
    for path in [None, *_loaded_mpi_libraries()]:
        try:
            fn = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return bool(fn()), f"MPIX_Query_cuda_support() of {path or 'the process'}"
    return None, "library has no MPIX_Query_cuda_support"


def cuda_aware_reason(*, override: bool = True) -> tuple[bool, str]:
    """Local. Whether device buffers go to MPI directly, and why.

    Order: the ``HPCTP_CUDA_AWARE`` environment variable (``0``/``1``) overrides; then the
    MPI library's own query; then library-specific environment (Open MPI's
    ``OMPI_MCA_opal_cuda_support``, MPICH's ``MPIR_CVAR_ENABLE_GPU``, Cray's
    ``MPICH_GPU_SUPPORT_ENABLED``); otherwise False (host staging, always correct).

    Parameters
    ----------
    override : bool
        Honour ``HPCTP_CUDA_AWARE``. False gives what the MPI library itself reports
        (e.g. to decide whether forcing the direct path is safe).

    Returns
    -------
    (bool, str)
        The decision and where it came from.

    Raises
    ------
    ValueError
        If ``HPCTP_CUDA_AWARE`` is set to something that is not a boolean.
    """
    forced = cuda_aware_setting() if override else None
    if forced is not None:
        return forced, f"HPCTP_CUDA_AWARE={int(forced)}"
    found, why = _query_library()
    if found is not None:
        return found, why
    for var in ("MPICH_GPU_SUPPORT_ENABLED", "OMPI_MCA_opal_cuda_support", "MPIR_CVAR_ENABLE_GPU"):
        if flag_set(var):
            return True, f"{var}=1"
    return False, "not detected (set HPCTP_CUDA_AWARE=1 to force)"


def cuda_aware() -> bool:
    """Local. True when device (CUDA) buffers are passed to MPI without host staging.

    Returns
    -------
    bool
        See :func:`cuda_aware_reason` for the detection order.
    """
    return cuda_aware_reason()[0]
