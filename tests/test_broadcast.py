"""numpy broadcasting between DistTensors (``x - x.mean(0)``, ``x * profile``) against numpy/torch
on the gathered tensors, values and gradients."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers.checks import Checks
from helpers.tensors import SHAPE, as_numpy, check_gradient, global_array, make_tensor, splits_for

import hpctp
from hpctp.testing import assert_allclose


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_smaller_operands_broadcast_as_in_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    with Checks(grid2d) as check:
        a = global_array(SHAPE)
        prof = np.cos(np.arange(6.0))
        for split, skew in itertools.product(splits_for(grid2d), (False, True)):
            x = make_tensor(grid2d, split, skew, backend)
            rep = hpctp.distribute(prof if grid2d.rank == 0 else None, grid2d, (None,)).to(backend)
            cut = hpctp.distribute(prof if grid2d.rank == 0 else None, grid2d, (grid2d.ndim - 1,)).to(backend)
            cases = {
                "x * x (one operand twice)": (x * x, a * a),
                "x.mean(0) * x.mean(0)": (x * (x.mean(0) * x.mean(0)), a * (a.mean(0) * a.mean(0))),
                "x - x.mean(0)": (x - x.mean(0), a - a.mean(0)),
                "x.mean(0) - x": (x.mean(0) - x, a.mean(0) - a),
                "x / x.sum((0, 2), keepdims)": (x / x.sum((0, 2), keepdims=True), a / a.sum((0, 2), keepdims=True)),
                "x * replicated profile": (x * rep, a * prof),
                "divided profile + x": (cut + x, prof + a),
                "x - x[0]": (x - x[0], a - a[0]),
                "np.maximum(x.max(1, keepdims), x)": (np.maximum(x.max(1, keepdims=True), x), np.maximum(a.max(1, keepdims=True), a)),
                "np.where(x > mean, x, mean)": (np.where(x > x.mean(2, keepdims=True), x, x.mean(2, keepdims=True)), np.where(a > a.mean(2, keepdims=True), a, a.mean(2, keepdims=True))),
            }  # fmt: skip
            for what, (got, want) in cases.items():
                check.true(got.layout == x.layout, f"{what}: the larger operand's layout, got {got.layout}")
                check.allclose(as_numpy(got.gather(None)), want, rtol=1e-14, atol=1e-13, what=f"{what} {split} {skew}")


@pytest.mark.mpi
def test_broadcast_gradients_equal_torch(grid2d: hpctp.ProcessGrid) -> None:
    for skew in (False, True):
        check_gradient(grid2d, lambda t: t - t.mean(0), lambda t: t - t.mean(0), skew, "x - x.mean(0)")
        check_gradient(grid2d, lambda t: t * t[2], lambda t: t * t[2], skew, "x * x[2]")
        check_gradient(
            grid2d, lambda t: t.sum(1, keepdims=True) * t, lambda t: t.sum(1, keepdims=True) * t, skew, "x.sum(1) * x"
        )
    # a learnable replicated profile: its gradient is summed over the ranks that use it (every rank gets all of it)
    x = make_tensor(grid2d, (0, 1, None), True, "torch")
    prof = torch.cos(torch.arange(6.0, dtype=torch.float64)).requires_grad_(True)
    p = hpctp.DistTensor(prof, grid2d, hpctp.Layout((6,), grid2d.dims, (None,)))
    w = torch.from_numpy(np.sin(global_array(SHAPE)))
    (x * p * x.with_local(w[x.local_slices])).sum().local.backward()
    ref = prof.detach().clone().requires_grad_(True)
    (torch.from_numpy(global_array(SHAPE)) * ref * w).sum().backward()
    assert_allclose(grid2d, prof.grad, ref.grad, rtol=1e-12, what="the profile's gradient")


@pytest.mark.mpi
def test_shapes_that_do_not_broadcast_one_way_are_refused(grid2d: hpctp.ProcessGrid) -> None:
    x = make_tensor(grid2d, (0, 1, None), True)
    with pytest.raises(ValueError, match=r"shape \(5,\) does not broadcast against one of shape \(7, 5, 6\)"):
        x + x[0, :, 0]
    with pytest.raises(ValueError, match="does not broadcast"):
        x[:, :1] + x[:1]  # (7, 1, 6) and (1, 5, 6): numpy broadcasts both ways, here one way only
