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
from ._inputs import field_input
from .window_spec import WindowSpec

__all__ = [
    "avg_pool2d",
    "avg_pool3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "max_pool2d",
    "max_pool3d",
]


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
    spec = WindowSpec.conv_transpose(1, stride, padding, output_padding, groups, dilation)
    return W.conv_transpose(field_input(x, grid, split, 1, layout), weight, bias, spec)


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
    spec = WindowSpec.conv_transpose(2, stride, padding, output_padding, groups, dilation)
    return W.conv_transpose(field_input(x, grid, split, 2, layout), weight, bias, spec)


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
    spec = WindowSpec.conv_transpose(3, stride, padding, output_padding, groups, dilation)
    return W.conv_transpose(field_input(x, grid, split, 3, layout), weight, bias, spec)


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
    spec = WindowSpec.max_pool(2, kernel_size, stride, padding, dilation, ceil_mode)
    return W.pool(field_input(x, grid, split, 2, layout), spec, overlap)


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
    spec = WindowSpec.max_pool(3, kernel_size, stride, padding, dilation, ceil_mode)
    return W.pool(field_input(x, grid, split, 3, layout), spec, overlap)


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
    spec = WindowSpec.avg_pool(2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    return W.pool(field_input(x, grid, split, 2, layout), spec, overlap)


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
    spec = WindowSpec.avg_pool(3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    return W.pool(field_input(x, grid, split, 3, layout), spec, overlap)
