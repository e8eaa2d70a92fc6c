"""var / std / any / all of DistTensors (and np.var, np.std, np.any, np.all) against numpy on
the gathered tensor, and torch.var / torch.std for gradients."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
from helpers.checks import Checks
from helpers.tensors import SHAPE, as_numpy, check_gradient, global_array, make_tensor, splits_for, with_values

import hpctp


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_var_std_equal_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    with Checks(grid2d) as check:
        base = np.sin(global_array(SHAPE)) * 3 + 1
        data = {
            "float64": base,
            "int64": (np.arange(np.prod(SHAPE)).reshape(SHAPE) * 7919 % 23).astype(np.int64),
            "complex128": base * (1 - 2j) + np.cos(base) * 1j,
            "float32": base.astype(np.float32),
        }
        for split, skew, (name, a) in itertools.product(splits_for(grid2d), (False, True), data.items()):
            x = with_values(make_tensor(grid2d, split, skew, backend).astype(a.dtype), a)
            rtol = 1e-5 if name == "float32" else 1e-12
            for axis, ddof, keepdims in (
                (None, 0, False),
                (0, 1, False),
                (-1, 0, True),
                ((0, 2), 1, True),
                (1, 2, False),
            ):
                what = f"{name} axis={axis} ddof={ddof} keepdims={keepdims} split={split} skew={skew}"
                v = np.var(x, axis=axis, ddof=ddof, keepdims=keepdims)
                want = np.var(a, axis=axis, ddof=ddof, keepdims=keepdims)
                check.true(v.global_shape == np.shape(want), f"var {what}: shape {v.global_shape}")
                check.true(np.dtype(as_numpy(v.local).dtype) == want.dtype, f"var {what}: dtype {v.local.dtype}")
                check.allclose(as_numpy(v.gather(None)), want, rtol=rtol, atol=0, what=f"var {what}")
                s = x.std(axis, ddof=ddof, keepdims=keepdims)
                want = np.std(a, axis=axis, ddof=ddof, keepdims=keepdims)
                check.allclose(as_numpy(s.gather(None)), want, rtol=rtol, atol=0, what=f"std {what}")
        a = data["float64"]
        x = with_values(make_tensor(grid2d, (0, 1, None), True, backend), a)
        with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():  # n - ddof <= 0: divides by 0
            warnings.simplefilter("ignore", RuntimeWarning)
            check.equal(as_numpy(x.var(0, correction=7).gather(None)), np.var(a, 0, ddof=7), "ddof = n")


@pytest.mark.mpi
def test_var_std_gradient(grid2d: hpctp.ProcessGrid) -> None:
    for skew in (False, True):
        check_gradient(
            grid2d,
            lambda x: x.var(axis=1, ddof=1),
            lambda t: torch.var(t, dim=1, correction=1),
            skew,
            "var axis 1",
            atol=1e-12,
        )
        check_gradient(
            grid2d,
            lambda x: np.std(x, axis=(0, 2), keepdims=True),
            lambda t: torch.std(t, dim=(0, 2), correction=0, keepdim=True),
            skew,
            "std axes (0, 2)",
            atol=1e-12,
        )


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_any_all_equal_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    with Checks(grid2d) as check:
        a = np.round(np.sin(global_array(SHAPE)) * 0.8)  # zeros in most places
        a[2, 3, 1] = np.nan  # NaN is nonzero, as in numpy
        for split, skew in itertools.product(splits_for(grid2d), (False, True)):
            x = with_values(make_tensor(grid2d, split, skew, backend), a)
            for data, values in ((x, a), (x != 0, a != 0), (x[:, :0], a[:, :0])):
                for axis, keepdims in ((None, False), (0, True), (1, False), ((0, 2), False), ((2, 1), True)):
                    for op in ("any", "all"):
                        got = getattr(np, op)(data, axis=axis, keepdims=keepdims)
                        want = getattr(np, op)(values, axis=axis, keepdims=keepdims)
                        what = f"{op} shape {values.shape} axis={axis} keepdims={keepdims} split={split} skew={skew}"
                        check.true(got.global_shape == np.shape(want), f"{what}: shape {got.global_shape}")
                        check.equal(as_numpy(got.gather(None)), want, what)
        x = with_values(make_tensor(grid2d, (0, 1, None), False, backend), a)
        check.true(bool(x.any()) and not bool((x > 5).any()), "bool() of a 0-d any")


@pytest.mark.mpi
def test_statistics_errors_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    x = make_tensor(grid2d, (0, 1, None), True)
    with pytest.raises(TypeError, match="no where= or mean="):
        np.var(x, where=np.ones(SHAPE, bool))
    with pytest.raises(ValueError, match="ddof and correction"):
        x.std(ddof=1, correction=1)
    with pytest.raises(TypeError, match="ddof must be a real number"):
        x.var(ddof="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="out="):
        np.any(x, out=np.zeros(()))
