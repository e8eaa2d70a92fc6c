"""SUMMA matmul (hpctp) vs numpy on one process vs Heat, float64, in one MPI run.

Usage::

    mpiexec -n 2 python benchmarks/matmul.py                  # n = 2048 and 4096
    mpiexec -n 2 python benchmarks/matmul.py --sizes 512 1024 # shrink

Every rank uses one BLAS thread (environment set before numpy is imported, torch via
``torch.set_num_threads(1)``: hpctp's local GEMMs on numpy blocks go through torch's BLAS).
For each n:

1. hpctp: ``hpctp.linalg.matmul(a, b)`` of two ``n x n`` float64 matrices split ``(0, 1)`` on the
   grid ``hpctp.perf.recommend_grid`` picks (or ``--grid``); result checked against numpy.
2. numpy on one process: rank 0 runs ``A @ B`` in a child process (numpy only, BLAS threads
   set in its environment before numpy is imported) with 1 thread and with P threads,
   while the other ranks sleep in a non-blocking barrier (no busy polling).
3. Heat (``pip install heat``), same ranks, the same matrices (row blocks, ``split=0``
   for both factors, Heat's recommended case); skipped with a note if Heat is not importable.

Times are the best of ``--reps`` runs (after one warm-up) of the slowest rank; hpctp and
Heat run interleaved, so load from other processes hits both alike.
Efficiency = rate / (P x numpy 1-thread rate). The alpha-beta-gamma model
(:mod:`hpctp.perf`) calibrated here (alpha, beta from broadcasts, gamma from numpy
1-thread) predicts the hpctp time.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import subprocess
import sys
import time
from typing import Any

_CHILD = """
import json, os, sys, time
import numpy as np
n, reps = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
a = rng.standard_normal((n, n)); b = rng.standard_normal((n, n))
a @ b
best = min((lambda t0: (a @ b, time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(reps))
print(json.dumps({"time": best}))
"""


def _numpy_child(n: int, threads: int, reps: int) -> float:
    """Seconds for ``A @ B`` in a fresh numpy-only process with ``threads`` BLAS threads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "HYDRA", "MPI", "OMPI", "PMIX", "I_MPI"))}
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
        env[var] = str(threads)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(n), str(reps)], env=env, check=True,
                         capture_output=True, text=True)  # fmt: skip
    return float(json.loads(out.stdout.strip().splitlines()[-1])["time"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--grid", type=int, nargs=2, default=None, metavar=("PR", "PC"))
    parser.add_argument("--panel", type=int, default=None, help="SUMMA panel width (default: hpctp's)")
    parser.add_argument("--no-heat", action="store_true")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as a results file (docs)")
    args = parser.parse_args()

    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
        os.environ[var] = "1"
    import numpy as np
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    try:  # belt and braces if the BLAS ignored the environment
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    except ImportError:
        pass
    import hpctp
    from hpctp import perf
    from hpctp.linalg import matmul, plan_matmul
    from hpctp.tensor.random import block_normal

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    heat: Any = None
    heat_note = ""
    if not args.no_heat:
        try:
            heat = importlib.import_module("heat")
        except Exception as e:  # noqa: BLE001 - any import failure means "not available"
            heat_note = f"Heat not available ({type(e).__name__}: {e}); pip install heat"
    else:
        heat_note = "Heat skipped (--no-heat)"

    def best_of(fns: list) -> list[float]:  # type: ignore[type-arg]
        """Best time (slowest rank) of each function over ``reps`` interleaved rounds, so that
        load from other processes hits every implementation alike."""
        best = [float("inf")] * len(fns)
        for fn in fns:
            fn()  # warm-up
        for _ in range(args.reps):
            for i, fn in enumerate(fns):
                world.Barrier()
                t0 = time.perf_counter()
                fn()
                dt = np.array([time.perf_counter() - t0])
                world.Allreduce(MPI.IN_PLACE, dt, op=MPI.MAX)
                best[i] = min(best[i], float(dt[0]))
        return best

    def idle_barrier() -> None:
        req = world.Ibarrier()
        while not req.Test():
            time.sleep(0.005)

    # calibrate the model: latency from tiny broadcasts, bandwidth from a 32 MiB one
    probe = np.zeros(1)
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(200):
        world.Bcast(probe, root=0)
    alpha = (time.perf_counter() - t0) / 200
    big = np.zeros(4 * 2**20)
    world.Bcast(big, root=0)
    world.Barrier()
    t0 = time.perf_counter()
    world.Bcast(big, root=0)
    world.Barrier()
    beta = max(time.perf_counter() - t0 - alpha, 1e-9) / big.nbytes

    rows = []
    if rank == 0:
        print(f"hpctp {hpctp.__version__}, {size} ranks x 1 BLAS thread, float64; heat: "
              f"{heat.__version__ if heat else heat_note}", flush=True)  # fmt: skip
        print(f"measured: alpha = {alpha * 1e6:.1f} us, bandwidth = {1 / beta / 1e9:.2f} GB/s; "
              f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)  # fmt: skip
    for n in args.sizes:
        flops = 2.0 * n**3
        base = np.zeros(2)  # numpy baselines on rank 0 alone, the others sleep
        if rank == 0:
            base[0] = _numpy_child(n, 1, args.reps)
            base[1] = _numpy_child(n, size, args.reps)
        idle_barrier() if rank else world.Ibarrier().Wait()
        world.Bcast(base, root=0)
        t_np1, t_npp = float(base[0]), float(base[1])
        machine = perf.Machine(alpha=alpha, beta=beta, gamma=t_np1 / flops)
        dims = tuple(args.grid) if args.grid else perf.recommend_grid(n, n, n, size, machine)
        grid = hpctp.ProcessGrid(list(dims))
        a = hpctp.random.normal((n, n), grid, (0, 1), seed=1)
        b = hpctp.random.normal((n, n), grid, (0, 1), seed=2)
        c = matmul(a, b, panel=args.panel)
        fns = [functools.partial(matmul, a, b, panel=args.panel)]
        if heat is not None:
            r0, r1 = hpctp.block_range(n, size, rank)  # the same matrices, as row blocks
            ha = heat.array(torch.from_numpy(block_normal((n, n), ((r0, r1), (0, n)), 1)), is_split=0)
            hb = heat.array(torch.from_numpy(block_normal((n, n), ((r0, r1), (0, n)), 2)), is_split=0)
            fns.append(functools.partial(heat.matmul, ha, hb))
        times = best_of(fns)
        t_hp, t_ht = times[0], (times[1] if heat is not None else None)
        plan = plan_matmul(a.layout, b.layout, panel=args.panel)
        pred = perf.predict_matmul(n, n, n, dims, machine, panel=plan.panel)  # type: ignore[arg-type]
        # check: C[:, :4] against A @ B[:, :4] (numpy, on rank 0)
        cg = c.gather(root=0)
        ok = True
        if cg is not None:  # rank 0
            A = block_normal((n, n), ((0, n), (0, n)), 1)
            B4 = block_normal((n, n), ((0, n), (0, 4)), 2)
            ok = bool(np.allclose(cg[:, :4], A @ B4, rtol=1e-10, atol=1e-10))
            del A, cg
        del c, a, b
        if heat is not None:
            hc = heat.matmul(ha, hb)  # check its rows against numpy too
            lo = hc.comm.chunk(hc.gshape, hc.split)[0] if hc.split == 0 else 0
            mine = hc.larray.numpy()
            b4 = block_normal((n, n), ((0, n), (0, 4)), 2)
            a_rows = block_normal((n, n), ((lo, lo + mine.shape[0]), (0, n)), 1)
            good = np.array([int(np.allclose(mine[:, :4], a_rows @ b4, rtol=1e-10, atol=1e-10))])
            world.Allreduce(MPI.IN_PLACE, good, op=MPI.MIN)
            ok = ok and bool(good[0]) if rank == 0 else ok
            del ha, hb, hc
        grid.free()
        rows.append((n, dims, plan.panel, t_np1, t_npp, t_hp, t_ht, pred.time, ok))

    if rank == 0:
        _report(rows, size, heat_note)
        print(f"load average at the end: {os.getloadavg()[0]:.2f} (other processes on the machine skew timings)")
        if args.json:
            _write_json(args.json, rows, size, heat.__version__ if heat is not None else None)
    return 0 if all(r[-1] for r in rows) or rank else 1


def _write_json(path: str, rows: list[tuple], size: int, heat: str | None) -> None:  # type: ignore[type-arg]
    """Rank 0: the table of :func:`_report` as a results file of the docs' benchmark pages (benchmarks/plots.py)."""
    import plots

    table: list[list[str]] = []
    gflops: dict[str, list[float]] = {}
    times: dict[str, list[float]] = {}
    for n, dims, _, t_np1, t_npp, t_hp, t_ht, _, _ in rows:
        ref = size * 2.0 * n**3 / t_np1
        cases = [("numpy", "1 × 1", t_np1), ("numpy", f"1 × {size}", t_npp)]
        cases.append((f"hpctp SUMMA, grid {dims[0]}×{dims[1]}", f"{size} × 1", t_hp))
        if t_ht is not None:
            cases.append(("Heat `ht.matmul`", f"{size} × 1", t_ht))
        for name, procs, t in cases:
            rate = 2.0 * n**3 / t
            table.append([str(n), name, procs, f"{t:.3g} s", f"{rate / 1e9:.1f}", f"{rate / ref:.0%}"])
            label = f"{name.split(',')[0].replace('`ht.matmul`', '').strip()}, {procs}"
            gflops.setdefault(label, []).append(round(rate / 1e9, 1))
            times.setdefault(label, []).append(float(f"{t:.3g}"))
    sizes = [r[0] for r in rows]
    heat_text = f"; Heat {heat}" if heat else ""
    against_heat = " and against Heat's `ht.matmul` on the same ranks" if heat else ""
    measures = (
        f"The product of two n × n float64 matrices (best of the timed runs after a warm-up, the slowest "
        f"rank): hpctp's SUMMA on {size} ranks against numpy's `A @ B` in one process with 1 and with {size} BLAS "
        f"threads{against_heat}, in the same run; the result is checked against numpy."
    )
    results = {
        **plots.header("matmul", "Matmul", size, f"1 BLAS thread per rank{heat_text}", measures),
        "tables": [
            {
                "caption": "n × n float64 matrix product; efficiency = GFLOP/s / (P × numpy's 1-thread GFLOP/s)",
                "columns": [
                    "n",
                    "implementation",
                    "processes × threads",
                    "time",
                    "GFLOP/s",
                    "efficiency vs P × 1-thread",
                ],
                "rows": table,
            }
        ],
        "plots": [
            {
                "file": "matmul_gflops.png",
                "kind": "bar",
                "title": "GFLOP/s by implementation",
                "xlabel": "",
                "ylabel": "GFLOP/s",
                "x": [f"n = {n}" for n in sizes],
                "series": gflops,
            },
            {
                "file": "matmul_time.png",
                "kind": "line",
                "title": "Time of one product against n",
                "xlabel": "n",
                "ylabel": "time (s, log scale)",
                "x": sizes,
                "series": times,
                "logx": True,
                "logy": True,
            },
        ],  # fmt: skip
    }
    print(f"results written to {plots.dump(results, path)}")


def _line(n: int, name: str, procs: str, t: float, ref_rate: float) -> str:
    rate = 2.0 * n**3 / t
    return f"| {n} | {name} | {procs} | {t:.3f} | {rate / 1e9:.2f} | {rate / ref_rate:.0%} |"


def _report(rows: list[tuple], size: int, heat_note: str) -> None:  # type: ignore[type-arg]
    """Print the table (markdown) and one summary line per size."""
    print()
    print("| n | implementation | processes x threads | time [s] | GFLOP/s | efficiency |")
    print("|---:|---|---|---:|---:|---:|")
    for n, dims, panel, t_np1, t_npp, t_hp, t_ht, _, _ in rows:
        ref = size * 2.0 * n**3 / t_np1  # P x (numpy 1-thread rate)
        print(_line(n, "numpy", "1 x 1", t_np1, ref))
        print(_line(n, "numpy", f"1 x {size}", t_npp, ref))
        print(_line(n, f"hpctp SUMMA, grid {dims[0]}x{dims[1]}, panel {panel}", f"{size} x 1", t_hp, ref))
        if t_ht is not None:
            print(_line(n, "Heat ht.matmul (split 0 @ split 0)", f"{size} x 1", t_ht, ref))
    print()
    for n, _, _, _, _, t_hp, t_ht, t_pred, ok in rows:
        extra = f", hpctp/Heat speed ratio {t_ht / t_hp:.2f}" if t_ht is not None else f" ({heat_note})"
        print(
            f"n={n}: results {'match' if ok else 'DO NOT MATCH'} numpy; model predicts "
            f"{t_pred:.3f} s for hpctp (measured {t_hp:.3f} s){extra}"
        )


if __name__ == "__main__":
    from hpctp.cli.runner import run_main

    run_main(main)  # an error on one rank aborts the job instead of hanging the others
