"""Distributed BatchNorm / GroupNorm equal single-process torch on the gathered field."""

from __future__ import annotations

import pytest
import torch

import hpctp
import hpctp.nn.norm as N
from hpctp.layout import Layout
from hpctp.nn.loss import global_sum
from hpctp.nn.parallel import sync_gradients
from hpctp.testing import assert_all, assert_allclose

F64 = torch.float64
RTOL = 1e-10


def field(shape: tuple[int, ...], seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64) * scale + shift


def block(t: torch.Tensor, grid: hpctp.ProcessGrid, layout: Layout) -> torch.Tensor:
    return t[layout.local_slices(grid.coords)].clone()


def check_step(grid, layer, ref, shape, layout, seed, what) -> None:  # type: ignore[no-untyped-def]
    """Forward + backward of layer (distributed) and ref (global); compare y, dx, dparams."""
    x = field(shape, seed, scale=2.0, shift=3.0)
    w = field(shape, seed + 1000)
    xg = x.clone().requires_grad_(True)
    y_ref = ref(xg)
    (y_ref * w).sum().backward()
    xl = block(x, grid, layout).requires_grad_(True)
    y = layer(xl)
    assert_allclose(
        grid, y.detach(), y_ref.detach()[layout.local_slices(grid.coords)], rtol=RTOL, atol=1e-12, what=f"{what} y"
    )
    layer.zero_grad()
    global_sum(y * block(w, grid, layout), grid).backward()
    sync_gradients(layer, grid)
    assert_allclose(grid, xl.grad, xg.grad[layout.local_slices(grid.coords)], rtol=RTOL, atol=1e-12, what=f"{what} dx")
    for (name, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters(), strict=True):
        assert_allclose(grid, p.grad, q.grad, rtol=RTOL, atol=1e-12, what=f"{what} d{name}")
    ref.zero_grad()


def make_pair(cls, ref_cls, grid, split, *args, **kw):  # type: ignore[no-untyped-def]
    layer = cls(*args, grid=grid, split=split, dtype=F64, **kw)
    ref = ref_cls(*args, dtype=F64, **kw)
    with torch.no_grad():
        if ref.weight is not None:
            ref.weight.copy_(1.0 + 0.1 * torch.arange(ref.weight.numel(), dtype=F64))
            ref.bias.copy_(0.2 * torch.arange(ref.bias.numel(), dtype=F64) - 0.3)
    layer.load_state_dict(ref.state_dict())
    return layer, ref


def check_running(grid, layer, ref, what) -> None:  # type: ignore[no-untyped-def]
    assert_allclose(grid, layer.running_mean, ref.running_mean, rtol=RTOL, what=f"{what} running_mean")
    assert_allclose(grid, layer.running_var, ref.running_var, rtol=RTOL, what=f"{what} running_var")
    assert_all(grid, int(layer.num_batches_tracked) == int(ref.num_batches_tracked), "num_batches_tracked")


@pytest.mark.mpi
@pytest.mark.parametrize("split", [(0, 1), (1, 0)])
def test_batchnorm2d_train_eval(grid2d, split) -> None:  # type: ignore[no-untyped-def]
    shape = (2, 3, 7, 9)
    layout = Layout(shape, grid2d.dims, (None, None, *split))
    layer, ref = make_pair(N.BatchNorm2d, torch.nn.BatchNorm2d, grid2d, split, 3)
    for step in range(3):
        check_step(grid2d, layer, ref, shape, layout, 10 * step, f"train step {step}")
        check_running(grid2d, layer, ref, f"step {step}")
    layer.eval()
    ref.eval()
    check_step(grid2d, layer, ref, shape, layout, 99, "eval")
    check_running(grid2d, layer, ref, "after eval")


@pytest.mark.mpi
def test_batchnorm2d_options_uneven_cuts(grid2d) -> None:  # type: ignore[no-untyped-def]
    """momentum=None (cumulative average), no affine, skewed explicit cuts, eval without running stats."""
    shape = (3, 2, 6, 5)
    dims = grid2d.dims
    # skewed blocks: coordinate 0 holds one row/column, the rest share the remainder
    cuts_h = (
        (0,) + tuple(1 + round(i * 5 / max(dims[0] - 1, 1)) for i in range(dims[0] - 1)) + (6,) if dims[0] > 1 else None
    )
    cuts_w = (
        (0,) + tuple(1 + round(i * 4 / max(dims[1] - 1, 1)) for i in range(dims[1] - 1)) + (5,) if dims[1] > 1 else None
    )
    layout = Layout(shape, dims, (None, None, 0, 1), (None, None, cuts_h, cuts_w))
    layer, ref = make_pair(N.BatchNorm2d, torch.nn.BatchNorm2d, grid2d, (0, 1), 2, momentum=None, affine=False)
    for step in range(2):
        check_step(grid2d, layer, ref, shape, layout, 5 + step, f"cma step {step}")
    check_running(grid2d, layer, ref, "cma")
    nostats, ref2 = make_pair(N.BatchNorm2d, torch.nn.BatchNorm2d, grid2d, (0, 1), 2, track_running_stats=False)
    nostats.eval()
    ref2.eval()
    check_step(grid2d, nostats, ref2, shape, layout, 7, "eval without running stats")


@pytest.mark.mpi
def test_batchnorm3d(grid3d) -> None:  # type: ignore[no-untyped-def]
    shape = (2, 2, 5, 4, 6)
    split = (0, 1, 2)
    layout = Layout(shape, grid3d.dims, (None, None, *split))
    layer, ref = make_pair(N.BatchNorm3d, torch.nn.BatchNorm3d, grid3d, split, 2, momentum=0.3)
    for step in range(2):
        check_step(grid3d, layer, ref, shape, layout, 20 + step, f"3d step {step}")
        check_running(grid3d, layer, ref, f"3d step {step}")
    layer.eval()
    ref.eval()
    check_step(grid3d, layer, ref, shape, layout, 29, "3d eval")


@pytest.mark.mpi
def test_batchnorm_replicated_grid_axis(grid2d) -> None:  # type: ignore[no-untyped-def]
    """Field split over grid axis 0 only: ranks along axis 1 hold replicas, counted once."""
    shape = (2, 3, 7, 4)
    layout = Layout(shape, grid2d.dims, (None, None, 0, None))
    layer, ref = make_pair(N.BatchNorm2d, torch.nn.BatchNorm2d, grid2d, (0, None), 3)
    x = field(shape, 3)
    y = layer(block(x, grid2d, layout))
    assert_allclose(grid2d, y.detach(), ref(x).detach()[layout.local_slices(grid2d.coords)], rtol=RTOL, atol=1e-12)
    check_running(grid2d, layer, ref, "replicated axis")


@pytest.mark.mpi
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_groupnorm(grid2d, groups) -> None:  # type: ignore[no-untyped-def]
    shape = (2, 4, 7, 9)
    layout = Layout(shape, grid2d.dims, (None, None, 0, 1))
    layer, ref = make_pair(N.GroupNorm, torch.nn.GroupNorm, grid2d, (0, 1), groups, 4)
    check_step(grid2d, layer, ref, shape, layout, 40 + groups, f"groupnorm G={groups}")
    layer.eval()
    ref.eval()
    check_step(grid2d, layer, ref, shape, layout, 50, "groupnorm eval")


@pytest.mark.mpi
def test_groupnorm_3d(grid3d) -> None:  # type: ignore[no-untyped-def]
    shape = (2, 4, 4, 5, 3)
    layout = Layout(shape, grid3d.dims, (None, None, 2, 0, 1))
    layer, ref = make_pair(N.GroupNorm, torch.nn.GroupNorm, grid3d, (2, 0, 1), 2, 4, eps=1e-3)
    check_step(grid3d, layer, ref, shape, layout, 60, "groupnorm 3d")


@pytest.mark.mpi
def test_bad_inputs(grid2d) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="split"):
        N.BatchNorm2d(3, grid=grid2d, split=(0,))
    with pytest.raises(ValueError, match="more than one"):
        N.BatchNorm2d(3, grid=grid2d, split=(0, 0))
    with pytest.raises(ValueError, match="out of range"):
        N.GroupNorm(1, 3, grid=grid2d, split=(0, 5))
    with pytest.raises(ValueError, match="batch and channel"):
        N.BatchNorm2d(3, grid=grid2d, split=(0, None, 1, None))
    with pytest.raises(TypeError, match="ProcessGrid"):
        N.BatchNorm2d(3, grid="grid", split=(0, 1))  # type: ignore[arg-type]
    bn = N.BatchNorm2d(3, grid=grid2d, split=(0, 1), dtype=F64)
    with pytest.raises(ValueError, match="channels"):
        bn(torch.zeros(2, 4, 3, 3, dtype=F64))
    with pytest.raises(ValueError, match="4-D"):
        bn(torch.zeros(2, 3, 3, dtype=F64))
    # a global field with one value per channel cannot be normalised in training
    layout = Layout((1, 3, 1, 1), grid2d.dims, (None, None, 0, 1))
    with pytest.raises(ValueError, match="more than 1 value"):
        bn(torch.zeros(layout.local_shape(grid2d.coords), dtype=F64))
    if grid2d.size > 1:  # a bad block on the last rank only: every rank raises, none waits in the statistics
        last = grid2d.rank == grid2d.size - 1
        for layer in (bn, N.GroupNorm(3, 3, grid=grid2d, split=(0, 1), dtype=F64)):
            with pytest.raises(ValueError, match="channels|shape"):
                layer(torch.zeros(2, 4 if last else 3, 2, 2, dtype=F64))
    dx = hpctp.zeros((2, 3, 4, 4), grid2d, (None, None, 1, 0), like="torch")  # split unlike the layers'
    for layer in (bn, N.GroupNorm(3, 3, grid=grid2d, split=(0, 1), dtype=F64)):
        with pytest.raises(ValueError, match=r"input split \(None, None, 1, 0\) differs from the layer's split"):
            layer(dx)


@pytest.mark.mpi
def test_plain_blocks_that_do_not_tile_raise_on_every_rank(grid2d) -> None:  # type: ignore[no-untyped-def]
    """Plain blocks must tile one global field: another batch size or a spatial size that breaks
    the tiling on one rank is refused on every rank (the statistics would be silently wrong, and
    GroupNorm's per-sample messages would not match)."""
    last = grid2d.rank == grid2d.size - 1  # on one rank, the only rank: any block tiles
    layers = (
        N.BatchNorm2d(3, grid=grid2d, split=(0, 1), dtype=F64),
        N.GroupNorm(3, 3, grid=grid2d, split=(0, 1), dtype=F64),
    )
    for layer in layers if grid2d.size > 1 else ():
        with pytest.raises(ValueError, match=r"dim 0 is not split but its local size differs between ranks: \[2, 3\]"):
            layer(torch.ones(3 if last else 2, 3, 2, 2, dtype=F64))
        with pytest.raises(ValueError, match="blocks do not tile"):  # the last rank's spatial block is off
            layer(torch.ones(2, 3, 3 if last else 2, 3 if last else 2, dtype=F64))
    bn = layers[0].eval()  # eval with running statistics stays local: any batch size on any rank
    y = bn(torch.ones(3 if last else 2, 3, 2, 2, dtype=F64))
    assert_all(grid2d, y.shape[0] == (3 if last else 2), "eval BatchNorm is local")


@pytest.mark.mpi
def test_low_precision_and_empty_batch_as_torch(grid2d) -> None:  # type: ignore[no-untyped-def]
    """bf16 input with float32 parameters gives bf16 (train and eval); GroupNorm of N=0 is empty."""
    shape = (2, 3, 4, 5)
    layout = Layout(shape, grid2d.dims, (None, None, 0, 1))
    x = field(shape, 3).to(torch.bfloat16)
    for layer in (N.BatchNorm2d(3, grid=grid2d), N.GroupNorm(3, 3, grid=grid2d)):
        for train in (True, False):
            y = layer.train(train)(block(x, grid2d, layout))
            assert_all(grid2d, y.dtype == torch.bfloat16, f"{type(layer).__name__} train={train}: {y.dtype}")
    gn, ref = N.GroupNorm(3, 3, grid=grid2d, dtype=F64), torch.nn.GroupNorm(3, 3, dtype=F64)
    e = torch.zeros(0, 3, 2, 2, dtype=F64, requires_grad=True)
    y = gn(e)
    y.sum().backward()
    assert_all(grid2d, y.shape == ref(e).shape and e.grad is not None and e.grad.shape == e.shape, "empty batch")


@pytest.mark.mpi
def test_default_split_and_disttensor_input(grid2d) -> None:  # type: ignore[no-untyped-def]
    """split=None means spatial dim i over grid axis i; a DistTensor input gives a DistTensor."""
    shape = (2, 3, 5, 6)
    x = field(shape, 8)
    dx = hpctp.distribute(x if grid2d.rank == 0 else None, grid2d, (None, None, 0, 1))
    for layer, ref in (
        (N.BatchNorm2d(3, grid=grid2d, dtype=F64), torch.nn.BatchNorm2d(3, dtype=F64)),
        (N.GroupNorm(3, 3, grid=grid2d, split=(None, None, 0, 1), dtype=F64), torch.nn.GroupNorm(3, 3, dtype=F64)),
    ):
        y = layer(dx)
        assert_all(grid2d, isinstance(y, hpctp.DistTensor) and y.layout == dx.layout, "DistTensor out")
        assert_allclose(grid2d, y.local.detach(), ref(x).detach()[dx.local_slices], rtol=RTOL, atol=1e-12)


def test_float32_large_mean_is_stable() -> None:
    """Float32 data far from zero: statistics (Chan's combination) stay close to float64 ones."""
    from mpi4py import MPI

    grid = hpctp.ProcessGrid((1, 1), comm=MPI.COMM_SELF)
    x = (field((4, 2, 16, 16), 1) * 0.01 + 1000.0).float()
    bn = N.BatchNorm2d(2, grid=grid, split=(0, 1))
    ref = torch.nn.BatchNorm2d(2, dtype=F64)
    y, y64 = bn(x), ref(x.double())
    torch.testing.assert_close(y.double(), y64.detach(), rtol=0, atol=5e-3)  # float32 rounding of x and mean
    torch.testing.assert_close(bn.running_var.double(), ref.running_var, rtol=1e-3, atol=0)
    grid.free()
