"""hpctp's FNO on P ranks against the FNO of PyPI's ``neuraloperator`` in one process: the same data, the
same budget, in one run; held-out error ratio and time-per-epoch ratio.

Usage::

    mpiexec -n 2 python benchmarks/fno_vs_neuraloperator.py --config apps/configs/ns.toml
    mpiexec -n 2 python benchmarks/fno_vs_neuraloperator.py --config apps/configs/ns.toml --site build/neuralop

``neuraloperator`` comes from the ``compare`` extra (``pip install -e ".[compare]"``; it leaves the pinned torch
alone), or from a folder given by ``--site`` (e.g. ``pip install --no-deps --target build/neuralop
neuraloperator tensorly tensorly-torch opt_einsum scipy``: what importing its FNO needs, without wandb and the
rest of its training stack). Without it, the script says why and runs hpctp's side only.

Both train on the snapshot file of the config (``simulation.out``, made by ``python -m apps.simulate``), on
the same training pairs ``(x_t, x_{t+horizon})`` (:func:`apps.surrogate.data.split_indices`), with the
config's budget: ``train.epochs`` epochs of ``train.batch_size``, Adam at ``train.lr``, MSE loss, float32.
Both predict ``x + s * f(x)`` with ``s`` the RMS change between paired snapshots over the training pairs
(:func:`apps.surrogate.train.fit_delta_scale`), so the two differ only in ``f``:

* hpctp: :class:`apps.surrogate.models.FNO` trained by ``apps.surrogate.train`` on P ranks (1 thread each),
  the field split over a 2-D grid;
* neuraloperator: ``neuralop.models.FNO`` with the same width, depth and kept modes (``n_modes = (2 m, 2 m - 1)``
  keeps frequencies ``-m..m-1`` along x and ``0..m-1`` along y, as hpctp's ``modes = m``), no positional
  embedding and no channel MLP (as hpctp's), a one-layer lifting; its projection is its two-layer MLP
  (``projection_channel_ratio``, default 2) where hpctp has one 1x1 conv, and it skips the activation after the
  last Fourier layer. Trained in one process on rank 0 with ``--threads`` torch threads (default P) while the
  other ranks sleep.

Time per epoch is the wall time of the whole training (scale fit included, and for hpctp one checkpoint at the
end) over the epochs; CPU time per epoch adds up the CPU seconds of all processes (and threads), which other
jobs on a shared machine distort less than the wall time. The error is the held-out one-step relative L2 error, per pair, averaged
(:func:`apps.surrogate.evaluate.evaluate`'s metric), and the rollout error at ``--lead`` steps
(:mod:`apps.surrogate.rollout`'s).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the apps live beside the package, not in it
    sys.path.insert(0, str(ROOT))

from apps.common.config import load_config  # noqa: E402
from apps.surrogate.data import FIELDS, split_indices  # noqa: E402
from apps.surrogate.evaluate import evaluate, load_model  # noqa: E402
from apps.surrogate.rollout import rollout, rollout_starts  # noqa: E402
from apps.surrogate.train import train  # noqa: E402


class Residual(torch.nn.Module):
    """``x + s * net(x)``, the output form of hpctp's surrogates."""

    def __init__(self, net: torch.nn.Module, scale: float) -> None:
        super().__init__()
        self.net = net
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.net(x)


def neuralop_fno(cfg: dict[str, Any], channels: int) -> torch.nn.Module:
    """neuraloperator's FNO configured as hpctp's (see the module docstring)."""
    from neuralop.models import FNO

    s = cfg["surrogate"]
    m = int(s["modes"])
    return FNO(
        n_modes=(2 * m, 2 * m - 1),
        in_channels=channels,
        out_channels=channels,
        hidden_channels=int(s["width"]),
        n_layers=int(s["depth"]),
        lifting_channel_ratio=0,
        positional_embedding=None,
        use_channel_mlp=False,
        fno_skip="linear",
    )


def real_parameters(model: torch.nn.Module) -> int:
    """Real numbers in the parameters (a complex weight counts twice, as hpctp stores it: real and imaginary)."""
    return sum(p.numel() * (2 if p.is_complex() else 1) for p in model.parameters())


def _rel(pred: torch.Tensor, truth: torch.Tensor) -> np.ndarray:
    """Per-sample relative L2 error, float64."""
    p, t = pred.double().flatten(1), truth.double().flatten(1)
    return (torch.linalg.vector_norm(p - t, dim=1) / torch.linalg.vector_norm(t, dim=1)).numpy()


def reference(cfg: dict[str, Any], data: str, threads: int, lead: int) -> dict[str, Any]:
    """Train and evaluate neuraloperator's FNO in this process; the result row."""
    torch.set_num_threads(threads)
    t = cfg["train"]
    horizon = int(cfg["surrogate"]["horizon"])
    with h5py.File(data, "r") as f:
        snaps = torch.from_numpy(np.asarray(f[FIELDS], dtype=np.float32))
    train_idx, held = split_indices(snaps.shape[0], horizon, float(t["holdout"]))
    x, y = snaps[train_idx], snaps[[i + horizon for i in train_idx]]
    torch.manual_seed(int(cfg["surrogate"]["seed"]))
    t0, c0 = time.perf_counter(), time.process_time()
    scale = float((y - x).double().square().mean().sqrt())
    model = Residual(neuralop_fno(cfg, snaps.shape[1]), scale)
    opt = torch.optim.Adam(model.parameters(), lr=float(t["lr"]))
    gen = torch.Generator().manual_seed(int(cfg["surrogate"]["seed"]))
    batch, epochs = int(t["batch_size"]), int(t["epochs"])
    losses = []
    for _ in range(epochs):
        order = torch.randperm(len(train_idx), generator=gen)
        for b in range(0, len(order), batch):
            sel = order[b : b + batch]
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x[sel]), y[sel])
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    model.eval()
    with torch.no_grad():
        xe, ye = snaps[held], snaps[[i + horizon for i in held]]
        err = float(np.mean(_rel(model(xe), ye)))
        persistence = float(np.mean(_rel(xe, ye)))
        starts = rollout_starts(snaps.shape[0], horizon, float(t["holdout"]), lead)
        state = snaps[starts]
        for _ in range(lead):
            state = model(state)
        roll = float(np.mean(_rel(state, snaps[[s + lead * horizon for s in starts]])))
    return {
        "error": err,
        "persistence": persistence,
        "rollout": roll,
        "epoch_s": seconds / epochs,
        "epoch_cpu_s": cpu / epochs,
        "params": real_parameters(model),
        "loss": (losses[0], losses[-1]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "apps" / "configs" / "ns.toml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--data", default=None, help="snapshot file (default: simulation.out)")
    p.add_argument("--out", default="out/compare/hpctp", help="hpctp's run directory")
    p.add_argument("--site", default=None, help="folder holding neuraloperator (prepended to sys.path)")
    p.add_argument("--threads", type=int, default=0, help="torch threads of the one process (default: P)")
    p.add_argument("--lead", type=int, default=10, help="rollout lead compared")
    p.add_argument("--rounds", type=int, default=1, help="train both this many times, alternating (median times)")
    args = p.parse_args()

    from mpi4py import MPI

    import hpctp
    from hpctp.cli.log import get_logger

    cfg = load_config(args.config, args.set)
    cfg["train"]["checkpoint_every"] = int(cfg["train"]["epochs"])  # one checkpoint, at the end
    grid = hpctp.ProcessGrid(cfg["simulation"]["grid"], comm=MPI.COMM_WORLD)
    log = get_logger("fno_vs_neuraloperator", grid)
    data = args.data or cfg["simulation"]["out"]
    error = (
        None if Path(data).is_file() else FileNotFoundError(f"{data} not found: run `python -m apps.simulate` first")
    )
    hpctp.comm.raise_if_any(grid.comm, error)
    if args.site:
        sys.path.insert(0, str(Path(args.site).resolve()))
    s = cfg["surrogate"]
    if s["model"] != "fno" or s["dtype"] != "float32":
        raise ValueError(f"this comparison is of float32 FNOs; the config has {s['model']!r}, {s['dtype']!r}")

    ref: dict[str, Any] | None = None
    why = ""
    ref_times: list[tuple[float, float]] = []
    times: list[tuple[float, float]] = []
    for _ in range(max(args.rounds, 1)):  # alternating, so that both see the same load from other jobs
        if grid.rank == 0 and not why:  # one process; the other ranks sleep rather than spin
            try:
                import neuralop

                log.info("neuraloperator %s from %s", neuralop.__version__, Path(neuralop.__file__).parent)
                ref = reference(cfg, data, args.threads or grid.size, args.lead)
                ref_times.append((ref["epoch_s"], ref["epoch_cpu_s"]))
            except ImportError as e:
                why = f"neuraloperator does not import ({e}); install the compare extra or pass --site"
        req = grid.comm.Ibarrier()
        while not req.Test():
            time.sleep(0.05)

        torch.set_num_threads(1)
        grid.comm.Barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        losses = train(cfg, data, args.out, grid, log)
        seconds = time.perf_counter() - t0
        cpu = np.array([time.process_time() - c0])
        hpctp.comm.allreduce(grid.comm, cpu, "sum")  # CPU seconds of all ranks
        times.append((seconds, float(cpu[0])))
    ckpt = str(Path(args.out) / "checkpoint.h5")
    result = evaluate(cfg, data, ckpt, grid, log, plot=None)
    with h5py.File(data, "r") as f:
        channels = int(f[FIELDS].shape[1])
    model = load_model(cfg, ckpt, channels, grid)
    roll = rollout(model, data, cfg, grid, args.lead, keep_frames=False)
    params = real_parameters(model)
    if grid.rank != 0:
        return 0
    epochs = int(cfg["train"]["epochs"])
    mine: dict[str, Any] = {
        "error": result["surrogate"],
        "persistence": result["persistence"],
        "rollout": float(roll.surrogate[-1]),
        "epoch_s": statistics.median(t[0] for t in times) / epochs,
        "epoch_cpu_s": statistics.median(t[1] for t in times) / epochs,
        "params": params,
        "loss": (losses[0], losses[-1]),
    }
    if ref is not None:
        ref["epoch_s"] = statistics.median(t[0] for t in ref_times)
        ref["epoch_cpu_s"] = statistics.median(t[1] for t in ref_times)
    t = cfg["train"]
    print(
        f"FNO (width {s['width']}, depth {s['depth']}, modes {s['modes']}) on {data}: {len(roll.starts)} rollout starts, "
        f"{int(result['pairs'])} held-out pairs; budget {epochs} epochs, batch {t['batch_size']}, Adam lr {t['lr']}, "
        f"MSE, float32; times: medians of {len(times)} alternating round(s)\n"
    )
    print(
        f"| implementation | processes x threads | parameters | time / epoch | CPU time / epoch | held-out rel. L2 "
        f"| rollout lead {args.lead} |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    rows = [("hpctp", f"{grid.size} x 1", mine)]
    if ref is not None:
        rows.append(("neuraloperator", f"1 x {args.threads or grid.size}", ref))
    for name, procs, r in rows:
        print(
            f"| {name} | {procs} | {r['params']:,} | {r['epoch_s']:.2f} s | {r['epoch_cpu_s']:.2f} s | {r['error']:.4f} "
            f"| {r['rollout']:.4f} |"
        )
    print(f"| persistence | | | | | {mine['persistence']:.4f} | {float(roll.persistence[-1]):.4f} |")
    if ref is not None:
        print(
            f"\nratio hpctp / neuraloperator: held-out error {mine['error'] / ref['error']:.2f}, "
            f"rollout error {mine['rollout'] / ref['rollout']:.2f}, time per epoch {mine['epoch_s'] / ref['epoch_s']:.2f} "
            f"(CPU time {mine['epoch_cpu_s'] / ref['epoch_cpu_s']:.2f})"
        )
        print(
            f"training loss: hpctp {mine['loss'][0]:.3e} -> {mine['loss'][1]:.3e}, "
            f"neuraloperator {ref['loss'][0]:.3e} -> {ref['loss'][1]:.3e}"
        )
    else:
        print(f"\nno comparison: {why}")
    return 0 if math.isfinite(mine["error"]) else 1


if __name__ == "__main__":
    from hpctp.cli.runner import run_main

    run_main(main)
