"""One rule for integer arguments: Python and numpy integers are ints, bools and floats are not.

Every public entry point that takes a size, axis, rank, seed or width goes through
``hpctp._util.ints``; numpy integers (e.g. from ``array.shape`` arithmetic) give the same result
as Python ints, and nothing is truncated.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpctp
from hpctp._util.ints import as_int, is_int
from hpctp.comm import ProcessGrid
from hpctp.layout import Layout, normalize_split
from hpctp.nn import Linear2D, MaxPool2d
from hpctp.ops.autograd import normalize_axes
from hpctp.testing import assert_all, assert_allclose


@pytest.mark.parametrize("v", [0, -3, 2**70, np.int8(1), np.uint64(7), np.int64(-2)])
def test_is_int_accepts_python_and_numpy_integers(v: object) -> None:
    assert is_int(v)
    assert as_int(v, "n") == int(v) and type(as_int(v, "n")) is int  # type: ignore[call-overload]


@pytest.mark.parametrize("v", [True, np.bool_(True), 2.0, np.float64(2), "2", None, np.array(2), [2], 2 + 0j])
def test_is_int_refuses_everything_else(v: object) -> None:
    assert not is_int(v)
    with pytest.raises(TypeError, match=r"parts must be an int, got"):
        as_int(v, "parts")


def test_as_int_minimum_names_the_value() -> None:
    with pytest.raises(ValueError, match=r"parts must be >= 1, got 0"):
        as_int(np.int32(0), "parts", 1)
    assert as_int(np.int32(1), "parts", 1) == 1


def test_layout_takes_numpy_ints_and_refuses_floats() -> None:
    a = Layout((np.int64(7), 5), (np.int32(2), 1), normalize_split((np.int64(0), None), 2, 2))
    b = Layout((7, 5), (2, 1), (0, None))
    assert a == b and a.split == (0, None) and all(type(g) is int for g in a.split if g is not None)
    with pytest.raises(TypeError, match="grid_dims"):
        Layout((7, 5), (2.0, 1), (0, None))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="global_shape"):
        Layout((7.0, 5), (2, 1), (0, None))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"split\[0\]"):
        normalize_split((True, None), 2, 2)


@pytest.mark.mpi
def test_grid_and_collectives_take_numpy_ints(world: MPI.Intracomm) -> None:
    size = world.Get_size()
    with ProcessGrid(np.array([size, 1])) as g, ProcessGrid([np.int64(0), np.int32(1)]) as h:
        assert_all(world, g.dims == (size, 1) and h.dims == (size, 1), f"{g.dims} {h.dims}")
        assert_all(world, all(type(d) is int for d in g.dims + h.dims), "dims are Python ints")
        a = np.arange(35.0).reshape(7, 5)
        x = hpctp.distribute(a if g.rank == size - 1 else None, g, (np.int64(0), None), root=np.int64(size - 1))
        got = x.gather(root=np.int32(0))
        assert_allclose(world, got if g.rank == 0 else a, a, rtol=0)
        assert_allclose(world, x.sum(axis=np.int64(1)).gather(root=None), a.sum(axis=1), rtol=1e-14)
        assert_all(world, normalize_axes(g, np.int64(0)) == (0,), "normalize_axes")
    with pytest.raises(ValueError, match="non-negative int"):
        ProcessGrid([float(size)])
    with pytest.raises(TypeError, match="dims must be an int"):
        ProcessGrid(np.bool_(True))  # type: ignore[arg-type]


@pytest.mark.mpi
def test_nn_layers_take_numpy_ints(grid2d: ProcessGrid) -> None:
    comm = grid2d.comm
    ref = Linear2D(6, 5, grid2d, seed=3)
    lin = Linear2D(np.int64(6), np.int32(5), grid2d, seed=np.int64(3))  # type: ignore[arg-type]
    assert_all(comm, (lin.in_features, lin.out_features) == (6, 5), "features")
    assert_all(comm, type(lin.in_features) is int and type(lin.out_features) is int, "features are Python ints")
    assert_allclose(comm, lin.weight.detach(), ref.weight.detach(), rtol=0)
    x = torch.arange(2 * 1 * 6 * 5, dtype=torch.float64).reshape(2, 1, 6, 5).sin()
    pool = MaxPool2d(np.int64(2), grid=grid2d, stride=np.int32(2))  # type: ignore[arg-type]
    y = pool(hpctp.distribute(x, grid2d, (None, None, 0, 1)))
    assert_allclose(comm, y.gather(root=None), torch.nn.functional.max_pool2d(x, 2, 2), rtol=0)
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        Linear2D(6.0, 5, grid2d)  # type: ignore[arg-type]
