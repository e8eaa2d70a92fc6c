"""Step time of one rank for a plan: computation, messages, pipeline bubble, optimizer step.

Per module (:class:`~hpctp.perf.workload.LayerInfo`) at the rank's block: its flops of each kind at the
machine's rate for that kind, its attention scores at the softmax's rate, its elementwise bytes at the memory
bandwidth (all divided by the tensor axis inside tensor-parallel modules), and its messages
(:func:`hpctp.perf.dryrun.layer_messages`: the layer's own calls on a virtual grid), each at the latency and bandwidth of the link its communicator crosses
(:meth:`MachineProfile.level`). A message the layer overlaps with its own computation (halo exchanges, the attention
ring) costs only what exceeds that computation. The host's own time per step (Python, operator dispatch, hooks) is
the trace's count of it, in small operators without their data work (:mod:`hpctp.perf.host`), times the machine's
seconds per kernel; on an asynchronous device it overlaps the kernels, elsewhere it adds. The optimizer's step is
its memory traffic (Adam reads a parameter, its gradient and two moments and writes three) at the bandwidth, and its
host work: the count of the step on one rank (this rank's share of its elements), or its kernel launches. Where
ranks share cores (:meth:`MachineProfile.sharing` ``k`` ranks per core, a CPU node running more ranks than it has
cores), the calibrated rates are those of ranks computing at once, and a data group with fewer samples (6 samples
over 4 groups: 2, 2, 1, 1) lends its cores once done: the busiest rank's computation then takes the mean group's
time, and at least its own at ``k`` times the rate.

Data parallelism (:class:`hpctp.nn.ShardedDataParallel`): stages 0-1 all-reduce each bucket over the data
axes and, for replicated parameters of spatially split layers, the spatial ones; stages 2-3 reduce-scatter
each parameter over the data axes, then all-reduce the slices over the spatial axes; these messages overlap
backward (the last bucket's never does). Stages 1-2 all-gather the updated slices after the step; stage 3
all-gathers each unit before its forward and again before its backward, the next unit's while this one
computes. Every such overlap, and a layer's, hides only the machine's share of a message
(:attr:`MachineProfile.overlap`): MPI without a progress thread completes a message in its wait, after the
computation, so none of it is hidden. A pipeline (:mod:`hpctp.nn.pipeline_parallel`) runs its schedule's
action lists with each stage's forward and backward times and a point-to-point message of the activation at each cut
(:meth:`~hpctp.nn.pipeline_parallel.Schedule.simulate`); its idle time is the bubble.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TypeVar

from ..layout import FlatPacking, block_range, grid_coords
from ..machine import use_machine
from ..nn.pipeline_parallel import balanced_cuts, pipeline_schedule
from .dryrun import affine_in_batch, dry_run
from .layers import FLOPS_OVERRIDES, POINT_FREE_SHARES, Message, Site, loss_messages
from .machine import MachineProfile
from .memory import Shares, buckets, shares
from .model import Candidate, TimeBreakdown
from .workload import OUTSIDE, LayerInfo, Workload

__all__ = [
    "OPTIMIZER_KERNELS",
    "LayerCost",
    "chain_cuts",
    "data_messages",
    "dry_messages",
    "layer_cost",
    "message_parts",
    "message_time",
    "point_free_share",
    "predict_time",
    "stage_cuts",
    "step_messages",
]

_F = TypeVar("_F")

NOT_FLOPS = ("gemm_small", "softmax")
"""Trace categories that are not flops of their own (:data:`hpctp.perf.workload.CATEGORIES`)."""

OPTIMIZER_KERNELS = 10
"""Kernels the optimizer launches per parameter tensor it steps (Adam's foreach updates on the host)."""


@dataclass
class LayerCost:
    """Local. One module's cost per micro-batch on the rank: seconds of computation and of exposed messages per
    role, forward and backward; its flops; its kernel launches."""

    fwd: float = 0.0
    bwd: float = 0.0
    comm_fwd: dict[str, float] = field(default_factory=dict)
    comm_bwd: dict[str, float] = field(default_factory=dict)
    flops: float = 0.0
    kernels: float = 0.0
    messages: list[Message] = field(default_factory=list)


def message_time(m: Message, cand: Candidate, machine: MachineProfile, full_axes: tuple[int, ...]) -> float:
    """Local. Seconds of message ``m`` on ``machine`` (``full_axes``: its axes on the plan's whole grid)."""
    return sum(message_parts(m, cand, machine, full_axes))


def message_parts(
    m: Message, cand: Candidate, machine: MachineProfile, full_axes: tuple[int, ...]
) -> tuple[float, float]:  # fmt: skip
    """Local. Message ``m``'s latency and its bandwidth time on ``machine``: a layer that overlaps its messages with
    its computation hides only the latter (each piece of a ring or halo must arrive before it is used)."""
    dims = cand.dims
    level = machine.level(dims, full_axes)
    q = math.prod(dims[a] for a in full_axes)
    if m.kind == "p2p":
        link = machine.link(level, "p2p")
        return m.count * link.alpha, max(m.sent, m.recv) * link.beta
    whole = machine.message_time(m.kind, m.nbytes, q, level)
    latency = machine.message_time(m.kind, 1, q, level)
    return latency, whole - latency


def _exposed(message: float, compute: float, overlap: float, floor: float = 0.0) -> float:
    """Seconds of messages posted before ``compute`` seconds of computation that stay exposed on a machine that hides
    the share ``overlap`` of a message behind computation (:attr:`MachineProfile.overlap`); ``floor``: what stays
    exposed even where all of it could hide (the last message, posted after the computation)."""
    return overlap * max(floor, message - compute) + (1.0 - overlap) * message


def _site(info: LayerInfo, cand: Candidate, sh: Shares, work: Workload, coords: tuple[int, ...]) -> Site:
    nsp = len(cand.spatial)
    dims = (*cand.spatial, cand.tensor)
    field = work.sample.field
    inputs = info.inputs.at(sh.batch, field) if info.inputs is not None else None
    output = info.output.at(sh.batch, field) if info.output is not None else None
    return Site(dims, coords, tuple(range(nsp)), nsp,
                inputs, output,
                {d: fd for d, (fd, _) in info.inputs.spatial.items()} if info.inputs is not None else {},
                {d: fd for d, (fd, _) in info.output.spatial.items()} if info.output is not None else {},
                work.sample.itemsize, work.sample.tensor_units)  # fmt: skip


def dry_messages(
    work: Workload, cand: Candidate, batch: int, coords: tuple[int, ...], machine: MachineProfile | None = None
) -> dict[str, list[Message]]:  # fmt: skip
    """Local. Each traced module's messages in one forward and backward of ``batch`` samples on the rank at ``coords``
    of ``cand``'s model grid (spatial axes, then the tensor axis), from the real code on a virtual grid
    (:func:`hpctp.perf.dryrun.layer_messages`, cached per grid, batch, rank and machine); a message of a module the
    trace does not list goes to its closest listed ancestor. The runtime's automatic choices (an attention's
    ``schedule="auto"``) price on ``machine`` there (:func:`hpctp.machine.use_machine`; default: the runtime's
    :func:`hpctp.machine.default_machine`), so the plan runs what the planner priced."""
    key = ("dry run", cand.spatial, cand.tensor, batch, coords, id(machine))
    if key not in work.cache:
        if work.builder is None:
            raise ValueError(
                "this workload has no model builder to run on a virtual grid: trace it with hpctp.perf.trace"
            )
        args = (work.builder, work.sample, cand.spatial, cand.tensor, work.tensor_capable, coords)
        pair = ("dry runs of 1 and 2 samples", cand.spatial, cand.tensor, coords, id(machine))
        with use_machine(machine) if machine is not None else contextlib.nullcontext():
            if pair not in work.cache:
                work.cache[pair] = dry_run(*args, (1, 2))
            one, two = work.cache[pair]
            found = affine_in_batch(one, two, batch) if batch > 2 else (one, two)[batch - 1]
            if found is None:
                found = dry_run(*args, (batch,))[0]
        root = next((f for f in work.layers if f != OUTSIDE), OUTSIDE)
        out: dict[str, list[Message]] = defaultdict(list)
        for owner, msgs in found.items():
            name = owner
            while name not in work.layers and "." in name:
                name = name.rsplit(".", 1)[0]
            out[name if name in work.layers else root] += msgs
        work.cache[key] = dict(out)
    return work.cache[key]  # type: ignore[no-any-return]


def _full_axes(m: Message, cand: Candidate) -> tuple[int, ...]:
    """Model-grid axes (spatial..., tensor) -> the plan's grid (pipeline, data, spatial..., tensor)."""
    return tuple(2 + a for a in m.axes)


def _registered(table: dict[type, _F], module: object) -> _F | None:
    """The entry of ``table`` (by layer class) that ``module`` is an instance of, if any."""
    return next((fn for cls, fn in table.items() if isinstance(module, cls)), None)


def layer_cost(info: LayerInfo, work: Workload, cand: Candidate, sh: Shares, machine: MachineProfile,
               coords: tuple[int, ...] | None = None) -> LayerCost:  # fmt: skip
    """Local. ``info``'s cost per micro-batch on the busiest rank (see the module docstring)."""
    rates = machine.rates(work.sample.dtype)
    share = sh.tensor if info.tensor else 1.0
    flops: dict[str, dict[str, float]] = {"fwd": defaultdict(float), "bwd": defaultdict(float)}
    for (phase, cat), fit in info.flops.items():
        flops[phase][cat] += fit(sh.batch, sh.points, sh.whole) * share
    if coords is None:
        coords = tuple(min(1, s - 1) for s in cand.spatial) + (0,)
    site = _site(info, cand, sh, work, coords)
    override = _registered(FLOPS_OVERRIDES, info.module)
    if override is not None:
        extra = override(info.module, site)
        if extra:
            for phase in ("fwd", "bwd"):
                for cat in ("fft", "gemm", "gemm_small"):
                    flops[phase].pop(cat, None)
            for (phase, cat), v in extra.items():
                flops[phase][cat] += v
    free = _registered(POINT_FREE_SHARES, info.module)
    free_share = free(info.module, site) if free is not None else 1.0
    cost = LayerCost()
    compute = {}
    for phase in ("fwd", "bwd"):
        small = flops[phase].pop("gemm_small", 0.0)
        scores = flops[phase].pop("softmax", 0.0)  # (scores, not flops)
        t = sum(v / rates.rate(cat) for cat, v in flops[phase].items()) + rates.gemm_half * small / rates.gemm
        t += scores / rates.softmax
        ew = info.elementwise.get(phase)
        if ew is not None:  # (the work that does not grow with the points divided where the layer divides it)
            nbytes = ew(sh.batch, sh.points) - (1.0 - free_share) * ew(sh.batch, 0.0)
            t += nbytes * share / rates.bandwidth
        compute[phase] = t
        cost.flops += sum(flops[phase].values())
        cost.kernels += info.kernels.get(phase, 0.0)
    msgs = dry_messages(work, cand, sh.batch, coords, machine).get(info.fqn, [])
    cost.messages = msgs
    for phase in ("fwd", "bwd"):
        hidden = 0.0
        exposed: dict[str, float] = defaultdict(float)
        for m in msgs:
            if m.phase != phase:
                continue
            latency, volume = message_parts(m, cand, machine, _full_axes(m, cand))
            if m.overlap:
                exposed[m.role] += latency
                hidden += volume
            else:
                exposed[m.role] += latency + volume
        if hidden > 0:  # (the share the machine's messages do not progress behind computation stays exposed)
            role = next(m.role for m in msgs if m.phase == phase and m.overlap)
            exposed[role] += _exposed(hidden, compute[phase], machine.overlap)
        setattr(cost, phase, compute[phase])
        (cost.comm_fwd if phase == "fwd" else cost.comm_bwd).update(exposed)
    return cost


def point_free_share(work: Workload, cand: Candidate) -> float:
    """Local. The largest share of their point-free work (:data:`hpctp.perf.layers.POINT_FREE_SHARES`: a Fourier
    layer's mix of its kept modes) that the layers dividing it leave one rank under ``cand``; 1 where none does."""
    key = ("point-free share", cand.spatial, cand.tensor)
    if key not in work.cache:
        best = 0.0
        one = shares(work.sample, dataclasses.replace(cand, data=1, microbatches=1))
        coords = (0,) * (len(cand.spatial) + 1)  # (rank 0 holds the longest run)
        for info in work.layers.values():
            fn = _registered(POINT_FREE_SHARES, info.module)
            if fn is not None and info.inputs is not None:
                best = max(best, fn(info.module, _site(info, cand, one, work, coords)))
        work.cache[key] = best if best > 0 else 1.0
    return work.cache[key]  # type: ignore[no-any-return]


def stage_cuts(work: Workload, parts: int) -> tuple[int, ...]:
    """Local. Cut points of the model's units (but the first, the model's own, in forward order) into ``parts``
    pipeline stages of balanced flops (one sample on the trace's field), by :func:`hpctp.nn.pipeline_parallel.balanced_cuts`."""
    key = ("cuts", parts)
    if key not in work.cache:
        costs = []
        pts = float(math.prod(work.probe_field))
        for u in work.units[1:]:
            c = 0.0
            for fqn in u.layers:
                info = work.layers.get(fqn)
                if info is not None:
                    c += sum(fit(1, pts, pts) for cat, fit in info.flops.items() if cat[1] not in NOT_FLOPS)
            costs.append(c + 1e-9)
        work.cache[key] = balanced_cuts(costs, parts)
    return work.cache[key]  # type: ignore[no-any-return]


def chain_cuts(work: Workload, parts: int) -> tuple[int, ...]:
    """Local. :func:`stage_cuts` as indices into the model's children, the chain :class:`hpctp.nn.PipelineParallel`
    cuts (a child without parameters goes with the unit before it); empty where the units are not the model's
    children (units nested deeper, which the runtime cannot cut at).

    Parameters
    ----------
    work : Workload
    parts : int
        Pipeline stages (pipeline ranks x stages per rank).

    Returns
    -------
    tuple of int
        ``parts + 1`` increasing indices from 0 to the number of children, or ``()``.
    """
    key = ("chain cuts", parts)
    if key not in work.cache:
        names = [name for name, _ in work.model.named_children()]
        index = {name: i for i, name in enumerate(names)}
        fqns = [u.fqn for u in work.units[1:]]
        if not fqns or not all(f in index for f in fqns):
            work.cache[key] = ()
        else:
            cuts = stage_cuts(work, parts)
            work.cache[key] = (0, *(index[fqns[c]] for c in cuts[1:-1]), len(names))
    return work.cache[key]  # type: ignore[no-any-return]


def _simulate(
    name: str, p: int, m: int, v: int, f: Sequence[float], b: Sequence[float], w: Sequence[float], latency: float
) -> tuple[float, float]:  # fmt: skip
    """Step time and the busiest rank's computation of a schedule with each stage's own costs (simulated in units of
    the slowest forward, every cost rounded to a twentieth of it: schedules that differ by less share one simulation,
    which keeps a search of thousands of pipeline plans to seconds)."""
    unit = max(f, default=0.0)
    if unit <= 0:
        return 0.0, 0.0

    def units(xs: Sequence[float]) -> tuple[float, ...]:
        return tuple(round(20 * x / unit) / 20 for x in xs)

    step, busy = _simulate_units(name, p, m, v, units(f), units(b), units(w), round(20 * latency / unit) / 20)
    return step * unit, busy * unit


@lru_cache(maxsize=4096)
def _simulate_units(
    name: str, p: int, m: int, v: int, f: tuple[float, ...], b: tuple[float, ...], w: tuple[float, ...], latency: float
) -> tuple[float, float]:  # fmt: skip
    timeline = pipeline_schedule(name, p, m, v).simulate({"F": list(f), "B": list(b), "W": list(w)}, latency)
    return timeline.step, max(timeline.busy(r) for r in range(p))


def predict_time(
    work: Workload, cand: Candidate, sh: Shares, machine: MachineProfile, costs: dict[str, LayerCost],
    host_scale: float, asynchronous: bool,
) -> tuple[TimeBreakdown, list[int], int]:  # fmt: skip
    """Local. The step time of ``cand``; also the parameters of the busiest stage and its index.

    Parameters
    ----------
    work : Workload
    cand : Candidate
    sh : Shares
    machine : MachineProfile
    costs : dict
        ``fqn -> LayerCost`` per micro-batch (:func:`layer_cost`) of every module that ran.
    host_scale : float
        The machine's seconds per kernel: the trace counts the host's work in small operators
        (:attr:`hpctp.perf.workload.Workload.host`).
    asynchronous : bool
        Kernels run asynchronously to the host (GPUs): host time overlaps them.

    Returns
    -------
    TimeBreakdown, list of int, int
    """
    rates = machine.rates(work.sample.dtype)
    comm: dict[str, float] = defaultdict(float)
    m = cand.microbatches

    def unit_cost(layers: Sequence[str]) -> tuple[float, float, dict[str, float], float]:
        f = b = fl = 0.0
        cm: dict[str, float] = defaultdict(float)
        for fqn in layers:
            c = costs.get(fqn)
            if c is None:
                continue
            f += c.fwd
            b += c.bwd
            fl += c.flops
            for role, t in c.comm_fwd.items():
                cm[role] += t
            for role, t in c.comm_bwd.items():
                cm[role] += t
        return f, b, cm, fl

    rc = cand.recompute and (True, 0) in work.host
    measured = work.host.get((rc, cand.zero))
    kernels = sum(c.kernels for c in costs.values())
    host_total = (measured[0] + measured[1]) * host_scale if measured else kernels * rates.kernel  # per micro-batch
    stages_params: list[int] = list(range(len(work.params)))
    busiest = 0
    if cand.pipeline == 1:
        f, b, cm, fl = unit_cost(list(costs))
        host = host_total * m
        device = m * (f + b)
        compute = max(device, host) if asynchronous else device + host
        k = machine.sharing(cand.ranks)
        if k > 1 and not asynchronous:  # (ranks sharing cores: a data group with fewer samples lends its cores)
            mean = work.sample.batch / cand.data / sh.samples  # (the mean group's samples over the busiest's)
            compute = max(device * mean + host, compute / k)
        for role, t in cm.items():
            comm[role] += m * t
        bubble = 0.0
        flops = m * fl
        bwd_time = m * b
    else:
        parts = cand.pipeline * cand.chunks
        cuts = stage_cuts(work, parts)
        root = work.units[0]
        rf, rb, rcm, rfl = unit_cost(root.layers)
        per_stage = []
        for k in range(parts):
            layers = [fqn for u in work.units[1 + cuts[k] : 1 + cuts[k + 1]] for fqn in u.layers]
            f, b, cm, fl = unit_cost(layers)
            per_stage.append((f + rf / parts, b + rb / parts, cm, fl + rfl / parts, layers))
        # the rank of the slowest stages: stages r, r + p, ... (looped placement)
        rank_load = [sum(per_stage[s][0] + per_stage[s][1] for s in range(r, parts, cand.pipeline))
                     for r in range(cand.pipeline)]  # fmt: skip
        busiest = max(range(cand.pipeline), key=lambda r: rank_load[r])
        mine = list(range(busiest, parts, cand.pipeline))
        half_host = host_total / parts / 2  # (each stage's share of the host's work, half in each pass)
        fs = [max(s[0], half_host) if asynchronous else s[0] + half_host for s in per_stage]
        bs = [max(s[1], half_host) if asynchronous else s[1] + half_host for s in per_stage]
        boundary = _boundary_bytes(work, sh)
        lat = machine.message_time("p2p", boundary, 2, machine.level(cand.dims, (0,)))
        split = cand.schedule == "zero_bubble" and not cand.recompute  # (a recomputing stage is not split)
        halves = [b / 2 for b in bs]
        fb = (fs, halves if split else bs, halves if split else [0.0] * parts)
        step0, busy = _simulate(cand.schedule, cand.pipeline, m, cand.chunks, *fb, 0.0)
        step1, _ = _simulate(cand.schedule, cand.pipeline, m, cand.chunks, *fb, lat)
        compute = busy
        bubble = max(0.0, step0 - busy)
        comm["pipeline"] += max(0.0, step1 - step0)
        for s in mine:
            for role, t in per_stage[s][2].items():
                comm[role] += m * t
        flops = m * sum(per_stage[s][3] for s in mine)
        bwd_time = m * sum(per_stage[s][1] for s in mine)
        stage_units = [u for s in mine for u in work.units[1 + cuts[s] : 1 + cuts[s + 1]]]
        stages_params = sorted({i for u in stage_units for i in u.params} | set(root.params))
    # the loss: one small all-reduce per micro-batch over the data and spatial axes
    for msg in _loss(cand, work):
        comm["data"] += m * message_time(msg, cand, machine, msg.axes)
    # data parallelism
    data_comm, opt_data, opt_kernels = _data_parallel(work, cand, machine, stages_params, bwd_time, rates.bandwidth,
                                                      rates.kernel)  # fmt: skip
    if measured:  # the host's work of the step as counted on one rank (the wrapper's and Adam's), this rank's share
        whole, own = _optimizer_elements(work, cand, stages_params)
        opt = opt_data + measured[2] * host_scale * (own / whole if whole else 1.0)
    else:
        opt = opt_data + opt_kernels
    comm["data"] += data_comm
    return TimeBreakdown(compute, {k: v for k, v in comm.items() if v > 0}, bubble, opt, flops), stages_params, busiest


def _loss(cand: Candidate, work: Workload) -> list[Message]:
    """The loss's all-reduces on the grid the plan runs on: its pipeline axis only with a pipeline, its tensor axis only
    when the model splits its weights over one (as ``apps.surrogate`` builds its grid)."""
    whole = cand.pipeline == 1 and cand.tensor == 1
    return loss_messages((1, *cand.axes["spatial"]), cand.dims, whole)


def _boundary_bytes(work: Workload, sh: Shares) -> float:
    """Bytes of the activation crossing a pipeline cut per micro-batch: the largest output of a unit."""
    key = ("boundary", sh.batch, sh.points)
    if key not in work.cache:
        work.cache[key] = _boundary(work, sh)
    return work.cache[key]  # type: ignore[no-any-return]


def _boundary(work: Workload, sh: Shares) -> float:
    best = 0.0
    for u in work.units[1:]:
        info = work.layers.get(u.fqn)
        if info is not None and info.output is not None:
            shape = info.output.at(sh.batch, work.sample.field)
            scale = sh.points / sh.whole if info.output.spatial else 1.0
            best = max(best, math.prod(shape) * scale * work.sample.itemsize)
    return best


def data_messages(
    work: Workload, cand: Candidate, params: list[int] | None = None, data_rank: int = 0
) -> list[Message]:
    """Local. The messages of :class:`hpctp.nn.ShardedDataParallel` on data rank ``data_rank`` in one step (``axes``:
    axes of the plan's whole grid): gradients in ``"bwd"``, the slices' spatial sums and the gathers after the step
    in ``"step"``, stage 3's unit gathers in ``"fwd"`` and ``"bwd"``; as :class:`hpctp.CommCounter` counts them."""
    dims = cand.dims
    d = cand.data
    spatial = tuple(a for a in cand.axes["spatial"] if dims[a] > 1)
    out: list[Message] = []
    gathers: list[Message] = []
    for b in buckets(work, cand, params):
        item = b.itemsize
        pack = FlatPacking(tuple((n,) for n in b.sizes), d)
        counts = pack.counts
        mine = counts[data_rank]
        axes = (1,) + (spatial if b.spatial else ())
        q = math.prod(dims[a] for a in axes)
        if cand.zero <= 1:
            if q > 1:
                n = b.numel * item
                out.append(Message("bwd", "Iallreduce", "allreduce", axes, n, n, n, 1, True, "data"))
        else:
            if d > 1:
                out.append(Message("bwd", "Ireduce_scatter", "reduce_scatter", (1,), b.numel * item,
                                   (b.numel - mine) * item, mine * item * (d - 1),
                                   sum(1 for r, x in enumerate(counts) if x and r != data_rank), True, "data"))  # fmt: skip
            if b.spatial and spatial:
                n = mine * item
                out.append(Message("step", "Iallreduce", "allreduce", spatial, n, n, n, 1, False, "data"))
        if d > 1 and cand.zero >= 1:
            sent, recv = mine * item * (d - 1), (b.numel - mine) * item
            msg = Message("step", "Iallgatherv", "allgather", (1,), b.numel * item, sent, recv, d - 1 if mine else 0,
                          False, "data")  # fmt: skip
            if cand.zero in (1, 2):
                out.append(msg)
            else:
                gathers += [dataclasses.replace(msg, phase="fwd"), dataclasses.replace(msg, phase="bwd")]
    return out + gathers


def _optimizer_elements(work: Workload, cand: Candidate, params: list[int]) -> tuple[int, int]:
    """Elements Adam steps on one rank of the whole model, and on this rank under ``cand``."""
    whole = sum(p.numel for p in work.params)
    bks = buckets(work, cand, params)
    return whole, sum(b.numel if cand.zero == 0 else b.slice(cand.data) for b in bks)


def _data_parallel(
    work: Workload, cand: Candidate, machine: MachineProfile, params: list[int], bwd_time: float, bandwidth: float,
    kernel: float,
) -> tuple[float, float, float]:  # fmt: skip
    """Exposed seconds of the gradient and parameter messages (those of :func:`data_messages`), and the optimizer
    step's: its memory traffic, and its kernel launches."""
    bks = buckets(work, cand, params)
    dims, d = cand.dims, cand.data
    spatial = tuple(a for a in cand.axes["spatial"] if dims[a] > 1)
    data_level = machine.level(dims, (1,))
    grads: list[float] = []
    gathers: list[float] = []
    after = 0.0
    for b in bks:
        n = b.numel * b.itemsize
        axes = (1,) + (spatial if b.spatial else ())
        q = math.prod(dims[a] for a in axes)
        if cand.zero <= 1:
            grads.append(machine.message_time("allreduce", n, q, machine.level(dims, axes)))
        else:
            grads.append(machine.message_time("reduce_scatter", b.numel * b.itemsize, d, data_level))
            if b.spatial and spatial:
                q = math.prod(dims[a] for a in spatial)
                after += machine.message_time("allreduce", b.slice(d) * b.itemsize, q, machine.level(dims, spatial))
        if cand.zero in (1, 2):
            after += machine.message_time("allgather", n, d, data_level)
        elif cand.zero == 3:
            gathers += [machine.message_time("allgather", n, d, data_level)] * 2
    exposed = 0.0
    if grads:  # they overlap backward; the last bucket's cannot
        exposed = _exposed(sum(grads), bwd_time, machine.overlap, floor=grads[-1])
    if gathers:  # stage 3: each unit's gather prefetched behind the unit before it
        exposed += _exposed(sum(gathers), 2 * bwd_time, machine.overlap, floor=max(gathers))
    # the optimizer: reads parameter, gradient, two moments; writes parameter, two moments
    elems = sum(b.numel if cand.zero == 0 else b.slice(d) for b in bks)
    item = max((b.itemsize for b in bks), default=4)
    tensors = len(params) if cand.zero == 0 else len(bks)
    return exposed + after, 7 * elems * item / bandwidth, OPTIMIZER_KERNELS * tensors * kernel


def step_messages(work: Workload, cand: Candidate, rank: int) -> list[Message]:
    """Local. Every message rank ``rank`` of ``cand``'s grid sends in one step without a pipeline: its layers' (at its
    own coordinates and its data group's samples), the loss's and the data-parallel wrapper's; ``axes`` of layer
    messages are model-grid axes, of the others whole-grid axes. What :class:`hpctp.CommCounter` counts there.

    Raises
    ------
    ValueError
        For a pipeline plan (its messages depend on the runtime) or a rank outside the grid.
    """
    if cand.pipeline > 1:
        raise ValueError("step_messages prices plans without a pipeline")
    if not 0 <= rank < cand.ranks:
        raise ValueError(f"rank {rank} is outside the {cand.ranks} ranks of {cand.label()}")
    coords = grid_coords(rank, cand.dims)
    lo, hi = block_range(work.sample.batch, cand.data, coords[1])
    sh = dataclasses.replace(shares(work.sample, cand), batch=hi - lo, samples=hi - lo)
    out = [m for msgs in dry_messages(work, cand, sh.batch, tuple(coords[2:])).values() for m in msgs]
    out += _loss(cand, work)
    return out + data_messages(work, cand, None, coords[1])
