"""Checkpoints of a ShardedDataParallel: the plain model's global HDF5 file, restored on other plans, stages and rank counts."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from helpers.sharded import first_ranks, make_model, ref_step, reference, sdp_step
from mpi4py import MPI

import hpctp
import hpctp.io
from hpctp.comm.io_calls import bcast_bytes
from hpctp.nn import ParallelPlan, ShardedDataParallel
from hpctp.testing import assert_all, assert_allclose

WORLD = MPI.COMM_WORLD
METHODS = ["serial", "mpio"] if hpctp.io.mpio_available() else ["serial"]  # see tests/test_io.py
SAVED_STEPS, NEXT_STEPS = 2, 2


@pytest.fixture
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One empty directory, created by rank 0 and used by every rank."""
    mine = str(tmp_path_factory.mktemp("sdp")).encode() if WORLD.rank == 0 else None
    return Path(bcast_bytes(WORLD, mine).decode())


def _adam(params: object, lr: float = 0.05) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=lr)  # type: ignore[arg-type]


def _save_plan() -> tuple[tuple[int, ...], int]:
    """The grid saved on (data 2 x spatial 2 from 4 ranks, else data over every rank) and its stage."""
    return ((2, 2), 3) if WORLD.size >= 4 else ((WORLD.size,), 3)


def _train_and_save(path: Path, dims: tuple[int, ...], stage: int, method: str) -> list[float]:
    """Collective over the first ranks. Train, save, and return the losses of the steps after the save."""
    comm = first_ranks(int(np.prod(dims)))
    if comm is None:
        return []
    with hpctp.ProcessGrid(dims, comm=comm) as grid:
        plan = ParallelPlan(grid, data=(0,))
        sdp = ShardedDataParallel(make_model(plan, "spatial"), plan, stage=stage)
        opt = _adam(sdp.parameters())
        for s in range(SAVED_STEPS):
            sdp_step(sdp, opt, "spatial", s)
        hpctp.io.save_checkpoint(path, sdp, opt, SAVED_STEPS, plan.grid, method=method)
        losses = [sdp_step(sdp, opt, "spatial", s) for s in range(SAVED_STEPS, SAVED_STEPS + NEXT_STEPS)]
        plan.free()
    comm.Free()
    return losses


def _restore_plain(path: Path, method: str) -> list[float]:
    """Local (rank 0). The file into a plain torch model and Adam on one rank; the next losses."""
    with hpctp.ProcessGrid((1,), comm=MPI.COMM_SELF) as grid:
        ref = make_model(None, "spatial")
        opt = _adam(ref.parameters(), lr=1.0)  # the file's lr (0.05) replaces it
        step = hpctp.io.load_checkpoint(path, ref, opt, grid, method=method)
    if step != SAVED_STEPS:
        raise AssertionError(f"step {step}")
    return [ref_step(ref, opt, "spatial", s) for s in range(SAVED_STEPS, SAVED_STEPS + NEXT_STEPS)]


def _restore_sharded(path: Path, dims: tuple[int, ...], stage: int, method: str) -> list[float]:
    """Collective over the first ranks. The file into a ShardedDataParallel of another plan and stage."""
    comm = first_ranks(int(np.prod(dims)))
    if comm is None:
        return []
    with hpctp.ProcessGrid(dims, comm=comm) as grid:
        plan = ParallelPlan(grid, data=(0,))
        model = make_model(plan, "spatial")
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.5)  # nothing of the saved values is there before loading
        sdp = ShardedDataParallel(model, plan, stage=stage)
        opt = _adam(sdp.parameters(), lr=1.0)
        step = hpctp.io.load_checkpoint(path, sdp, opt, plan.grid, method=method)
        losses = [sdp_step(sdp, opt, "spatial", s) for s in range(SAVED_STEPS, SAVED_STEPS + NEXT_STEPS)]
        plan.free()
    comm.Free()
    if step != SAVED_STEPS:
        raise AssertionError(f"step {step}")
    return losses


def _bcast_losses(values: list[float]) -> np.ndarray:
    buf = np.array(values if WORLD.rank == 0 else [0.0] * NEXT_STEPS, dtype=np.float64)
    return hpctp.comm.bcast(WORLD, buf, 0)


@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
def test_restart_on_one_rank_and_another_plan(shared_dir: Path, method: str) -> None:
    """Saved at stage 3 on (data 2 x spatial 2) (fewer ranks: data over all of them); restored into a plain torch
    model on one rank and into stage 1 on (data 1 x spatial 3) (or as many ranks as there are): same next losses."""
    path = shared_dir / "sdp.h5"
    dims, stage = _save_plan()
    want = _bcast_losses(_train_and_save(path, dims, stage, method))
    plain = _restore_plain(path, method) if WORLD.rank == 0 else list(want)
    assert_allclose(WORLD, np.array(plain), want, rtol=1e-10, what="next losses, plain model on 1 rank")
    spatial = min(3, WORLD.size)
    got = _restore_sharded(path, (1, spatial), 1, method)
    mine = np.array(got) if got else want
    assert_allclose(WORLD, mine, want, rtol=1e-10, what=f"next losses, data 1 x spatial {spatial}, stage 1")


@pytest.mark.mpi
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_file_equals_the_plain_models(shared_dir: Path, stage: int) -> None:
    """The same datasets, attributes and values (to 1e-10) as the checkpoint of one process's model and Adam after
    the same steps; training goes on after saving (whose .numpy() views pin the parameters' storage)."""
    path, plain_path = shared_dir / f"sdp{stage}.h5", shared_dir / f"plain{stage}.h5"
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))
        model = make_model(plan, "spatial")
        ref = reference(model, plan, "spatial")  # before wrapping: stage 3 frees the parameters
        sdp = ShardedDataParallel(model, plan, stage=stage)
        opt, ref_opt = _adam(sdp.parameters()), _adam(ref.parameters())
        for s in range(SAVED_STEPS):
            sdp_step(sdp, opt, "spatial", s)
            ref_step(ref, ref_opt, "spatial", s)
        hpctp.io.save_checkpoint(path, sdp, opt, SAVED_STEPS, plan.grid)
        if WORLD.rank == 0:
            with hpctp.ProcessGrid((1,), comm=MPI.COMM_SELF) as one:
                hpctp.io.save_checkpoint(plain_path, ref, ref_opt, SAVED_STEPS, one)
        after = [sdp_step(sdp, opt, "spatial", SAVED_STEPS), ref_step(ref, ref_opt, "spatial", SAVED_STEPS)]
        assert_allclose(grid, after[0], after[1], rtol=1e-10, what="training goes on after saving")
        plan.free()
    problems: list[str] = []
    if WORLD.rank == 0:
        problems = _differences(path, plain_path)
    assert_all(WORLD, not problems, "; ".join(problems))


def _differences(path: Path, plain_path: Path) -> list[str]:
    with h5py.File(path, "r") as a, h5py.File(plain_path, "r") as b:
        keys: list[list[str]] = [[], []]
        for f, out in ((a, keys[0]), (b, keys[1])):
            f.visititems(lambda n, o, out=out: out.append(n) if isinstance(o, h5py.Dataset) else None)
        if keys[0] != keys[1]:
            return [f"datasets {keys[0]} vs {keys[1]}"]
        out = []
        for k in keys[0]:
            x, y = a[k][()], b[k][()]
            if x.shape != y.shape or not np.allclose(x, y, rtol=1e-10, atol=1e-13):
                out.append(f"{k} differs")
            if dict(a[k].attrs).get("torch_dtype") != dict(b[k].attrs).get("torch_dtype"):
                out.append(f"{k} dtype")
        if a["optimizer"].attrs["param_groups"] != b["optimizer"].attrs["param_groups"]:
            out.append("param_groups")
        if a["optimizer"].attrs["class"] != b["optimizer"].attrs["class"]:
            out.append("optimizer class")
        return out


@pytest.mark.mpi
def test_errors_on_every_rank(shared_dir: Path) -> None:
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, data=(0,))
        sdp = ShardedDataParallel(make_model(plan, "spatial"), plan, stage=3)
        opt = _adam(sdp.parameters())
        with pytest.raises(FileNotFoundError):
            hpctp.io.load_checkpoint(shared_dir / "missing.h5", sdp, opt, plan.grid)
        with pytest.raises(ValueError, match="plan's grid"):
            hpctp.io.save_checkpoint(shared_dir / "x.h5", sdp, opt, 0, plan.model_grid)
        with pytest.raises(ValueError, match="step must be"):
            hpctp.io.save_checkpoint(shared_dir / "x.h5", sdp, opt, -1, plan.grid)
        stored = sum(p.untyped_storage().nbytes() for p in sdp.module.parameters())
        assert_all(grid, stored == 0, f"stage 3's parameters freed after a failed call ({stored} bytes)")
        plan.free()
