"""How steady is this machine? One fixed kernel, timed over and over: its speed per window of time.

Usage::

    python benchmarks/machine_drift.py                          # 1 process, 60 s
    mpiexec -n 4 python benchmarks/machine_drift.py --seconds 30 # every rank at once (ranks sharing cores)

Each process calls the same kernel (``--gemms`` float64 products of two ``--size`` square matrices, one thread) for
``--seconds`` seconds and keeps each window's (``--window`` seconds) fastest call: the least a window could do, so a
window slower than the fastest is the machine running slower, not this process being preempted once. Printed on rank
0: each rank's windows as ratios against its fastest one, the slowest window's ratio, and the share of windows within
5% of the fastest. A step time measured in a window 1.3x slower reads 1.3x slower: on a machine whose windows move
that much, timings of plans a few percent apart cannot rank them (``benchmarks/planner.py`` prints the same limit as
its measurement against itself).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def windows(seconds: float, window: float, size: int, gemms: int) -> list[float]:
    """Local. The fastest call of the kernel in each window of ``window`` seconds over ``seconds`` seconds."""
    a = torch.randn(size, size, dtype=torch.float64)
    b = torch.randn(size, size, dtype=torch.float64)
    out: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        best, close = float("inf"), time.perf_counter() + window
        while time.perf_counter() < close:
            t0 = time.perf_counter()
            for _ in range(gemms):
                a @ b
            best = min(best, time.perf_counter() - t0)
        out.append(best)
    return out


def summary(times: list[float]) -> tuple[float, float]:
    """Local. The slowest window's time over the fastest's, and the share of windows within 5% of the fastest."""
    t = np.asarray(times)
    return float(t.max() / t.min()), float(np.mean(t <= 1.05 * t.min()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--window", type=float, default=1.0, help="seconds per window")
    p.add_argument("--size", type=int, default=256, help="matrix size")
    p.add_argument("--gemms", type=int, default=20, help="products per call")
    args = p.parse_args()
    torch.set_num_threads(1)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    comm.Barrier()
    mine = windows(args.seconds, args.window, args.size, args.gemms)
    gathered = comm.gather(mine, root=0)  # (lists of floats, on rank 0 only: a report, not data)
    if gathered is None:
        return
    every: list[list[float]] = gathered
    print(f"fixed kernel: {args.gemms} float64 products of {args.size} x {args.size} matrices per call, one thread, "
          f"on {comm.Get_size()} rank(s) at once; the fastest call of each {args.window:g} s window\n")  # fmt: skip
    print("| rank | fastest window [ms] | slowest window / fastest | windows within 5% of the fastest |")
    print("| ---: | ---: | ---: | ---: |")
    for r, times in enumerate(every):
        worst, near = summary(times)
        print(f"| {r} | {min(times) * 1e3:.2f} | {worst:.2f} | {near:.0%} |")
    first = np.asarray(every[0])
    print("\nrank 0's windows against its fastest, in order:")
    print(" ".join(f"{v:.2f}" for v in first / first.min()))


if __name__ == "__main__":
    main()
