"""Run the simulation and store snapshots ``[T, C, H, W]`` with hpctp.io (each rank its hyperslab):
Gray-Scott's ``(u, v)`` (``C = 2``) or Navier-Stokes' vorticity (``C = 1``), by ``[simulation] pde``."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import hpctp
from hpctp.io import save_hdf5

from .grayscott import GrayScott, initial_state
from .navier_stokes import simulate_navier_stokes

__all__ = ["simulate"]


def simulate(cfg: dict[str, Any], grid: hpctp.ProcessGrid, log: Any, progress: bool = True) -> hpctp.DistTensor:
    """Collective over grid. Run the ``[simulation]`` config and return the snapshots.

    ``pde`` (default ``"grayscott"``) picks the model; ``"navier_stokes"`` runs
    :func:`apps.simulate.navier_stokes.simulate_navier_stokes` (its keys are listed there).

    Returns
    -------
    DistTensor
        ``[T, 2, H, W]`` split ``(None, None, 0, 1)``: snapshot ``t`` is the state after
        ``warmup + t * snapshot_every`` steps (Navier-Stokes: ``[T, 1, H, W]``, the vorticity at
        time ``warmup + t * snapshot_every``).

    Raises
    ------
    ValueError
        On an unknown ``pde`` or bad snapshot counts.
    """
    pde = cfg.get("pde", "grayscott")
    if pde == "navier_stokes":
        return simulate_navier_stokes(cfg, grid, log, progress)
    if pde != "grayscott":
        raise ValueError(f"simulation.pde must be 'grayscott' or 'navier_stokes', got {pde!r}")
    h, w = cfg["size"]
    model = GrayScott.from_config(cfg)
    state = initial_state((h, w), grid, cfg["seed"], cfg["seeds"])
    every, warmup, steps = int(cfg["snapshot_every"]), int(cfg["warmup"]), int(cfg["steps"])
    if every < 1 or warmup < 0 or steps < warmup + every:
        raise ValueError(f"need snapshot_every >= 1, warmup >= 0 and steps >= warmup + snapshot_every, got {cfg}")
    count = (steps - warmup) // every + 1
    snaps = np.empty((count, *state.local.shape), dtype=state.local.dtype)
    t0 = time.perf_counter()
    model.step(state, warmup)
    snaps[0] = state.local
    show = progress and grid.rank == 0 and sys.stderr.isatty()
    bar = tqdm(total=count - 1, desc="simulate", unit="snap", disable=not show)
    for t in range(1, count):
        model.step(state, every)
        snaps[t] = state.local
        bar.update()
    bar.close()
    layout = hpctp.Layout((count, 2, h, w), grid.dims, (None, None, 0, 1))
    result = hpctp.DistTensor(snaps, grid, layout)
    v = result.local[:, 1]
    log.info(
        "simulated %d steps on %s in %.2f s; %d snapshots; v in [%.3f, %.3f] (this rank)",
        steps, grid.dims, time.perf_counter() - t0, count, float(v.min()) if v.size else 0.0, float(v.max()) if v.size else 0.0,
    )  # fmt: skip
    return result


def save_snapshots(snaps: hpctp.DistTensor, path: str, cfg: dict[str, Any]) -> None:
    """Collective over grid. Write snapshots to ``path`` (dataset ``fields``) with the parameters as attributes."""
    Path(path).parent.mkdir(parents=True, exist_ok=True) if snaps.grid.rank == 0 else None
    snaps.grid.comm.Barrier()
    attrs: dict[str, Any] = {k: v for k, v in cfg.items() if isinstance(v, (int, float, str))}
    attrs["size"] = np.asarray(cfg["size"])
    save_hdf5(snaps, path, "fields", mode="w", attrs=attrs)
