"""Distributed training: global MSE (+ its high-wavenumber part), summed gradients, Adam; rank-0 progress;
periodic checkpoints."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

import hpctp
from hpctp.io import FieldLoader, load_checkpoint, save_checkpoint
from hpctp.nn import check_replicas, global_mse_loss, sync_gradients

from .blocks import pointwise
from .data import open_pairs
from .models import build_model
from .spectrum import high_band_loss

__all__ = ["train", "train_step", "make_optimizer", "fit_delta_scale"]


def make_optimizer(model: torch.nn.Module, cfg: dict[str, Any]) -> torch.optim.Optimizer:
    """Local. Adam with the configured learning rate."""
    return torch.optim.Adam(model.parameters(), lr=float(cfg["train"]["lr"]))


def fit_delta_scale(model: torch.nn.Module, pairs: Any, grid: hpctp.ProcessGrid) -> float:
    """Collective over grid. Set ``model.delta_scale`` to the RMS of ``target - input`` over all pairs.

    Each rank sums its blocks; one all-reduce gives the global value (the same on any grid).
    """
    sums = np.zeros(2)
    for i in range(len(pairs)):
        x, y = pairs.read_batch([i])
        d = (torch.as_tensor(y.local) - torch.as_tensor(x.local)).double()
        sums += [float((d * d).sum()), d.numel()]
    hpctp.comm.allreduce(grid.comm, sums, "sum")
    scale = float(np.sqrt(sums[0] / max(sums[1], 1.0))) or 1.0
    with torch.no_grad():
        model.get_buffer("delta_scale").fill_(scale)
    return scale


def _as(x: hpctp.DistTensor, dtype: torch.dtype) -> hpctp.DistTensor:
    return pointwise(lambda t: t.to(dtype), x)


def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: hpctp.DistTensor,
    y: hpctp.DistTensor,
    grid: hpctp.ProcessGrid,
    spectral_weight: float = 0.0,
) -> float:
    """Collective over grid. One optimizer step on the global batch; returns the global loss:
    the MSE, plus ``spectral_weight`` times its high-wavenumber part (:func:`high_band_loss`)."""
    dtype = next(model.parameters()).dtype
    opt.zero_grad(set_to_none=True)
    pred = model(_as(x, dtype))
    loss = global_mse_loss(pred.local, y.local.to(dtype), grid)
    if spectral_weight:
        loss = loss + spectral_weight * high_band_loss(pred.local, y.local, grid, pred.layout)
    loss.backward()
    sync_gradients(model, grid)
    opt.step()
    return float(loss.detach())


def train(
    cfg: dict[str, Any], data: str, out: str, grid: hpctp.ProcessGrid, log: Any, resume: bool = False
) -> list[float]:
    """Collective over grid. Train on the snapshot file ``data``; write checkpoints and history to ``out``.

    Returns
    -------
    list of float
        The loss of every step run in this call.
    """
    tcfg = cfg["train"]
    run = Path(out)
    ckpt = run / "checkpoint.h5"
    if grid.rank == 0:
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.json").write_text(json.dumps(cfg, indent=2))
    grid.comm.Barrier()
    pairs = open_pairs(data, grid, cfg, "train")
    channels = pairs.layout.global_shape[0]
    model = build_model(cfg["surrogate"], channels, grid)
    opt = make_optimizer(model, cfg)
    loader = FieldLoader(pairs, int(tcfg["batch_size"]), shuffle=True, seed=int(cfg["surrogate"]["seed"]))
    per_epoch = math.ceil(len(pairs) / int(tcfg["batch_size"]))
    step = 0
    if resume and ckpt.exists():
        step = load_checkpoint(ckpt, model, opt, grid)
        log.info("resumed from %s at step %d (saved on any grid; now %s)", ckpt, step, grid.dims)
    else:
        log.info("RMS change between paired snapshots: %.4g (output scale)", fit_delta_scale(model, pairs, grid))
    history: list[float] = []
    epochs = int(tcfg["epochs"])
    show = grid.rank == 0 and sys.stderr.isatty()
    t0 = time.perf_counter()
    for epoch in range(step // per_epoch, epochs):
        loader.set_epoch(epoch)
        losses = []
        skip = step - epoch * per_epoch  # batches already done in a resumed epoch
        for i, (x, y) in enumerate(tqdm(loader, total=per_epoch, desc=f"epoch {epoch + 1}/{epochs}", disable=not show)):
            if i < skip:
                continue
            losses.append(train_step(model, opt, x, y, grid, float(tcfg.get("spectral_weight", 0.0))))
            step += 1
        history += losses
        log.info(
            "epoch %d/%d  loss %.4e  (%d steps, %.1f s)",
            epoch + 1,
            epochs,
            sum(losses) / max(len(losses), 1),
            step,
            time.perf_counter() - t0,
        )
        if (epoch + 1) % int(tcfg["checkpoint_every"]) == 0 or epoch + 1 == epochs:
            save_checkpoint(ckpt, model, opt, step, grid)
            log.info("checkpoint %s (step %d)", ckpt, step)
            drift = check_replicas(model, grid)  # every rank must still hold the same model
            if drift:
                log.warning("replicated parameters differ between ranks (name: ranks): %s", drift)
    if grid.rank == 0:
        with open(run / "history.csv", "a") as f:
            for v in history:
                f.write(f"{v!r}\n")
    pairs.close()
    return history
