"""Normalisation layers whose statistics cover the whole spatially partitioned field.

Every rank holds a block ``[N, C, *local_spatial]`` of a field ``[N, C, *spatial]`` whose
spatial dims are split over grid axes (``split``). Batch statistics are those of the
*global* field: each rank computes its block's count, mean and (biased) variance with
torch, one ``Allgatherv`` per reduction communicator collects them, and every rank
combines them with Chan's parallel formula in float64 (numerically stable, identical on
every rank). The backward pass needs one ``Allreduce`` of ``2 * stats`` numbers, so
input gradients are exact. Affine parameters are replicated: their gradients are the
rank's partial sums; :func:`hpctp.nn.sync_gradients` adds them up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ... import comm as C
from ..._util.backend import shape_only
from ...comm import ProcessGrid
from ...ops.autograd import Comms, check_grid, comms_for_axes, reduce_sum_
from ._inputs import field_axes, field_input, split_items

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "GroupNorm",
    "global_moments",
    "normalize",
    "field_axes",
]


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _combine(table: torch.Tensor, s: int) -> torch.Tensor:
    """Chan et al.: merge rows ``[count, mean(s), var(s)]`` into one such row (float64)."""
    n = table[:, 0:1]
    mean_i, var_i = table[:, 1 : 1 + s], table[:, 1 + s :]
    total = n.sum()
    mean = (n * mean_i).sum(0) / total.clamp_min(1)
    var = (n * (var_i + (mean_i - mean) ** 2)).sum(0) / total.clamp_min(1)
    return torch.cat([total.reshape(1), mean, var])


def _gather_combine(row: torch.Tensor, comms: Comms) -> torch.Tensor:
    s = (row.numel() - 1) // 2
    for c in comms:
        p = c.Get_size()
        table = torch.empty(p * row.numel(), dtype=row.dtype, device=row.device)
        C.allgatherv(c, row, table, [row.numel()] * p)
        row = _combine(table.view(p, row.numel()), s)
    return row


def global_moments(
    x: torch.Tensor, dims: tuple[int, ...], comms: Comms, count: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Collective over grid. Mean and biased variance of ``x`` over ``dims`` of the global field.

    Parameters
    ----------
    x : torch.Tensor
        Local block.
    dims : tuple of int
        Dims to reduce (the split dims among them are reduced over the ranks of ``comms``).
    comms : tuple of communicators
        See :func:`hpctp.ops.autograd.comms_for_axes`.
    count : int, optional
        The global number of reduced elements per statistic as the field's layout gives it. Used on
        ``meta`` blocks only (a virtual grid's dry run, whose gathered counts hold no values); without it
        every rank there counts as many elements as this one.

    Returns
    -------
    (mean, var, count)
        ``mean``/``var`` with ``keepdim`` shape, dtype promoted to at least float32, no
        autograd history; ``count`` the global number of reduced elements per statistic.
    """
    with torch.no_grad():
        keep = [1 if d in dims else n for d, n in enumerate(x.shape)]
        s = math.prod(keep)
        n_local = math.prod(x.shape[d] for d in dims)
        row = torch.zeros(1 + 2 * s, dtype=torch.float64, device=x.device)
        if n_local > 0 and s > 0:
            var, mean = torch.var_mean(x.to(_stats_dtype(x.dtype)), dim=dims, correction=0)
            row[0] = n_local
            row[1 : 1 + s] = mean.reshape(-1)
            row[1 + s :] = var.reshape(-1)
        row = _gather_combine(row, comms)
        dt = _stats_dtype(x.dtype)
        mean = row[1 : 1 + s].to(dt).reshape(keep)
        var = row[1 + s :].to(dt).reshape(keep)
        if shape_only(row):  # (a virtual grid's dry run: the count from the layout, or this rank's)
            return mean, var, count if count is not None else n_local * math.prod(c.Get_size() for c in comms)
        return mean, var, int(round(float(row[0])))


class _Normalize(torch.autograd.Function):
    """xhat = (x - mean) * invstd with global statistics; exact distributed backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        count: int,
        dims: tuple[int, ...],
        comms: Comms,
    ) -> torch.Tensor:
        """Collective over grid. Autograd forward pass (see the class docstring)."""
        xhat = ((x - mean) * invstd).to(x.dtype)
        ctx.save_for_backward(xhat, invstd)
        ctx.count, ctx.dims, ctx.comms = count, dims, comms
        return xhat

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        xhat, invstd = ctx.saved_tensors
        dims = ctx.dims
        gs = g.to(invstd.dtype)
        xs = xhat.to(invstd.dtype)
        shape = invstd.shape
        if g.numel():
            sums = torch.cat([gs.sum(dims).reshape(-1), (gs * xs).sum(dims).reshape(-1)])
        else:
            sums = torch.zeros(2 * invstd.numel(), dtype=invstd.dtype, device=g.device)
        sums = reduce_sum_(sums.contiguous(), ctx.comms) / ctx.count
        s = invstd.numel()
        mean_g, mean_gx = sums[:s].reshape(shape), sums[s:].reshape(shape)
        dx = (invstd * (gs - mean_g - xs * mean_gx)).to(g.dtype)
        return dx, None, None, None, None, None


def normalize(
    x: torch.Tensor, dims: tuple[int, ...], comms: Comms, eps: float, count: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Collective over grid. ``(x - mean) / sqrt(var + eps)`` with global statistics over ``dims``.

    The reductions run over ``comms`` (see :func:`hpctp.ops.autograd.comms_for_axes`); ``count`` as for
    :func:`global_moments`.

    Returns
    -------
    (xhat, mean, var, count)
        ``xhat`` differentiable w.r.t. ``x``; biased ``var``; global ``count``.

    Raises
    ------
    ValueError
        If the global field has no element to reduce (same on every rank).
    """
    mean, var, count = global_moments(x, dims, comms, count)
    if count == 0:
        raise ValueError("cannot normalise an empty field: the global reduction has no element")
    invstd = torch.rsqrt(var + eps)
    return _Normalize.apply(x, mean, invstd, count, dims, comms), mean, var, count


def _channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.reshape((1, -1) + (1,) * (ndim - 2))


class _DistBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Local. Base of the distributed batch norms (see :class:`BatchNorm2d`)."""

    _spatial = 2

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        grid: ProcessGrid,
        split: Sequence[int | None] | None = None,
    ) -> None:
        check_grid(grid)
        self.split, self.axes = field_axes(grid, split, self._spatial)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.grid = grid
        self._comms = comms_for_axes(grid, self.axes)

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() != 2 + self._spatial:
            raise ValueError(f"expected a {2 + self._spatial}-D block [N, C, *spatial], got {x.dim()}-D")
        if x.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels, got a block of shape {tuple(x.shape)}")

    def forward(self, x: Any) -> Any:
        """Collective over grid. Normalise the local block (local in eval mode with running stats).

        Parameters
        ----------
        x : torch.Tensor or DistTensor
            Local block ``[N, C, *local_spatial]`` (or a DistTensor with a torch block).

        Returns
        -------
        torch.Tensor or DistTensor
            Output block, same shape (and layout) as the input.

        Raises
        ------
        ValueError
            On a wrong number of dims or channels, or (training) a global field with one
            value per channel.
        """
        use_batch = self.training or self.running_mean is None
        # statistics need every rank: a bad block on one rank raises everywhere; eval with running
        # statistics is purely local
        field = field_input(x, self.grid, self.split, self._spatial, check=self._check_input_dim, collective=use_batch)
        x = field.block
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is not None:
                factor = self.momentum
            elif shape_only(self.num_batches_tracked):  # (no values on meta: the factor scales running stats of none)
                factor = 1.0
            else:
                factor = 1.0 / float(self.num_batches_tracked)
        if not use_batch:
            return field.wrap(
                torch.nn.functional.batch_norm(
                    x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
                )
            )
        dims = (0,) + tuple(range(2, x.dim()))
        whole = field.global_layout.global_shape  # (the global count on meta blocks, where no count travels)
        mean, var, count = global_moments(x, dims, self._comms, math.prod(whole[d] for d in dims))
        if self.training and count <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got a global field of "
                f"{count} value(s) per channel"
            )
        rm, rv = self.running_mean, self.running_var
        if self.training and rm is not None and rv is not None:
            with torch.no_grad():
                unbiased = var.reshape(-1) * (count / max(count - 1, 1))
                rm.mul_(1 - factor).add_(mean.reshape(-1).to(rm.dtype), alpha=factor)
                rv.mul_(1 - factor).add_(unbiased.to(rv.dtype), alpha=factor)
        xhat = _Normalize.apply(x, mean, torch.rsqrt(var + self.eps), count, dims, self._comms)
        if self.weight is not None:  # in x's dtype, as torch (bf16 input, float32 parameters: bf16)
            xhat = (xhat * _channel_view(self.weight, x.dim()) + _channel_view(self.bias, x.dim())).to(x.dtype)
        return field.wrap(xhat)

    def extra_repr(self) -> str:
        """Local. Extra text for ``repr``."""
        return super().extra_repr() + f", grid={self.grid.dims}, split={self.split}"


class BatchNorm1d(_DistBatchNorm):
    """Collective over grid. :class:`torch.nn.BatchNorm1d` over a partitioned ``[N, C, L]`` field.

    Parameters
    ----------
    num_features, eps, momentum, affine, track_running_stats, device, dtype
        As for :class:`torch.nn.BatchNorm1d`.
    grid : ProcessGrid
    split : sequence of (int or None), optional
        Grid axis of the length dim (default ``(0,)``).

    Notes
    -----
    See :class:`BatchNorm2d`.
    """

    _spatial = 1


class BatchNorm2d(_DistBatchNorm):
    """Collective over grid. :class:`torch.nn.BatchNorm2d` with statistics of the global field.

    In training mode (and whenever ``track_running_stats=False``) the mean and variance
    per channel are those over ``N`` and the whole distributed ``H x W`` field, so the
    output blocks tile exactly what ``torch.nn.BatchNorm2d`` gives on the gathered field;
    one ``Allgatherv`` (forward) and one ``Allreduce`` (backward) per reduction
    communicator. Running statistics are updated exactly as torch does (unbiased global
    variance; ``momentum=None`` gives the cumulative average) and are identical on every
    rank. In eval mode the running statistics are used: purely local, no communication.

    Parameters
    ----------
    num_features, eps, momentum, affine, track_running_stats, device, dtype
        As for :class:`torch.nn.BatchNorm2d`.
    grid : ProcessGrid
    split : sequence of (int or None), optional
        Grid axis of each spatial dim, e.g. ``(0, 1)`` (None entry: a whole dim), or of
        each block dim ``(None, None, 0, 1)``; default: spatial dim ``i`` over grid axis
        ``i``. Ranks along grid axes used by no spatial dim must hold replicas of the
        same block (they are not double counted).

    Raises
    ------
    ValueError, TypeError
        On an invalid ``grid`` or ``split`` (the same on every rank).

    Notes
    -----
    ``weight`` and ``bias`` are replicated (no ``hpctp_layout``): after ``backward()``
    each rank holds the partial gradient of its block; call
    :func:`hpctp.nn.sync_gradients` before the optimiser step. Double backward is not
    supported.
    """

    _spatial = 2


class BatchNorm3d(_DistBatchNorm):
    """Collective over grid. :class:`torch.nn.BatchNorm3d` with statistics of the global field.

    Parameters
    ----------
    num_features, eps, momentum, affine, track_running_stats, device, dtype
        As for :class:`torch.nn.BatchNorm3d`.
    grid : ProcessGrid
    split : sequence of (int or None), optional
        Grid axis of each of the three spatial dims (default ``(0, 1, 2)`` as far as the
        grid has axes).

    Notes
    -----
    See :class:`BatchNorm2d`.
    """

    _spatial = 3


class GroupNorm(torch.nn.GroupNorm):
    """Collective over grid. :class:`torch.nn.GroupNorm` whose groups span the global field.

    Each sample's channel groups are normalised with the mean and variance over the group's
    channels and the whole distributed spatial field (one ``Allgatherv`` forward, one
    ``Allreduce`` backward, each of ``O(N * num_groups)`` numbers). Same in train and eval.

    Parameters
    ----------
    num_groups, num_channels, eps, affine, device, dtype
        As for :class:`torch.nn.GroupNorm`.
    grid : ProcessGrid
    split : sequence of (int or None), optional
        Grid axis of each spatial dim (or of each block dim ``(None, None, *spatial)``);
        default: spatial dim ``i`` over grid axis ``i``. Any number of spatial dims.

    Raises
    ------
    ValueError, TypeError
        On invalid arguments (the same on every rank).

    Notes
    -----
    ``weight``/``bias`` are replicated: call :func:`hpctp.nn.sync_gradients` after backward.
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        grid: ProcessGrid,
        split: Sequence[int | None] | None = None,
    ) -> None:
        check_grid(grid)
        split = split_items(split)
        if split is not None:
            field_axes(grid, split, len(split))  # validate axes now; dims are known in forward
        super().__init__(num_groups, num_channels, eps, affine, device, dtype)
        self.grid = grid
        self.split = split

    def forward(self, x: Any) -> Any:
        """Collective over grid. Normalise the local block.

        Parameters
        ----------
        x : torch.Tensor or DistTensor
            Local block ``[N, C, *local_spatial]`` (or a DistTensor with a torch block).

        Returns
        -------
        torch.Tensor or DistTensor
            Output block, same shape (and layout) as the input.

        Raises
        ------
        ValueError
            On a wrong number of dims or channels, or a split that does not fit the block.
        """
        field = field_input(x, self.grid, self.split, None, check=self._check_block)
        x, axes = field.block, field.axes
        n, c = x.shape[0], x.shape[1]
        g = self.num_groups
        if n == 0:  # no sample, no group to normalise (torch returns the empty block)
            y = x * 1.0
        else:
            xv = x.reshape((n, g, c // g) + tuple(x.shape[2:]))
            dims = tuple(range(2, xv.dim()))
            whole = (c // g,) + tuple(field.global_layout.global_shape[2:])  # (the count on meta blocks)
            y, _, _, _ = normalize(xv, dims, comms_for_axes(self.grid, axes), self.eps, math.prod(whole))
            y = y.reshape(x.shape)
        if self.weight is not None:  # in x's dtype, as torch
            y = (y * _channel_view(self.weight, x.dim()) + _channel_view(self.bias, x.dim())).to(x.dtype)
        return field.wrap(y)

    def _check_block(self, x: torch.Tensor) -> None:
        if x.dim() < 3 or x.shape[1] != self.num_channels:
            raise ValueError(f"expected a block [N, {self.num_channels}, *spatial], got shape {tuple(x.shape)}")

    def extra_repr(self) -> str:
        """Local. Extra text for ``repr``."""
        return super().extra_repr() + f", grid={self.grid.dims}, split={self.split}"
