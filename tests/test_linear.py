"""Tensor-parallel linear layers: outputs and gradients against single-process torch (float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.linear import full_param, param_block, reference_linear

import hpctp
from hpctp.nn.linear import ColumnParallelLinear, Linear, Linear2D, RowParallelLinear
from hpctp.tensor.random import block_normal, block_uniform
from hpctp.testing import assert_all, assert_allclose

F64 = torch.float64


def _global(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.from_numpy(block_normal(shape, tuple((0, s) for s in shape), seed))


@pytest.mark.mpi
@pytest.mark.parametrize("batch,fin,fout,bias", [(5, 7, 6, True), (3, 2, 5, False), (1, 9, 4, True)])
def test_linear2d_matches_torch(grid2d, batch, fin, fout, bias):  # type: ignore[no-untyped-def]
    layer = Linear2D(fin, fout, grid2d, bias=bias, dtype=F64, panel=2, seed=5)
    ref = reference_linear(layer, grid2d, fin, fout)
    X, G = _global((batch, fin), 1), _global((batch, fout), 2)
    xr = X.clone().requires_grad_()
    (ref(xr) * G).sum().backward()
    xl = hpctp.Layout((batch, fin), grid2d.dims, (0, 1)).local_slices(grid2d.coords)
    yl = hpctp.Layout((batch, fout), grid2d.dims, (0, 1)).local_slices(grid2d.coords)
    x = X[xl].clone().requires_grad_()
    y = layer(x)
    (y * G[yl]).sum().backward()
    assert_allclose(grid2d, y.detach(), ref(X).detach()[yl], rtol=1e-12, atol=1e-14, what="output block")
    assert_allclose(grid2d, x.grad, xr.grad[xl], rtol=1e-12, atol=1e-14, what="input gradient")
    assert_allclose(
        grid2d, layer.weight.grad, param_block(layer.weight, ref.weight.grad, grid2d), rtol=1e-12, atol=1e-14
    )
    if bias:
        assert_allclose(grid2d, layer.bias.grad, param_block(layer.bias, ref.bias.grad, grid2d), rtol=1e-12, atol=1e-14)


@pytest.mark.mpi
@pytest.mark.parametrize("gather,scatter", [(False, False), (True, True)])
def test_column_row_mlp_matches_torch(grid2d, gather, scatter):  # type: ignore[no-untyped-def]
    """Megatron MLP: column-parallel -> tanh -> row-parallel, over each grid axis."""
    batch, fin, hidden, fout = 4, 5, 7, 3
    X, G = _global((batch, fin), 3), _global((batch, fout), 4)
    for axis in range(2):
        col = ColumnParallelLinear(fin, hidden, grid2d, axis=axis, gather_output=gather, dtype=F64, seed=1)
        row = RowParallelLinear(hidden, fout, grid2d, axis=axis, input_is_parallel=not scatter, dtype=F64, seed=2)
        r1, r2 = reference_linear(col, grid2d, fin, hidden), reference_linear(row, grid2d, hidden, fout)
        xr = X.clone().requires_grad_()
        (r2(torch.tanh(r1(xr))) * G).sum().backward()
        x = X.clone().requires_grad_()
        h = col(x)
        want_h = hidden if gather else col.weight.shape[0]
        assert_all(grid2d, h.shape == (batch, want_h), f"hidden block shape {tuple(h.shape)}")
        y = row(torch.tanh(h))
        (y * G).sum().backward()
        what = f"axis={axis} gather={gather} scatter={scatter}"
        assert_allclose(grid2d, y.detach(), r2(torch.tanh(r1(X))).detach(), rtol=1e-12, atol=1e-14, what=what)
        assert_allclose(grid2d, x.grad, xr.grad, rtol=1e-12, atol=1e-14, what=what)
        for layer, ref in ((col, r1), (row, r2)):
            assert_allclose(
                grid2d, layer.weight.grad, param_block(layer.weight, ref.weight.grad, grid2d), rtol=1e-12, what=what
            )
            assert_allclose(
                grid2d, layer.bias.grad, param_block(layer.bias, ref.bias.grad, grid2d), rtol=1e-12, what=what
            )


@pytest.mark.mpi
def test_column_parallel_on_1d_grid(grid1d):  # type: ignore[no-untyped-def]
    layer = ColumnParallelLinear(3, 5, grid1d, dtype=F64, gather_output=True)
    ref = reference_linear(layer, grid1d, 3, 5)
    X = _global((2, 3), 6)
    x, xr = X.clone().requires_grad_(), X.clone().requires_grad_()
    (layer(x) ** 2).sum().backward()
    (ref(xr) ** 2).sum().backward()
    assert_allclose(grid1d, x.grad, xr.grad, rtol=1e-12)
    assert_allclose(grid1d, layer.weight.grad, param_block(layer.weight, ref.weight.grad, grid1d), rtol=1e-12)


@pytest.mark.mpi
def test_init_is_grid_independent(grid2d):  # type: ignore[no-untyped-def]
    fin, fout, seed = 6, 5, 9
    want_w = block_uniform((fout, fin), ((0, fout), (0, fin)), seed, -1 / np.sqrt(fin), 1 / np.sqrt(fin))
    layers = [
        ColumnParallelLinear(fin, fout, grid2d, axis=1, seed=seed, dtype=F64),
        RowParallelLinear(fin, fout, grid2d, axis=0, seed=seed, dtype=F64),
        Linear2D(fin, fout, grid2d, seed=seed, dtype=F64),
    ]
    biases = [full_param(layer.bias, grid2d) for layer in layers]
    for layer in layers:
        assert_allclose(grid2d, full_param(layer.weight, grid2d), want_w, rtol=0, atol=0, what=type(layer).__name__)
        lay = layer.weight.hpctp_layout
        assert_all(grid2d, tuple(layer.weight.shape) == lay.local_shape(grid2d.coords), "weight block shape")
        assert_all(grid2d, lay.global_shape == (fout, fin) and lay.grid_dims == grid2d.dims, str(lay))
    for b in biases[1:]:
        assert_allclose(grid2d, b, biases[0], rtol=0, atol=0, what="bias")
    assert_all(grid2d, not hasattr(layers[1].bias, "hpctp_layout"), "row-parallel bias is replicated")
    assert_all(grid2d, layers[2].bias.hpctp_layout.split == (1,), "Linear2D bias follows Y's columns")
    assert_all(grid2d, not torch.allclose(biases[0][:1], torch.from_numpy(want_w[0, :1])), "bias stream differs")


@pytest.mark.mpi
def test_float32_and_factory(grid2d):  # type: ignore[no-untyped-def]
    layer = Linear(8, 6, grid2d, mode="2d", seed=3)
    assert_all(grid2d, isinstance(layer, Linear2D) and layer.weight.dtype == torch.float32, repr(layer))
    assert_all(grid2d, isinstance(Linear(8, 6, grid2d, mode="row"), RowParallelLinear), "row")
    assert_all(grid2d, isinstance(Linear(8, 6, grid2d), ColumnParallelLinear), "column")
    X = _global((4, 8), 7).float()
    xl = hpctp.Layout((4, 8), grid2d.dims, (0, 1)).local_slices(grid2d.coords)
    yl = hpctp.Layout((4, 6), grid2d.dims, (0, 1)).local_slices(grid2d.coords)
    ref = (X.double() @ full_param(layer.weight, grid2d).double().T + full_param(layer.bias, grid2d).double()).float()
    assert_allclose(grid2d, layer(X[xl].contiguous()).detach(), ref[yl], rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_errors(grid1d, grid2d):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="2-D grid"):
        Linear2D(4, 4, grid1d)
    with pytest.raises(ValueError, match="mode"):
        Linear(4, 4, grid2d, mode="diagonal")
    with pytest.raises(ValueError, match="axis"):
        ColumnParallelLinear(4, 4, grid2d, axis=2)
    with pytest.raises(ValueError, match="in_features"):
        RowParallelLinear(0, 4, grid2d)
    with pytest.raises(TypeError, match="ProcessGrid"):
        Linear2D(4, 4, "grid")  # type: ignore[arg-type]
    layer = Linear2D(4, 5, grid2d, dtype=F64)
    bad_cols = layer.weight.shape[1] + (1 if grid2d.rank == 0 else 0)
    with pytest.raises(ValueError, match="last dim"):  # a wrong block on one rank only: all ranks raise
        layer(torch.zeros(2, bad_cols, dtype=F64))
    with pytest.raises(TypeError, match="dtype|float"):
        layer(torch.zeros(2, layer.weight.shape[1], dtype=torch.float32))
    row = RowParallelLinear(5, 2, grid2d, axis=1, dtype=F64)
    with pytest.raises(ValueError, match="last dim"):
        row(torch.zeros(3, row.weight.shape[1] + (1 if grid2d.coords[1] == 0 else 0), dtype=F64))
    col = ColumnParallelLinear(4, 6, grid2d, axis=1, gather_output=True, dtype=F64)
    with pytest.raises(ValueError, match="last dim"):  # one rank of the axis wrong: none waits in the gather
        col(torch.zeros(3, 4 + (1 if grid2d.coords[1] == grid2d.dims[1] - 1 else 0), dtype=F64))
    if grid2d.dims[1] > 1:
        with pytest.raises(ValueError, match="same rows of X"):  # batch rows differ along a grid row
            layer(torch.zeros(2 + grid2d.coords[1], layer.weight.shape[1], dtype=F64))


@pytest.mark.mpi
def test_sync_gradients_leaves_completed_linear_gradients_alone(grid1d):  # type: ignore[no-untyped-def]
    """Tensor-parallel layers complete their gradients in backward; one sync_gradients over
    the grid (as needed by spatially partitioned layers in the same model) must not sum them again."""
    from hpctp.nn import sync_gradients

    col = ColumnParallelLinear(5, 7, grid1d, dtype=F64, seed=1)
    row = RowParallelLinear(7, 3, grid1d, dtype=F64, seed=2)
    r1, r2 = reference_linear(col, grid1d, 5, 7), reference_linear(row, grid1d, 7, 3)
    X = _global((4, 5), 3)
    (row(torch.tanh(col(X))) ** 2).sum().backward()
    (r2(torch.tanh(r1(X))) ** 2).sum().backward()
    sync_gradients(torch.nn.ModuleList([col, row]), grid1d)
    for layer, ref in ((col, r1), (row, r2)):
        assert_allclose(grid1d, layer.weight.grad, param_block(layer.weight, ref.weight.grad, grid1d), rtol=1e-12)
        assert_allclose(grid1d, layer.bias.grad, param_block(layer.bias, ref.bias.grad, grid1d), rtol=1e-12)
