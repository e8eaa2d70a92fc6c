"""Timing helpers shared by the benchmark scripts (no torch: numpy and hpctp only)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import hpctp


def best_of(fn: Callable[[], object], reps: int, grid: hpctp.ProcessGrid) -> float:
    """Collective over grid. The best of ``reps`` runs of ``fn`` after one warm-up (plans,
    allocations), each timed by its slowest rank (:func:`hpctp.comm.slowest_seconds`)."""
    return min(hpctp.comm.slowest_seconds(grid.comm, fn) for _ in range(reps + 1))


def single_process(grid: Any, fn: Callable[[], tuple[Any, float]]) -> tuple[Any, float] | None:
    """Collective over grid. ``fn()`` (a result and its time) on rank 0 while the other ranks
    sleep rather than spin, so the reference has the cores to itself; None elsewhere."""
    out = fn() if grid.rank == 0 else None
    req = grid.comm.Ibarrier()
    while not req.Test():
        time.sleep(0.05)
    return out
