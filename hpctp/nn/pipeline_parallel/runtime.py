"""Running a pipeline schedule: :class:`PipelineParallel`, the model cut into stages along the plan's pipeline axis.

Construction cuts the layers into ``p * v`` stages (explicit cut points, or balanced by cost:
:func:`~hpctp.nn.pipeline_parallel.balanced_cuts` over each layer's measured time and saved activations
from one profiling pass of a ``sample``, or its parameter count without one), keeps the stages of this
rank (stage ``s`` on pipeline rank ``s % p``), materializes them if the model was built on the meta
device (walking every layer in construction order, so the values are one process's: the other ranks'
layers are materialized on the side only to draw the same random numbers, and dropped), and optionally
wraps each in :class:`~hpctp.nn.ShardedDataParallel` over the data axes.

:meth:`PipelineParallel.step` runs the schedule's actions for this rank
(:meth:`~hpctp.nn.pipeline_parallel.Schedule.actions`) one at a time through a table of handlers, one per
action kind. Receives are posted a few actions ahead (their description known), sends are non-blocking
and completed at the end of the step. The global batch's loss is the sum over micro-batches of each
micro-batch's loss (a mean over its global samples, as :func:`hpctp.nn.global_mse_loss` computes)
weighted by its share of the batch, so uneven micro-batches and data groups give one process's loss and
gradients; gradients are summed over micro-batches, never averaged. The first step of each input signature
first walks meta copies of every layer (every rank, all stages) to find stages that do not fit together, raised on
every rank before any activation message (:mod:`~hpctp.nn.pipeline_parallel._fit`). A failing action re-raises
with the rank, the action and the schedule table; :func:`hpctp.cli.run_main` then ends the job.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import torch

from ... import comm as C
from ..._util.backend import shape_only
from ..._util.ints import is_int
from ...comm import Pending, tags
from ...layout import GroupTransferPlan, Layout, block_range, grid_coords, group_transfer_plan
from ...tensor.core import DistTensor
from .._deferred_weights import DeferredWeightGradients
from ..distributed.plan import ParallelPlan
from ..distributed.recompute import Checkpointed
from ..distributed.sharded import ShardedDataParallel
from ..init import UNSEEDED_FIX, generator_state, seeded
from ..meta import dematerialize, has_meta, materialize_modules, meta_problems, reset_order
from ..spatial.redistribute import Redistribute
from ._actions import Action, ActionKind
from ._balance import balanced_cuts
from ._fit import check_fit, shadows, signature, walk_shapes
from ._messages import Described, Part, blocks_of, describe, moved, receive_description, send_description
from ._split_backward import backward_input
from .schedules import Schedule, pipeline_schedule

__all__ = ["PipelineParallel", "RECEIVE_AHEAD"]

RECEIVE_AHEAD = 3
"""How many actions ahead a receive is posted (once its activation's description is known). Earlier
posting lets a large message land while this rank computes; each posted receive holds its buffer."""

_K = ActionKind
_FIXES = {
    "generator_state": UNSEEDED_FIX,
    "layers": "the ranks' chains have different numbers of layers: build the same model on every rank",
    "meta": "build the model on the meta device on every rank or on none",
}
_LOG = logging.getLogger("hpctp.nn.pipeline")
LossFn = Callable[[Any, Any], torch.Tensor]


class PipelineParallel(torch.nn.Module):
    """Collective over grid. A model cut by its layers into stages along ``plan``'s pipeline axis.

    Parameters
    ----------
    layers : torch.nn.Sequential or sequence of torch.nn.Module
        The model as a chain of layers, each taking the previous one's output (a tensor, a
        :class:`~hpctp.DistTensor` on ``plan.model_grid``, or a tuple of them: skip connections, the input
        carried to a residual output; one message per tensor), built on ``plan.model_grid`` on every rank,
        identically, or on the ``meta`` device (then no rank ever holds more than its stages). A stage that
        starts with a :class:`~hpctp.nn.Redistribute` (another split of the field, or another shape of the
        model grid's ranks) receives its input in that layout: each piece travels straight from the rank that
        computed it to the rank that keeps it, one message per piece (and its gradient back the same way).
    plan : ParallelPlan
        With a pipeline axis of ``p`` ranks (a plan without one runs every stage on each rank).
    schedule : {"gpipe", "1f1b", "interleaved", "zero_bubble"}
        :func:`~hpctp.nn.pipeline_parallel.pipeline_schedule`.
    microbatches : int
        ``m``: each data group's share of a batch is cut into ``m`` micro-batches (uneven allowed).
    virtual : int
        ``v``: stages per rank (``"interleaved"`` only): ``p * v`` stages.
    cuts : sequence of int, optional
        ``p * v + 1`` layer indices from 0 to ``len(layers)``, strictly increasing: stage ``s`` runs layers
        ``cuts[s]:cuts[s + 1]``. Default: balanced (see the module docstring).
    sample : tensor or DistTensor, optional
        A micro-batch's input for the profiling pass that balances the stages (a real model only).
    zero : {0, 1, 2, 3}, optional
        Wrap each stage in :class:`~hpctp.nn.ShardedDataParallel` of this stage over the data axes
        (``"zero_bubble"`` takes 0-2); None: plain stages, gradients summed by
        :meth:`ParallelPlan.sync_gradients` at the end of a step.
    seed : int, optional
        A meta model: materialize as one process would after ``torch.manual_seed(seed)``. None: from the
        current torch generator, which must then be in the same state on every rank (checked; torch seeds every
        process differently, so call ``torch.manual_seed`` alike on every rank first).
    device : torch.device or str, optional
        A meta model: where its stages live (default this rank's GPU, else the CPU). ``"meta"``: a dry run (e.g. on
        a virtual grid, :meth:`hpctp.ProcessGrid.virtual`): nothing is materialized and a step sends what a real one
        sends; there, where no description of an activation arrives, a receiving stage finds it by walking the
        layers before the cut on meta (torch layers on plain tensors only: a chain with an hpctp layer or a
        DistTensor before a cut raises NotImplementedError at its first receive).

    Attributes
    ----------
    schedule : Schedule
    cuts : tuple of int
    balance : tuple of (int, int, int, float, float, float)
        Balanced cuts only: per stage ``(stage, first layer, end layer, share of the cost, parameter bytes,
        activation bytes per micro-batch)``; also logged (logger ``hpctp.nn.pipeline``, grid rank 0).
    stages : tuple of int
        The stage indices this rank holds.
    modules_of : dict
        Stage index -> its module (a ``torch.nn.Sequential`` keeping the layers' names in ``layers``, a
        Sequential's own or the indices, so state-dict keys are the whole model's), wrapped when ``zero``
        is given.
    layer_names : tuple of str
        Every layer's name, in the chain's order.
    timeline : list of (str, float, float)
        The last step's compute actions on this rank: ``(action, start, end)`` (seconds, ``perf_counter``),
        after ``("step", start, end)``.
    step_seconds : float
        The last step's actions' wall time on the slowest rank (the step every rank waits for).

    Raises
    ------
    TypeError, ValueError
        On every rank, before any message: a bad layer list, plan, schedule, micro-batch or virtual count,
        cuts that leave a stage empty or do not cover the layers, ``zero`` out of range or 3 with
        ``"zero_bubble"``, a layer not built on ``plan.model_grid``, a meta layer that nothing can initialise,
        or a meta model without ``seed=`` whose generator state differs between ranks.
    """

    def __init__(
        self,
        layers: torch.nn.Sequential | Sequence[torch.nn.Module],
        plan: ParallelPlan,
        *,
        schedule: str = "1f1b",
        microbatches: int,
        virtual: int = 1,
        cuts: Sequence[int] | None = None,
        sample: Any = None,
        zero: int | None = None,
        seed: int | None = None,
        device: Any = None,
    ) -> None:
        super().__init__()
        if not isinstance(plan, ParallelPlan):
            raise TypeError(f"PipelineParallel: plan must be a hpctp.nn.ParallelPlan, got {type(plan).__name__}")
        error: Exception | None = None
        chain: list[torch.nn.Module] = []
        names: list[str] = []
        sched: Schedule | None = None
        meta = False
        try:
            names, chain = _layers(layers)
            plan.check_model(torch.nn.Sequential(OrderedDict(zip(names, chain))), "PipelineParallel")
            sched = pipeline_schedule(schedule, plan.pipeline_size, microbatches, virtual)
            if zero is not None and (isinstance(zero, bool) or zero not in (0, 1, 2, 3)):
                raise ValueError(f"PipelineParallel: zero must be 0, 1, 2, 3 or None, got {zero!r}")
            if zero == 3 and sched.split_backward:
                raise ValueError(
                    "PipelineParallel: zero=3 frees a unit's parameters when its gradients arrive, which the zero-bubble "
                    "schedule defers to W; use zero <= 2 with 'zero_bubble', or another schedule with zero=3"
                )
            if cuts is not None:
                cuts = _check_cuts(cuts, len(chain), sched.n_stages)
            meta = has_meta(torch.nn.ModuleList(chain))
            if meta:
                problems = meta_problems(reset_order(torch.nn.ModuleList(chain)))
                if problems:
                    raise ValueError("PipelineParallel: " + "; ".join(problems[:5]))
                if sample is not None and cuts is None:
                    raise ValueError(
                        "PipelineParallel: a model on the meta device cannot run the profiling pass of sample=; "
                        "give cuts= (or no sample: the stages are then balanced by parameter count)"
                    )
            if len(chain) < sched.n_stages:
                raise ValueError(
                    f"PipelineParallel: {len(chain)} layers cannot fill {sched.n_stages} stages (p={plan.pipeline_size} "
                    f"x v={virtual}): a stage would be empty; use fewer stages or split the model into more layers"
                )
        except (TypeError, ValueError) as e:
            error = e
        C.agree_arguments(
            plan.grid.comm, "PipelineParallel", error, fixes=_FIXES, schedule=schedule,
            microbatches=microbatches, virtual=virtual, cuts=None if cuts is None else list(cuts), zero=zero,
            layers=len(chain), meta=meta, seed=seed, generator_state=generator_state(meta, seed),
        )  # fmt: skip
        sched = cast(Schedule, sched)  # (agreed above: no rank failed)
        self.plan, self.schedule, self.zero = plan, sched, zero
        self.layer_names = tuple(names)
        self.balance: tuple[tuple[int, int, int, float, float, float], ...] = ()
        self.cuts = tuple(cuts) if cuts is not None else self._balance(chain, sample)
        self.stages = tuple(sched.stages_of(plan.pipeline_rank))
        # stages starting with a Redistribute: the previous stage sends the pieces of its output straight to their
        # ranks in the new layout (the redistribution fused into the pipeline's messages: hpctp.layout.group_transfer_plan)
        self._model_ranks_of: dict[int, tuple[int, ...]] = {}  # stage -> its grid ranks at this data coordinate
        self._relayout = {
            s: chain[self.cuts[s]] for s in range(1, sched.n_stages) if isinstance(chain[self.cuts[s]], Redistribute)
        }
        target = _device(device, meta)
        self._shadows = shadows(chain)  # (meta copies of every layer, made before anything wraps them: _fit)
        self._fits: set[tuple[Any, ...]] = set()  # the input signatures whose stages were found to fit
        kept = self._build(chain, seed, target, meta)
        self.stage_modules = torch.nn.ModuleList(kept[s] for s in self.stages)
        self.modules_of = dict(zip(self.stages, self.stage_modules))
        self._last_grad_action = _last_gradient_actions(sched, plan.pipeline_rank)
        self._splittable = {s: not _recomputes(m) for s, m in self.modules_of.items()}  # [Note: split backward]
        self._meta_sent: set[tuple[int, int]] = set()
        self._meta_known: dict[tuple[int, int], Described] = {}
        self._micro_of: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}  # the groups' shares -> cut
        self.timeline: list[tuple[str, float, float]] = []
        self.step_seconds = 0.0

    # ------------------------------------------------------------------ construction
    def _balance(self, chain: list[torch.nn.Module], sample: Any) -> tuple[int, ...]:
        """Collective over grid. Balanced cuts: measured forward time and saved activations per layer (the max
        over ranks, so every rank cuts alike), or the parameter count without a sample; logged with each stage's
        predicted share (:attr:`balance`)."""
        n = self.schedule.n_stages
        params = [float(sum(p.numel() * p.element_size() for p in layer.parameters())) for layer in chain]
        if sample is None:
            costs, saved = [1.0 + v for v in params], [0.0] * len(chain)
            cuts = balanced_cuts(costs, n)
        else:
            times, saved = _profile(chain, sample)
            both = np.array(times + saved, dtype=np.float64)
            C.allreduce(self.plan.grid.comm, both, "max")
            costs, saved = both[: len(chain)].tolist(), both[len(chain) :].tolist()
            cuts = balanced_cuts(costs, n, secondary=saved)
        total = sum(costs) or 1.0
        self.balance = tuple(
            (s, cuts[s], cuts[s + 1], sum(costs[cuts[s] : cuts[s + 1]]) / total, sum(params[cuts[s] : cuts[s + 1]]),
             sum(saved[cuts[s] : cuts[s + 1]]))
            for s in range(n)
        )  # fmt: skip
        if self.plan.grid.rank == 0:
            what = "measured time" if sample is not None else "parameters"
            rows = "; ".join(
                f"stage {s}: layers {a}:{b}, {share:.0%} of the {what}, {p / 2**20:.2f} MiB of parameters"
                + (f", {act / 2**20:.2f} MiB of activations per micro-batch" if sample is not None else "")
                for s, a, b, share, p, act in self.balance
            )
            _LOG.info("pipeline cuts %s (balanced by %s): %s", cuts, what, rows)
        return cuts

    def _build(
        self, chain: list[torch.nn.Module], seed: int | None, device: Any, meta: bool
    ) -> dict[int, torch.nn.Module]:
        """Local (collective over the data axes with ``zero``). This rank's stages, materialized and wrapped."""
        mine = {s: range(self.cuts[s], self.cuts[s + 1]) for s in self.stages}
        owned = {i for r in mine.values() for i in r}
        dry = meta and torch.device(device).type == "meta"  # (a dry run, e.g. on a virtual grid: no values to draw)
        if meta and not dry:
            with seeded(seed):
                for i, layer in enumerate(chain):  # every layer, in order: the generator draws as one process's
                    materialize_modules(reset_order(layer), "cpu")
                    if i in owned:
                        layer.to(device)
                    else:  # another rank's: drawn only for the generator's sake, then back on meta
                        dematerialize(layer)
        out: dict[int, torch.nn.Module] = {}
        for s, idx in mine.items():
            module: torch.nn.Module = torch.nn.Sequential(OrderedDict((self.layer_names[i], chain[i]) for i in idx))
            if self.zero is not None:
                module = ShardedDataParallel(module, self.plan, stage=self.zero, device=device if dry else None)
            out[s] = module
        return out

    # ------------------------------------------------------------------ parameters
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Local. This rank's stages' parameters (their ShardedDataParallel slices with ``zero``), the optimizer's."""
        for s, module in self.modules_of.items():
            yield from module.named_parameters(
                f"{prefix}stage{s}." if prefix else f"stage{s}.", recurse, remove_duplicate
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Local. Clear every stage's gradients."""
        for module in self.modules_of.values():
            module.zero_grad(set_to_none)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Local. Not used: a pipeline runs a whole step at once (:meth:`step`).

        Raises
        ------
        TypeError
            Always.
        """
        raise TypeError(
            "PipelineParallel runs forward and backward of a batch together: call pipe.step(inputs, targets, loss_fn)"
        )

    # ------------------------------------------------------------------ the step
    def step(
        self, inputs: Any, targets: Any, loss_fn: LossFn, *, optimizer: torch.optim.Optimizer | None = None
    ) -> float:
        """Collective over grid. Forward and backward of one batch through the pipeline; its loss.

        Parameters
        ----------
        inputs, targets : tensor or DistTensor
            This data group's share of the batch (dim 0 the samples), on every rank of the group: the first
            stage reads ``inputs``, the last ``targets``.
        loss_fn : callable
            ``loss_fn(prediction, targets)`` of a micro-batch on the last stage: its mean over the
            micro-batch's global samples (e.g. ``lambda p, y: global_mse_loss(p.local, y, plan.grid,
            plan.loss_axes)``).
        optimizer : torch.optim.Optimizer, optional
            Also step it (over :meth:`parameters`) and, with ``zero`` 1-2, gather the updated parameters.

        Returns
        -------
        float
            The batch's loss, as one process computes it, on every rank (a dry run on ``meta`` tensors has none:
            NaN where it would be computed).

        Raises
        ------
        ValueError
            On every rank: if the batch has fewer samples than micro-batches; if a stage does not take the previous
            stage's output (or a layer the previous layer's), before any activation message, naming the stages, the
            layers at the cut, the shape and dtype given, the error and the fix (checked once per input signature
            on meta copies of the layers; what is checked and what is not: :mod:`hpctp.nn.pipeline_parallel._fit`).
        """
        plan, sched = self.plan, self.schedule
        shares, sizes, weights = self._microbatches(_length(inputs))
        self._check_fit(inputs, shares, sizes)
        run = _Step(self, inputs, targets, loss_fn, sizes, weights)
        t0 = time.perf_counter()
        run.execute(sched.actions(plan.pipeline_rank))
        self.timeline = [("step", t0, time.perf_counter()), *run.spans]
        slowest = np.array([self.timeline[0][2] - t0])
        C.allreduce(plan.grid.comm, slowest, "max")  # (a rank done early idles until the step ends)
        self.step_seconds = float(slowest[0])
        for module in self.modules_of.values():
            if isinstance(module, ShardedDataParallel):
                module.finish_gradients()
            else:
                plan.sync_gradients(module)
        if run.losses and shape_only(run.losses[0]):  # (a dry run: no value)
            total = float("nan")
        else:
            total = float(torch.stack(run.losses).to(torch.float64).sum()) if run.losses else 0.0
        loss = self._broadcast_loss(total)
        if optimizer is not None:
            optimizer.step()
            for module in self.modules_of.values():
                if isinstance(module, ShardedDataParallel):
                    module.refresh_parameters()
        return loss

    def idle_fraction(self) -> float:
        """Local. This rank's measured bubble in the last step: ``1 - busy / step``, ``busy`` the compute spans of
        :attr:`timeline` (forward, backward and weight passes, after their inputs arrived), ``step`` the slowest
        rank's wall time of the step (:attr:`step_seconds`: a rank whose actions end early waits for the others,
        as the closed forms count it).

        Raises
        ------
        RuntimeError
            Before the first step.
        """
        if not self.timeline:
            raise RuntimeError("PipelineParallel.idle_fraction: no step has run yet")
        return 1.0 - sum(e - s for _, s, e in self.timeline[1:]) / max(self.step_seconds, 1e-12)

    def _check_fit(self, inputs: Any, shares: tuple[int, ...], sizes: list[int]) -> None:
        """Collective over grid, once per input signature (the data groups' shares, the inputs' shape past dim 0 and
        dtype: the same on every rank, so every rank agrees or skips alike). Whether each layer takes the previous
        one's output, walked on meta copies (:mod:`~hpctp.nn.pipeline_parallel._fit`).

        Raises
        ------
        ValueError
            On every rank, before any activation message, naming the stages that do not fit.
        """
        key = (shares, signature(inputs))
        if key in self._fits:
            return
        device = _stage_device(self.modules_of.values())
        check_fit(self.plan.grid.comm, self._shadows, self.cuts, self.layer_names, inputs, sizes, self.stages, device)
        self._fits.add(key)

    def _microbatches(self, share: int) -> tuple[tuple[int, ...], list[int], list[float]]:
        """Collective over the data axes (one integer each, every step: any group's share may change alone). The
        groups' shares, this group's samples in each micro-batch, and each micro-batch's share of the global batch.

        The global batch (the groups' shares in data-rank order) is cut into ``m`` near-equal micro-batches and
        each group takes its samples of each, so no micro-batch is empty everywhere (a mean over no samples)
        while the batch has at least ``m`` samples.

        Raises
        ------
        ValueError
            On every rank, if the global batch has fewer samples than micro-batches.
        """
        shares = tuple(int(v) for v in C.allgather_ints(self.plan.data_comm, [share])[:, 0])
        if shares not in self._micro_of:
            m, total = self.schedule.m, sum(shares)
            if total < m:
                raise ValueError(
                    f"PipelineParallel: a batch of {total} samples cannot fill {m} micro-batches; use fewer "
                    "micro-batches or a larger batch"
                )
            lo = sum(shares[: self.plan.data_rank])
            hi = lo + share
            cuts = [block_range(total, m, i) for i in range(m)]
            sizes = [max(0, min(b, hi) - max(a, lo)) for a, b in cuts]
            self._micro_of[shares] = (sizes, [(b - a) / total for a, b in cuts])
        return (shares, *self._micro_of[shares])

    def _broadcast_loss(self, value: float) -> float:
        """Collective over grid. The last stage's loss to every rank (over the whole grid, not the pipeline axis)."""
        plan = self.plan
        coords = [0] * plan.grid.ndim
        if plan.pipeline_axes:
            coords[plan.pipeline_axes[0]] = self.schedule.rank_of(self.schedule.n_stages - 1)
        root = plan.grid.rank_of(tuple(coords))
        buf = np.array([value if plan.grid.rank == root else 0.0])
        C.bcast(plan.grid.comm, buf, root)
        return float(buf[0])

    def extra_repr(self) -> str:
        return (
            f"schedule={self.schedule.name}, p={self.schedule.p}, m={self.schedule.m}, v={self.schedule.v}, "
            f"cuts={self.cuts}, stages={self.stages}, zero={self.zero}"
        )


class _Step:
    """Local (its actions talk to the neighbouring stages). One step's state: stage inputs, outputs, losses,
    the receives posted, the sends in flight, the weight-gradient passes waiting (zero-bubble)."""

    def __init__(self, pipe: PipelineParallel, inputs: Any, targets: Any, loss_fn: LossFn, sizes: list[int],
                 weights: list[float]) -> None:  # fmt: skip
        self.pipe, self.inputs, self.targets, self.loss_fn = pipe, inputs, targets, loss_fn
        self.sizes, self.share_of = sizes, weights
        self.starts = [0]
        for n in sizes:
            self.starts.append(self.starts[-1] + n)
        self.comm = pipe.plan.pipeline_comm
        self.grid = pipe.plan.model_grid
        self.world = pipe.plan.grid.comm  # (pieces of a fused redistribution go to other model coordinates)
        self.x: dict[tuple[int, int], Any] = {}  # the stage's input (a tensor that requires grad, or the data)
        self.y: dict[tuple[int, int], Any] = {}  # its output (or the weighted loss on the last stage)
        # posted receives: their requests, and how the received buffers become the blocks
        self.received: dict[tuple[str, int, int], tuple[list[Pending], Callable[[], list[torch.Tensor]]]] = {}
        self.dinput: dict[tuple[int, int], list[torch.Tensor | None]] = {}  # per tensor of the stage's input
        self.weight_pass: dict[tuple[int, int], Callable[[], None]] = {}
        self.deferred: dict[tuple[int, int], DeferredWeightGradients] = {}  # [Note: deferred weight gradients]
        self.device: torch.device | None = None
        self.sends: list[tuple[Pending, torch.Tensor]] = []  # (the sends not known complete, and their buffers)
        self.spans: list[tuple[str, float, float]] = []
        self.losses: list[torch.Tensor] = []  # (the weighted micro-batch losses: one host sync at the end, not m)
        self.last = pipe.schedule.n_stages - 1
        self.handlers: dict[ActionKind, Callable[[Action], None]] = {
            _K.F: self.forward, _K.B: self.backward, _K.W: self.weights, _K.SEND_F: self.send_activation,
            _K.RECV_F: self.receive_activation, _K.SEND_B: self.send_gradient, _K.RECV_B: self.receive_gradient,
        }  # fmt: skip

    def execute(self, actions: Sequence[Action]) -> None:
        for j, a in enumerate(actions):
            self.post_ahead(actions[j : j + 1 + RECEIVE_AHEAD])
            try:
                self.handlers[a.kind](a)
            except Exception as e:
                raise RuntimeError(
                    f"PipelineParallel: pipeline rank {self.pipe.plan.pipeline_rank} failed at step {j} ({a}): {e}\n"
                    f"{self.pipe.schedule.table()}"
                ) from e
        for pending, _ in self.sends:
            pending.wait()

    # ------------------------------------------------------------------ messages
    def _peer(self, stage: int) -> int:
        return self.pipe.schedule.rank_of(stage)

    def _local(self, stage: int) -> bool:
        """Whether ``stage`` runs on this rank too (a pipeline of one rank holds every stage)."""
        return self._peer(stage) == self.pipe.plan.pipeline_rank

    def _description(self, boundary: int, i: int) -> Described | None:
        return self.pipe._meta_known.get((boundary, self.sizes[i]))

    def post_ahead(self, window: Sequence[Action]) -> None:
        """Post the receives of the coming actions whose buffers' shapes are known, in the schedule's order: MPI
        matches one kind's messages in the order the receives are posted, so a receive that must wait for its
        description holds back every later one of its kind (never waits itself)."""
        held: set[ActionKind] = set()
        for a in window:
            if a.kind.is_recv and a.kind not in held and not self.post_early(a):
                held.add(a.kind)

    def post_early(self, a: Action) -> bool:
        """Post ``a``'s receive if its buffer's shape is known; whether it is posted."""
        kind = "F" if a.kind is _K.RECV_F else "B"
        if (kind, a.stage, a.microbatch) in self.received:
            return True
        if a.kind is _K.RECV_F:
            d = self._description(a.stage - 1, a.microbatch)
            if d is None:
                return False
            self._post("F", a, d, tags.PIPELINE_ACTIVATION, a.stage - 1)
            return True
        if (a.stage, a.microbatch) not in self.y:
            return False
        self._post("B", a, self._sent(a.stage, a.microbatch), tags.PIPELINE_GRADIENT, a.stage + 1)
        return True

    def _sent(self, stage: int, i: int) -> Described:
        """What ``stage`` sent forward for micro-batch ``i`` (the layouts its gradient comes back in)."""
        out = self.y[(stage, i)]
        _, d = describe(out)
        fused = self._fused(stage + 1)
        if fused is not None:
            d = moved(d, fused.target, self.grid.rank)
        return d

    def _post(self, kind: str, a: Action, d: Described, tag: int, peer_stage: int) -> None:
        """Post the receives of one activation (``kind`` F: its blocks, described by the sender; B: the gradients of
        what this rank sent, in its own layouts), one per tensor, or per piece where the layout changes."""
        pipe_peer = self._peer(peer_stage)
        device = self._device()
        pending: list[Pending] = []
        blocks: list[torch.Tensor] = []
        pieces: list[tuple[torch.Tensor, tuple[slice, ...], torch.Tensor]] = []
        for p in d.parts:
            shape = p.shape if kind == "F" or p.source is None else p.source.local_shape(
                grid_coords(self.grid.rank, p.source.grid_dims)
            )  # fmt: skip
            block = torch.empty(shape, dtype=p.dtype, device=device)
            blocks.append(block)
            if p.source is None:
                pending.append(C.irecv(self.comm, block, pipe_peer, tag))
                continue
            boundary = a.stage - 1 if kind == "F" else a.stage
            for piece in self._transfer(p, boundary, kind).recvs:
                buf = torch.empty(piece.shape, dtype=p.dtype, device=device)
                pending.append(C.irecv(self.world, buf, piece.peer, tag))
                pieces.append((block, piece.slices, buf))

        def finish() -> list[torch.Tensor]:
            for block, where, buf in pieces:
                block[where] = buf
            return blocks

        self.received[(kind, a.stage, a.microbatch)] = (pending, finish)

    def _fused(self, stage: int) -> Any:
        """The Redistribute that starts ``stage`` when its input crosses ranks (fused into the messages), else None."""
        layer = self.pipe._relayout.get(stage)
        return layer if layer is not None and self._peer(stage) != self._peer(stage - 1) else None

    def _transfer(self, p: Part, boundary: int, kind: str) -> GroupTransferPlan:
        """The pieces of a tensor whose layout changes at ``boundary`` (stage ``boundary`` to ``boundary + 1``):
        forward (``kind`` F) from ``p.source`` on the sending stage's model ranks to ``p.layout`` on the receiving
        stage's, backward (B, the gradient) the other way; peers are ranks of the whole grid."""
        src, dst = cast(Layout, p.source), cast(Layout, p.layout)
        before, after = self._model_ranks(boundary), self._model_ranks(boundary + 1)
        rank = self.pipe.plan.grid.rank
        if kind == "F":
            return group_transfer_plan(src, before, dst, after, rank)
        return group_transfer_plan(dst, after, src, before, rank)

    def _model_ranks(self, stage: int) -> tuple[int, ...]:
        """The grid ranks holding ``stage`` at this rank's data coordinates, in the model grid's row-major order."""
        known = self.pipe._model_ranks_of.get(stage)
        if known is not None:
            return known
        plan = self.pipe.plan
        out = []
        for q in range(self.grid.size):
            coords = list(plan.grid.coords)
            coords[plan.pipeline_axes[0]] = self._peer(stage)
            for axis, c in zip(plan.grid_axes(range(self.grid.ndim)), grid_coords(q, self.grid.dims)):
                coords[axis] = c
            out.append(plan.grid.rank_of(tuple(coords)))
        self.pipe._model_ranks_of[stage] = tuple(out)
        return tuple(out)

    def _device(self) -> torch.device:
        if self.device is None:  # (once per step: a walk of the modules costs more than posting a receive)
            self.device = _stage_device(self.pipe.modules_of.values())
        return self.device

    def receive_activation(self, a: Action) -> None:
        key = ("F", a.stage, a.microbatch)
        if key not in self.received:
            d = self._description(a.stage - 1, a.microbatch)
            if d is None:  # the first micro-batch of this size at this boundary: its description comes first
                d = receive_description(self.comm, self._peer(a.stage - 1))
                if C.is_virtual(self.comm):  # (nothing arrives on a virtual grid: the description from shapes)
                    d = self._inferred(a.stage - 1, self.sizes[a.microbatch])
                self.pipe._meta_known[(a.stage - 1, self.sizes[a.microbatch])] = d
            self._post("F", a, d, tags.PIPELINE_ACTIVATION, a.stage - 1)

    def _inferred(self, boundary: int, n: int) -> Described:
        """Local. On a virtual grid: what stage ``boundary`` sends for a micro-batch of ``n`` samples, from the
        shadows of the layers before the cut walked on meta (:func:`~hpctp.nn.pipeline_parallel._fit.walk_shapes`).

        Raises
        ------
        NotImplementedError
            Where the walk cannot reach the cut (a layer before it communicates: hpctp's layers have no shadow; a
            DistTensor input or activation).
        """
        out = walk_shapes(self.pipe._shadows, self.inputs, n, self.pipe.cuts[boundary + 1])
        if out is None:
            names = self.pipe.layer_names[: self.pipe.cuts[boundary + 1]]
            raise NotImplementedError(
                f"PipelineParallel on a virtual grid: the activation stage {boundary} sends stage {boundary + 1} "
                f"cannot be found from shapes alone: the walk of layers {list(names)} on meta stops at an hpctp "
                "layer (its forward communicates) or a DistTensor; a virtual pipeline takes chains of torch layers "
                "on plain tensors up to each cut"
            )
        _, d = describe(out)
        fused = self._fused(boundary + 1)
        return moved(d, fused.target, self.grid.rank) if fused is not None else d

    def receive_gradient(self, a: Action) -> None:
        if ("B", a.stage, a.microbatch) not in self.received:
            self._post("B", a, self._sent(a.stage, a.microbatch), tags.PIPELINE_GRADIENT, a.stage + 1)

    def send_activation(self, a: Action) -> None:
        blocks = blocks_of(self.y[(a.stage, a.microbatch)])
        d = self._sent(a.stage, a.microbatch)
        key, peer = (a.stage, self.sizes[a.microbatch]), self._peer(a.stage + 1)
        if key not in self.pipe._meta_sent:
            self.sends.append((send_description(self.comm, d, peer), blocks[0]))
            self.pipe._meta_sent.add(key)
        for block, p in zip(blocks, d.parts):
            self._send(block.detach(), p, "F", a.stage + 1, tags.PIPELINE_ACTIVATION)

    def _send(self, block: torch.Tensor, p: Part, kind: str, stage: int, tag: int) -> None:
        """Send one tensor to ``stage``: whole to the counterpart, or (a layout changing on the way) each piece to
        the rank that keeps it (``kind`` F: the activation's pieces; B: the gradient's, back). The buffers of the
        sends already complete are let go first: a stage would otherwise keep every activation and input gradient
        it sent until the step ends (``m`` of each)."""
        self.sends = [(pending, data) for pending, data in self.sends if not pending.test()]
        if p.source is None:
            data = block.contiguous()
            self.sends.append((C.isend(self.comm, data, self._peer(stage), tag), data))
            return
        for piece in self._transfer(p, stage - 1 if kind == "F" else stage, kind).sends:
            data = block[piece.slices].contiguous()
            self.sends.append((C.isend(self.world, data, piece.peer, tag), data))

    def send_gradient(self, a: Action) -> None:
        grads = self.dinput.pop((a.stage, a.microbatch))
        x = self.x.pop((a.stage, a.microbatch))
        d = cast(Described, self._description(a.stage - 1, a.microbatch))
        for g, block, p in zip(grads, blocks_of(x), d.parts):
            data = torch.zeros_like(block) if g is None else g  # (None: the input reached no output)
            self._send(data, p, "B", a.stage - 1, tags.PIPELINE_GRADIENT)

    def _take(self, kind: str, stage: int, i: int) -> list[torch.Tensor]:
        pending, finish = self.received.pop((kind, stage, i))
        for p in pending:
            p.wait()
        return finish()

    # ------------------------------------------------------------------ compute
    def forward(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        if s == 0:
            x = _rows(self.inputs, self.starts[i], self.starts[i + 1])
        elif self._local(s - 1):  # the previous stage on this rank (one pipeline rank): handed over, no message
            prev = self.y[(s - 1, i)]
            x = _detached(prev)
        else:
            blocks = [b.requires_grad_(True) for b in self._take("F", s, i)]
            fused = self._fused(s)
            moved_grid = fused.grid if fused is not None else None
            x = self._description(s - 1, i).wrap(blocks, self.grid, moved_grid)  # type: ignore[union-attr]
        self.x[(s, i)] = x
        t0 = time.perf_counter()  # (after the input arrived: a span is computation, never waiting)
        if s > 0 and self.pipe.schedule.split_backward and self.pipe._splittable[s]:
            deferred = self.deferred[(s, i)] = DeferredWeightGradients()
            with deferred.recording():
                out = self.pipe.modules_of[s](x)
        else:
            out = self.pipe.modules_of[s](x)
        if s == self.last:
            target = _rows(self.targets, self.starts[i], self.starts[i + 1])
            loss = self.loss_fn(out, target) * self.share_of[i]
            self.losses.append(loss.detach())
            out = loss
        self.y[(s, i)] = out
        self.spans.append((str(a), t0, time.perf_counter()))

    def _gradient_sync(self, a: Action, whole: bool = False) -> contextlib.AbstractContextManager[Any]:
        """Inside the stage's no_sync unless ``a`` is the stage's last gradient pass (ZeRO 0-2: gradients wait in
        the buckets until then; stage 3 sends every micro-batch's, into its slices). ``whole``: a backward that
        computes the weights' gradients too, where a zero-bubble schedule's W would have."""
        module = self.pipe.modules_of[a.stage]
        if not isinstance(module, ShardedDataParallel) or module.stage == 3 or a.kind is _K.F:
            return contextlib.nullcontext()
        kind = _K.W if whole and self.pipe.schedule.split_backward else a.kind
        if self.pipe._last_grad_action[a.stage] == (kind, a.microbatch):
            return contextlib.nullcontext()
        return module.no_sync()

    def backward(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        out = self.y.pop((s, i))
        roots: list[torch.Tensor] = [out]
        grads: list[torch.Tensor | None] = [None]  # (the last stage: the loss's 1)
        if s != self.last:
            if self._local(s + 1):
                arrived: list[torch.Tensor | None] = self.dinput.pop((s + 1, i))
                del self.x[(s + 1, i)]
            else:
                arrived = list(self._take("B", s, i))
            # (outputs that need no gradient: data passed through from the first stage's input)
            pairs = [(b, g) for b, g in zip(blocks_of(out), arrived) if b.requires_grad and g is not None]
            roots, grads = [b for b, _ in pairs], [g for _, g in pairs]
        x_blocks = blocks_of(self.x[(s, i)]) if s > 0 else []
        t0 = time.perf_counter()
        module = self.pipe.modules_of[s]
        deferred = self.deferred.pop((s, i), None)
        if not deferred and self.pipe.schedule.split_backward and self.pipe._splittable[s]:  # (the graph walk)
            params = [p for p in _inner(module).parameters() if p.requires_grad]
            dx, weights = backward_input(roots, grads, x_blocks, params)
            self.weight_pass[(s, i)] = weights
            self.dinput[(s, i)] = list(dx)
        else:  # autograd's backward: every weight's gradient, or (deferred) all but the linear layers', left to W
            with self._gradient_sync(a, whole=not deferred):
                if roots:
                    torch.autograd.backward(roots, None if s == self.last else grads)
            self.dinput[(s, i)] = [b.grad for b in x_blocks]
            if self.pipe.schedule.split_backward:  # (a stage with recomputed layers: W does nothing)
                self.weight_pass[(s, i)] = deferred.run if deferred else _nothing
        if s == 0:
            del self.x[(s, i)]
        self.spans.append((str(a), t0, time.perf_counter()))

    def weights(self, a: Action) -> None:
        t0 = time.perf_counter()
        with self._gradient_sync(a):
            self.weight_pass.pop((a.stage, a.microbatch))()
        self.spans.append((str(a), t0, time.perf_counter()))


# ---------------------------------------------------------------------- helpers
def _layers(layers: object) -> tuple[list[str], list[torch.nn.Module]]:
    """The chain's names (a Sequential's own, else the indices) and layers."""
    named: list[tuple[str, Any]] | None = None
    if isinstance(layers, torch.nn.Sequential):
        named = list(layers.named_children())
    elif isinstance(layers, (list, tuple, torch.nn.ModuleList)):
        named = [(str(i), m) for i, m in enumerate(layers)]
    if not named or not all(isinstance(m, torch.nn.Module) for _, m in named):
        raise TypeError(
            "PipelineParallel: layers must be a torch.nn.Sequential or a non-empty list of torch.nn.Module (the model "
            f"as a chain of layers), got {type(layers).__name__}"
        )
    return [n for n, _ in named], [m for _, m in named]


def _check_cuts(cuts: Sequence[int], n: int, stages: int) -> list[int]:
    c = list(cuts)
    if len(c) != stages + 1 or not all(is_int(v) for v in c) or c[0] != 0 or c[-1] != n:
        raise ValueError(
            f"PipelineParallel: cuts={tuple(c)} must be {stages + 1} layer indices from 0 to {n} (stage s runs layers "
            "cuts[s]:cuts[s+1])"
        )
    empty = [s for s in range(stages) if c[s + 1] <= c[s]]
    if empty:
        raise ValueError(f"PipelineParallel: cuts={tuple(c)} leave stages {empty} empty; every stage needs a layer")
    return [int(v) for v in c]


def _last_gradient_actions(sched: Schedule, rank: int) -> dict[int, tuple[ActionKind, int]]:
    """Each of this rank's stages' last gradient pass (W with split backward, else B): where gradients sync."""
    kind = _K.W if sched.split_backward else _K.B
    out: dict[int, tuple[ActionKind, int]] = {}
    for a in sched.actions(rank):
        if a.kind is kind:
            out[a.stage] = (kind, a.microbatch)
    return out


def _device(device: Any, meta: bool) -> Any:
    if device is not None:
        return torch.device(device)
    gpu = C.current_device() if meta else None
    return torch.device("cpu") if gpu is None else torch.device("cuda", gpu)


def _stage_device(modules: Iterable[torch.nn.Module]) -> torch.device:
    """Where this rank's stages compute: their first parameter's device, else the CPU."""
    for module in modules:
        for p in module.parameters():
            return p.device
    return torch.device("cpu")


def _length(x: Any) -> int:
    shape = x.global_shape if isinstance(x, DistTensor) else tuple(x.shape)
    return int(shape[0])


def _rows(x: Any, a: int, b: int) -> Any:
    return x[a:b]


def _nothing() -> None:
    """A weight-gradient pass with nothing left to do."""


def _recomputes(module: torch.nn.Module) -> bool:
    """Whether a stage recomputes activations in backward (:func:`hpctp.nn.checkpoint_forward`, Checkpointed): its
    backward cannot be split, since the recompute runs once per pass."""
    return any(getattr(m, "hpctp_recomputed", False) or isinstance(m, Checkpointed) for m in module.modules())


def _detached(x: Any) -> Any:
    """A stage's output as the next stage's input on the same rank: new leaves, so each stage has its own graph."""
    if isinstance(x, tuple):
        return tuple(_detached(v) for v in x)
    if isinstance(x, DistTensor):
        return x.with_local(x.local.detach().requires_grad_(True))
    return x.detach().requires_grad_(True)


def _inner(module: torch.nn.Module) -> torch.nn.Module:
    return module.module if isinstance(module, ShardedDataParallel) else module


def _profile(chain: list[torch.nn.Module], sample: Any) -> tuple[list[float], list[float]]:
    """Collective over the model grid. Each layer's forward time (x 3: forward and backward) and the bytes
    autograd saves in it, from one pass over ``sample``."""
    times, saved = [], []
    x = sample
    for layer in chain:
        total = [0]

        def pack(t: torch.Tensor, total: list[int] = total) -> torch.Tensor:
            total[0] += t.numel() * t.element_size()
            return t

        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = layer(x)
        times.append(3.0 * (time.perf_counter() - t0))
        saved.append(float(total[0]))
    return times, saved
