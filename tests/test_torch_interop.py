"""torch.distributed beside hpctp: the grid's process group and DeviceMesh, DTensor round trips."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import hpctp
from hpctp import comm as C
from hpctp.comm.torch_dist import device_mesh, process_group, torch_ranks
from hpctp.tensor.dtensor import chunk_cuts
from hpctp.testing import assert_all, assert_allclose, assert_equal

EVEN = (12, 12)  # divisible by every grid axis of 1 to 6 ranks but 5
UNEVEN = (7, 5)  # torch.chunk leaves some ranks short or empty


@pytest.fixture(scope="module", autouse=True)
def torch_world() -> Iterator[None]:
    """torch.distributed over every rank, once for the file (process_group initialises it where no
    earlier test did; every rank gets here at the first test of the file)."""
    grid = hpctp.ProcessGrid((0,))
    process_group(grid, "gloo")
    yield
    grid.free()


def chunked(
    grid: hpctp.ProcessGrid, a: np.ndarray, split: tuple[int | None, ...], device: str = "cpu"
) -> hpctp.DistTensor:
    """Local. ``a`` as a DistTensor with torch.chunk's cuts (DTensor's), torch blocks on ``device``."""
    cuts = tuple(None if g is None else chunk_cuts(n, grid.dims[g]) for n, g in zip(a.shape, split))
    lay = hpctp.Layout(a.shape, grid.dims, split, cuts=cuts)
    return hpctp.DistTensor(torch.from_numpy(a[lay.local_slices(grid.coords)].copy()).to(device), grid, lay)


def values(shape: tuple[int, ...]) -> np.ndarray:
    return np.arange(np.prod(shape), dtype=np.float64).reshape(shape) * 0.25 - 3.0


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.mpi
def test_process_group_and_mesh_follow_the_grid(grid2d: hpctp.ProcessGrid) -> None:
    pg = process_group(grid2d, "gloo")
    ok = (
        process_group(grid2d, "gloo") is pg
        and dist.get_rank(pg) == grid2d.rank
        and dist.get_world_size(pg) == grid2d.size
    )
    assert_all(grid2d, ok, "group ranks are grid ranks; cached")
    t = torch.tensor([(grid2d.rank + 1.0) ** 2], dtype=torch.float64)
    dist.all_reduce(t, group=pg)
    assert_equal(grid2d, t.numpy(), C.allreduce(grid2d.comm, np.array([(grid2d.rank + 1.0) ** 2])), "all_reduce")

    mesh = device_mesh(grid2d, "cpu")
    ranks = torch_ranks(grid2d)
    ok = device_mesh(grid2d, "cpu") is mesh and tuple(mesh.shape) == grid2d.dims
    ok = ok and tuple(mesh.get_coordinate() or ()) == grid2d.coords
    ok = ok and all(int(mesh.mesh[c]) == ranks[grid2d.rank_of(c)] for c in np.ndindex(*grid2d.dims))
    assert_all(grid2d, ok, "mesh coordinates are grid coordinates")
    for axis in range(grid2d.ndim):  # the mesh's groups reduce along the grid's axes
        t = torch.tensor([float(grid2d.rank)], dtype=torch.float64)
        dist.all_reduce(t, group=mesh.get_group(axis))
        want = C.allreduce(grid2d.sub(axis), np.array([float(grid2d.rank)]))
        assert_equal(grid2d, t.numpy(), want, f"all_reduce along axis {axis}")


def round_trip(grid: hpctp.ProcessGrid, a: np.ndarray, split: tuple[int | None, ...], device: str = "cpu") -> None:
    """Collective over grid. DistTensor -> DTensor -> DistTensor: values equal, no copy either way."""
    mesh = device_mesh(grid, device)
    x = chunked(grid, a, split, device)
    dt = x.to_dtensor(mesh)
    what = f"{a.shape} split {split} on {grid.dims}"
    want_placements = tuple(Shard(split.index(i)) if i in split else Replicate() for i in range(grid.ndim))
    ok = isinstance(dt, DTensor) and tuple(dt.placements) == want_placements and tuple(dt.shape) == a.shape
    assert_all(grid, ok and same_storage(dt.to_local(), x.local), f"to_dtensor shares the block: {what}")
    assert_equal(grid, dt.full_tensor(), x.gather(None), f"full_tensor: {what}")
    y = hpctp.from_dtensor(dt, grid)
    assert_all(grid, y.layout == x.layout and same_storage(y.local, x.local), f"from_dtensor shares it: {what}")
    assert_equal(grid, y.gather(None), a, f"from_dtensor values: {what}")
    z = hpctp.from_dtensor(dt * 2 + 1, grid)  # a DTensor op, back in hpctp
    assert_allclose(grid, z.gather(None), (x * 2 + 1).gather(None), what=f"dt * 2 + 1: {what}")


@pytest.mark.mpi
@pytest.mark.parametrize("shape", [EVEN, UNEVEN], ids=["even", "uneven"])
def test_round_trips_2d(grid2d: hpctp.ProcessGrid, shape: tuple[int, ...]) -> None:
    a = values(shape)
    for split in [(None, None), (0, 1), (1, 0), (0, None), (None, 1)]:
        round_trip(grid2d, a, split)


@pytest.mark.mpi
def test_round_trips_3d(grid3d: hpctp.ProcessGrid) -> None:
    a = values((5, 4, 7))
    for split in [(0, 1, 2), (2, None, 0)]:  # every axis divides; axis 1 replicated
        round_trip(grid3d, a, split)


@pytest.mark.mpi
def test_cuda_blocks_on_an_nccl_mesh(grid2d: hpctp.ProcessGrid) -> None:
    node_ranks = C.local_rank(grid2d.comm)[1]
    if not C.all_true(grid2d.comm, torch.cuda.is_available() and C.gpu_count() >= node_ranks):
        pytest.skip("needs a CUDA device per rank (NCCL)")
    C.select_device(grid2d.comm)
    for split in [(0, 1), (None, 0)]:
        round_trip(grid2d, values(UNEVEN), split, "cuda")


@pytest.mark.mpi
def test_matmul_of_dtensors_equals_hpctp(grid2d: hpctp.ProcessGrid) -> None:
    mesh = device_mesh(grid2d, "cpu")
    a, b = values((9, 6)), values((6, 5)) / 7
    x, w = chunked(grid2d, a, (0, None)), chunked(grid2d, b, (None, None))  # rows sharded, weights replicated
    out = torch.mm(x.to_dtensor(mesh), w.to_dtensor(mesh))
    assert_allclose(grid2d, out.full_tensor(), (x @ w).gather(None), what="torch.mm of DTensors")
    assert_allclose(grid2d, hpctp.from_dtensor(out, grid2d).gather(None), a @ b, what="back in hpctp")


@pytest.mark.mpi
def test_clear_errors_on_every_rank(grid2d: hpctp.ProcessGrid) -> None:
    mesh = device_mesh(grid2d, "cpu")
    a = values(UNEVEN)
    x = chunked(grid2d, a, (0, 1))
    with pytest.raises(TypeError, match=r"needs torch blocks, got numpy: convert them first, x.to\('torch'\)"):
        x.to("numpy").to_dtensor(mesh)
    line = hpctp.ProcessGrid((grid2d.size,))
    with pytest.raises(ValueError, match=r"the mesh has shape \(\d+,\) but the grid has dims"):
        x.to_dtensor(device_mesh(line, "cpu"))
    if grid2d.dims[0] > 1:  # cuts that are not torch.chunk's: everything in the last block
        cuts = ((0,) * grid2d.dims[0] + (a.shape[0],), None)
        skew = hpctp.Layout(a.shape, grid2d.dims, (0, None), cuts=cuts)
        y = hpctp.DistTensor(torch.from_numpy(a[skew.local_slices(grid2d.coords)].copy()), grid2d, skew)
        with pytest.raises(ValueError, match=r"dim 0 \(size 7\): hpctp's cuts .* DTensor's .* x.redistribute"):
            y.to_dtensor(mesh)
    with pytest.raises(ValueError, match="the mesh has shape"):
        hpctp.from_dtensor(x.to_dtensor(mesh), line)
    balanced = hpctp.Layout(a.shape, grid2d.dims, (0, None))  # hpctp's cuts: 3, 2, 2 on 3 ranks; chunk's 3, 3, 1
    if balanced.dim_cuts[0] != chunk_cuts(a.shape[0], grid2d.dims[0]):  # some ranks' blocks are not chunk's
        b = torch.from_numpy(a[balanced.local_slices(grid2d.coords)].copy())
        dt = DTensor.from_local(
            b, mesh, (Shard(0), Replicate()), run_check=False, shape=torch.Size(a.shape), stride=(5, 1)
        )
        with pytest.raises(ValueError, match="the DTensor's local tensor has shape"):
            hpctp.from_dtensor(dt, grid2d)
    partial = DTensor.from_local(x.local, mesh, (Partial(), Replicate()), run_check=False)
    with pytest.raises(ValueError, match=r"Partial.* on mesh dim 0 holds partial values.*t.redistribute"):
        hpctp.from_dtensor(partial, grid2d)
    both = DTensor.from_local(
        x.local, mesh, (Shard(0), Shard(0)), run_check=False, shape=torch.Size(a.shape), stride=(5, 1)
    )
    with pytest.raises(ValueError, match="mesh dims 0 and 1 both shard tensor dim 0"):
        hpctp.from_dtensor(both, grid2d)
    with pytest.raises(TypeError, match="needs a torch DTensor, got Tensor"):
        hpctp.from_dtensor(x.local, grid2d)
    line.free()


@pytest.mark.mpi(min_size=2)
def test_grid_in_another_rank_order(world: MPI.Intracomm) -> None:
    rev = world.Split(0, world.Get_size() - 1 - world.Get_rank())  # grid rank g is world rank size - 1 - g
    grid = hpctp.ProcessGrid((0, 0), comm=rev)
    pg = process_group(grid, "gloo")
    ok = dist.get_rank(pg) == grid.rank and torch_ranks(grid) == tuple(reversed(range(grid.size)))
    assert_all(grid, ok, "the group's ranks follow the grid's, not torch's default order")
    round_trip(grid, values(UNEVEN), (1, 0))
    grid.free()
    rev.Free()


@pytest.mark.mpi(min_size=2)
def test_grid_of_part_of_the_torch_world_is_refused(world: MPI.Intracomm) -> None:
    half = world.Split(world.Get_rank() % 2, world.Get_rank())
    grid = hpctp.ProcessGrid((0,), comm=half)
    with pytest.raises(ValueError, match="default group has .* processes but the grid holds default-group ranks"):
        process_group(grid, "gloo")
    grid.free()
    half.Free()
