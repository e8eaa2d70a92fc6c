"""Spatially partitioned pooling layers: drop-in ``torch.nn.MaxPool2d/3d``, ``AvgPool2d/3d``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...comm import check_grid
from . import _window as W
from ._inputs import field_input, full_split
from .conv import _Spatial
from .window_spec import WindowSpec

__all__ = ["AvgPool2d", "AvgPool3d", "MaxPool2d", "MaxPool3d"]

_DOC = """Collective over grid. ``torch.nn.{name}`` on a field cut over ``grid`` along its spatial dims.

    Same arguments as ``torch.nn.{name}`` {extra}, plus the keyword-only ones below. ``forward``
    takes this rank's ``(N, C, *spatial)`` block or a :class:`hpctp.DistTensor` and returns
    this rank's block of the global output (balanced blocks over the same grid axes).
    Windows crossing block edges read the neighbours' data; windows crossing the global
    edge follow torch's padding rules (``-inf`` for max, torch's divisors for average).

    Parameters
    ----------
    grid : ProcessGrid
    split : sequence of (int or None), optional
        Grid axis of each spatial dim; default spatial dim ``i`` over grid axis ``i``.
    overlap : bool
        Pool the interior while the halo is in flight (default True).

    Raises
    ------
    ValueError
        On every rank: bad split, wrong input dims, too-large padding, a max-pooling window
        that covers only padding (dilation over a small input), ``return_indices``.
    """


class _PoolMixin(_Spatial):
    def forward(self, x: Any) -> Any:
        """Collective over grid. This rank's output block."""
        return W.pool(field_input(x, self.grid, self.split, self._nd), self._window, self.overlap)


class _MaxMixin(_PoolMixin):
    _nd = 2

    def __init__(
        self,
        kernel_size: Any,
        stride: Any = None,
        padding: Any = 0,
        dilation: Any = 1,
        return_indices: bool = False,
        ceil_mode: bool = False,
        *,
        grid: Any,
        split: Sequence[int | None] | None = None,
        overlap: bool = True,
    ) -> None:
        grid = check_grid(grid)
        full_split(split, self._nd, grid.ndim)
        if return_indices:
            raise ValueError("return_indices=True is not supported by partitioned max pooling")
        window = WindowSpec.max_pool(self._nd, kernel_size, stride, padding, dilation, ceil_mode)
        super().__init__(kernel_size, stride, padding, dilation, return_indices, ceil_mode)  # type: ignore[call-arg]
        self._setup(grid, split, self._nd, overlap, window)


class _AvgMixin(_PoolMixin):
    _nd = 2

    def __init__(
        self,
        kernel_size: Any,
        stride: Any = None,
        padding: Any = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
        *,
        grid: Any,
        split: Sequence[int | None] | None = None,
        overlap: bool = True,
    ) -> None:
        grid = check_grid(grid)
        full_split(split, self._nd, grid.ndim)
        window = WindowSpec.avg_pool(
            self._nd, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
        )
        super().__init__(kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)  # type: ignore[call-arg]
        self._setup(grid, split, self._nd, overlap, window)


class MaxPool2d(_MaxMixin, torch.nn.MaxPool2d):
    __doc__ = _DOC.format(name="MaxPool2d", extra="(``return_indices`` must be False)")
    _nd = 2


class MaxPool3d(_MaxMixin, torch.nn.MaxPool3d):
    __doc__ = _DOC.format(name="MaxPool3d", extra="(``return_indices`` must be False)")
    _nd = 3


class AvgPool2d(_AvgMixin, torch.nn.AvgPool2d):
    __doc__ = _DOC.format(name="AvgPool2d", extra="")
    _nd = 2


class AvgPool3d(_AvgMixin, torch.nn.AvgPool3d):
    __doc__ = _DOC.format(name="AvgPool3d", extra="")
    _nd = 3
