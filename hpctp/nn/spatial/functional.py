"""Spatially partitioned functional ops on local torch blocks: halo padding, convolutions (also transposed),
pooling.

Re-exported by :mod:`hpctp.nn.functional`; see there for the conventions (collective
forward and backward, plain blocks or DistTensors, balanced output blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ... import comm as C
from ...comm import ProcessGrid
from ...halo.plan import fetch_plan, halo_wants, normalize_boundary, normalize_widths
from ...layout import Layout, normalize_split
from . import _window as W
from ._fetch import Fetch
from ._inputs import field_input, full_split, resolve_layout
from .window_spec import WindowSpec

__all__ = [
    "halo_pad",
    "conv1d",
    "conv2d",
    "conv3d",
    "spatial_split",
    "avg_pool2d",
    "avg_pool3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "max_pool2d",
    "max_pool3d",
]


def halo_pad(
    x: torch.Tensor,
    grid: ProcessGrid,
    split: object,
    width: object,
    boundary: object = "zero",
    *,
    layout: Layout | None = None,
    stencil: str = "box",
) -> torch.Tensor:
    """Collective over grid. Pad the local block with its neighbours' data (differentiable).

    The result is ``x`` widened by ``width`` cells per side: inside the global index range
    the cells hold the neighbours' values (faces, edges and corners; from any rank when a
    width exceeds a neighbour's block), outside they follow ``boundary``. On a single
    rank this is ``torch.nn.functional.pad`` with mode constant/circular/reflect/replicate;
    widths beyond torch's limits (a reflection of ``n`` or more cells, a wrap of more than
    ``n``) repeat the pattern, as ``numpy.pad`` does.
    The backward is the adjoint: ghost-cell gradients are sent to their owners and summed.

    Parameters
    ----------
    x : torch.Tensor
        This rank's block (any device; leading batch/channel dims have split None).
    grid : ProcessGrid
    split : sequence of (int or None)
        Grid axis of each dim of ``x`` (None: not split).
    width : int or sequence
        An int ``w`` pads every split dim by ``w`` on both sides (unsplit dims by 0); a
        sequence has one entry per dim of ``x``: an int or a ``(lo, hi)`` pair.
    boundary : {"zero", "periodic", "reflect", "replicate"} or sequence of them
        Outside the global range: zeros, wrap-around, mirror without the edge
        (``torch`` "reflect") or repeat the edge ("replicate"). One per dim or for all.
    layout : Layout, optional
        Global layout of ``x``; inferred with one small collective when omitted.
    stencil : {"box", "star"}
        ``"star"`` leaves edges and corners zero (no diagonal messages).

    Returns
    -------
    torch.Tensor
        Shape ``x.shape[d] + lo_d + hi_d`` per dim; same dtype and device.

    Raises
    ------
    ValueError
        On every rank: bad split/width/boundary, blocks that do not tile, or a non-zero
        boundary on an empty global dim.
    TypeError
        If ``x`` is not a torch tensor.

    Examples
    --------
    >>> import torch, hpctp
    >>> from hpctp.nn.functional import halo_pad
    >>> grid = hpctp.ProcessGrid([0, 0])  # every rank of the job, as a 2-D grid
    >>> x = hpctp.ones((1, 1, 8, 8), grid, (None, None, 0, 1), like="torch")
    >>> y = halo_pad(x.local, grid, (None, None, 0, 1), 1, "periodic")
    >>> tuple(y.shape[2:]) == (x.local.shape[2] + 2, x.local.shape[3] + 2), bool((y == 1).all())
    (True, True)
    >>> grid.free()
    """
    error: Exception | None = None
    try:  # every argument agreed on before the exchange: a bad or different one on one rank raises everywhere
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"halo_pad needs a torch.Tensor block, got {type(x).__name__}")
        if stencil not in ("box", "star"):
            raise ValueError(f"stencil must be 'box' or 'star', got {stencil!r}")
        sp = normalize_split(split, x.ndim, grid.ndim)
        widths = normalize_widths(width, sp)
        bnd = normalize_boundary(boundary, x.ndim)
    except (TypeError, ValueError) as e:
        error = e
    C.agree_arguments(
        grid.comm, "halo_pad", error, split=split, width=width, boundary=boundary, stencil=stencil,
        dtype=str(getattr(x, "dtype", None)),  # (devices differ: one GPU per rank)
    )  # fmt: skip
    # (the layout's split is sp: inferred with it, or checked against it)
    lay = resolve_layout(tuple(x.shape), grid, sp, layout)
    plan = fetch_plan(lay, grid.rank, halo_wants(lay, widths), bnd, stencil)
    return Fetch.apply(x, plan, grid.comm, 0.0)


# --------------------------------------------------------------------------- window ops
def conv1d(
    x: Any,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: object = 1,
    padding: object = 0,
    dilation: object = 1,
    groups: int = 1,
    *,
    grid: ProcessGrid,
    split: object = None,
    padding_mode: str = "zeros",
    layout: Layout | None = None,
    overlap: bool = True,
) -> Any:
    """Collective over grid. Spatially partitioned ``torch.nn.functional.conv1d``; see :func:`conv2d`."""
    spec = WindowSpec.conv(1, stride, padding, dilation, groups, padding_mode)
    return W.conv(field_input(x, grid, split, 1, layout), weight, bias, spec, overlap)


def conv2d(
    x: Any,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: object = 1,
    padding: object = 0,
    dilation: object = 1,
    groups: int = 1,
    *,
    grid: ProcessGrid,
    split: object = None,
    padding_mode: str = "zeros",
    layout: Layout | None = None,
    overlap: bool = True,
) -> Any:
    """Collective over grid. Spatially partitioned ``torch.nn.functional.conv2d``.

    The output is cut into balanced blocks of the global output shape over the same grid
    axes as the input; each rank fetches exactly the input range its output block needs
    (which depends on stride, padding and dilation, and may span several ranks). The
    interior is computed while the halo is in flight, the boundary strips afterwards.

    Parameters
    ----------
    x : torch.Tensor or DistTensor
        This rank's ``(N, C, H, W)`` block (possibly uneven), or a DistTensor.
    weight, bias : torch.Tensor
        Replicated parameters (as for torch). Their gradients are this rank's partial
        sums: call ``hpctp.nn.sync_gradients`` (sum over the grid) after backward.
    stride, padding, dilation, groups
        As for ``torch.nn.functional.conv2d``; ``padding`` may be ``"same"``/``"valid"``.
    grid : ProcessGrid
    split : sequence of (int or None), optional
        Grid axis of each spatial dim (default: spatial dim ``i`` over grid axis ``i``).
    padding_mode : {"zeros", "circular", "reflect", "replicate"}
        Boundary condition of the global field (as ``torch.nn.Conv2d``'s padding_mode).
    layout : Layout, optional
        Global layout of a plain block (inferred collectively if omitted).
    overlap : bool
        Compute the interior while the halo is in flight (default True).

    Returns
    -------
    torch.Tensor or DistTensor
        This rank's block of the global output (same kind as ``x``).

    Raises
    ------
    ValueError
        On every rank: wrong dims, split or channels, an output size < 1, or padding
        beyond torch's limits for ``padding_mode`` ("reflect": < size, "circular": <= size).
    """
    spec = WindowSpec.conv(2, stride, padding, dilation, groups, padding_mode)
    return W.conv(field_input(x, grid, split, 2, layout), weight, bias, spec, overlap)


def conv3d(
    x: Any,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: object = 1,
    padding: object = 0,
    dilation: object = 1,
    groups: int = 1,
    *,
    grid: ProcessGrid,
    split: object = None,
    padding_mode: str = "zeros",
    layout: Layout | None = None,
    overlap: bool = True,
) -> Any:
    """Collective over grid. Spatially partitioned ``torch.nn.functional.conv3d``; see :func:`conv2d`."""
    spec = WindowSpec.conv(3, stride, padding, dilation, groups, padding_mode)
    return W.conv(field_input(x, grid, split, 3, layout), weight, bias, spec, overlap)


def spatial_split(split: Sequence[int | None] | None, nd: int, grid: ProcessGrid) -> tuple[int | None, ...]:
    """Local. The full split ``(None, None, *spatial)`` of an ``(N, C, *spatial)`` block.

    ``None`` means spatial dim ``i`` over grid axis ``i`` for the grid's axes.
    """
    return full_split(split, nd, grid.ndim)


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
