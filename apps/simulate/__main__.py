"""``mpiexec -n 4 python -m apps.simulate [--config C] [--out F] [--set simulation.key=value] [--train-online]``"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Collective over COMM_WORLD. Simulate and write snapshots (or run in-situ inference, or train online)."""
    p = argparse.ArgumentParser(
        prog="python -m apps.simulate",
        description="Distributed simulation: Gray-Scott or Navier-Stokes (simulation.pde)",
    )
    p.add_argument("--config", default=None, help="TOML config (default: apps/configs/default.toml)")
    p.add_argument("--out", default=None, help="HDF5 output (default: simulation.out)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--insitu", action="store_true", help="run the trained surrogate in-situ on the live field")
    p.add_argument("--checkpoint", default=None, help="surrogate checkpoint for --insitu")
    p.add_argument(
        "--train-online", action="store_true",
        help="train the surrogate ([surrogate], [train], [online]) while simulating: checkpoint to train.out, "
        "no snapshot file (apps/simulate/online.py)",
    )  # fmt: skip
    p.add_argument("--verbose", action="store_true", help="log from every rank")
    args = p.parse_args(argv)

    from mpi4py import MPI

    import hpctp
    from hpctp.cli.log import get_logger

    from ..common.config import load_config

    cfg = load_config(args.config, args.set)
    if args.train_online:
        if args.insitu or args.out:
            raise ValueError("--train-online writes no snapshot file and runs no in-situ model: drop --out/--insitu")
        from .online import run_online

        run_online(cfg, MPI.COMM_WORLD, args.verbose)
        return 0
    sim = cfg["simulation"]
    grid = hpctp.ProcessGrid(sim["grid"], comm=MPI.COMM_WORLD)
    log = get_logger("apps.simulate", grid, args.verbose)
    if args.insitu:
        if sim.get("pde", "grayscott") != "grayscott":
            raise ValueError(f"--insitu runs the Gray-Scott model only; the config has pde = {sim['pde']!r}")
        from .insitu import run_insitu

        return run_insitu(cfg, grid, log, args.checkpoint)
    from .run import save_snapshots, simulate

    snaps = simulate(sim, grid, log)
    out = args.out or sim["out"]
    save_snapshots(snaps, out, sim)
    log.info("wrote %s: fields %s", out, snaps.global_shape)
    return 0


if __name__ == "__main__":
    from hpctp.cli.runner import run_main

    run_main(main)
