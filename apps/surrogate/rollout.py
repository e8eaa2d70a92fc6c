"""Rollouts: the surrogate fed its own predictions, error against lead time.

From each held-out initial state (an evaluation pair's input, :func:`apps.surrogate.data.split_indices`, whose
trajectory has ``N`` more snapshots at the model's ``horizon``), the model is applied ``N`` times, each time to
its own previous output (no grad), and compared with the stored snapshot at every lead time ``k = 1..N``
(``k * horizon`` snapshots later). The error is the relative L2 error of the whole distributed field, per
initial state, averaged over the initial states (the metric of :func:`apps.surrogate.evaluate.evaluate`),
computed in float64 with all-reduced sums, so it is the same on any rank count. Persistence (predicting
the initial state at every lead) is the baseline.

The initial states are held out; the later truths along the one stored trajectory may be training inputs
(the split interleaves pairs in time), as in any rollout on a single trajectory.

``python -m apps.surrogate evaluate --rollout N`` writes ``RUNDIR/rollout.csv`` (``lead,surrogate,persistence``)
and ``RUNDIR/rollout.png`` (error against lead time; truth, prediction and error fields at a few leads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

import hpctp
from hpctp.io import FieldDataset
from hpctp.nn import relative_l2_error

from .blocks import pointwise
from .data import FIELDS, SPLIT, split_indices
from .evaluate import load_model

__all__ = [
    "Rollout",
    "rollout_starts",
    "max_rollout_steps",
    "longest_rollout",
    "rollout",
    "run_rollout",
    "write_rollout_csv",
    "write_rollout_plot",
]


@dataclass
class Rollout:
    """Local. The errors of a rollout, the same on every rank.

    Attributes
    ----------
    surrogate, persistence : numpy.ndarray
        ``[N]``: mean relative L2 error at lead ``k = 1..N`` of the model and of persistence.
    starts : list of int
        Snapshot indices of the initial states.
    horizon : int
        Snapshots per surrogate step.
    frames : list
        ``(lead, truth, prediction)`` of the first initial state at the leads shown in the plot
        (``[1, C, H, W]`` DistTensors).
    """

    surrogate: np.ndarray
    persistence: np.ndarray
    starts: list[int]
    horizon: int
    frames: list[tuple[int, hpctp.DistTensor, hpctp.DistTensor]] = field(default_factory=list)

    @property
    def leads(self) -> np.ndarray:
        """Local. ``1..N``."""
        return np.arange(1, self.surrogate.size + 1)

    def at(self, lead: int) -> tuple[float, float]:
        """Local. ``(surrogate, persistence)`` error at ``lead`` (1-based)."""
        return float(self.surrogate[lead - 1]), float(self.persistence[lead - 1])

    def table(self, leads: list[int] | None = None) -> str:
        """Local. One line per lead (all leads by default): lead, surrogate and persistence error."""
        rows = [f"rollout from {len(self.starts)} held-out initial states (relative L2 error, mean over them):"]
        rows.append(f"  {'lead':>4}  {'snapshots':>9}  {'surrogate':>9}  {'persistence':>11}")
        for k in leads if leads is not None else self.leads.tolist():
            if 1 <= k <= self.surrogate.size:
                m, p = self.at(k)
                rows.append(f"  {k:>4}  {k * self.horizon:>9}  {m:>9.4f}  {p:>11.4f}")
        return "\n".join(rows)


def max_rollout_steps(n_snapshots: int, horizon: int, holdout: float) -> int:
    """Local. The longest rollout some held-out initial state has truth for (0 if none)."""
    _, held = split_indices(n_snapshots, horizon, holdout)
    return max(0, (n_snapshots - 1 - held[0]) // horizon)


def longest_rollout(data: str | Path, cfg: dict[str, Any]) -> int:
    """Local. :func:`max_rollout_steps` of the snapshot file ``data`` under the config's horizon and holdout."""
    with h5py.File(data, "r") as f:
        n = int(f[FIELDS].shape[0])
    return max_rollout_steps(n, int(cfg["surrogate"]["horizon"]), float(cfg["train"]["holdout"]))


def rollout_starts(n_snapshots: int, horizon: int, holdout: float, steps: int) -> list[int]:
    """Local. Snapshot indices of the held-out initial states with ``steps`` more snapshots at ``horizon``.

    Raises
    ------
    ValueError
        If ``steps < 1``, or no held-out initial state has ``steps * horizon`` more snapshots (the message
        gives the longest rollout the data allows).
    """
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"a rollout needs steps >= 1 (an int), got {steps!r}")
    _, held = split_indices(n_snapshots, horizon, holdout)
    starts = [i for i in held if i + steps * horizon <= n_snapshots - 1]
    if not starts:
        raise ValueError(
            f"no held-out initial state has {steps} more steps of {horizon} snapshot(s) among {n_snapshots} snapshots; "
            f"the longest rollout this data allows is {max_rollout_steps(n_snapshots, horizon, holdout)} "
            "(simulate more snapshots, or ask for fewer steps)"
        )
    return starts


def _first(x: hpctp.DistTensor) -> hpctp.DistTensor:
    """Local. Sample 0 of a batch whose dim 0 is not split (no communication)."""
    lay = x.layout
    layout = hpctp.Layout((1, *lay.global_shape[1:]), lay.grid_dims, lay.split, (None, *lay.cuts[1:]))
    return hpctp.DistTensor(x.local[:1].clone(), x.grid, layout)


def _shown_leads(steps: int) -> list[int]:
    return sorted({1, (steps + 1) // 2, steps})


def rollout(
    model: torch.nn.Module,
    data: str,
    cfg: dict[str, Any],
    grid: hpctp.ProcessGrid,
    steps: int,
    *,
    batch: int = 8,
    keep_frames: bool = True,
) -> Rollout:
    """Collective over grid. Roll ``model`` out ``steps`` times from every held-out initial state of ``data``.

    Parameters
    ----------
    model : torch.nn.Module
        A surrogate on ``grid`` (``[B, C, H, W]`` DistTensors in, the same layout out).
    data : str
        The snapshot file (dataset ``fields``, ``[T, C, H, W]``).
    cfg : dict
        The config (``surrogate.horizon``, ``train.holdout``).
    grid : ProcessGrid
        The model's grid (2-D: H over axis 0, W over axis 1).
    steps : int
        ``N``: surrogate steps, each ``horizon`` snapshots.
    batch : int
        Initial states rolled out together.
    keep_frames : bool
        Keep the first initial state's truth and prediction at leads ``1, ceil(N / 2), N`` for the plot.

    Returns
    -------
    Rollout

    Raises
    ------
    ValueError
        If the data has no held-out initial state with ``N`` more steps (on every rank: all read the same file).
    """
    horizon = int(cfg["surrogate"]["horizon"])
    dtype = next(model.parameters()).dtype
    shown = _shown_leads(steps) if keep_frames else []
    with FieldDataset(data, FIELDS, grid, SPLIT, targets=None, like="torch") as snaps:
        starts = rollout_starts(len(snaps), horizon, float(cfg["train"]["holdout"]), steps)
        sums = np.zeros((2, steps))
        frames: list[tuple[int, hpctp.DistTensor, hpctp.DistTensor]] = []
        for c in range(0, len(starts), max(int(batch), 1)):
            chunk = starts[c : c + max(int(batch), 1)]
            x0, _ = snaps.read_batch(chunk)
            state = pointwise(lambda t: t.to(dtype), x0)
            first = x0.local.double()
            for k in range(1, steps + 1):
                with torch.no_grad():
                    state = model(state)
                truth, _ = snaps.read_batch([s + k * horizon for s in chunk])
                t64 = truth.local.double()
                err = relative_l2_error(state.local.double(), t64, grid, per_sample=True)
                base = relative_l2_error(first, t64, grid, per_sample=True)
                sums[:, k - 1] += len(chunk) * np.array([float(err), float(base)])
                if c == 0 and k in shown:
                    frames.append((k, _first(truth), _first(state)))
    mean = sums / len(starts)
    return Rollout(mean[0], mean[1], starts, horizon, frames)


def write_rollout_csv(path: str | Path, result: Rollout, grid: hpctp.ProcessGrid) -> None:
    """Collective over grid. Rank 0 writes ``lead,surrogate,persistence`` (one row per lead)."""
    if grid.rank == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        lines = ["lead,surrogate,persistence"]
        rows = zip(result.leads.tolist(), result.surrogate.tolist(), result.persistence.tolist())
        lines += [f"{k},{m!r},{p!r}" for k, m, p in rows]
        Path(path).write_text("\n".join(lines) + "\n")
    grid.comm.Barrier()


def write_rollout_plot(path: str | Path, result: Rollout, grid: hpctp.ProcessGrid) -> None:
    """Collective over grid. Rank 0 writes a PNG: error against lead time (surrogate and persistence),
    then for each kept lead the truth, the prediction and their difference (the last channel)."""
    gathered = [(k, t.gather(root=0), p.gather(root=0)) for k, t, p in result.frames]
    if grid.rank != 0:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = 1 + len(gathered)
    fig = plt.figure(figsize=(13, 3.6 * rows), constrained_layout=True)
    spec = fig.add_gridspec(rows, 3)
    ax = fig.add_subplot(spec[0, :])
    ax.plot(result.leads, result.surrogate, "o-", label="surrogate (its own outputs fed back)")
    ax.plot(result.leads, result.persistence, "s--", label="persistence (no change)")
    ax.set_xlabel(f"lead time (surrogate steps of {result.horizon} snapshot(s))")
    ax.set_ylabel("relative L2 error")
    ax.set_title(f"rollout error against lead time, mean over {len(result.starts)} held-out initial states")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend()
    for r, (k, truth, pred) in enumerate(gathered, start=1):
        if truth is None or pred is None:
            continue
        t = truth[0, -1].double().numpy()
        p = pred[0, -1].detach().double().numpy()
        lo, hi = float(min(t.min(), p.min())), float(max(t.max(), p.max()))
        lim = float(np.abs(p - t).max()) or 1.0
        for col, (img, title, cmap, vmin, vmax) in enumerate(
            [
                (t, f"simulation, lead {k}", "viridis", lo, hi),
                (p, f"surrogate, lead {k}", "viridis", lo, hi),
                (p - t, f"error, lead {k}", "RdBu_r", -lim, lim),
            ]
        ):
            a = fig.add_subplot(spec[r, col])
            im = a.imshow(img, cmap=cmap, vmin=vmin, vmax=vmax)
            a.set_title(title)
            a.axis("off")
            fig.colorbar(im, ax=a, shrink=0.8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run_rollout(
    cfg: dict[str, Any],
    data: str,
    checkpoint: str,
    grid: hpctp.ProcessGrid,
    log: Any,
    steps: int,
    out_dir: str | Path | None = None,
) -> Rollout:
    """Collective over grid. Load the checkpoint, roll out ``steps`` steps, log the errors, and write
    ``out_dir/rollout.csv`` and ``out_dir/rollout.png`` (default: the checkpoint's directory).

    Raises
    ------
    ValueError
        If the data is too short for ``steps`` (see :func:`rollout_starts`).
    """
    with FieldDataset(data, FIELDS, grid, SPLIT, targets=None) as probe:
        channels = probe.layout.global_shape[0]
    model = load_model(cfg, checkpoint, channels, grid)
    result = rollout(model, data, cfg, grid, steps)
    run = Path(out_dir) if out_dir is not None else Path(checkpoint).parent
    write_rollout_csv(run / "rollout.csv", result, grid)
    write_rollout_plot(run / "rollout.png", result, grid)
    for line in result.table().splitlines():
        log.info("%s", line)
    log.info("rollout errors written to %s, plot %s", run / "rollout.csv", run / "rollout.png")
    return result
