"""``mpiexec -n 4 python -m apps.surrogate {train,evaluate,predict} [--config C] ...``"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Collective over COMM_WORLD. Train, evaluate or run the surrogate."""
    p = argparse.ArgumentParser(
        prog="python -m apps.surrogate", description="Distributed surrogate of the Gray-Scott fields"
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("train", "evaluate", "predict"):
        s = sub.add_parser(name)
        s.add_argument("--config", default=None, help="TOML config (default: apps/configs/default.toml)")
        s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
        s.add_argument("--data", default=None, help="snapshot file (default: simulation.out)")
        s.add_argument("--verbose", action="store_true", help="log from every rank")
        if name == "train":
            s.add_argument("--out", default=None, help="run directory (default: train.out)")
            s.add_argument("--resume", action="store_true", help="continue from RUNDIR/checkpoint.h5 (any rank count)")
            s.add_argument(
                "--dry-run", action="store_true",
                help="stop before training, after logging the plan (with train.plan = 'auto': the one hpctp.perf picks)",
            )  # fmt: skip
            s.add_argument(
                "--trace", type=int, nargs="?", const=2000, default=None, metavar="N",
                help="flight recorder: keep each rank's last N MPI calls (default 2000) and write them to RUNDIR/trace "
                "at the end, for `hpctp trace summarize RUNDIR/trace` (HPCTP_WATCHDOG and HPCTP_CHECK also apply)",
            )  # fmt: skip
        else:
            s.add_argument("--checkpoint", default=None, help="default: train.out/checkpoint.h5")
        if name == "evaluate":
            s.add_argument("--plot", default=None, help="PNG of truth/prediction/error (default: RUNDIR/eval.png)")
            s.add_argument(
                "--rollout", type=int, default=0, metavar="N",
                help="also feed the surrogate its own predictions for N steps from held-out initial states: "
                "error per lead time beside persistence (RUNDIR/rollout.csv, RUNDIR/rollout.png)",
            )  # fmt: skip
        if name == "predict":
            s.add_argument("--start", type=int, default=0, help="snapshot index to start from")
            s.add_argument("--steps", type=int, default=4, help="number of predicted states")
            s.add_argument("--out", default=None, help="HDF5 output (default: RUNDIR/predictions.h5)")
    args = p.parse_args(argv)

    from pathlib import Path

    from mpi4py import MPI

    import hpctp
    from hpctp.cli.log import get_logger

    from ..common.config import load_config

    cfg = load_config(args.config, args.set)
    if getattr(args, "trace", None) is not None:
        hpctp.debug.trace(args.trace)  # (before the grid: every rank's sequence numbers count the same calls)
    grid = hpctp.ProcessGrid(cfg["simulation"]["grid"], comm=MPI.COMM_WORLD)
    log = get_logger(f"apps.surrogate.{args.command}", grid, args.verbose)
    data = args.data or cfg["simulation"]["out"]
    run = Path(cfg["train"]["out"])
    if args.command == "train":
        from .train import train

        losses = train(cfg, data, args.out or str(run), grid, log, resume=args.resume, dry_run=args.dry_run)
        if losses:
            log.info("loss: first step %.4e, last step %.4e", losses[0], losses[-1])
        if args.trace is not None:
            where = Path(args.out or str(run)) / "trace"
            hpctp.debug.dump(where)
            log.info(
                "flight recorder: each rank's last %d MPI calls in %s (hpctp trace summarize %s)",
                args.trace,
                where,
                where,
            )
        return 0
    checkpoint = args.checkpoint or str(run / "checkpoint.h5")
    if args.command == "evaluate":
        from .evaluate import evaluate

        result = evaluate(cfg, data, checkpoint, grid, log, plot=args.plot or str(Path(checkpoint).parent / "eval.png"))
        if grid.rank == 0:
            print(
                f"relative L2 error: {result['surrogate']:.4f} (persistence baseline {result['persistence']:.4f})",
                flush=True,
            )
        if args.rollout:
            from .rollout import run_rollout

            roll = run_rollout(cfg, data, checkpoint, grid, log, args.rollout)
            if grid.rank == 0:
                print(roll.table(), flush=True)
        return 0
    from .predict import predict

    predict(
        cfg,
        data,
        checkpoint,
        args.start,
        args.steps,
        args.out or str(Path(checkpoint).parent / "predictions.h5"),
        grid,
        log,
    )
    return 0


if __name__ == "__main__":
    from hpctp.cli.runner import run_main

    run_main(main)
