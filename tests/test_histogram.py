"""hpctp.histogram / np.histogram of DistTensors against numpy on the gathered tensor: the
counts are equal exactly, on every rank, for every layout (replicas counted once)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers.checks import Checks
from helpers.tensors import SHAPE, global_array, make_tensor, splits_for, with_values

import hpctp
from hpctp.testing import assert_allclose, assert_equal


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_histogram_equals_numpy(grid2d: hpctp.ProcessGrid, backend: str) -> None:
    with Checks(grid2d) as check:
        base = np.sin(global_array(SHAPE) * 1.7)
        data = {
            "float64": base,
            "float32": base.astype(np.float32),
            "int64": (np.arange(np.prod(SHAPE)).reshape(SHAPE) * 7919 % 23).astype(np.int64),
            "constant": np.full(SHAPE, 2.5),  # numpy widens an empty range by 0.5 on each side
        }
        cases = [{}, {"bins": 7}, {"bins": [-1.0, -0.3, 0.0, 0.1, 1.0, 30.0]}, {"bins": 5, "range": (-0.5, 12)}]
        cases += [{"bins": 4, "density": True}]
        for split, skew, (name, a) in itertools.product(splits_for(grid2d), (False, True), data.items()):
            x = with_values(make_tensor(grid2d, split, skew, backend).astype(a.dtype), a)
            for kw in cases:
                what = f"{name} {kw} split={split} skew={skew}"
                counts, edges = np.histogram(x, **kw)  # type: ignore[call-overload]
                want, want_edges = np.histogram(a, **kw)  # type: ignore[call-overload]
                check.equal(edges, want_edges, f"edges {what}")
                check.equal(counts, want, f"counts {what}")


@pytest.mark.mpi
def test_histogram_weights_and_nans(grid2d: hpctp.ProcessGrid) -> None:
    a = np.cos(global_array(SHAPE))
    w = np.abs(np.sin(global_array(SHAPE))) + 0.25
    x = with_values(make_tensor(grid2d, (0, 1, None), True), a)
    weights = with_values(make_tensor(grid2d, (0, 1, None), False), w)  # cut differently: aligned first
    got, _ = hpctp.histogram(x, 6, weights=weights)
    assert_allclose(grid2d, got, np.histogram(a, 6, weights=w)[0], rtol=1e-13, what="weighted counts")
    got, _ = np.histogram(x, 6, weights=weights, density=True)
    assert_allclose(grid2d, got, np.histogram(a, 6, weights=w, density=True)[0], rtol=1e-13, what="weighted density")
    b = a.copy()
    b[3, 2, 1] = np.nan  # with a range, numpy leaves NaNs out
    y = with_values(make_tensor(grid2d, (0, 1, None), True), b)
    assert_equal(grid2d, np.histogram(y, 5, (-1, 1))[0], np.histogram(b, 5, (-1, 1))[0], "NaN left out")
    with pytest.raises(ValueError, match="autodetected range of \\[nan, nan\\] is not finite"):
        np.histogram(y)
    empty = x[:0]
    assert_equal(grid2d, np.histogram(empty, 3)[0], np.histogram(a[:0], 3)[0], "empty tensor: range (0, 1)")


@pytest.mark.mpi
def test_histogram_errors_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    x = make_tensor(grid2d, (0, 1, None), True)
    with pytest.raises(ValueError, match="bin estimators"):
        np.histogram(x, bins="auto")
    with pytest.raises(ValueError, match="max must be larger than min"):
        hpctp.histogram(x, 3, range=(2, 1))
    with pytest.raises(ValueError, match="monotonically"):
        hpctp.histogram(x, [0, 2, 1])
    with pytest.raises(ValueError, match="same shape"):
        hpctp.histogram(x, 3, weights=x[1:])
    if grid2d.size > 1:  # ranks binning differently: refused, not mixed counts
        with pytest.raises(ValueError, match="bins"):
            hpctp.histogram(x, 3 + grid2d.rank % 2)
