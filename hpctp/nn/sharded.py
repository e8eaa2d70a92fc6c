"""Sharded data parallelism over a :class:`~hpctp.nn.ParallelPlan`'s data axes (ZeRO 1-2, FSDP).

:class:`ShardedDataParallel` wraps a model built on ``plan.model_grid`` (the same on every data
group) and keeps its training state in flat **buckets**: the trainable parameters grouped by
device, dtype and gradient axes (:meth:`ParallelPlan.gradient_axes`: the data axes and the
spatial axes where a parameter is replicated), each group packed into one flat buffer, of which
every data rank owns a balanced contiguous slice (:func:`hpctp.layout.block_range`; uneven
sizes and empty slices allowed). A parameter split over a tensor or spatial axis contributes
its own block; it is thus split over that axis and sharded over the data axes at once.

Stages (as ZeRO / FSDP):

* **0**: plain data parallelism; each bucket's gradients are all-reduced over its axes.
* **1**: as 0, but the optimizer sees only this rank's slices (its state exists only for them);
  after the step the updated slices are all-gathered into the parameters.
* **2**: gradients are reduce-scattered over the data axes straight into the slices (the full
  gradient is freed as soon as it is packed), then summed over the bucket's spatial axes.
* **3**: the parameters themselves exist only as slices between uses: each *unit* (a submodule)
  all-gathers its buckets just before its forward and frees them after, gathers them again
  before its backward (a hook on its outputs' gradients), and frees them once its gradients
  are reduce-scattered. Freeing keeps the parameter objects and sets their storage's size to
  zero (FSDP's ``untyped_storage().resize_(0)``), so autograd's saved references stay valid
  and no version counter changes. The next unit's gather is started ahead (``prefetch``): in
  forward order during forward, in reverse during backward.

Gradient messages overlap backward: a post-accumulate-grad hook on every parameter packs a
bucket once its last gradient has arrived and starts its non-blocking all-reduce
(:func:`hpctp.comm.iallreduce`) or reduce-scatter (:func:`hpctp.comm.ireduce_scatter`). Buckets
start in a fixed order (reverse parameter order, or for stage 3 reverse forward order of the
units, as DDP), a ready bucket waiting for the ones before it, so every rank of a communicator
starts its collectives in the same order whatever order autograd runs in;
:meth:`ShardedDataParallel.finish_gradients` waits for them.

With a loss summed over :attr:`ParallelPlan.loss_axes` (e.g. ``global_mse_loss(pred, y,
plan.grid, plan.loss_axes)``) every stage computes the gradient of the global batch, and an
elementwise optimizer (Adam, AdamW, SGD, ...) makes the same step on slices as on whole
parameters: the parameters equal those of one process training on the whole batch.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .. import comm as C
from ..comm import Pending
from ..layout import block_range
from ..tensor.core import DistTensor
from .parallel import bcast_tensors
from .plan import ParallelPlan

__all__ = ["ShardedDataParallel"]

_MIB = 1 << 20
BucketKey = tuple[torch.device, torch.dtype, tuple[int, ...]]


class _Bucket:
    """Local. Trainable parameters of one ``(device, dtype, gradient axes)`` group, packed into one flat
    buffer, with this data rank's slice ``[lo, hi)`` of it and the state of the current backward."""

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]], axes: tuple[int, ...], plan: ParallelPlan) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.axes = axes
        self.device, self.dtype = self.params[0].device, self.params[0].dtype
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]
        ranges = [block_range(self.numel, plan.data_size, r) for r in range(plan.data_size)]
        self.counts = [b - a for a, b in ranges]
        self.lo, self.hi = ranges[plan.data_rank]
        self.data_comm = plan.data_comm
        self.comm = plan.grid.axes_comm(axes)  # stages 0-1: the whole sum in one all-reduce
        self.spatial_comm = plan.grid.axes_comm(_spatial_part(axes, plan))  # stages 2-3: after the data part
        self.flat: torch.Tensor | None = None  # stages 1-3: the whole parameters; they are views of it
        self.shard: torch.nn.Parameter | None = None  # stages 1-3: this rank's slice, what the optimizer steps
        self.gathering: Pending | None = None
        self.gathered = True
        self.arrived: set[int] = set()
        self.ready = False
        self.grad: torch.Tensor | None = None  # the packed gradient, until its message completes
        self.shard_grad: torch.Tensor | None = None
        self.message: Pending | None = None

    # ------------------------------------------------------------------ parameters
    def pack_parameters(self, keep_whole: bool) -> None:
        """Local. Make the parameters views of one flat buffer and copy this rank's slice into ``shard``."""
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])
            self.flat = flat
            self._point_parameters()
            self.shard = torch.nn.Parameter(flat[self.lo : self.hi].clone())
        if not keep_whole:
            self.free()

    def start_gather(self, *, refresh: bool = False) -> None:
        """Collective over the data axes (non-blocking). Refill the flat buffer from every rank's slice
        (if freed, or with ``refresh``: stages 1-2 after a step)."""
        if self.gathering is not None or (self.gathered and not refresh):
            return
        flat, shard = self._flat(), self._shard()
        storage, size = flat.untyped_storage(), flat.numel() * flat.element_size()
        if storage.nbytes() != size:
            storage.resize_(size)
        self.gathering = C.iallgatherv(self.data_comm, shard.detach(), _resizable_view(flat), self.counts)

    def wait_gather(self) -> None:
        """Local. Complete a started gather."""
        if self.gathering is not None:
            self.gathering.wait()
            self.gathering = None
            self.gathered = True

    def free(self) -> None:
        """Local. Release the flat buffer's memory (the parameter objects stay, with empty storage)."""
        self.wait_gather()
        if not self.gathered:
            return
        storage = self._flat().untyped_storage()
        if not storage.resizable():  # a .numpy() of a parameter pinned it: move the parameters to a new buffer
            self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self._point_parameters()
            storage = self.flat.untyped_storage()
        storage.resize_(0)
        self.gathered = False

    def _point_parameters(self) -> None:
        flat = self._flat()
        for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
            p.data = flat[a:b].view_as(p)

    def _flat(self) -> torch.Tensor:
        if self.flat is None:
            raise RuntimeError("ShardedDataParallel: stage 0 keeps no flat parameter buffers")
        return self.flat

    def _shard(self) -> torch.nn.Parameter:
        if self.shard is None:
            raise RuntimeError("ShardedDataParallel: stage 0 keeps no parameter slices")
        return self.shard

    # ------------------------------------------------------------------ gradients
    def pack_gradients(self) -> None:
        """Local. Copy the gradients (zeros where None) into one flat buffer and drop the parameters' own."""
        with torch.no_grad():
            parts = [
                p.grad.reshape(-1)
                if p.grad is not None
                else torch.zeros(p.numel(), dtype=self.dtype, device=self.device)
                for p in self.params
            ]
            self.grad = torch.cat(parts) if parts else torch.zeros(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.grad = None
        self.ready = True

    def launch(self, stage: int) -> None:
        """Collective over the bucket's axes (non-blocking). Start summing the packed gradient."""
        grad = self._grad()
        if stage <= 1:
            if self.comm.Get_size() > 1:
                self.message = C.iallreduce(self.comm, grad)
            return
        self.shard_grad = torch.empty(self.hi - self.lo, dtype=self.dtype, device=self.device)
        self.message = C.ireduce_scatter(self.data_comm, grad, self.shard_grad, self.counts)

    def complete(self, stage: int) -> None:
        """Local. Wait for the gradient message and hand the sum to the parameters (stage 0) or the slice."""
        if self.message is not None:
            self.message.wait()
            self.message = None
        grad = self._grad()
        if stage == 0:
            for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
                p.grad = grad[a:b].view_as(p)
        elif stage == 1:
            self._shard().grad = grad[self.lo : self.hi].clone()
        else:
            self._shard().grad = self.shard_grad
        self.grad = self.shard_grad = None

    def reset(self) -> None:
        """Local. Forget the finished backward."""
        self.arrived.clear()
        self.ready = False

    def _grad(self) -> torch.Tensor:
        if self.grad is None:
            raise RuntimeError("ShardedDataParallel: a bucket's gradient was sent before it was packed")
        return self.grad


class _Unit:
    """Local. A submodule whose buckets stage 3 gathers before its forward and backward."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self.module = module
        self.name = name
        self.buckets: list[_Bucket] = []

    def start_gather(self) -> None:
        """Collective over the data axes (non-blocking)."""
        for b in self.buckets:
            b.start_gather()

    def gather(self) -> None:
        """Collective over the data axes. The whole parameters, now."""
        self.start_gather()
        for b in self.buckets:
            b.wait_gather()

    def free(self) -> None:
        """Local."""
        for b in self.buckets:
            b.free()


def _spatial_part(axes: tuple[int, ...], plan: ParallelPlan) -> tuple[int, ...]:
    return tuple(a for a in axes if a not in plan.data_axes)


def _resizable_view(t: torch.Tensor) -> Any:
    """Local. ``t`` as a buffer for MPI that leaves its storage resizable. The comm layer hands CPU
    tensors to MPI through ``.numpy()``, which fixes a storage's size for good; stage 3 resizes
    the flat buffers, so they go as numpy arrays over the same memory (DLPack; bfloat16 as int16)."""
    if t.device.type != "cpu":
        return t
    return np.from_dlpack(t.detach().view(torch.int16) if t.dtype == torch.bfloat16 else t.detach())


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Local. The torch tensors in a module's output (DistTensors by their blocks; tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, DistTensor):
        if isinstance(value.local, torch.Tensor):
            yield value.local
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)


class ShardedDataParallel(torch.nn.Module):
    """Collective over grid. A model trained on the data axes of ``plan`` with its state sharded (ZeRO/FSDP).

    See the module docstring for the stages. The model is built on ``plan.model_grid``; data rank
    0's parameters and buffers are broadcast to the other data groups at construction.

    Training step::

        sdp = ShardedDataParallel(model, plan, stage=3)
        opt = torch.optim.Adam(sdp.parameters(), lr=1e-3)
        loss = global_mse_loss(sdp(x), y, plan.grid, plan.loss_axes)
        loss.backward()          # gradient messages start from hooks during backward
        sdp.step(opt)            # finish_gradients(), opt.step(), gather the parameters (stages 1-2)
        sdp.zero_grad()

    Parameters
    ----------
    model : torch.nn.Module
        Built on ``plan.model_grid``, identical on every data group (parameters split over its
        axes carry ``hpctp_layout``). Do not move or re-create its parameters afterwards.
    plan : ParallelPlan
    stage : {0, 1, 2, 3}
        What is sharded over the data axes: nothing, optimizer state, + gradients, + parameters.
    bucket_mib : float
        Stages 0-2: the size (MiB) at which a bucket is closed, walking the parameters in reverse
        order (smaller buckets start their messages earlier in backward). Stage 3 has one
        bucket per unit and group.
    overlap : bool
        Start gradient messages from backward's hooks (else all in :meth:`finish_gradients`).
    prefetch : bool
        Stage 3: start gathering the next unit's parameters while this one computes.
    units : sequence of torch.nn.Module, optional
        Stage 3: the submodules gathered as one (each parameter belongs to the innermost unit
        holding it; parameters in none belong to ``model``). A unit must be called (``unit(x)``,
        which runs its hooks) and its parameters used only inside that call; a module whose
        parent calls its methods directly (as :class:`ParallelMLP` does with its linears) must
        not be a unit. Default: the model's children holding trainable parameters (the
        elements of a ModuleList or ModuleDict child, e.g. each block of a stack).

    Attributes
    ----------
    module : torch.nn.Module
        The wrapped model.
    plan : ParallelPlan
    stage : int

    Raises
    ------
    TypeError
        If ``model`` is not a Module or ``plan`` not a ParallelPlan.
    ValueError
        On a bad ``stage``, ``bucket_mib`` or unit, a ``hpctp_layout`` not of ``plan.model_grid``,
        a parameter shared by two units, or models that differ between ranks.
    All raised on every rank.

    Notes
    -----
    Limits: one backward per step (gradient accumulation over several backward passes raises
    a RuntimeError; sum the micro-batches' losses instead); a trainable parameter that gets no
    gradient counts as zero (torch's optimizers would skip it); frozen parameters stay whole
    and are not stepped. Stages 1-3 need an optimizer with one param group over
    :meth:`parameters` that is elementwise (Adam, AdamW, SGD, RMSprop, Adagrad...: per-element
    state and per-parameter scalars such as ``step``); one that looks at whole tensors (LBFGS,
    norm-based trust ratios, gradient clipping by a norm) steps differently on slices, and state
    that is neither per element nor a scalar raises a ValueError in :meth:`gathered`. Stage 3
    needs units called through ``__call__`` (module hooks) and parameters used only inside their
    unit; outside forward and backward the model's parameters have no storage, so read them only
    inside :meth:`gathered` (reading them elsewhere is undefined). Stages 2-3 sum a bucket's
    spatial part (replicated parameters of spatially split layers) on the slices in
    :meth:`finish_gradients`, after the overlapped reduce-scatter. Gradients must be dense.
    ``state_dict()`` of the wrapper is not the model's: save with
    :func:`hpctp.io.save_checkpoint` or read it inside :meth:`gathered`. Move the model to its
    device and dtype before wrapping.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        plan: ParallelPlan,
        *,
        stage: int = 0,
        bucket_mib: float = 25.0,
        overlap: bool = True,
        prefetch: bool = True,
        units: Sequence[torch.nn.Module] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(plan, ParallelPlan):
            raise TypeError(f"ShardedDataParallel: plan must be a hpctp.nn.ParallelPlan, got {type(plan).__name__}")
        error: Exception | None = None
        axes: list[tuple[int, ...]] = []
        trainable: list[tuple[str, torch.nn.Parameter]] = []
        chosen: list[torch.nn.Module] = []
        try:
            _check_arguments(model, stage, bucket_mib, units)
            chosen = _choose_units(model, units) if stage == 3 else []
            trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            axes = [plan.gradient_axes(p, n) for n, p in trainable]
        except (TypeError, ValueError) as e:
            error = e
        C.agree_arguments(
            plan.grid.comm, "ShardedDataParallel", error, stage=stage, bucket_mib=bucket_mib, overlap=overlap,
            prefetch=prefetch, names=[n for n, _ in trainable], axes=axes,
        )  # fmt: skip
        for key in sorted({a for ax in axes for a in (ax, _spatial_part(ax, plan))}):
            plan.grid.axes_comm(key)  # collective on first use: every rank creates them here, in one order
        self.module = model
        self.plan = plan
        self.stage = int(stage)
        self.overlap, self.prefetch = bool(overlap), bool(prefetch)
        bcast_tensors(plan.data_comm, [*model.parameters(), *model.buffers()])
        grad_axes = {id(p): a for (_, p), a in zip(trainable, axes)}
        self._units: list[_Unit] = []
        if self.stage == 3:
            self._units = self._make_units(model, chosen, trainable, grad_axes)
            self._buckets = [b for u in self._units for b in u.buckets]
            self._order = [b for u in reversed(self._units) for b in u.buckets]
        else:
            self._buckets = self._make_buckets(trainable, grad_axes, float(bucket_mib) * _MIB)
            self._order = list(self._buckets)
        for b in self._buckets:
            if self.stage >= 1:
                b.pack_parameters(keep_whole=self.stage < 3)
        self._active = False  # a backward has run since the last finish_gradients
        self._next = 0  # the first bucket of _order whose message is not started
        self._forward_seen: list[_Unit] | None = [] if self.stage == 3 else None
        self._handles = self._register_hooks()

    # ------------------------------------------------------------------ construction
    def _make_buckets(
        self, trainable: list[tuple[str, torch.nn.Parameter]], axes: dict[int, tuple[int, ...]], cap: float
    ) -> list[_Bucket]:
        """Local. Buckets of at most ``cap`` bytes (one parameter may exceed it), in reverse parameter order
        (a bucket's place: where its first parameter comes)."""
        filling: dict[BucketKey, list[tuple[str, torch.nn.Parameter]]] = {}
        size: dict[BucketKey, int] = {}
        made: list[tuple[tuple[int, ...], list[tuple[str, torch.nn.Parameter]]]] = []
        for name, p in reversed(trainable):
            key = (p.device, p.dtype, axes[id(p)])
            if key not in filling:
                filling[key], size[key] = [], 0
                made.append((key[2], filling[key]))
            filling[key].append((name, p))
            size[key] += p.numel() * p.element_size()
            if size[key] >= cap:
                del filling[key]
        return [_Bucket(params, bucket_axes, self.plan) for bucket_axes, params in made]

    def _make_units(
        self,
        model: torch.nn.Module,
        chosen: list[torch.nn.Module],
        trainable: list[tuple[str, torch.nn.Parameter]],
        axes: dict[int, tuple[int, ...]],
    ) -> list[_Unit]:
        """Local. Units (innermost owner of each parameter) with one bucket per group of each."""
        names = {id(m): n for n, m in model.named_modules()}
        owner: dict[int, torch.nn.Module] = {}
        for m in sorted(chosen, key=lambda m: names[id(m)].count(".") + bool(names[id(m)])):  # outer first
            for p in m.parameters():
                owner[id(p)] = m
        made = {id(m): _Unit(m, names[id(m)]) for m in chosen}
        for unit in made.values():
            mine = [(n, p) for n, p in trainable if owner[id(p)] is unit.module]
            groups: dict[BucketKey, list[tuple[str, torch.nn.Parameter]]] = defaultdict(list)
            for n, p in mine:
                groups[(p.device, p.dtype, axes[id(p)])].append((n, p))
            unit.buckets = [_Bucket(ps, key[2], self.plan) for key, ps in groups.items()]
        return [made[id(m)] for m in chosen if made[id(m)].buckets]

    def _register_hooks(self) -> list[Any]:
        handles = []
        for b in self._buckets:
            for i, p in enumerate(b.params):
                handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_gradient, b, i)))
        for u in self._units:
            handles.append(u.module.register_forward_pre_hook(functools.partial(self._before_forward, u)))
            handles.append(u.module.register_forward_hook(functools.partial(self._after_forward, u)))
        return handles

    # ------------------------------------------------------------------ parameters
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Local. Stage 0: the model's parameters; stages 1-3: this rank's flat slices, one per bucket
        (``shard0``, ``shard1``...), the parameters to give the optimizer."""
        if self.stage == 0:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            return
        for i, b in enumerate(self._buckets):
            yield (f"{prefix}.shard{i}" if prefix else f"shard{i}"), b._shard()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Local. Clear the gradients of :meth:`parameters` and of the model."""
        for p in [*self.parameters(), *self.module.parameters()]:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Collective over grid. The model's forward (stage 3 gathers each unit's parameters around its own).

        Raises
        ------
        RuntimeError
            If a backward's gradients were not finished (:meth:`step` or :meth:`finish_gradients`).
        """
        if self._active:
            raise RuntimeError(
                "ShardedDataParallel: forward after a backward whose gradients were not finished; "
                "call sdp.step(optimizer) (or sdp.finish_gradients()) after each backward"
            )
        out = self.module(*args, **kwargs)
        if self.stage == 3:
            for u in self._units:
                u.free()  # prefetched but not used
            self._fix_order()
        return out

    def _fix_order(self) -> None:
        """After the first forward: units in the order they ran (for prefetch and gradient messages)."""
        if self._forward_seen is None:
            return
        seen = self._forward_seen
        self._units = seen + [u for u in self._units if u not in seen]
        self._order = [b for u in reversed(self._units) for b in u.buckets]
        self._forward_seen = None

    def _neighbour(self, unit: _Unit, step: int) -> _Unit | None:
        i = self._units.index(unit) + step
        return self._units[i] if 0 <= i < len(self._units) else None

    def _before_forward(self, unit: _Unit, _module: torch.nn.Module, _args: Any) -> None:
        if self._forward_seen is not None and unit not in self._forward_seen:
            self._forward_seen.append(unit)
        unit.gather()
        nxt = self._neighbour(unit, 1)
        if self.prefetch and nxt is not None:
            nxt.start_gather()

    def _after_forward(self, unit: _Unit, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for t in _tensors_in(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._before_backward, unit))
        unit.free()

    def _before_backward(self, unit: _Unit, _grad: torch.Tensor) -> None:
        unit.gather()
        prev = self._neighbour(unit, -1)
        if self.prefetch and prev is not None:
            prev.start_gather()

    # ------------------------------------------------------------------ gradients
    def _on_gradient(self, bucket: _Bucket, index: int, _param: torch.nn.Parameter) -> None:
        if bucket.ready or index in bucket.arrived:
            raise RuntimeError(
                "ShardedDataParallel: a second backward before the gradients were finished; gradient "
                "accumulation over several backward passes is not supported (sum the losses, or call "
                "sdp.step(optimizer) after each backward)"
            )
        self._active = True
        bucket.arrived.add(index)
        if len(bucket.arrived) == len(bucket.params):
            self._bucket_ready(bucket)
            if self.overlap:
                self._launch_ready()
        if self.overlap:
            self._progress()

    def _progress(self) -> None:
        """Local. Let MPI advance the messages in flight (a ``Test`` each): without a progress thread,
        a large message moves only while its process is inside MPI, so backward's hooks poke it."""
        for bucket in self._order[: self._next]:
            if bucket.message is not None:
                bucket.message.test()

    def _bucket_ready(self, bucket: _Bucket) -> None:
        bucket.pack_gradients()
        if self.stage == 3:
            bucket.free()

    def _launch_ready(self) -> None:
        """Start the messages of the ready buckets at the head of the fixed order."""
        while self._next < len(self._order) and self._order[self._next].ready:
            self._order[self._next].launch(self.stage)
            self._next += 1

    def finish_gradients(self) -> None:
        """Collective over grid. Wait for every gradient message of the last backward.

        Buckets whose messages have not started (a parameter without a gradient counts as zeros)
        start now, in order. Afterwards stage 0's parameters hold the gradient of the global batch
        and stages 1-3's slices (:meth:`parameters`) their part of it. Nothing happens when no
        backward ran since the last call.
        """
        if not self._active:
            return
        for b in self._order:
            if not b.ready:
                self._bucket_ready(b)
        self._launch_ready()
        for b in self._buckets:
            b.complete(self.stage)
        if self.stage >= 2:
            spatial = [b for b in self._buckets if b.spatial_comm.Get_size() > 1]
            C.waitall([C.iallreduce(b.spatial_comm, b._shard().grad) for b in spatial])  # type: ignore[arg-type]
        for u in self._units:
            u.free()
        for b in self._buckets:
            b.reset()
        self._next = 0
        self._active = False

    # ------------------------------------------------------------------ step
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Collective over grid. :meth:`finish_gradients`, ``optimizer.step()``, then (stages 1-2) the
        updated slices all-gathered into the parameters (stage 3 gathers them at the next use).

        Parameters
        ----------
        optimizer : torch.optim.Optimizer
            Over :meth:`parameters` (stages 1-3: exactly those, in one param group).

        Raises
        ------
        TypeError, ValueError
            If ``optimizer`` is not an Optimizer over :meth:`parameters` as above.
        """
        self._check_optimizer(optimizer)
        self.finish_gradients()
        optimizer.step()
        if self.stage in (1, 2):
            with torch.no_grad():
                for b in self._buckets:
                    b.start_gather(refresh=True)
                for b in self._buckets:
                    b.wait_gather()

    def _check_optimizer(self, optimizer: object) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"ShardedDataParallel: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if self.stage == 0:
            return
        mine = {id(p) for p in self.parameters()}
        held = [id(p) for g in optimizer.param_groups for p in g["params"]]
        if len(optimizer.param_groups) != 1 or set(held) != mine or len(held) != len(mine):
            raise ValueError(
                f"ShardedDataParallel(stage={self.stage}): the optimizer must hold exactly sdp.parameters() "
                f"({len(mine)} flat slices) in one param group, got {len(optimizer.param_groups)} group(s) "
                f"of {len(held)} parameters; build it as Optimizer(sdp.parameters(), ...)"
            )

    # ------------------------------------------------------------------ whole state
    @contextlib.contextmanager
    def gathered(
        self, optimizer: torch.optim.Optimizer | None = None, *, write_back: bool = False
    ) -> Iterator[tuple[torch.nn.Module, torch.optim.Optimizer | None]]:
        """Collective over grid. The model with whole parameters and the optimizer state per parameter.

        Yields ``(model, opt)``: the wrapped model (stage 3: its parameters gathered for the
        duration) and an optimizer of ``optimizer``'s class over ``model.parameters()`` in one
        param group, with ``optimizer``'s hyperparameters and its state gathered and cut per
        parameter (each parameter's own block, in torch's convention; stage 0: ``optimizer``
        itself). This is what :func:`hpctp.io.save_checkpoint` writes. With ``write_back``,
        changes made inside (e.g. by :func:`hpctp.io.load_checkpoint`) go back to the slices
        and ``optimizer`` when the block exits without an exception.

        Parameters
        ----------
        optimizer : torch.optim.Optimizer, optional
            As for :meth:`step`.
        write_back : bool

        Raises
        ------
        TypeError, ValueError
            On an optimizer not over :meth:`parameters`, or optimizer state that is neither per
            element nor a scalar.
        RuntimeError
            If a backward's gradients were not finished.
        """
        if optimizer is not None:
            self._check_optimizer(optimizer)
        if self._active:
            raise RuntimeError("ShardedDataParallel.gathered: finish the gradients (sdp.step) first")
        if self.stage == 0:
            yield self.module, optimizer
            return
        try:
            for u in self._units:
                u.start_gather()
            for u in self._units:
                u.gather()
            view = self._optimizer_view(optimizer) if optimizer is not None else None
            yield self.module, view
            if write_back:
                self._write_back(optimizer, view)
        finally:
            for u in self._units:
                u.free()

    def _optimizer_view(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        error: Exception | None = None
        kinds: list[list[tuple[str, str]]] = []
        try:
            kinds = [_state_kinds(optimizer.state.get(b._shard(), {}), b) for b in self._buckets]
        except ValueError as e:
            error = e
        every = sorted({pair for bucket_kinds in kinds for pair in bucket_kinds})  # bucket counts may differ
        C.agree_arguments(self.plan.grid.comm, "ShardedDataParallel.gathered", error, state=every)
        state: dict[torch.nn.Parameter, dict[str, Any]] = {}
        for b, bucket_kinds in zip(self._buckets, kinds):
            st = optimizer.state.get(b._shard(), {})
            wholes = {k: _gather_flat(b, st[k]) for k, kind in bucket_kinds if kind == "elementwise"}
            for p, lo, hi in zip(b.params, b.offsets, b.offsets[1:]):
                if bucket_kinds:
                    state[p] = {
                        k: wholes[k][lo:hi].view_as(p).clone() if kind == "elementwise" else _copy(st[k])
                        for k, kind in bucket_kinds
                    }
        return _optimizer_like(optimizer, list(self.module.parameters()), state)

    def _write_back(self, optimizer: torch.optim.Optimizer | None, view: torch.optim.Optimizer | None) -> None:
        with torch.no_grad():
            for b in self._buckets:
                b._shard().copy_(b._flat()[b.lo : b.hi])
        if optimizer is None or view is None:
            return
        for k, v in view.param_groups[0].items():
            if k != "params":
                optimizer.param_groups[0][k] = v
        for b in self._buckets:
            optimizer.state[b._shard()] = _slice_state(b, [view.state.get(p, {}) for p in b.params])

    def extra_repr(self) -> str:
        return (
            f"stage={self.stage}, data_size={self.plan.data_size}, buckets={len(self._buckets)}, "
            f"units={len(self._units)}, overlap={self.overlap}, prefetch={self.prefetch}"
        )


# ---------------------------------------------------------------------- checks and optimizer state
def _check_arguments(model: object, stage: object, bucket_mib: object, units: object) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ShardedDataParallel: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"ShardedDataParallel: stage must be 0, 1, 2 or 3, got {stage!r}")
    if isinstance(bucket_mib, bool) or not isinstance(bucket_mib, (int, float)) or not bucket_mib > 0:
        raise ValueError(f"ShardedDataParallel: bucket_mib must be a positive number, got {bucket_mib!r}")
    if units is not None and stage != 3:
        raise ValueError(f"ShardedDataParallel: units= applies to stage 3 only, got stage={stage}")


def _choose_units(model: torch.nn.Module, units: Sequence[torch.nn.Module] | None) -> list[torch.nn.Module]:
    """Local. Stage 3's units: ``model`` itself, then ``units`` (default :func:`_default_units`).

    Raises
    ------
    ValueError
        If a unit is not a submodule of ``model``, or two units that do not nest share a parameter.
    """
    chosen = _default_units(model) if units is None else list(units)
    inside = {id(m) for m in model.modules()}
    bad = [type(u).__name__ for u in chosen if not isinstance(u, torch.nn.Module) or id(u) not in inside]
    if bad:
        raise ValueError(f"ShardedDataParallel: units {bad} are not submodules of the model; list its own modules")
    if not any(u is model for u in chosen):
        chosen.insert(0, model)  # the parameters in no other unit; it runs first
    _check_nesting(chosen)
    return chosen


def _default_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Local. The model's children that hold trainable parameters (those of a ModuleList or ModuleDict, which
    is never called itself; ParameterLists stay with their parent)."""
    out: list[torch.nn.Module] = []
    for child in model.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            out += _default_units(child)
        elif not isinstance(child, (torch.nn.ParameterList, torch.nn.ParameterDict)):
            if any(p.requires_grad for p in child.parameters()):
                out.append(child)
    return out


def _check_nesting(units: list[torch.nn.Module]) -> None:
    """A parameter held by two units that do not nest (tied weights) would be used while freed."""
    holders: dict[int, list[int]] = defaultdict(list)
    for i, u in enumerate(units):
        for p in u.parameters():
            holders[id(p)].append(i)
    inside = [{id(m) for m in u.modules()} for u in units]
    for held in holders.values():
        for i in held:
            for j in held:
                if i < j and id(units[j]) not in inside[i] and id(units[i]) not in inside[j]:
                    raise ValueError(
                        f"ShardedDataParallel: units {type(units[i]).__name__} and {type(units[j]).__name__} share "
                        "a parameter (tied weights) but do not nest; pass units= with a module holding both"
                    )


def _state_kinds(state: dict[str, Any], bucket: _Bucket) -> list[tuple[str, str]]:
    """Each optimizer state entry of a slice: ``elementwise`` (one value per element), ``tensor`` (0-d) or ``number``.

    Raises
    ------
    ValueError
        On other state.
    """
    out = []
    for k in sorted(state):
        v = state[k]
        if isinstance(v, torch.Tensor) and tuple(v.shape) == (bucket.hi - bucket.lo,):
            out.append((k, "elementwise"))
        elif isinstance(v, torch.Tensor) and v.ndim == 0:
            out.append((k, "tensor"))
        elif isinstance(v, (bool, int, float)):
            out.append((k, "number"))
        else:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(
                f"ShardedDataParallel: optimizer state {k!r} of a slice of {bucket.hi - bucket.lo} elements is {shape}; "
                "only per-element state and scalars can be cut per parameter (use an elementwise optimizer)"
            )
    return out


def _gather_flat(bucket: _Bucket, part: torch.Tensor) -> torch.Tensor:
    """Collective over the data axes. Every rank's slice of a per-element state: the whole flat tensor."""
    whole = torch.empty(bucket.numel, dtype=part.dtype, device=part.device)
    C.iallgatherv(bucket.data_comm, part.detach().contiguous(), whole, bucket.counts).wait()
    return whole


def _copy(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _slice_state(bucket: _Bucket, states: list[dict[str, Any]]) -> dict[str, Any]:
    """Local. The state of the bucket's slice from its parameters' states (the reverse of the gather).

    Raises
    ------
    ValueError
        If the parameters' states have different keys or scalars.
    """
    keys = sorted(states[0]) if states else []
    if any(sorted(s) != keys for s in states):
        raise ValueError(
            f"ShardedDataParallel: the parameters {bucket.names} have different optimizer state keys; "
            "they share one flat slice and must be stepped together"
        )
    out: dict[str, Any] = {}
    for k in keys:
        values = [s[k] for s in states]
        if _is_elementwise(k, values, bucket.params):
            whole = torch.cat([v.detach().reshape(-1) for v in values])
            out[k] = whole[bucket.lo : bucket.hi].clone()
        else:
            first = values[0]
            if any(not _same(first, v) for v in values[1:]):
                raise ValueError(f"ShardedDataParallel: optimizer state {k!r} differs between {bucket.names}")
            out[k] = _copy(first)
    return out


def _is_elementwise(key: str, values: list[Any], params: list[torch.nn.Parameter]) -> bool:
    if not all(isinstance(v, torch.Tensor) and v.shape == p.shape for v, p in zip(values, params)):
        return False
    return any(p.ndim > 0 for p in params) or key != "step"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bool(a.shape == b.shape and torch.equal(a.cpu(), b.cpu()))
    return bool(a == b)


def _optimizer_like(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], state: dict[torch.nn.Parameter, dict[str, Any]]
) -> torch.optim.Optimizer:
    """Local. An optimizer of ``optimizer``'s class and hyperparameters over ``params`` holding ``state``
    (made without its constructor, as ``copy`` does, so any optimizer class works)."""
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    view = type(optimizer).__new__(type(optimizer))
    view.__setstate__(
        {
            "defaults": dict(optimizer.defaults),
            "state": defaultdict(dict, state),
            "param_groups": [{**group, "params": params}],
        }
    )
    return view
