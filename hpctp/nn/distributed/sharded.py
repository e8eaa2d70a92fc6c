"""Sharded data parallelism over a :class:`~hpctp.nn.ParallelPlan`'s data axes (ZeRO 1-2, FSDP).

:class:`ShardedDataParallel` wraps a model built on ``plan.model_grid`` (the same on every data
group) and keeps its training state in flat **buckets** (:mod:`hpctp.nn.distributed._bucket`): the
trainable parameters grouped by device, dtype and gradient axes (:meth:`ParallelPlan.gradient_axes`:
the data axes and the spatial axes where a parameter is replicated), each group packed into one
flat buffer, of which every data rank owns a balanced contiguous slice
(:class:`hpctp.layout.FlatPacking`; uneven sizes and empty slices allowed). A parameter split over
a tensor or spatial axis contributes its own block; it is thus split over that axis and sharded
over the data axes at once.

Stages (as ZeRO / FSDP):

* **0**: plain data parallelism; each bucket's gradients are all-reduced over its axes.
* **1**: as 0, but the optimizer sees only this rank's slices (its state exists only for them);
  after the step the updated slices are all-gathered into the parameters.
* **2**: gradients are reduce-scattered over the data axes straight into the slices, then summed
  over the bucket's spatial axes.
* **3**: the parameters themselves exist only as slices between uses: each *unit* (a submodule,
  :mod:`hpctp.nn.distributed._units`) all-gathers its buckets just before its forward and frees them
  after, gathers them again before its backward (a hook on its outputs' gradients), and frees
  them once its gradients are in. Freeing keeps the parameter objects and takes their storage's
  memory (FSDP's ``untyped_storage().resize_(0)``; on the CPU the memory goes to the next unit
  of its size, :mod:`hpctp.nn.distributed._unit_memory`), so autograd's saved references stay
  valid and no version counter changes. The next unit's gather is started ahead (``prefetch``):
  in forward order during forward, in reverse during backward. A step's gradient slices are views
  of one block, and on the CPU ``malloc_threshold`` returns the full gradients to the system once
  sent, so the resident set follows what the step allocates under glibc too.

A model built on the ``meta`` device (:mod:`hpctp.nn.init`) never exists whole: the wrapper
materializes one unit at a time (stage 3; stages 0-2 need the whole parameters anyway) with the
values one process gets by building the model for real, keeps this rank's slices and frees the
rest, so construction peaks at one unit. :func:`hpctp.io.load_checkpoint` and
:func:`hpctp.io.save_checkpoint` then read and write each rank's slices as hyperslabs of the
plain global checkpoint, never the whole model.

Gradient messages overlap backward: a post-accumulate-grad hook on every parameter adds its
gradient into its bucket's buffer and drops it ([Note: gradient buffers] in
:mod:`hpctp.nn.distributed._bucket`); once a bucket's last gradient has arrived its non-blocking
all-reduce (:func:`hpctp.comm.iallreduce`) or reduce-scatter (:func:`hpctp.comm.ireduce_scatter`)
starts. Buckets start in a fixed order (reverse parameter order, or for stage 3 reverse forward
order of the units, as DDP), a ready bucket waiting for the ones before it, so every rank of a
communicator starts its collectives in the same order whatever order autograd runs in; at most
:data:`MAX_IN_FLIGHT` messages are in flight. :meth:`ShardedDataParallel.finish_gradients` waits
for them.

Gradient accumulation: several backward passes before :meth:`~ShardedDataParallel.step` sum their
gradients (never an average). Inside :meth:`~ShardedDataParallel.no_sync` a backward sends nothing
and its gradients wait in the buckets (stage 3: a unit-sized buffer per bucket until the next
synchronised backward); outside it every backward sends its buckets and the results add up.

With a loss summed over :attr:`ParallelPlan.loss_axes` (e.g. ``global_mse_loss(pred, y,
plan.grid, plan.loss_axes)``) every stage computes the gradient of the global batch, and an
elementwise optimizer (Adam, AdamW, SGD, ...) makes the same step on slices as on whole
parameters: the parameters equal those of one process training on the whole batch.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ... import comm as C
from ..._util.memory import map_large_blocks
from ...tensor.core import DistTensor
from ..init import UNSEEDED_FIX, generator_state, seeded
from ..meta import has_meta, materialize_modules, meta_problems, reset_order
from ._bucket import Bucket, InFlight, ParamState
from ._optimizer_state import copy_value, gather_flat, optimizer_like, slice_state, state_kinds
from ._unit_memory import GradientSlices, UnitMemory
from ._units import Unit, choose_units, owner_units
from .bucket_plan import fill_buckets, group_by_kind
from .plan import ParallelPlan
from .replicas import bcast_tensors

__all__ = ["ShardedDataParallel", "MAX_IN_FLIGHT"]

MAX_IN_FLIGHT = 1
"""Gradient messages in flight at once during a backward. Each holds its bucket's whole gradient buffer
until it completes (stage 3: one unit's gradient), so more messages overlap more communication with
backward's compute but hold that many more unit-sized buffers; at the limit, starting a message first
waits for the oldest. (Stage 3 also finishes them before the next unit's backward: they overlap its gather.)"""

_MIB = 1 << 20
_FIXES = {
    "generator_state": UNSEEDED_FIX,
    "names": "the ranks' models have different trainable parameters: build the same model on every rank",
    "axes": "a parameter is split differently on some ranks: build the same model, with the same splits, on every rank",
    "meta": "build the model on the meta device on every rank or on none",
}
BucketKey = tuple[torch.device, torch.dtype, tuple[int, ...]]


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


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` through a weak reference to its object: a hook that autograd keeps in C++ (a parameter's
    post-accumulate hook, a tensor's hook) would otherwise hold the wrapper, and through it the model, in a cycle
    that Python's garbage collector cannot see, so neither were ever freed. (Nor may the hook's other arguments
    hold the parameter: a parameter's hook names its bucket by index.)"""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


class ShardedDataParallel(torch.nn.Module):
    """Collective over grid. A model trained on the data axes of ``plan`` with its state sharded (ZeRO/FSDP).

    See the module docstring for the stages. The model is built on ``plan.model_grid``; data rank
    0's parameters and buffers are broadcast to the other data groups at construction (a model on
    ``meta`` is materialized instead, with the same values on every rank).

    Parameters
    ----------
    model : torch.nn.Module
        Built on ``plan.model_grid``, identical on every data group (parameters split over its
        axes carry ``hpctp_layout``), or built on the ``meta`` device (every hpctp layer can be;
        other modules need a ``reset_parameters()``). Do not move or re-create its parameters
        afterwards.
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
    seed : int, optional
        A model on ``meta``: initialise it as one process would after ``torch.manual_seed(seed)``
        (layers built with their own ``seed=`` draw from it either way). None: from the current
        torch generator, which must then be in the same state on every rank (checked; torch seeds
        every process differently, so call ``torch.manual_seed`` alike on every rank first).
    device : torch.device or str, optional
        A model on ``meta``: where its slices (and buffers) live; default this rank's GPU
        (:func:`hpctp.comm.current_device`) if one was selected, else the CPU. Values are
        computed on the CPU, one unit at a time, so they do not depend on the device. ``"meta"``: a
        dry run (e.g. on a virtual grid, :meth:`hpctp.ProcessGrid.virtual`): no values are computed, the
        slices and buffers are meta tensors, and a step sends what a real one sends.
    malloc_threshold : int, "auto" or None
        Stage 3 on the CPU: glibc's ``malloc`` maps blocks of this many bytes or more on their own and
        returns them when freed (``mallopt(M_MMAP_THRESHOLD)``, and its trim threshold to twice that;
        process-wide, set at construction). ``"auto"``: decided at the first forward with gradients:
        the largest trainable parameter's bytes (within 1-32 MiB) if no tensor that forward saved for
        backward is larger, so the full gradients of the largest parameters, which autograd
        allocates anew in every backward, go back to the system once sent; else nothing (the
        activations and the work buffers beside them would be mapped anew, and page-faulted, every
        step: an FNO on 96 x 96 fields took 1.6x the step). Without it glibc raises its own
        threshold as blocks are freed and keeps freed gradients resident among long-lived small
        blocks (benchmarks/memory.py: a resident peak of 0.40 of one process on 4 ranks where 0.30
        was allocated, against 0.29 with it). It costs page faults, a touch of those gradients'
        bytes per step (there: the step up to 1.2x). None leaves the allocator alone; nothing is
        changed under another ``malloc`` (jemalloc through ``LD_PRELOAD``) or when
        ``MALLOC_MMAP_THRESHOLD_`` is set.

    Attributes
    ----------
    module : torch.nn.Module
        The wrapped model.
    plan : ParallelPlan
    stage : int
    flat_buckets : tuple of Bucket
        The buckets (read-only; what checkpoints read and write).
    malloc_threshold : int or None
        The threshold set (bytes), or None if the allocator was left alone (``"auto"``: until the
        first forward with gradients).

    Raises
    ------
    TypeError
        If ``model`` is not a Module or ``plan`` not a ParallelPlan.
    ValueError
        On a bad ``stage``, ``bucket_mib``, ``seed``, ``malloc_threshold`` or unit, a layer or ``hpctp_layout``
        not of ``plan.model_grid``, a parameter shared by two units, models that differ between ranks,
        or a meta model some of whose tensors have no way to be initialised (naming them) or
        whose generator state differs between ranks (the message says to pass ``seed=``).
    All raised on every rank.

    Examples
    --------
    A training step, on any number of ranks (grid axis 0 carries the data, grid axis 1 splits the rows; on
    ``plan.model_grid`` that axis is axis 0, ``plan.spatial``):

    >>> import torch, hpctp
    >>> from hpctp.nn import Conv2d, ParallelPlan, ShardedDataParallel, global_mse_loss
    >>> grid = hpctp.ProcessGrid([0, 1])
    >>> plan = ParallelPlan(grid, data=(0,))
    >>> with torch.device("meta"):  # optional: nothing is allocated here
    ...     model = Conv2d(2, 2, 3, padding=1, grid=plan.model_grid, split=(*plan.spatial, None))
    >>> sdp = ShardedDataParallel(model, plan, stage=3, seed=0)  # seed=: the same values on every rank
    >>> opt = torch.optim.Adam(sdp.parameters(), lr=1e-3)
    >>> start, stop = plan.sample_range(8)  # this data group's share of a batch of 8 samples
    >>> field = (None, None, *plan.spatial, None)
    >>> x = hpctp.random.normal((stop - start, 2, 16, 16), plan.model_grid, field, dtype="float32", like="torch")
    >>> loss = global_mse_loss(sdp(x), x, plan.grid, plan.loss_axes)  # the loss of the whole batch
    >>> loss.backward()  # gradient messages start from hooks during backward
    >>> sdp.step(opt)  # finish_gradients(), opt.step(), gather the parameters (stages 1-2)
    >>> sdp.zero_grad()
    >>> loss.dim(), bool(loss > 0)
    (0, True)
    >>> plan.free(); grid.free()

    Notes
    -----
    A trainable parameter that gets no gradient counts as zero (torch's optimizers would skip
    it); frozen parameters stay whole and are not stepped. Stages 1-3 need an optimizer with one
    param group over :meth:`parameters` that is elementwise (Adam, AdamW, SGD, RMSprop,
    Adagrad...: per-element state and per-parameter scalars such as ``step``); one that looks at
    whole tensors (LBFGS, norm-based trust ratios, gradient clipping by a norm) steps differently
    on slices, and state that is neither per element nor a scalar raises a ValueError in
    :meth:`gathered`. Stage 3 needs units called through ``__call__`` (module hooks) and
    parameters used only inside their unit; outside forward and backward the model's parameters
    have no storage, so read them only inside :meth:`gathered` (reading them elsewhere is
    undefined). A module's ``reset_parameters()`` may set its own tensors and those of its
    sub-modules in the same unit. Stages 2-3 sum a bucket's spatial part (replicated parameters
    of spatially split layers) on the slices in :meth:`finish_gradients`, after the overlapped
    reduce-scatter. Gradients must be dense. ``state_dict()`` of the wrapper is not the model's:
    save with :func:`hpctp.io.save_checkpoint` or read it inside :meth:`gathered`. Move a real
    model to its device and dtype before wrapping.
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
        seed: int | None = None,
        device: Any = None,
        malloc_threshold: int | str | None = "auto",
    ) -> None:
        super().__init__()
        if not isinstance(plan, ParallelPlan):
            raise TypeError(f"ShardedDataParallel: plan must be a hpctp.nn.ParallelPlan, got {type(plan).__name__}")
        error: Exception | None = None
        axes: list[tuple[int, ...]] = []
        trainable: list[tuple[str, torch.nn.Parameter]] = []
        chosen: list[torch.nn.Module] = []
        meta = False
        target = torch.device("cpu")
        try:
            _check_arguments(model, stage, bucket_mib, units, seed, malloc_threshold)
            plan.check_model(model, "ShardedDataParallel")
            chosen = choose_units(model, units) if stage == 3 else []
            trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            axes = [plan.gradient_axes(p, n) for n, p in trainable]
            meta = has_meta(model)
            if meta:
                problems = meta_problems(reset_order(model))
                if problems:
                    raise ValueError("ShardedDataParallel: " + "; ".join(problems[:5]) + _META_FIX)
            target = _target_device(device, meta)
        except (TypeError, ValueError) as e:
            error = e
        C.agree_arguments(
            plan.stage_comm, "ShardedDataParallel", error, fixes=_FIXES, stage=stage,
            bucket_mib=bucket_mib, overlap=overlap, prefetch=prefetch, names=[n for n, _ in trainable], axes=axes,
            meta=meta, seed=seed, generator_state=generator_state(meta, seed), malloc_threshold=malloc_threshold,
        )  # fmt: skip
        for key in sorted({a for ax in axes for a in (ax, tuple(x for x in ax if x not in plan.data_axes))}):
            plan.grid.axes_comm(key)  # collective on first use: every rank creates them here, in one order
        self.module = model
        self.plan = plan
        self.stage = int(stage)
        self.overlap, self.prefetch = bool(overlap), bool(prefetch)
        if not meta:
            bcast_tensors(plan.data_comm, [*model.parameters(), *model.buffers()])
        grad_axes = {id(p): a for (_, p), a in zip(trainable, axes)}
        self._units: list[Unit] = []
        self._unit_memory = UnitMemory()  # stage 3: the gathered units' memory, reused
        if self.stage == 3:
            self._units = self._make_units(model, chosen, trainable, grad_axes, target if meta else None)
            self._buckets = [b for u in self._units for b in u.buckets]
            self._order = [b for u in reversed(self._units) for b in u.buckets]
        else:
            self._buckets = self._make_buckets(trainable, grad_axes, float(bucket_mib) * _MIB, target if meta else None)
            self._order = list(self._buckets)
        self.malloc_threshold: int | None = None
        self._threshold_floor: int | None = None  # "auto": the largest parameter's bytes, until a forward saw more
        if self.stage == 3 and malloc_threshold is not None and any(b.device.type == "cpu" for b in self._buckets):
            if malloc_threshold == "auto":
                self._threshold_floor = max((p.numel() * p.element_size() for _, p in trainable), default=0)
            else:
                self.malloc_threshold = _set_malloc_threshold(int(malloc_threshold))  # type: ignore[call-overload]
        for i, b in enumerate(self._buckets):
            b.trace_label = f"ShardedDataParallel bucket {i}"
        self._slot = {id(p): (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._grad_slices = GradientSlices(self._buckets)
        self._unit_of = {id(b): u for u in self._units for b in u.buckets}
        if meta:
            self._materialize(model, chosen, seed, target)
        else:
            for b in self._buckets:
                b.take(range(len(b.params)))
        self._sync = True  # False inside no_sync(): backward sends nothing
        self._active = False  # a backward has run since the last finish_gradients
        self._sent = False  # a bucket was sent since the last finish_gradients
        self._next = 0  # the first bucket of _order whose message is not started in this round
        self._ready: set[int] = set()  # ids of buckets complete and waiting for their turn
        self._in_flight: collections.deque[InFlight] = collections.deque()
        self._forward_seen: list[Unit] | None = [] if self.stage == 3 else None
        self._handles = self._register_hooks()

    # ------------------------------------------------------------------ construction
    def _make_buckets(
        self, trainable: list[tuple[str, torch.nn.Parameter]], axes: dict[int, tuple[int, ...]], cap: float,
        meta_device: torch.device | None,
    ) -> list[Bucket]:  # fmt: skip
        """Local. Buckets of at most ``cap`` bytes (one parameter may exceed it), in reverse parameter order
        (a bucket's place: where its first parameter comes)."""
        kinds: list[BucketKey] = [(meta_device or p.device, p.dtype, axes[id(p)]) for _, p in trainable]
        made = fill_buckets(kinds, [p.numel() * p.element_size() for _, p in trainable], cap)
        return [Bucket([trainable[i] for i in members], key[2], self.plan, self.stage, key[0])
                for key, members in made]  # fmt: skip

    def _make_units(
        self,
        model: torch.nn.Module,
        chosen: list[torch.nn.Module],
        trainable: list[tuple[str, torch.nn.Parameter]],
        axes: dict[int, tuple[int, ...]],
        meta_device: torch.device | None,
    ) -> list[Unit]:
        """Local. Units (innermost owner of each parameter) with one bucket per group of each."""
        names = {id(m): n for n, m in model.named_modules()}
        owner = {id(p): owner_units(model, chosen)[id(m)] for m in model.modules() for p in m.parameters(recurse=False)}
        made = {id(m): Unit(m, names[id(m)]) for m in chosen}
        for unit in made.values():
            mine = [(n, p) for n, p in trainable if owner[id(p)] is unit.module]
            groups = group_by_kind([(meta_device or p.device, p.dtype, axes[id(p)]) for _, p in mine])
            unit.buckets = [
                Bucket([mine[i] for i in members], key[2], self.plan, self.stage, key[0], self._unit_memory)
                for key, members in groups
            ]
        return [made[id(m)] for m in chosen if made[id(m)].buckets]

    def _materialize(
        self, model: torch.nn.Module, chosen: list[torch.nn.Module], seed: int | None, device: Any
    ) -> None:
        """Local. Values for a model built on ``meta``, computed on the CPU one group of modules at a time
        (stage 3: a unit; stages 0-2: the model, whose parameters stay whole), handed to the buckets,
        then freed. Groups run in :func:`~hpctp.nn.meta.reset_order`, so the generator is
        consumed as construction would. On ``meta`` (a dry run, e.g. on a virtual grid) nothing has values: the
        buckets adopt the meta parameters as they are."""
        if torch.device(device).type == "meta":
            for b in self._buckets:
                b.take(range(len(b.params)))
            return
        order = reset_order(model)
        owner = owner_units(model, chosen) if self.stage == 3 else {}
        groups: list[list[tuple[str, torch.nn.Module, bool]]] = []
        for item in order:
            if groups and owner.get(id(item[1])) is owner.get(id(groups[-1][-1][1])):
                groups[-1].append(item)
            else:
                groups.append([item])
        with seeded(seed):
            for group in groups:
                materialize_modules(group, "cpu")
                taken: dict[int, list[int]] = collections.defaultdict(list)
                with torch.no_grad():
                    for _, m, _ in group:
                        for p in m.parameters(recurse=False):
                            if id(p) in self._slot:
                                b, i = self._slot[id(p)]
                                taken[id(b)].append(i)
                            else:  # frozen: stays whole
                                p.data = p.data.to(device)
                        for name, buf in m.named_buffers(recurse=False):
                            m._buffers[name] = buf.to(device)
                    for b in self._buckets:
                        if id(b) in taken:
                            if self.stage == 0:
                                for i in taken[id(b)]:
                                    b.params[i].data = b.params[i].data.to(device)
                            b.take(taken[id(b)])

    def _register_hooks(self) -> list[Any]:
        handles = []
        on_gradient = _weakly(self._on_gradient)
        self._weak_before_backward = _weakly(self._before_backward)  # (made once: _after_forward runs every step)
        for k, b in enumerate(self._buckets):  # (by index: a bucket holds the parameters the hook is kept on)
            for i, p in enumerate(b.params):
                handles.append(p.register_post_accumulate_grad_hook(functools.partial(on_gradient, k, i)))
        for u in self._units:
            handles.append(u.module.register_forward_pre_hook(functools.partial(self._before_forward, u)))
            handles.append(u.module.register_forward_hook(functools.partial(self._after_forward, u)))
        return handles

    # ------------------------------------------------------------------ parameters
    @property
    def unit_names(self) -> tuple[str, ...]:
        """Local. Stage 3's units (module names, ``""`` for the model itself), in the order they run."""
        return tuple(u.name for u in self._units)

    @property
    def flat_buckets(self) -> tuple[Bucket, ...]:
        """Local. The buckets (read-only): packing, this rank's slice and its pieces of each parameter."""
        return tuple(self._buckets)

    def empty_cache(self) -> None:
        """Local. Stage 3: free the memory kept for gathering units (a block per unit size, reused from one unit
        to the next: :mod:`hpctp.nn.distributed._unit_memory`); the next gathers allocate it again."""
        self._unit_memory.clear()

    @property
    def cache_bytes(self) -> int:
        """Local. Bytes kept between steps for gathering units (stage 3; what :meth:`empty_cache` frees), held by
        no tensor: a measurement of live tensors adds them."""
        return self._unit_memory.kept_bytes

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
        """Collective over grid. The model's forward (stage 3 gathers each unit's parameters around its own)."""
        if self._threshold_floor is not None and torch.is_grad_enabled():
            saved = _LargestSaved()
            with saved:
                out = self.module(*args, **kwargs)
            if saved.largest <= self._threshold_floor:  # (else activations, and the work buffers beside them, would
                self.malloc_threshold = _set_malloc_threshold(self._threshold_floor)  # be mapped anew every step)
            self._threshold_floor = None
        else:
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

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        i = self._units.index(unit) + step
        return self._units[i] if 0 <= i < len(self._units) else None

    def _before_forward(self, unit: Unit, _module: torch.nn.Module, _args: Any) -> None:
        if self._forward_seen is not None and unit not in self._forward_seen:
            self._forward_seen.append(unit)
        unit.gather()
        nxt = self._neighbour(unit, 1)
        if self.prefetch and nxt is not None:
            nxt.start_gather()

    def _after_forward(self, unit: Unit, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for t in _tensors_in(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._weak_before_backward, unit))
        unit.free()

    def _before_backward(self, unit: Unit, _grad: torch.Tensor) -> None:
        """Stage 3, a unit's backward is next: its parameters gathered, and the messages in flight finished (their
        reduce-scatters moved while this unit was gathered), so its full gradients never meet the last unit's."""
        unit.gather()  # (idempotent: it runs once per output of the unit; a prefetched unit is waited for)
        while self._in_flight:  # the last unit's gradients are summed before this one's exist: one unit's at a time
            self._in_flight.popleft().finish()

    def _unit_done(self, unit: Unit) -> None:
        """Stage 3, backward: every gradient of ``unit`` is in. Its parameters are already freed; only now is the
        unit before it prefetched, so a backward holds two units' parameters at once only briefly, never beside
        a unit's gradients being computed ([Note: gradient buffers])."""
        prev = self._neighbour(unit, -1)
        if self.prefetch and prev is not None:
            prev.start_gather()

    # ------------------------------------------------------------------ gradients
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Local. Backward passes inside send no gradient message: their gradients are summed in the
        buckets and sent with the next synchronised backward or :meth:`finish_gradients` (gradient
        accumulation over micro-batches; stage 3 then holds one unit-sized gradient buffer per bucket)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_gradient(self, which: int, index: int, param: torch.nn.Parameter) -> None:
        bucket = self._buckets[which]
        grad, param.grad = param.grad, None  # [Note: gradient buffers]
        if grad is None:
            return
        self._active = True
        complete = bucket.add_gradient(index, grad)
        del grad
        if complete:
            bucket.end_backward()
            if self.stage == 3:
                bucket.free()
                unit = self._unit_of[id(bucket)]
                if all(b.state is not ParamState.UNSHARDED and not b.arrived for b in unit.buckets):
                    self._unit_done(unit)
            if self._sync:
                self._ready.add(id(bucket))
                if self.overlap:
                    self._launch_ready()
        if self.overlap:
            self._progress()

    def _progress(self) -> None:
        """Local. Let MPI advance the messages in flight (a ``Test`` each) and release the finished ones'
        buffers: without a progress thread, a large message moves only while its process is inside
        MPI, so backward's hooks poke it."""
        done = [m for m in self._in_flight if m.test()]
        for m in done:
            self._in_flight.remove(m)
            m.finish()

    def _launch_ready(self) -> None:
        """Start the messages of the ready buckets at the head of the fixed order (a new round after the last)."""
        while self._order and id(self._order[self._next]) in self._ready:
            bucket = self._order[self._next]
            self._ready.discard(id(bucket))
            self._in_flight.append(bucket.send(self._grad_slices))
            self._sent = True
            while len(self._in_flight) > MAX_IN_FLIGHT:
                self._in_flight.popleft().finish()
            self._next = (self._next + 1) % len(self._order)
            if self._next == 0:
                break

    def finish_gradients(self) -> None:
        """Collective over grid. Wait for every gradient message of the backward passes since the last call.

        Buckets whose messages have not started (a parameter without a gradient counts as zeros)
        start now, in order, and gradients summed inside :meth:`no_sync` are sent. Afterwards
        stage 0's parameters hold the gradient of the global batch and stages 1-3's slices
        (:meth:`parameters`) their part of it. Nothing happens when no backward ran since the last
        call.
        """
        if not self._active:
            return
        if self._next > 0:  # finish the round under way
            self._ready.update(id(b) for b in self._order[self._next :])
            self._launch_ready()
        if not self._sent or any(b.pending for b in self._order):  # one more round for what waits
            self._ready.update(id(b) for b in self._order)
            self._launch_ready()
        while self._in_flight:
            self._in_flight.popleft().finish()
        for b in self._buckets:
            b.hand_out()
            b.end_backward()
        self._grad_slices.next_step()
        if self.stage >= 2:
            spatial = [b for b in self._buckets if b.spatial_comm.Get_size() > 1]
            C.waitall([C.iallreduce(b.spatial_comm, b._shard().grad) for b in spatial])  # type: ignore[arg-type]
        for u in self._units:
            u.free()
        self._ready.clear()
        self._next = 0
        self._active = self._sent = False

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
        self.refresh_parameters()

    def refresh_parameters(self) -> None:
        """Collective over the data axes. Stages 1-2: all-gather the updated slices into the whole parameters
        (after ``optimizer.step()`` when not stepping through :meth:`step`); other stages: nothing."""
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
        itself). With ``write_back``, changes made inside go back to the slices and
        ``optimizer`` when the block exits without an exception. This holds the whole model (and
        optimizer state) on every rank: checkpoints do not need it (:func:`hpctp.io.save_checkpoint`
        writes the slices).

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
            kinds = [state_kinds(optimizer.state.get(b._shard(), {}), b) for b in self._buckets]
        except ValueError as e:
            error = e
        every = sorted({pair for bucket_kinds in kinds for pair in bucket_kinds})  # bucket counts may differ
        C.agree_arguments(self.plan.stage_comm, "ShardedDataParallel.gathered", error, state=every)
        state: dict[torch.nn.Parameter, dict[str, Any]] = {}
        for b, bucket_kinds in zip(self._buckets, kinds):
            st = optimizer.state.get(b._shard(), {})
            wholes = {k: gather_flat(b, st[k]) for k, kind in bucket_kinds if kind == "elementwise"}
            for p, lo, hi in zip(b.params, b.offsets, b.offsets[1:]):
                if bucket_kinds:
                    state[p] = {
                        k: wholes[k][lo:hi].view_as(p).clone() if kind == "elementwise" else copy_value(st[k])
                        for k, kind in bucket_kinds
                    }
        return optimizer_like(optimizer, list(self.module.parameters()), state)

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
            optimizer.state[b._shard()] = slice_state(b, [view.state.get(p, {}) for p in b.params])

    def extra_repr(self) -> str:
        return (
            f"stage={self.stage}, data_size={self.plan.data_size}, buckets={len(self._buckets)}, "
            f"units={len(self._units)}, overlap={self.overlap}, prefetch={self.prefetch}"
        )


_META_FIX = (
    "; give their module a reset_parameters() that sets them (as torch's layers have), or build it on a real device"
)


def _target_device(device: Any, meta: bool) -> torch.device:
    """Local. Where a meta model's slices live (a real model's stay where its parameters are)."""
    if device is not None:
        return torch.device(device)
    if not meta:
        return torch.device("cpu")
    gpu = C.current_device()
    return torch.device("cpu") if gpu is None else torch.device("cuda", gpu)


def _check_arguments(
    model: object, stage: object, bucket_mib: object, units: object, seed: object, malloc_threshold: object
) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ShardedDataParallel: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"ShardedDataParallel: stage must be 0, 1, 2 or 3, got {stage!r}")
    if isinstance(bucket_mib, bool) or not isinstance(bucket_mib, (int, float)) or not bucket_mib > 0:
        raise ValueError(f"ShardedDataParallel: bucket_mib must be a positive number, got {bucket_mib!r}")
    if units is not None and stage != 3:
        raise ValueError(f"ShardedDataParallel: units= applies to stage 3 only, got stage={stage}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"ShardedDataParallel: seed must be a non-negative int or None, got {seed!r}")
    if malloc_threshold not in ("auto", None) and (
        isinstance(malloc_threshold, bool) or not isinstance(malloc_threshold, int) or malloc_threshold <= 0
    ):
        raise ValueError(
            f"ShardedDataParallel: malloc_threshold must be a positive number of bytes, 'auto' or None, "
            f"got {malloc_threshold!r}"
        )


def _set_malloc_threshold(threshold: int) -> int | None:
    """Local. Fix glibc's mapping threshold at ``threshold`` bytes, within 1-32 MiB; the value set, or None where the
    process's ``malloc`` is not glibc's or the environment set it."""
    value = min(max(int(threshold), _MIB), 32 * _MIB)
    return value if map_large_blocks(value) else None


class _LargestSaved(torch.autograd.graph.saved_tensors_hooks):
    """Local. A context noting the largest tensor autograd saves for backward inside it (bytes)."""

    def __init__(self) -> None:
        self.largest = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            self.largest = max(self.largest, t.numel() * t.element_size())
            return t

        super().__init__(pack, lambda t: t)
