"""ProcessGrid: shape, coordinates, sub-communicators, shifts and errors on every rank."""

from __future__ import annotations

import math

import pytest
from mpi4py import MPI

import hpctp
from hpctp.testing import assert_all, assert_equal


@pytest.mark.mpi
def test_grid_basics(grid2d: hpctp.ProcessGrid, world: MPI.Intracomm) -> None:
    g = grid2d
    assert_equal(world, g.size, world.Get_size())
    assert_equal(world, g.rank, world.Get_rank(), "grid rank equals the rank in the user's comm")
    assert_equal(world, g.coords, tuple(g.comm.Get_coords(g.rank)))
    assert_all(world, MPI.Comm.Compare(g.comm, world) != MPI.IDENT, "grid must use its own duplicate")
    for axis in range(2):
        sub = g.sub(axis)
        assert_equal(world, (sub.Get_size(), sub.Get_rank()), (g.dims[axis], g.coords[axis]))
        src, dst = g.shift(axis, 1)
        expect_dst = (
            g.rank_of(tuple(c + (a == axis) for a, c in enumerate(g.coords)))
            if g.coords[axis] + 1 < g.dims[axis]
            else MPI.PROC_NULL
        )
        assert_equal(world, dst, expect_dst)
        if g.coords[axis] == 0:
            assert_equal(world, src, MPI.PROC_NULL)
        else:
            assert_equal(world, src, g.rank_of(tuple(c - (a == axis) for a, c in enumerate(g.coords))))


@pytest.mark.mpi
def test_dims_filled_by_mpi(world: MPI.Intracomm) -> None:
    size = world.Get_size()
    for dims in (2, [0, 0], [0], [1, 0], 3):
        with hpctp.ProcessGrid(dims) as g:
            assert_equal(world, math.prod(g.dims), size)
    with hpctp.ProcessGrid([0, 1]) as g:
        assert_equal(world, g.dims, (size, 1))


@pytest.mark.mpi
def test_periodic_shift_wraps(world: MPI.Intracomm) -> None:
    size = world.Get_size()
    with hpctp.ProcessGrid([size], periods=[True]) as g:
        assert_equal(world, g.shift(0, 1), ((g.rank - 1) % size, (g.rank + 1) % size))


@pytest.mark.mpi
def test_grid_on_a_subcommunicator(world: MPI.Intracomm) -> None:
    half = world.Split(world.Get_rank() % 2, world.Get_rank())
    with hpctp.ProcessGrid([0, 0], comm=half) as g:
        assert_equal(world, g.size, half.Get_size())
        x = hpctp.ones((5, 3), g, (0, 1))
        assert_equal(world, float(x.sum()), 15.0)
    half.Free()


@pytest.mark.mpi
def test_bad_dims_raise_on_every_rank(world: MPI.Intracomm) -> None:
    size = world.Get_size()
    with pytest.raises(ValueError, match=f"hold {size + 1} ranks but the communicator has {size}"):
        hpctp.ProcessGrid([size + 1])
    with pytest.raises(ValueError, match="non-negative"):
        hpctp.ProcessGrid([-1, 0])
    with pytest.raises(ValueError, match="periods"):
        hpctp.ProcessGrid([size], periods=[True, False])
    with pytest.raises(TypeError, match="Intracomm"):
        hpctp.ProcessGrid([size], comm="world")  # type: ignore[arg-type]
    if size > 1:
        with pytest.raises(ValueError, match="do not divide"):
            hpctp.ProcessGrid([size + 1, 0])
        last = world.Get_rank() == size - 1  # arguments bad or different on the last rank only
        with pytest.raises(ValueError, match="hold|reported by rank"):
            hpctp.ProcessGrid([size + 1] if last else [size])
        with pytest.raises(ValueError, match=r"ProcessGrid: ranks passed different dims \(.*rank\(s\) \[\d+\]"):
            hpctp.ProcessGrid([size, 1] if last else [1, size])
        with pytest.raises(ValueError, match=r"ProcessGrid: ranks passed different periods"):
            hpctp.ProcessGrid([size], periods=[last])
    with hpctp.ProcessGrid([size]) as g:
        with pytest.raises(ValueError, match="not an axis"):
            g.sub(1)
