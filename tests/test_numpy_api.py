"""numpy's protocols on DistTensors (ufuncs, np.sum/np.where/np.allclose ...) against numpy on the gathered tensor."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers.checks import Checks
from helpers.tensors import SHAPE, global_array, make_tensor, splits_for

import hpctp
from hpctp.testing import assert_all, assert_allclose


# ---------------------------------------------------------------------------- numpy ufuncs
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_ufuncs_equal_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    with Checks(grid2d) as check:
        a = global_array(SHAPE)
        b = np.sin(a) * 3
        for split, skew in itertools.product(splits_for(grid2d), (False, True)):
            x = make_tensor(grid2d, split, skew, backend)
            y = x.with_local(x.local * 0 + (torch.from_numpy(b) if backend == "torch" else b)[x.local_slices])
            s = x.sum()
            cases = {
                "exp": (np.exp(x), np.exp(a)),
                "sqrt|x|": (np.sqrt(np.abs(x)), np.sqrt(np.abs(a))),
                "arctan2 scalar": (np.arctan2(x, 2.0), np.arctan2(a, 2.0)),
                "arctan2 scalar left": (np.arctan2(2.0, x), np.arctan2(2.0, a)),
                "maximum": (np.maximum(x, y), np.maximum(a, b)),
                "hypot 0-d": (np.hypot(s, y), np.hypot(a.sum(), b)),
                "power": (np.power(x, 2), a**2),
                "equal": (np.equal(x, y), a == b),
                "isfinite": (np.isfinite(x / 0.5), np.isfinite(a / 0.5)),
                "numpy scalar + x": (np.float64(2.5) + x, 2.5 + a),
                "numpy scalar < x": (np.float64(-0.5) < x, -0.5 < a),
                "tanh": (np.tanh(x * 0.1), np.tanh(a * 0.1)),
            }
            for what, (got, want) in cases.items():
                check.true(got.backend == backend and got.layout == x.layout, what)
                check.allclose(got.gather(None), want, rtol=1e-15, atol=0, what=f"{what} split={split}")


@pytest.mark.mpi
def test_ufunc_matmul_and_errors(grid2d: hpctp.ProcessGrid) -> None:
    a = global_array((6, 4))
    x = hpctp.distribute(a, grid2d, (0, 1))
    z = hpctp.distribute(a.T.copy(), grid2d, (0, 1))
    assert_allclose(grid2d, np.matmul(x, z).gather(None), a @ a.T, rtol=1e-14)
    with pytest.raises(TypeError, match=r"numpy.add.reduce is not supported .* x.sum\(\)"):
        np.add.reduce(x)
    with pytest.raises(TypeError, match="numpy.exp with out= is not supported"):
        np.exp(x, out=x)
    with pytest.raises(TypeError, match="numpy.divmod is not supported"):
        np.divmod(x, 2)
    with pytest.raises(TypeError, match="unsupported operand .* ndarray"):
        np.add(x, a)
    with pytest.raises(ValueError, match="same layout|does not broadcast"):
        np.maximum(x, x.redistribute((1, 0)) if grid2d.size > 1 else x[1:])
    with pytest.raises(TypeError, match="numpy.spacing has no torch counterpart"):
        np.spacing(x.to("torch"))
    with pytest.raises(ValueError, match="expects"):
        x.with_local(np.zeros((99, 1)))


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_numpy_reductions_call_the_collective_ones(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    """np.sum(x), np.mean(x, axis), np.max/np.min: numpy calls the DistTensor's methods."""
    a = global_array(SHAPE)
    x = make_tensor(grid2d, (0, 1, None), True, backend)
    cases = {
        "np.sum": (np.sum(x), a.sum()),
        "np.sum axis keepdims": (np.sum(x, axis=(0, 2), keepdims=True), a.sum(axis=(0, 2), keepdims=True)),
        "np.mean axis 1": (np.mean(x, axis=1), a.mean(axis=1)),
        "np.max axis 0": (np.max(x, axis=0), a.max(axis=0)),
        "np.min": (np.min(x), a.min()),
        "sum dtype": (x.sum(dtype="float32"), a.astype(np.float32).sum()),
        "np.mean dtype": (np.mean(x, dtype="float32"), a.astype(np.float32).mean()),
    }
    for what, (got, want) in cases.items():
        assert_all(grid2d, isinstance(got, hpctp.DistTensor) and got.backend == backend, what)
        rtol = 1e-6 if "dtype" in what else 1e-14
        assert_allclose(grid2d, got.gather(None), want, rtol=rtol, atol=0, what=what)
    with pytest.raises(TypeError, match=r"sum\(out=...\) is not supported"):
        np.sum(x, out=x)
    with pytest.raises(TypeError, match=r"max\(out=...\) is not supported"):
        x.max(out=x)


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_numpy_functions_equal_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    with Checks(grid2d) as check:
        a = global_array(SHAPE)
        b = a + np.where(np.arange(a.size).reshape(SHAPE) % 7 == 0, 1e-3, 1e-10)
        for split, skew in itertools.product(splits_for(grid2d), (False, True)):
            x = make_tensor(grid2d, split, skew, backend)
            y = x.with_local(x.local * 0 + (torch.from_numpy(b) if backend == "torch" else b)[x.local_slices])
            z = x.astype("complex128") * (1 - 2j)
            cases = {
                "where": (np.where(x > 0, x, y * 2), np.where(a > 0, a, b * 2)),
                "where scalars": (np.where(x > 0, 1.0, -1.0 * x), np.where(a > 0, 1.0, -a)),
                "isclose": (np.isclose(x, y), np.isclose(a, b)),
                "isclose atol": (np.isclose(x, y, rtol=0, atol=2e-3), np.isclose(a, b, rtol=0, atol=2e-3)),
                "clip": (np.clip(x, -2.0, 3.0), np.clip(a, -2.0, 3.0)),
                "clip max=": (np.clip(x, max=0.5), np.clip(a, None, 0.5)),
                "clip by tensors": (x.clip(y - 1, y), np.clip(a, b - 1, b)),
                "real": (np.real(z), np.real(a * (1 - 2j))),
                "imag": (np.imag(z), np.imag(a * (1 - 2j))),
                "imag of real": (np.imag(x), np.zeros(SHAPE)),
                "norm": (np.linalg.norm(x), np.linalg.norm(a)),
                "flip": (np.flip(x, (0, 2)), np.flip(a, (0, 2))),
                "flipud fliplr": (np.fliplr(np.flipud(x)), np.fliplr(np.flipud(a))),
                "roll": (np.roll(x, (1, -2), (0, 1)), np.roll(a, (1, -2), (0, 1))),
                "periodic stencil": (
                    np.roll(x, 1, 0) + np.roll(x, -1, 0) - 2 * x,
                    np.roll(a, 1, 0) + np.roll(a, -1, 0) - 2 * a,
                ),
            }
            for what, (got, want) in cases.items():
                check.true(isinstance(got, hpctp.DistTensor) and got.backend == backend, what)
                check.allclose(got.gather(None), want, rtol=1e-14, atol=0, what=f"{what} split={split}")
            check.equal(np.array([np.allclose(x, y), np.allclose(x, y, atol=2e-3)]), np.array([False, True]))
            check.true(np.shape(x) == SHAPE and np.ndim(x) == 3 and np.size(x) == a.size, "shape/ndim/size")


@pytest.mark.mpi
def test_other_numpy_functions_are_refused(grid2d: hpctp.ProcessGrid) -> None:
    x = make_tensor(grid2d, (0, 1, None), True)
    for call in (np.unique, np.sort, np.vstack, np.round):
        with pytest.raises(TypeError, match="is not supported on DistTensors .supported: np.all, np.allclose"):
            call([x, x] if call is np.vstack else x)
    with pytest.raises(TypeError, match="numpy.where.condition."):
        np.where(x > 0)
    with pytest.raises(TypeError, match="only the Frobenius norm"):
        np.linalg.norm(x, axis=0)
    with pytest.raises(TypeError, match="no out="):
        np.clip(x, 0, 1, out=x)
