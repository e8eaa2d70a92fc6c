"""A partitioned layer against torch on the gathered field: output, input gradient, parameter gradients."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

import hpctp
from helpers.layouts import make_layout
from hpctp.comm import allreduce
from hpctp.testing import assert_all, assert_allclose, assert_equal

RTOL = 1e-10


def global_field(shape: Sequence[int], seed: int) -> torch.Tensor:
    """Local. A float64 standard-normal field of ``shape`` from torch's generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def compare_layer(
    grid: hpctp.ProcessGrid,
    layer: Callable[[hpctp.DistTensor], hpctp.DistTensor],
    ref: Callable[[torch.Tensor], torch.Tensor],
    shape: Sequence[int],
    split: Sequence[int | None],
    params: Sequence[torch.Tensor] = (),
    ref_params: Sequence[torch.Tensor] = (),
    skew: bool = False,
    sync: torch.nn.Module | None = None,
    device: str = "cpu",
) -> hpctp.DistTensor:
    """Collective over grid. Forward and backward of ``layer`` on this rank's block vs ``ref`` on the whole field.

    Checks the output block, the input gradient block and the parameter gradients summed
    over the grid (float64, rtol 1e-10), collectively: with ``hpctp.nn.sync_gradients(sync)``
    if a module is given, else by a plain all-reduce of each gradient. With ``device``
    (``layer`` already moved there) the input block lives on that device and the output
    and every gradient must stay there; ``ref`` runs on the host.
    """
    layout = make_layout(grid, shape, split, skew)
    X = global_field(shape, 1)
    x = X[layout.local_slices(grid.coords)].clone().to(device).requires_grad_()
    y = layer(hpctp.DistTensor(x, grid, layout))
    on = torch.device(device).type
    assert_all(grid, y.local.device.type == on, f"output on {y.local.device}, expected {on}")
    Xr = X.clone().requires_grad_()
    R = ref(Xr)
    assert_equal(grid, np.array(y.global_shape), np.array(R.shape), "global output shape")
    sl = y.layout.local_slices(grid.coords)
    assert_allclose(grid, y.local.detach(), R.detach()[sl], rtol=RTOL, atol=1e-12, what="forward")
    GY = global_field(R.shape, 2)
    (y.local * GY[sl].to(device)).sum().backward()
    (R * GY).sum().backward()
    assert_all(grid, x.grad is not None and x.grad.device.type == on, "input gradient on the input's device")
    assert_allclose(grid, x.grad, Xr.grad[layout.local_slices(grid.coords)], rtol=RTOL, atol=1e-12, what="input grad")
    if sync is not None:
        hpctp.nn.sync_gradients(sync, grid)
    for p, q in zip(params, ref_params):
        assert_all(grid, p.grad.device.type == on, f"parameter gradient on {p.grad.device}, expected {on}")
        g = p.grad.detach().clone().contiguous()
        if sync is None:
            allreduce(grid.comm, g, "sum")
        assert_allclose(grid, g, q.grad, rtol=RTOL, atol=1e-11, what="parameter grad (sum over ranks)")
    return y
