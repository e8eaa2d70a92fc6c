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
import json
import os
import resource
import subprocess
import sys
import time

import torch


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _field(c: int, h: tuple[int, int], w: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Block [h0:h1, w0:w1] of x[0, c, i, j] = sin(0.013 i + 0.007 j + 0.5 c) (built in place)."""
    base = torch.arange(h[0], h[1], dtype=dtype).mul_(0.013).reshape(-1, 1) + torch.arange(
        w[0], w[1], dtype=dtype
    ).mul_(0.007).reshape(1, -1)
    out = torch.empty((1, c, h[1] - h[0], w[1] - w[0]), dtype=dtype)
    for k in range(c):
        torch.add(base, 0.5 * k, out=out[0, k]).sin_()
    return out


def _stack(make: object, layers: int, channels: int) -> torch.nn.Sequential:
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods.append(make(channels, i))  # type: ignore[operator]
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def _run(model: torch.nn.Module, x: torch.Tensor, reps: int, sync: object = None) -> tuple[float, float, float]:
    """Mean wall and CPU seconds per forward+backward (after one warm-up), and the last local loss."""
    times, cpu, loss = [], [], 0.0
    for _ in range(reps + 1):
        model.zero_grad(set_to_none=True)
        c0 = time.process_time()
        t0 = time.perf_counter()
        y = model(x)
        out = y.square().sum()
        out.backward()
        if sync is not None:
            sync()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        loss = float(out.detach())
        del y, out
    return sum(times[1:]) / max(reps, 1), sum(cpu[1:]) / max(reps, 1), loss


def reference(args: argparse.Namespace) -> None:
    """Single-process torch (no MPI imported); prints one JSON line."""
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    base = _rss_mb()
    x = _field(args.channels, (0, args.size), (0, args.size), dtype)

    def make(c: int, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Conv2d(c, c, 3, padding=1, dtype=dtype)

    model = _stack(make, args.layers, args.channels)
    sec, cpu, loss = _run(model, x, args.reps)
    print(json.dumps({"sec": sec, "cpu": cpu, "loss": loss, "peak_mb": _peak_mb(), "base_mb": base}), flush=True)


def distributed(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    import numpy as np

    import hpctp
    from hpctp.nn import sync_gradients
    from hpctp.nn.conv import Conv2d

    grid = hpctp.ProcessGrid((0, 0) if args.grid is None else tuple(args.grid))
    dtype = getattr(torch, args.dtype)
    lay = hpctp.Layout((1, args.channels, args.size, args.size), grid.dims, (None, None, 0, 1))
    base = _rss_mb()
    rows, cols = lay.local_ranges(grid.coords)[2:]
    x = _field(args.channels, rows, cols, dtype)

    def make(c: int, seed: int) -> torch.nn.Module:
        return Conv2d(c, c, 3, padding=1, dtype=dtype, grid=grid, seed=seed, overlap=not args.no_overlap)

    model = _stack(make, args.layers, args.channels)

    def sync() -> None:  # sum the partial parameter gradients (one all-reduce per bucket)
        sync_gradients(model, grid)

    grid.comm.Barrier()
    sec, cpu, loss = _run(model, x, args.reps, sync)
    del x
    stats = np.array([sec, loss, _peak_mb(), base, cpu], dtype=np.float64)
    table = np.empty((grid.size, 5), dtype=np.float64)
    grid.comm.Allgather(stats, table)
    ref = None
    if grid.rank == 0:
        cmd = [sys.executable, os.path.abspath(__file__), "--reference", "--threads", str(args.threads or grid.size)]
        cmd += ["--size", str(args.size), "--channels", str(args.channels), "--layers", str(args.layers)]
        cmd += ["--reps", str(args.reps), "--dtype", args.dtype]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "HYDRA", "MPI"))}
        env["OMP_NUM_THREADS"] = str(args.threads or grid.size)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        ref = json.loads(done.stdout.strip().splitlines()[-1])
    req = grid.comm.Ibarrier()  # other ranks sleep (not spin) while the reference runs
    while not req.Test():
        time.sleep(0.05)
    if grid.rank != 0:
        return
    assert ref is not None
    n = grid.size
    print(
        f"field 1x{args.channels}x{args.size}x{args.size} {args.dtype}; {args.layers} x Conv2d({args.channels},"
        f"{args.channels},3,padding=1) + ReLU; loss = sum(y^2); forward+backward, mean of {args.reps} after 1 warm-up"
    )
    print(f"hpctp : {n} ranks, grid {grid.dims}, 1 torch thread each, overlap={not args.no_overlap}")
    for r in range(n):
        print(
            f"  rank {r}: {table[r, 0]:8.3f} s/iter ({table[r, 4]:.3f} CPU s)   peak RSS {table[r, 2]:8.1f} MB "
            f"(+{table[r, 2] - table[r, 3]:.1f} MB over the {table[r, 3]:.1f} MB after imports)"
        )
    print(f"torch : 1 process, {args.threads or n} threads (separate process)")
    print(
        f"          {ref['sec']:8.3f} s/iter ({ref['cpu']:.3f} CPU s)   peak RSS {ref['peak_mb']:8.1f} MB "
        f"(+{ref['peak_mb'] - ref['base_mb']:.1f} MB over the {ref['base_mb']:.1f} MB after imports)"
    )
    t = table[:, 0].max()
    peak = table[:, 2].max()
    inc = (table[:, 2] - table[:, 3]).max()
    print(f"time ratio hpctp/torch          : {t / ref['sec']:.3f}  (speed-up {ref['sec'] / t:.2f}x)")
    print(
        f"CPU-time ratio (sum over ranks) : {table[:, 4].sum() / ref['cpu']:.3f}  (> 1: overhead of the partitioning)"
    )
    print(
        f"peak RSS per rank / single proc : {peak / ref['peak_mb']:.3f}  "
        f"(increments: {inc / (ref['peak_mb'] - ref['base_mb']):.3f})"
    )
    total = table[:, 1].sum()
    print(
        f"loss check: hpctp {total:.6e}  torch {ref['loss']:.6e}  rel diff {abs(total - ref['loss']) / abs(ref['loss']):.1e}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=2048, help="H = W of the field (default 2048)")
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads of the reference (default: #ranks)")
    p.add_argument("--grid", type=int, nargs="+", default=None, help="grid dims (default: MPI's choice, 2-D)")
    p.add_argument("--no-overlap", action="store_true", help="fetch the halo before computing (no overlap)")
    p.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.reference:
        reference(args)
    else:
        distributed(args)


if __name__ == "__main__":
    from hpctp.runner import run_main

    run_main(main)  # an error on one rank aborts the job instead of hanging the others
