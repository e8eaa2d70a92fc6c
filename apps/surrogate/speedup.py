"""What the surrogate saves: the solver's time for one surrogate step against one surrogate prediction,
in one run on the same ranks and the same field, and the rollout error at which that speed-up holds.

``mpiexec -n P python -m apps.surrogate.speedup [--config C] [--set K=V] [--sizes 256] [--reps 7] [--chain 5]``

For each field size (the config's, then each of ``--sizes``, square):

(a) the solver advances one surrogate step: Gray-Scott ``horizon x snapshot_every`` explicit steps
    (:class:`apps.simulate.grayscott.GrayScott`); Navier-Stokes ``horizon x snapshot_every`` time units
    with its CFL-adaptive step (:class:`apps.simulate.navier_stokes.NavierStokes2D`, ``cfl`` from the config:
    the largest step that is stable for any flow), from its own spectral state;
(b) one surrogate prediction (forward, no grad) of a ``[1, C, H, W]`` field on the same grid.

Both start from a held-out snapshot of the data (at a larger size: the snapshot tiled periodically for
Gray-Scott, whose grid spacing is fixed, or interpolated spectrally for Navier-Stokes, whose domain is the
unit square), are warmed up once, then timed in interleaved repeats, each by its slowest rank after a
barrier; the table shows the medians and their ratio. Each is timed once more ``--chain`` steps in a row
(the surrogate fed its own outputs, as in a rollout), per step: one step alone runs right after the other
side's step, with the caches holding that one's data, which costs a small model more than the solver. The
surrogate's weights come from the trained
checkpoint at every size (the FNO's, CNN's and U-Net's weights do not depend on the field size), or are
the untrained initial ones with ``--untrained``. Beside each size: the relative L2 error of one surrogate
step against this solver's step from the same state. Then, at the config's size, the rollout errors
(:mod:`apps.surrogate.rollout`) at the leads of ``--leads`` beside persistence's.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

import hpctp
from hpctp.comm import slowest_seconds
from hpctp.io import load_checkpoint
from hpctp.nn import relative_l2_error

from ..simulate.grayscott import GrayScott
from ..simulate.navier_stokes import NavierStokes2D
from .data import FIELDS, split_indices
from .models import build_model
from .rollout import Rollout, max_rollout_steps, rollout

__all__ = ["SolverStep", "resize_field", "measure", "format_report", "main"]


def resize_field(field: np.ndarray, size: tuple[int, int], pde: str) -> np.ndarray:
    """Local. A stored ``[C, h, w]`` snapshot at ``size`` ``(H, W)``.

    Gray-Scott (unit grid spacing, periodic): tiled, so ``H, W`` must be multiples of ``h, w``.
    Navier-Stokes (the unit square): interpolated spectrally (the ``h x w`` modes kept, their
    Nyquist modes dropped, the rest zero).

    Raises
    ------
    ValueError
        If a Gray-Scott size is not a multiple of the stored one, or a Navier-Stokes size is smaller.
    """
    c, h, w = field.shape
    big_h, big_w = int(size[0]), int(size[1])
    if (big_h, big_w) == (h, w):
        return field.copy()
    if pde == "grayscott":
        if big_h % h or big_w % w:
            raise ValueError(f"a Gray-Scott field of {h}x{w} tiles only sizes that are multiples of it, got {size}")
        return np.tile(field, (1, big_h // h, big_w // w))
    if big_h < h or big_w < w:
        raise ValueError(f"spectral interpolation enlarges a {h}x{w} field; got {size}")
    spec = np.fft.rfft2(field, axes=(1, 2))
    out = np.zeros((c, big_h, big_w // 2 + 1), dtype=np.complex128)
    kh, kw = (h - 1) // 2, (w - 1) // 2  # modes |k| <= (n - 1) / 2: no Nyquist mode
    out[:, : kh + 1, : kw + 1] = spec[:, : kh + 1, : kw + 1]
    out[:, big_h - kh :, : kw + 1] = spec[:, h - kh :, : kw + 1]
    return np.fft.irfft2(out, s=(big_h, big_w), axes=(1, 2)) * (big_h * big_w) / (h * w)


class SolverStep:
    """Collective over grid. The configured solver at one field size, started from a whole field, advanced
    one surrogate step per :meth:`advance`.

    Parameters
    ----------
    cfg : dict
        The whole config (``simulation`` and ``surrogate.horizon``).
    field : numpy.ndarray
        ``[C, H, W]``, the same on every rank.
    grid : ProcessGrid
        2-D.
    """

    def __init__(self, cfg: dict[str, Any], field: np.ndarray, grid: hpctp.ProcessGrid) -> None:
        sim = dict(cfg["simulation"])
        sim["size"] = [int(field.shape[1]), int(field.shape[2])]
        self.pde = str(sim.get("pde", "grayscott"))
        self.grid = grid
        horizon = int(cfg["surrogate"]["horizon"])
        self.layout = hpctp.Layout(field.shape, grid.dims, (None, 0, 1))
        block = np.ascontiguousarray(field[self.layout.local_slices(grid.coords)], dtype=np.float64)
        self.steps = 0  # solver steps in the last advance
        self.taken: list[int] = []
        if self.pde == "navier_stokes":
            self.ns = NavierStokes2D.from_config(sim, grid)
            self.state = self.ns.state_from(hpctp.DistTensor(block, grid, self.layout))
            self.duration = horizon * float(sim["snapshot_every"])
            self.what = (
                f"Navier-Stokes, viscosity {self.ns.viscosity:g}, CFL-adaptive RK3 (cfl {self.ns.cfl:g}); one surrogate "
                f"step = {self.duration:g} time unit(s)"
            )
        elif self.pde == "grayscott":
            self.gs = GrayScott.from_config(sim)
            self.field = hpctp.DistTensor(block, grid, self.layout)
            self.count = horizon * int(sim["snapshot_every"])
            limit = 0.25 / max(self.gs.du, self.gs.dv)
            self.what = (
                f"Gray-Scott, explicit Euler dt {self.gs.dt:g} (stable up to {limit:g}); one surrogate step = "
                f"{self.count} solver steps"
            )
        else:
            raise ValueError(f"simulation.pde must be 'grayscott' or 'navier_stokes', got {self.pde!r}")

    def advance(self) -> None:
        """Collective over grid. One surrogate step of the solver, in place."""
        if self.pde == "navier_stokes":
            self.steps = self.ns.advance(self.state, self.duration)
        else:
            self.gs.step(self.field, self.count)
            self.steps = self.count
        self.taken.append(self.steps)

    def current(self) -> hpctp.DistTensor:
        """Collective over grid. The state ``[C, H, W]`` (float64 numpy blocks, split ``(None, 0, 1)``)."""
        if self.pde == "navier_stokes":
            return self.ns.vorticity(self.state)
        return self.field

    def close(self) -> None:
        """Collective over grid. Release the solver's communicators."""
        if self.pde == "navier_stokes":
            self.ns.close()


def _model_input(field: np.ndarray, grid: hpctp.ProcessGrid, dtype: torch.dtype) -> hpctp.DistTensor:
    layout = hpctp.Layout((1, *field.shape), grid.dims, (None, None, 0, 1))
    block = torch.from_numpy(np.ascontiguousarray(field[None][layout.local_slices(grid.coords)])).to(dtype)
    return hpctp.DistTensor(block, grid, layout)


def _predictor(model: torch.nn.Module, x: hpctp.DistTensor, steps: int = 1) -> Callable[[], object]:
    """``steps`` surrogate predictions from ``x``, each fed the previous one's output (forward, no grad)."""

    def predict() -> object:
        y = x
        with torch.no_grad():
            for _ in range(steps):
                y = model(y)
        return y

    return predict


def _advancer(solver: SolverStep, steps: int) -> Callable[[], None]:
    """The solver advancing ``steps`` surrogate steps in a row."""

    def advance() -> None:
        for _ in range(steps):
            solver.advance()

    return advance


def _start_index(n: int, cfg: dict[str, Any]) -> int:
    _, held = split_indices(n, int(cfg["surrogate"]["horizon"]), float(cfg["train"]["holdout"]))
    return held[0]


def measure(
    cfg: dict[str, Any],
    data: str,
    checkpoint: str | None,
    grid: hpctp.ProcessGrid,
    log: Any,
    sizes: Sequence[int] = (),
    reps: int = 7,
    leads: Sequence[int] = (1, 5, 10),
    chain: int = 5,
) -> dict[str, Any]:
    """Collective over grid. Time the solver and the surrogate per surrogate step at the config's size and
    at each square size of ``sizes``; roll out to the largest of ``leads`` at the config's size.

    Each size is timed two ways, interleaved: one surrogate step alone (the solver's step, then one
    prediction, each right after the other's: caches hold the other's data), and ``chain`` steps in a row
    (the solver ``chain`` surrogate steps, the surrogate ``chain`` predictions each fed the last one's
    output, as in a rollout: each in its steady state), per step.

    Parameters
    ----------
    cfg : dict
        The config.
    data : str
        The snapshot file (the start state; the rollout's truth).
    checkpoint : str or None
        Trained weights, or None for the untrained model.
    grid : ProcessGrid
        2-D.
    log : logger
    sizes : sequence of int
        Extra square field sizes.
    reps : int
        Timed repeats (after one warm-up).
    leads : sequence of int
        Rollout leads reported (the rollout runs to the largest the data allows).
    chain : int
        Steps in a row of the second timing.

    Returns
    -------
    dict
        ``rows`` (per size: ``size``, ``solver_s``, ``surrogate_s``, ``speedup``, ``chain_solver_s``,
        ``chain_surrogate_s``, ``chain_speedup`` (seconds per step), ``solver_steps``, ``one_step_error``),
        ``rollout`` (a :class:`~apps.surrogate.rollout.Rollout` or None), ``leads``, ``what`` (the solver),
        ``reps``, ``chain``; the same on every rank.

    Raises
    ------
    ValueError
        If ``reps < 1``, ``chain < 1`` or a size cannot be made from the stored field (see :func:`resize_field`).
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if chain < 1:
        raise ValueError(f"chain must be >= 1, got {chain}")
    pde = str(cfg["simulation"].get("pde", "grayscott"))
    with h5py.File(data, "r") as f:  # every rank: one small snapshot, whole
        n = int(f[FIELDS].shape[0])
        start = _start_index(n, cfg)
        snapshot = np.asarray(f[FIELDS][start], dtype=np.float64)
    channels, h, w = snapshot.shape
    shapes = [(h, w)] + [(int(s), int(s)) for s in sizes if (int(s), int(s)) != (h, w)]
    rows: list[dict[str, Any]] = []
    what = ""
    native_model: torch.nn.Module | None = None
    for shape in shapes:
        field = resize_field(snapshot, shape, pde)
        model = build_model(cfg["surrogate"], channels, grid)
        if checkpoint is not None:
            load_checkpoint(checkpoint, model, None, grid)
        model.eval()
        dtype = next(model.parameters()).dtype
        x = _model_input(field, grid, dtype)
        solver = SolverStep(cfg, field, grid)
        what = solver.what
        with torch.no_grad():  # warm-up, and the error of one surrogate step against this solver's
            pred = model(x)
        solver.advance()
        truth = solver.current()
        err = float(relative_l2_error(pred.local[0].double(), torch.as_tensor(truth.local).double(), grid))
        t_solver, t_model, c_solver, c_model = [], [], [], []
        predict, predict_chain = _predictor(model, x), _predictor(model, x, chain)
        advance_chain = _advancer(solver, chain)
        predict_chain()  # (warm-up of the chain's later inputs)
        for _ in range(reps):
            t_solver.append(slowest_seconds(grid.comm, solver.advance))
            t_model.append(slowest_seconds(grid.comm, predict))
            c_solver.append(slowest_seconds(grid.comm, advance_chain) / chain)
            c_model.append(slowest_seconds(grid.comm, predict_chain) / chain)
        solver.close()
        a, b = statistics.median(t_solver), statistics.median(t_model)
        ca, cb = statistics.median(c_solver), statistics.median(c_model)
        rows.append(
            {
                "size": shape,
                "solver_s": a,
                "surrogate_s": b,
                "speedup": a / b,
                "chain_solver_s": ca,
                "chain_surrogate_s": cb,
                "chain_speedup": ca / cb,
                "solver_steps": float(np.mean(solver.taken[1:])),
                "one_step_error": err,
            }
        )
        log.info(
            "%dx%d: solver %.2f ms per surrogate step (%.0f steps), surrogate %.2f ms, speed-up %.1fx "
            "(%d in a row: %.2f ms vs %.2f ms per step, %.1fx)",
            shape[0], shape[1], 1e3 * a, rows[-1]["solver_steps"], 1e3 * b, a / b, chain, 1e3 * ca, 1e3 * cb, ca / cb,
        )  # fmt: skip
        if shape == (h, w):
            native_model = model
    roll: Rollout | None = None
    longest = max_rollout_steps(n, int(cfg["surrogate"]["horizon"]), float(cfg["train"]["holdout"]))
    steps = min(max(leads), longest) if leads else 0
    if native_model is not None and steps >= 1:
        roll = rollout(native_model, data, cfg, grid, steps, keep_frames=False)
    kept = [k for k in leads if k <= steps]
    return {"rows": rows, "rollout": roll, "leads": kept, "what": what, "reps": reps, "chain": chain}


def format_report(result: dict[str, Any], cfg: dict[str, Any], grid: hpctp.ProcessGrid, trained: bool) -> str:
    """Local. The report: the speed-up table and the rollout errors."""
    s = cfg["surrogate"]
    threads = torch.get_num_threads()
    lines = [
        f"surrogate speed-up: {result['what']}",
        f"{s['model']} surrogate ({'trained' if trained else 'untrained'} weights, {s['dtype']}), "
        f"{grid.size} rank(s) (grid {'x'.join(map(str, grid.dims))}), {threads} thread(s) per rank; medians of "
        f"{result['reps']} interleaved repeats after a warm-up, each timed on its slowest rank",
        "",
        f"| field | solver: one surrogate step | solver steps | surrogate: one prediction | speed-up | "
        f"{result['chain']} steps in a row, per step: solver | surrogate | speed-up | one-step error vs solver |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['size'][0]}x{r['size'][1]} | {1e3 * r['solver_s']:.2f} ms | {r['solver_steps']:.0f} | "
            f"{1e3 * r['surrogate_s']:.2f} ms | {r['speedup']:.1f}x | {1e3 * r['chain_solver_s']:.2f} ms | "
            f"{1e3 * r['chain_surrogate_s']:.2f} ms | {r['chain_speedup']:.1f}x | {r['one_step_error']:.4f} |"
        )
    roll = result["rollout"]
    if roll is not None:
        lines.append("")
        lines.append(roll.table(result["leads"]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Collective over COMM_WORLD. Measure and print the speed-up table."""
    p = argparse.ArgumentParser(prog="python -m apps.surrogate.speedup", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="TOML config (default: apps/configs/default.toml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--data", default=None, help="snapshot file (default: simulation.out)")
    p.add_argument("--checkpoint", default=None, help="default: train.out/checkpoint.h5")
    p.add_argument("--untrained", action="store_true", help="time the untrained model (no checkpoint needed)")
    p.add_argument("--sizes", type=int, nargs="*", default=[], help="extra square field sizes, e.g. 256")
    p.add_argument("--reps", type=int, default=7, help="timed repeats of each (after one warm-up)")
    p.add_argument("--leads", default="1,5,10", help="rollout leads to report (comma-separated)")
    p.add_argument("--chain", type=int, default=5, help="steps in a row of the second timing (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)

    from mpi4py import MPI

    from hpctp.cli.log import get_logger

    from ..common.config import load_config

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.set)
    grid = hpctp.ProcessGrid(cfg["simulation"]["grid"], comm=MPI.COMM_WORLD)
    log = get_logger("apps.surrogate.speedup", grid, args.verbose)
    data = args.data or cfg["simulation"]["out"]
    checkpoint = None if args.untrained else (args.checkpoint or str(Path(cfg["train"]["out"]) / "checkpoint.h5"))
    error = None
    if not Path(data).is_file():
        error = FileNotFoundError(f"{data} not found: run `python -m apps.simulate` with this config first")
    elif checkpoint is not None and not Path(checkpoint).is_file():
        error = FileNotFoundError(f"{checkpoint} not found: train first, or pass --untrained")
    hpctp.comm.raise_if_any(grid.comm, error)
    leads = [int(k) for k in args.leads.split(",") if k.strip()]
    result = measure(cfg, data, checkpoint, grid, log, args.sizes, args.reps, leads, args.chain)
    if grid.rank == 0:
        print(format_report(result, cfg, grid, checkpoint is not None), flush=True)
    grid.free()
    return 0 if all(math.isfinite(r["speedup"]) for r in result["rows"]) else 1


if __name__ == "__main__":
    from hpctp.cli.runner import run_main

    run_main(main)
