"""The main job: simulate -> train -> evaluate -> plot, in one MPI run.

``mpiexec -n 4 python -m apps.pipeline [--config C] [--set section.key=value]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Collective over COMM_WORLD. Run the whole pipeline on the config's defaults."""
    p = argparse.ArgumentParser(prog="python -m apps.pipeline", description=__doc__)
    p.add_argument("--config", default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)

    from mpi4py import MPI

    import hpctp
    from hpctp.cli.log import get_logger

    from .common.config import load_config
    from .simulate.run import save_snapshots, simulate
    from .surrogate.evaluate import evaluate
    from .surrogate.rollout import longest_rollout, run_rollout
    from .surrogate.train import train

    t0 = time.perf_counter()
    cfg = load_config(args.config, args.set)
    grid = hpctp.ProcessGrid(cfg["simulation"]["grid"], comm=MPI.COMM_WORLD)
    log = get_logger("apps.pipeline", grid, args.verbose)
    log.info("pipeline on %d ranks, grid %s", grid.size, grid.dims)
    data = cfg["simulation"]["out"]
    save_snapshots(simulate(cfg["simulation"], grid, log), data, cfg["simulation"])
    run = cfg["train"]["out"]
    losses = train(cfg, data, run, grid, log)
    result = evaluate(cfg, data, f"{run}/checkpoint.h5", grid, log, plot=str(Path(run) / "eval.png"))
    steps = min(10, longest_rollout(data, cfg))  # a 10-step rollout (fewer if the data is short)
    roll = run_rollout(cfg, data, f"{run}/checkpoint.h5", grid, log, steps) if steps >= 1 else None
    if grid.rank == 0:
        rolled = (
            f"; {steps}-step rollout error {roll.surrogate[-1]:.4f} (persistence {roll.persistence[-1]:.4f}, "
            f"{run}/rollout.png)"
            if roll is not None
            else ""
        )
        print(
            f"pipeline done in {time.perf_counter() - t0:.0f} s on {grid.size} ranks: training loss "
            f"{losses[0]:.3e} -> {losses[-1]:.3e}; held-out relative L2 error {result['surrogate']:.4f} "
            f"(persistence baseline {result['persistence']:.4f}); plot {run}/eval.png{rolled}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    from hpctp.cli.runner import run_main

    run_main(main)
