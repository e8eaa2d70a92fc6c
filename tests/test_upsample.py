"""Distributed Upsample tiles torch.nn.Upsample of the gathered field exactly (values and gradients)."""

from __future__ import annotations

import pytest
import torch

import hpctp
from hpctp.layout import Layout
from hpctp.nn.loss import global_sum
from hpctp.nn.upsample import Upsample, upsampled_layout
from hpctp.testing import assert_all, assert_allclose, assert_equal

F64 = torch.float64


def field(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def check(grid, layer, ref, shape, layout, scales, balanced=False, what="") -> None:  # type: ignore[no-untyped-def]
    x = field(shape, 1)
    out_layout = upsampled_layout(layout, scales, balanced)
    w = field(out_layout.global_shape, 2)
    xg = x.clone().requires_grad_(True)
    yg = ref(xg)
    (yg * w).sum().backward()
    xl = x[layout.local_slices(grid.coords)].clone().requires_grad_(True)
    y = layer(xl)
    osl = out_layout.local_slices(grid.coords)
    assert_allclose(grid, y.detach(), yg.detach()[osl], rtol=1e-10, atol=1e-12, what=f"{what} y")
    global_sum(y * w[osl], grid).backward()
    assert_allclose(grid, xl.grad, xg.grad[layout.local_slices(grid.coords)], rtol=1e-10, atol=1e-12, what=f"{what} dx")


@pytest.mark.mpi
def test_nearest_no_communication(grid2d) -> None:  # type: ignore[no-untyped-def]
    shape = (2, 3, 7, 9)
    layout = Layout(shape, grid2d.dims, (None, None, 0, 1))
    for scales in ((2, 2), (3, 1)):
        layer = Upsample(scales, "nearest", grid=grid2d, split=(0, 1))
        ref = torch.nn.Upsample(scale_factor=tuple(float(s) for s in scales), mode="nearest")
        x = field(shape, 3)[layout.local_slices(grid2d.coords)]
        with hpctp.CommCounter() as cc:
            y = layer(x)
        assert_equal(grid2d, cc.calls, {}, what="nearest must not communicate")
        assert_equal(grid2d, tuple(y.shape), upsampled_layout(layout, scales).local_shape(grid2d.coords))
        check(grid2d, layer, ref, shape, layout, scales, what=f"nearest {scales}")


@pytest.mark.mpi
@pytest.mark.parametrize("align_corners", [False, True])
def test_bilinear(grid2d, align_corners) -> None:  # type: ignore[no-untyped-def]
    shape = (2, 3, 7, 9)
    layout = Layout(shape, grid2d.dims, (None, None, 0, 1))
    layer = Upsample((2, 3), "bilinear", align_corners, grid=grid2d, split=(0, 1))
    ref = torch.nn.Upsample(scale_factor=(2.0, 3.0), mode="bilinear", align_corners=align_corners)
    check(grid2d, layer, ref, shape, layout, (2, 3), what=f"bilinear ac={align_corners}")


@pytest.mark.mpi
def test_bilinear_uneven_one_row_blocks_and_replicated_axis(grid2d) -> None:  # type: ignore[no-untyped-def]
    """Skewed explicit cuts (one-row blocks) along axis 0; W whole (replicas along grid axis 1)."""
    p = grid2d.dims[0]
    shape = (1, 2, p + 3, 5)
    cuts_h = tuple(range(p)) + (p + 3,)  # 1, 1, ..., 1, 4 rows
    layout = Layout(shape, grid2d.dims, (None, None, 0, None), (None, None, cuts_h, None))
    for ac in (False, True):
        layer = Upsample(2, "bilinear", ac, grid=grid2d, split=(0, None))
        ref = torch.nn.Upsample(scale_factor=2.0, mode="bilinear", align_corners=ac)
        check(grid2d, layer, ref, shape, layout, (2, 2), what=f"uneven ac={ac}")


@pytest.mark.mpi
def test_balanced_output_and_disttensor(grid2d) -> None:  # type: ignore[no-untyped-def]
    shape = (2, 2, 7, 5)
    layout = Layout(shape, grid2d.dims, (None, None, 0, 1))
    for mode in ("nearest", "bilinear"):
        layer = Upsample(2, mode, grid=grid2d, balanced=True)
        ref = torch.nn.Upsample(scale_factor=2.0, mode=mode)
        check(grid2d, layer, ref, shape, layout, (2, 2), balanced=True, what=f"balanced {mode}")
    x = field(shape, 4)
    dx = hpctp.distribute(x if grid2d.rank == 0 else None, grid2d, (None, None, 0, 1))
    dy = Upsample(2, "bilinear", grid=grid2d)(dx)
    want = torch.nn.Upsample(scale_factor=2.0, mode="bilinear")(x)
    assert_all(grid2d, isinstance(dy, hpctp.DistTensor) and dy.layout == upsampled_layout(dx.layout, (2, 2)), "layout")
    assert_allclose(grid2d, dy.local, want[dy.local_slices], rtol=1e-12)
    assert_allclose(grid2d, dy.gather(root=None), want, rtol=1e-12)


@pytest.mark.mpi
@pytest.mark.parametrize("mode,align_corners", [("trilinear", False), ("trilinear", True), ("nearest", None)])
def test_3d(grid3d, mode, align_corners) -> None:  # type: ignore[no-untyped-def]
    shape = (1, 2, 5, 4, 6)
    layout = Layout(shape, grid3d.dims, (None, None, 0, 1, 2))
    layer = Upsample((2, 1, 3), mode, align_corners, grid=grid3d, split=(0, 1, 2))
    ref = torch.nn.Upsample(scale_factor=(2.0, 1.0, 3.0), mode=mode, align_corners=align_corners)
    check(grid3d, layer, ref, shape, layout, (2, 1, 3), what=f"3d {mode} ac={align_corners}")


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["trilinear", "nearest"])
def test_spatial_split_starting_with_two_nones(grid1d, mode) -> None:  # type: ignore[no-untyped-def]
    """(None, None, 0) is a split of 3 spatial dims (as the conv layers read it) or of [N, C, W]."""
    shape = (1, 2, 3, 4, 7)
    layout = Layout(shape, grid1d.dims, (None, None, None, None, 0))
    layer = Upsample(2, mode, grid=grid1d, split=(None, None, 0))
    check(grid1d, layer, torch.nn.Upsample(scale_factor=2.0, mode=mode), shape, layout, (2, 2, 2), what=mode)
    if mode == "nearest":  # the same spec as a full split of a 1-D field [N, C, W]
        flat = Layout((2, 3, 7), grid1d.dims, (None, None, 0))
        check(grid1d, layer, torch.nn.Upsample(scale_factor=2.0, mode=mode), (2, 3, 7), flat, (2,), what="1-D")


@pytest.mark.mpi
def test_bad_arguments(grid2d) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="integer"):
        Upsample(1.5, grid=grid2d)
    with pytest.raises(ValueError, match="integer"):
        Upsample((2, 0), grid=grid2d)
    with pytest.raises(ValueError, match="mode"):
        Upsample(2, "bicubic", grid=grid2d)
    with pytest.raises(ValueError, match="align_corners"):
        Upsample(2, "nearest", True, grid=grid2d)
    with pytest.raises(ValueError, match="align_corners"):  # torch refuses any explicit value
        Upsample(2, "nearest", False, grid=grid2d)
    with pytest.raises(ValueError, match="disagree"):
        Upsample((2, 2, 2), "bilinear", grid=grid2d)
    with pytest.raises(ValueError, match="out of range"):
        Upsample(2, "bilinear", grid=grid2d, split=(0, 7))
    with pytest.raises(ValueError, match="spatial dims"):
        Upsample(2, "bilinear", grid=grid2d)(torch.zeros(1, 1, 2, 2, 2, dtype=F64))
    layout = Layout((1, 1, 8, 8), grid2d.dims, (None, None, 0, 1))
    with pytest.raises(ValueError, match="does not describe"):
        Upsample(2, grid=grid2d)(torch.zeros(1, 1, 9, 9, dtype=F64), layout=layout)
    if grid2d.size > 1:  # a bad block on the last rank only: every rank raises before the halo messages
        last = grid2d.rank == grid2d.size - 1
        for bad in (torch.zeros(1, 2, 2, dtype=F64), torch.zeros(1, 1, 2, 2, 2, dtype=F64)):
            with pytest.raises(ValueError, match="spatial|dims"):
                Upsample(2, "bilinear", grid=grid2d)(bad if last else torch.zeros(1, 1, 2, 2, dtype=F64))
        with pytest.raises(ValueError, match="does not describe"):
            blk = (
                torch.zeros(1, 1, 3, 4, dtype=F64)
                if last
                else torch.zeros(layout.local_shape(grid2d.coords), dtype=F64)
            )
            Upsample(2, "bilinear", grid=grid2d, balanced=True)(blk, layout=layout)
