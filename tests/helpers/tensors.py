"""A small DistTensor with known values for the tensor-function tests, and checks against numpy/torch."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

import hpctp
from helpers.layouts import make_layout
from hpctp.testing import assert_allclose

SHAPE = (7, 5, 6)


def global_array(shape: tuple[int, ...]) -> np.ndarray:
    """Local. The global values of the test tensors: ``arange * 0.5 - 7`` (float64, signs mixed)."""
    return np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) * 0.5 - 7.0


def make_tensor(
    grid: hpctp.ProcessGrid, split: tuple[int | None, ...], skew: bool, backend: str = "numpy"
) -> hpctp.DistTensor:
    """Local. ``global_array(SHAPE)`` as a DistTensor divided as ``split`` (skewed blocks if ``skew``)
    with ``backend`` blocks; each rank takes its part of the same global array, no communication."""
    lay = make_layout(grid, SHAPE, split, skew)
    x = hpctp.DistTensor(global_array(SHAPE)[lay.local_slices(grid.coords)].copy(), grid, lay)
    return x.to(backend)


def as_numpy(x: object) -> np.ndarray:
    """Local. A gathered result (numpy array or CPU torch tensor) as a numpy array."""
    return x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def with_values(x: hpctp.DistTensor, a: np.ndarray) -> hpctp.DistTensor:
    """Local. ``x``'s layout and backend holding the global array ``a`` (each rank its part)."""
    block = np.ascontiguousarray(a[x.local_slices])
    return x.with_local(torch.from_numpy(block) if x.backend == "torch" else block)


def splits_for(grid: hpctp.ProcessGrid) -> list[tuple[int | None, ...]]:
    """Local. The splits of a 3-dim tensor the tests try on ``grid``: undivided, dims in grid-axis
    order, and the first two grid axes reversed over dims 1 and 2."""
    axes = list(range(grid.ndim))
    out = [(None,) * 3]
    out += [tuple(axes[:3]) + (None,) * (3 - min(3, grid.ndim))]
    out += [(None,) + tuple(reversed(axes[:2])) + (None,) * (2 - min(2, grid.ndim))]
    return out


def check_gradient(
    grid: hpctp.ProcessGrid,
    op: Callable[[hpctp.DistTensor], hpctp.DistTensor],
    ref_op: Callable[[torch.Tensor], torch.Tensor],
    skew: bool,
    what: str,
    atol: float = 0.0,
) -> None:
    """Collective over grid. d/dX sum(W * op(X)) on the blocks of X (dims 0 and 1 divided, torch) equals
    torch's d/dX sum(W * ref_op(X)) on the gathered tensor (float64, 1e-12 relative)."""
    x = make_tensor(grid, (0, 1, None), skew, "torch")
    x.local.requires_grad_(True)
    y = op(x)
    ref = torch.from_numpy(global_array(SHAPE)).requires_grad_(True)
    want = ref_op(ref)
    w = torch.cos(torch.arange(want.numel(), dtype=torch.float64)).reshape(want.shape)
    (y.local * w[y.local_slices]).sum().backward()
    (want * w).sum().backward()
    assert_allclose(grid, x.local.grad, ref.grad[x.local_slices], rtol=1e-12, atol=atol, what=f"{what} skew={skew}")
