"""LayerNorm / RMSNorm with the hidden dim split over a grid axis, against torch in one process (float64)."""

from __future__ import annotations

import pytest
import torch
from helpers.agreement import count_agreements
from helpers.layouts import skewed_cuts
from helpers.linear import param_block
from helpers.transformer import F64, normal

from hpctp.layout import block_cuts
from hpctp.nn.layer_norm import LayerNorm, RMSNorm
from hpctp.testing import assert_all, assert_allclose

RTOL, ATOL = 1e-10, 1e-12


def _compare(grid, layer, ref, shape, cuts, what):  # type: ignore[no-untyped-def]
    """Forward, input gradient and affine gradients of ``layer`` on this rank's block of the last dim."""
    X, G = normal(shape, 1), normal(shape, 2)
    r = grid.coords[layer.axis] if layer.axis is not None else 0
    sl = (..., slice(cuts[r], cuts[r + 1]))
    x = X[sl].clone().requires_grad_()
    y = layer(x)
    (y * G[sl]).sum().backward()
    xr = X.clone().requires_grad_()
    yr = ref(xr)
    (yr * G).sum().backward()
    assert_allclose(grid, y.detach(), yr.detach()[sl], rtol=RTOL, atol=ATOL, what=f"{what} forward")
    assert_allclose(grid, x.grad, xr.grad[sl], rtol=RTOL, atol=ATOL, what=f"{what} input grad")
    for name, p in layer.named_parameters():
        want = param_block(p, dict(ref.named_parameters())[name].grad, grid)
        assert_allclose(grid, p.grad, want, rtol=RTOL, atol=ATOL, what=f"{what} {name} grad")


@pytest.mark.mpi
@pytest.mark.parametrize("skew", [False, True])
def test_layer_norm_split_hidden_matches_torch(grid2d, skew):  # type: ignore[no-untyped-def]
    """Hidden dim 10 split over each grid axis (uneven: 3, 4, 6 ranks; skewed cuts leave 1 feature on rank 0)."""
    for axis in range(2):
        p = grid2d.dims[axis]
        cuts = skewed_cuts(10, p) if skew else block_cuts(10, p)
        for shape, norm in (((2, 7, 10), (10,)), ((3, 4, 10), (4, 10))):
            layer = LayerNorm(norm, grid2d, axis=axis, eps=1e-5, cuts=cuts, dtype=F64)
            ref = torch.nn.LayerNorm(norm, eps=1e-5, dtype=F64)
            with torch.no_grad():  # non-trivial affine parameters
                w, b = normal(norm, 3), normal(norm, 4)
                ref.weight.copy_(w)
                ref.bias.copy_(b)
                layer.weight.copy_(param_block(layer.weight, w, grid2d))
                layer.bias.copy_(param_block(layer.bias, b, grid2d))
            _compare(grid2d, layer, ref, shape, cuts, f"LayerNorm axis={axis} {norm}")


@pytest.mark.mpi
def test_rms_norm_split_hidden_matches_torch(grid1d, grid2d):  # type: ignore[no-untyped-def]
    for grid in (grid1d, grid2d):
        for axis in range(grid.ndim):
            cuts = block_cuts(10, grid.dims[axis])
            for eps in (None, 1e-6):
                layer = RMSNorm(10, grid, axis=axis, eps=eps, dtype=F64)
                ref = torch.nn.RMSNorm(10, eps=eps, dtype=F64)
                with torch.no_grad():
                    w = normal((10,), 5)
                    ref.weight.copy_(w)
                    layer.weight.copy_(param_block(layer.weight, w, grid))
                _compare(grid, layer, ref, (2, 7, 10), cuts, f"RMSNorm grid={grid.dims} axis={axis} eps={eps}")


@pytest.mark.mpi
def test_whole_hidden_is_torch(grid1d):  # type: ignore[no-untyped-def]
    """axis=None: the local block's rows are normalised as torch does (here the rows split over the grid)."""
    for layer, ref in (
        (LayerNorm(10, grid1d, dtype=F64, elementwise_affine=False), torch.nn.LayerNorm(10, elementwise_affine=False)),
        (LayerNorm(10, grid1d, dtype=F64, bias=False), torch.nn.LayerNorm(10, bias=False, dtype=F64)),
        (RMSNorm(10, grid1d, dtype=F64), torch.nn.RMSNorm(10, dtype=F64)),
    ):
        rows = slice(*block_cuts(7, grid1d.size)[grid1d.rank : grid1d.rank + 2])
        X = normal((7, 10), 6)
        x = X[rows].clone().requires_grad_()
        xr = X.clone().requires_grad_()
        layer(x).pow(2).sum().backward()
        ref(xr).pow(2).sum().backward()
        assert_allclose(grid1d, layer(X[rows]).detach(), ref(X).detach()[rows], rtol=RTOL, atol=ATOL)
        assert_allclose(grid1d, x.grad, xr.grad[rows], rtol=RTOL, atol=ATOL)
        assert_all(grid1d, all(not hasattr(p, "hpctp_layout") for p in layer.parameters()), "replicated parameters")


@pytest.mark.mpi
def test_split_parameters_and_float32(grid1d):  # type: ignore[no-untyped-def]
    layer = LayerNorm(10, grid1d, axis=0)
    lay = layer.weight.hpctp_layout
    assert_all(grid1d, lay.global_shape == (10,) and lay.split == (0,), f"layout {lay}")
    assert_all(grid1d, layer.weight.dtype == torch.float32 and bool((layer.weight == 1).all()), "ones")
    X = normal((2, 3, 10), 7).float()
    sl = (..., slice(*block_cuts(10, grid1d.size)[grid1d.rank : grid1d.rank + 2]))
    ref = torch.nn.functional.layer_norm(X, (10,))
    assert_allclose(grid1d, layer(X[sl]).detach(), ref[sl], rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_agreement_once_per_shape(grid1d, monkeypatch):  # type: ignore[no-untyped-def]
    calls = count_agreements(monkeypatch)
    layer = LayerNorm(10, grid1d, axis=0, dtype=F64)
    n = layer.weight.shape[0]
    for rows in (3, 3, 5, 3):
        layer(torch.ones(rows, n, dtype=F64))
    assert_all(grid1d, calls == ["LayerNorm", "LayerNorm"], f"agreements {calls}: once per input shape")


@pytest.mark.mpi
def test_errors(grid1d):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="normalized_shape"):
        LayerNorm(0, grid1d)
    with pytest.raises(ValueError, match="axis"):
        LayerNorm(4, grid1d, axis=1)
    with pytest.raises(ValueError, match="cuts"):
        LayerNorm(4, grid1d, axis=0, cuts=(0, 5))
    with pytest.raises(ValueError, match="cuts needs axis"):
        RMSNorm(4, grid1d, cuts=(0, 4))
    layer = LayerNorm(10, grid1d, axis=0, dtype=F64)
    n = layer.weight.shape[0] + (1 if grid1d.rank == grid1d.size - 1 else 0)
    with pytest.raises(ValueError, match="last dims"):  # one rank wrong: every rank raises, none waits
        layer(torch.zeros(2, n, dtype=F64))
    rows = 2 + (1 if grid1d.rank == 0 else 0)
    if grid1d.size > 1:
        with pytest.raises(ValueError, match="differ"):  # leading dims differ along the axis
            layer(torch.zeros(rows, layer.weight.shape[0], dtype=F64))
