"""Small helpers so one model definition runs distributed (DistTensor) or in one process (Tensor)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

import hpctp

__all__ = ["pointwise", "cat_channels", "with_local"]

T = TypeVar("T", hpctp.DistTensor, torch.Tensor)


def with_local(x: hpctp.DistTensor, local: torch.Tensor) -> hpctp.DistTensor:
    """Local. A DistTensor with ``x``'s grid and split holding ``local`` (channel count may differ)."""
    return hpctp.DistTensor(local, x.grid, x.layout.with_size(1, int(local.shape[1])))


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: T) -> T:
    """Local. ``fn`` applied to the block (autograd flows through ``fn``)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    return with_local(x, fn(x.local))


def cat_channels(a: T, b: T) -> T:
    """Local. Concatenate along dim 1 (channels) two tensors cut the same way spatially.

    Raises
    ------
    ValueError
        If the spatial layouts differ.
    """
    if isinstance(a, torch.Tensor):
        return torch.cat([a, b], dim=1)
    la, lb = a.layout, b.layout
    if la.split != lb.split or la.dim_cuts[2:] != lb.dim_cuts[2:] or la.dim_cuts[0] != lb.dim_cuts[0]:
        raise ValueError(f"cat_channels needs the same spatial layout, got {la} and {lb}")
    return with_local(a, torch.cat([a.local, b.local], dim=1))
