"""Pipeline parallelism: a chain of layers cut into stages along a grid axis, every schedule against one process.

    mpiexec -n 4 python examples/guide/pipeline_parallel.py [OUTDIR]     (OUTDIR/pipe.h5: a checkpoint)

The grid is 2 x (ranks / 2): grid axis 0 the pipeline (2 stages), grid axis 1 data (the samples). A chain of
3x3 convolutions is built on the meta device (no rank holds the whole model) and trained for a few SGD steps with
each schedule, with plain stages and with ZeRO per stage; every rank also trains the same model in one process and
compares. Rank 0 prints the schedules' tables, the cuts, the differences, and the planner's view of the model.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import hpctp
import hpctp.perf
from hpctp.io import load_checkpoint, save_checkpoint
from hpctp.nn import Conv2d, ParallelPlan, PipelineParallel, global_mse_loss
from hpctp.nn.pipeline_parallel import SCHEDULES, ActionKind, pipeline_schedule

out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/guide")
BATCH, MICRO, WIDTH, DEPTH, SIZE, STEPS, LR = 8, 4, 8, 4, 16, 3, 0.05
F64 = torch.float64


# ------------------------------------------------------------------------------------------------------ the model
def chain(grid: hpctp.ProcessGrid, dtype: torch.dtype = F64) -> list[torch.nn.Module]:
    """2 channels in, DEPTH 3x3 convolutions of WIDTH channels with GELU between, 2 channels out: 11 layers.

    No layer has a seed of its own: their initial values come from torch's generator, in construction order.
    """
    layers: list[torch.nn.Module] = [Conv2d(2, WIDTH, 3, padding=1, grid=grid, dtype=dtype)]
    for _ in range(DEPTH):
        layers += [torch.nn.GELU(), Conv2d(WIDTH, WIDTH, 3, padding=1, grid=grid, dtype=dtype)]
    return layers + [torch.nn.GELU(), Conv2d(WIDTH, 2, 1, grid=grid, dtype=dtype)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step: random fields and the same fields shifted by one column."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 2, SIZE, SIZE, generator=g, dtype=F64)
    return x, torch.roll(x, 1, dims=3)


# ------------------------------------------------------------------------------------------------------ schedules
def schedules(p: int, m: int) -> None:
    """Local. One schedule's table, then every schedule's step, bubble and activations in flight (pure: no MPI)."""
    print(pipeline_schedule("1f1b", p, m))
    print("\nschedule     v  step  bubble  activations held on rank 0   (F = 1, B = 2 units for a rank's layers)")
    for name in SCHEDULES:
        v = 2 if name == "interleaved" else 1
        costs = {ActionKind.F: 1 / v, ActionKind.B: 2 / v}  # zero-bubble's B and W split backward's 2 units
        if name == "zero_bubble":
            costs = {ActionKind.F: 1, ActionKind.B: 1, ActionKind.W: 1}
        timeline = pipeline_schedule(name, p, m, v).simulate(costs)
        held = timeline.peak_in_flight(0) / v  # (in micro-batches' activations of all the rank's layers)
        print(f"{name:11s}  {v}  {timeline.step:4g}  {timeline.bubble_fraction:6.2f}  {held:4g} micro-batches")


# ------------------------------------------------------------------------------------------------------ one process
def one_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Local. The same steps in one process: the losses and the parameters at the end."""
    with hpctp.ProcessGrid([1], comm=MPI.COMM_SELF) as alone:
        torch.manual_seed(0)  # (the draws PipelineParallel(seed=0) replays on every rank)
        ref = torch.nn.Sequential(*chain(alone))
        opt = torch.optim.SGD(ref.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(ref(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in ref.state_dict().items()}


# ------------------------------------------------------------------------------------------------------ the pipeline
grid = hpctp.ProcessGrid([2, 0])  # 2 pipeline ranks x the rest
plan = ParallelPlan(grid, pipeline=0, data=(1,))  # plan.model_grid: each stage's ranks at one data coordinate


def loss_fn(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A micro-batch's mean over its samples in every data group (on the last stage)."""
    return global_mse_loss(prediction, target, plan.grid, plan.loss_axes)


def train(
    schedule: str, virtual: int = 1, zero: int | None = None, cuts: list[int] | None = None
) -> tuple[PipelineParallel, torch.optim.Optimizer, list[float]]:
    """Collective over grid. Build the pipeline from a meta model, run STEPS steps; it and its losses."""
    with torch.device("meta"):
        layers = chain(plan.model_grid)
    model = PipelineParallel(
        layers, plan, schedule=schedule, microbatches=MICRO, virtual=virtual, zero=zero, cuts=cuts, seed=0
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # over this rank's stages (its ZeRO slices with zero=)
    a, b = plan.sample_range(BATCH)  # this data group's samples
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        losses.append(model.step(x[a:b], y[a:b], loss_fn, optimizer=opt))
        model.zero_grad()
    return model, opt, losses


want, final = one_process()
if grid.rank == 0:
    print(f"grid {grid.dims}: axis 0 the pipeline ({plan.pipeline_size} stages), axis 1 data ({plan.data_size} groups)")
    schedules(plan.pipeline_size, MICRO)
    print("\nschedule     v  zero  cuts              rank 0's stages  loss diff  parameter diff (against one process)")

# ------------------------------------------------------------------------------------------------------ the runs
runs = [("gpipe", 1, None), ("1f1b", 1, None), ("interleaved", 2, None), ("zero_bubble", 1, None)]
runs += [("1f1b", 1, 1), ("zero_bubble", 1, 2)]  # ZeRO 1 and 2 per stage, over the data axis
for schedule, virtual, zero in runs:
    model, opt, losses = train(schedule, virtual, zero)
    path = str(out / "pipe.h5")
    save_checkpoint(path, model, opt, STEPS, grid)  # the whole model's plain file, written from the stages
    with hpctp.ProcessGrid([1], comm=MPI.COMM_SELF) as alone:  # each rank reads it into one process's model
        plain = torch.nn.Sequential(*chain(alone))
        load_checkpoint(path, plain, None, alone)
    diffs = np.array([
        max(abs(a - b) for a, b in zip(losses, want)),
        max(float((v - final[k]).abs().max()) for k, v in plain.state_dict().items()),
    ])  # fmt: skip
    hpctp.comm.allreduce(grid.comm, diffs, "max")
    if grid.rank == 0:
        cuts, stages = str(list(model.cuts)), str(model.stages)
        print(f"{schedule:11s}  {virtual}  {zero!s:4}  {cuts:16}  {stages:15}  {diffs[0]:9.1e}  {diffs[1]:9.1e}")

# ------------------------------------------------------------------------------------------------------ stage cuts
if grid.rank == 0:  # the last model's cuts: balanced by parameter count (the default)
    for stage, first, end, share, params, _ in model.balance:
        print(f"stage {stage}: layers {first}:{end}, {share:.0%} of the parameters ({params / 1024:.1f} KiB)")
model, _, losses = train("1f1b", cuts=[0, 3, 11])
if grid.rank == 0:
    print(f"cuts=[0, 3, 11]: stage 0 runs layers {model.layer_names[0:3]}; loss diff {abs(losses[-1] - want[-1]):.1e}")
plan.free()


# ------------------------------------------------------------------------------------------------------ the planner
def build(candidate: ParallelPlan) -> torch.nn.Sequential:
    """The model on a candidate plan's model grid, in float32 (the sample's dtype): a chain, so pipelines count."""
    return torch.nn.Sequential(*chain(candidate.model_grid, torch.float32))


if grid.rank == 0:  # (one process: the planner builds the model on the meta device and sends no message)
    sample = hpctp.perf.Sample((64, 2, 64, 64), "float32")
    report = hpctp.perf.plan(build, sample, ranks=4, memory="16MiB", machine="h100-ndr")
    print()
    print(report.table(top=5, infeasible=3))
grid.free()
