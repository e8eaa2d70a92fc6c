"""Choosing a plan: hpctp.perf.plan ranks the ways to train a model on N ranks within a memory budget.

    python examples/guide/planning.py      (one process: the planner sends no message)

The model is a chain of 3x3 convolutions on 2 x 256 x 256 fields, written for a plan's model grid (the
planner builds it on the meta device for every grid it considers, so nothing is allocated). The planner
traces one training step, prices each layer's own messages on each candidate grid with a machine
profile (here the published figures of an A100 cluster), and ranks the plans that fit 256 MiB per
rank by predicted step time; plans that do not fit are listed with the reason.
"""

import torch

import hpctp
import hpctp.perf
from hpctp.nn import Conv2d, ParallelPlan

WIDTH, LAYERS = 32, 6


def build(plan: ParallelPlan) -> torch.nn.Sequential:
    """The model on ``plan``'s model grid: a chain, so pipeline plans are considered too."""
    grid = plan.model_grid
    layers: list[torch.nn.Module] = [Conv2d(2, WIDTH, 3, padding=1, grid=grid, seed=0)]
    for k in range(LAYERS):
        layers += [torch.nn.GELU(), Conv2d(WIDTH, WIDTH, 3, padding=1, grid=grid, seed=1 + k)]
    return torch.nn.Sequential(*layers, Conv2d(WIDTH, 2, 1, grid=grid, seed=9))


sample = hpctp.perf.Sample((16, 2, 256, 256), "float32")  # the global batch of one step
report = hpctp.perf.plan(build, sample, ranks=8, memory="256MiB", machine="a100-hdr")
print(report.table(top=6))
best = report.best
print(f"\nbest: {best.candidate.label()}, {best.memory.total / 2**20:.0f} MiB per rank, bounded by {best.bottleneck}")
