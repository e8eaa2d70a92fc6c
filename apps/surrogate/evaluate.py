"""Held-out evaluation: relative L2 error of the surrogate vs the simulation, and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

import hpctp
from hpctp.io import load_checkpoint
from hpctp.nn import relative_l2_error

from .blocks import pointwise, with_local
from .data import open_pairs
from .fronts import gradient_error
from .models import build_model
from .spectrum import band_errors

__all__ = ["load_model", "evaluate"]


def load_model(cfg: dict[str, Any], checkpoint: str, channels: int, grid: hpctp.ProcessGrid) -> torch.nn.Module:
    """Collective over grid. The configured model with the checkpoint's weights (any saving grid)."""
    model = build_model(cfg["surrogate"], channels, grid)
    load_checkpoint(checkpoint, model, None, grid)
    model.eval()
    return model


def evaluate(
    cfg: dict[str, Any], data: str, checkpoint: str, grid: hpctp.ProcessGrid, log: Any, plot: str | None = None
) -> dict[str, float]:
    """Collective over grid. Mean per-sample relative L2 error on the held-out pairs.

    Returns
    -------
    dict
        ``surrogate`` (model error), ``persistence`` (error of predicting no change),
        ``pairs`` (count) and ``surrogate_low_k``/``surrogate_high_k`` (the parts of the model's error from
        the low and high wavenumber band, :func:`apps.surrogate.spectrum.band_errors`) and
        ``surrogate_gradient`` (the relative error of its gradient,
        :func:`apps.surrogate.fronts.gradient_error`); the same on every rank.
    """
    pairs = open_pairs(data, grid, cfg, "eval")
    model = load_model(cfg, checkpoint, pairs.layout.global_shape[0], grid)
    dtype = next(model.parameters()).dtype
    err_model, err_persist, shown = [], [], None
    err_bands: list[tuple[float, float]] = []
    err_grad: list[float] = []
    with torch.no_grad():
        for i in range(len(pairs)):
            x, y = pairs.read_batch([i])
            if y is None:
                raise RuntimeError(f"{data}: evaluation pairs have no targets")
            xin = pointwise(lambda t: t.to(dtype), x)
            pred = model(xin)
            yt = y.local.to(dtype)
            err_model.append(float(relative_l2_error(pred.local, yt, grid)))
            err_persist.append(float(relative_l2_error(xin.local, yt, grid)))
            err_bands.append(band_errors(pred, with_local(y, yt)))
            err_grad.append(gradient_error(pred, with_local(y, yt)))
            if i == len(pairs) - 1:
                shown = (x, y, pred)
    pairs.close()
    result = {
        "surrogate": float(np.mean(err_model)),
        "persistence": float(np.mean(err_persist)),
        "pairs": float(len(err_model)),
        "surrogate_low_k": float(np.mean([b[0] for b in err_bands])),
        "surrogate_high_k": float(np.mean([b[1] for b in err_bands])),
        "surrogate_gradient": float(np.mean(err_grad)),
    }
    log.info(
        "held-out relative L2 error: surrogate %.4f, persistence baseline %.4f (%d pairs)",
        result["surrogate"], result["persistence"], len(err_model),
    )  # fmt: skip
    log.info(
        "its share by wavenumber (hpctp.fft): %.4f from |k| <= k_max/2, %.4f from above (squares add up)",
        result["surrogate_low_k"], result["surrogate_high_k"],
    )  # fmt: skip
    log.info(
        "relative L2 error of its gradient (fronts; np.roll on the distributed fields): %.4f",
        result["surrogate_gradient"],
    )
    if plot and shown is not None:
        write_plot(plot, *shown, grid)
        log.info("plot written to %s", plot)
    return result


def write_plot(
    path: str, x: hpctp.DistTensor, y: hpctp.DistTensor, pred: hpctp.DistTensor, grid: hpctp.ProcessGrid
) -> None:
    """Collective over grid. Rank 0 writes a PNG of the last channel (Gray-Scott's v, Navier-Stokes'
    vorticity): truth, prediction, error, and the three's shell-binned power spectra
    (:func:`hpctp.fft.radial_spectrum`, computed distributed)."""
    err = hpctp.DistTensor(pred.local - y.local.to(pred.local.dtype), pred.grid, pred.layout)
    spectra = [hpctp.fft.radial_spectrum(t, axes=(2, 3))[0, -1] for t in (y, pred, err)]
    truth = y.gather(root=0)
    guess = pred.gather(root=0)
    if truth is None or guess is None:  # not rank 0
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = truth[0, -1].double().numpy()  # (the last channel: Gray-Scott's v, Navier-Stokes' vorticity)
    p = guess[0, -1].detach().double().numpy()
    fig, axes = plt.subplots(1, 4, figsize=(16, 4), constrained_layout=True)
    for ax, img, title, cmap in [
        (axes[0], t, "simulation v(t+k)", "viridis"),
        (axes[1], p, "surrogate v(t+k)", "viridis"),
        (axes[2], p - t, "error", "RdBu_r"),
    ]:
        lim = float(np.abs(img).max()) if cmap == "RdBu_r" else None
        im = ax.imshow(img, cmap=cmap, vmin=-lim if lim else None, vmax=lim)
        ax.set_title(title)
        ax.axis("off")
        fig.colorbar(im, ax=ax, shrink=0.8)
    k = np.arange(spectra[0].size)
    for spec, label in zip(spectra, ("simulation", "surrogate", "error")):
        axes[3].semilogy(k[1:], np.maximum(spec[1:], 1e-30), label=label)
    axes[3].set_xlabel("|k| (shell)")
    axes[3].set_title("power spectrum of v")
    axes[3].legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
