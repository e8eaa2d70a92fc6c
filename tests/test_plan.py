"""ParallelPlan: the roles of grid axes, data groups' shares, and gradients summed over the right axes.

Training on any (data x spatial x tensor) grid must equal one process on the whole global batch.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.layers import global_field

import hpctp
from hpctp.comm.io_calls import bcast_bytes
from hpctp.layout import Layout
from hpctp.nn import Conv2d, ParallelMLP, ParallelPlan, global_mse_loss
from hpctp.testing import assert_all, assert_allclose, assert_equal

F64 = torch.float64
BATCH = 5  # uneven over 2, 3, 4 data groups


def _convnet(grid: hpctp.ProcessGrid | None, split: tuple[int, ...]) -> torch.nn.Module:
    """Two circular 3x3 convolutions with a tanh between (hpctp layers on ``grid``, torch's for None)."""
    if grid is None:
        layers: list[torch.nn.Module] = []
        for seed, (cin, cout) in enumerate(((2, 3), (3, 2))):
            torch.manual_seed(seed)
            layers.append(torch.nn.Conv2d(cin, cout, 3, padding=1, padding_mode="circular", dtype=F64))
        return torch.nn.Sequential(layers[0], torch.nn.Tanh(), layers[1])
    return torch.nn.Sequential(
        Conv2d(2, 3, 3, padding=1, padding_mode="circular", grid=grid, split=split, seed=0, dtype=F64),
        torch.nn.Tanh(),
        Conv2d(3, 2, 3, padding=1, padding_mode="circular", grid=grid, split=split, seed=1, dtype=F64),
    )


@pytest.mark.mpi
def test_plan_roles_and_shares(grid3d) -> None:  # type: ignore[no-untyped-def]
    plan = ParallelPlan(grid3d, data=(0,), tensor=(2,))
    try:
        assert_equal(grid3d, np.array(plan.spatial_axes), np.array([1]), "spatial axes default to the rest")
        assert_equal(grid3d, np.array(plan.model_grid.dims), np.array(grid3d.dims[1:]), "model grid dims")
        assert_equal(grid3d, np.array([plan.spatial, plan.tensor]), np.array([[0], [1]]), "axes on the model grid")
        assert_equal(grid3d, np.array([plan.data_size, plan.data_rank]), np.array([grid3d.dims[0], grid3d.coords[0]]))
        # the model grid's rank is the row-major index of this rank's spatial and tensor coordinates
        assert_equal(grid3d, np.array(plan.model_grid.coords), np.array(grid3d.coords[1:]), "model grid coords")
        # every sample of a batch goes to exactly one data group
        shares = np.zeros(BATCH, dtype=np.int64)
        start, stop = plan.sample_range(BATCH)
        shares[start:stop] = 1
        hpctp.comm.allreduce(plan.data_comm, shares, "sum")
        assert_equal(grid3d, shares, np.ones(BATCH, dtype=np.int64), "each sample in one group")
        assert_equal(grid3d, np.array(plan.loss_axes), np.array([0, 1]), "loss over data and spatial axes")
    finally:
        plan.free()


@pytest.mark.mpi
def test_plan_rejects_bad_roles(grid2d) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="twice"):
        ParallelPlan(grid2d, data=(0,), tensor=(0,))
    with pytest.raises(ValueError, match="outside"):
        ParallelPlan(grid2d, data=(2,))
    with pytest.raises(ValueError, match="no role"):
        ParallelPlan(grid2d, data=(0,), spatial=())
    with pytest.raises(TypeError, match="ints"):
        ParallelPlan(grid2d, data=("x",))  # type: ignore[arg-type]
    # the ranks must agree: a rank-dependent role raises on every rank
    if grid2d.size > 1:
        with pytest.raises(ValueError, match="differ"):
            ParallelPlan(grid2d, data=(grid2d.rank % 2,), spatial=((grid2d.rank + 1) % 2,))


def _train(plan: ParallelPlan, steps: int) -> tuple[list[float], torch.nn.Module]:
    """Adam steps of the conv net on (data x spatial) with the plan's shares of the global batch."""
    grid = plan.model_grid
    model = _convnet(grid, plan.spatial)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    X, Y = global_field((BATCH, 2, 6, 7), 1), global_field((BATCH, 2, 6, 7), 2)
    start, stop = plan.sample_range(BATCH)
    lay = Layout((stop - start, 2, 6, 7), grid.dims, (None, None, *plan.spatial))
    sl = lay.local_slices(grid.coords)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        pred = model(hpctp.DistTensor(X[start:stop][sl].clone(), grid, lay))
        loss = global_mse_loss(pred.local, Y[start:stop][sl], plan.grid, plan.loss_axes)
        loss.backward()
        plan.sync_gradients(model)
        opt.step()
        losses.append(float(loss))
    return losses, model


@pytest.mark.mpi
def test_data_x_spatial_training_equals_one_process(grid3d) -> None:  # type: ignore[no-untyped-def]
    plan = ParallelPlan(grid3d, data=(0,))
    try:
        losses, model = _train(plan, 3)
    finally:
        plan.free()
    ref = _convnet(None, ())
    opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    X, Y = global_field((BATCH, 2, 6, 7), 1), global_field((BATCH, 2, 6, 7), 2)
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = F.mse_loss(ref(X), Y)
        loss.backward()
        opt.step()
        want.append(float(loss))
    assert_allclose(grid3d, np.array(losses), np.array(want), rtol=1e-12, what="losses")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_allclose(grid3d, p.detach(), q.detach(), rtol=1e-10, atol=1e-13, what=name)


@pytest.mark.mpi
def test_data_x_tensor_gradients(grid2d) -> None:  # type: ignore[no-untyped-def]
    """Column/row-split MLP on the tensor axis, samples over the data axis: the tensor axis is never summed."""
    plan = ParallelPlan(grid2d, data=(0,), tensor=(1,))
    try:
        grid = plan.model_grid
        mlp = ParallelMLP(4, 6, grid, axis=plan.tensor[0], seed=3, dtype=F64)
        norm = torch.nn.LayerNorm(4, dtype=F64)  # replicated along the tensor axis: identical gradients there
        X = global_field((BATCH, 3, 4), 5)
        start, stop = plan.sample_range(BATCH)
        y = mlp(norm(X[start:stop]))
        loss = global_mse_loss(y, torch.zeros_like(y), plan.grid, plan.loss_axes)
        loss.backward()
        model = torch.nn.ModuleDict({"mlp": mlp, "norm": norm})
        plan.sync_gradients(model)
        ref_norm = torch.nn.LayerNorm(4, dtype=F64)
        ref = torch.nn.Sequential(torch.nn.Linear(4, 6, dtype=F64), torch.nn.GELU(), torch.nn.Linear(6, 4, dtype=F64))
        state = hpctp.nn.global_state_dict(mlp)
        ref.load_state_dict({k.replace("linear1", "0").replace("linear2", "2"): v for k, v in state.items()})
        yr = ref(ref_norm(X))
        F.mse_loss(yr, torch.zeros_like(yr)).backward()
        assert_allclose(grid, loss.detach(), F.mse_loss(yr, torch.zeros_like(yr)).detach(), rtol=1e-12, what="loss")
        assert_allclose(grid, norm.weight.grad, ref_norm.weight.grad, rtol=1e-10, atol=1e-13, what="norm grad")
    finally:
        plan.free()


@pytest.mark.mpi
def test_loader_shares_global_batches(tmp_path_factory, grid2d) -> None:  # type: ignore[no-untyped-def]
    """Each data group reads its share of every global batch; together they are the one-process batches."""
    world = grid2d.comm
    mine = str(tmp_path_factory.mktemp("plan")).encode() if grid2d.rank == 0 else None
    name = str(Path(bcast_bytes(world, mine).decode()) / "x.h5")
    data = np.arange(7 * 2 * 3, dtype=np.float64).reshape(7, 2, 3)
    if grid2d.rank == 0:
        with h5py.File(name, "w") as f:
            f["x"] = data
    world.Barrier()
    plan = ParallelPlan(grid2d, data=(0,))
    try:
        with hpctp.io.FieldDataset(name, "x", plan.model_grid, (None, plan.spatial[0])) as ds:
            # uneven shares, and a last batch of 1 sample: empty shares where there are several groups
            loader = hpctp.io.FieldLoader(ds, 3, shuffle=True, seed=4, plan=plan)
            seen = np.zeros(7, dtype=np.int64)
            want = np.zeros(7, dtype=np.int64)
            for positions, (x, _) in zip(loader.batches(0), loader):
                share = loader.share(positions)
                assert_all(grid2d, x.global_shape[0] == len(share), "a group's batch is its share")
                full = np.asarray(x.gather(root=None))
                assert_all(grid2d, np.array_equal(full, data[np.sort(share)]), "a group reads its share")
                seen[share] += 1
                want[positions] += 1
            hpctp.comm.allreduce(plan.data_comm, seen, "sum")
            assert_equal(grid2d, seen, want, "every sample of the global batches once")
        with hpctp.io.FieldDataset(name, "x", grid2d, (None, 0)) as other:
            with pytest.raises(ValueError, match="model grid"):
                hpctp.io.FieldLoader(other, 3, plan=plan)
    finally:
        plan.free()
