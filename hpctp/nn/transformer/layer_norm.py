"""Layer normalisation over features that may be split over a grid axis: :class:`LayerNorm`, :class:`RMSNorm`.

When the normalised dims are whole on every rank the layers are ``torch.nn.LayerNorm`` /
``torch.nn.RMSNorm`` on the local block. When the last normalised dim (the hidden dim of a
tensor-parallel model) is split over grid ``axis``, each rank holds ``[..., *normalized_local]``
and the statistics of every row combine the ranks' parts:

* LayerNorm: each rank's count, mean and sum of squared deviations per row, one
  ``Allgatherv`` over the axis, merged with Chan's formula in rank order (stable, and the
  same bits on every rank);
* RMSNorm: each rank's sum of squares per row, one ``Allreduce``.

Backward is exact: one ``Allreduce`` over the axis of two (LayerNorm) or one (RMSNorm)
numbers per row. The affine parameters are split like the features (``hpctp_layout``);
their gradients are complete over ``axis`` and partial over the ranks holding other rows
(data parallelism, tokens split): :func:`hpctp.nn.sync_gradients` sums those.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ... import comm as C
from ..._util.ints import is_int
from ...comm import ProcessGrid, check_grid
from ...layout import Layout
from .agreement import ArgumentAgreement
from .linear import feature_cuts

__all__ = ["LayerNorm", "RMSNorm"]

Comm = Any


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _normalized_shape(shape: object) -> tuple[int, ...]:
    dims = (shape,) if is_int(shape) else shape
    try:
        out: tuple[Any, ...] = tuple(dims)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got {shape!r}") from None
    if not out or not all(is_int(n) and n >= 1 for n in out):
        raise ValueError(f"normalized_shape must be positive ints (at least one), got {shape!r}")
    return tuple(int(n) for n in out)


def _row_sums(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.sum(tuple(range(x.ndim - k, x.ndim))) if x.numel() else x.new_zeros(x.shape[: x.ndim - k])


class _SplitLayerNorm(torch.autograd.Function):
    """xhat = (x - mean) / sqrt(var + eps), statistics over the last ``k`` dims of the global rows."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, k: int, counts: tuple[int, ...], comm: Comm, eps: float
    ) -> torch.Tensor:
        sd = _stats_dtype(x.dtype)
        xs = x.detach().to(sd)
        rank = comm.Get_rank()
        n = counts[rank]
        lead = tuple(x.shape[: x.ndim - k])
        rows = math.prod(lead)
        mine = torch.zeros(2, rows, dtype=sd, device=x.device)
        if n:
            mean_i = _row_sums(xs, k) / n
            mine[0] = mean_i.reshape(-1)
            mine[1] = _row_sums((xs - mean_i.reshape(lead + (1,) * k)) ** 2, k).reshape(-1)
        table = torch.empty(len(counts), 2, rows, dtype=sd, device=x.device)
        C.allgatherv(comm, mine.reshape(-1), table.reshape(-1), [2 * rows] * len(counts))
        total = sum(counts)
        w = torch.tensor(counts, dtype=sd, device=x.device).reshape(-1, 1)
        mean = (w * table[:, 0]).sum(0) / total
        m2 = (table[:, 1] + w * (table[:, 0] - mean) ** 2).sum(0)
        shape = lead + (1,) * k
        mean, invstd = mean.reshape(shape), torch.rsqrt(m2.reshape(shape) / total + eps)
        xhat = (xs - mean) * invstd
        ctx.save_for_backward(xhat, invstd)
        ctx.meta = (k, total, comm)
        return xhat.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        xhat, invstd = ctx.saved_tensors
        k, total, comm = ctx.meta
        gs = g.to(xhat.dtype)
        sums = torch.stack([_row_sums(gs, k), _row_sums(gs * xhat, k)]).contiguous()
        C.allreduce(comm, sums)
        shape = invstd.shape
        mean_g, mean_gx = (sums[0] / total).reshape(shape), (sums[1] / total).reshape(shape)
        return (invstd * (gs - mean_g - xhat * mean_gx)).to(g.dtype), None, None, None, None


class _SplitRMSNorm(torch.autograd.Function):
    """xhat = x / sqrt(mean(x^2) + eps), the mean over the last ``k`` dims of the global rows."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, k: int, total: int, comm: Comm, eps: float
    ) -> torch.Tensor:
        xs = x.detach().to(_stats_dtype(x.dtype))
        lead = tuple(x.shape[: x.ndim - k])
        ss = _row_sums(xs * xs, k).contiguous()
        C.allreduce(comm, ss)
        inv = torch.rsqrt(ss.reshape(lead + (1,) * k) / total + eps)
        xhat = xs * inv
        ctx.save_for_backward(xhat, inv)
        ctx.meta = (k, total, comm)
        return xhat.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        xhat, inv = ctx.saved_tensors
        k, total, comm = ctx.meta
        gs = g.to(xhat.dtype)
        s = _row_sums(gs * xhat, k).contiguous()
        C.allreduce(comm, s)
        return (inv * (gs - xhat * (s.reshape(inv.shape) / total))).to(g.dtype), None, None, None, None


class _FeatureNorm(torch.nn.Module):
    """Local. What :class:`LayerNorm` and :class:`RMSNorm` share: shapes, the split, parameters, checks."""

    weight: torch.nn.Parameter | None
    bias: torch.nn.Parameter | None
    _what = "LayerNorm"

    def __init__(
        self, normalized_shape: int | Sequence[int], grid: ProcessGrid, axis: int | None, eps: float | None,
        affine: bool, bias: bool, cuts: Sequence[int] | None, dtype: torch.dtype | None, device: Any,
    ) -> None:  # fmt: skip
        super().__init__()
        self.grid = check_grid(grid)
        self.normalized_shape = _normalized_shape(normalized_shape)
        if axis is not None and (not is_int(axis) or not 0 <= axis < grid.ndim):
            raise ValueError(f"axis={axis!r} must be None or an axis of the {grid.ndim}-D grid {grid.dims}")
        if eps is not None and (not isinstance(eps, (int, float)) or not eps >= 0):
            raise ValueError(f"eps must be a non-negative number, got {eps!r}")
        self.axis = None if axis is None else int(axis)
        self.eps = eps
        self.elementwise_affine = bool(affine)
        k = len(self.normalized_shape)
        if self.axis is None:
            if cuts is not None:
                raise ValueError("cuts needs axis: they cut the last normalised dim over that grid axis")
            self.cuts: tuple[int, ...] | None = None
            layout = Layout(self.normalized_shape, grid.dims, (None,) * k)
            self._counts: tuple[int, ...] = (math.prod(self.normalized_shape),)
        else:
            self.cuts = feature_cuts(self.normalized_shape[-1], grid.dims[self.axis], cuts, "cuts")
            split = (None,) * (k - 1) + (self.axis,)
            layout = Layout(self.normalized_shape, grid.dims, split, (None,) * (k - 1) + (self.cuts,))
            rest = math.prod(self.normalized_shape[:-1])
            self._counts = tuple(rest * (b - a) for a, b in zip(self.cuts, self.cuts[1:]))
        self.local_shape = layout.local_shape(grid.coords)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if self.elementwise_affine:
            self.weight = self._param(torch.ones(self.local_shape, dtype=dtype, device=device), layout)
            if bias:
                self.bias = self._param(torch.zeros(self.local_shape, dtype=dtype, device=device), layout)
        self._agreed = ArgumentAgreement()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Collective over the ranks of ``axis`` (local when ``axis`` is None). Normalise the rows of ``x``.

        Parameters
        ----------
        x : torch.Tensor
            ``[..., *normalized_shape]``, the last dim this rank's block when split.

        Returns
        -------
        torch.Tensor
            Same shape as ``x``.

        Raises
        ------
        TypeError, ValueError
            On a wrong input (on every rank of the axis, the first time a shape is seen).
        """
        return self._normalize(x, self._checked_comm(x))

    def _normalize(self, x: torch.Tensor, comm: Any) -> torch.Tensor:
        """The norm of the rows of ``x`` (``comm``: the axis splitting the last dim, or None)."""
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Local. Weight one, bias zero (the values of construction)."""
        with torch.no_grad():
            if self.weight is not None:
                self.weight.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def _param(self, data: torch.Tensor, layout: Layout) -> torch.nn.Parameter:
        p = torch.nn.Parameter(data)
        if self.axis is not None:
            p.hpctp_layout = layout  # type: ignore[attr-defined]
        return p

    def _check(self, x: object) -> tuple[Exception | None, tuple[Any, ...]]:
        k = len(self.normalized_shape)
        if not isinstance(x, torch.Tensor):
            return TypeError(f"{self._what}: input must be a torch.Tensor, got {type(x).__name__}"), ()
        if x.ndim < k or tuple(x.shape[x.ndim - k :]) != self.local_shape:
            where = "" if self.axis is None else f" (this rank's block of {self.normalized_shape})"
            return ValueError(
                f"{self._what}: input's last dims must be {self.local_shape}{where}, got shape {tuple(x.shape)}"
            ), ()
        if not x.is_floating_point():
            return TypeError(f"{self._what}: input must be floating point, got {x.dtype}"), ()
        return None, (tuple(x.shape[: x.ndim - k]), str(x.dtype), x.device.type)

    def _affine(self, xhat: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            xhat = xhat * self.weight
        if self.bias is not None:
            xhat = xhat + self.bias
        return xhat

    def _checked_comm(self, x: torch.Tensor) -> Comm | None:
        """The axis' communicator (None when not split), once the input is valid on every rank of it."""
        error, signature = self._check(x)
        if self.axis is None:
            if error is not None:
                raise error
            return None
        comm = self.grid.sub(self.axis)
        self._agreed.check(comm, self._what, ("invalid",) if error is not None else signature, error)
        return comm

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"grid={self.grid.dims}, axis={self.axis}"
        )


class LayerNorm(_FeatureNorm):
    """Local. ``torch.nn.LayerNorm`` whose last normalised dim may be split over a grid axis.

    ``axis=None``: the normalised dims are whole on every rank; the layer is
    ``torch.nn.LayerNorm`` on the local block (rows may be split any way: the statistics are
    per row). With ``axis``, every rank passes ``[..., *normalized_shape[:-1], n_local]``,
    its block of the last dim (balanced cuts, or ``cuts``), the same leading dims as the
    other ranks of the axis; mean and variance reduce over the axis (see the module
    docstring), and ``forward`` is collective over the ranks of ``axis``.

    Parameters
    ----------
    normalized_shape : int or sequence of int
        As for ``torch.nn.LayerNorm``: the trailing dims normalised together.
    grid : ProcessGrid
    axis : int, optional
        Grid axis splitting the last normalised dim; None: not split.
    eps : float
    elementwise_affine : bool
        Learnable ``weight`` (ones) and ``bias`` (zeros), split like the features.
    bias : bool
        Whether the affine part has a bias (as torch's ``bias`` argument).
    seed : int
        Accepted for a uniform signature across hpctp.nn; the initial values (ones and
        zeros) do not depend on it.
    cuts : sequence of int, optional
        Cuts of the last normalised dim over ``axis`` (default balanced).
    dtype : torch.dtype, optional
    device : torch.device or str, optional

    Raises
    ------
    TypeError
        If ``grid`` is not a ProcessGrid or ``normalized_shape`` not ints.
    ValueError
        On a bad ``axis``, ``eps``, ``cuts`` or ``normalized_shape``.
    """

    _what = "LayerNorm"

    def __init__(
        self, normalized_shape: int | Sequence[int], grid: ProcessGrid, *, axis: int | None = None,
        eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True, seed: int = 0,
        cuts: Sequence[int] | None = None, dtype: torch.dtype | None = None, device: Any = None,
    ) -> None:  # fmt: skip
        if eps is None:
            raise ValueError("LayerNorm: eps must be a non-negative number, got None")
        super().__init__(normalized_shape, grid, axis, eps, elementwise_affine, bias, cuts, dtype, device)

    def _normalize(self, x: torch.Tensor, comm: Any) -> torch.Tensor:
        eps = float(self.eps)  # type: ignore[arg-type]
        if comm is None:
            return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, eps)
        return self._affine(_SplitLayerNorm.apply(x, len(self.normalized_shape), self._counts, comm, eps))


class RMSNorm(_FeatureNorm):
    """Local. ``torch.nn.RMSNorm`` whose last normalised dim may be split over a grid axis.

    ``y = x / sqrt(mean(x^2) + eps) * weight``, the mean over the normalised dims of each row;
    with ``axis`` the sums of squares are all-reduced over the axis. See :class:`LayerNorm`
    for the layouts.

    Parameters
    ----------
    normalized_shape : int or sequence of int
    grid : ProcessGrid
    axis : int, optional
        Grid axis splitting the last normalised dim; None: not split.
    eps : float, optional
        Default (None): ``torch.finfo(x.dtype).eps``, as torch.
    elementwise_affine : bool
        Learnable ``weight`` (ones), split like the features.
    seed : int
        Accepted for a uniform signature; the initial weight (ones) does not depend on it.
    cuts : sequence of int, optional
    dtype : torch.dtype, optional
    device : torch.device or str, optional

    Raises
    ------
    TypeError, ValueError
        As :class:`LayerNorm`.
    """

    _what = "RMSNorm"

    def __init__(
        self, normalized_shape: int | Sequence[int], grid: ProcessGrid, *, axis: int | None = None,
        eps: float | None = None, elementwise_affine: bool = True, seed: int = 0,
        cuts: Sequence[int] | None = None, dtype: torch.dtype | None = None, device: Any = None,
    ) -> None:  # fmt: skip
        super().__init__(normalized_shape, grid, axis, eps, elementwise_affine, False, cuts, dtype, device)

    def _normalize(self, x: torch.Tensor, comm: Any) -> torch.Tensor:
        k = len(self.normalized_shape)
        eps = torch.finfo(x.dtype).eps if self.eps is None else float(self.eps)
        if comm is None:
            dims = tuple(range(x.ndim - k, x.ndim))
            return self._affine(x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps))
        return self._affine(_SplitRMSNorm.apply(x, k, sum(self._counts), comm, eps))
