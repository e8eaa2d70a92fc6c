"""One flat bucket of :class:`hpctp.nn.ShardedDataParallel`: its packing, its parameters' state, its gradients.

A bucket packs trainable parameters of one ``(device, dtype, gradient axes)`` group end to end
(:class:`hpctp.layout.FlatPacking`); data rank ``r`` owns the slice ``[lo, hi)`` of the flat
buffer. What it holds between uses depends on the stage:

===========  ===============================  =============================================
stage        parameters (``state``)           gradients
===========  ===============================  =============================================
0            whole, the model's own tensors   summed whole, handed back as views (``.grad``)
1            whole, views of ``flat``;        summed whole, this rank's slice kept
             ``shard`` the optimizer's slice
2            as 1                             reduce-scattered into the slice
3            ``SHARDED``: ``flat`` has no     as 2
             storage, only ``shard`` exists;
             ``UNSHARDED`` inside a unit's
             forward or backward
===========  ===============================  =============================================

[Note: gradient buffers] Gradients never pile up and are never copied twice. A parameter's
gradient is taken from it in its post-accumulate hook (``.grad`` is set back to None at once) and
added into the bucket's flat ``local`` buffer (its one copy); once the bucket is complete that buffer
is all-reduced (stages 0-1) or reduce-scattered straight into the slice (stages 2-3): one message
per bucket, whatever its number of parameters. Each send buffer is
freed when its message completes (:class:`InFlight`), not at the end of backward, and the owner
bounds the buckets in flight (:data:`hpctp.nn.distributed.sharded.MAX_IN_FLIGHT`); at stage 3 it also
finishes them before the next unit's backward, so a backward holds one unit's full gradients at a time.
The slices the reduce-scatters land in are views of one block per step
(:class:`~hpctp.nn.distributed._unit_memory.GradientSlices`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ... import comm as C
from ...comm import Pending
from ...layout import FlatPacking
from ._unit_memory import GradientSlices, UnitMemory

__all__ = ["Bucket", "InFlight", "ParamState", "resizable_view"]


class ParamState(enum.Enum):
    """Local. Where a bucket's whole parameters are (stage 3 moves between the last three)."""

    WHOLE = "whole"  # stages 0-2: always whole
    SHARDED = "sharded"  # stage 3: the flat buffer has no storage; only the slice exists
    GATHERING = "gathering"  # stage 3: an all-gather into the flat buffer is in flight
    UNSHARDED = "unsharded"  # stage 3: whole, for a unit's forward or backward


def resizable_view(t: torch.Tensor) -> Any:
    """Local. ``t`` as a buffer for MPI that leaves its storage resizable. The comm layer hands CPU
    tensors to MPI through ``.numpy()``, which fixes a storage's size for good; stage 3 resizes
    the flat buffers, so they go as numpy arrays over the same memory (DLPack; bfloat16 as int16)."""
    if t.device.type != "cpu":
        return t
    return np.from_dlpack(t.detach().view(torch.int16) if t.dtype == torch.bfloat16 else t.detach())


class Bucket:
    """Local. Trainable parameters of one group packed flat; this data rank's slice; the current gradient.

    Parameters
    ----------
    params : list of (str, torch.nn.Parameter)
        Names and parameters, in packing order (their shapes fix the packing; they may still be
        on ``meta``: :meth:`take` adopts them once they have values).
    axes : tuple of int
        The grid axes its gradient is summed over (data axes, then spatial ones).
    plan : ParallelPlan
    stage : int
    device : torch.device
        Where the flat buffer and the slice live.
    memory : UnitMemory, optional
        Stage 3: where the flat buffer's memory comes from and goes back to (one per owner).
    """

    def __init__(
        self, params: list[tuple[str, torch.nn.Parameter]], axes: tuple[int, ...], plan: Any, stage: int,
        device: torch.device, memory: UnitMemory | None = None,
    ) -> None:  # fmt: skip
        self.trace_label = (
            "ShardedDataParallel bucket"  # names its messages in hpctp.debug's recorder (owner sets the index)
        )
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.axes = axes
        self.stage = stage
        self.device, self.dtype = device, self.params[0].dtype
        self.memory = memory if memory is not None else UnitMemory()
        self.packing = FlatPacking(tuple(tuple(p.shape) for p in self.params), plan.data_size)
        self.offsets = self.packing.offsets
        self.numel = self.packing.numel
        self.counts = list(self.packing.counts)
        self.lo, self.hi = self.packing.slice_range(plan.data_rank)
        self.pieces = self.packing.pieces(plan.data_rank)
        self.data_comm = plan.data_comm
        self.comm = plan.grid.axes_comm(axes)  # stages 0-1: the whole sum in one all-reduce
        spatial = tuple(a for a in axes if a not in plan.data_axes)
        self.spatial_comm = plan.grid.axes_comm(spatial)  # stages 2-3: after the data part
        self.state = ParamState.WHOLE
        self.flat: torch.Tensor | None = None  # stages 1-3: the whole parameters are views of it
        self.shard: torch.nn.Parameter | None = None  # stages 1-3: this rank's slice, what the optimizer steps
        self.gathering: Pending | None = None
        self.local: torch.Tensor | None = None  # this rank's gradient sum since the last send, flat
        self.filled: set[int] = set()  # parameters written into ``local`` since it was allocated
        self.arrived: set[int] = set()  # parameters whose gradient arrived in the current backward
        self.reduced: torch.Tensor | None = None  # the summed gradient: whole (stage 0) or the slice (1-3)
        if stage >= 1:
            self.shard = torch.nn.Parameter(torch.empty(self.hi - self.lo, dtype=self.dtype, device=device))
            self.flat = torch.empty(self.numel, dtype=self.dtype, device=device)  # (stage 3: never touched)
        # the parameters' places in the flat buffer (made while it has storage: a view needs it)
        self.views = [] if self.flat is None else [self.flat[a:b].view(s) for a, b, s in zip(
            self.offsets, self.offsets[1:], self.packing.shapes)]  # fmt: skip
        if stage == 3:
            self._release()
            self.state = ParamState.SHARDED

    # ------------------------------------------------------------------ parameters
    def take(self, indices: Iterable[int]) -> None:
        """Local. Adopt parameters ``indices`` (with their values now): stages 1-3 copy their part of this
        rank's slice into ``shard``, stages 1-2 their whole values into ``flat``; then each parameter
        becomes a view of ``flat`` (stage 3: with no storage) and its own storage is released."""
        if self.stage == 0:
            return
        wanted = set(indices)
        flat, shard = self._flat(), self._shard()
        with torch.no_grad():
            for piece in self.pieces:
                if piece.tensor in wanted:
                    src = self.params[piece.tensor].detach().reshape(-1)[piece.start : piece.stop]
                    shard[piece.at : piece.at + piece.stop - piece.start].copy_(src)
            for i in sorted(wanted):
                p, a, b = self.params[i], self.offsets[i], self.offsets[i + 1]
                if self.stage < 3:
                    flat[a:b].copy_(p.detach().reshape(-1))
                p.data = self.views[i]

    def start_gather(self, *, refresh: bool = False) -> None:
        """Collective over the data axes (non-blocking). Refill the flat buffer from every rank's slice
        (stage 3 when sharded; stages 1-2 with ``refresh``, after a step)."""
        if self.gathering is not None or (self.state is not ParamState.SHARDED and not refresh):
            return
        flat, shard = self._flat(), self._shard()
        storage, size = flat.untyped_storage(), flat.numel() * flat.element_size()
        if storage.nbytes() != size:
            self.memory.attach(storage, size)
        if self.data_comm.Get_size() == 1:  # (this rank's slice is the whole: a copy, no message)
            with torch.no_grad():
                flat.copy_(shard.detach())
            if self.state is ParamState.SHARDED:
                self.state = ParamState.UNSHARDED
            return
        self.gathering = C.iallgatherv(self.data_comm, shard.detach(), resizable_view(flat), self.counts)
        if self.state is ParamState.SHARDED:
            self.state = ParamState.GATHERING

    def wait_gather(self) -> None:
        """Local. Complete a started gather."""
        if self.gathering is not None:
            self.gathering.wait()
            self.gathering = None
            if self.state is ParamState.GATHERING:
                self.state = ParamState.UNSHARDED

    def free(self) -> None:
        """Local. Stage 3: release the flat buffer's memory (the parameter objects stay, with empty storage)."""
        self.wait_gather()
        if self.state is not ParamState.UNSHARDED:
            return
        self._release()
        self.state = ParamState.SHARDED

    def _release(self) -> None:
        storage = self._flat().untyped_storage()
        if not storage.resizable():  # a .numpy() of a parameter pinned it: move the parameters to a new buffer
            self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self.views = [
                self.flat[a:b].view(s) for a, b, s in zip(self.offsets, self.offsets[1:], self.packing.shapes)
            ]
            for p, v in zip(self.params, self.views):
                p.data = v
            storage = self.flat.untyped_storage()
        self.memory.detach(storage)

    def _flat(self) -> torch.Tensor:
        if self.flat is None:
            raise RuntimeError("ShardedDataParallel: stage 0 keeps no flat parameter buffers")
        return self.flat

    def _shard(self) -> torch.nn.Parameter:
        if self.shard is None:
            raise RuntimeError("ShardedDataParallel: stage 0 keeps no parameter slices")
        return self.shard

    # ------------------------------------------------------------------ gradients
    def add_gradient(self, index: int, grad: torch.Tensor) -> bool:
        """Local. Add parameter ``index``'s gradient to this rank's sum in the flat ``local`` buffer; True once
        every parameter's gradient arrived in this backward (the bucket is complete)."""
        with torch.no_grad():
            if self.local is None:
                self.local = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            part = self.local[self.offsets[index] : self.offsets[index + 1]]
            if index in self.filled:
                part.add_(grad.reshape(-1))
            else:
                part.copy_(grad.reshape(-1))
                self.filled.add(index)
        self.arrived.add(index)
        return len(self.arrived) == len(self.params)

    def end_backward(self) -> None:
        """Local. Forget which gradients arrived (the sums stay)."""
        self.arrived.clear()

    @property
    def pending(self) -> bool:
        """Local. Whether this rank holds gradients not sent yet."""
        return self.local is not None

    def send(self, slices: GradientSlices | None = None) -> InFlight:
        """Collective over the bucket's axes (non-blocking). Start summing this rank's flat gradient buffer
        (zeros for parameters that got none): stages 0-1 one all-reduce, stages 2-3 one reduce-scatter
        straight into this rank's slice (this step's slice in ``slices`` for the first sum); the bucket
        starts new sums afterwards."""
        self.arrived.clear()
        if self.local is None:
            self.local = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        else:
            for i in range(len(self.params)):
                if i not in self.filled:
                    self.local[self.offsets[i] : self.offsets[i + 1]].zero_()
        buf, self.local = self.local, None
        self.filled.clear()
        if self.stage <= 1:
            message = C.iallreduce(self.comm, buf) if self.comm.Get_size() > 1 else None
            return InFlight(self, [] if message is None else [message], [buf], None)
        direct = self.reduced is None  # the first sum lands in the slice's gradient itself, later ones beside it
        if direct and slices is not None:
            target = slices.slice_of(self)
        else:
            target = torch.empty(self.hi - self.lo, dtype=self.dtype, device=self.device)
        if direct:
            self.reduced = target
        if self.data_comm.Get_size() == 1:  # (the sum over one rank is its own buffer: a copy, no message)
            with torch.no_grad():
                target.copy_(buf)
            return InFlight(self, [], [buf], None if direct else target)
        message = C.ireduce_scatter(self.data_comm, buf, target, self.counts)
        return InFlight(self, [message], [buf], None if direct else target)

    def accumulate(self, summed: torch.Tensor) -> None:
        """Local. Add a completed message's result (whole for stage 0, this rank's slice for 1-3)."""
        if self.reduced is None:
            self.reduced = summed
        else:
            self.reduced.add_(summed)

    def hand_out(self) -> None:
        """Local. The summed gradient to the parameters (stage 0, views) or the slice (1-3); zeros if none."""
        whole = self.stage == 0
        reduced = self.reduced
        if reduced is None:
            reduced = torch.zeros(self.numel if whole else self.hi - self.lo, dtype=self.dtype, device=self.device)
        if whole:
            for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
                p.grad = reduced[a:b].view_as(p)
        else:
            self._shard().grad = reduced
        self.reduced = None


class InFlight:
    """Local. A bucket's gradient messages: their requests, the buffers they read (held until they complete)
    and, for a sum that goes beside the slice, where it lands."""

    def __init__(
        self, bucket: Bucket, messages: list[Pending], bufs: list[torch.Tensor], beside: torch.Tensor | None
    ) -> None:
        self.bucket, self.messages, self.bufs, self.beside = bucket, messages, bufs, beside

    def test(self) -> bool:
        """Local. Whether every message completed (lets MPI progress them)."""
        return all(m.test() for m in self.messages)

    def finish(self) -> None:
        """Local. Wait, hand the sum to the bucket and free the buffers."""
        C.waitall(self.messages)
        b = self.bucket
        if b.stage <= 1:
            buf = self.bufs[0]
            b.accumulate(buf[b.lo : b.hi].clone() if b.stage == 1 else buf)
        elif self.beside is not None:
            b.accumulate(self.beside)
        self.bufs, self.beside = [], None
