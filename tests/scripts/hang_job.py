"""Jobs that fail on purpose, for tests/test_debug_faults.py (run under mpiexec with HPCTP_WATCHDOG or HPCTP_CHECK).

    mpiexec -n 2 python tests/scripts/hang_job.py MODE [RANK]

Every rank makes a few all-reduces on a 1-D grid over all ranks; rank RANK (default: the
last) goes wrong on the third one (``# <- MODE`` marks the line the test looks for):

    skip      leaves it out and carries on (its next all-reduce lines up with the others' third)
    bcast     calls Bcast where the others call Allreduce (the same buffer)
    size      passes half the elements to the all-reduce
    send      sends twice the elements its neighbour expects (the all-reduces are exchanges with the
              neighbours here: rank r sends to r + 1 and receives from r - 1, around the ring)
    sleep     sleeps instead (outside MPI, in time.sleep)
    loop      spins in a pure-Python loop instead
    raise     raises a ValueError instead (no run_main: a plain uncaught exception)

With HPCTP_CHECK=1 each rank catches the mismatch, prints ``caught on rank R: <message>`` and
whether its buffer is unchanged (``data untouched: True``), and the job ends normally.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import hpctp
from hpctp.comm import allreduce, bcast, irecv, isend, waitall
from hpctp.comm.trace import CollectiveMismatch

MODE = sys.argv[1]


def main() -> None:
    grid = hpctp.ProcessGrid([0])
    odd = int(sys.argv[2]) if len(sys.argv) > 2 else grid.size - 1
    me = grid.rank == odd
    x = np.ones(8)
    for step in range(5):
        if step == 2 and me:
            if MODE == "skip":
                continue
            if MODE == "sleep":
                time.sleep(120)  # <- sleep
            if MODE == "loop":
                n = 0
                while n >= 0:  # <- loop
                    n += 1
            if MODE == "raise":
                raise ValueError("rank went its own way")  # <- raise
            if MODE == "bcast":
                _try(grid, x, lambda: bcast(grid.comm, x))  # <- bcast
                continue
            if MODE == "size":
                _try(grid, x[:4], lambda: allreduce(grid.comm, x[:4]))  # <- size
                continue
        if MODE == "send":
            _exchange(grid, x, twice=me and step == 2)
            continue
        _try(grid, x, lambda: allreduce(grid.comm, x))  # <- allreduce
        x[:] = 1.0
    allreduce(grid.comm, x)  # <- final
    print(f"rank {grid.rank} done", flush=True)


def _exchange(grid: hpctp.ProcessGrid, x: np.ndarray, twice: bool) -> None:
    """Send ``x[:4]`` (all of ``x`` when ``twice``) to the next rank, receive 4 elements from the previous one."""
    n = grid.size
    got = np.empty(4)
    out = x if twice else x[:4]
    pending = [irecv(grid.comm, got, (grid.rank - 1) % n, tag=7)]
    pending.append(isend(grid.comm, out, (grid.rank + 1) % n, tag=7))  # <- send
    waitall(pending)  # <- wait


def _try(grid: hpctp.ProcessGrid, buf: np.ndarray, call: object) -> None:
    before = buf.copy()
    try:
        call()  # type: ignore[operator]
    except CollectiveMismatch as e:
        print(f"caught on rank {grid.rank}: {e}\ndata untouched: {bool((buf == before).all())}", flush=True)
        sys.exit(0)


if __name__ == "__main__":
    main()
