"""Tensor-parallel transformer layers against torch: global inputs, token and batch blocks, gathered gradients."""

from __future__ import annotations

import torch

import hpctp
from hpctp.layout import block_cuts
from hpctp.nn.state_dict import global_state_dict

F64 = torch.float64


def normal(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Local. A float64 standard-normal tensor from torch's generator seeded with ``seed`` (same on every rank)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def block(n: int, parts: int, index: int) -> slice:
    """Local. Block ``index`` of ``n`` items in balanced cuts over ``parts``."""
    c = block_cuts(n, parts)
    return slice(c[index], c[index + 1])


def batch_rows(grid: hpctp.ProcessGrid, axis: int, batch: int) -> slice:
    """Local. This rank's samples when the grid axes other than ``axis`` split the batch (data parallelism).

    The other axes' coordinates, row-major, number the data-parallel ranks.
    """
    dp, index = 1, 0
    for a in range(grid.ndim):
        if a != axis:
            index = index * grid.dims[a] + grid.coords[a]
            dp *= grid.dims[a]
    return block(batch, dp, index)


def token_rows(grid: hpctp.ProcessGrid, axis: int, tokens: int) -> slice:
    """Local. This rank's tokens when ``axis`` splits them (sequence parallelism, balanced cuts)."""
    return block(tokens, grid.dims[axis], grid.coords[axis])


def global_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective over the module's grid. The parameters' gradients gathered like the parameters
    (:func:`hpctp.nn.state_dict.global_state_dict`: torch's names and packing), on every rank."""
    params = list(module.parameters())
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        return global_state_dict(module)
    finally:
        for p, d in zip(params, saved):
            p.data = d


def torch_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Local. A torch module's parameter gradients by name."""
    return {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
