"""The virtual grid (hpctp.comm.virtual): a grid of any size played by one process, its communicators equal to
MPI's, its calls counted as on MPI. The layers' messages against real runs: test_virtual_spatial.py,
test_virtual_transformer.py, test_virtual_parallel.py."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpctp
import hpctp.nn
from hpctp import comm as C
from hpctp.comm import CallLog, CommCounter
from hpctp.testing import assert_all


def _members(comm: MPI.Comm) -> tuple[int, ...]:
    """The world ranks of an MPI communicator, in its rank order."""
    mine, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(int(r) for r in MPI.Group.Translate_ranks(mine, list(range(comm.Get_size())), world))
    finally:
        mine.Free()
        world.Free()


def _same_communicators(grid: hpctp.ProcessGrid) -> None:
    twin = hpctp.ProcessGrid.virtual(grid.dims, rank=grid.rank, periods=grid.periods)
    wrong = []
    if (twin.rank, twin.size, twin.coords) != (grid.rank, grid.size, grid.coords):
        wrong.append(f"grid {(twin.rank, twin.size, twin.coords)} != {(grid.rank, grid.size, grid.coords)}")
    axes_sets = [(a,) for a in range(grid.ndim)] + [(), tuple(range(grid.ndim))]
    if grid.ndim == 3:
        axes_sets += [(0, 2), (1, 2)]
    for axes in axes_sets:
        real, virt = grid.axes_comm(axes), twin.axes_comm(axes)
        got = (virt.Get_size(), virt.Get_rank(), virt.Get_name(), virt.members)
        want = (real.Get_size(), real.Get_rank(), real.Get_name(), _members(real))
        if got != want:
            wrong.append(f"axes {axes}: virtual {got} != MPI {want}")
    for axis in range(grid.ndim):
        for disp in (1, -1, 2):
            if twin.shift(axis, disp) != grid.shift(axis, disp):
                wrong.append(f"shift({axis}, {disp}): {twin.shift(axis, disp)} != {grid.shift(axis, disp)}")
    for r in range(grid.size):
        if twin.rank_of(grid.coords_of(r)) != r:
            wrong.append(f"rank_of(coords_of({r})) = {twin.rank_of(grid.coords_of(r))}")
    assert_all(grid, not wrong, "; ".join(wrong))
    assert_all(grid, twin.is_virtual and not grid.is_virtual, "is_virtual")
    twin.free()


@pytest.mark.mpi
def test_virtual_communicators_equal_mpis_on_2d_grids(grid2d: hpctp.ProcessGrid) -> None:
    """Every communicator of a virtual 2-D grid playing this rank (its axes, none, all) has the size, the rank, the
    name and the world ranks of MPI's, and so do shifts and coordinates."""
    _same_communicators(grid2d)


@pytest.mark.mpi
def test_virtual_communicators_equal_mpis_on_periodic_3d_grids(world: MPI.Intracomm) -> None:
    """As on 2-D grids, with every axis periodic and pairs of axes (Cart_sub of two of three)."""
    from hpctp.testing import grid_shapes

    for dims in grid_shapes(world.Get_size(), 3):
        grid = hpctp.ProcessGrid(dims, periods=[True, False, True])
        _same_communicators(grid)
        grid.free()


def test_a_grid_of_4096_ranks_costs_nothing_to_build() -> None:
    """A virtual grid of 16x16x16 ranks playing its last rank builds in well under a second, with the right
    neighbours and sub-communicators (MPI-free arithmetic)."""
    t = time.perf_counter()
    grid = hpctp.ProcessGrid.virtual((16, 16, 16), rank=4095, periods=(True, False, False))
    built = time.perf_counter() - t
    assert built < 1.0, built
    assert (grid.size, grid.rank, grid.coords) == (4096, 4095, (15, 15, 15))
    assert grid.sub(2).members == tuple(range(4080, 4096))
    assert grid.sub(0).members == tuple(range(255, 4096, 256))
    assert grid.shift(0, 1) == (3839, 255)  # periodic: the next along axis 0 wraps to (0, 15, 15)
    assert grid.shift(1, 1) == (4079, MPI.PROC_NULL)
    assert grid.axes_comm((0, 2)).Get_size() == 256 and grid.axes_comm((0, 2)).Get_rank() == 255
    grid.free()


def test_virtual_calls_move_nothing_and_count_as_on_mpi() -> None:
    """On a virtual grid of 8 ranks playing rank 5, each call returns at once, leaves its buffers as they were,
    and is counted with MPI's conventions, the peer and the communicator's world ranks in the log."""
    grid = hpctp.ProcessGrid.virtual((2, 4), rank=5)
    x = torch.arange(6.0, dtype=torch.float64)
    row = grid.sub(1)  # ranks 4..7, this one is 1 of them
    with CommCounter() as c, CallLog() as log:
        C.allreduce(row, x)
        C.waitall(
            [C.isend(row, x, 2, tag=3), C.irecv(row, torch.empty(6, device="meta", dtype=torch.float64), 0, tag=3)]
        )
        gathered = torch.zeros(24, dtype=torch.float64)
        C.allgatherv(row, x, gathered, [6] * 4)
        ints = C.allgather_ints(grid.comm, [7, 9])
    assert torch.equal(x, torch.arange(6.0, dtype=torch.float64)) and not gathered.any()
    assert ints.tolist() == [[7, 9]] * 8  # every rank holds what this one holds
    assert c.calls == {"Allreduce": 1, "Isend": 1, "Irecv": 1, "Allgatherv": 1, "Allgather": 1}
    assert (c.bytes_sent, c.bytes_recv) == (48 + 48 + 48 * 3 + 16 * 7, 48 + 48 + 48 * 3 + 16 * 7)
    ops = [(k.op, k.comm, k.size, k.sent, k.recv, k.peer, k.members) for k in log.calls]
    assert ops[:3] == [
        ("Allreduce", "hpctp.grid.axis1", 4, 48, 48, -1, (4, 5, 6, 7)),
        ("Isend", "hpctp.grid.axis1", 4, 48, 0, 2, (4, 5, 6, 7)),
        ("Irecv", "hpctp.grid.axis1", 4, 0, 48, 0, (4, 5, 6, 7)),
    ]
    assert ops[4][:3] == ("Allgather", "hpctp.grid", 8) and ops[4][-1] == tuple(range(8))
    grid.free()


def test_agreement_on_a_virtual_grid_follows_the_local_verdict() -> None:
    """Agreement checks agree with this rank's verdict: equal arguments pass, a local error is raised as is."""
    grid = hpctp.ProcessGrid.virtual((64,), rank=63)
    C.agree_arguments(grid.comm, "f", None, shape=(3, 4))
    with pytest.raises(ValueError, match="bad shape"):
        C.agree_arguments(grid.comm, "f", ValueError("bad shape"), shape=(3, 4))
    with pytest.raises(ValueError, match="bad axis"):
        C.raise_if_any(grid.comm, ValueError("bad axis"))
    grid.free()


def test_what_a_virtual_grid_cannot_do_says_so() -> None:
    """Groups chosen by every rank's colour (split_comm) cannot be known in one process: NotImplementedError naming
    the grid's own groups; a bad virtual shape or rank is a ValueError naming it."""
    grid = hpctp.ProcessGrid.virtual((2, 2), rank=1)
    with pytest.raises(NotImplementedError, match="axes_comm"):
        C.split_comm(grid.comm, 0)
    with pytest.raises(ValueError, match=r"dims=\(2, 0\)"):
        hpctp.ProcessGrid.virtual((2, 0))
    with pytest.raises(ValueError, match="rank=4"):
        hpctp.ProcessGrid.virtual((2, 2), rank=4)
    assert grid.same_ranks(grid) and not grid.same_ranks(hpctp.ProcessGrid.virtual((4,), rank=0).subgrid([]))
    grid.free()


def test_a_halo_exchange_on_a_virtual_grid_logs_each_neighbours_message() -> None:
    """A 3x3 convolution on a field split 4x4 (rank 5, an inner rank): its forward sends one strip or corner to each
    of its 8 neighbours, each logged with its peer, and bytes of the strips' sizes."""
    grid = hpctp.ProcessGrid.virtual((4, 4), rank=5)
    with torch.device("meta"):
        conv = hpctp.nn.Conv2d(1, 1, 3, padding=1, grid=grid, dtype=torch.float64)
    layout = hpctp.layout.Layout((1, 1, 32, 32), grid.dims, (None, None, 0, 1))
    x = hpctp.DistTensor(torch.empty(layout.local_shape(grid.coords), device="meta", dtype=torch.float64), grid, layout)
    with CallLog() as log:
        conv(x)
    sends = sorted((k.peer, k.sent) for k in log.calls if k.op == "Isend")
    # (peers in the grid's communicator: rank 5 is (1, 1); its neighbours (0..2, 0..2) but itself)
    assert [p for p, _ in sends] == [0, 1, 2, 4, 6, 8, 9, 10], sends
    assert sorted({b for _, b in sends}) == [8, 64], sends  # corners: 1 float64, strips: 8
    assert np.all([k.comm == "hpctp.grid" for k in log.calls if k.op == "Isend"])
    grid.free()
