"""Enumerate the ways to train a workload on ``ranks`` ranks, predict each, rank them.

The grid is ``pipeline x data x spatial_1 x ... x spatial_d x tensor``. Every ordered factorisation of
``ranks`` into those axes is a candidate grid unless an axis has more ranks than it can use (data: the
samples of a step; spatial: the field's cells per dim; tensor: the heads, or none when no parameter is
split over it; pipeline: the model's units). Equal field dims are symmetric, so a grid and its mirror
are priced once (the one with more ranks on the first dim). Each grid is combined with the ZeRO stages
(0 alone without data parallelism), recomputation on and off, and for a pipeline its schedules with
``p``, ``2 p`` and ``4 p`` micro-batches (and two chunks per rank for the interleaved schedule).

Memory is predicted first (it needs no message model) and only the plans that fit are timed; plans that
share a block and a micro-batch share their per-module costs, and identical modules (a transformer's
blocks) are priced once, so thousands of candidates take seconds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from ..layout import block_range
from ..nn.pipeline_parallel import RECEIVE_AHEAD, SCHEDULES, ActionKind, pipeline_schedule
from .machine import MachineProfile
from .memory import predict_memory, shares
from .model import Candidate, MemoryBreakdown, Prediction, TimeBreakdown
from .timing import LayerCost, chain_cuts, layer_cost, point_free_share, predict_time, stage_cuts
from .workload import LayerInfo, Trace, Workload

__all__ = ["Limits", "limits", "grids", "candidates", "evaluate", "memory_of", "spearman"]


@dataclass(frozen=True)
class Limits:
    """Local. The most ranks each axis can use, and why."""

    data: int
    spatial: tuple[int, ...]
    tensor: int
    pipeline: int

    @property
    def ranks(self) -> int:
        """Local. The most ranks any grid can use."""
        return self.data * math.prod(self.spatial) * self.tensor * self.pipeline


def limits(work: Workload) -> Limits:
    """Local. The axis limits of ``work`` (see the module docstring)."""
    s = work.sample
    spatial = tuple(n // s.spatial_multiple for n in s.field)
    tensor = 1
    if work.tensor_capable:
        sizes = [p.shape[p.tensor_dim] for p in work.params if p.tensor_dim is not None]
        tensor = min(sizes) if sizes else 1
        if s.tensor_units:
            tensor = min(tensor, s.tensor_units)
    return Limits(s.batch, spatial, tensor, max(1, len(work.units) - 1))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def grids(ranks: int, lim: Limits, symmetric: bool) -> Iterator[tuple[int, int, tuple[int, ...], int]]:
    """Local. ``(pipeline, data, spatial, tensor)`` with product ``ranks`` within ``lim``."""
    nsp = len(lim.spatial)

    def spatial(rest: int, k: int) -> Iterator[tuple[int, ...]]:
        if k == nsp:
            if rest == 1:
                yield ()
            return
        for d in _divisors(rest):
            if d <= lim.spatial[k]:
                for tail in spatial(rest // d, k + 1):
                    yield (d, *tail)

    for p in _divisors(ranks):
        if p > lim.pipeline:
            continue
        for t in _divisors(ranks // p):
            if t > lim.tensor:
                continue
            for d in _divisors(ranks // p // t):
                if d > lim.data:
                    continue
                for s in spatial(ranks // p // t // d, 0):
                    if symmetric and list(s) != sorted(s, reverse=True):
                        continue
                    yield p, d, s, t


def candidates(work: Workload, ranks: int, *, schedules: Sequence[str] = SCHEDULES, zero: Sequence[int] = (0, 1, 2, 3),
               recompute: Sequence[bool] = (False, True), pipeline: bool = True) -> list[Candidate]:  # fmt: skip
    """Local. Every candidate plan on ``ranks`` ranks (see the module docstring)."""
    lim = limits(work)
    field = work.sample.field
    symmetric = len(set(field)) == 1 and len(field) > 1
    rcs = [r for r in recompute if not r or True in work.traces]
    out = []
    for p, d, s, t in grids(ranks, lim, symmetric):
        if p > 1 and not pipeline:
            continue
        samples = -(-work.sample.batch // d)
        stages = list(zero) if d > 1 else [0]
        if p > 1:  # (a pipeline accumulates micro-batches' gradients: sharding them (ZeRO 2-3) is left out)
            stages = [z for z in stages if z <= 1]
        pipes: list[tuple[str, int, int]] = [("", 1, 1)]
        if p > 1:
            pipes = []
            for name in schedules:
                for m in sorted({p, 2 * p, 4 * p}):
                    if m > samples:
                        continue
                    v = 2 if name == "interleaved" else 1
                    if v * p > lim.pipeline:
                        continue
                    pipes.append((name, m, v))
        for name, m, v in pipes:
            for z in stages:
                for r in rcs:
                    out.append(Candidate(d, s, t, p, z, r, name, m, v))
    return out


def _signature(info: LayerInfo) -> tuple[object, ...]:
    """Equal for modules of one kind, shapes and costs (a transformer's blocks): priced once."""

    def geo(g: object) -> object:
        return None if g is None else (g.shape, g.batch_dim, tuple(sorted(g.spatial.items())))  # type: ignore[attr-defined]

    try:
        extra = info.module.extra_repr()
    except Exception:  # a module whose repr needs its tensors' values
        extra = ""
    return (info.kind, extra, info.tensor, geo(info.inputs), geo(info.output),
            tuple(sorted((k, v.c, v.quadratic) for k, v in info.flops.items())), tuple(sorted(info.kernels.items())),
            tuple(sorted((k, v.c) for k, v in info.elementwise.items())))  # fmt: skip


def _microbatch_sizes(batch: int, data: int, m: int) -> list[list[int]]:
    """Each data group's samples in each micro-batch, as :class:`hpctp.nn.PipelineParallel` cuts them: the global
    batch (the groups' shares in order) into ``m`` near-equal micro-batches, each group taking its samples of each."""
    out = []
    for g in range(data):
        lo, hi = block_range(batch, data, g)
        out.append([max(0, min(b, hi) - max(a, lo)) for a, b in (block_range(batch, m, i) for i in range(m))])
    return out


@lru_cache(maxsize=4096)
def _group_cuts(batch: int, data: int, m: int) -> tuple[tuple[int, ...], ...]:
    """The distinct ways the data groups' samples fall into the micro-batches (:func:`_microbatch_sizes`)."""
    return tuple(dict.fromkeys(tuple(sizes) for sizes in _microbatch_sizes(batch, data, m)))


@lru_cache(maxsize=4096)
def _group_units(batch: int, data: int, m: int) -> tuple[tuple[float, ...], ...]:
    """:func:`_group_cuts` in units of the busiest group's micro-batch, ``ceil(ceil(batch / data) / m)`` samples
    (:func:`hpctp.perf.memory.shares`' ``batch``)."""
    unit = math.ceil(math.ceil(batch / data) / m)
    return tuple(tuple(n / unit for n in sizes) for sizes in _group_cuts(batch, data, m))


GRAPH_WALK_KEEPS = 2.0
"""What a micro-batch holds between its ``B`` and its ``W`` on a stage split by the graph walk
(:mod:`hpctp.nn.pipeline_parallel._split_backward`), in units of its activations: the retained graph, and the
gradients captured at the weights' boundaries (about its activations' bytes again)."""


@lru_cache(maxsize=4096)
def _in_flight(
    schedule: str, p: int, m: int, v: int, batch: int = 0, data: int = 1, weights: tuple[float, ...] | None = None,
    after_b: tuple[float, ...] | None = None,
) -> tuple[float, ...]:  # fmt: skip
    """The activations each pipeline rank holds at once, in units of all its stages' activations of one micro-batch
    of ``ceil(ceil(batch / data) / m)`` samples (the busiest data group's; ``batch`` 0: micro-batches of one size).
    ``weights[s]``: stage ``s``'s share of its rank's activations (default ``1 / v`` each). Under a split backward
    (zero-bubble) a micro-batch holds ``after_b[s]`` of its activations on stage ``s`` between its ``B`` and its
    ``W`` (default :data:`GRAPH_WALK_KEEPS`; a stage whose linear layers' weight products wait holds their inputs
    and output gradients only), on every stage but the first, whose ``B`` computes nothing (there a micro-batch is
    held whole from its ``F`` to its ``W``)."""
    sched = pipeline_schedule(schedule, p, m, v)
    timeline = sched.simulate()
    w = weights or (1.0 / v,) * (p * v)
    kept = after_b or (GRAPH_WALK_KEEPS,) * (p * v)
    groups: list[tuple[float, ...]] = [(1.0,) * m]
    if batch >= m:  # (each distinct cut once: most data groups share one)
        groups = list(_group_units(batch, data, m))
    split = sched.split_backward
    out = []
    for spans in timeline.spans:
        peak = 0.0
        for sizes in groups:
            held = 0.0
            for span in spans:
                a = span.action
                size = sizes[a.microbatch] * w[a.stage]
                after = kept[a.stage] if split and a.stage > 0 else 1.0
                if a.kind is ActionKind.F:
                    held += size
                elif a.kind is ActionKind.B:
                    held += size * (after - 1.0) if split else -size
                elif a.kind is ActionKind.W:
                    held -= size * after
                peak = max(peak, held)
        out.append(peak)
    return tuple(out)


@lru_cache(maxsize=16384)  # (a search of 512 ranks asks about 5,500 distinct ones, 120,000 times)
def _message_buffers(
    schedule: str, p: int, m: int, v: int, rank: int, ahead: int, sizes: tuple[float, ...] | None = None
) -> tuple[tuple[float, ...], ...]:  # fmt: skip
    """The pipeline message buffers rank ``rank`` holds during each of its computations, per cut: entry ``c`` of a
    row counts the buffers of the micro-batches crossing cut ``c`` (between stages ``c - 1`` and ``c``), each
    weighted by its size (``sizes[i]``: micro-batch ``i``'s, in units of the one a cut's bytes are for; default 1).

    As :class:`hpctp.nn.PipelineParallel` runs the lowered schedule: a receive is posted (its buffer allocated) once it
    is within ``ahead`` actions (:data:`hpctp.nn.pipeline_parallel.RECEIVE_AHEAD`), a gradient's only once its stage
    has run that micro-batch's forward; a received activation is the stage's input until its gradient is sent back;
    a received gradient lives until its stage's backward is done. A stage's own outputs are not counted (the next
    layer keeps its input, so the trace counts them with the stage's activations), nor the buffers of sends (let go
    as they complete)."""
    actions = pipeline_schedule(schedule, p, m, v).action_lists[rank]
    forwards_done: set[tuple[int, int]] = set()
    posted: dict[tuple[ActionKind, int, int], int] = {}  # (kind, stage, micro-batch) -> the cut its buffer crosses
    rows = []
    for j, a in enumerate(actions):
        held: set[ActionKind] = set()
        for b in actions[j : j + 1 + ahead]:
            if not b.kind.is_recv or b.kind in held:
                continue
            key = (b.kind, b.stage, b.microbatch)
            if key in posted:
                continue
            if b.kind is ActionKind.RECV_B and (b.stage, b.microbatch) not in forwards_done:
                held.add(b.kind)  # (MPI matches a kind's messages in posting order: the later ones wait too)
                continue
            posted[key] = b.stage if b.kind is ActionKind.RECV_F else b.stage + 1
        if a.kind.is_compute:
            counts = [0.0] * (p * v + 1)
            for (_, _, i), cut in posted.items():
                counts[cut] += 1.0 if sizes is None else sizes[i]
            rows.append(tuple(counts))
        if a.kind is ActionKind.F:
            forwards_done.add((a.stage, a.microbatch))
        elif a.kind is ActionKind.B:
            posted.pop((ActionKind.RECV_B, a.stage, a.microbatch), None)
        elif a.kind is ActionKind.SEND_B:  # (the stage's input, whose gradient this is, is let go)
            posted.pop((ActionKind.RECV_F, a.stage, a.microbatch), None)
    return tuple(dict.fromkeys(rows))


def _stage_parts(work: Workload, cand: Candidate) -> list[tuple[list[int], list[np.ndarray], list[np.ndarray]]]:
    """Per pipeline rank: its parameters, and per stage it holds (stage ``r``, ``r + p``, ...) the activations the
    stage keeps at the end of forward (coefficients of ``(1, b, p, b p)`` replicated over the tensor axis, then
    divided by it), a share of the model's own (root) ones and its output included (the runtime holds it until the
    stage's backward); and, alike, what its zero-bubble ``W`` keeps after ``B`` (its linear layers' inputs and
    output gradients: [Note: deferred weight gradients])."""
    parts = cand.pipeline * cand.chunks
    split = cand.splits_field
    key = ("stages", cand.pipeline, cand.chunks, cand.recompute, split)
    if key not in work.cache:
        trace = work.trace_of(cand.recompute, split)
        cuts = stage_cuts(work, parts)
        root = work.units[0]
        zero = np.zeros(8)

        def total(of: dict[str, np.ndarray], units: Sequence[Any]) -> np.ndarray:
            return sum((of.get(f, zero) for u in units for f in u.layers), zero)

        kinds = (trace.retained, trace.deferred)
        roots = [total(of, [root]) / parts for of in kinds]
        ut = trace.units
        freed = [zero] * parts  # (each stage's output the whole model let go of by the end of forward: the runtime
        if ut is not None:  # holds it until the stage's backward)
            for s in range(parts - 1):
                out_of = ut.freed.get(work.units[cuts[s + 1]].fqn)
                freed[s] = zero if out_of is None else out_of[ut.end_forward]
        out = []
        for r in range(cand.pipeline):
            mine = list(range(r, parts, cand.pipeline))
            stages = [work.units[1 + cuts[s] : 1 + cuts[s + 1]] for s in mine]
            params = sorted({i for units in stages for u in units for i in u.params} | set(root.params))
            kept, deferred = ([total(of, units) + base for units in stages] for of, base in zip(kinds, roots))
            out.append((params, [k + freed[s] for k, s in zip(kept, mine)], deferred))
        work.cache[key] = out
    return work.cache[key]  # type: ignore[no-any-return]


def _stage_timelines(work: Workload, cand: Candidate, split_backward: bool) -> list[Trace]:
    """Per pipeline stage: the snapshots of the traced step at which its units compute, each with what the stage's
    units hold there above what they keep at the end of forward (its transient: a backward's temporaries, or less
    than all in forward), as a :class:`~hpctp.perf.workload.Trace` (gradients and phases of the whole step's).

    A snapshot where no unit runs (the model's own code, the loss) belongs to the stage that ran last before it
    (the first stage before any); the bytes the root and the loss hold count on the last stage, which computes the
    loss. One micro-batch on its stage sees only its own units' bytes: what earlier stages hold is another rank's,
    and what crosses a cut is a message buffer (:func:`_message_buffers`); its output stays until its backward
    is done, wherever the whole model lets go of it. In backward the gradients at its cuts may each be copied once,
    its output's from the message's layout into the one its backward works in, its input's into the input's
    ``.grad`` (for the message back): counted throughout its backward, an upper bound. With a ``split`` backward
    (zero-bubble; every stage but the first, whose ``B`` computes nothing) a linear layer's input and its output's
    gradient stay after backward has used them, until ``W`` ([Note: deferred weight gradients]): they add up over
    the stage's ``B`` (the trace's :data:`~hpctp.perf.workload.WAITS`)."""
    parts = cand.pipeline * cand.chunks
    split_field = cand.splits_field
    key = ("stage timelines", parts, cand.recompute, split_backward, split_field)
    if key not in work.cache:
        trace = work.trace_of(cand.recompute, split_field)
        ut = trace.units
        cuts = stage_cuts(work, parts)
        stage_of = {work.units[1 + k].fqn: s for s in range(parts) for k in range(cuts[s], cuts[s + 1])}
        root = work.units[0].fqn
        n = len(ut.running) if ut is not None else 0
        zero = np.zeros((n, 8))
        rows: list[list[int]] = [[] for _ in range(parts)]
        current = 0
        for j, unit in enumerate(ut.running if ut is not None else ()):
            current = stage_of.get(unit, current)
            rows[current].append(j)
        out = []
        for s in range(parts):
            if ut is None or not rows[s]:  # (a trace without its units' timeline: no transient)
                out.append(Trace(np.zeros((1, 4)), np.zeros((1, 4)), np.zeros(1), np.zeros(1), [""], 0, np.zeros(1),
                                 trace.arrival))  # fmt: skip
                continue
            units = work.units[1 + cuts[s] : 1 + cuts[s + 1]]

            def of(timeline: dict[str, np.ndarray], units: Sequence[Any] = units) -> np.ndarray:
                return np.sum([timeline.get(u.fqn, zero) for u in units], axis=0)

            held = of(ut.owned)
            if s == parts - 1:
                held = held + ut.owned.get(root, zero)
            else:  # (its output, which the runtime holds until the stage's backward is done)
                held = held + ut.freed.get(work.units[cuts[s + 1]].fqn, zero)
            if split_backward and s > 0:  # (what its W keeps that backward would have freed)
                held = held + of(ut.waiting)
            mine = np.array(rows[s])
            vec = held[mine] - held[ut.end_forward]
            for cut in [c for c in (cuts[s], cuts[s + 1]) if 0 < c < cuts[-1]]:  # (the gradients at its cuts' copies)
                fit = work.leaving.get(work.units[cut].fqn)
                if fit is not None:
                    vec[ut.backward[mine], :4] += fit.vector
            vec = np.vstack([vec, np.zeros((1, 8))])  # (and the end of forward: 0)
            k = np.append(mine, ut.end_forward)
            out.append(Trace(vec[:, :4], vec[:, 4:], ut.grads[k], np.append(ut.backward[mine], False).astype(float),
                             [ut.running[i] for i in k], len(mine), ut.arrived[k], trace.arrival).pruned())  # fmt: skip
        work.cache[key] = out
    return work.cache[key]  # type: ignore[no-any-return]


def _boundaries(work: Workload, cand: Candidate, sh: Any) -> list[float]:
    """Bytes of one micro-batch crossing each pipeline cut on a rank (``out[s]``: into stage ``s``; none into the
    first stage or out of the last): what enters the first layer of each stage, at the rank's block."""
    parts = cand.pipeline * cand.chunks
    cuts = stage_cuts(work, parts)
    out = [0.0] * (parts + 1)
    for s in range(1, parts):
        fit = work.entering.get(work.units[1 + cuts[s]].fqn)
        out[s] = fit(sh.batch, sh.points) if fit is not None else 0.0
    return out


def memory_of(work: Workload, cand: Candidate) -> MemoryBreakdown:
    """Local. The busiest rank's predicted peak memory under ``cand`` (every pipeline rank tried)."""
    sh = shares(work.sample, cand)
    if cand.pipeline == 1:
        return predict_memory(work, cand, sh, free_share=point_free_share(work, cand))
    f = sh.features
    split_field = cand.splits_field
    key = ("retained", cand.recompute, split_field)
    if key not in work.cache:
        trace = work.trace_of(cand.recompute, split_field)
        work.cache[key] = sum(trace.retained.values(), np.zeros(8))
    whole = work.cache[key]

    def at(vec: np.ndarray) -> float:  # (an 8-vector of (1, b, p, b p) coefficients, replicated then split, here)
        return float(vec[:4] @ f + sh.tensor * (vec[4:] @ f))

    total = at(whole) or 1.0
    parts = _stage_parts(work, cand)
    p, v = cand.pipeline, cand.chunks
    weights = [1.0 / v] * (p * v)
    after_b = [0.0 if cand.recompute else GRAPH_WALK_KEEPS] * (p * v)  # (a recomputing stage is not split)
    shares_of = []
    for r, (_, kept, deferred) in enumerate(parts):
        mine = [at(k) for k in kept]
        shares_of.append(sum(mine) / total)
        for c, (k, d) in enumerate(zip(mine, deferred)):
            weights[r + c * p] = k / sum(mine) if sum(mine) > 0 else 1.0 / v
            waits = at(d)
            if waits > 0 and k > 0 and not cand.recompute:  # (its linear layers' products wait: the graph is freed)
                after_b[r + c * p] = waits / k
    peaks = _in_flight(cand.schedule, p, cand.microbatches, v, work.sample.batch, cand.data,
                       tuple(round(x, 6) for x in weights), after_b=tuple(round(x, 6) for x in after_b))  # fmt: skip
    cross = _boundaries(work, cand, sh)
    best: MemoryBreakdown | None = None
    split = pipeline_schedule(cand.schedule, p, cand.microbatches, v).split_backward and not cand.recompute
    timelines = _stage_timelines(work, cand, split)
    sizes = _group_cuts(work.sample.batch, cand.data, cand.microbatches)
    largest = dataclasses.replace(sh, batch=max(sh.batch, *(n for g in sizes for n in g)))
    units = _group_units(work.sample.batch, cand.data, cand.microbatches)  # (each data group's cut)
    for r, (params, _, _) in enumerate(parts):
        rows = [row for u in units for row in _message_buffers(cand.schedule, p, cand.microbatches, v, r,
                                                                RECEIVE_AHEAD, u)]  # fmt: skip
        boundary = max(sum(n * c for n, c in zip(row, cross)) for row in rows)
        own: list[Trace] = [timelines[s] for s in range(r, p * v, p)]
        rep, split_, grads, bwd, arrived = (np.concatenate([getattr(t, f) for t in own])
                                            for f in ("rep", "split", "grads", "backward", "arrived"))  # fmt: skip
        timeline = Trace(rep, split_, grads, bwd, [o for t in own for o in t.owners], own[0].end_forward, arrived,
                         own[0].arrival)  # fmt: skip
        m = predict_memory(work, cand, sh, params, peaks[r], shares_of[r], r, boundary, timeline, largest)
        if best is None or m.total > best.total:
            best = m
    assert best is not None  # (pipeline >= 2: the loop ran)
    return best


def evaluate(
    work: Workload, cands: Sequence[Candidate], machine: MachineProfile, budget: int, *, host_scale: float,
    asynchronous: bool,
) -> list[Prediction]:  # fmt: skip
    """Local. Predictions of ``cands``: memory first, then time for the ones within ``budget`` bytes (the others
    carry a zero time and the reason)."""
    groups: dict[tuple[object, ...], list[Candidate]] = {}
    for c in cands:
        groups.setdefault((c.data, c.spatial, c.tensor, c.pipeline, c.microbatches, c.recompute), []).append(c)
    sigs = {rc: {fqn: _signature(info) for fqn, info in layers.items()} for rc, layers in work.layer_variants.items()}
    out: list[Prediction] = []
    plain_fits: set[Candidate] = set()
    for members in sorted(groups.values(), key=lambda ms: ms[0].recompute):  # (without recomputation first)
        if members[0].recompute:  # recomputing is slower: only where the same plan without it does not fit
            members = [c for c in members if dataclasses.replace(c, recompute=False) not in plain_fits]
            if not members:
                continue
        mems = {c: memory_of(work, c) for c in members}
        fitting = [c for c in members if mems[c].total <= budget]
        plain_fits.update(c for c in fitting if not c.recompute)
        for c in members:
            if mems[c].total > budget:
                out.append(Prediction(c, mems[c], TimeBreakdown(0.0), False, _reason(mems[c], budget)))
        if not fitting:
            continue
        first = fitting[0]
        sh = shares(work.sample, first)
        variant = first.recompute and True in work.layer_variants
        layers = work.layer_variants[variant]
        costs: dict[str, LayerCost] = {}
        priced: dict[tuple[object, ...], LayerCost] = {}
        for fqn, info in layers.items():
            sig = sigs[variant][fqn]
            if sig not in priced:
                priced[sig] = layer_cost(info, work, first, sh, machine)
            costs[fqn] = priced[sig]
        for c in fitting:
            t, _, _ = predict_time(work, c, sh, machine, costs, host_scale, asynchronous)
            cuts = chain_cuts(work, c.pipeline * c.chunks) if c.pipeline > 1 else ()
            out.append(Prediction(c, mems[c], t, True, "", cuts))
    return out


def _reason(mem: MemoryBreakdown, budget: int) -> str:
    kinds = mem.kinds()
    top = max(kinds, key=lambda k: kinds[k])
    return f"needs {_gib(mem.total)} > {_gib(budget)} ({top} {_gib(kinds[top])}, at the {mem.phase})"


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Local. Spearman's rank correlation of ``a`` and ``b`` (ties ranked by their mean rank)."""

    def ranks(x: Sequence[float]) -> np.ndarray:
        arr = np.asarray(x, float)
        order = np.argsort(arr, kind="mergesort")
        r = np.empty(len(arr))
        r[order] = np.arange(len(arr), dtype=float)
        for v in np.unique(arr):
            same = arr == v
            r[same] = r[same].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])
