"""Three small jobs with a fault each, which examples/guide/debugging.py runs under mpiexec with HPCTP_* set.

    HPCTP_WATCHDOG=3 mpiexec -n 2 python examples/guide/debugging_job.py skip
    HPCTP_CHECK=1    mpiexec -n 2 python examples/guide/debugging_job.py histogram
    HPCTP_TRACE=500  mpiexec -n 2 python examples/guide/debugging_job.py uneven

skip       The ranks hold uneven data (5 and 3 samples, batches of 2); a rank whose batch is empty leaves the
           step's all-reduce out, so its last all-reduce meets another one and the other rank waits forever.
histogram  Each rank bins its own values with numpy's "auto" bin count, so the ranks all-reduce counts of
           different sizes.
uneven     A field cut unevenly over the ranks (rank 1's block 1.5x rank 0's) goes through 3x3 convolutions;
           the work before each layer grows with the block (a sleep stands in for it), so rank 1 posts every
           halo late.
"""

import sys
import time

import numpy as np
import torch

import hpctp
from hpctp.comm import allreduce
from hpctp.layout import Layout
from hpctp.nn import Conv2d


def skip(grid: hpctp.ProcessGrid) -> None:
    samples = np.arange(5.0) if grid.rank == 0 else np.arange(3.0)  # (uneven data: 5 and 3 samples)
    total = np.zeros(1)
    for step in range(3):
        batch = samples[2 * step : 2 * step + 2]
        if len(batch) == 0:
            continue  # the bug: this rank leaves the step's all-reduce out
        loss = np.array([float((batch**2).mean())])
        allreduce(grid.comm, loss)  # the step's loss, summed over the ranks
        total += loss
    allreduce(grid.comm, total)  # the epoch's: where the ranks part
    print(f"rank {grid.rank}: epoch done, total {total[0]}", flush=True)


def histogram(grid: hpctp.ProcessGrid) -> None:
    values = np.random.default_rng(grid.rank).normal(size=1000 * (grid.rank + 1))
    counts, _ = np.histogram(values, bins="auto")  # the bug: each rank picks its own number of bins
    try:
        allreduce(grid.comm, counts)  # the counts of all the ranks' values
    except hpctp.debug.CollectiveMismatch as e:  # (raised on every rank; caught here to print it once)
        if grid.rank == 0:
            print(f"{type(e).__name__}: {e}", flush=True)
        sys.exit(1)


def uneven(grid: hpctp.ProcessGrid) -> None:
    widths = [16 if r % 2 == 0 else 24 for r in range(grid.size)]  # rank 1's block: 1.5x rank 0's
    cuts = tuple(np.concatenate([[0], np.cumsum(widths)]).tolist())
    layout = Layout((1, 4, 32, cuts[-1]), grid.dims, (None, None, 0, 1), cuts=(None, None, None, cuts))
    convs = [Conv2d(4, 4, 3, padding=1, grid=grid, seed=k) for k in range(3)]

    def work(module: torch.nn.Module, args: tuple) -> None:  # stands in for work that grows with the block
        time.sleep(0.08 * args[0].local.shape[-1] / min(widths))

    for conv in convs:
        conv.register_forward_pre_hook(work)
    x = hpctp.DistTensor(torch.randn(layout.local_shape(grid.coords)), grid, layout)
    with torch.no_grad():
        for _ in range(2):
            y = x
            for conv in convs:
                y = conv(y).redistribute(layout)  # (each layer's output is cut evenly: back to the uneven cut)
    print(f"rank {grid.rank}: block of {widths[grid.rank]} columns, done", flush=True)


if __name__ == "__main__":
    grid = hpctp.ProcessGrid([1, 0])
    {"skip": skip, "histogram": histogram, "uneven": uneven}[sys.argv[1]](grid)
