"""Input handling shared by the partitioned layers: plain blocks or DistTensors, layouts."""

from __future__ import annotations

from typing import Any

import torch

from .. import comm as C
from ..comm import ProcessGrid
from ..layout import Layout
from ..tensor.core import DistTensor
from ..tensor.infer import infer_layout
from . import _window as W

__all__ = ["finish", "prepare", "resolve_layout"]


def resolve_layout(
    x: torch.Tensor, grid: ProcessGrid, split: tuple[int | None, ...], layout: Layout | None,
    error: Exception | None = None,
) -> Layout:  # fmt: skip
    """Collective over grid. ``layout`` inferred when None, else checked against the block on
    every rank (a block that does not match on one rank raises everywhere: none is left waiting);
    ``error``, a failed earlier local check, is raised the same way (in the inference's one
    message when there is no ``layout``)."""
    if layout is None:
        return infer_layout(tuple(x.shape), grid, split, error)
    try:
        if error is not None:
            raise error
        if not isinstance(layout, Layout):
            raise TypeError(f"layout must be a hpctp.layout.Layout, got {type(layout).__name__}")
        if layout.split != split:
            raise ValueError(f"layout {layout} does not match split={split}")
        layout.check_block(x.shape, grid.dims, grid.coords, f"rank {grid.rank}: block")
    except (TypeError, ValueError) as e:
        error = e
    C.raise_if_any(grid.comm, error)
    return layout


def prepare(
    x: Any, grid: ProcessGrid, split: object, nd: int, layout: Layout | None
) -> tuple[torch.Tensor, Layout, bool]:
    """Local block, its global layout (collective when inferred) and whether x was a DistTensor."""
    lay: Layout | None
    if isinstance(x, DistTensor):
        local, lay, wrapped = x.local, x.layout, True
        if not isinstance(local, torch.Tensor):
            raise TypeError("DistTensor inputs of nn layers need a torch local block (use .to('torch'))")
        if x.grid is not grid and x.grid.dims != grid.dims:
            raise ValueError(f"input lives on grid dims {x.grid.dims}, the layer on {grid.dims}")
    elif isinstance(x, torch.Tensor):
        local, lay, wrapped = x, layout, False
    else:
        raise TypeError(f"input must be a torch.Tensor block or a DistTensor, got {type(x).__name__}")
    sp = W.full_split(split, nd, grid.ndim)
    if lay is None:
        # inferred collectively, before the local check: a block of another ndim on only some ranks
        # fails the inference on every rank instead of leaving the others waiting in it
        try:
            return local, infer_layout(tuple(local.shape), grid, sp), wrapped
        except ValueError:
            if local.ndim != nd + 2:
                raise _wrong_ndim(local, nd) from None
            raise
    if wrapped:
        if local.ndim != nd + 2:  # the layout is global: every rank raises
            raise _wrong_ndim(local, nd)
        if lay.split != sp:
            raise ValueError(f"input split {lay.split} differs from the layer's split {sp}; redistribute first")
        return local, lay, wrapped
    error = _wrong_ndim(local, nd) if local.ndim != nd + 2 else None
    return local, resolve_layout(local, grid, sp, lay, error), wrapped


def _wrong_ndim(local: torch.Tensor, nd: int) -> ValueError:
    return ValueError(f"expected a batched {nd + 2}-D block (N, C, *spatial), got {local.ndim} dims")


def finish(y: torch.Tensor, out_layout: Layout, grid: ProcessGrid, wrapped: bool) -> Any:
    return DistTensor(y, grid, out_layout) if wrapped else y
