"""Periodic 5-point stencil (explicit heat-equation steps) three ways: numpy's np.roll in one
process, the same np.roll code on a DistTensor, and a planned HaloExchange on the blocks.

Usage::

    mpiexec -n 2 python benchmarks/stencil.py                # 4096^2 float64 field, 10 steps
    mpiexec -n 4 python benchmarks/stencil.py --size 1024    # shrink

In one run: the ranks hold an ``n x n`` float64 field on a 2-D grid (``ProcessGrid([0, 0])``)
and time ``--steps`` steps of ``u += k * (roll(u, 1, 0) + roll(u, -1, 0) + roll(u, 1, 1) +
roll(u, -1, 1) - 4 u)`` written with ``np.roll`` on the DistTensor (each roll moves only the
row or column leaving a block), then the same update on the local block padded by a periodic
``HaloExchange`` of width 1 (``begin``/``end``; one exchange per step instead of four rolls).
Each is the best of ``--reps`` (the slowest rank). Then rank 0 runs numpy's ``np.roll`` code
on the whole field in its own process while the other ranks sleep, and compares both results
with it. Bytes sent per rank and step (:class:`hpctp.CommCounter`) are printed too.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from _timing import best_of, single_process

import hpctp

K = 0.2  # diffusion number (stable below 0.25)


def _field(rows: tuple[int, int], cols: tuple[int, int], n: int) -> np.ndarray:
    i = np.arange(*rows, dtype=np.float64)[:, None]
    j = np.arange(*cols, dtype=np.float64)[None, :]
    return np.sin(2 * np.pi * 3 * i / n) * np.cos(2 * np.pi * 5 * j / n) + 0.01 * ((i * 7 + j * 13) % 11)


def _roll_steps(u: Any, steps: int) -> Any:
    """The numpy code, unchanged for numpy arrays and DistTensors."""
    for _ in range(steps):
        u = u + K * (np.roll(u, 1, 0) + np.roll(u, -1, 0) + np.roll(u, 1, 1) + np.roll(u, -1, 1) - 4 * u)
    return u


def _halo_steps(u: hpctp.DistTensor, steps: int) -> hpctp.DistTensor:
    halo = hpctp.HaloExchange(u, 1, boundary="periodic", stencil="star")
    block = u.local
    for _ in range(steps):
        p = halo.exchange(block)
        block = block + K * (p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * block)
    return u.with_local(block)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=4096, help="edge n of the n x n field (default 4096)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as a results file (docs)")
    args = p.parse_args()
    n, steps = args.size, args.steps
    grid = hpctp.ProcessGrid([0, 0])
    lay = hpctp.Layout((n, n), grid.dims, (0, 1))
    rows, cols = lay.local_ranges(grid.coords)
    u = hpctp.DistTensor(_field(rows, cols, n), grid, lay)
    t_roll = best_of(lambda: _roll_steps(u, steps), args.reps, grid)
    t_halo = best_of(lambda: _halo_steps(u, steps), args.reps, grid)
    with hpctp.CommCounter() as c_roll:
        by_roll = _roll_steps(u, steps)
    with hpctp.CommCounter() as c_halo:
        by_halo = _halo_steps(u, steps)
    sent = np.array([c_roll.bytes_sent, c_halo.bytes_sent], dtype=np.float64) / steps
    hpctp.comm.allreduce(grid.comm, sent, "max")
    got_roll, got_halo = by_roll.gather(root=0), by_halo.gather(root=0)

    def reference() -> tuple[np.ndarray, float]:
        whole = _field((0, n), (0, n), n)
        best = float("inf")
        for _ in range(args.reps + 1):
            t = time.perf_counter()
            out = _roll_steps(whole, steps)
            best = min(best, time.perf_counter() - t)
        return out, best

    timed = single_process(grid, reference)
    if grid.rank != 0:
        return
    if got_roll is None or got_halo is None or timed is None:
        raise RuntimeError("rank 0 lacks the gathered results or the reference")
    ref, t_ref = timed
    scale = float(np.abs(ref).max())
    print(f"field {n}x{n} float64 ({n * n * 8 / 2**20:.0f} MiB) on a {grid.dims} grid, {steps} periodic 5-point steps")
    print(f"numpy np.roll, 1 process            : {t_ref / steps * 1e3:8.2f} ms/step")
    print(f"hpctp np.roll, {grid.size} ranks (1 thread)  : {t_roll / steps * 1e3:8.2f} ms/step")
    print(f"hpctp HaloExchange, {grid.size} ranks        : {t_halo / steps * 1e3:8.2f} ms/step")
    print(f"time ratio hpctp/numpy              : np.roll {t_roll / t_ref:.3f}, HaloExchange {t_halo / t_ref:.3f}")
    print(
        f"bytes sent per rank and step (max)  : np.roll {sent[0] / 2**10:.0f} KiB, "
        f"HaloExchange {sent[1] / 2**10:.0f} KiB (one row of the field: {n * 8 / 2**10:.0f} KiB)"
    )
    print(
        f"result check: max |hpctp - numpy| / max |numpy| = {np.abs(got_roll - ref).max() / scale:.1e} (np.roll), "
        f"{np.abs(got_halo - ref).max() / scale:.1e} (HaloExchange)"
    )
    if args.json:
        _write_json(args, grid, [t / steps for t in (t_ref, t_roll, t_halo)], sent)


def _write_json(args: argparse.Namespace, grid: hpctp.ProcessGrid, per_step: list[float], sent: np.ndarray) -> None:
    """Rank 0: this run's figures as a results file of the docs' benchmark pages (benchmarks/plots.py)."""

    import plots

    n, p = args.size, grid.size
    ms = [float(f"{t * 1e3:.3g}") for t in per_step]
    names = [
        "numpy `np.roll`, 1 process",
        f"hpctp `np.roll` on a DistTensor, {p} ranks",
        f"hpctp `HaloExchange`, {p} ranks",
    ]
    measures = (
        f"{args.steps} explicit periodic 5-point heat steps on a {n}² float64 field "
        f"({n * n * 8 / 2**20:.0f} MiB), best of {args.reps} after a warm-up, the slowest rank: numpy's `np.roll` "
        f"code in one process against the same code on a DistTensor on {p} ranks and against a periodic "
        "`HaloExchange` of width 1 on the blocks, in the same run."
    )
    results = {
        **plots.header("stencil", "Stencil", p, "1 thread per rank", measures),
        "tables": [
            {
                "caption": f"Periodic 5-point heat step on a {n}² float64 field",
                "columns": ["", "time / step", "bytes sent per rank and step"],
                "rows": [
                    [names[0], f"{ms[0]:g} ms", ""],
                    [names[1], f"{ms[1]:g} ms (ratio {per_step[1] / per_step[0]:.2f})", f"{sent[0] / 2**10:.0f} KiB"],
                    [names[2], f"{ms[2]:g} ms (ratio {per_step[2] / per_step[0]:.2f})", f"{sent[1] / 2**10:.0f} KiB"],
                ],
            }
        ],
        "plots": [
            {
                "file": "stencil_time.png",
                "kind": "bar",
                "title": f"Time per heat step, {n}² float64",
                "xlabel": "",
                "ylabel": "time per step (ms)",
                "x": [name.replace("`", "").replace(" on a DistTensor", "") for name in names],
                "series": {"time per step": ms},
            }
        ],
    }
    print(f"results written to {plots.dump(results, args.json)}")


if __name__ == "__main__":
    from hpctp.cli.runner import run_main

    run_main(main)  # an error on one rank aborts the job instead of hanging the others
