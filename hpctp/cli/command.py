"""Command line: ``hpctp info``, ``hpctp demo`` (run under mpiexec/srun for several ranks), ``hpctp trace``,
``hpctp plan`` (the planner, one process) and ``hpctp perf calibrate`` (under mpiexec)."""

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
    trace = sub.add_parser("trace", help="read the flight recorder's dumps (HPCTP_TRACE / HPCTP_WATCHDOG)")
    how = trace.add_subparsers(dest="trace_command", required=True)
    summ = how.add_parser("summarize", help="who waits for whom: stragglers, waiting per rank and operation")
    summ.add_argument("directory", help="a job directory of rank*.json dumps, or the directory of job-* directories")
    summ.add_argument("--perfetto", default=None, help="Chrome/Perfetto trace JSON (default: DIR/perfetto.json)")
    summ.add_argument("--png", default=None, help="also draw the timeline as a PNG (matplotlib)")
    summ.add_argument("--window", type=float, nargs=2, default=None, metavar=("FROM_MS", "TO_MS"),
                      help="the PNG's window, in ms from the first recorded call (default: all)")  # fmt: skip
    rep = how.add_parser("report", help="where the ranks diverge (the watchdog's report, offline)")
    rep.add_argument("directory")
    pl = sub.add_parser("plan", help="rank the parallel plans of a model config on N ranks (no mpiexec needed)")
    pl.add_argument(
        "config",
        help="TOML config: an apps surrogate config, or one with [plan] inputs = 'module:function', a function of the "
        "config returning {'builder': build, 'sample': hpctp.perf.Sample(...)}, where build(plan) builds the model on "
        "plan.model_grid split on plan.spatial (the guide's 'Planning your own model')",
    )
    pl.add_argument("--ranks", type=int, required=True, help="ranks of the job")
    pl.add_argument("--memory", required=True, help="memory per rank, e.g. 80GiB")
    pl.add_argument(
        "--machine", default=None,
        help="machine file (written by 'hpctp perf calibrate') or published profile (default: h100-ndr, the published "
        "figures of H100 GPUs, not this machine: a warning says so)",
    )  # fmt: skip
    pl.add_argument("--top", type=int, default=10, help="plans shown")
    pl.add_argument("--no-pipeline", action="store_true", help="leave pipeline plans out")
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    perf = sub.add_parser("perf", help="machine profiles for the planner")
    what = perf.add_subparsers(dest="perf_command", required=True)
    cal = what.add_parser("calibrate", help="measure message costs along each grid axis and compute rates (mpiexec)")
    cal.add_argument("--out", default="machine.toml", help="machine file to write (default: machine.toml)")
    cal.add_argument("--dtype", default="float32")
    cal.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    if args.command == "plan":  # one process: the planner traces on the meta device, sends nothing
        from .plan import plan_command

        return plan_command(
            args.config, args.ranks, args.memory, args.machine, args.top, args.set, not args.no_pipeline
        )
    if args.command == "perf":
        from .plan import calibrate_command

        return calibrate_command(args.out, args.dtype, args.repeats)
    if args.command == "trace":  # offline: no collective, whatever the number of ranks
        from .trace import report_command, summarize_command

        if args.trace_command == "summarize":
            return summarize_command(args.directory, args.perfetto, args.png, args.window)
        return report_command(args.directory)

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
