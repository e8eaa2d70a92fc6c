"""Spatially partitioned conv stack vs single-process torch: time and peak memory per process.

Usage::

    mpiexec -n 2 python benchmarks/conv.py                 # 1x16x2048x2048 float32 field
    mpiexec -n 2 python benchmarks/conv.py --size 256      # shrink

In one run: every rank runs forward+backward of ``layers`` x (Conv2d 3x3 + ReLU) on its
block of the field (1 torch thread per rank), then rank 0 starts the single-process torch
reference in a *separate process* (``--threads`` torch threads, default = number of
ranks) while the other ranks sleep, so each process's peak RSS (``getrusage`` maxrss) is
its own. The input is an analytic function of the global index, so both compute the same
loss (printed as a sanity check).
"""

from __future__ import annotations

import argparse

import _layers as L
import torch


def reference(args: argparse.Namespace) -> None:
    """Single-process torch (a singleton MPI, unused: the script starts through hpctp.cli.runner); one JSON line."""

    def make(c: int, seed: int, dtype: torch.dtype) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Conv2d(c, c, 3, padding=1, dtype=dtype)

    L.reference(args, make, torch.nn.ReLU)


def distributed(args: argparse.Namespace) -> None:
    from hpctp.nn import sync_gradients
    from hpctp.nn.spatial.conv import Conv2d

    grid, x, base = L.setup_ranks(args)
    dtype = x.dtype

    def make(c: int, seed: int) -> torch.nn.Module:
        return Conv2d(c, c, 3, padding=1, dtype=dtype, grid=grid, seed=seed, overlap=not args.no_overlap)

    model = L.stack(make, args.layers, args.channels, torch.nn.ReLU)

    def sync() -> None:  # sum the partial parameter gradients (one all-reduce per bucket)
        sync_gradients(model, grid)

    grid.comm.Barrier()
    sec, cpu, loss = L.run(model, x, args.reps, sync)
    del x
    table = L.gather_stats(grid, [sec, loss, L.peak_mb(), base, cpu])
    threads = args.threads or grid.size
    argv = ["--size", str(args.size), "--channels", str(args.channels), "--layers", str(args.layers)]
    ref = L.reference_run(grid, __file__, threads, argv + ["--reps", str(args.reps), "--dtype", args.dtype])
    if ref is None:  # not rank 0
        return
    print(
        f"field 1x{args.channels}x{args.size}x{args.size} {args.dtype}; {args.layers} x Conv2d({args.channels},"
        f"{args.channels},3,padding=1) + ReLU; loss = sum(y^2); forward+backward, mean of {args.reps} after 1 warm-up"
    )
    L.report(
        table,
        ref,
        f"hpctp : {grid.size} ranks, grid {grid.dims}, 1 torch thread each, overlap={not args.no_overlap}",
        f"torch : 1 process, {threads} threads (separate process)",
    )
    if args.json:
        import plots

        c, s = args.channels, args.size
        layer = f"Conv2d({c},{c},3)+ReLU"
        results = L.results(
            args, table, ref, benchmark="conv", title="Convolution", reference="torch",
            caption=f"{args.layers} × {layer}, forward+backward, 1×{c}×{s}×{s} {args.dtype}",
            measures=f"Forward+backward of {args.layers} × {layer} on a 1×{c}×{s}×{s} {args.dtype} field (mean of "
            f"{args.reps} iterations after a warm-up) and each process's peak resident set, hpctp's halo-exchanging "
            f"`Conv2d` on {grid.size} ranks against `torch.nn.Conv2d` in one separate process with {threads} threads, "
            "in the same run.",
        )  # fmt: skip
        print(f"results written to {plots.dump(results, args.json)}")


if __name__ == "__main__":
    p = L.parser(__doc__, size=2048, layers=3, reps=2)
    p.add_argument("--no-overlap", action="store_true", help="fetch the halo before computing (no overlap)")
    L.start(p, reference, distributed)
