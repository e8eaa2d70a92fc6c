"""cumsum / cumprod of DistTensors (also np.cumsum, torch.cumsum, ...) against numpy on the
gathered tensor and torch's autograd."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers.checks import Checks
from helpers.tensors import SHAPE, as_numpy, check_gradient, global_array, make_tensor, splits_for, with_values

import hpctp
from hpctp.testing import assert_equal


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_cumsum_cumprod_equal_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    with Checks(grid2d) as check:
        base = np.cos(global_array(SHAPE)) + 1.5  # positive: no cancellation, products stay finite
        data = {
            "float64": base,
            "int32": (np.arange(np.prod(SHAPE)).reshape(SHAPE) % 5 - 2).astype(np.int32),
            "bool": np.sin(global_array(SHAPE)) > 0,
            "complex128": base * (1 - 0.5j),
        }
        for split, skew, (name, a) in itertools.product(splits_for(grid2d), (False, True), data.items()):
            x = with_values(make_tensor(grid2d, split, skew, backend).astype(a.dtype), a)
            for axis, op in itertools.product((0, 1, -1), ("cumsum", "cumprod")):
                got = getattr(np, op)(x, axis=axis)
                want = getattr(np, op)(a, axis=axis)
                what = f"{name} {op} axis={axis} split={split} skew={skew}"
                ok = got.layout == x.layout and np.dtype(as_numpy(got.local).dtype) == want.dtype
                check.true(ok, f"{what}: layout kept, dtype {got.local.dtype} (numpy {want.dtype})")
                check.allclose(as_numpy(got.gather(None)), want, rtol=1e-13, atol=0, what=what)
        x = with_values(make_tensor(grid2d, (0, 1, None), True, backend), data["float64"])
        got = x.cumsum(1, dtype="float32")
        want = np.cumsum(data["float64"], 1, dtype=np.float32)
        check.allclose(as_numpy(got.gather(None)), want, rtol=1e-6, atol=0, what="cumsum dtype=float32")


@pytest.mark.mpi
def test_cumsum_of_a_vector(grid1d: hpctp.ProcessGrid) -> None:
    a = np.arange(1, 12, dtype=np.int64) ** 2
    x = hpctp.distribute(a if grid1d.rank == 0 else None, grid1d, (0,))
    assert_equal(grid1d, np.cumsum(x).gather(None), np.cumsum(a), "np.cumsum of a 1-D tensor (axis None)")
    assert_equal(grid1d, hpctp.cumprod(x[:6]).gather(None), np.cumprod(a[:6]), "cumprod of a slice")


@pytest.mark.mpi
def test_scan_gradients_equal_torch(grid2d: hpctp.ProcessGrid) -> None:
    for skew, dim in itertools.product((False, True), (0, 1, 2)):
        check_gradient(
            grid2d, lambda x, d=dim: torch.cumsum(x, d), lambda t, d=dim: torch.cumsum(t, d), skew, f"cumsum {dim}"
        )
        check_gradient(  # (the field holds a zero: torch.prod's backward handles it)
            grid2d,
            lambda x, d=dim: x.cumprod(d) / 100.0,
            lambda t, d=dim: torch.cumprod(t, d) / 100.0,
            skew,
            f"cumprod {dim}",
            atol=1e-9,
        )


@pytest.mark.mpi
def test_scan_errors_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    x = make_tensor(grid2d, (0, 1, None), True)
    with pytest.raises(ValueError, match="give an int axis"):
        np.cumsum(x)
    with pytest.raises(TypeError, match="takes an int axis"):
        x.cumprod(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out of range|axis"):
        x.cumsum(3)
    with pytest.raises(TypeError, match="out="):
        np.cumsum(x, 0, out=np.zeros(SHAPE))
    if grid2d.size > 1:  # ranks scanning along different dims: refused, not mismatched moves
        with pytest.raises(ValueError, match="axis"):
            x.cumsum(grid2d.rank % 2)
