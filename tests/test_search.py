"""argmax / argmin of DistTensors (and np.argmax / np.argmin), and max / min with NaNs, against
numpy on the gathered tensor."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers.checks import Checks
from helpers.tensors import SHAPE, as_numpy, global_array, make_tensor, splits_for, with_values

import hpctp
from hpctp.testing import assert_all, assert_allclose, assert_equal


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_argmax_argmin_equal_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    with Checks(grid2d) as check:
        ties = np.round(np.sin(global_array(SHAPE)) * 2)  # many equal extremes: the first one counts
        nans = np.cos(global_array(SHAPE))
        nans[3, 1, 4] = nans[5, 0, 0] = np.nan  # a NaN is the extreme, as in numpy
        ints = (np.arange(np.prod(SHAPE)).reshape(SHAPE) * 7919 % 23).astype(np.int64)
        for split, skew, (name, a) in itertools.product(
            splits_for(grid2d), (False, True), (("ties", ties), ("nans", nans), ("ints", ints))
        ):
            x = with_values(make_tensor(grid2d, split, skew, backend).astype(a.dtype), a)
            for axis, keepdims in itertools.product((None, 0, 1, -1), (False, True)):
                for op in ("argmax", "argmin"):
                    got = getattr(x, op)(axis, keepdims)
                    want = getattr(np, op)(a, axis=axis, keepdims=keepdims)
                    what = f"{name} {op} axis={axis} keepdims={keepdims} split={split} skew={skew}"
                    check.true(got.global_shape == np.shape(want), f"{what}: shape {got.global_shape}")
                    check.equal(as_numpy(got.gather(None)).astype(np.int64), np.asarray(want), what)
            check.true(int(np.argmax(x)) == int(np.argmax(a)), f"{name}: np.argmax dispatch")
            check.equal(as_numpy(np.argmin(x, axis=2).gather(None)), np.argmin(a, axis=2), f"{name}: np.argmin")


@pytest.mark.mpi
def test_argmax_of_a_tensor_that_requires_grad(grid2d: hpctp.ProcessGrid) -> None:
    x = make_tensor(grid2d, (0, 1, None), True, "torch")
    x.local.requires_grad_(True)
    a = global_array(SHAPE)
    assert_all(grid2d, int(x.argmax()) == int(np.argmax(a)), "an index of a tensor that requires grad")


@pytest.mark.mpi
def test_argmax_errors_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    x = make_tensor(grid2d, (0, 1, None), True)
    with pytest.raises(TypeError, match="argmax takes an int axis or None"):
        x.argmax((0, 1))
    with pytest.raises(ValueError, match="axis 3 is out of range"):
        x.argmin(3)
    with pytest.raises(ValueError, match="argmax of an empty tensor"):
        x[2:2].argmax(0)
    with pytest.raises(TypeError, match="complex"):
        (x * 1j).argmax()
    with pytest.raises(TypeError, match="out=.... is not supported"):
        np.argmax(x, out=np.zeros(()))


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_max_min_propagate_nan_across_ranks(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    """numpy's max/min are NaN where any element is; MPI's MAX/MIN alone would drop a NaN held
    by another rank."""
    a = np.cos(global_array(SHAPE))
    a[0, 0, 0] = a[6, 4, 5] = a[3, 2, 1] = np.nan
    for split, skew in itertools.product(splits_for(grid2d), (False, True)):
        x = with_values(make_tensor(grid2d, split, skew, backend), a)
        for op, axis in itertools.product(("max", "min"), (None, 0, 1, (0, 2))):
            got = as_numpy(getattr(x, op)(axis).gather(None))
            assert_equal(grid2d, got, getattr(np, op)(a, axis=axis), f"{op} axis={axis} split={split} skew={skew}")


@pytest.mark.mpi
def test_max_min_gradient_is_shared_among_ties(grid2d: hpctp.ProcessGrid) -> None:
    """d/dx of sum(W * x.max(axis)) equals torch.amax's: the gradient goes to the elements equal
    to the result, shared evenly among them, also when the ties lie on different ranks."""
    ties = np.round(np.sin(global_array(SHAPE)) * 2)  # every extreme is tied, across blocks
    for split, skew in itertools.product(splits_for(grid2d), (False, True)):
        x0 = make_tensor(grid2d, split, skew, "torch")
        for (axis, keepdims), op in itertools.product(
            ((None, False), (0, False), (1, True), ((0, 2), False), (-1, False)), ("max", "min")
        ):
            x = x0.with_local(torch.from_numpy(ties[x0.local_slices].copy()).requires_grad_(True))
            r = getattr(x, op)(axis, keepdims)
            ref = torch.from_numpy(ties).requires_grad_(True)
            dims = tuple(range(3)) if axis is None else axis
            want = (torch.amax if op == "max" else torch.amin)(ref, dim=dims, keepdim=keepdims)
            w = torch.cos(torch.arange(want.numel(), dtype=torch.float64)).reshape(want.shape)
            (r.local * w[r.local_slices]).sum().backward()  # the rank's part of a replicated loss
            (want * w).sum().backward()
            what = f"{op} axis={axis} keepdims={keepdims} split={split} skew={skew}"
            assert_equal(grid2d, r.local.detach(), want.detach()[r.local_slices], what)
            assert_allclose(grid2d, x.local.grad, ref.grad[x.local_slices], rtol=1e-12, what=f"d {what}")
    nans = ties.copy()
    nans[1, 2, 3] = nans[6, 4, 0] = np.nan  # NaN is the result; its gradient goes to the NaNs (torch.max)
    x0 = make_tensor(grid2d, (0, 1, None), True, "torch")
    x = x0.with_local(torch.from_numpy(nans[x0.local_slices].copy()).requires_grad_(True))
    (x.max() * 3.0).local.backward()
    ref = torch.from_numpy(nans).requires_grad_(True)
    (torch.max(ref) * 3.0).backward()
    assert_equal(grid2d, x.local.grad, ref.grad[x.local_slices], "gradient of a NaN maximum")
