"""GPU ratios in one MPI run (ranks share or split the GPUs), each against torch on one device
measured in the same run:

1. SUMMA (``hpctp.matmul``) of two ``n x n`` float32 matrices vs ``torch.matmul`` on one GPU.
2. A stack of three halo-exchanging ``hpctp.nn.Conv2d`` (16 channels, 3x3), forward + backward on
   a ``1 x 16 x f x f`` field split over the grid, vs the same torch convolutions on one GPU.
3. Two Fourier layers (``hpctp.nn.SpectralConv2d``, 16 modes) on the same field vs
   ``spectral_conv_fft`` (torch.fft) on one GPU.

    mpiexec -n 4 python benchmarks/gpu_bench.py [--n 16384] [--field 4096] [--reps 3]
    mpiexec -n 2 python benchmarks/gpu_bench.py --device cpu --n 256 --field 64   # dry run, no GPU

Times are the best of ``--reps`` runs after one warm-up, each the slowest rank's. Ratios above 1
mean hpctp is faster. Ranks sharing one GPU split its throughput, so expect ratios below 1 there;
the point is the overhead of the partitioned path (halo exchange, host staging without
CUDA-aware MPI).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from mpi4py import MPI

import hpctp
import hpctp.nn

Timer = Callable[[Callable[[], object], int, MPI.Comm], float]


def _timer(device: str) -> Timer:
    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def best(fn: Callable[[], object], reps: int, comm: MPI.Comm) -> float:
        fn()
        sync()
        out = float("inf")
        for _ in range(reps):
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            out = min(out, comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        return out

    return best


def _summa(args: argparse.Namespace, grid: hpctp.ProcessGrid, like: str, timed: Timer) -> None:
    """SUMMA vs torch.matmul on one device (the matrices are freed on return)."""
    n = args.n
    a = hpctp.random.normal((n, n), grid, (0, 1), seed=1, dtype=torch.float32, like=like)
    b = hpctp.random.normal((n, n), grid, (0, 1), seed=2, dtype=torch.float32, like=like)
    t = timed(lambda: hpctp.matmul(a, b), args.reps, grid.comm)
    if grid.rank == 0:
        ga = torch.randn(n, n, device=args.device)
        gb = torch.randn(n, n, device=args.device)
        ref = timed(lambda: ga @ gb, args.reps, MPI.COMM_SELF)
        flops = 2.0 * n**3
        print(f"SUMMA fp32 n={n}: hpctp {flops / t / 1e12:.2f} TFLOP/s, torch.matmul one device "
              f"{flops / ref / 1e12:.2f} TFLOP/s, ratio {ref / t:.2f}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=16384, help="matrix size of the SUMMA benchmark")
    p.add_argument("--field", type=int, default=4096, help="field edge of the conv benchmark")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of this script")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    grid = hpctp.ProcessGrid([0, 0])
    timed = _timer(args.device)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu_bench.py: no CUDA device visible; use --device cpu for a dry run")
        dev = hpctp.comm.select_device(grid)
        name = torch.cuda.get_device_name()
    else:
        dev, name = None, "cpu"
    like = "cuda" if args.device == "cuda" else "torch"
    rank0 = grid.rank == 0
    if rank0:
        aware, why = hpctp.comm.cuda_aware_reason()
        print(f"{grid.size} ranks, grid {grid.dims}, device {dev} ({name}), CUDA-aware MPI {aware} ({why})")

    _summa(args, grid, like, timed)
    world.Barrier()
    f = args.field
    convs = torch.nn.ModuleList(
        [hpctp.nn.Conv2d(16, 16, 3, padding=1, grid=grid, split=(0, 1), seed=i, device=args.device) for i in range(3)]
    )
    x = hpctp.random.normal((1, 16, f, f), grid, (None, None, 0, 1), seed=3, dtype=torch.float32, like=like)

    def step() -> None:
        h = hpctp.DistTensor(x.local.clone().requires_grad_(), grid, x.layout)
        for c in convs:
            h = c(h)
        (h.local**2).sum().backward()

    t = timed(step, args.reps, world)
    if rank0:
        tconvs = torch.nn.Sequential(*[torch.nn.Conv2d(16, 16, 3, padding=1) for _ in range(3)]).to(args.device)
        gx = torch.randn(1, 16, f, f, device=args.device, requires_grad=True)
        ref = timed(lambda: (tconvs(gx) ** 2).sum().backward(), args.reps, MPI.COMM_SELF)
        print(f"halo conv fwd+bwd 1x16x{f}x{f}: hpctp {t * 1e3:.1f} ms, torch one device {ref * 1e3:.1f} ms, "
              f"ratio {ref / t:.2f}")  # fmt: skip
    _fno(args, grid, x, timed)
    return 0


def _fno(args: argparse.Namespace, grid: hpctp.ProcessGrid, x: hpctp.DistTensor, timed: Timer) -> None:
    """Two Fourier layers (16 modes) on the conv benchmark's field vs spectral_conv_fft on one device."""
    from hpctp.nn.functional import spectral_conv_fft

    layers = [hpctp.nn.SpectralConv2d(16, 16, 16, grid=grid, seed=i, device=args.device) for i in range(2)]

    def step() -> None:
        h = hpctp.DistTensor(x.local.clone().requires_grad_(), grid, x.layout)
        for layer in layers:
            h = layer(h)
        (h.local**2).sum().backward()

    t = timed(step, args.reps, grid.comm)
    if grid.rank == 0:
        f = x.global_shape[-1]
        gx = torch.randn(1, 16, f, f, device=args.device, requires_grad=True)
        ws = [layer.weight.detach().clone().requires_grad_() for layer in layers]

        def ref_step() -> None:
            h = gx
            for w in ws:
                h = spectral_conv_fft(h, w)
            (h**2).sum().backward()

        ref = timed(ref_step, args.reps, MPI.COMM_SELF)
        print(f"FNO 2 x SpectralConv2d(16,16,modes=16) fwd+bwd 1x16x{f}x{f}: hpctp {t * 1e3:.1f} ms, "
              f"torch.fft one device {ref * 1e3:.1f} ms, ratio {ref / t:.2f}")  # fmt: skip


if __name__ == "__main__":
    from hpctp.cli.runner import run_main

    run_main(main)  # an error on one rank aborts the job instead of hanging the others
