"""Tensor-parallel linear layers ``y = x W^T + b`` with torch autograd.

Three ways to cut the weight ``W`` (``out_features x in_features``, torch's convention):

* :class:`ColumnParallelLinear`: ``W`` split over ``axis`` by output features. Input
  ``[..., in]`` (replicated along ``axis``), output ``[..., out_local]`` (or all of it).
* :class:`RowParallelLinear`: ``W`` split over ``axis`` by input features. Input
  ``[..., in_local]`` (or all of it), output ``[..., out]`` (replicated along ``axis``).
* :class:`Linear2D`: ``W`` split ``(0, 1)`` over a 2-D grid, products by SUMMA. Input the
  block ``[batch_i, in_j]`` of ``X`` split ``(0, 1)``, output the block ``[batch_i, out_j]``.

``*_local`` blocks follow balanced cuts (:func:`hpctp.block_range`) of the feature dim
over the grid axis, or the ``out_cuts``/``in_cuts`` given (e.g. whole attention heads);
"replicated" means identical on every rank along ``axis``. Layers take
and return local torch blocks. Every sharded parameter carries ``hpctp_layout``, the
:class:`~hpctp.Layout` of the global parameter on the layer's grid; a parameter without
it is replicated.

Initialisation does not depend on the grid: ``W`` and ``b`` are drawn from
``U(-1/sqrt(in), 1/sqrt(in))`` (torch's default distribution) with
:func:`hpctp.random.block_uniform`, so the gathered weights of all three layers, on any
number of ranks, are the same for the same ``(in, out, seed)``.

Gradients: after ``backward`` every parameter's ``.grad`` is the single-process gradient
of its block for the loss the ranks back-propagate together (a sum of losses of disjoint
output blocks, or one loss every rank computes alike from a replicated output). The
layers do every reduction their partitioning needs, including the batch sum of
:class:`Linear2D`'s bias gradient over grid axis 0; so with
:func:`hpctp.nn.sync_gradients`, pass only data-parallel grid axes (not the axes these
layers use). Forward and backward are collective over the layer's grid (or ``axis``):
call them on every rank, with ``requires_grad`` the same on every rank. The ranks of
``axis`` agree on the input's shape and dtype the first time each shape is seen
(:class:`~hpctp.nn.transformer.sequence_parallel.ArgumentAgreement`), not on every call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ... import comm as C
from ..._util.ints import is_int, positive_ints
from ...comm import ProcessGrid, check_grid
from ...layout import Layout, block_cuts
from ...linalg.plan import check_panel
from ...linalg.summa import summa_block
from .._amp import autocast_dtype
from .._deferred_weights import linear as _linear
from ..init import BlockReset, bias_seed, derive_seed, init_block
from .agreement import ArgumentAgreement
from .sequence_parallel import CopyToAxis, SumOverAxis

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "Linear2D",
    "Linear",
    "init_block",
    "derive_seed",
    "feature_cuts",
]


def _check_features(in_features: object, out_features: object) -> tuple[int, int]:
    n_in, n_out = positive_ints(in_features=in_features, out_features=out_features)
    return n_in, n_out


def _check_axis(grid: ProcessGrid, axis: object) -> int:
    if not is_int(axis) or not 0 <= axis < grid.ndim:
        raise ValueError(f"axis={axis!r} is not an axis of the {grid.ndim}-D grid {grid.dims}")
    return int(axis)


def feature_cuts(n: int, parts: int, cuts: Sequence[int] | None, name: str) -> tuple[int, ...]:
    """Local. Balanced cuts of ``n`` features over ``parts`` ranks, or the given ``cuts`` validated.

    Raises
    ------
    ValueError
        If ``cuts`` is not ``parts + 1`` non-decreasing ints from 0 to ``n``.
    """
    if cuts is None:
        return block_cuts(n, parts)
    c = tuple(cuts)
    if (
        len(c) != parts + 1
        or not all(is_int(v) for v in c)
        or c[0] != 0
        or c[-1] != n
        or any(b < a for a, b in zip(c, c[1:]))
    ):
        raise ValueError(f"{name}={c!r} must be {parts + 1} non-decreasing ints from 0 to {n} (one block per rank)")
    return tuple(int(v) for v in c)


def _parameter(data: torch.Tensor, layout: Layout) -> torch.nn.Parameter:
    """A parameter holding ``data``; it carries ``hpctp_layout`` when ``layout`` splits a dim
    (sharded), none when it is replicated (checkpoints and gradient sync treat it as plain)."""
    p = torch.nn.Parameter(data)
    if any(axis is not None for axis in layout.split):
        p.hpctp_layout = layout  # type: ignore[attr-defined]
    return p


class _BlockLinear(BlockReset, torch.nn.Module):
    """Local. What ``_init_parameters`` needs of a layer (for the type checker)."""


def _init_parameters(
    module: _BlockLinear, grid: ProcessGrid, weight: Layout, bias: Layout | None, seed: int, dtype: torch.dtype,
    device: Any,
) -> None:  # fmt: skip
    """Local. ``module.weight`` (global ``[out, in]`` laid out as ``weight``) and ``module.bias``
    (laid out as ``bias``; None: no bias), initialised like ``torch.nn.Linear``
    (``U(-1/sqrt(in), 1/sqrt(in))``) as this rank's blocks of grid-independent global tensors."""
    bound = 1.0 / math.sqrt(weight.global_shape[1])
    module.weight = _parameter(init_block(weight, grid.coords, seed, bound, dtype, device), weight)
    module._record_block("weight", weight, grid.coords, seed, bound)
    if bias is None:
        module.register_parameter("bias", None)
    else:
        module.bias = _parameter(init_block(bias, grid.coords, bias_seed(seed), bound, dtype, device), bias)
        module._record_block("bias", bias, grid.coords, bias_seed(seed), bound)


def _mark_complete(module: torch.nn.Module, axes: tuple[int, ...]) -> None:
    """Record that backward already completes these parameters' gradients along ``axes``.

    :func:`hpctp.nn.sync_gradients` then leaves those axes alone (summing again would count
    the contributions several times); it still sums along other (e.g. data-parallel) axes.
    """
    for p in module.parameters(recurse=False):
        p.hpctp_grad_reduced = axes  # type: ignore[attr-defined]


def _split(ndim: int, dim: int, axis: int) -> tuple[int | None, ...]:
    out: list[int | None] = [None] * ndim
    out[dim] = axis
    return tuple(out)


def _extent(cuts: tuple[int, ...], i: int) -> int:
    return cuts[i + 1] - cuts[i]


# ---------------------------------------------------------------------------- adjoint collectives
def _allgather_last(x: torch.Tensor, comm: Any, cuts: tuple[int, ...]) -> torch.Tensor:
    lead = tuple(x.shape[:-1])
    rows = math.prod(lead)
    counts = [rows * _extent(cuts, r) for r in range(len(cuts) - 1)]
    recv = torch.empty(sum(counts), dtype=x.dtype, device=x.device)
    C.allgatherv(comm, x.detach().contiguous().reshape(-1), recv, counts)
    parts = torch.split(recv, counts)
    blocks = [p.reshape(rows, _extent(cuts, r)) for r, p in enumerate(parts)]
    return torch.cat(blocks, dim=1).reshape(lead + (cuts[-1],))


class _GatherLast(torch.autograd.Function):
    """Forward all-gather of the last dim's blocks, backward this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any, cuts: tuple[int, ...]) -> torch.Tensor:
        ctx.lo, ctx.hi = cuts[comm.Get_rank()], cuts[comm.Get_rank() + 1]
        return _allgather_last(x, comm, cuts)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return dy[..., ctx.lo : ctx.hi].contiguous(), None, None


class _SliceLast(torch.autograd.Function):
    """Forward this rank's slice of the last dim, backward all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any, cuts: tuple[int, ...]) -> torch.Tensor:
        ctx.comm, ctx.cuts = comm, cuts
        r = comm.Get_rank()
        return x[..., cuts[r] : cuts[r + 1]].contiguous()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _allgather_last(dy, ctx.comm, ctx.cuts), None, None


def _signature(x: object, error: Exception | None, whole: bool) -> tuple[Any, ...]:
    """What the ranks of the axis must agree on: the input's shape (without the last dim when
    each rank passes its own block of features), dtype and device kind."""
    if error is not None or not isinstance(x, torch.Tensor):
        return ("invalid",)
    shape = tuple(x.shape) if whole else tuple(x.shape[:-1])
    return (shape, str(x.dtype), x.device.type)


def _check_input(x: object, weight: torch.Tensor, features: int, what: str) -> Exception | None:
    if not isinstance(x, torch.Tensor):
        return TypeError(f"{what}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 1 or x.shape[-1] != features:
        return ValueError(f"{what}: input's last dim must be {features} on this rank, got shape {tuple(x.shape)}")
    if (x.dtype != weight.dtype and autocast_dtype(x) is None) or x.device != weight.device:  # (autocast casts)
        return TypeError(f"{what}: input is {x.dtype} on {x.device}, the weight {weight.dtype} on {weight.device}")
    return None


# ---------------------------------------------------------------------------- 1-D tensor parallel
class ColumnParallelLinear(_BlockLinear):
    """Local. ``y = x W^T + b`` with the output features split over one grid axis.

    Layouts: ``weight`` is the block ``[out_local, in]`` of ``W`` split ``(axis, None)``;
    ``bias`` the block ``[out_local]`` split ``(axis,)``; both replicated along the other
    grid axes. ``forward(x)`` takes the full input ``[..., in]`` (the same on every rank
    of ``axis``) and returns ``[..., out_local]`` (or the full ``[..., out]`` with
    ``gather_output``). Backward sums the input gradient over ``axis`` (the adjoint of
    using the same input everywhere).

    Parameters
    ----------
    in_features, out_features : int
    grid : ProcessGrid
        Any grid; only the ranks along ``axis`` communicate.
    axis : int
        Grid axis splitting the output features.
    bias : bool
    gather_output : bool
        All-gather the output features (backward then takes this rank's slice).
    seed : int
        Initialisation seed (grid-independent values).
    dtype : torch.dtype
    device : torch.device or str, optional
    out_cuts : sequence of int, optional
        The output features' cuts over the ranks of ``axis`` (``P + 1`` ints from 0 to
        ``out_features``, e.g. whole attention heads); default balanced.

    Raises
    ------
    TypeError
        If ``grid`` is not a ProcessGrid.
    ValueError
        On non-positive feature counts, a bad ``axis`` or bad ``out_cuts``.
    """

    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None

    def __init__(
        self, in_features: int, out_features: int, grid: ProcessGrid, *, axis: int = 0, bias: bool = True,
        gather_output: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = None,
        out_cuts: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.grid = check_grid(grid)
        in_features, out_features = _check_features(in_features, out_features)
        self.axis = _check_axis(grid, axis)
        self.in_features, self.out_features, self.gather_output = in_features, out_features, bool(gather_output)
        self.out_cuts = feature_cuts(out_features, grid.dims[axis], out_cuts, "out_cuts")
        wl = Layout((out_features, in_features), grid.dims, _split(2, 0, axis), (self.out_cuts, None))
        bl = Layout((out_features,), grid.dims, _split(1, 0, axis), (self.out_cuts,)) if bias else None
        _init_parameters(self, grid, wl, bl, seed, dtype, device)
        _mark_complete(self, (self.axis,))
        self._agreed = ArgumentAgreement()

    def local_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Local. ``x W_local^T + b_local`` on the whole input, inside a tensor-parallel region.

        The caller entered the region (:func:`hpctp.nn.transformer.sequence_parallel.enter_parallel_region`),
        so the input gradient is summed over ``axis`` there.
        """
        return _linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Collective over grid. Ranks along ``axis`` only; ``[..., in] -> [..., out_local]`` (or ``[..., out]``).

        Parameters
        ----------
        x : torch.Tensor
            Full input, identical on the ranks along ``axis``.

        Returns
        -------
        torch.Tensor

        Raises
        ------
        TypeError, ValueError
            On a wrong input type, dtype or feature size, on every rank of ``axis``
            (before the layer's messages).
        """
        comm = self.grid.sub(self.axis)
        error = _check_input(x, self.weight, self.in_features, "ColumnParallelLinear")
        self._agreed.check(comm, "ColumnParallelLinear", _signature(x, error, whole=True), error)
        y = self.local_forward(CopyToAxis.apply(x, comm))
        return _GatherLast.apply(y, comm, self.out_cuts) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, grid={self.grid.dims}, "
                f"axis={self.axis}, bias={self.bias is not None}, gather_output={self.gather_output}")  # fmt: skip


class RowParallelLinear(_BlockLinear):
    """Local. ``y = x W^T + b`` with the input features split over one grid axis.

    Layouts: ``weight`` is the block ``[out, in_local]`` of ``W`` split ``(None, axis)``;
    ``bias`` ``[out]`` is replicated (no ``hpctp_layout``). ``forward(x)`` takes
    ``[..., in_local]`` (the block of the last dim, e.g. a :class:`ColumnParallelLinear`
    output) or, with ``input_is_parallel=False``, the full ``[..., in]``; it returns the
    full ``[..., out]``, identical on every rank of ``axis``: the partial products are
    all-reduced (backward: identity, the adjoint of the sum).

    Parameters
    ----------
    in_features, out_features : int
    grid : ProcessGrid
    axis : int
        Grid axis splitting the input features.
    bias : bool
    input_is_parallel : bool
        The input is already this rank's block of features (else the layer slices it and
        all-gathers its gradient).
    seed : int
    dtype : torch.dtype
    device : torch.device or str, optional
    in_cuts : sequence of int, optional
        The input features' cuts over the ranks of ``axis`` (``P + 1`` ints from 0 to
        ``in_features``, e.g. whole attention heads); default balanced.

    Raises
    ------
    TypeError
        If ``grid`` is not a ProcessGrid.
    ValueError
        On non-positive feature counts, a bad ``axis`` or bad ``in_cuts``.
    """

    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None

    def __init__(
        self, in_features: int, out_features: int, grid: ProcessGrid, *, axis: int = 0, bias: bool = True,
        input_is_parallel: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = None,
        in_cuts: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.grid = check_grid(grid)
        in_features, out_features = _check_features(in_features, out_features)
        self.axis = _check_axis(grid, axis)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = bool(input_is_parallel)
        self.in_cuts = feature_cuts(in_features, grid.dims[axis], in_cuts, "in_cuts")
        wl = Layout((out_features, in_features), grid.dims, _split(2, 1, axis), (None, self.in_cuts))
        bl = Layout((out_features,), grid.dims, (None,)) if bias else None  # replicated
        _init_parameters(self, grid, wl, bl, seed, dtype, device)
        _mark_complete(self, (self.axis,))
        self._agreed = ArgumentAgreement()

    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Local. This rank's partial product ``x_local W_local^T`` (no bias), inside a tensor-parallel region.

        The caller sums it over ``axis`` when leaving the region
        (:func:`hpctp.nn.transformer.sequence_parallel.leave_parallel_region`) and adds ``bias``.
        """
        return _linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Collective over grid. Ranks along ``axis`` only; ``[..., in_local] -> [..., out]``.

        Parameters
        ----------
        x : torch.Tensor
            This rank's block of the input features (or the full input, see ``input_is_parallel``).

        Returns
        -------
        torch.Tensor
            The full output, identical on the ranks along ``axis``.

        Raises
        ------
        TypeError, ValueError
            On a wrong input type, dtype or feature size, on every rank of ``axis``.
        """
        comm = self.grid.sub(self.axis)
        local_in = self.weight.shape[1] if self.input_is_parallel else self.in_features
        error = _check_input(x, self.weight, local_in, "RowParallelLinear")
        self._agreed.check(comm, "RowParallelLinear", _signature(x, error, whole=not self.input_is_parallel), error)
        if not self.input_is_parallel:
            x = _SliceLast.apply(x, comm, self.in_cuts)
        y = SumOverAxis.apply(self.partial_forward(x), comm)
        return y + self.bias.to(y.dtype) if self.bias is not None else y  # (autocast: y's dtype, as torch)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, grid={self.grid.dims}, "
                f"axis={self.axis}, bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}")  # fmt: skip


# ---------------------------------------------------------------------------- 2-D (SUMMA)
class _Summa2DLinear(torch.autograd.Function):
    """``Y = X W^T + b`` by SUMMA; backward ``dX = dY W``, ``dW = dY^T X``, ``db = sum_rows dY``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        grid: ProcessGrid, x_layout: Layout, w_layout: Layout, panel: int | None,
    ) -> torch.Tensor:  # fmt: skip
        y, y_layout = summa_block(x.detach(), weight.detach(), grid, x_layout, w_layout, transpose_b=True, panel=panel)
        if bias is not None:
            y.add_(bias.detach())
        ctx.save_for_backward(x, weight)
        ctx.meta = (grid, x_layout, w_layout, y_layout, panel, bias is not None)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        grid, x_layout, w_layout, y_layout, panel, has_bias = ctx.meta
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx, _ = summa_block(dy, weight.detach(), grid, y_layout, w_layout, panel=panel)
        if ctx.needs_input_grad[1]:
            dw, lay = summa_block(dy, x.detach(), grid, y_layout, x_layout, transpose_a=True, panel=panel)
            if lay != w_layout:  # cannot happen: stationary-B gives W's own balanced layout
                raise RuntimeError(f"Linear2D: weight gradient came out in {lay}, expected {w_layout}")
        if has_bias and ctx.needs_input_grad[2]:
            db = C.allreduce(grid.sub(0), dy.sum(0).contiguous())
        return dx, dw, db, None, None, None, None


class Linear2D(_BlockLinear):
    """Local. ``Y = X W^T + b`` with ``X``, ``W`` and ``Y`` all cut over a 2-D grid (SUMMA), for huge layers.

    Layouts on grid ``(pr, pc)``: ``weight`` is the block ``[out_i, in_j]`` of ``W`` split
    ``(0, 1)``; ``bias`` the block ``[out_j]`` of ``b`` split ``(1,)`` (replicated along
    grid axis 0). ``forward(x)`` takes the block ``[batch_i, in_j]`` of ``X`` (``[batch,
    in]`` split ``(0, 1)``: any batch rows per grid row, equal along it; ``in_j`` the
    balanced block over axis 1) and returns the block ``[batch_i, out_j]`` of ``Y``
    (split ``(0, 1)``, same batch rows, ``out_j`` balanced over axis 1). No rank ever
    holds a whole weight, input or output.

    Forward is SUMMA ``X @ W.T`` (stationary X: broadcast W panels down grid columns,
    reduce partial Y columns along grid rows); backward ``dX = dY @ W`` (stationary dX)
    and ``dW = dY.T @ X`` (stationary X: broadcast dY panels, reduce dW rows), and the
    bias gradient is summed over grid axis 0.

    Parameters
    ----------
    in_features, out_features : int
    grid : ProcessGrid
        A 2-D grid.
    bias : bool
    panel : int, optional
        SUMMA panel width (default from the block sizes).
    seed : int
    dtype : torch.dtype
    device : torch.device or str, optional

    Raises
    ------
    TypeError
        If ``grid`` is not a ProcessGrid or ``panel`` not an int.
    ValueError
        If the grid is not 2-D, feature counts are not positive or ``panel < 1``.
    """

    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None

    def __init__(
        self, in_features: int, out_features: int, grid: ProcessGrid, *, bias: bool = True,
        panel: int | None = None, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.grid = check_grid(grid)
        if grid.ndim != 2:
            raise ValueError(f"Linear2D needs a 2-D grid, got dims {grid.dims}")
        in_features, out_features = _check_features(in_features, out_features)
        self.in_features, self.out_features = in_features, out_features
        self.panel = check_panel(panel)
        self.w_layout = Layout((out_features, in_features), grid.dims, (0, 1))
        bl = Layout((out_features,), grid.dims, (1,)) if bias else None
        _init_parameters(self, grid, self.w_layout, bl, seed, dtype, device)
        _mark_complete(self, (0, 1))

    def _x_layout(self, rows: int) -> Layout:
        """A layout of X that is exact at this rank's grid row (others are never consulted: the
        batch index is always an aligned, stationary index of the three SUMMA products)."""
        pr = self.grid.dims[0]
        return Layout(
            (rows * pr, self.in_features), self.grid.dims, (0, 1), (tuple(i * rows for i in range(pr + 1)), None)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Collective over grid. ``[batch_i, in_j] -> [batch_i, out_j]`` blocks.

        Parameters
        ----------
        x : torch.Tensor
            This rank's block of ``X`` (2-D); ranks of a grid row must pass the same number of rows.

        Returns
        -------
        torch.Tensor
            This rank's block of ``Y``.

        Raises
        ------
        TypeError, ValueError
            On a wrong input type, dtype or block shape, on every rank.
        """
        in_j = self.weight.shape[1]
        err = _check_input(x, self.weight, in_j, "Linear2D")
        if err is None and x.ndim != 2:
            err = ValueError(f"Linear2D: input must be a 2-D block [batch_i, in_j], got shape {tuple(x.shape)}")
        rows = C.allgather_ints(self.grid.sub(1), [x.shape[0] if err is None else -1])[:, 0]
        if err is None and (rows != rows[0]).any():
            err = ValueError(
                f"Linear2D: the ranks of grid row {self.grid.coords[0]} pass {rows.tolist()} batch rows; "
                f"every rank of a grid row must pass the same rows of X"
            )
        C.raise_if_any(self.grid.comm, err)
        lay = self._x_layout(x.shape[0])
        w: torch.Tensor = self.weight
        b: torch.Tensor | None = self.bias
        dt = autocast_dtype(x)
        if dt is not None:  # autocast: the products in its dtype, as torch's linear (reductions in float32)
            x, w, b = x.to(dt), w.to(dt), None if b is None else b.to(dt)
        return _Summa2DLinear.apply(x.contiguous(), w, b, self.grid, lay, self.w_layout, self.panel)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, grid={self.grid.dims}, "
                f"bias={self.bias is not None}, panel={self.panel}")  # fmt: skip


def Linear(
    in_features: int, out_features: int, grid: ProcessGrid, mode: str = "column", **kwargs: Any
) -> torch.nn.Module:
    """Local. A tensor-parallel linear layer: ``mode`` picks the class.

    Parameters
    ----------
    in_features, out_features : int
    grid : ProcessGrid
    mode : {"column", "row", "2d"}
        :class:`ColumnParallelLinear`, :class:`RowParallelLinear` or :class:`Linear2D`.
    **kwargs
        Passed to the class (``axis``, ``bias``, ``seed``, ``dtype``, ...).

    Returns
    -------
    torch.nn.Module

    Raises
    ------
    ValueError
        On an unknown ``mode`` (and as the chosen class raises).
    """
    classes = {"column": ColumnParallelLinear, "row": RowParallelLinear, "2d": Linear2D}
    if mode not in classes:
        raise ValueError(f"mode must be one of {sorted(classes)}, got {mode!r}")
    return classes[mode](in_features, out_features, grid, **kwargs)
