"""Spatially partitioned transposed convolutions and pooling on local torch blocks.

Re-exported by :mod:`hpctp.nn.functional`; see there for the conventions (collective
forward and backward, plain blocks or DistTensors, balanced output blocks).
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import ProcessGrid
from ..layout import Layout
from . import _window as W
from ._inputs import finish as _finish
from ._inputs import prepare as _prepare

__all__ = [
    "avg_pool2d",
    "avg_pool3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "max_pool2d",
    "max_pool3d",
]


def _convt(
    nd: int,
    x: Any,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: object,
    padding: object,
    output_padding: object,
    groups: int,
    dilation: object,
    grid: ProcessGrid,
    split: object,
    layout: Layout | None,
) -> Any:
    local, lay, wrapped = _prepare(x, grid, split, nd, layout)
    y, out_layout = W.conv_transpose(
        nd, local, lay, grid, weight, bias, stride, padding, output_padding, groups, dilation
    )
    return _finish(y, out_layout, grid, wrapped)


def conv_transpose1d(
    x: Any,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: object = 1,
    padding: object = 0,
    output_padding: object = 0,
    groups: int = 1,
    dilation: object = 1,
    *,
    grid: ProcessGrid,
    split: object = None,
    layout: Layout | None = None,
) -> Any:
    """Collective over grid. Spatially partitioned ``conv_transpose1d``; see :func:`conv_transpose2d`."""
    return _convt(1, x, weight, bias, stride, padding, output_padding, groups, dilation, grid, split, layout)


def conv_transpose2d(
    x: Any,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: object = 1,
    padding: object = 0,
    output_padding: object = 0,
    groups: int = 1,
    dilation: object = 1,
    *,
    grid: ProcessGrid,
    split: object = None,
    layout: Layout | None = None,
) -> Any:
    """Collective over grid. Spatially partitioned ``torch.nn.functional.conv_transpose2d``.

    The output is cut into balanced blocks of the global output shape; each rank fetches
    the input range whose scattered contributions reach its output block.

    Parameters
    ----------
    x : torch.Tensor or DistTensor
        This rank's ``(N, C_in, H, W)`` block.
    weight, bias : torch.Tensor
        Replicated parameters; gradients are partial sums (see :func:`conv2d`).
    stride, padding, output_padding, groups, dilation
        As for ``torch.nn.functional.conv_transpose2d``.
    grid : ProcessGrid
    split : sequence of (int or None), optional
        Grid axis of each spatial dim.
    layout : Layout, optional
        Global layout of a plain block.

    Returns
    -------
    torch.Tensor or DistTensor

    Raises
    ------
    ValueError
        On every rank: wrong dims, split or channels, bad output_padding.
    """
    return _convt(2, x, weight, bias, stride, padding, output_padding, groups, dilation, grid, split, layout)


def conv_transpose3d(
    x: Any,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: object = 1,
    padding: object = 0,
    output_padding: object = 0,
    groups: int = 1,
    dilation: object = 1,
    *,
    grid: ProcessGrid,
    split: object = None,
    layout: Layout | None = None,
) -> Any:
    """Collective over grid. Spatially partitioned ``conv_transpose3d``; see :func:`conv_transpose2d`."""
    return _convt(3, x, weight, bias, stride, padding, output_padding, groups, dilation, grid, split, layout)


def _pool(
    nd: int,
    kind: str,
    x: Any,
    kernel_size: object,
    stride: object,
    padding: object,
    dilation: object,
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
    grid: ProcessGrid,
    split: object,
    layout: Layout | None,
    overlap: bool,
) -> Any:
    local, lay, wrapped = _prepare(x, grid, split, nd, layout)
    y, out_layout = W.pool(
        nd,
        kind,
        local,
        lay,
        grid,
        kernel_size,
        stride,
        padding,
        dilation,
        ceil_mode,
        count_include_pad,
        divisor_override,
        overlap,
    )
    return _finish(y, out_layout, grid, wrapped)


def max_pool2d(
    x: Any,
    kernel_size: object,
    stride: object = None,
    padding: object = 0,
    dilation: object = 1,
    ceil_mode: bool = False,
    *,
    grid: ProcessGrid,
    split: object = None,
    layout: Layout | None = None,
    overlap: bool = True,
) -> Any:
    """Collective over grid. Spatially partitioned ``torch.nn.functional.max_pool2d``.

    Same tiling as :func:`conv2d` (balanced output blocks, exact per-rank input ranges).
    ``return_indices`` is not supported.

    Parameters
    ----------
    x : torch.Tensor or DistTensor
    kernel_size, stride, padding, dilation, ceil_mode
        As for torch (``stride`` defaults to ``kernel_size``).
    grid : ProcessGrid
    split, layout, overlap
        See :func:`conv2d`.

    Returns
    -------
    torch.Tensor or DistTensor
    """
    return _pool(
        2, "max", x, kernel_size, stride, padding, dilation, ceil_mode, True, None, grid, split, layout, overlap
    )


def max_pool3d(
    x: Any,
    kernel_size: object,
    stride: object = None,
    padding: object = 0,
    dilation: object = 1,
    ceil_mode: bool = False,
    *,
    grid: ProcessGrid,
    split: object = None,
    layout: Layout | None = None,
    overlap: bool = True,
) -> Any:
    """Collective over grid. Spatially partitioned ``max_pool3d``; see :func:`max_pool2d`."""
    return _pool(
        3, "max", x, kernel_size, stride, padding, dilation, ceil_mode, True, None, grid, split, layout, overlap
    )


def avg_pool2d(
    x: Any,
    kernel_size: object,
    stride: object = None,
    padding: object = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
    *,
    grid: ProcessGrid,
    split: object = None,
    layout: Layout | None = None,
    overlap: bool = True,
) -> Any:
    """Collective over grid. Spatially partitioned ``torch.nn.functional.avg_pool2d``.

    Parameters
    ----------
    x : torch.Tensor or DistTensor
    kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
        As for torch.
    grid : ProcessGrid
    split, layout, overlap
        See :func:`conv2d`.

    Returns
    -------
    torch.Tensor or DistTensor
    """
    return _pool(
        2,
        "avg",
        x,
        kernel_size,
        stride,
        padding,
        1,
        ceil_mode,
        count_include_pad,
        divisor_override,
        grid,
        split,
        layout,
        overlap,
    )


def avg_pool3d(
    x: Any,
    kernel_size: object,
    stride: object = None,
    padding: object = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
    *,
    grid: ProcessGrid,
    split: object = None,
    layout: Layout | None = None,
    overlap: bool = True,
) -> Any:
    """Collective over grid. Spatially partitioned ``avg_pool3d``; see :func:`avg_pool2d`."""
    return _pool(
        3,
        "avg",
        x,
        kernel_size,
        stride,
        padding,
        1,
        ceil_mode,
        count_include_pad,
        divisor_override,
        grid,
        split,
        layout,
        overlap,
    )
