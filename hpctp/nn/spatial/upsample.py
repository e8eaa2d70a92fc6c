"""Upsampling of a spatially partitioned field by integer factors.

Output layout: with integer scale factors ``s`` the global output is cut at ``s`` times
the input cuts (:func:`upsampled_layout`), i.e. every rank's output block is exactly the
upsampled image of its input block. That block is ``s`` times the input block, so
``nearest`` needs no communication at all; ``linear``/``bilinear``/``trilinear`` need a
halo of one cell (:func:`hpctp.nn.functional.halo_pad`, replicate at the global edge).
This layout is in general *not* the balanced layout of the output shape (7 rows on 2
ranks are cut 4 + 3, so 14 output rows are cut 8 + 6 rather than 7 + 7); pass
``balanced=True`` to redistribute to the balanced layout (one ``Alltoallv``).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ...comm import ProcessGrid
from ...layout import Layout
from ...ops.autograd import Redistribute, check_grid
from ._inputs import field_axes, field_input, split_items
from .functional import halo_pad

__all__ = ["Upsample", "upsampled_layout"]

_LINEAR = {"linear": 1, "bilinear": 2, "trilinear": 3}
_MODES = ("nearest", "nearest-exact", *_LINEAR)


def _check_scales(scale_factor: object) -> tuple[int, ...] | int:
    items = tuple(scale_factor) if isinstance(scale_factor, (tuple, list)) else (scale_factor,)
    for s in items:
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or not float(s).is_integer() or float(s) < 1:
            raise ValueError(
                f"scale_factor={scale_factor!r}: only positive integer factors are supported (output "
                f"blocks are the upsampled input blocks)"
            )
    if isinstance(scale_factor, (tuple, list)):
        if not items:
            raise ValueError("scale_factor must not be empty")
        return tuple(int(float(s)) for s in items)  # type: ignore[arg-type]
    return int(float(items[0]))  # type: ignore[arg-type]


def _spatial_dims(split: object) -> set[int] | None:
    """Numbers of spatial dims a split spec can describe (None: any, decided by the input).

    A spec has one entry per spatial dim, or one per dim of ``[N, C, *spatial]`` when it
    starts with ``(None, None)``: ``(None, None, 0)`` is 3 spatial dims or 1.
    """
    items = split_items(split)
    if items is None:
        return None
    if len(items) > 2 and items[0] is None and items[1] is None:
        return {len(items), len(items) - 2}
    return {len(items)}


def upsampled_layout(layout: Layout, scale_factor: Sequence[int], balanced: bool = False) -> Layout:
    """Local. Layout of the upsampled field ``[N, C, *spatial]`` given the input's.

    Parameters
    ----------
    layout : Layout
        Layout of the input ``[N, C, *spatial]``.
    scale_factor : sequence of int
        Integer factor per spatial dim.
    balanced : bool
        False: cuts at ``scale * input cuts`` (what :class:`Upsample` produces without
        communication). True: the balanced layout of the output shape.

    Returns
    -------
    Layout

    Raises
    ------
    ValueError
        If the number of factors does not match the spatial dims.
    """
    scales = tuple(int(s) for s in scale_factor)
    nd = layout.ndim - 2
    if len(scales) != nd:
        raise ValueError(f"{len(scales)} scale factors for {nd} spatial dims")
    shape = layout.global_shape[:2] + tuple(n * s for n, s in zip(layout.global_shape[2:], scales, strict=True))
    if balanced:
        return Layout(shape, layout.grid_dims, layout.split)
    cuts = (None, None) + tuple(tuple(c * s for c in layout.dim_cuts[2 + k]) for k, s in enumerate(scales))
    return Layout(shape, layout.grid_dims, layout.split, cuts)


def _linear_weights(
    n: int, s: int, lo: int, hi: int, pad_lo: int, align_corners: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indices (into the padded block) and weights of output rows ``[s*lo, s*hi)`` along one dim."""
    m = n * s
    o = torch.arange(s * lo, s * hi, dtype=torch.float64, device=device)
    if align_corners:
        src = o * ((n - 1) / (m - 1)) if m > 1 else torch.zeros_like(o)
    else:
        src = ((o + 0.5) / s - 0.5).clamp_min(0.0)
    i0 = src.floor().clamp(max=n - 1)
    lam = src - i0
    i0 = i0.long()
    i1 = (i0 + 1).clamp(max=n - 1)
    shift = lo - pad_lo
    return i0 - shift, i1 - shift, lam


def _nearest(x: torch.Tensor, scales: tuple[int, ...]) -> torch.Tensor:
    n, c = x.shape[:2]
    view, expand, out = [n, c], [n, c], [n, c]
    for size, s in zip(x.shape[2:], scales, strict=True):
        view += [size, 1]
        expand += [size, s]
        out.append(size * s)
    return x.reshape(view).expand(expand).reshape(out)


class Upsample(torch.nn.Module):
    """Collective over grid. Upsampling of a partitioned field (``nearest``: local, no messages).

    Each rank's output block is the upsampled image of its input block, so the blocks tile
    the global ``torch.nn.Upsample`` output exactly (layout: :func:`upsampled_layout`).

    Parameters
    ----------
    scale_factor : int or sequence of int
        Positive integer factor(s), one per spatial dim or one for all.
    mode : {"nearest", "nearest-exact", "linear", "bilinear", "trilinear"}
        As for :class:`torch.nn.Upsample` (the linear modes need 1, 2, 3 spatial dims).
        The two nearest modes coincide for integer factors.
    align_corners : bool, optional
        As for torch (linear modes only; None means False).
    grid : ProcessGrid
    split : sequence of (int or None), optional
        Grid axis per spatial dim (or per block dim); default: spatial dim ``i`` over grid
        axis ``i``.
    balanced : bool
        Redistribute the output to the balanced layout of the output shape (one
        ``Alltoallv``, plus a tiny ``Allgather`` to learn the input layout when a plain
        block is given without ``layout``).

    Raises
    ------
    ValueError
        On a non-integer scale factor, an unknown mode, ``align_corners`` with a nearest
        mode, or an invalid split (the same on every rank).

    Notes
    -----
    Communication: ``nearest`` none (unless ``balanced``); linear modes one halo exchange
    of width 1 forward and its adjoint backward (plus one small ``Allgather`` per call to
    infer the layout of a plain block, unless ``layout=`` is passed to :meth:`forward`).
    No parameters, so nothing to synchronise.
    """

    def __init__(
        self,
        scale_factor: int | Sequence[int],
        mode: str = "nearest",
        align_corners: bool | None = None,
        *,
        grid: ProcessGrid,
        split: Sequence[int | None] | None = None,
        balanced: bool = False,
    ) -> None:
        super().__init__()
        self.grid = check_grid(grid)
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if mode.startswith("nearest") and align_corners is not None:  # as torch: even False
            raise ValueError("align_corners can only be set with the linear modes")
        self._scale = _check_scales(scale_factor)
        hints = (
            {_LINEAR[mode]} if mode in _LINEAR else None,
            _spatial_dims(split),
            {len(self._scale)} if isinstance(self._scale, tuple) else None,
        )
        options: set[int] | None = None
        for h in hints:
            if h is not None:
                options = h if options is None else options & h
        if options is not None and not options:
            raise ValueError(
                f"mode={mode!r}, split={split!r} and scale_factor={scale_factor!r} disagree on the "
                f"number of spatial dims ({[sorted(h) for h in hints if h is not None]})"
            )
        self._nd_options = options
        self.nd: int | None = next(iter(options)) if options is not None and len(options) == 1 else None
        self._split_spec = split  # as given (repr)
        self._split = split_items(split)
        if self.nd is not None:
            field_axes(grid, split, self.nd)  # validate now
        self.mode = mode
        self.align_corners = bool(align_corners)
        self.balanced = bool(balanced)

    def _scales(self, nd: int) -> tuple[int, ...]:
        """Scale factors for ``nd`` spatial dims (a number the mode, split and factors allow)."""
        if self._nd_options is not None and nd not in self._nd_options:
            want = " or ".join(str(n) for n in sorted(self._nd_options))
            raise ValueError(f"expected a block [N, C, *spatial] with {want} spatial dims, got {nd}")
        return self._scale if isinstance(self._scale, tuple) else (self._scale,) * nd

    def _check_block(self, x: torch.Tensor) -> None:
        if x.dim() < 3:
            raise ValueError(f"expected a block [N, C, *spatial], got {x.dim()} dims")
        self._scales(x.dim() - 2)

    def output_layout(self, layout: Layout) -> Layout:
        """Local. Layout of the output for an input of ``layout``.

        Parameters
        ----------
        layout : Layout
            Layout of the input ``[N, C, *spatial]``.

        Returns
        -------
        Layout
            ``scale * input cuts``, or balanced when the layer was built with ``balanced=True``.
        """
        scales = self._scales(layout.ndim - 2)
        field_axes(self.grid, self._split, layout.ndim - 2)  # a split valid for these dims
        return upsampled_layout(layout, scales, self.balanced)

    def forward(self, x: Any, layout: Layout | None = None) -> Any:
        """Collective over grid. This rank's block of the upsampled field (see the class notes).

        Parameters
        ----------
        x : torch.Tensor or DistTensor
            This rank's block ``[N, C, *spatial]`` (uneven blocks allowed).
        layout : Layout, optional
            Global layout of a plain block; inferred collectively when needed and omitted.

        Returns
        -------
        torch.Tensor or DistTensor
            The output block (a DistTensor with :meth:`output_layout` for a DistTensor input).

        Raises
        ------
        ValueError
            If the block does not have ``2 + len(split)`` dims, or ``layout`` does not match it.
        """
        # the linear modes' halo and the balancing move need every rank: a bad block on one rank
        # raises everywhere; nearest upsampling without balancing is purely local
        collective = self.balanced or self.mode in _LINEAR
        field = field_input(x, self.grid, self._split, None, layout, check=self._check_block, collective=collective)
        local, scales = field.block, self._scales(field.block.dim() - 2)
        if self.mode in _LINEAR:
            y = self._linear(local, field.global_layout, field.split[2:], scales)
        else:
            y = _nearest(local, scales)
        if field.layout is None:  # a plain block, nothing exchanged: no layout to give
            return y
        out_layout = upsampled_layout(field.layout, scales, self.balanced)
        if self.balanced:
            src = upsampled_layout(field.layout, scales)
            y = Redistribute.apply(y.contiguous(), self.grid, src, out_layout)
        return field.wrap(y, out_layout)

    def _linear(
        self, x: torch.Tensor, lay: Layout, split: tuple[int | None, ...], scales: tuple[int, ...]
    ) -> torch.Tensor:
        width: list[tuple[int, int]] = [(0, 0), (0, 0)] + [(0, 0) if g is None else (1, 1) for g in split]
        xp = halo_pad(x, self.grid, (None, None) + split, width, "replicate", layout=lay)
        if not self.align_corners:
            y = F.interpolate(xp, scale_factor=[float(s) for s in scales], mode=self.mode, align_corners=False)
            for k, (g, s) in enumerate(zip(split, scales, strict=True)):
                if g is not None:
                    y = y.narrow(2 + k, s, s * x.shape[2 + k])
            return y
        y = xp.to(torch.promote_types(xp.dtype, torch.float32))  # bf16/fp16: one rounding, at the end
        ranges = lay.local_ranges(self.grid.coords)
        for k, s in enumerate(scales):
            d = 2 + k
            lo, hi = ranges[d]
            i0, i1, lam = _linear_weights(lay.global_shape[d], s, lo, hi, 0 if split[k] is None else 1, True, x.device)
            shape = [1] * y.dim()
            shape[d] = -1
            lam = lam.to(y.dtype).reshape(shape)
            y = y.index_select(d, i0) * (1 - lam) + y.index_select(d, i1) * lam
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        """Local. Extra text for ``repr``."""
        return (
            f"scale_factor={self._scale}, mode={self.mode!r}, align_corners={self.align_corners}, "
            f"grid={self.grid.dims}, split={self._split_spec}, balanced={self.balanced}"
        )
