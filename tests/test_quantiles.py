"""quantile / percentile / median of DistTensors (and np.quantile, np.percentile, np.median)
against numpy on the gathered tensor: the values are numpy's to the bit, with numpy's dtypes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers.checks import Checks
from helpers.tensors import SHAPE, as_numpy, global_array, make_tensor, splits_for, with_values

import hpctp
from hpctp.tensor.functions.quantiles import from_keys, sortable_keys
from hpctp.testing import assert_equal


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "int64", "int8"])
def test_keys_sort_as_the_values(dtype: str) -> None:
    if dtype.startswith("float"):
        f = np.finfo(dtype)
        v = np.array([-np.inf, f.min, -3, -1, -f.tiny, -0.0, 0, f.tiny, 1, 2.5, f.max, np.inf], dtype=dtype)
    else:
        i = np.iinfo(dtype)
        v = np.array([i.min, -3, -1, 0, 0, 1, 2, i.max], dtype=dtype)
    keys = sortable_keys(v)
    assert (np.diff(keys) >= 0).all() and (np.diff(keys)[v[1:] != v[:-1]] > 0).all(), keys
    assert np.array_equal(from_keys(keys, v.dtype).view(np.uint8), v.view(np.uint8))  # bit for bit


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_quantiles_equal_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    with Checks(grid2d) as check:
        base = np.round(np.sin(global_array(SHAPE) * 1.3) * 4, 1)  # ties across blocks
        base[0, 0, 0] = -0.0
        data = {"float64": base, "float32": base.astype(np.float32), "int64": (base * 10).astype(np.int64)}
        for split, skew, (name, a) in itertools.product(splits_for(grid2d), (False, True), data.items()):
            x = with_values(make_tensor(grid2d, split, skew, backend).astype(a.dtype), a)
            for axis, q, keepdims in (
                (None, 0.3, False),
                (0, [0.0, 0.25, 0.5, 1.0], False),
                (-1, 0.9, True),
                ((0, 2), np.array([0.1, 0.75]), False),
            ):
                what = f"{name} quantile q={q} axis={axis} keepdims={keepdims} split={split} skew={skew}"
                got = np.quantile(x, q, axis=axis, keepdims=keepdims)
                want = np.quantile(a, q, axis=axis, keepdims=keepdims)
                ok = got.global_shape == np.shape(want) and np.dtype(as_numpy(got.local).dtype) == want.dtype
                check.true(ok, f"{what}: shape {got.global_shape}, dtype {got.local.dtype} vs {want.dtype}")
                check.equal(as_numpy(got.gather(None)), want, what)
            for axis in (None, 1, (0, 1)):  # even and odd counts
                want = np.median(a, axis=axis)
                check.equal(as_numpy(np.median(x, axis=axis).gather(None)), want, f"{name} median axis={axis}")
            want = np.percentile(a, [5, 50, 95], axis=0)
            check.equal(as_numpy(np.percentile(x, [5, 50, 95], axis=0).gather(None)), want, f"{name} percentile")


@pytest.mark.mpi
def test_quantiles_of_nans(grid2d: hpctp.ProcessGrid) -> None:
    a = np.cos(global_array(SHAPE))
    a[3, 1, :2] = np.nan  # the slices holding a NaN give NaN, as in numpy
    x = with_values(make_tensor(grid2d, (0, 1, None), True), a)
    for axis in (None, 0, 2):
        assert_equal(grid2d, np.median(x, axis=axis).gather(None), np.median(a, axis=axis), f"median axis={axis}")
        got = hpctp.quantile(x, [0.2, 0.8], axis=axis).gather(None)
        assert_equal(grid2d, got, np.quantile(a, [0.2, 0.8], axis=axis), f"quantile axis={axis}")


@pytest.mark.mpi
def test_quantile_errors_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    x = make_tensor(grid2d, (0, 1, None), True)
    with pytest.raises(ValueError, match="range \\[0, 1\\]"):
        np.quantile(x, 1.5)
    with pytest.raises(ValueError, match="range \\[0, 100\\]"):
        np.percentile(x, -1)
    with pytest.raises(ValueError, match="only numpy's default method"):
        np.quantile(x, 0.5, method="nearest")
    with pytest.raises(TypeError, match="real numbers"):
        np.median(x * 1j)
    with pytest.raises(ValueError, match="empty"):
        np.median(x[:, :0], axis=1)
    with pytest.raises(TypeError, match="no out="):
        np.median(x, out=np.zeros(()))
    t = make_tensor(grid2d, (0, 1, None), True, "torch")
    t.local.requires_grad_(True)
    with pytest.raises(TypeError, match="not differentiable"):
        hpctp.median(t)
    if grid2d.size > 1:
        with pytest.raises(ValueError, match="q"):
            hpctp.quantile(x, 0.1 * (grid2d.rank % 2))
