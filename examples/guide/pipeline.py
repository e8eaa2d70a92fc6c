"""Pipeline parallelism: a chain of layers cut into stages, one per rank, trained as one process trains it.

    mpiexec -n 2 python examples/guide/pipeline.py [OUTDIR]     (figure: OUTDIR/timeline.png)

A chain of 3x3 convolutions and GELUs on 16x16 fields is built on the meta device (no rank ever holds
the whole model) and cut into two stages balanced by parameter count; each rank materializes only its
stage. A global batch of 6 fields goes through in 3 micro-batches with the 1F1B schedule, whose action
lists are printed first. Rank 0 prints; the same steps run in one process for reference.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import hpctp
import hpctp.nn
from hpctp.nn import Conv2d, ParallelPlan, PipelineParallel

out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/guide")
BATCH, MICRO, WIDTH, SIZE, STEPS = 6, 3, 8, 16, 3


def chain(grid: hpctp.ProcessGrid) -> list[torch.nn.Module]:
    """Lift to WIDTH channels, 4 convolutions with GELU between, back to one channel."""
    layers: list[torch.nn.Module] = [Conv2d(1, WIDTH, 3, padding=1, grid=grid, seed=0)]
    for k in range(4):
        layers += [torch.nn.GELU(), Conv2d(WIDTH, WIDTH, 3, padding=1, grid=grid, seed=1 + k)]
    return layers + [Conv2d(WIDTH, 1, 1, grid=grid, seed=9)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 1, SIZE, SIZE, generator=g)
    return x, torch.roll(x, 1, dims=3)  # learn a shift by one column


grid = hpctp.ProcessGrid([0])  # every rank along one axis: the pipeline
plan = ParallelPlan(grid, pipeline=0)  # the model grid of each stage: one rank here
with torch.device("meta"):
    layers = chain(plan.model_grid)
model = PipelineParallel(layers, plan, schedule="1f1b", microbatches=MICRO, seed=0)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
if grid.rank == 0:
    print(model.schedule)
    print(f"cuts {list(model.cuts)}: stage s holds layers cuts[s]:cuts[s+1]; rank 0 holds {model.stages}")


def loss_fn(p: hpctp.DistTensor, t: hpctp.DistTensor) -> torch.Tensor:
    return hpctp.nn.global_mse_loss(p.local, t.local, plan.grid, plan.loss_axes)


losses = []
for step in range(STEPS):
    x, y = batch(step)
    xs, ys = (hpctp.distribute(t, plan.model_grid, (None, None, 0, None)) for t in (x, y))
    losses.append(model.step(xs, ys, loss_fn, optimizer=opt))  # forward and backward of every micro-batch
    model.zero_grad()
timeline = model.timeline  # this rank's last step: (action, start, end)
idle = np.array([model.idle_fraction()])
hpctp.comm.allreduce(grid.comm, idle, "sum")
spans = grid.comm.gather(timeline, root=0)  # (small Python lists: for the figure only)

if grid.rank == 0:
    with hpctp.ProcessGrid([1], comm=MPI.COMM_SELF) as one:  # the same model and steps in one process
        torch.manual_seed(0)
        ref = torch.nn.Sequential(*chain(one))
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        want = []
        for step in range(STEPS):
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(ref(x), y)
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            want.append(float(loss.detach()))
    print("step  pipeline loss    one process     relative difference")
    for k, (a, b) in enumerate(zip(losses, want)):
        print(f"{k:4d}  {a:.10f}   {b:.10f}   {abs(a - b) / b:.1e}")
    print(
        f"measured bubble (idle share of the last step, mean over ranks): {idle[0] / grid.size:.2f}; "
        f"the schedule's closed form (p - 1) / (m + p - 1): {(grid.size - 1) / (MICRO + grid.size - 1):.2f}"
    )

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.5 * grid.size))
    t0 = min(s for rank in spans for name, s, _ in rank if name == "step")
    for r, rank in enumerate(spans):
        for name, s, e in rank:
            if name != "step":
                color = "tab:blue" if "F" in name else "tab:orange"
                ax.barh(r, (e - s) * 1e3, left=(s - t0) * 1e3, color=color, edgecolor="white")
                ax.text((s + e - 2 * t0) / 2 * 1e3, r, name, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(grid.size), [f"rank {r}" for r in range(grid.size)])
    ax.invert_yaxis()
    ax.set_xlabel("ms into the step (forward blue, backward orange; gaps: the bubble)")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "timeline.png", dpi=100)
plan.free()
grid.free()
