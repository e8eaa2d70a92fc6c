"""Parallel HDF5 read bandwidth: hpctp.io.load_hdf5 on N ranks vs one process reading everything.

    mpiexec -n 2 python benchmarks/io_read.py            # 1 GiB float32 dataset
    mpiexec -n 2 python benchmarks/io_read.py --gib 0.05 # quick check

Rank 0 writes a contiguous ``[n, 512, 512]`` float32 dataset (``--gib`` GiB) into
``--dir``, then times (best of ``--repeat``):

* serial:   rank 0 alone reads the whole dataset with one ``read_direct`` (the others wait);
* parallel: every rank reads its block of dim 0 with ``load_hdf5`` (time to the slowest rank).

The file was just written, so reads come from a warm page cache: this measures how well
ranks share the copy out of the cache and the HDF5 overhead, not disk bandwidth (the
page cache is not dropped). The file is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import h5py
import numpy as np
from mpi4py import MPI

import hpctp
import hpctp.io
from hpctp.comm.io_calls import bcast_bytes

PLANE = (512, 512)


def write_file(path: str, planes: int) -> None:
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("u", shape=(planes, *PLANE), dtype="float32")
        block = 64
        for start in range(0, planes, block):
            n = min(block, planes - start)
            slab = np.empty((n, *PLANE), dtype=np.float32)
            slab[...] = np.arange(start, start + n, dtype=np.float32)[:, None, None]
            ds[start : start + n] = slab  # a full array: h5py writes broadcasts element row by row


def time_serial(path: str) -> float:
    with h5py.File(path, "r") as f:
        ds = f["u"]
        out = np.empty(ds.shape, dtype=ds.dtype)
        t = time.perf_counter()
        ds.read_direct(out)
        elapsed = time.perf_counter() - t
    if out[-1, 0, 0] != ds.shape[0] - 1:
        raise RuntimeError("serial read returned wrong data")
    return elapsed


def time_parallel(path: str, grid: hpctp.ProcessGrid) -> float:
    grid.comm.Barrier()
    t = time.perf_counter()
    x = hpctp.io.load_hdf5(path, "u", grid, (0, None, None))
    elapsed = np.array([time.perf_counter() - t])
    grid.comm.Allreduce(MPI.IN_PLACE, elapsed, op=MPI.MAX)
    first = x.local_offsets[0]
    if x.local.shape[0] and x.local[0, 0, 0] != first:
        raise RuntimeError("parallel read returned wrong data")
    return float(elapsed[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="dataset size in GiB (default 1)")
    parser.add_argument("--dir", default=None, help="directory for the file (default: a temp dir under the cwd)")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (best is reported)")
    parser.add_argument("--keep", action="store_true", help="keep the file")
    args = parser.parse_args()
    grid = hpctp.ProcessGrid((0,))
    plane_bytes = PLANE[0] * PLANE[1] * 4
    planes = max(grid.size, int(args.gib * 2**30 // plane_bytes))
    folder = path = ""
    if grid.rank == 0:
        folder = tempfile.mkdtemp(prefix="hpctp-io-bench-", dir=args.dir or os.getcwd())
        path = os.path.join(folder, "bench.h5")
        t = time.perf_counter()
        write_file(path, planes)
        print(
            f"wrote {planes * plane_bytes / 2**30:.3f} GiB ({planes} x {PLANE[0]} x {PLANE[1]} float32) "
            f"in {time.perf_counter() - t:.2f} s to {path}",
            flush=True,
        )
    path = bcast_bytes(grid.comm, path.encode() if grid.rank == 0 else None).decode()
    nbytes = planes * plane_bytes
    try:
        serial = []
        for _ in range(args.repeat):
            grid.comm.Barrier()
            if grid.rank == 0:
                serial.append(time_serial(path))
        parallel = [time_parallel(path, grid) for _ in range(args.repeat)]
        if grid.rank == 0:
            s, p = min(serial), min(parallel)
            method = "mpio" if hpctp.io.mpio_available() and grid.size > 1 else "serial (per-rank POSIX reads)"
            print(f"h5py MPI: {hpctp.io.mpio_available()}; load_hdf5 method: {method}; warm page cache")
            print(f"1 process : {s:.3f} s  {nbytes / 2**30 / s:.2f} GiB/s  (best of {args.repeat})")
            print(
                f"{grid.size} ranks   : {p:.3f} s  {nbytes / 2**30 / p:.2f} GiB/s  (slowest rank, best of {args.repeat})"
            )
            print(f"speed-up  : {s / p:.2f}x  (parallel / serial bandwidth)")
    finally:
        grid.comm.Barrier()
        if grid.rank == 0 and not args.keep:
            os.remove(path)
            os.rmdir(folder)
        grid.free()


if __name__ == "__main__":
    from hpctp.cli.runner import run_main

    run_main(main)  # an error on one rank aborts the job instead of hanging the others
