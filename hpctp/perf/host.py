"""The host's own work in a training step, apart from the data work of its operators.

A step on one rank costs the host's work (Python, the dispatch of every operator, hooks, the optimizer's loop over
its tensors) and its operators' data work (flops, bytes). The planner prices the data work from the traced shapes at
a machine's rates (:mod:`hpctp.perf.timing`), and the host's work from one real small step on this CPU
(:attr:`hpctp.perf.workload.Workload.host`), which this module counts:

* :class:`OperatorClock`, a dispatch mode, times every aten operator of the step in this thread's CPU time;
* what an operator takes beyond a small operator (an 8-element add) is its data work, and is left out, as is the
  clock's own cost per operator (:class:`ClockCosts`, timed on a loop of small operators with and without it);
* the rest is counted in small operators timed just before it (:func:`small_operators_seconds`): a count does not
  move with this machine's speed, and a machine file's seconds per kernel make it that machine's host time.

Counted whole, one step of a wide FNO (16 M parameters, a 32x32 probe field) read 38,000 small operators here: its
spectral products and Adam's arithmetic, which the trace prices at the machine's rates too, and which a GPU's machine
file then priced as host time (0.27 s of an H100 step predicted at 0.33 s). Without them it counts 2,000.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_UNIT_OPS", "ClockCosts", "OperatorClock", "clock_costs", "host_count", "small_operators_seconds"]

HOST_UNIT_OPS = 500
"""Small operators per timing of the unit a host count is counted in (:func:`clock_costs`)."""

T = TypeVar("T")


def small_operators_seconds(
    count: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32,
    clock: Callable[[], float] = time.perf_counter,
) -> float:  # fmt: skip
    """Local. Seconds of ``count`` small operators in a row on ``device`` (an 8-element add each, the device
    synchronized at the end): the host's own cost of launching one, in Python, dispatch and the allocator.

    Parameters
    ----------
    count : int
    device : torch.device, optional
        Default the CPU.
    dtype : torch.dtype
    clock : callable
        The clock read before and after: wall time (default), or ``time.thread_time`` for this thread's CPU time.

    Returns
    -------
    float
    """
    dev = device or torch.device("cpu")
    t = torch.zeros(8, dtype=dtype, device=dev)
    t0 = clock()
    for _ in range(count):
        t = t + 1.0
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return clock() - t0


class OperatorClock(TorchDispatchMode):
    """Local. A dispatch mode that counts the aten operators run under it (forward, backward and the optimizer's)
    and the CPU seconds this thread spends inside them (:attr:`inside`)."""

    def __init__(self) -> None:
        super().__init__()
        self.operators = 0
        self.inside = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        t0 = time.thread_time()
        out = func(*args, **(kwargs or {}))
        self.inside += time.thread_time() - t0
        self.operators += 1
        return out


class ClockCosts(NamedTuple):
    """Local. This thread's CPU seconds of one small operator: alone (:attr:`unit`), under an :class:`OperatorClock`
    (:attr:`clocked`), and of that inside the operator (:attr:`inside`)."""

    unit: float
    clocked: float
    inside: float

    @property
    def per_operator(self) -> float:
        """What the host's work of one operator is beyond what the clock leaves outside it: the operator alone less
        the clock's own cost (``unit - (clocked - inside)``); negative where the clock costs more than an operator."""
        return self.unit - (self.clocked - self.inside)


def clock_costs(count: int = HOST_UNIT_OPS, rounds: int = 3) -> ClockCosts:
    """Local. :class:`ClockCosts` of a loop of ``count`` small operators, each figure the median of ``rounds`` rounds
    that time it alone and under the clock in turn (a machine whose speed drifts slows both alike)."""
    alone, clocked, inside = [], [], []
    for _ in range(rounds):
        alone.append(small_operators_seconds(count, clock=time.thread_time) / count)
        clock = OperatorClock()
        with clock:
            clocked.append(small_operators_seconds(count, clock=time.thread_time) / count)
        inside.append(clock.inside / max(clock.operators, 1))
    return ClockCosts(float(np.median(alone)), float(np.median(clocked)), float(np.median(inside)))


def host_count(fn: Callable[[], T], costs: ClockCosts) -> tuple[float, T]:
    """Local. Run ``fn()`` and count its host work in small operators: this thread's CPU time under an
    :class:`OperatorClock`, less the time inside the operators and the clock's own cost, plus one small operator's
    dispatch per operator, over :attr:`ClockCosts.unit` (at least 0).

    Parameters
    ----------
    fn : callable
        The work, on this thread (torch's CPU backward runs on the caller's).
    costs : ClockCosts
        Timed just before (:func:`clock_costs`).

    Returns
    -------
    float, object
        The count and ``fn``'s result.
    """
    clock = OperatorClock()
    with clock:
        t0 = time.thread_time()
        out = fn()
        seconds = time.thread_time() - t0
    host = seconds - clock.inside + clock.operators * costs.per_operator
    return max(host, 0.0) / costs.unit, out
