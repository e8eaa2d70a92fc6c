"""Distributed training: global MSE (+ its high-wavenumber part), summed gradients, Adam; rank-0 progress;
periodic checkpoints.

The training grid is data x spatial (x tensor) (:mod:`apps.surrogate.parallel`): each data group trains
on its share of every global batch, and :class:`hpctp.nn.ShardedDataParallel` sums the gradients over
the data and spatial axes (sharding optimizer state, gradients or parameters with ``train.zero``), so
the loss curve is one process's on any grid."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from tqdm import tqdm

import hpctp
from hpctp.io import FieldLoader, load_checkpoint, save_checkpoint
from hpctp.nn import (
    ParallelPlan,
    PipelineParallel,
    ShardedDataParallel,
    check_replicas,
    global_mse_loss,
    sync_gradients,
)

from .blocks import pointwise, set_delta_scale
from .data import open_pairs
from .models import build_model
from .parallel import TrainingSetup, autocast, checkpoint_layers, memory_line, training_setup
from .spectrum import high_band_loss

__all__ = ["train", "train_step", "pipeline_step", "make_optimizer", "fit_delta_scale"]


def make_optimizer(model: torch.nn.Module, cfg: dict[str, Any]) -> torch.optim.Optimizer:
    """Local. Adam with the configured learning rate (over the shards a ShardedDataParallel owns)."""
    return torch.optim.Adam(model.parameters(), lr=float(cfg["train"]["lr"]))


def _mib(params: Any, whole: bool = False) -> float:
    """Local. MiB of ``params`` (``whole``: their shapes' sizes, storage or not)."""
    return sum(p.numel() * p.element_size() if whole else p.untyped_storage().nbytes() for p in params) / 2**20


def fit_delta_scale(model: torch.nn.Module, pairs: Any, grid: hpctp.ProcessGrid) -> float:
    """Collective over grid. Set the model's ``delta_scale`` to the RMS of ``target - input`` over all pairs.

    Each rank sums its blocks; one all-reduce gives the global value (the same on any grid).
    """
    sums = np.zeros(2)
    for i in range(len(pairs)):
        x, y = pairs.read_batch([i])
        d = (torch.as_tensor(y.local) - torch.as_tensor(x.local)).double()
        sums += [float((d * d).sum()), d.numel()]
    hpctp.comm.allreduce(grid.comm, sums, "sum")
    scale = float(np.sqrt(sums[0] / max(sums[1], 1.0))) or 1.0
    set_delta_scale(model, scale)
    return scale


def _as(x: hpctp.DistTensor, dtype: torch.dtype) -> hpctp.DistTensor:
    return pointwise(lambda t: t.to(dtype), x)


def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: hpctp.DistTensor,
    y: hpctp.DistTensor,
    grid: hpctp.ProcessGrid | ParallelPlan,
    spectral_weight: float = 0.0,
    *,
    share: float = 1.0,
    setup: TrainingSetup | None = None,
) -> float:
    """Collective over grid. One optimizer step on the global batch; returns the global loss:
    the MSE, plus ``spectral_weight`` times its high-wavenumber part (:func:`high_band_loss`).

    ``grid`` is a ProcessGrid whose axes all split the field (a replicated model), or a ParallelPlan
    (``x``, ``y``: this data group's share of the global batch, ``share`` of its samples; ``model``
    a :class:`hpctp.nn.ShardedDataParallel` or a model whose gradients the plan sums). ``setup``
    gives the precision (default float32)."""
    plan = grid if isinstance(grid, ParallelPlan) else None
    mgrid: hpctp.ProcessGrid = grid.model_grid if isinstance(grid, ParallelPlan) else grid
    loss_grid, loss_axes = (plan.grid, plan.loss_axes) if plan is not None else (mgrid, None)
    dtype = next(model.parameters()).dtype
    if isinstance(model, ShardedDataParallel):
        model.zero_grad(set_to_none=True)
    opt.zero_grad(set_to_none=True)
    with autocast(setup, x.local.device) if setup is not None else contextlib.nullcontext():
        pred = model(_as(x, dtype))
    target = y.local.to(dtype)
    loss = global_mse_loss(pred.local, target, loss_grid, loss_axes)
    shown = float(loss.detach())
    if spectral_weight:
        part = np.zeros(1)
        if share:  # (the same on every rank of a data group: an empty share has no band to compute)
            band = spectral_weight * share * high_band_loss(pred.local.to(dtype), target, mgrid, pred.layout)
            loss = loss + band
            part[0] = float(band.detach())
        if plan is not None:
            hpctp.comm.allreduce(plan.data_comm, part, "sum")
        shown += float(part[0])
    loss.backward()
    if isinstance(model, ShardedDataParallel):
        model.step(opt)
        return shown
    if plan is not None:
        plan.sync_gradients(model)
    else:
        sync_gradients(model, mgrid)
    opt.step()
    return shown


def pipeline_step(
    pipe: PipelineParallel, opt: torch.optim.Optimizer, x: hpctp.DistTensor, y: hpctp.DistTensor,
    setup: TrainingSetup | None = None,
) -> float:  # fmt: skip
    """Collective over ``pipe.plan.grid``. One optimizer step on the global batch through the pipeline's stages
    (``x``, ``y``: this data group's share, on every stage's ranks); returns the global MSE."""
    plan = pipe.plan
    dtype = next(pipe.parameters()).dtype

    def loss_fn(pred: hpctp.DistTensor, target: hpctp.DistTensor) -> torch.Tensor:
        return global_mse_loss(pred.local, target.local.to(dtype), plan.grid, plan.loss_axes)

    pipe.zero_grad(set_to_none=True)
    opt.zero_grad(set_to_none=True)
    with autocast(setup, x.local.device) if setup is not None else contextlib.nullcontext():
        return pipe.step(_as(x, dtype), y, loss_fn, optimizer=opt)


def _stages_line(pipe: PipelineParallel, busy: float, steps: int, measured: hpctp.PeakMemory) -> str:
    """Collective over grid. Each stage's layers, share of the compute time and measured peak memory (the
    slowest / largest rank of each pipeline coordinate)."""
    plan = pipe.plan
    table = hpctp.comm.allgather_ints(
        plan.grid.comm, [plan.pipeline_rank, int(1e6 * busy / max(steps, 1)), int(measured.peak)]
    )
    p = plan.pipeline_size
    per = [(table[table[:, 0] == r, 1].max() / 1e6, table[table[:, 0] == r, 2].max() / 2**20) for r in range(p)]
    total = sum(t for t, _ in per) or 1.0
    cuts = pipe.cuts
    rows = []
    for r, (t, mib) in enumerate(per):
        stages = pipe.schedule.stages_of(r)
        layers = ", ".join(",".join(pipe.layer_names[cuts[s] : cuts[s + 1]]) for s in stages)
        rows.append(f"rank {r} [{layers}]: {t:.3g} s/step ({t / total:.0%}), {mib:.0f} MiB")
    return "pipeline stages (compute per step, share, peak memory added): " + "; ".join(rows)


def train(
    cfg: dict[str, Any], data: str, out: str, grid: hpctp.ProcessGrid, log: Any, resume: bool = False,
    dry_run: bool = False,
) -> list[float]:  # fmt: skip
    """Collective over grid. Train on the snapshot file ``data``; write checkpoints and history to ``out``.

    With ``train.plan = "auto"`` the parallelism keys are first set to the plan :func:`hpctp.perf.plan` picks
    (logged with its predicted memory and time); ``dry_run`` stops there (nothing is read or trained).

    Returns
    -------
    list of float
        The loss of every step run in this call.
    """
    if TrainingSetup(cfg).plan == "auto":
        from .autoplan import apply, choose

        chosen, cuts, table = choose(cfg, grid, log)
        log.info("train.plan = auto on %d ranks: %s\n%s", grid.size, chosen.label(), table)
        cfg = apply(cfg, chosen, cuts)
    if dry_run:
        t = cfg["train"]
        pipe = (
            f"pipeline {t['pipeline']} ({t['schedule']}, {t['microbatches']} micro-batches), "
            if t.get("pipeline", 1) > 1
            else ""
        )
        log.info(
            "dry run: data %d, %sspatial %s, tensor %d, zero %d, checkpoint_activations %s; stopping before training",
            t.get("data", 1), pipe, cfg["simulation"]["grid"], t.get("tensor", 1), t.get("zero", 0),
            t.get("checkpoint_activations", False),
        )  # fmt: skip
        return []
    tcfg = cfg["train"]
    run = Path(out)
    ckpt = run / "checkpoint.h5"
    if grid.rank == 0:
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.json").write_text(json.dumps(cfg, indent=2))
    grid.comm.Barrier()
    setup, plan = training_setup(cfg, grid)
    log.info("training grid %s: %s, zero stage %d, %s", plan.grid.dims, plan, setup.zero, setup.precision)
    pairs = open_pairs(data, plan.model_grid, cfg, "train")
    channels = pairs.layout.global_shape[0]
    measured = hpctp.PeakMemory()
    measured.__enter__()  # (ended after the last step: construction, training and checkpoints)
    # the whole model never exists on a rank: built on meta, materialized a slice (stage 3) or a stage at a time
    meta = setup.zero == 3 or setup.pipelined
    seed = int(cfg["surrogate"]["seed"])
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = build_model(
            cfg["surrogate"], channels, plan.model_grid, tensor_axis=plan.tensor[0] if plan.tensor else None
        )
    whole = _mib(model.parameters(), whole=True)
    if setup.checkpoint_activations:
        log.info("activation checkpointing: %d layers recompute in backward", checkpoint_layers(model))
    wrapped: ShardedDataParallel | PipelineParallel
    if setup.pipelined:
        wrapped = PipelineParallel(
            cast(torch.nn.Sequential, model), plan, schedule=setup.schedule, microbatches=setup.microbatches, virtual=setup.virtual,
            zero=setup.zero or None, seed=seed, cuts=setup.cuts or None,
        )  # fmt: skip
        sched = wrapped.schedule
        how = (
            "as train.cuts gives"
            if setup.cuts
            else "by parameter count: "
            + "; ".join(f"stage {s}: {a}:{b} ({share:.0%})" for s, a, b, share, *_ in wrapped.balance)
        )
        log.info(
            "pipeline: %d stages on %d ranks (%s, %d micro-batches, bubble %.2f by the schedule's formula), cut at %s "
            "%s", sched.n_stages, sched.p, sched.name, sched.m, sched.simulate().bubble_fraction, list(wrapped.cuts), how,
        )  # fmt: skip
        log.info(
            "model built on the meta device: each rank materialized only its stages (%.3g of %.3g MiB of parameters "
            "here)", _mib(wrapped.parameters()), whole,
        )  # fmt: skip
    else:
        sdp = wrapped = ShardedDataParallel(model, plan, stage=setup.zero, seed=seed)
        if meta:
            log.info(
                "model built on the meta device: each rank materialized only its slices, %d units one at a time "
                "(%.3g of %.3g MiB of parameters here)", len(sdp.unit_names), _mib(sdp.parameters()), whole,
            )  # fmt: skip
    if not resume or not ckpt.exists():  # (buffers stay whole on every rank at any stage; the head's on its stage)
        scaled = wrapped if setup.pipelined else model
        log.info(
            "RMS change between paired snapshots: %.4g (output scale)", fit_delta_scale(scaled, pairs, plan.model_grid)
        )
    opt = make_optimizer(wrapped, cfg)
    loader = FieldLoader(pairs, int(tcfg["batch_size"]), shuffle=True, seed=int(cfg["surrogate"]["seed"]), plan=plan)
    per_epoch = len(loader)
    step = 0
    if resume and ckpt.exists():
        step = load_checkpoint(ckpt, wrapped, opt, plan.grid)
        log.info("resumed from %s at step %d (saved on any grid; now %s)", ckpt, step, plan.grid.dims)
    history: list[float] = []
    epochs = int(tcfg["epochs"])
    show = grid.rank == 0 and sys.stderr.isatty()
    weight = float(tcfg.get("spectral_weight", 0.0))
    busy, idle, timed = 0.0, 0.0, 0  # the pipeline's compute and measured bubble, summed over steps
    t0 = time.perf_counter()
    for epoch in range(step // per_epoch, epochs):
        loader.set_epoch(epoch)
        sizes = [len(b) for b in loader.batches(epoch)]
        losses = []
        skip = step - epoch * per_epoch  # batches already done in a resumed epoch
        batches = tqdm(loader, total=per_epoch, desc=f"epoch {epoch + 1}/{epochs}", disable=not show)
        for i, (x, y) in enumerate(batches):
            if i < skip:
                continue
            if isinstance(wrapped, PipelineParallel):
                losses.append(pipeline_step(wrapped, opt, x, y, setup))
                idle += wrapped.idle_fraction()
                busy += sum(e - s for _, s, e in wrapped.timeline[1:])
                timed += 1
            else:
                share = x.global_shape[0] / sizes[i]
                losses.append(train_step(wrapped, opt, x, y, plan, weight, share=share, setup=setup))
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
            save_checkpoint(ckpt, wrapped, opt, step, plan.grid)
            log.info("checkpoint %s (step %d)", ckpt, step)
            if setup.zero < 3 and not setup.pipelined:  # every rank of a data group's blocks: the same model
                drift = check_replicas(model, plan.model_grid)
                if drift:
                    log.warning("replicated parameters differ between ranks (name: ranks): %s", drift)
        if isinstance(wrapped, PipelineParallel) and timed:
            bubble = np.array([idle / timed])
            hpctp.comm.allreduce(plan.grid.comm, bubble, "sum")
            log.info(
                "pipeline bubble %.3f measured (idle share of a step, mean over %d steps and %d ranks)",
                bubble[0] / plan.grid.size, timed, plan.grid.size,
            )  # fmt: skip
    measured.__exit__(None, None, None)
    log.info(memory_line(plan.grid, measured))
    if isinstance(wrapped, PipelineParallel):
        log.info(_stages_line(wrapped, busy, timed, measured))
    if grid.rank == 0:
        with open(run / "history.csv", "a") as f:
            for v in history:
                f.write(f"{v!r}\n")
    pairs.close()
    plan.free()
    plan.grid.free()
    return history
