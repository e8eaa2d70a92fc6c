"""A conv stack on an uneven split, for tests/test_debug_faults.py (run under mpiexec with HPCTP_TRACE set).

    HPCTP_TRACE=500 HPCTP_TRACE_DIR=DIR mpiexec -n 3 python tests/scripts/imbalance_job.py BASE_MS

The field's last dim is cut over a 1 x n grid so that rank 1's block is 1.5x the others'
(8, 12, 8, ... columns). Before each of the ``LAYERS`` convolutions every rank sleeps
``BASE_MS`` x its block / the smallest block, which stands in for work that grows with the
block: rank 1 then posts its halo ``BASE_MS / 2`` after the others, at every layer. The output
(balanced by the layer) is moved back to the uneven layout before the next layer. Each rank
writes its flight-recorder dump at exit.
"""

from __future__ import annotations

import sys
import time

import torch

import hpctp
from hpctp.layout import Layout
from hpctp.nn.conv import Conv2d

LAYERS, STEPS = 3, 2


def main() -> None:
    base = float(sys.argv[1]) / 1e3
    grid = hpctp.ProcessGrid([1, 0])
    widths = [12 if r == 1 else 8 for r in range(grid.size)]
    cuts = [0]
    for w in widths:
        cuts.append(cuts[-1] + w)
    layout = Layout((1, 2, 6, cuts[-1]), grid.dims, (None, None, 0, 1), cuts=(None, None, None, tuple(cuts)))
    convs = [Conv2d(2, 2, 3, padding=1, grid=grid, seed=i, dtype=torch.float64) for i in range(LAYERS)]
    smallest = min(widths)

    def work(module: torch.nn.Module, args: tuple) -> None:  # stands in for compute that grows with the block
        time.sleep(base * args[0].local.shape[-1] / smallest)

    for conv in convs:
        conv.register_forward_pre_hook(work)
    torch.manual_seed(0)
    x = hpctp.DistTensor(torch.randn(layout.local_shape(grid.coords), dtype=torch.float64), grid, layout)
    with torch.no_grad():
        for _ in range(STEPS):
            y = x
            for conv in convs:
                y = conv(y).redistribute(layout)
    print(f"rank {grid.rank} block {widths[grid.rank]} columns, done", flush=True)


if __name__ == "__main__":
    main()
