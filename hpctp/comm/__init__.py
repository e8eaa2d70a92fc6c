"""The only part of hpctp that talks to MPI: process grids, collectives, counters."""

from .agree import agree_arguments
from .buffers import mpi_buffer, nbytes, staging_pool, synchronize
from .callsite import label as trace_label
from .collectives import (
    Pending,
    all_true,
    allgather_ints,
    allgatherv,
    allreduce,
    alltoallv,
    barrier,
    bcast,
    bcast_ints,
    gatherv,
    iallgatherv,
    iallreduce,
    ibcast,
    irecv,
    ireduce_scatter,
    isend,
    raise_if_any,
    scatterv,
    slowest_seconds,
    waitall,
)
from .counter import Call, CallLog, CommCounter, record
from .cuda import cuda_aware, cuda_aware_reason
from .device import current_device, gpu_count, local_rank, select_device, use_device
from .grid import ProcessGrid, check_grid
from .groups import free_comm, iprobe, split_comm
from .summa_calls import ireduce, reduce
from .virtual import VirtualComm, is_virtual, virtual_world

__all__ = [
    "Call",
    "CallLog",
    "CommCounter",
    "Pending",
    "ProcessGrid",
    "all_true",
    "agree_arguments",
    "allgather_ints",
    "allgatherv",
    "allreduce",
    "alltoallv",
    "barrier",
    "bcast",
    "bcast_ints",
    "check_grid",
    "cuda_aware",
    "cuda_aware_reason",
    "current_device",
    "free_comm",
    "gatherv",
    "gpu_count",
    "iallgatherv",
    "iallreduce",
    "ibcast",
    "iprobe",
    "irecv",
    "ireduce",
    "ireduce_scatter",
    "isend",
    "local_rank",
    "mpi_buffer",
    "nbytes",
    "raise_if_any",
    "record",
    "reduce",
    "scatterv",
    "slowest_seconds",
    "split_comm",
    "select_device",
    "staging_pool",
    "synchronize",
    "trace_label",
    "use_device",
    "VirtualComm",
    "is_virtual",
    "virtual_world",
    "waitall",
]
