"""Peak memory of one rank for a plan: parameters, gradients and optimizer state exactly, activations from the trace.

The training state follows :class:`hpctp.nn.ShardedDataParallel`'s buckets, made by the functions the wrapper
runs (:mod:`hpctp.nn.distributed.bucket_plan`: the trainable parameters of one kind, packed flat,
:class:`hpctp.layout.FlatPacking`; the data ranks own balanced slices of each): stages 0-2 close a bucket at
``bucket_mib`` walking the parameters in reverse, stage 3 keeps one bucket per unit and kind. Per rank (``P``: its parameters' bytes, tensor-parallel blocks included; ``S``: its
slices, about ``P / D``):

=====  ==========  ====================================  =======  ======================================
stage  parameters  gradients (backward / at the step)    Adam     extra
=====  ==========  ====================================  =======  ======================================
0      ``P``       two buckets + those summed / ``P``    ``2 P``  step temporary ``P``
1      ``P + S``   two buckets + their slices / ``S``    ``2 S``  step temporary ``S``
2      ``P + S``   two buckets + ``S`` / ``S``           ``2 S``  step temporary ``S``
3      ``S``       one unit's + ``S`` / ``S``            ``2 S``  gathered units: two in forward, one in
                                                                     backward, one kept between steps
=====  ==========  ====================================  =======  ======================================

Activations are the trace's timeline (:class:`hpctp.perf.workload.Trace`) at the rank's block; the peak is
the largest moment of forward and backward, with the gradients that exist then, or the optimizer step. In
backward the gradients follow the buckets' messages: the bucket being filled holds its whole flat buffer, the
last complete one stays whole until the next is sent, and the earlier ones are summed (stage 0: whole; 1: their
slices; 2: one block of every slice, taken at the first message).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import numpy as np

from ..nn import ShardedDataParallel
from ..nn.distributed.bucket_plan import fill_buckets, group_by_kind
from .model import Candidate, MemoryBreakdown
from .workload import ParamInfo, Sample, Trace, Workload

__all__ = ["ADAM_MOMENTS", "BUCKET_BYTES", "Shares", "Bucket", "shares", "local_numel", "buckets", "predict_memory"]

BUCKET_BYTES = int(inspect.signature(ShardedDataParallel).parameters["bucket_mib"].default * 2**20)
"""Where :class:`hpctp.nn.ShardedDataParallel` closes a bucket at stages 0-2 (its default ``bucket_mib``)."""
ADAM_MOMENTS = 2
"""Per-element optimizer state per parameter element (Adam's two moments)."""


@dataclass(frozen=True)
class Shares:
    """Local. The busiest rank's part of one step.

    Attributes
    ----------
    batch : int
        Samples of one micro-batch on its data group.
    samples : int
        Samples of its data group per step (all micro-batches).
    points : int
        Field points of its block.
    whole : int
        Field points of the whole field.
    tensor : float
        Its share of a tensor split over the tensor axis.
    block : tuple of int
        Its block's extents.
    """

    batch: int
    samples: int
    points: int
    whole: int
    tensor: float
    block: tuple[int, ...]

    @property
    def features(self) -> np.ndarray:
        """Local. ``(1, b, p, b p)`` for the trace's fits."""
        b, p = float(self.batch), float(self.points)
        return np.array([1.0, b, p, b * p])


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def shares(sample: Sample, cand: Candidate) -> Shares:
    """Local. The busiest rank's share of ``sample`` under ``cand`` (uneven cuts: the larger part)."""
    samples = _ceil(sample.batch, cand.data)
    batch = _ceil(samples, cand.microbatches)
    m = sample.spatial_multiple
    block = tuple(_ceil(_ceil(n, m), s) * m for n, s in zip(sample.field, cand.spatial))
    units = sample.tensor_units
    tensor = 1.0 if cand.tensor == 1 else (_ceil(units, cand.tensor) / units if units else 1.0 / cand.tensor)
    return Shares(batch, samples, math.prod(block), math.prod(sample.field), tensor, block)


def local_numel(p: ParamInfo, cand: Candidate, sample: Sample) -> int:
    """Local. Elements of ``p``'s block on the busiest rank (its tensor-axis split; the rare spatially split
    parameter divided by the largest spatial axis)."""
    shape = list(p.shape)
    if p.tensor_dim is not None and cand.tensor > 1:
        n = shape[p.tensor_dim]
        units = sample.tensor_units
        if units and n % units == 0:
            shape[p.tensor_dim] = _ceil(units, cand.tensor) * (n // units)
        else:
            shape[p.tensor_dim] = _ceil(n, cand.tensor)
    for d in p.spatial_dims:
        shape[d] = _ceil(shape[d], max(cand.spatial))
    return math.prod(shape)


@dataclass(frozen=True)
class Bucket:
    """Local. A flat bucket of the busiest rank: its elements (whole), bytes per element, whether its gradient is
    also partial over the spatial axes, its unit (stage 3), and its parameters' elements."""

    numel: int
    itemsize: int
    spatial: bool
    unit: int
    sizes: tuple[int, ...]
    members: tuple[int, ...]  # the parameters (the workload's indices), in packing order

    def slice(self, data: int) -> int:
        """Local. Elements of the largest slice over ``data`` ranks."""
        return _ceil(self.numel, data)


def buckets(work: Workload, cand: Candidate, params: list[int] | None = None) -> list[Bucket]:
    """Local. The buckets :class:`hpctp.nn.ShardedDataParallel` makes of ``params`` (indices; default all), in the
    order their gradients are sent."""
    key = ("buckets", cand.tensor, cand.zero == 3, None if params is None else tuple(params))
    if key not in work.cache:
        work.cache[key] = _buckets(work, cand, params)
    return work.cache[key]  # type: ignore[no-any-return]


def _buckets(work: Workload, cand: Candidate, params: list[int] | None) -> list[Bucket]:
    idx = list(range(len(work.params))) if params is None else list(params)
    numels = {i: local_numel(work.params[i], cand, work.sample) for i in idx}
    out: list[Bucket] = []

    def kind(i: int) -> tuple[int, bool]:  # (what a bucket shares: dtype, the axes summing the gradient)
        return (work.params[i].itemsize, work.params[i].partial_spatial)

    if cand.zero == 3:
        for unit in reversed(range(len(work.units))):
            mine = [i for i in idx if work.params[i].unit == unit]
            for (item, sp), at in group_by_kind([kind(i) for i in mine]):
                members = tuple(mine[j] for j in at)
                sizes = tuple(numels[i] for i in members)
                out.append(Bucket(sum(sizes), item, sp, unit, sizes, members))
        return out
    made = fill_buckets([kind(i) for i in idx], [numels[i] * work.params[i].itemsize for i in idx], BUCKET_BYTES)
    for (item, sp), at in made:
        members = tuple(idx[j] for j in at)
        sizes = tuple(numels[i] for i in members)
        out.append(Bucket(sum(sizes), item, sp, 0, sizes, members))
    return out


def _state(work: Workload, cand: Candidate, params: list[int] | None) -> tuple[int, int, int, int, int]:
    """Bytes of the rank's parameters (whole), of its slices, of the largest bucket, of the two largest units."""
    key = ("state", cand.tensor, cand.zero == 3, cand.data, None if params is None else tuple(params))
    if key not in work.cache:
        bks = buckets(work, cand, params)
        unit_bytes: dict[int, int] = {}
        for b in bks:
            unit_bytes[b.unit] = unit_bytes.get(b.unit, 0) + b.numel * b.itemsize
        units = sorted(unit_bytes.values(), reverse=True) + [0, 0]
        work.cache[key] = (
            sum(b.numel * b.itemsize for b in bks), sum(b.slice(cand.data) * b.itemsize for b in bks),
            max((b.numel * b.itemsize for b in bks), default=0), units[0], units[1],
        )  # fmt: skip
    return work.cache[key]  # type: ignore[no-any-return]


def _gradient_bytes(trace: Trace, bks: list[Bucket], zero: int, data: int) -> np.ndarray:
    """Local. Per snapshot of ``trace``, the gradient bytes a rank of stages 0-2 holds with the buckets ``bks`` (in
    their sending order), from the order the traced gradients arrived in. A bucket holds its whole flat buffer
    from its first gradient; it is sent once complete and every bucket before it was sent, and stays whole in
    flight until the next one is sent (:data:`hpctp.nn.distributed.sharded.MAX_IN_FLIGHT`); then it is summed:
    whole (stage 0), its slice (stage 1), or one block of every bucket's slice taken at the first message
    (stage 2)."""
    if not bks:
        return np.zeros(len(trace.grads))
    pos = {p: k for k, p in enumerate(trace.arrival)}
    never = float(len(pos) + 1)  # (a parameter without a gradient: its bucket is sent by finish_gradients)
    first = np.array([min((pos.get(i, never) for i in b.members), default=never) for b in bks])
    last = np.array([max((pos.get(i, never) for i in b.members), default=never) for b in bks])
    sent = np.maximum.accumulate(last)  # sent once this many + 1 gradients arrived
    summed_at = np.append(sent[1:], np.inf)  # finished when the next is sent
    whole = np.array([b.numel * b.itemsize for b in bks], dtype=float)
    part = np.array([_ceil(b.numel, data) * b.itemsize for b in bks], dtype=float)
    a = trace.arrived[:, None]
    done = a > summed_at
    held = (a > first) & ~done
    out = (held * whole).sum(axis=1)
    if zero == 0:
        out += (done * whole).sum(axis=1)
    elif zero == 1:
        out += (done * part).sum(axis=1)
    else:
        out += np.where((a > sent).any(axis=1), part.sum(), 0.0)
    return out


def _bytes(trace: Trace, sh: Shares, free_share: float = 1.0) -> np.ndarray:
    f = sh.features
    out = trace.rep @ f + sh.tensor * (trace.split @ f)
    if free_share < 1.0:
        out = out - (1.0 - free_share) * (trace.free @ f)
    return np.asarray(out)


def _activations(trace: Trace, sh: Shares, free_share: float = 1.0) -> np.ndarray:
    return np.maximum(_bytes(trace, sh, free_share), 0.0)


def predict_memory(
    work: Workload, cand: Candidate, sh: Shares, stage_params: list[int] | None = None,
    in_flight: float = 1.0, stage_share: float = 1.0, stage: int = 0, boundary: float = 0.0,
    timeline: Trace | None = None, largest: Shares | None = None,
    free_share: float = 1.0,
) -> MemoryBreakdown:  # fmt: skip
    """Local. The busiest rank's peak bytes by kind (see the module docstring).

    Parameters
    ----------
    work : Workload
    cand : Candidate
    sh : Shares
    stage_params : list of int, optional
        The parameters of the rank's pipeline stage (default all).
    in_flight : float
        Micro-batches whose activations the stage holds at once (pipelines).
    stage_share : float
        The stage's share of the activations kept between forward and backward.
    stage : int
        The stage (reported).
    boundary : float
        Bytes a pipeline rank holds at its stages' cuts (the inputs received and outputs sent of the micro-batches
        in flight, one output gradient), counted with the activations.
    timeline : Trace, optional
        A pipeline rank's own snapshots, each with what its stage holds there above what it keeps at the end of
        forward (:func:`hpctp.perf.search._stage_timelines`, what a zero-bubble ``W`` keeps included): added to
        the micro-batches in flight at ``largest``'s micro-batch (default ``sh``: the micro-batch that computes may
        be the largest of uneven ones). Without it, the whole model's timeline stands for the stage's.
    largest : Shares, optional
    free_share : float
        The rank's share of the point-free activations of layers that divide them over a split field
        (:func:`hpctp.perf.timing.point_free_share`; the trace's ``free``).

    Returns
    -------
    MemoryBreakdown
    """
    trace = work.trace_of(cand.recompute, cand.splits_field)
    whole, slices, biggest, u0, u1 = _state(work, cand, stage_params)
    z = cand.zero
    params = whole if z == 0 else (whole + slices if z < 3 else slices)
    opt_elems_bytes = whole if z == 0 else slices
    optimizer = ADAM_MOMENTS * opt_elems_bytes
    temp = opt_elems_bytes
    data = 2 * sh.samples * work.sample.shape[1] * sh.points * work.sample.itemsize
    acts = _activations(trace, sh, free_share)
    end = float(acts[trace.end_forward]) if acts.size else 0.0
    if cand.pipeline > 1 and acts.size:
        kept = end * stage_share * in_flight  # the stage's kept activations of each micro-batch in flight
        if timeline is not None:  # (and what the micro-batch computing holds beyond them, at its stage's snapshots)
            trace = timeline
            acts = _bytes(timeline, largest or sh) + kept
        else:
            acts = acts - end + kept
        acts = acts + boundary
    g, bwd = trace.grads, trace.backward > 0
    if z <= 2:
        bks = buckets(work, cand, stage_params)
        grads = _gradient_bytes(trace, bks, z, cand.data)
        if cand.pipeline > 1 and cand.microbatches > 1:  # (after a stage's first micro-batch its buckets hold the sums)
            grads = np.where(bwd, np.maximum(grads, float(sum(b.numel * b.itemsize for b in bks))), grads)
    else:  # (the wrapper sums a unit's gradients before the next unit's backward: one unit's full gradients at a time)
        grads = np.minimum(g * whole, u0) + np.where(g > 0, slices, 0.0)
    grads = np.where(bwd, grads, 0.0)
    # stage 3 gathers a unit and prefetches the next in forward; in backward it prefetches only once a unit is done,
    # so one unit is gathered beside the gradients; one unit's memory is kept between steps for the next gather
    buffers = np.where(bwd, float(u0), float(u0 + u1)) if z == 3 else np.zeros(len(bwd))
    totals = params + optimizer + acts + grads + buffers + data
    j = int(np.argmax(totals)) if totals.size else -1
    grads_step = whole if z == 0 else slices
    kept = float(u0) if z == 3 else 0.0
    step_total = params + optimizer + temp + grads_step + kept + data
    if j < 0 or step_total >= totals[j]:
        return MemoryBreakdown(int(params), int(grads_step), int(optimizer + temp), 0, int(kept), int(data),
                               "optimizer step", stage)  # fmt: skip
    phase = "backward" if bwd[j] else "forward"
    act, grads_j = float(acts[j]), float(grads[j])
    return MemoryBreakdown(int(params), int(grads_j), int(optimizer), int(act), int(buffers[j]), int(data), phase,
                           stage)  # fmt: skip
