"""np.nansum / nanmean / nanmax / nanmin / nanvar / nanstd of DistTensors against numpy on the
gathered tensor (NaNs on several ranks, all-NaN slices) and torch.nansum / nanmean gradients."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
from helpers.checks import Checks
from helpers.tensors import SHAPE, as_numpy, global_array, make_tensor, splits_for, with_values

import hpctp
from hpctp.testing import assert_allclose

FUNCS = ("nansum", "nanmean", "nanmax", "nanmin", "nanvar", "nanstd")


def _data() -> dict[str, np.ndarray]:
    base = np.sin(global_array(SHAPE)) * 2 + 0.5
    base[1, 2, :] = np.nan  # an all-NaN slice along axis 2
    base[4:6, 0, 3] = np.nan
    base[0, :, 0] = np.nan  # an all-NaN slice along axis 1
    return {
        "float64": base,
        "float32": base.astype(np.float32),
        "complex128": base * (1 - 0.5j),
        "int64": np.nan_to_num(base * 10).astype(np.int64),
    }


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_nan_reductions_equal_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    with Checks(grid2d) as check:
        for split, skew, (name, a) in itertools.product(splits_for(grid2d), (False, True), _data().items()):
            x = with_values(make_tensor(grid2d, split, skew, backend).astype(a.dtype), a)
            for func, (axis, keepdims) in itertools.product(
                FUNCS, ((None, False), (2, False), ((0, 1), True), (1, False))
            ):
                if func in ("nanmax", "nanmin") and name == "complex128":
                    continue  # (no order on complex numbers; max/min refuse them)
                kw = {"ddof": 1} if func in ("nanvar", "nanstd") and axis == 2 else {}
                what = f"{name} {func} axis={axis} keepdims={keepdims} {kw} split={split} skew={skew}"
                with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
                    warnings.simplefilter("ignore", RuntimeWarning)  # numpy warns of all-NaN slices, as do the blocks
                    got = getattr(np, func)(x, axis=axis, keepdims=keepdims, **kw)
                    want = getattr(np, func)(a, axis=axis, keepdims=keepdims, **kw)
                    g = as_numpy(got.gather(None))
                check.true(g.shape == np.shape(want) and g.dtype == want.dtype, f"{what}: {g.shape} {g.dtype}")
                rtol = 1e-5 if name == "float32" else 1e-12
                check.allclose(g, want, rtol=rtol, atol=1e-12, what=what)  # (NaN where numpy has NaN)


@pytest.mark.mpi
def test_nan_reduction_gradients(grid2d: hpctp.ProcessGrid) -> None:
    a = torch.from_numpy(_data()["float64"])
    for skew, (what, dist, ref) in itertools.product(
        (False, True),
        (
            ("nansum", lambda t: np.nansum(t, axis=0), lambda t: torch.nansum(t, dim=0)),
            ("nanmean", lambda t: np.nanmean(t, axis=(0, 2)), lambda t: torch.nanmean(t, dim=(0, 2))),
        ),
    ):
        x0 = make_tensor(grid2d, (0, 1, None), skew, "torch")
        x = x0.with_local(a[x0.local_slices].clone().requires_grad_(True))
        out = dist(x)
        ag = a.clone().requires_grad_(True)
        want = ref(ag)
        w = torch.cos(torch.arange(want.numel(), dtype=torch.float64)).reshape(want.shape)
        (out.local * w[out.local_slices]).sum().backward()
        (want * w).sum().backward()
        assert_allclose(grid2d, x.local.grad, ag.grad[x.local_slices], rtol=1e-12, atol=1e-15, what=f"d {what}")


@pytest.mark.mpi
def test_nan_reduction_errors(grid2d: hpctp.ProcessGrid) -> None:
    x = make_tensor(grid2d, (0, 1, None), True)
    with pytest.raises(TypeError, match="takes axis, keepdims"):
        np.nansum(x, out=np.zeros(()))
    with pytest.raises(TypeError, match="takes axis, keepdims"):
        np.nanmax(x, initial=3.0)
    with pytest.raises(TypeError, match="ddof must be a real number"):
        np.nanvar(x, ddof="1")
