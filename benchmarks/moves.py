"""Moves of numpy blocks vs torch blocks (and Heat, when importable), float64, in one MPI run.

Usage::

    mpiexec -n 2 python benchmarks/moves.py                          # 8192 x 4096, 256^3, 4096^2
    mpiexec -n 2 python benchmarks/moves.py --rows 1024 --cols 512 --fft 32 --halo 256 --rounds 3

Three planned moves, each on numpy blocks and on CPU torch blocks (``x.to("torch")``, what every
``hpctp.nn`` layer and the trainer move):

1. ``x.redistribute((None, 0))`` of a ``rows x cols`` tensor split by rows over a 1-D grid (one
   Alltoallv: rows -> columns);
2. ``hpctp.fft.rfftn`` of an ``n^3`` field split by slabs (two transposes);
3. ``HaloExchange(width 1, periodic).exchange`` of a ``m x m`` field split by rows.

With Heat importable (``pip install heat``; it pins its own torch: use a side environment), also
Heat's ``resplit_(1)`` of the same matrix and ``heat.fft.rfftn`` of the same field. Cases run
interleaved for ``--rounds`` rounds (each call timed by its slowest rank), so machine noise hits
all of them alike; printed are the medians with the spread (min-max), the ratio torch/numpy per
move, and the communication buffers each move allocated on its second call (CommCounter's
``allocations``; 0 when the buffer pool serves them). ``THP_MEM_ALLOC_ENABLE`` (torch's 2 MiB
pages) is printed as found in the environment: run once with and once without it.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

import hpctp
import hpctp.fft
from hpctp.cli.runner import run_main


def _allocations(fn: Callable[[], object]) -> int:
    """Local. Communication buffers allocated by the second call of ``fn``."""
    fn()
    with hpctp.CommCounter() as c:
        fn()
    return c.allocations


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--fft", type=int, default=256, help="edge n of the n^3 field of rfftn")
    p.add_argument("--halo", type=int, default=4096, help="edge m of the m x m field of the halo exchange")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-heat", action="store_true")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    grid = hpctp.ProcessGrid([0])
    x = {"numpy": hpctp.random.normal((args.rows, args.cols), grid, (0, None), seed=1)}
    f = {"numpy": hpctp.random.normal((args.fft,) * 3, grid, (0, None, None), seed=2)}
    h = {"numpy": hpctp.random.normal((args.halo, args.halo), grid, (0, None), seed=3)}
    for d in (x, f, h):
        d["torch"] = d["numpy"].to("torch")
    halo = hpctp.HaloExchange(h["numpy"], 1, boundary="periodic")
    cases: dict[str, Callable[[], object]] = {}
    for kind in ("numpy", "torch"):
        cases[f"redistribute {kind}"] = functools.partial(x[kind].redistribute, (None, 0))
        cases[f"rfftn {kind}"] = functools.partial(hpctp.fft.rfftn, f[kind])
        cases[f"halo {kind}"] = functools.partial(halo.exchange, h[kind].local)
    heat: Any = None
    note = "skipped (--no-heat)"
    if not args.no_heat:
        try:
            heat = importlib.import_module("heat")
            note = f"heat {heat.__version__}"
        except ImportError as e:
            note = f"not importable ({e}); pip install heat in a side environment"
    if heat is not None:
        hx = heat.array(torch.from_numpy(np.ascontiguousarray(x["numpy"].local)), is_split=0)
        hf = heat.array(torch.from_numpy(np.ascontiguousarray(f["numpy"].local)), is_split=0)
        cases["redistribute heat"] = lambda: heat.resplit(hx, 1)
        cases["rfftn heat"] = lambda: heat.fft.rfftn(hf)
    allocs = {name: _allocations(fn) for name, fn in cases.items()}  # (also the warm-up)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            times[name].append(hpctp.comm.slowest_seconds(grid.comm, fn))
    ok = np.array_equal(x["torch"].redistribute((None, 0)).local.numpy(), x["numpy"].redistribute((None, 0)).local)
    if grid.rank != 0:
        return 0
    med = {name: statistics.median(t) for name, t in times.items()}
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
    print(f"hpctp {hpctp.__version__} on {grid.size} ranks x 1 thread, float64; THP_MEM_ALLOC_ENABLE={thp}; {note}")
    print(
        f"sizes: redistribute {args.rows}x{args.cols} rows->columns, rfftn {args.fft}^3 slabs, "
        f"halo {args.halo}^2 rows width 1; medians of {args.rounds} interleaved rounds"
    )
    print("| move | numpy blocks | torch blocks | torch/numpy | heat | torch/heat | buffers allocated, 2nd call |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for move in ("redistribute", "rfftn", "halo"):
        t_np, t_th = med[f"{move} numpy"], med[f"{move} torch"]
        spread = [f"{min(times[f'{move} {k}']):.3f}-{max(times[f'{move} {k}']):.3f}" for k in ("numpy", "torch")]
        heat_t = med.get(f"{move} heat")
        heat_cell = f"{heat_t:.3f} s" if heat_t is not None else "-"
        ratio_heat = f"{t_th / heat_t:.2f}" if heat_t is not None else "-"
        print(
            f"| {move} | {t_np:.3f} s ({spread[0]}) | {t_th:.3f} s ({spread[1]}) | {t_th / t_np:.2f} | {heat_cell} | "
            f"{ratio_heat} | numpy {allocs[f'{move} numpy']}, torch {allocs[f'{move} torch']} |"
        )
    print(f"result check: torch-block redistribute equals numpy-block redistribute: {ok}")
    return 0


if __name__ == "__main__":
    run_main(main)
