"""Rank-aware logging: rank 0 speaks, other ranks only with ``verbose``; lines carry the rank."""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["get_logger"]


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self.rank, self.size = rank, size

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = f"{self.rank}/{self.size}"
        return True


def get_logger(name: str, comm: Any, verbose: bool = False) -> logging.Logger:
    """Local. A logger printing ``[rank r/size]`` lines to stderr: rank 0 at INFO, others
    at WARNING unless ``verbose`` (then every rank at INFO, rank 0 at DEBUG too).

    Parameters
    ----------
    name : str
        Logger name (e.g. ``"hpctp.demo"``).
    comm : mpi4py communicator or ProcessGrid
    verbose : bool
        Let every rank log.
    """
    comm = getattr(comm, "comm", comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    logger = logging.getLogger(f"{name}.rank{rank}")
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s [rank %(rank)s] %(message)s", "%H:%M:%S"))
    handler.addFilter(_RankFilter(rank, size))
    logger.addHandler(handler)
    if rank == 0:
        logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    else:
        logger.setLevel(logging.INFO if verbose else logging.WARNING)
    return logger
