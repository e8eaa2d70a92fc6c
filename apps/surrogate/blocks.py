"""Small helpers so one model definition runs distributed (DistTensor) or in one process (Tensor)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

import hpctp

__all__ = ["pointwise", "cat_channels", "with_local", "ResidualScale", "zero_", "set_delta_scale"]

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


def zero_(layer: torch.nn.Module) -> torch.nn.Module:
    """Local. Zero a layer's weight and bias (the head: the untrained model predicts persistence exactly)."""
    with torch.no_grad():
        for name in ("weight", "bias"):
            t = getattr(layer, name, None)
            if t is not None:
                t.zero_()
    return layer


class ResidualScale(torch.nn.Module):
    """Local. The output scale the surrogates share: ``delta_scale``, the RMS of one step's change (a buffer,
    set by :func:`apps.surrogate.train.fit_delta_scale`); its ``reset_parameters()`` (the model's own state: its
    layers reset themselves) puts it back to 1, as built, so a model built on the meta device materializes."""

    delta_scale: torch.Tensor

    def _scale_buffer(self, dtype: torch.dtype) -> None:
        self.register_buffer("delta_scale", torch.ones((), dtype=dtype))

    def reset_parameters(self) -> None:
        """Local. ``delta_scale`` back to 1."""
        with torch.no_grad():
            self.delta_scale.fill_(1.0)


def set_delta_scale(model: torch.nn.Module, value: float) -> None:
    """Local. Fill every ``delta_scale`` buffer of ``model`` (the model's own, or its head's in a chain; none on a
    pipeline's other stages) with ``value``."""
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.split(".")[-1] == "delta_scale":
                buf.fill_(value)
