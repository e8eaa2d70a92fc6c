"""The planner: which grid, roles, ZeRO stage, recomputation and pipeline to train a model with.

:func:`plan` traces the model once (:func:`hpctp.perf.trace`), enumerates the plans of ``ranks`` ranks
(:mod:`hpctp.perf.search`), predicts each one's peak memory per rank and step time on a machine
(:mod:`hpctp.perf.memory`, :mod:`hpctp.perf.timing`, :mod:`hpctp.perf.layers`), and returns them
ranked by predicted step time, each with its breakdown and bottleneck, beside the plans that do not fit
the memory budget and why. No trial runs: every figure comes from the layers' own plans and the trace.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..nn.pipeline_parallel import SCHEDULES
from .machine import MachineProfile, load_machine
from .model import Prediction
from .search import candidates, evaluate, limits
from .workload import Builder, Sample, Workload, trace

__all__ = ["PlanError", "PlanReport", "plan", "parse_bytes", "DEFAULT_MACHINE"]

DEFAULT_MACHINE = "h100-ndr"
"""The machine :func:`plan` prices on when none is given (a published profile)."""

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


class PlanError(ValueError):
    """Local. No plan fits: the message says what to change (more ranks, more memory, recomputation)."""


def parse_bytes(value: int | float | str) -> int:
    """Local. Bytes from an int or a string such as ``"80GiB"``, ``"512 MiB"``, ``"1.5e9"``.

    Raises
    ------
    ValueError
        On anything else (naming the units understood).
    """
    if isinstance(value, bool):
        raise ValueError(f"memory must be bytes or a size such as '80GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"memory must be a positive size (bytes, or e.g. 80GiB), got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"memory {value!r} is not a size: give e.g. 80GiB, 512MiB, 40GB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[unit])


def _gib(n: float) -> str:
    """A size with its unit: GiB, MiB, KiB or bytes, whichever reads as a number from 1 up."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n:.0f} B"


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f}" if t < 10 else f"{t:.3g} s"


@dataclass
class PlanReport:
    """Local. The plans of one model on one machine, ranked.

    Attributes
    ----------
    ranked : list of Prediction
        The plans that fit, fastest first.
    infeasible : list of Prediction
        The plans that do not fit, smallest peak first, each with its reason.
    workload : Workload
    machine : MachineProfile
    ranks, budget : int
    seconds : float
        How long tracing and searching took.
    """

    ranked: list[Prediction]
    infeasible: list[Prediction]
    workload: Workload
    machine: MachineProfile
    ranks: int
    budget: int
    seconds: float = 0.0

    @property
    def best(self) -> Prediction:
        """Local. The fastest plan that fits."""
        return self.ranked[0]

    def table(self, top: int = 10, infeasible: int = 5) -> str:
        """Local. The ``top`` plans and the ``infeasible`` closest to fitting, as a text table."""
        w = self.workload
        wide = max([29, *(len(p.candidate.label()) for p in self.ranked[:top])])  # the plan column's width
        lines = [
            f"{self.ranks} ranks, {_gib(self.budget)} per rank, machine: {self.machine.name} ({self.machine.source})",
            f"model: {w.param_count / 1e6:.4g} M parameters ({_gib(w.param_bytes)}), sample {w.sample.shape} "
            f"{w.sample.dtype}; {len(self.ranked)} plans fit, {len(self.infeasible)} do not "
            f"(traced and searched in {self.seconds:.1f} s)",
            "",
            f"  # | {'plan':{wide}s} | {'grid (P,D,S..,T)':17s} | memory/rank | "
            + "  ".join(f"{k:>9s}" for k in ("params", "grads", "optim", "activ"))
            + " | step [ms] | "
            + " ".join(f"{k:>7s}" for k in ("compute", "spatial", "tensor", "data", "pipe", "bubble", "optim"))
            + " [ms] | bottleneck",
        ]
        for i, p in enumerate(self.ranked[:top]):
            lines.append(_row(i + 1, p, wide))
        if self.ranked and self.best.cuts:
            lines.append(f"plan 1's pipeline stages cut the model's layers at {list(self.best.cuts)} (balanced flops): "
                         "give them to PipelineParallel(cuts=...)")  # fmt: skip
        if self.infeasible and infeasible:
            lines += ["", "closest plans that do not fit:"]
            for p in self.infeasible[:infeasible]:
                lines.append(f"    {p.candidate.label():30s} {p.reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _row(i: int, p: Prediction, wide: int) -> str:
    c, m, t = p.candidate, p.memory, p.time
    grid = "x".join(map(str, c.dims))

    def f(x: float) -> str:
        return f"{x * 1e3:7.1f}"

    return (
        f"{i:3d} | {c.label():{wide}s} | {grid:17s} | {_gib(m.total):>11s} | {_gib(m.params):>9s}  {_gib(m.grads):>9s}  "
        f"{_gib(m.optimizer):>9s}  {_gib(m.activations):>9s} | {t.total * 1e3:9.1f} | {f(t.compute)} "
        f"{f(t.comm.get('spatial', 0))} {f(t.comm.get('tensor', 0))} {f(t.comm.get('data', 0))} "
        f"{f(t.comm.get('pipeline', 0))} {f(t.bubble)} {f(t.optimizer)}      | {p.bottleneck}"
    )


def plan(
    model: Builder | Workload,
    sample: Sample | Sequence[int] | None = None,
    *,
    ranks: int,
    memory: int | float | str,
    machine: MachineProfile | str | Path | None = None,
    recompute: Callable[[torch.nn.Module], Any] | bool = True,
    units: Callable[[torch.nn.Module], Sequence[torch.nn.Module]] | None = None,
    pipeline: bool = True,
    schedules: Sequence[str] = SCHEDULES,
    zero: Sequence[int] = (0, 1, 2, 3),
) -> PlanReport:
    """Local. Rank the ways to train ``model`` on ``ranks`` ranks of ``machine`` within ``memory`` bytes per rank.

    Parameters
    ----------
    model : callable or Workload
        ``builder(plan) -> torch.nn.Module`` (see :func:`hpctp.perf.trace`), or a workload traced already.
    sample : Sample or sequence of int
        The global batch of one step, ``(batch, channels, *field)`` (float32), or a :class:`Sample`.
    ranks : int
    memory : int, float or str
        Bytes per rank (``"80GiB"`` ...).
    machine : MachineProfile, str or path, optional
        A profile, a machine file, or a published profile's name (default :data:`DEFAULT_MACHINE`).
    recompute : callable or bool
        How the model's activations are recomputed (see :func:`hpctp.perf.trace`); False leaves
        recomputation out of the search.
    units : callable, optional
        The model's sharding units (see :func:`hpctp.perf.trace`).
    pipeline : bool
        Include pipeline plans: for a model that is a chain of layers (a ``torch.nn.Sequential``, which
        :class:`hpctp.nn.PipelineParallel` cuts into stages; other models get none).
    schedules : sequence of str
        The pipeline schedules to consider.
    zero : sequence of int
        The ZeRO stages to consider.

    Returns
    -------
    PlanReport

    Raises
    ------
    PlanError
        If no grid of ``ranks`` ranks exists for the model, no plan fits ``memory`` (the message names
        the smallest peak and what to change), or ``ranks`` span several nodes of a machine that prices no
        message between nodes.
    ValueError
        On a bad sample, rank count, memory size, or machine file (naming the key).
    """
    t0 = time.perf_counter()
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive int, got {ranks!r}")
    budget = parse_bytes(memory)
    prof = machine if isinstance(machine, MachineProfile) else load_machine(machine or DEFAULT_MACHINE)
    _check_nodes(prof, ranks)
    if isinstance(model, Workload):
        work = model
    else:
        if sample is None:
            raise ValueError("plan needs the sample (batch, channels, *field) of one step for a model builder")
        smp = sample if isinstance(sample, Sample) else Sample(tuple(sample))
        prof.rates(smp.dtype)  # (an error now, before tracing, if the machine lacks this dtype)
        device = "meta" if prof.asynchronous else "cpu"  # (a GPU's code paths are the non-CPU ones)
        work = trace(model, smp, recompute=recompute if recompute else None, units=units, device=device)
    prof.rates(work.sample.dtype)
    pipeline = pipeline and isinstance(work.model, torch.nn.Sequential)
    cands = candidates(work, ranks, schedules=schedules, zero=zero, recompute=(False, True) if recompute else (False,),
                       pipeline=pipeline)  # fmt: skip
    if not cands:
        lim = limits(work)
        raise PlanError(
            f"no grid of {ranks} ranks suits this model: it can use at most {lim.data} data ranks (the samples of a "
            f"step), {' x '.join(map(str, lim.spatial))} spatial ranks (the field's cells per dim), {lim.tensor} "
            f"tensor ranks and {lim.pipeline} pipeline stages (its layers); use a rank count that factors into "
            f"these (at most {lim.ranks}), or a larger batch or field"
        )
    host_scale = prof.rates(work.sample.dtype).kernel  # (the trace counts the host's work in small operators)
    preds = evaluate(work, cands, prof, budget, host_scale=host_scale, asynchronous=prof.asynchronous)
    ranked = sorted((p for p in preds if p.fits), key=lambda p: (p.time.total, p.memory.total))
    infeasible = sorted((p for p in preds if not p.fits), key=lambda p: p.memory.total)
    report = PlanReport(ranked, infeasible, work, prof, ranks, budget, time.perf_counter() - t0)
    if not ranked:
        raise PlanError(_nothing_fits(report, recompute=bool(recompute)))
    return report


def _check_nodes(prof: MachineProfile, ranks: int) -> None:
    """Local. A PlanError, before any tracing, when ``ranks`` ranks span several nodes of ``prof`` and it prices no
    message between nodes (a calibrated profile: its ranks are one node): every axis of a grid of that many ranks that
    crosses a node would need the missing figures."""
    if ranks <= prof.ranks_per_node or "inter" in prof.network:
        return
    raise PlanError(
        f"machine {prof.name!r} prices messages within a node of {prof.ranks_per_node} ranks only (no [network.inter] "
        f"figures), and {ranks} ranks span several nodes: plan at most {prof.ranks_per_node} ranks, measure as many "
        f"ranks as you plan for ('mpiexec -n {ranks} hpctp perf calibrate --out machine.toml', taken as one node), or "
        "add a [network.inter] table to the machine file"
    )


def _nothing_fits(report: PlanReport, recompute: bool) -> str:
    small = report.infeasible[0]
    need = small.memory.total
    kinds = small.memory.kinds()
    top = max(kinds, key=lambda k: kinds[k])
    more = math.ceil(report.ranks * need / report.budget)
    text = (
        f"no plan of {report.ranks} ranks fits in {_gib(report.budget)} per rank: the smallest peak is {_gib(need)} "
        f"({small.candidate.label()}; {top} {_gib(kinds[top])}). Give more memory per rank (at least {_gib(need)}), "
        f"or more ranks (at least {more}: a plan's state and activations per rank shrink at best as 1 / ranks)"
    )
    if not recompute:
        text += ", or allow activation recomputation"
    if small.candidate.zero < 3 and small.candidate.data > 1:
        text += ", or a higher ZeRO stage"
    return text + "."
