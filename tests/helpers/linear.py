"""The single-process torch reference of a tensor-parallel linear layer, and its parameters' blocks."""

from __future__ import annotations

import torch

import hpctp

F64 = torch.float64


def full_param(p: torch.Tensor, grid: hpctp.ProcessGrid) -> torch.Tensor:
    """Collective over grid (for a divided parameter). The global parameter (gathered on every rank),
    on the host; replicated parameters as they are."""
    lay = getattr(p, "hpctp_layout", None)
    if lay is None:
        return p.detach().cpu().clone()
    return hpctp.DistTensor(p.detach(), grid, lay).gather(root=None).cpu()


def reference_linear(layer: torch.nn.Module, grid: hpctp.ProcessGrid, fin: int, fout: int) -> torch.nn.Linear:
    """Collective over grid. A float64 ``torch.nn.Linear(fin, fout)`` holding ``layer``'s gathered weight and bias."""
    ref = torch.nn.Linear(fin, fout, bias=layer.bias is not None, dtype=F64)
    with torch.no_grad():
        ref.weight.copy_(full_param(layer.weight, grid))
        if layer.bias is not None:
            ref.bias.copy_(full_param(layer.bias, grid))
    return ref


def param_block(p: torch.Tensor, full: torch.Tensor, grid: hpctp.ProcessGrid) -> torch.Tensor:
    """Local. This rank's block of the global ``full`` as parameter ``p`` is divided (all of it if replicated)."""
    lay = getattr(p, "hpctp_layout", None)
    return full if lay is None else full[lay.local_slices(grid.coords)]
