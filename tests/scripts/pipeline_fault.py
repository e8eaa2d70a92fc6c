"""A pipeline whose second stage fails on the values the first sends (tests/test_pipeline_parallel.py): the shapes
fit (the check before the step passes), but stage 1 reads the activations as rows of a 4-row table and finds rows
past its end. Run under ``hpctp.cli.run_main`` on 2 ranks, the failing rank's error ends the job instead of leaving
the other rank waiting for a gradient that never comes."""

from __future__ import annotations

import torch

import hpctp
from hpctp.cli.runner import run_main
from hpctp.nn import ParallelPlan, PipelineParallel, global_mse_loss


class _Lookup(torch.nn.Module):
    """x -> the sum of the table's rows ``|x| + 4``: rows that a 4-row table does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[x.abs().long() + 4].sum(1)


def main() -> int:
    with hpctp.ProcessGrid((0,)) as grid:
        plan = ParallelPlan(grid, pipeline=0)
        layers = [torch.nn.Linear(4, 4, dtype=torch.float64), _Lookup()]
        pipe = PipelineParallel(layers, plan, schedule="1f1b", microbatches=2, cuts=(0, 1, 2))
        x = torch.ones(4, 4, dtype=torch.float64)
        pipe.step(x, x, lambda p, t: global_mse_loss(p, t, plan.grid, plan.loss_axes))
    return 0


if __name__ == "__main__":
    run_main(main)
