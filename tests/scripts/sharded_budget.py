"""A model 3x a per-rank memory budget (parameters + gradients + Adam state) trains and saves at stage 3, built on meta.

Run by tests/test_sharded_meta.py under ``mpiexec -n 4`` (any count works; the budget is state / (0.75 D)). Each rank
measures its resident memory (:class:`hpctp.PeakMemory`: the kernel's high-water mark) over
construction, 2 Adam steps and a checkpoint save, minus the runtime's own: the same measurement after a warm-up run
of a 2-layer model of the same width. Rank 0 prints one JSON line: the state, the budget and every rank's peaks.

Usage: mpiexec -n 4 python tests/scripts/sharded_budget.py OUT_DIR [WIDTH LAYERS]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import hpctp
import hpctp.io
from hpctp._util.memory import resident_bytes, trim_heap
from hpctp.nn import ParallelPlan, ShardedDataParallel

BATCH = 8


def train(plan: ParallelPlan, width: int, layers: int, steps: int, save: Path | None) -> None:
    """Collective over the plan's grid. Build on meta, shard at stage 3, train ``steps`` Adam steps, save."""
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    sdp = ShardedDataParallel(model, plan, stage=3, seed=0)
    opt = torch.optim.Adam(sdp.parameters(), lr=1e-4, foreach=False)  # (foreach: a slice-sized temporary per step)
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(1))
    a, b = plan.sample_range(BATCH)
    for _ in range(steps):
        sdp(x[a:b]).square().sum().backward()
        sdp.step(opt)
        sdp.zero_grad()
    if save is not None:
        hpctp.io.save_checkpoint(save, sdp, opt, steps, plan.grid)


def main() -> None:
    out = Path(sys.argv[1])
    width, layers = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (512, 32)
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    grid = hpctp.ProcessGrid((world.size,))
    plan = ParallelPlan(grid, data=(0,))
    train(plan, width, 2, 1, out / "warmup.h5")  # the runtime's own memory, with the same kinds of buffers
    trim_heap()  # (glibc: what the warm-up freed is not reused unseen below the baseline)
    base = resident_bytes()
    with hpctp.PeakMemory(baseline=base) as m:
        train(plan, width, layers, 2, out / "budget.h5")
    state = 4 * layers * width * (width + 1) * 4  # parameters, gradients, Adam's two moments (float32)
    budget = state / (0.75 * world.size)
    peaks = hpctp.comm.allgather_ints(world, [m.peak])[:, 0]
    if world.rank == 0:
        print(json.dumps({"state": state, "budget": budget, "peaks": peaks.tolist(), "ranks": world.size}))
    plan.free()
    grid.free()


if __name__ == "__main__":
    main()
