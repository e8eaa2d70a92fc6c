"""Online training: the surrogate trains on the snapshots of a running simulation, drawn from a replay
buffer in the trainer ranks' memory (:class:`hpctp.io.Stream`), with no file in between.

The trainer takes the ``[train]`` grid (data x spatial x tensor, :func:`apps.surrogate.parallel.training_setup`),
the model of ``[surrogate]`` and the training step of :mod:`apps.surrogate.train`. Its budget of optimizer
steps is that of offline training on the same snapshots (``train.epochs`` x the batches of an epoch of
the training pairs, unless ``online.steps`` says otherwise), spread evenly over the snapshots the
simulation is expected to produce (:class:`hpctp.io.TrainingSchedule`); the pairs kept aside (every
``round(1 / train.holdout)``-th, as offline) give the held-out error against persistence at the end.

Config keys (``[online]``, all optional; see ``apps/configs/default.toml``):

* ``placement``: ``"colocated"`` (every rank simulates and trains) or ``"separate"`` (``trainer_ranks``
  of the job's ranks train, the others simulate);
* ``trainer_ranks`` (separate; 0: half of the ranks), ``buffer_mib`` (replay capacity, MiB of the global
  field's pairs), ``eviction`` (``"reservoir"`` or ``"window"``), ``steps`` (0: the offline budget),
  ``ramp`` and ``tail`` (how the steps spread over the snapshots, :class:`hpctp.io.TrainingSchedule`:
  by default 2 and 0, steps in proportion to the pairs there are to draw from, none after the end),
  ``max_wait`` (seconds the simulation may wait for the trainer; ``inf``: never thin), ``depth``
  (snapshots in flight), ``checkpoint_every`` (steps; 0: ``train.checkpoint_every`` epochs' worth),
  ``stop_after`` (the simulation stops after that many snapshots; 0: all).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hpctp
from hpctp.io import Stream, StreamConfig, TrainingSchedule, save_checkpoint
from hpctp.io.replay import snapshots_for_pairs
from hpctp.nn import ParallelPlan, ShardedDataParallel, relative_l2_error

from .blocks import set_delta_scale
from .data import split_indices
from .models import build_model
from .parallel import TrainingSetup
from .train import make_optimizer, train_step

__all__ = [
    "ONLINE_DEFAULTS",
    "CapiTrainer",
    "capi_trainer",
    "OnlineTrainer",
    "expected_snapshots",
    "online_settings",
    "snapshot_shape",
    "step_budget",
    "stream_config",
]

ONLINE_DEFAULTS: dict[str, Any] = {
    "placement": "colocated",
    "trainer_ranks": 0,
    "buffer_mib": 256.0,
    "eviction": "reservoir",
    "steps": 0,
    "max_wait": 1.0,
    "depth": 4,
    "checkpoint_every": 0,
    "stop_after": 0,
    "ramp": 2.0,
    "tail": 0.0,
}
"""The ``[online]`` keys and their values when a config leaves them out."""

PLACEMENTS = ("colocated", "separate")


def online_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """Local. The ``[online]`` section with its defaults filled in.

    Raises
    ------
    ValueError
        On an unknown key or a bad value.
    """
    given = dict(cfg.get("online", {}))
    unknown = sorted(set(given) - set(ONLINE_DEFAULTS))
    if unknown:
        raise ValueError(f"[online] has unknown keys {unknown}; known: {sorted(ONLINE_DEFAULTS)}")
    on = {**ONLINE_DEFAULTS, **given}
    if on["placement"] not in PLACEMENTS:
        raise ValueError(f"online.placement must be one of {PLACEMENTS}, got {on['placement']!r}")
    for key in ("trainer_ranks", "steps", "checkpoint_every", "stop_after"):
        if not isinstance(on[key], int) or isinstance(on[key], bool) or on[key] < 0:
            raise ValueError(f"online.{key} must be an int >= 0, got {on[key]!r}")
    if not isinstance(on["depth"], int) or on["depth"] < 2:
        raise ValueError(
            f"online.depth must be an int >= 2 (a pair's input and target travel together), got {on['depth']!r}"
        )
    if not float(on["buffer_mib"]) > 0:
        raise ValueError(f"online.buffer_mib must be > 0, got {on['buffer_mib']!r}")
    if not float(on["ramp"]) >= 1.0:
        raise ValueError(f"online.ramp must be >= 1 (1: steps evenly over the snapshots), got {on['ramp']!r}")
    if not 0.0 <= float(on["tail"]) < 1.0:
        raise ValueError(f"online.tail must be a share of the steps in [0, 1), got {on['tail']!r}")
    if not float(on["max_wait"]) >= 0:
        raise ValueError(f"online.max_wait must be seconds >= 0 (inf: never thin), got {on['max_wait']!r}")
    return on


def expected_snapshots(sim: dict[str, Any]) -> int:
    """Local. The snapshots a ``[simulation]`` section produces (as :func:`apps.simulate.run.simulate`)."""
    if sim.get("pde", "grayscott") == "navier_stokes":
        return int(sim["snapshots"])
    return (int(sim["steps"]) - int(sim["warmup"])) // int(sim["snapshot_every"]) + 1


def snapshot_shape(sim: dict[str, Any]) -> tuple[int, int, int]:
    """Local. ``[C, H, W]`` of one snapshot: Gray-Scott's ``(u, v)``, Navier-Stokes' vorticity."""
    h, w = (int(s) for s in sim["size"])
    return (1 if sim.get("pde", "grayscott") == "navier_stokes" else 2), h, w


def _holdout_every(cfg: dict[str, Any]) -> int:
    return max(2, round(1 / float(cfg["train"]["holdout"])))


def step_budget(cfg: dict[str, Any]) -> int:
    """Local. ``online.steps``, or offline training's: ``train.epochs`` x the batches of an epoch of
    the training pairs of the expected snapshots (:func:`apps.surrogate.data.split_indices`)."""
    on = online_settings(cfg)
    if on["steps"]:
        return int(on["steps"])
    n = expected_snapshots(cfg["simulation"])
    train, _ = split_indices(n, int(cfg["surrogate"]["horizon"]), float(cfg["train"]["holdout"]))
    return int(cfg["train"]["epochs"]) * -(-len(train) // int(cfg["train"]["batch_size"]))


def stream_config(cfg: dict[str, Any]) -> StreamConfig:
    """Local. The :class:`hpctp.io.StreamConfig` of a config: pairs ``horizon`` snapshots apart, the
    held-out pairs of offline training kept aside (room for all of them), the ``[online]`` buffer."""
    on = online_settings(cfg)
    shape = snapshot_shape(cfg["simulation"])
    pair_bytes = 2 * math.prod(shape) * 8  # (the simulations' float64 fields)
    every = _holdout_every(cfg)
    n = expected_snapshots(cfg["simulation"])
    held = max(1, n // every + 1)
    return StreamConfig(
        horizon=int(cfg["surrogate"]["horizon"]),
        buffer_bytes=int(float(on["buffer_mib"]) * 2**20),
        eviction=str(on["eviction"]),
        batch_size=int(cfg["train"]["batch_size"]),
        holdout_every=every,
        holdout_bytes=held * pair_bytes,
        seed=int(cfg["surrogate"]["seed"]),
        max_wait=float(on["max_wait"]),
        depth=int(on["depth"]),
    )


class OnlineTrainer:
    """Collective over ``plan.grid``. The trainer's side of online training.

    Co-located: call :meth:`run_due` after every :meth:`hpctp.io.Stream.put` (it runs the steps whose
    snapshots are there, without waiting), then :meth:`finish`. Separate groups: :meth:`finish` alone
    (it waits for the snapshots each step needs).

    Parameters
    ----------
    cfg : dict
        The whole config (``[simulation]`` for the expected snapshots, ``[surrogate]``, ``[train]``,
        ``[online]``).
    stream : hpctp.io.Stream
        Built with ``train_grid=plan.grid`` and ``train_split=(None, *plan.spatial_axes)``.
    plan : ParallelPlan
    setup : TrainingSetup
    log : logging.Logger
    out : str
        Run directory: ``checkpoint.h5``, ``config.json``, ``history.csv``.
    """

    def __init__(
        self, cfg: dict[str, Any], stream: Stream, plan: ParallelPlan, setup: TrainingSetup, log: Any, out: str
    ) -> None:
        self.cfg, self.stream, self.plan, self.setup, self.log = cfg, stream, plan, setup, log
        self.out = Path(out)
        on = online_settings(cfg)
        scfg = stream.config
        n = expected_snapshots(cfg["simulation"])
        self.budget = step_budget(cfg)
        start = snapshots_for_pairs(scfg.batch_size, scfg.horizon, scfg.holdout_every)
        self.schedule = TrainingSchedule(self.budget, n, min(start, n), float(on["ramp"]), float(on["tail"]))
        batches = -(-len(split_indices(n, scfg.horizon, float(cfg["train"]["holdout"]))[0]) // scfg.batch_size)
        self.checkpoint_every = int(on["checkpoint_every"]) or max(1, batches * int(cfg["train"]["checkpoint_every"]))
        self.weight = float(cfg["train"].get("spectral_weight", 0.0))
        meta = setup.zero == 3  # (as offline training: the whole model never exists on a rank)
        with torch.device("meta") if meta else contextlib.nullcontext():
            self.model = build_model(
                cfg["surrogate"], stream.shape[0], plan.model_grid, tensor_axis=plan.tensor[0] if plan.tensor else None
            )
        self.wrapped = ShardedDataParallel(self.model, plan, stage=setup.zero, seed=int(cfg["surrogate"]["seed"]))
        self.opt = make_optimizer(self.wrapped, cfg)
        self.scaled = False  # delta_scale set from the first pairs
        self.step = 0
        self.history: list[float] = []
        self.busy = 0.0  # seconds in training steps
        self.t0 = time.perf_counter()
        self.t_steps_done = self.t0
        self.ckpt = self.out / "checkpoint.h5"
        if plan.grid.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.json").write_text(json.dumps(cfg, indent=2))
        plan.grid.comm.Barrier()
        layout = stream.layout
        self._batch_split = (None, None, *plan.spatial)
        self._batch_cuts = (None, None, *layout.dim_cuts[1:])
        log.info(
            "online trainer on %d ranks (grid %s, %s): %d steps over %d expected snapshots (first after %d), "
            "buffer of %d pairs (%s), checkpoint every %d steps",
            plan.grid.size, plan.grid.dims, plan, self.budget, n, self.schedule.start, stream.replay.capacity,
            scfg.eviction, self.checkpoint_every,
        )  # fmt: skip

    # ------------------------------------------------------------------ steps
    def _wrap(self, block: np.ndarray) -> hpctp.DistTensor:
        shape = (block.shape[0], *self.stream.shape)
        grid = self.plan.model_grid
        x = hpctp.DistTensor(
            torch.from_numpy(block), grid, hpctp.Layout(shape, grid.dims, self._batch_split, self._batch_cuts)
        )
        balanced = hpctp.Layout(shape, grid.dims, self._batch_split)
        return x if x.layout == balanced else x.redistribute(balanced)  # (the layers' own blocks)

    def _scale(self) -> None:
        """Collective over plan.grid. Before the first step: the output scale ``delta_scale`` from the
        pairs in the buffer then (offline training takes all pairs; buffers stay whole at any stage)."""
        scale = self.stream.pair_rms() or 1.0
        set_delta_scale(self.model, scale)
        self.scaled = True
        self.log.info("RMS change between paired snapshots in the buffer: %.4g (output scale)", scale)

    def _train_step(self) -> None:
        if not self.scaled:
            self._scale()
        t0 = time.perf_counter()
        slots = self.stream.draw(self.step)
        start, stop = self.plan.sample_range(len(slots))
        xb, yb = self.stream.batch(slots[start:stop])
        share = (stop - start) / len(slots)
        loss = train_step(
            self.wrapped,
            self.opt,
            self._wrap(xb),
            self._wrap(yb),
            self.plan,
            self.weight,
            share=share,
            setup=self.setup,
        )
        self.history.append(loss)
        self.step += 1
        self.busy += time.perf_counter() - t0
        if self.step % self.checkpoint_every == 0:
            self._save()

    def _advance(self, wait: bool) -> None:
        """Collective over plan.grid. Run every step whose snapshots have arrived (``wait``: waiting for
        them until the stream ends), then take in what the next step may already see."""
        stream = self.stream
        while self.step < self.budget:
            need = self.schedule.need(self.step)
            stream.ingest(until=need, wait=wait)
            if stream.produced < need:
                break  # not yet simulated (co-located), or the simulation stopped early
            if stream.pairs == 0:  # (thinning left no pair yet)
                if stream.ended or not wait:
                    break
                stream.ingest(until=stream.produced + 1, wait=wait)
                continue
            self._train_step()
        if self.step < self.budget:
            stream.ingest(until=self.schedule.need(self.step), wait=False)

    def run_due(self) -> None:
        """Collective over plan.grid. Co-located: run the steps that the snapshots put so far allow."""
        self._advance(wait=False)

    def _save(self) -> None:
        save_checkpoint(self.ckpt, self.wrapped, self.opt, self.step, self.plan.grid)

    # ------------------------------------------------------------------ the end
    def finish(self) -> dict[str, Any]:
        """Collective over plan.grid (and, through :meth:`hpctp.io.Stream.close`, the stream's ranks).
        Run the remaining steps the snapshots allow, write the checkpoint, close the stream, and
        evaluate on the held-out pairs.

        Returns
        -------
        dict
            ``surrogate`` and ``persistence`` (mean per-pair relative L2 error on the held-out pairs),
            ``held_out`` (their count), ``steps``, ``losses``, ``seconds``, ``busy`` (seconds in steps),
            ``utilization`` and the stream's ``stats``.
        """
        self._advance(wait=True)
        self.t_steps_done = time.perf_counter()
        self._save()
        if self.step < self.budget:
            self.log.warning(
                "the simulation stopped after %d of %d snapshots: %d of %d steps trained on what it produced",
                self.stream.produced, self.schedule.snapshots, self.step, self.budget,
            )  # fmt: skip
        self.stream.close()
        result = self._evaluate()
        seconds = self.t_steps_done - self.t0
        result.update(
            steps=self.step, losses=list(self.history), seconds=seconds, busy=self.busy,
            utilization=self.busy / seconds if seconds > 0 else 0.0, stats=self.stream.stats,
        )  # fmt: skip
        if self.plan.grid.rank == 0:
            with open(self.out / "history.csv", "w") as f:
                f.writelines(f"{v!r}\n" for v in self.history)
        s = self.stream.stats
        self.log.info("stream: %s", s.line())
        self.log.info(
            "online training: %d steps in %.1f s, %.0f%% of it in steps (trainer utilization); loss %.4e -> %.4e; "
            "checkpoint %s",
            self.step, seconds, 100 * result["utilization"], self.history[0] if self.history else math.nan,
            self.history[-1] if self.history else math.nan, self.ckpt,
        )  # fmt: skip
        self.log.info(
            "held-out relative L2 error: surrogate %.4f, persistence baseline %.4f (%d pairs kept aside)",
            result["surrogate"], result["persistence"], result["held_out"],
        )  # fmt: skip
        return result

    def _evaluate(self) -> dict[str, Any]:
        """Collective over plan.grid. Mean per-pair relative L2 error of the model and of persistence
        on the held-out pairs (every data group evaluates all of them)."""
        hx, hy, _ = self.stream.held_out_pairs()
        model: Any = self.wrapped
        dtype = next(self.model.parameters()).dtype
        grid = self.plan.model_grid
        err_model, err_persist = [], []
        model.eval()
        with torch.no_grad():
            for i in range(hx.shape[0]):
                x, y = self._wrap(hx[i : i + 1]), self._wrap(hy[i : i + 1])
                xin = hpctp.DistTensor(x.local.to(dtype), x.grid, x.layout)
                pred = model(xin)
                yt = y.local.to(dtype)
                err_model.append(float(relative_l2_error(pred.local, yt, grid)))
                err_persist.append(float(relative_l2_error(xin.local, yt, grid)))
        model.train()
        return {
            "surrogate": float(np.mean(err_model)) if err_model else math.nan,
            "persistence": float(np.mean(err_persist)) if err_persist else math.nan,
            "held_out": len(err_model),
        }


class CapiTrainer:
    """Collective over grid. The online trainer of the C/Fortran API (``hpctp_stream_init``): co-located
    on the simulation's ranks, built at the first snapshot (whose blocks give the layout), training the
    steps that each snapshot allows before the simulation goes on.

    Parameters
    ----------
    grid : ProcessGrid
        The simulation's grid (``hpctp_init``).
    cfg : dict
        The TOML file of ``hpctp_stream_init``: ``[simulation]`` must describe what the caller simulates
        (``size``, and ``steps``/``warmup``/``snapshot_every``, or ``pde = "navier_stokes"`` and
        ``snapshots``: the expected snapshot count), with ``[surrogate]``, ``[train]`` and ``[online]``.
    """

    def __init__(self, grid: hpctp.ProcessGrid, cfg: dict[str, Any]) -> None:
        from hpctp.cli.log import get_logger

        from .parallel import training_setup

        if online_settings(cfg)["placement"] != "colocated":
            raise ValueError("the C API trains co-located (online.placement = 'colocated'): the caller's ranks train")
        self.grid, self.cfg = grid, cfg
        self.log = get_logger("apps.surrogate.online", grid)
        tcfg = {**cfg, "simulation": {**cfg["simulation"], "grid": list(grid.dims)}}
        if int(cfg["train"].get("data", 1)) != 1 or int(cfg["train"].get("tensor", 1)) != 1:
            tcfg["simulation"]["grid"] = [0] * grid.ndim
        self.setup, self.plan = training_setup(tcfg, grid)
        self.stream: Stream | None = None
        self.trainer: OnlineTrainer | None = None

    def put(self, x: hpctp.DistTensor) -> None:
        """Collective over grid. The next snapshot (copied into the trainer's buffer), then the steps it allows."""
        if self.stream is None:
            self.stream = Stream(
                self.grid, x.global_shape, x.dtype, stream_config(self.cfg), sim_grid=self.grid, sim_layout=x.layout,
                train_grid=self.plan.grid, train_split=(None, *self.plan.spatial_axes),
            )  # fmt: skip
            self.trainer = OnlineTrainer(
                self.cfg, self.stream, self.plan, self.setup, self.log, self.cfg["train"]["out"]
            )
        self.stream.put(x)
        self.trainer.run_due()  # type: ignore[union-attr]

    def finalize(self) -> dict[str, Any]:
        """Collective over grid. End the stream, finish the training (checkpoint in ``train.out``)."""
        result: dict[str, Any] = {}
        if self.stream is not None and self.trainer is not None:
            self.stream.end()
            result = self.trainer.finish()
        self.plan.free()
        self.plan.grid.free()
        return result


def capi_trainer(grid: hpctp.ProcessGrid, cfg: dict[str, Any]) -> CapiTrainer:
    """Collective over grid. The factory ``hpctp_stream_init`` calls (``trainer =
    "apps.surrogate.online:capi_trainer"`` in its TOML file)."""
    return CapiTrainer(grid, cfg)
