"""Spatially partitioned convolution layers: drop-in ``torch.nn.ConvNd`` with a grid.

Parameters are replicated: every rank holds the whole weight and bias, identical on every
rank (``seed`` makes them independent of the grid and of the global RNG; without a seed
rank 0's values are broadcast). After ``loss.backward()`` each rank's parameter gradient
is its partial sum over its own output block: call ``hpctp.nn.sync_gradients(model, grid)``
(a sum over the grid) before the optimizer step. Forward and backward are collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...comm import ProcessGrid, check_grid
from ..init import SeededReset, init_replicated
from . import _window as W
from ._inputs import field_input, full_split
from .window_spec import WindowSpec

__all__ = ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "init_replicated"]


class _Spatial:
    """Attributes shared by the partitioned layers; the window layers (conv, transposed conv,
    pooling) keep their :class:`~hpctp.nn.spatial.window_spec.WindowSpec`, built once in ``__init__``
    (validated before any message), which ``forward`` hands to the window engine."""

    grid: ProcessGrid
    split: tuple[int | None, ...]
    overlap: bool
    _nd: int
    _window: WindowSpec

    def _setup(
        self, grid: ProcessGrid, split: Sequence[int | None] | None, nd: int, overlap: bool,
        window: WindowSpec | None = None,
    ) -> None:  # fmt: skip
        self.grid = grid
        self.split = full_split(split, nd, grid.ndim)[2:]
        self.overlap = bool(overlap)
        if window is not None:
            self._window = window

    def _grid_repr(self) -> str:
        return f", grid={self.grid.dims}, split={self.split}"

    def extra_repr(self) -> str:
        return super().extra_repr() + self._grid_repr()  # type: ignore[misc]


class _ConvMixin(SeededReset, _Spatial):
    _nd = 2

    def _draw_parameters(self) -> None:
        torch.nn.modules.conv._ConvNd.reset_parameters(self)  # type: ignore[arg-type]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any = 1,
        padding: Any = 0,
        dilation: Any = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: Any = None,
        dtype: Any = None,
        *,
        grid: ProcessGrid,
        split: Sequence[int | None] | None = None,
        seed: int | None = None,
        overlap: bool = True,
    ) -> None:
        grid = check_grid(grid)
        full_split(split, self._nd, grid.ndim)  # validate before any communication
        window = WindowSpec.conv(self._nd, stride, padding, dilation, groups, padding_mode)

        def init() -> None:
            super(_ConvMixin, self).__init__(
                in_channels,
                out_channels,
                kernel_size,
                stride,
                padding,
                dilation,  # type: ignore[call-arg]
                groups,
                bias,
                padding_mode,
                device,
                dtype,
            )

        init_replicated(self, init, grid, seed)  # type: ignore[arg-type]
        self._setup(grid, split, self._nd, overlap, window)

    def forward(self, x: Any) -> Any:
        """Collective over grid. This rank's output block (see the class docstring)."""
        m: Any = self
        return W.conv(field_input(x, self.grid, self.split, self._nd), m.weight, m.bias, self._window, self.overlap)


class _ConvTMixin(SeededReset, _Spatial):
    _nd = 2

    def _draw_parameters(self) -> None:
        torch.nn.modules.conv._ConvNd.reset_parameters(self)  # type: ignore[arg-type]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any = 1,
        padding: Any = 0,
        output_padding: Any = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: Any = 1,
        padding_mode: str = "zeros",
        device: Any = None,
        dtype: Any = None,
        *,
        grid: ProcessGrid,
        split: Sequence[int | None] | None = None,
        seed: int | None = None,
    ) -> None:
        grid = check_grid(grid)
        full_split(split, self._nd, grid.ndim)  # validate before any communication
        window = WindowSpec.conv_transpose(self._nd, stride, padding, output_padding, groups, dilation)

        def init() -> None:
            super(_ConvTMixin, self).__init__(
                in_channels,
                out_channels,
                kernel_size,
                stride,
                padding,
                output_padding,  # type: ignore[call-arg]
                groups,
                bias,
                dilation,
                padding_mode,
                device,
                dtype,
            )

        init_replicated(self, init, grid, seed)  # type: ignore[arg-type]
        self._setup(grid, split, self._nd, False, window)

    def forward(self, x: Any, output_size: Any = None) -> Any:
        """Collective over grid. This rank's output block (``output_size`` is not supported)."""
        if output_size is not None:
            raise ValueError("output_size is not supported by partitioned transposed convs; use output_padding")
        m: Any = self
        return W.conv_transpose(field_input(x, self.grid, self.split, self._nd), m.weight, m.bias, self._window)


_DOC = """Collective over grid. ``torch.nn.{name}`` on a field cut over ``grid`` along its spatial dims.

    Same arguments and parameters as ``torch.nn.{name}``, plus the keyword-only ones below.
    ``forward`` takes this rank's ``(N, C, *spatial)`` block (plain ``torch.Tensor``, blocks
    may be uneven; the global layout is inferred with one tiny collective) or a
    :class:`hpctp.DistTensor`, and returns this rank's block of the global output (balanced
    blocks of the global output shape over the same grid axes), of the same kind. {extra}

    Parameters
    ----------
    grid : ProcessGrid
    split : sequence of (int or None), optional
        Grid axis of each spatial dim; default spatial dim ``i`` over grid axis ``i``.
    seed : int, optional
        Initialise the (replicated) parameters from this seed (no communication; equal to
        torch's init after ``torch.manual_seed(seed)``). Default: broadcast rank 0's init.
    {overlap}
    Notes
    -----
    Parameter gradients after backward are this rank's partial sums; call
    ``hpctp.nn.sync_gradients(module, grid)`` (sum over the grid) before stepping.

    Raises
    ------
    ValueError
        On every rank: bad split, wrong input dims/channels, output size < 1.
    """
_OVERLAP = """overlap : bool
        Compute interior outputs while the halo is in flight (default True).
"""
_MODES = "``padding_mode`` zeros/circular/reflect/replicate."
_NOSIZE = "``forward(x, output_size)`` is not supported."


class Conv1d(_ConvMixin, torch.nn.Conv1d):
    __doc__ = _DOC.format(name="Conv1d", extra=_MODES, overlap=_OVERLAP)
    _nd = 1


class Conv2d(_ConvMixin, torch.nn.Conv2d):
    __doc__ = _DOC.format(name="Conv2d", extra=_MODES, overlap=_OVERLAP)
    _nd = 2


class Conv3d(_ConvMixin, torch.nn.Conv3d):
    __doc__ = _DOC.format(name="Conv3d", extra=_MODES, overlap=_OVERLAP)
    _nd = 3


class ConvTranspose1d(_ConvTMixin, torch.nn.ConvTranspose1d):
    __doc__ = _DOC.format(name="ConvTranspose1d", extra=_NOSIZE, overlap="")
    _nd = 1


class ConvTranspose2d(_ConvTMixin, torch.nn.ConvTranspose2d):
    __doc__ = _DOC.format(name="ConvTranspose2d", extra=_NOSIZE, overlap="")
    _nd = 2


class ConvTranspose3d(_ConvTMixin, torch.nn.ConvTranspose3d):
    __doc__ = _DOC.format(name="ConvTranspose3d", extra=_NOSIZE, overlap="")
    _nd = 3
