"""The flight recorder's cost on the attention benchmark's transformer block: tracing off, on, and the check.

Usage::

    mpiexec -n 2 python benchmarks/trace_overhead.py                     # blocks 64x64 and 256x128
    mpiexec -n 2 python benchmarks/trace_overhead.py --blocks 64x64 --rounds 41 --entries 2000

Forward+backward of one :class:`hpctp.nn.TransformerBlock` (as ``benchmarks/attention.py`` part (a):
batch 1, head dim 32, MLP 4 x embed, float32, one torch thread per rank) in three cases, interleaved
round by round in one run: tracing off (the default: each MPI call of hpctp pays one branch), the
flight recorder on (``hpctp.debug.trace(N)``, as ``HPCTP_TRACE=N``: each call entered with its
sequence numbers, its label from the stack and the user's call site, and retired), and the recorder
with the mismatch check (``HPCTP_CHECK=1``: one more ``Allgather`` of 5 int64 before each
collective). A sample is the mean of ``--calls`` consecutive steps, timed by its slowest rank; the
table gives medians over ``--rounds`` rounds (min-max) and the ratios of the medians with the
min-max of the per-round ratios. On a busy machine the step's own noise hides a cost this small, so
the recorder's cost per call is also measured alone (entering and retiring an entry from inside a
module's forward, as a layer's call is, without MPI traffic), and its share of the step given:
calls per step x cost per call / the untraced step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

import hpctp
import hpctp.debug
from hpctp.cli.runner import run_main
from hpctp.comm import trace as T
from hpctp.nn import TransformerBlock


def _clock(fn: Callable[[], object], calls: int) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls

    return run


def _with(setting: Callable[[], None], reset: Callable[[], None], case: Callable[[], float]) -> Callable[[], float]:
    def run() -> float:
        setting()
        try:
            return case()
        finally:
            reset()

    return run


class _Layer(torch.nn.Module):
    """A module whose forward enters entries as a layer's collectives do (the label and call site are found on the stack)."""

    def forward(self, n: int) -> float:
        x = np.zeros(8)
        t0 = time.perf_counter()
        for _ in range(n):
            e = T.begin(MPI.COMM_SELF, "Allreduce", x.nbytes, x)
            if e is not None:
                T.end(e)
        return (time.perf_counter() - t0) / n


def _entry_cost(entries: int, n: int = 20000) -> float:
    """Local. Seconds to enter and retire one entry (the best of 5 runs of ``n``)."""
    hpctp.debug.trace(entries)
    try:
        layer = _Layer()
        return min(layer(n) for _ in range(5))
    finally:
        hpctp.debug.trace(0)


def _cell(t: list[float]) -> str:
    return f"{statistics.median(t) * 1e3:.3f} ms ({min(t) * 1e3:.3f}-{max(t) * 1e3:.3f})"


def _ratio(a: list[float], b: list[float]) -> str:
    per = [x / y for x, y in zip(a, b)]
    return f"{statistics.median(a) / statistics.median(b):.3f} ({min(per):.2f}-{max(per):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--blocks", nargs="+", default=["64x64", "256x128"], metavar="EMBEDxTOKENS")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--entries", type=int, default=2000, help="ring entries of the recorder (HPCTP_TRACE)")
    args = p.parse_args()
    if args.rounds < 1 or args.calls < 1 or args.entries < 1:
        raise ValueError("--rounds, --calls and --entries must be >= 1")
    torch.set_num_threads(1)
    grid = hpctp.ProcessGrid([0])
    rows = []
    for spec in args.blocks:
        embed, tokens = (int(v) for v in spec.lower().split("x"))
        block = TransformerBlock(embed, embed // 32, 4.0, grid, seed=7)
        x = torch.randn(1, tokens, embed, generator=torch.Generator().manual_seed(1)).requires_grad_()
        g = torch.randn(1, tokens, embed, generator=torch.Generator().manual_seed(2))

        def step(block: TransformerBlock = block, x: torch.Tensor = x, g: torch.Tensor = g) -> None:
            block.zero_grad(set_to_none=True)
            x.grad = None
            (block(x) * g).sum().backward()

        step()  # (the first call agrees on the input once: not a step's calls)
        hpctp.debug.trace(args.entries)
        before = T.recorder().count  # type: ignore[union-attr]
        step()
        per_step = T.recorder().count - before  # type: ignore[union-attr]
        hpctp.debug.trace(0)
        cases = {
            "off": _clock(step, args.calls),
            "on": _with(lambda: hpctp.debug.trace(args.entries), lambda: hpctp.debug.trace(0), _clock(step, args.calls)),
            "check": _with(lambda: hpctp.debug.check(grid), lambda: hpctp.debug.check(grid, False), _clock(step, args.calls)),
        }  # fmt: skip
        for fn in cases.values():
            fn()
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.rounds):
            for name, fn in cases.items():
                grid.comm.Barrier()
                sec = np.array([fn()])
                hpctp.comm.allreduce(grid.comm, sec, "max")
                times[name].append(float(sec[0]))
        rows.append((embed, tokens, per_step, times))
    cost = float(hpctp.comm.allgather_ints(grid.comm, [int(_entry_cost(args.entries) * 1e9)]).max()) / 1e9
    if grid.rank == 0:
        print(
            f"hpctp {hpctp.__version__}, torch {torch.__version__}, {grid.size} ranks x 1 torch thread; transformer "
            f"block forward+backward, float32; medians of {args.rounds} interleaved rounds (min-max) of the mean of "
            f"{args.calls} steps; recorder ring {args.entries} entries"
        )
        print("| embed | tokens | MPI calls per step | off | recorder on | on / off | calls x cost per call / off "
              "| recorder + check | check / off |")  # fmt: skip
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for embed, tokens, per_step, t in rows:
            share = per_step * cost / statistics.median(t["off"])
            print(
                f"| {embed} | {tokens} | {per_step} | {_cell(t['off'])} | {_cell(t['on'])} | {_ratio(t['on'], t['off'])} "
                f"| {share:.2%} | {_cell(t['check'])} | {_ratio(t['check'], t['off'])} |"
            )
        print(f"recorder cost per call, measured alone (slowest rank, best of 5 x 20000): {cost * 1e6:.2f} us")
        print(
            f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (other processes skew times)"
        )
    return 0


if __name__ == "__main__":
    run_main(main)
