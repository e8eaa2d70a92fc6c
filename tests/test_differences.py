"""hpctp.diff / hpctp.gradient (and np.diff / np.gradient) against numpy and torch on the gathered field."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers.checks import Checks
from helpers.tensors import SHAPE, as_numpy, check_gradient, global_array, make_tensor, splits_for

import hpctp
from hpctp.testing import assert_all, assert_allclose

STRETCHED = np.cumsum(np.linspace(0.5, 2.0, SHAPE[0]))  # coordinates along dim 0: a stretched mesh


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_diff_and_gradient_equal_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    with Checks(grid2d) as check:
        a = np.sin(global_array(SHAPE))
        for split, skew in itertools.product(splits_for(grid2d), (False, True)):
            x0 = make_tensor(grid2d, split, skew, backend)
            x = x0.with_local(x0.local * 0 + (torch.from_numpy(a) if backend == "torch" else a)[x0.local_slices])
            cases = {
                "diff": (np.diff(x), np.diff(a)),
                "diff n=2 axis=0": (hpctp.diff(x, 2, axis=0), np.diff(a, 2, axis=0)),
                "gradient axis=0": (np.gradient(x, axis=0), np.gradient(a, axis=0)),
                "gradient h, edge 2": (
                    np.gradient(x, 0.5, axis=1, edge_order=2),
                    np.gradient(a, 0.5, axis=1, edge_order=2),
                ),
                "gradient axis=(2, 0)": (
                    hpctp.gradient(x, 0.3, 2.0, axis=(2, 0)),
                    np.gradient(a, 0.3, 2.0, axis=(2, 0)),
                ),
            }
            for edge in (1, 2):  # coordinates: stretched, equally spaced (numpy's scalar path), ints; with a number
                spacings = (STRETCHED, np.linspace(0.0, 2.0, 5), np.arange(6) ** 2)
                cases[f"gradient coordinates, edge {edge}"] = (
                    np.gradient(x, *spacings, edge_order=edge),
                    np.gradient(a, *spacings, edge_order=edge),
                )
                cases[f"gradient coordinates and a number, edge {edge}"] = (
                    hpctp.gradient(x, 0.25, STRETCHED, axis=(1, 0), edge_order=edge),
                    np.gradient(a, 0.25, STRETCHED, axis=(1, 0), edge_order=edge),
                )
            for what, (got, want) in cases.items():
                got = got if isinstance(got, tuple) else (got,)
                want = want if isinstance(want, tuple) else (want,)
                check.true(len(got) == len(want), f"{what}: {len(got)} results, numpy {len(want)}")
                for g, w in zip(got, want):
                    check.allclose(as_numpy(g.gather(None)), w, rtol=1e-14, atol=1e-14, what=f"{what} {split} {skew}")
            every = hpctp.gradient(x, STRETCHED, 1.0, np.arange(6.0) ** 2, edge_order=2)
            layouts_kept = all(g.layout == x.layout for g in every)
            check.true(len(every) == 3 and layouts_kept, "one derivative per dim, each in the field's layout")
            for g, w in zip(every, np.gradient(a, STRETCHED, 1.0, np.arange(6.0) ** 2, edge_order=2)):
                check.allclose(as_numpy(g.gather(None)), w, rtol=1e-14, atol=1e-14, what=f"all axes {split} {skew}")


@pytest.mark.mpi
def test_gradient_of_ints_is_float(grid1d: hpctp.ProcessGrid) -> None:
    a = (np.arange(11) ** 2).astype(np.int64)
    x = hpctp.distribute(a if grid1d.rank == 0 else None, grid1d, (0,))
    g = np.gradient(x)
    assert_all(grid1d, g.dtype == np.float64, f"float64, got {g.dtype}")
    assert_allclose(grid1d, g.gather(None), np.gradient(a), rtol=0, atol=0)


@pytest.mark.mpi
def test_gradient_autograd_equals_torch(grid2d: hpctp.ProcessGrid) -> None:
    for skew, (dim, edge) in itertools.product((False, True), ((0, 1), (1, 2))):
        check_gradient(
            grid2d,
            lambda t, d=dim, e=edge: hpctp.gradient(t, 0.7, axis=d, edge_order=e),
            lambda t, d=dim, e=edge: torch.gradient(t, spacing=0.7, dim=d, edge_order=e)[0],
            skew,
            f"dim {dim} edge_order {edge}",
            atol=1e-12,
        )
        check_gradient(  # coordinates: torch.gradient's spacing as a coordinate tensor
            grid2d,
            lambda t, e=edge: hpctp.gradient(t, STRETCHED, axis=0, edge_order=e),
            lambda t, e=edge: torch.gradient(t, spacing=(torch.from_numpy(STRETCHED),), dim=0, edge_order=e)[0],
            skew,
            f"coordinates, edge_order {edge}",
            atol=1e-12,
        )


@pytest.mark.mpi
def test_difference_errors_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    x = make_tensor(grid2d, (0, 1, None), True)
    with pytest.raises(ValueError, match="edge_order must be 1 or 2"):
        np.gradient(x, edge_order=3)
    with pytest.raises(ValueError, match="too small along dim 0"):
        np.gradient(x[:2], axis=0, edge_order=2)
    with pytest.raises(ValueError, match="7 coordinates for dim 1 of length 5"):
        np.gradient(x, np.arange(7.0), axis=1)
    with pytest.raises(ValueError, match="scalars or 1d"):
        np.gradient(x, np.ones((7, 1)), axis=0)
    with pytest.raises(TypeError, match="not a DistTensor"):
        np.gradient(x, x[:, 0, 0], axis=0)
    with pytest.raises(TypeError, match="real number"):
        np.gradient(x, "1", axis=0)
    with pytest.raises(TypeError, match="2 spacings given for 3 axes"):
        np.gradient(x, 1.0, 2.0)
    with pytest.raises(ValueError, match="order must be non-negative"):
        np.diff(x, -1)
    with pytest.raises(TypeError, match="no prepend= or append="):
        np.diff(x, prepend=0.0)
    with pytest.raises(ValueError, match="axis 3 is out of range"):
        hpctp.diff(x, axis=3)


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_trapezoid_equals_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    with Checks(grid2d) as check:
        a = np.sin(global_array(SHAPE)) + 1.2
        for split, skew in itertools.product(splits_for(grid2d), (False, True)):
            x0 = make_tensor(grid2d, split, skew, backend)
            y = x0.with_local(x0.local * 0 + (torch.from_numpy(a) if backend == "torch" else a)[x0.local_slices])
            pts = y * 0.5 + 3.0  # sample points as a DistTensor of y's shape
            cases = {
                "dx": (np.trapezoid(y, dx=0.3, axis=0), np.trapezoid(a, dx=0.3, axis=0)),
                "default": (hpctp.trapezoid(y), np.trapezoid(a)),
                "1-D points": (np.trapezoid(y, STRETCHED, axis=0), np.trapezoid(a, STRETCHED, axis=0)),
                "points tensor": (np.trapezoid(y, pts, axis=1), np.trapezoid(a, a * 0.5 + 3.0, axis=1)),
                "one sample": (np.trapezoid(y[:1], STRETCHED[:1], axis=0), np.trapezoid(a[:1], STRETCHED[:1], axis=0)),
            }
            for what, (got, want) in cases.items():
                check.true(got.global_shape == want.shape, f"{what}: shape {got.global_shape}")
                check.allclose(as_numpy(got.gather(None)), want, rtol=1e-13, atol=0, what=f"{what} {split} {skew}")
        for skew in (False, True):
            check_gradient(
                grid2d,
                lambda t: hpctp.trapezoid(t, STRETCHED, axis=0),
                lambda t: torch.trapezoid(t, torch.from_numpy(STRETCHED), dim=0),
                skew,
                "trapezoid, 1-D points",
                atol=1e-12,
            )
        x = make_tensor(grid2d, (0, 1, None), True)
        with pytest.raises(ValueError, match="one point per sample"):
            hpctp.trapezoid(x, np.arange(4.0), axis=0)
        with pytest.raises(ValueError, match="sample points of shape"):
            hpctp.trapezoid(x, x[1:], axis=0)
