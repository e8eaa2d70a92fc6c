"""Distributed 3-D FFT (hpctp.fft.rfftn, a pencil FFT) vs numpy.fft.rfftn in one process.

Usage::

    mpiexec -n 2 python benchmarks/fft.py               # 256^3 float64 field
    mpiexec -n 4 python benchmarks/fft.py --size 128    # shrink

In one run: the ranks hold an ``n^3`` float64 field split over a 2-D grid as pencils (dims 0
and 1 divided, dim 2 whole) and time ``hpctp.fft.rfftn`` (best of ``--reps``, the slowest
rank), with the result in the input's layout and with ``out_split="any"`` (the transposed
output: one all-to-all fewer). Then rank 0 times ``numpy.fft.rfftn`` of the whole field in its
own process while the other ranks sleep, and compares the gathered result with it. Bytes sent
per rank (:class:`hpctp.CommCounter`) are printed next to the field's size: a pencil FFT moves
the field once per transposed dim.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from _timing import best_of, single_process

import hpctp
import hpctp.fft


def _field(n: int, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
    """Block of x[i, j, k] = sin(0.013 i + 0.007 j) cos(0.011 k) + 0.001 (i + j + k)."""
    i = np.arange(*rows, dtype=np.float64)[:, None, None]
    j = np.arange(*cols, dtype=np.float64)[None, :, None]
    k = np.arange(n, dtype=np.float64)[None, None, :]
    return np.sin(0.013 * i + 0.007 * j) * np.cos(0.011 * k) + 0.001 * (i + j + k)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=256, help="edge n of the n^3 field (default 256)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as a results file (docs)")
    args = p.parse_args()
    n = args.size
    grid = hpctp.ProcessGrid([0, 0])
    lay = hpctp.Layout((n, n, n), grid.dims, (0, 1, None))
    rows, cols, _ = lay.local_ranges(grid.coords)
    x = hpctp.DistTensor(_field(n, rows, cols), grid, lay)
    t_same = best_of(lambda: hpctp.fft.rfftn(x), args.reps, grid)
    t_any = best_of(lambda: hpctp.fft.rfftn(x, out_split="any"), args.reps, grid)
    with hpctp.CommCounter() as c_same:
        y = hpctp.fft.rfftn(x)
    with hpctp.CommCounter() as c_any:
        hpctp.fft.rfftn(x, out_split="any")
    sent = np.array([c_same.bytes_sent, c_any.bytes_sent], dtype=np.float64)
    hpctp.comm.allreduce(grid.comm, sent, "max")
    got = y.gather(root=0)

    def reference() -> tuple[np.ndarray, float]:
        whole = _field(n, (0, n), (0, n))
        best = float("inf")
        for _ in range(args.reps + 1):
            t = time.perf_counter()
            out = np.fft.rfftn(whole)
            best = min(best, time.perf_counter() - t)
        return out, best

    timed = single_process(grid, reference)
    if grid.rank != 0:
        return
    if got is None or timed is None:
        raise RuntimeError("rank 0 lacks the gathered result or the reference")
    ref, t_ref = timed
    field = n**3 * 8
    diff = float(np.abs(got - ref).max() / np.abs(ref).max())
    print(f"field {n}^3 float64 ({field / 2**20:.0f} MiB), pencils: dims 0 and 1 over a {grid.dims} grid, dim 2 whole")
    print(f"hpctp.fft.rfftn, {grid.size} ranks (1 thread each) : {t_same:.3f} s   (out_split='any': {t_any:.3f} s)")
    print(f"numpy.fft.rfftn, 1 process           : {t_ref:.3f} s")
    print(f"time ratio hpctp/numpy               : {t_same / t_ref:.3f}  (out_split='any': {t_any / t_ref:.3f})")
    print(
        f"bytes sent per rank (max)            : {sent[0] / 2**20:.1f} MiB ({sent[0] / field:.2f} x the field), "
        f"out_split='any': {sent[1] / 2**20:.1f} MiB"
    )
    print(f"result check: max |hpctp - numpy| / max |numpy| = {diff:.1e}")
    if args.json:
        _write_json(args, grid, (t_same, t_any, t_ref), sent / field)


def _write_json(
    args: argparse.Namespace, grid: hpctp.ProcessGrid, times: tuple[float, float, float], sent: Any
) -> None:
    """Rank 0: this run's figures as a results file of the docs' benchmark pages (benchmarks/plots.py)."""

    import plots

    t_same, t_any, t_ref = times
    n, dims = args.size, "×".join(map(str, grid.dims))
    measures = (
        f"`hpctp.fft.rfftn` of a {n}³ float64 field split into pencils (best of {args.reps} after a "
        'warm-up, the slowest rank), with the result in the input\'s layout and with `out_split="any"`, and the '
        "bytes each rank sends, against `numpy.fft.rfftn` of the whole field in one process, in the same run."
    )
    results = {
        **plots.header("fft", "FFT", grid.size, "1 thread per rank", measures),
        "tables": [
            {
                "caption": f"rfftn of a {n}³ float64 field ({n**3 * 8 / 2**20:.0f} MiB), {grid.size} ranks (pencils "
                f"on a {dims} grid), 1 thread each",
                "columns": ["", "time", "time / numpy", "bytes sent per rank"],
                "rows": [
                    ["numpy.fft.rfftn, 1 process", f"{t_ref:.3g} s", "", ""],
                    [
                        "hpctp.fft.rfftn, result in the input's layout",
                        f"{t_same:.3g} s",
                        f"{t_same / t_ref:.2f}",
                        f"{sent[0]:.2f} × the field",
                    ],
                    [
                        'hpctp.fft.rfftn, `out_split="any"` (no move back)',
                        f"{t_any:.3g} s",
                        f"{t_any / t_ref:.2f}",
                        f"{sent[1]:.2f} × the field",
                    ],
                ],  # fmt: skip
            }
        ],
        "plots": [
            {
                "file": "fft_ratio.png",
                "kind": "bar",
                "title": "hpctp.fft.rfftn / numpy.fft.rfftn (dashed: 1, equal)",
                "xlabel": "",
                "ylabel": "time / numpy's",
                "x": [f"{grid.size} ranks"],
                "series": {
                    "result in the input's layout": [round(t_same / t_ref, 2)],
                    'out_split="any"': [round(t_any / t_ref, 2)],
                },
                "hline": 1.0,
            },
            {
                "file": "fft_time.png",
                "kind": "bar",
                "title": f"rfftn of a {n}³ float64 field",
                "xlabel": "",
                "ylabel": "time (s)",
                "x": ["numpy, 1 process", f"hpctp, {grid.size} ranks × 1 thread", 'hpctp, out_split="any"'],
                "series": {"time": [float(f"{t:.3g}") for t in (t_ref, t_same, t_any)]},
            },
        ],
    }
    print(f"results written to {plots.dump(results, args.json)}")


if __name__ == "__main__":
    from hpctp.cli.runner import run_main

    run_main(main)  # an error on one rank aborts the job instead of hanging the others
