"""GPU ratios in one MPI run (ranks share or split the GPUs): SUMMA vs torch.matmul, and a halo
conv stack forward+backward vs torch on one device.

    mpiexec -n 4 python benchmarks/gpu_bench.py [--n 16384] [--field 4096]
"""

from __future__ import annotations

import argparse
import time

import torch
from mpi4py import MPI

import hpctp


def _time(fn, reps: int, comm) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return best


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--field", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    world = MPI.COMM_WORLD
    grid = hpctp.ProcessGrid([0, 0])
    dev = hpctp.comm.select_device(grid)
    rank0 = grid.rank == 0
    if rank0:
        print(f"{grid.size} ranks, grid {grid.dims}, device {dev}, cuda-aware {hpctp.comm.cuda_aware_reason()}")
    n = args.n
    a = hpctp.random.normal((n, n), grid, (0, 1), seed=1, dtype=torch.float32, like="cuda")
    b = hpctp.random.normal((n, n), grid, (0, 1), seed=2, dtype=torch.float32, like="cuda")
    t = _time(lambda: hpctp.matmul(a, b), args.reps, world)
    flops = 2.0 * n**3
    ref = None
    if rank0:
        ga, gb = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
        ref = _time(lambda: ga @ gb, args.reps, MPI.COMM_SELF)
        print(f"SUMMA fp32 n={n}: {flops / t / 1e12:.1f} TFLOP/s; torch.matmul one device: "
              f"{flops / ref / 1e12:.1f} TFLOP/s; ratio {ref / t:.2f}")  # fmt: skip
    world.Barrier()
    f = args.field
    convs = torch.nn.ModuleList(
        [hpctp.nn.Conv2d(16, 16, 3, padding=1, grid=grid, split=(0, 1), seed=i, device="cuda") for i in range(3)]
    )
    x = hpctp.random.normal((1, 16, f, f), grid, (None, None, 0, 1), seed=3, dtype=torch.float32, like="cuda")

    def step() -> None:
        h = hpctp.DistTensor(x.local.clone().requires_grad_(), grid, x.layout)
        for c in convs:
            h = c(h)
        (h.local**2).sum().backward()

    t = _time(step, args.reps, world)
    if rank0:
        tconvs = torch.nn.Sequential(*[torch.nn.Conv2d(16, 16, 3, padding=1) for _ in range(3)]).cuda()
        gx = torch.randn(1, 16, f, f, device="cuda", requires_grad=True)
        ref = _time(lambda: (tconvs(gx) ** 2).sum().backward(), args.reps, MPI.COMM_SELF)
        print(f"halo conv fwd+bwd 1x16x{f}x{f}: hpctp {t * 1e3:.1f} ms, torch one device {ref * 1e3:.1f} ms, "
              f"ratio {ref / t:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
