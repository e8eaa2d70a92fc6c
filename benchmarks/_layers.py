"""Shared parts of the layer benchmarks (conv.py, fno.py): field, stack, timing, reference, report.

Each benchmark times forward+backward of a stack of hpctp layers on its block of a field,
one rank per process, then rank 0 starts the single-process torch reference as a *separate
process* (so each process's peak RSS is its own) while the other ranks sleep, and prints
both with their ratios. A benchmark script supplies the layers and its extra lines.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from _timing import single_process

__all__ = [
    "parser",
    "results",
    "start",
    "field",
    "gather_stats",
    "peak_mb",
    "reference",
    "reference_run",
    "report",
    "rss_mb",
    "run",
    "setup_ranks",
    "stack",
]


def rss_mb() -> float:
    """Local. Current resident set size of this process, MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    """Local. Peak resident set size of this process so far, MB (Linux ``ru_maxrss`` is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def field(c: int, h: tuple[int, int], w: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Local. Block [h0:h1, w0:w1] of x[0, c, i, j] = sin(0.013 i + 0.007 j + 0.5 c) (built in place)."""
    base = torch.arange(h[0], h[1], dtype=dtype).mul_(0.013).reshape(-1, 1) + torch.arange(
        w[0], w[1], dtype=dtype
    ).mul_(0.007).reshape(1, -1)
    out = torch.empty((1, c, h[1] - h[0], w[1] - w[0]), dtype=dtype)
    for k in range(c):
        torch.add(base, 0.5 * k, out=out[0, k]).sin_()
    return out


def stack(
    make: Callable[[int, int], torch.nn.Module], layers: int, channels: int, act: type[torch.nn.Module]
) -> torch.nn.Sequential:
    """Local. ``layers`` x ``make(channels, seed=i)`` with ``act()`` between them."""
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods.append(make(channels, i))
        if i < layers - 1:
            mods.append(act())
    return torch.nn.Sequential(*mods)


def setup_ranks(args: Any) -> tuple[Any, torch.Tensor, float]:
    """Collective over the world. One torch thread per rank, the grid (``args.grid`` or MPI's
    2-D choice), this rank's block of the ``1 x args.channels x args.size^2`` field (dtype
    ``args.dtype``) and the RSS before it was built."""
    torch.set_num_threads(1)
    import hpctp

    grid = hpctp.ProcessGrid((0, 0) if args.grid is None else tuple(args.grid))
    lay = hpctp.Layout((1, args.channels, args.size, args.size), grid.dims, (None, None, 0, 1))
    base = rss_mb()
    rows, cols = lay.local_ranges(grid.coords)[2:]
    return grid, field(args.channels, rows, cols, getattr(torch, args.dtype)), base


def run(
    model: torch.nn.Module, x: torch.Tensor, reps: int, sync: Callable[[], None] | None = None
) -> tuple[float, float, float]:
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
            sync()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        loss = float(out.detach())
        del y, out
    return sum(times[1:]) / max(reps, 1), sum(cpu[1:]) / max(reps, 1), loss


def reference(
    args: argparse.Namespace, make: Callable[[int, int, torch.dtype], torch.nn.Module], act: type[torch.nn.Module]
) -> None:
    """Local (the reference process). Time the stack of ``make(channels, seed, dtype)`` layers on
    the whole field with ``args.threads`` torch threads; print one JSON line for :func:`reference_run`."""
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    base = rss_mb()
    x = field(args.channels, (0, args.size), (0, args.size), dtype)
    model = stack(lambda c, seed: make(c, seed, dtype), args.layers, args.channels, act)
    sec, cpu, loss = run(model, x, args.reps)
    print(json.dumps({"sec": sec, "cpu": cpu, "loss": loss, "peak_mb": peak_mb(), "base_mb": base}), flush=True)


def gather_stats(grid: Any, stats: Sequence[float]) -> np.ndarray:
    """Collective over grid. Every rank's ``stats`` row (sec, loss, peak, base, cpu, ...extra)."""
    row = np.array(stats, dtype=np.float64)
    table = np.empty((grid.size, len(row)), dtype=np.float64)
    grid.comm.Allgather(row, table)
    return table


def reference_run(grid: Any, script: str, threads: int, argv: Sequence[str]) -> dict[str, float] | None:
    """Collective over grid. Rank 0 runs ``script --reference --threads T *argv`` in a fresh
    process (MPI environment removed) while the others sleep; its JSON result on rank 0."""

    def run() -> tuple[dict[str, float], float]:
        cmd = [sys.executable, os.path.abspath(script), "--reference", "--threads", str(threads), *argv]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "HYDRA", "MPI"))}
        env["OMP_NUM_THREADS"] = str(threads)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1]), 0.0

    out = single_process(grid, run)
    return None if out is None else out[0]


def report(table: np.ndarray, ref: dict[str, float], hpctp_line: str, ref_line: str) -> None:
    """Local (rank 0). Per-rank and reference times and peak memory, their ratios, the loss check."""
    print(hpctp_line)
    for r in range(table.shape[0]):
        print(
            f"  rank {r}: {table[r, 0]:8.3f} s/iter ({table[r, 4]:.3f} CPU s)   peak RSS {table[r, 2]:8.1f} MB "
            f"(+{table[r, 2] - table[r, 3]:.1f} MB over the {table[r, 3]:.1f} MB after imports)"
        )
    print(ref_line)
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


def results(
    args: argparse.Namespace,
    table: np.ndarray,
    ref: dict[str, float],
    *,
    benchmark: str,
    title: str,
    measures: str,
    caption: str,
    reference: str,
) -> dict[str, Any]:
    """Local (rank 0). This run's figures as a results file of the docs' benchmark pages (``benchmarks/plots.py``'s
    schema): the table of :func:`report` (time, peak RSS, their ratios) and its plots; a script adds its own."""
    import plots

    ranks = table.shape[0]
    threads = args.threads or ranks
    t, peak, cpu = table[:, 0].max(), table[:, 2].max(), table[:, 4].sum()
    hp, torch_name = f"hpctp, {ranks} ranks", f"{reference}, 1 process"
    return {
        **plots.header(benchmark, title, ranks, f"hpctp 1 thread per rank, {reference} {threads} threads", measures),
        "tables": [
            {
                "caption": caption,
                "columns": ["", "time / iter", "peak RSS per process"],
                "rows": [
                    [hp, f"{t:.3g} s", f"{peak:.0f} MB"],
                    [torch_name, f"{ref['sec']:.3g} s", f"{ref['peak_mb']:.0f} MB"],
                    [
                        f"ratio hpctp/{reference}",
                        f"{t / ref['sec']:.2f} (CPU-time ratio {cpu / ref['cpu']:.2f})",
                        f"{peak / ref['peak_mb']:.2f} per rank",
                    ],
                ],
            }
        ],
        "plots": [
            {
                "file": f"{benchmark}_time.png",
                "kind": "bar",
                "title": "Forward+backward time per iteration",
                "xlabel": "",
                "ylabel": "time per iteration (s)",
                "x": [f"{hp} × 1 thread", f"{torch_name} × {threads} threads"],
                "series": {"time per iteration": [float(f"{t:.3g}"), float(f"{ref['sec']:.3g}")]},
            },
            {
                "file": f"{benchmark}_ratios.png",
                "kind": "bar",
                "title": f"hpctp / {reference} (dashed: 1, equal)",
                "xlabel": "",
                "ylabel": f"hpctp / {reference}",
                "x": ["wall time", "CPU time (all ranks)", "peak RSS per process"],
                "series": {
                    f"hpctp / {reference}": [
                        round(t / ref["sec"], 2),
                        round(cpu / ref["cpu"], 2),
                        round(peak / ref["peak_mb"], 2),
                    ]
                },
                "hline": 1.0,
            },
        ],
    }


def parser(doc: str | None, size: int, layers: int, reps: int) -> argparse.ArgumentParser:
    """Local. The options every layer benchmark takes (a script adds its own)."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    p.add_argument("--size", type=int, default=size, help=f"H = W of the field (default {size})")
    p.add_argument("--channels", type=int, default=16, help="channels of every layer (default 16)")
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--reps", type=int, default=reps, help=f"timed iterations (default {reps})")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads of the reference (default: #ranks)")
    p.add_argument("--grid", type=int, nargs="+", default=None, help="grid dims (default: MPI's choice, 2-D)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as a results file (docs)")
    p.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    return p


def start(
    p: argparse.ArgumentParser,
    reference: Callable[[argparse.Namespace], None],
    distributed: Callable[[argparse.Namespace], None],
) -> None:
    """Parse the options and run the reference (``--reference``, one process) or the ranks' part;
    an error on one rank aborts the job instead of hanging the others."""
    from hpctp.cli.runner import run_main

    def main() -> None:
        args = p.parse_args()
        (reference if args.reference else distributed)(args)

    run_main(main)
