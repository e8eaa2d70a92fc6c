"""Checkpoints of a PipelineParallel: the plain global file of the whole model, restored into one process's model, into
a pipeline of another schedule, stage count or ZeRO stage, with the optimizer's state (training goes on as one
process's would); a file of another model refused on every rank."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.sharded import torch_step
from mpi4py import MPI

import hpctp
from hpctp.io import load_checkpoint, save_checkpoint
from hpctp.nn import ParallelPlan, PipelineParallel, global_mse_loss
from hpctp.testing import assert_allclose

WORLD = MPI.COMM_WORLD
F64 = torch.float64
N, M, E = 6, 3, 4  # samples, micro-batches, features
FIRST, LATER = 2, 3  # steps before the checkpoint, steps after it


def _layers() -> list[torch.nn.Module]:
    """7 layers (Linear, Tanh, ...): uneven cuts on most stage counts."""
    torch.manual_seed(0)
    out: list[torch.nn.Module] = []
    for _ in range(4):
        out += [torch.nn.Linear(E, E, dtype=F64), torch.nn.Tanh()]
    return out[:-1]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(N, E, generator=g, dtype=F64), torch.randn(N, E, generator=g, dtype=F64)


def _reference() -> list[float]:
    """One process, FIRST + LATER Adam steps on the whole batch: the losses."""
    ref = torch.nn.Sequential(*_layers())
    opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    out = []
    for s in range(FIRST + LATER):
        out.append(torch_step(ref, opt, *_batch(s)))
    return out


def _train(model: PipelineParallel, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    plan = model.plan
    a, b = plan.sample_range(N)

    def loss(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return global_mse_loss(p, t, plan.grid, plan.loss_axes)

    out = []
    for s in steps:
        x, y = _batch(s)
        out.append(model.step(x[a:b].contiguous(), y[a:b].contiguous(), loss, optimizer=opt))
        model.zero_grad()
    return out


# (grid dims, data axes) and the (schedule, virtual, zero) saved, then restored
_PIPES = {
    1: [((1,), (), ("1f1b", 1, None), ("interleaved", 2, 1))],
    2: [((2,), (), ("1f1b", 1, None), ("interleaved", 2, None)), ((2,), (), ("zero_bubble", 1, 2), ("1f1b", 1, None))],
    3: [((3,), (), ("interleaved", 2, None), ("gpipe", 1, None))],
    4: [((2, 2), (1,), ("1f1b", 1, 2), ("interleaved", 2, 1)), ((4,), (), ("1f1b", 1, None), ("zero_bubble", 1, None))],
    6: [((3, 2), (1,), ("1f1b", 1, 1), ("zero_bubble", 1, 2))],
}  # fmt: skip
CASES = [
    pytest.param(dims, data, saved, restored, id=f"{'x'.join(map(str, dims))}-{saved[0]}-zero{saved[2]}-to-{restored[0]}-zero{restored[2]}")
    for dims, data, saved, restored in _PIPES.get(WORLD.size, [])
]  # fmt: skip


def _path(tmp_path: Path, name: str) -> str:
    return WORLD.bcast(str(tmp_path / name), root=0)


@pytest.mark.mpi
@pytest.mark.parametrize(("dims", "data", "saved", "restored"), CASES)
def test_restart_in_another_pipeline_and_in_one_process(
    tmp_path: Path, dims: tuple[int, ...], data: tuple[int, ...], saved: tuple, restored: tuple
) -> None:
    """Train FIRST steps on a pipeline, save; restore (a) into another pipeline of the same grid (another schedule,
    virtual stage count, ZeRO stage) and (b) on each rank alone into a plain one-process model; both go on for LATER
    steps with the restored Adam state and their losses equal one process's uninterrupted run to 1e-10."""
    path = _path(tmp_path, "pipe.h5")
    want = _reference()
    with hpctp.ProcessGrid(dims) as grid:
        plan = ParallelPlan(grid, data=data, pipeline=0)
        schedule, virtual, zero = saved
        model = PipelineParallel(_layers(), plan, schedule=schedule, microbatches=M, virtual=virtual, zero=zero)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        first = _train(model, opt, range(FIRST))
        save_checkpoint(path, model, opt, FIRST, grid)

        schedule, virtual, zero = restored
        with torch.device("meta"):
            layers = _layers()
        again = PipelineParallel(layers, plan, schedule=schedule, microbatches=M, virtual=virtual, zero=zero, seed=7)
        opt2 = torch.optim.Adam(again.parameters(), lr=1.0)  # (the saved lr comes back with the state)
        step = load_checkpoint(path, again, opt2, grid)
        later = _train(again, opt2, range(FIRST, FIRST + LATER))
        assert_allclose(grid, np.array([float(step), *first, *later]), np.array([FIRST, *want]), rtol=1e-10,
                        what="step and losses, saved pipeline then restored pipeline")  # fmt: skip
        plan.free()

    with hpctp.ProcessGrid((1,), comm=MPI.COMM_SELF) as alone:
        plain = torch.nn.Sequential(*_layers())
        opt3 = torch.optim.Adam(plain.parameters(), lr=1.0)
        load_checkpoint(path, plain, opt3, alone)
        losses = []
        for s in range(FIRST, FIRST + LATER):
            losses.append(torch_step(plain, opt3, *_batch(s)))
    with hpctp.ProcessGrid((WORLD.size,)) as world:
        assert_allclose(world, np.array(losses), np.array(want[FIRST:]), rtol=1e-10, what="losses restored alone")


@pytest.mark.mpi
def test_a_file_of_another_model_is_refused_everywhere(tmp_path: Path) -> None:
    """A file saved from a deeper model: strict loading names the tensors no stage has, on every rank; strict=False
    restores the layers the pipeline has; a grid other than the plan's is refused."""
    path = _path(tmp_path, "other.h5")
    if WORLD.rank == 0:
        with hpctp.ProcessGrid((1,), comm=MPI.COMM_SELF) as alone:
            deeper = torch.nn.Sequential(*_layers(), torch.nn.Tanh(), torch.nn.Linear(E, E, dtype=F64))
            save_checkpoint(path, deeper, None, 0, alone)
    WORLD.Barrier()
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, pipeline=0)
        model = PipelineParallel(_layers(), plan, schedule="1f1b", microbatches=M)
        with pytest.raises(KeyError, match=r"no stage of the pipeline has: \['8.bias', '8.weight'\]"):
            load_checkpoint(path, model, None, grid)
        step = load_checkpoint(path, model, None, grid, strict=False)  # (the layers the pipeline has)
        assert_allclose(grid, np.array([float(step)]), np.array([0.0]), what="step of the deeper file")
        with hpctp.ProcessGrid((WORLD.size,)) as another, pytest.raises(ValueError, match="pass pipe.plan.grid"):
            save_checkpoint(path, model, None, 0, another)
        plan.free()
