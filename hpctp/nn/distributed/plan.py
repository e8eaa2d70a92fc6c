"""The roles of a process grid's axes in training: data, pipeline, spatial and tensor parallelism.

A training grid has four kinds of axes (any of them may be absent, and an axis may have size 1):

* **data** axes: ranks along them hold *different samples* of the global batch and the same
  model (or, with :class:`hpctp.nn.ShardedDataParallel`, shards of it);
* **spatial** axes: ranks along them hold different *blocks of each field* (the layers' ``split``);
* **tensor** axes: ranks along them hold different *parts of the weights* (heads, hidden units)
  and the same activations;
* a **pipeline** axis (at most one): ranks along it hold different *layers* (the stages of
  :class:`hpctp.nn.PipelineParallel`), each stage on its own model grid of the same shape.

The model is built on :attr:`ParallelPlan.model_grid`, the sub-grid of the spatial and tensor axes
(in the grid's axis order); each data group and pipeline stage (the ranks with the same data and
pipeline coordinates) is one such sub-grid. The loss is summed over the data and spatial axes (:attr:`ParallelPlan.loss_axes`), so it
is the loss of the global batch on every rank, and :meth:`ParallelPlan.sync_gradients` sums each
gradient over the axes where it is partial: the data axes and, for a replicated parameter, the
spatial axes (never the tensor axes, along which replicated parameters get identical gradients).
With every axis of size 1 the plan is one process.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from ... import comm as C
from ..._util.ints import is_int
from ...comm import ProcessGrid, check_grid
from ...layout import block_range
from .replicas import partial_axes, reduce_bucket

__all__ = ["ParallelPlan"]

PlanBucketKey = tuple[torch.device, torch.dtype, tuple[int, ...]]


def _axes(name: str, value: object, ndim: int) -> tuple[int, ...]:
    if is_int(value):
        value = (value,)
    if not isinstance(value, Sequence) or not all(is_int(a) for a in value):
        raise TypeError(f"ParallelPlan: {name} must be a sequence of grid axes (ints), got {value!r}")
    axes = tuple(int(a) for a in value)
    bad = [a for a in axes if not 0 <= a < ndim]
    if bad:
        raise ValueError(f"ParallelPlan: {name}={axes} names axes {bad} outside a {ndim}-D grid (0..{ndim - 1})")
    return axes


class ParallelPlan:
    """Collective over grid. Which grid axes carry data, spatial and tensor parallelism.

    Parameters
    ----------
    grid : ProcessGrid
        The training grid (all ranks of the job).
    data : sequence of int
        Grid axes along which ranks hold different samples.
    spatial : sequence of int, optional
        Grid axes that split the fields (default: every axis not in ``data`` or ``tensor``).
    tensor : sequence of int
        Grid axes that split the weights.
    pipeline : int or sequence of one int, optional
        The grid axis along which ranks hold different stages (layers) of the model.

    Attributes
    ----------
    grid : ProcessGrid
    data_axes, spatial_axes, tensor_axes, pipeline_axes : tuple of int
        Axes of ``grid`` (``pipeline_axes``: none or one).
    model_grid : ProcessGrid
        The spatial and tensor axes (grid order; ``(1,)`` when there are none): build the model,
        its inputs and its layers on it.
    spatial, tensor : tuple of int
        The same axes numbered on ``model_grid`` (e.g. a layer's ``split=plan.spatial``).
    data_comm : mpi4py.MPI.Intracomm
        The ranks of the other data groups that hold the same blocks (rank = data index).
    data_size, data_rank : int
        Number of data groups and this rank's group.
    pipeline_comm : mpi4py.MPI.Intracomm
        The ranks holding the other stages of this rank's model copy (rank = stage position).
    pipeline_size, pipeline_rank : int
        Number of pipeline ranks (1 without a pipeline axis) and this rank's place along it.
    stage_comm : mpi4py.MPI.Intracomm
        The ranks holding the same stage (every axis but the pipeline one): what a stage's collectives span.

    Raises
    ------
    ValueError
        On every rank, if an axis is outside the grid, is named twice, or the ranks disagree.
    TypeError
        If ``grid`` is not a ProcessGrid or an axis is not an int.
    """

    def __init__(
        self,
        grid: ProcessGrid,
        *,
        data: Sequence[int] = (),
        spatial: Sequence[int] | None = None,
        tensor: Sequence[int] = (),
        pipeline: int | Sequence[int] = (),
    ) -> None:
        check_grid(grid)
        error: Exception | None = None
        data_axes: tuple[int, ...] = ()
        tensor_axes: tuple[int, ...] = ()
        spatial_axes: tuple[int, ...] = ()
        pipeline_axes: tuple[int, ...] = ()
        try:
            data_axes = _axes("data", data, grid.ndim)
            tensor_axes = _axes("tensor", tensor, grid.ndim)
            pipeline_axes = _axes("pipeline", pipeline, grid.ndim)
            if len(pipeline_axes) > 1:
                raise ValueError(
                    f"ParallelPlan: pipeline={pipeline_axes} names {len(pipeline_axes)} axes; the stages lie along one grid "
                    "axis: name one (merge axes into one with another grid shape)"
                )
            named = data_axes + tensor_axes + pipeline_axes
            if spatial is None:
                spatial_axes = tuple(a for a in range(grid.ndim) if a not in named)
            else:
                spatial_axes = _axes("spatial", spatial, grid.ndim)
            every = data_axes + spatial_axes + tensor_axes + pipeline_axes
            if len(set(every)) != len(every):
                raise ValueError(
                    f"ParallelPlan: data={data_axes}, spatial={spatial_axes}, tensor={tensor_axes}, "
                    f"pipeline={pipeline_axes} name an axis twice; give each grid axis one role"
                )
            if len(every) != grid.ndim:
                missing = sorted(set(range(grid.ndim)) - set(every))
                raise ValueError(
                    f"ParallelPlan: grid axes {missing} of a {grid.ndim}-D grid have no role; name them in data, "
                    "pipeline, spatial or tensor (or leave spatial out: it takes the rest)"
                )
        except (TypeError, ValueError) as e:
            error = e
        C.agree_arguments(
            grid.comm, "ParallelPlan", error, data=data_axes, spatial=spatial_axes, tensor=tensor_axes,
            pipeline=pipeline_axes,
        )  # fmt: skip
        self.grid = grid
        self.data_axes, self.spatial_axes, self.tensor_axes = data_axes, spatial_axes, tensor_axes
        self.pipeline_axes = pipeline_axes
        model = sorted(spatial_axes + tensor_axes)
        self.model_grid = grid.subgrid(model)
        position = {a: i for i, a in enumerate(model)}
        self._model_axes = tuple(model)
        self.spatial = tuple(position[a] for a in spatial_axes)
        self.tensor = tuple(position[a] for a in tensor_axes)
        self.data_comm = grid.axes_comm(data_axes)
        self.data_size = math.prod(grid.dims[a] for a in data_axes)
        self.data_rank = int(self.data_comm.Get_rank())
        self.pipeline_comm = grid.axes_comm(pipeline_axes)
        self.pipeline_size = math.prod(grid.dims[a] for a in pipeline_axes)
        self.pipeline_rank = int(self.pipeline_comm.Get_rank())
        self.stage_comm = grid.axes_comm(tuple(a for a in range(grid.ndim) if a not in pipeline_axes))
        for spatial_part in itertools.chain.from_iterable(
            itertools.combinations(spatial_axes, k) for k in range(len(spatial_axes) + 1)
        ):  # every communicator a gradient may be summed over, made here by all ranks in one order (pipeline stages
            # of different layers would otherwise ask for different ones first)
            grid.axes_comm(tuple(sorted(data_axes + spatial_part)))
            grid.axes_comm(spatial_part)

    # ------------------------------------------------------------------ local queries
    @property
    def loss_axes(self) -> tuple[int, ...]:
        """Local. The grid axes along which ranks hold different parts of the batch (data and
        spatial): sum a loss over them (e.g. ``global_mse_loss(p, y, plan.grid, plan.loss_axes)``)."""
        return tuple(sorted(self.data_axes + self.spatial_axes))

    def grid_axes(self, model_axes: Sequence[int]) -> tuple[int, ...]:
        """Local. ``model_grid`` axes numbered on ``grid``.

        Raises
        ------
        ValueError
            If an axis is not a model-grid axis.
        """
        out = []
        for a in model_axes:
            if not is_int(a) or not 0 <= int(a) < len(self._model_axes):
                raise ValueError(f"{a!r} is not an axis of the model grid of dims {self.model_grid.dims}")
            out.append(self._model_axes[int(a)])
        return tuple(out)

    def sample_range(self, n: int) -> tuple[int, int]:
        """Local. This data group's ``[start, stop)`` of ``n`` samples (balanced, the first groups
        one larger), the same on every rank of the group.

        Raises
        ------
        ValueError
            If ``n`` is negative or not an int.
        """
        if not is_int(n) or n < 0:
            raise ValueError(f"sample count must be an int >= 0, got {n!r}")
        return block_range(int(n), self.data_size, self.data_rank)

    def gradient_axes(self, p: torch.nn.Parameter, name: str = "parameter") -> tuple[int, ...]:
        """Local. The grid axes over which ``p``'s gradient (of a model on ``model_grid``) is partial:
        the data axes, and the spatial axes along which ``p`` is replicated and that its layer did
        not already sum in backward.

        Raises
        ------
        ValueError
            If ``p.hpctp_layout`` is not a Layout of ``model_grid``.
        """
        spatial = self.grid_axes(partial_axes(p, self.model_grid, self.spatial, name))
        return tuple(sorted(self.data_axes + spatial))

    def check_model(self, model: torch.nn.Module, what: str) -> None:
        """Local. Raise if a layer of ``model`` lives on other ranks than :attr:`model_grid` (a model built on
        the whole grid, or on another plan's model grid).

        Parameters
        ----------
        model : torch.nn.Module
        what : str
            The caller, for the message (e.g. ``"ShardedDataParallel"``).

        Raises
        ------
        ValueError
            Naming the first such layer, its grid and the fix (build it on ``plan.model_grid``).
        """
        for name, m in model.named_modules():
            grid = getattr(m, "grid", None)
            if isinstance(grid, ProcessGrid) and not grid.same_ranks(self.model_grid):
                raise ValueError(
                    f"{what}: layer {name or '(the model)'!r} ({type(m).__name__}) is built on a grid of dims "
                    f"{grid.dims} ({grid.size} ranks), not on plan.model_grid (dims {self.model_grid.dims}, "
                    f"{self.model_grid.size} ranks: the plan's spatial and tensor axes, one copy per data group"
                    f"{' and pipeline stage' if self.pipeline_axes else ''}); build the model on plan.model_grid"
                )

    def gradient_buckets(self, module: torch.nn.Module) -> dict[PlanBucketKey, list[tuple[str, torch.nn.Parameter]]]:
        """Local. The trainable parameters grouped by ``(device, dtype, gradient_axes)`` in
        ``named_parameters()`` order; groups whose axes hold one rank are left out.

        Raises
        ------
        ValueError
            If a parameter's ``hpctp_layout`` is not a Layout of ``model_grid``.
        """
        buckets: dict[PlanBucketKey, list[tuple[str, torch.nn.Parameter]]] = defaultdict(list)
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            axes = self.gradient_axes(p, name)
            if math.prod(self.grid.dims[a] for a in axes) > 1:
                buckets[(p.device, p.dtype, axes)].append((name, p))
        return dict(buckets)

    # ------------------------------------------------------------------ collectives
    def sync_gradients(self, module: torch.nn.Module) -> None:
        """Collective over grid. Sum every gradient of ``module`` over its :meth:`gradient_axes`.

        One ``Allreduce`` per bucket (:meth:`gradient_buckets`) on the communicator of its axes.
        With a loss summed over :attr:`loss_axes`, every rank then holds the gradient of the
        global batch. A parameter whose ``.grad`` is None contributes zeros; it stays None only
        where it is None on every rank of its bucket's communicator.

        Raises
        ------
        ValueError
            If a gradient is sparse or a ``hpctp_layout`` is not of ``model_grid``.
        """
        buckets = self.gradient_buckets(module)
        with torch.no_grad():
            for (device, dtype, axes), params in buckets.items():
                reduce_bucket(params, dtype, device, (self.grid.axes_comm(axes),))

    def free(self) -> None:
        """Collective over grid. Release the model grid (the data communicator belongs to ``grid``)."""
        self.model_grid.free()

    def __repr__(self) -> str:
        return (
            f"ParallelPlan(dims={self.grid.dims}, data={self.data_axes}, spatial={self.spatial_axes}, "
            f"tensor={self.tensor_axes}"
            + (f", pipeline={self.pipeline_axes}" if self.pipeline_axes else "")
            + f", model_grid={self.model_grid.dims})"
        )
