"""The virtual grid against the real one: the same step's messages, counted on both.

:func:`same_messages` runs a step on the real grid (real data, float64 on the CPU) and again, on this process
alone, on a virtual grid of the same shape playing this rank (:meth:`hpctp.ProcessGrid.virtual`, ``meta``
tensors), each under a :class:`hpctp.comm.CommCounter`; every communicator's calls, bytes and messages must be
equal. One collective verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import hpctp
from hpctp.comm import CommCounter
from hpctp.testing import assert_all

Step = Callable[[hpctp.ProcessGrid, torch.device, torch.dtype], Callable[[], Any]]
"""A step: builds what it needs on ``grid`` on ``device`` (``cpu`` or ``meta``) in ``dtype`` (its messages not
counted: a real build broadcasts what a meta one leaves to ``to_empty``) and returns the counted run."""


def counts(c: CommCounter) -> dict[str, tuple[int, int, int, tuple[tuple[str, int], ...]]]:
    """Local. Per communicator: (bytes sent, bytes received, messages, calls per operation), sorted."""
    return {
        name: (s.bytes_sent, s.bytes_recv, s.messages, tuple(sorted((k, v) for k, v in s.calls.items() if v)))
        for name, s in sorted(c.per_comm.items())
        if s.calls
    }


def virtual_twin(grid: hpctp.ProcessGrid) -> hpctp.ProcessGrid:
    """Local. A virtual grid of ``grid``'s shape and periods playing this rank."""
    return hpctp.ProcessGrid.virtual(grid.dims, rank=grid.rank, periods=grid.periods)


def same_messages(grid: hpctp.ProcessGrid, step: Step, what: str = "", dtype: torch.dtype = torch.float64) -> dict:
    """Collective over grid. ``step`` on ``grid`` (CPU) and on its virtual twin (meta) sends the same.

    Returns the real run's counts (a test may check that the step sent something)."""
    torch.manual_seed(0)
    run = step(grid, torch.device("cpu"), dtype)
    with CommCounter() as real:
        run()
    error = ""
    try:
        twin = virtual_twin(grid)
        run = step(twin, torch.device("meta"), dtype)
        with CommCounter() as dry:
            run()
        twin.free()
        a, b = counts(real), counts(dry)
        if a != b:
            diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
            error = f"{what} on {grid.dims}, rank {grid.rank}: real != virtual per communicator: {diff}"
    except Exception as e:  # noqa: BLE001 - reported collectively
        error = f"{what} on {grid.dims}, rank {grid.rank}: the virtual run raised {type(e).__name__}: {e}"
    assert_all(grid, not error, error)
    return counts(real)
