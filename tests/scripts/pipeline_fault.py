"""A pipeline whose second stage does not fit the first's output (tests/test_pipeline_parallel.py): run under
``hpctp.cli.run_main`` on 2 ranks, the failing rank's error ends the job instead of leaving the other rank waiting
for a gradient that never comes."""

from __future__ import annotations

import torch

import hpctp
from hpctp.cli.runner import run_main
from hpctp.nn import ParallelPlan, PipelineParallel, global_mse_loss


def main() -> int:
    with hpctp.ProcessGrid((0,)) as grid:
        plan = ParallelPlan(grid, pipeline=0)
        layers = [torch.nn.Linear(4, 4, dtype=torch.float64), torch.nn.Linear(5, 4, dtype=torch.float64)]
        pipe = PipelineParallel(layers, plan, schedule="1f1b", microbatches=2, cuts=(0, 1, 2))
        x = torch.ones(4, 4, dtype=torch.float64)
        pipe.step(x, x, lambda p, t: global_mse_loss(p, t, plan.grid, plan.loss_axes))
    return 0


if __name__ == "__main__":
    run_main(main)
