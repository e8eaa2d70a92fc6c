"""Command line: ``hpctp info`` and ``hpctp demo`` (run under mpiexec/srun for several ranks)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NoReturn

from .runner import run_main

__all__ = ["main", "cli"]


def main(argv: Sequence[str] | None = None) -> int:
    """Collective over COMM_WORLD. Entry point of ``python -m hpctp`` / ``hpctp``."""
    parser = argparse.ArgumentParser(prog="hpctp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="MPI library, ranks, grid, CUDA-aware MPI and backends")
    demo = sub.add_parser("demo", help="scatter/redistribute/reduce a random tensor and check against numpy")
    demo.add_argument("--shape", type=int, nargs=2, default=(1001, 777), metavar=("M", "N"))
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--verbose", action="store_true", help="log from every rank")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    if args.command == "info":
        from .info import format_info, runtime_info

        info = runtime_info(MPI.COMM_WORLD)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(format_info(info), flush=True)
        return 0
    from .demo import run_demo

    worst = run_demo(tuple(args.shape), args.seed, args.verbose)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"demo ok: largest relative error {worst:.2e}", flush=True)
    return 0 if worst < 1e-10 else 1


def cli() -> NoReturn:
    """Collective over COMM_WORLD. The ``hpctp`` command: :func:`main`, and an error on one rank
    aborts the job instead of leaving the others waiting."""
    run_main(main)


if __name__ == "__main__":
    cli()
