"""The training grid of the surrogate: data x spatial (x tensor) axes from the ``[train]`` config keys,
the precision, activation checkpointing, and the memory line of the log.

Config keys (``[train]``, all optional):

* ``data`` (int, default 1): data-parallel groups; each holds a share of every global batch.
* ``tensor`` (int, default 1): ranks splitting the ViT's heads and MLP (``model = "vit"`` only).
* ``zero`` (0..3, default 0): what :class:`hpctp.nn.ShardedDataParallel` shards over the data axis
  (0 nothing, 1 optimizer state, 2 + gradients, 3 + parameters); with a pipeline, per stage.
* ``pipeline`` (int, default 1): pipeline stages (``model = "unet"`` or ``"vit"``: chains of layers), each on
  its own ranks (:class:`hpctp.nn.PipelineParallel`); the model is built on the meta device and each rank
  materializes only its stages.
* ``schedule`` (``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zero_bubble"``; default ``"1f1b"``),
  ``microbatches`` (default ``2 x pipeline``) and ``virtual`` (stages per rank, default 2 for
  ``"interleaved"``, else 1): the pipeline's schedule; ``cuts`` (``pipeline x virtual + 1`` increasing layer
  indices from 0 to the model's layer count; default ``[]``: stages of balanced parameter counts): where the stages
  cut the model's layers (``plan = "auto"`` sets the planner's, balanced by flops).
* ``precision`` (``"fp32"`` or ``"bf16"``): bf16 runs the forward under ``torch.autocast`` (float32
  parameters and optimizer state; ``surrogate.dtype`` must then be float32).
* ``checkpoint_activations`` (bool): recompute each layer's activations in backward.
* ``plan`` (``"manual"`` or ``"auto"``): ``"auto"`` sets the keys above and ``simulation.grid`` to the plan
  :func:`hpctp.perf.plan` predicts fastest within ``memory`` per rank (e.g. ``"16GiB"``; default the machine's) on
  ``machine`` (a machine file or a published profile's name; empty: measured at start), see
  :mod:`apps.surrogate.autoplan`.

The grid is ``[data, *simulation.grid]``, with ``[pipeline]`` after ``data`` when ``pipeline > 1`` and
``[tensor]`` last when ``tensor > 1``; the spatial part is
filled in by MPI where ``simulation.grid`` has zeros, so the same config runs on any rank count.
"""

from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

import hpctp
from hpctp.nn import ParallelPlan, checkpoint_forward
from hpctp.nn.pipeline_parallel import SCHEDULES

__all__ = ["TrainingSetup", "training_setup", "autocast", "checkpoint_layers", "memory_line", "PRECISIONS", "CHAINS"]

PRECISIONS = ("fp32", "bf16")
CHAINS = ("unet", "vit")
"""The surrogates built as chains of layers (``torch.nn.Sequential``), which a pipeline cuts into stages."""


class TrainingSetup:
    """Local. The validated ``[train]`` parallelism keys."""

    def __init__(self, cfg: dict[str, Any]):
        t, s = cfg["train"], cfg["surrogate"]
        self.data = t.get("data", 1)
        self.tensor = t.get("tensor", 1)
        self.zero = t.get("zero", 0)
        self.precision = t.get("precision", "fp32")
        self.checkpoint_activations = t.get("checkpoint_activations", False)
        self.plan = t.get("plan", "manual")
        if self.plan not in ("manual", "auto"):
            raise ValueError(f"train.plan must be 'manual' or 'auto', got {self.plan!r}")
        self.pipeline = t.get("pipeline", 1)
        self.schedule = t.get("schedule", "1f1b")
        self.microbatches = t.get("microbatches", 2 * self.pipeline if isinstance(self.pipeline, int) else 1)
        self.virtual = t.get("virtual", 2 if self.schedule == "interleaved" else 1)
        self.cuts = t.get("cuts", [])
        if not isinstance(self.cuts, list) or not all(
            isinstance(c, int) and not isinstance(c, bool) for c in self.cuts
        ):
            raise ValueError(f"train.cuts must be a list of ints (layer indices), got {self.cuts!r}")
        for name, value in (("data", self.data), ("tensor", self.tensor), ("pipeline", self.pipeline),
                            ("microbatches", self.microbatches), ("virtual", self.virtual)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"train.{name} must be a positive int, got {value!r}")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"train.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.precision == "bf16" and s["dtype"] != "float32":
            raise ValueError(
                f"train.precision = 'bf16' computes in bfloat16 from float32 parameters; "
                f"set surrogate.dtype = 'float32' (got {s['dtype']!r})"
            )
        if not isinstance(self.checkpoint_activations, bool):
            raise ValueError(f"train.checkpoint_activations must be true or false, got {self.checkpoint_activations!r}")
        if self.tensor > 1 and s["model"] != "vit":
            raise ValueError(
                f"train.tensor = {self.tensor} splits the weights of the ViT's heads and MLP; the {s['model']!r} "
                "model has none to split: use train.tensor = 1 or surrogate.model = 'vit'"
            )
        if self.tensor > 1 and float(t.get("spectral_weight", 0.0)):
            raise ValueError("train.spectral_weight needs train.tensor = 1 (its FFT runs on the spatial axes)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"train.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.pipeline > 1 and s["model"] not in CHAINS:
            raise ValueError(
                f"train.pipeline = {self.pipeline} cuts a chain of layers into stages; the {s['model']!r} model is not "
                f"one: use surrogate.model in {CHAINS}, or train.pipeline = 1"
            )
        if self.cuts and self.pipeline == 1:
            raise ValueError(
                f"train.cuts = {self.cuts} cuts pipeline stages: set train.pipeline > 1, or train.cuts = []"
            )
        if self.pipeline > 1 and float(t.get("spectral_weight", 0.0)):
            raise ValueError("train.spectral_weight needs train.pipeline = 1 (its loss term is not a per-sample mean)")

    @property
    def pipelined(self) -> bool:
        """Local. Whether the model is cut into pipeline stages."""
        return bool(self.pipeline > 1)


def training_setup(cfg: dict[str, Any], grid: hpctp.ProcessGrid) -> tuple[TrainingSetup, ParallelPlan]:
    """Collective over grid. The parallelism keys and the plan of a training grid on ``grid``'s ranks.

    Raises
    ------
    ValueError
        On invalid keys, or when ``data x tensor`` does not divide the rank count (on every rank).
    """
    setup = TrainingSetup(cfg)
    spatial = list(cfg["simulation"]["grid"])
    parts = setup.data * setup.tensor * setup.pipeline
    if grid.size % parts:
        raise ValueError(
            f"train.data x train.pipeline x train.tensor = {setup.data} x {setup.pipeline} x {setup.tensor} must "
            f"divide the {grid.size} ranks; choose them so, or run on a multiple of their product"
        )
    pipe = [setup.pipeline] if setup.pipelined else []
    dims = [setup.data, *pipe, *spatial] + ([setup.tensor] if setup.tensor > 1 else [])
    train_grid = hpctp.ProcessGrid(dims, comm=grid.comm)
    tensor = (train_grid.ndim - 1,) if setup.tensor > 1 else ()
    first = 1 + len(pipe)
    return setup, ParallelPlan(
        train_grid, data=(0,), pipeline=(1,) if pipe else (), spatial=(first, first + 1), tensor=tensor
    )


def autocast(setup: TrainingSetup, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Local. ``torch.autocast`` to bfloat16 for ``precision = "bf16"``, else nothing."""
    if setup.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _layers(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The modules whose activations are recomputed: the layers of a chain (a ``torch.nn.Sequential``: the
    U-Net's levels, the ViT's embedding, blocks and head), else every member of the model's ModuleLists that
    is not itself a ModuleList (the conv layers, Fourier layers)."""
    if isinstance(model, torch.nn.Sequential):
        yield from model.children()
        return
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList):
            yield from (c for c in m if not isinstance(c, torch.nn.ModuleList))


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Local. Run each layer of ``model`` (see :func:`_layers`) under :func:`hpctp.nn.checkpoint` when
    gradients are on (:func:`hpctp.nn.checkpoint_forward`); the module tree and state-dict names are
    unchanged. Returns the count."""
    layers = list(_layers(model))
    for layer in layers:
        checkpoint_forward(layer)
    return len(layers)


def memory_line(grid: hpctp.ProcessGrid, measured: hpctp.PeakMemory | None = None) -> str:
    """Collective over grid. Peak memory per rank as ``min-max over ranks`` in MiB: the resident set over the
    process's life, and (``measured``) what training added at its peak, sampled from a thread (see
    :class:`hpctp.PeakMemory`); and peak CUDA memory where used."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    added = measured.peak if measured is not None else 0
    table = hpctp.comm.allgather_ints(grid.comm, [int(rss), int(cuda), int(added)]) / 2**20
    text = f"peak memory per rank: host {table[:, 0].min():.0f}-{table[:, 0].max():.0f} MiB"
    if measured is not None:
        text += f" (training added {table[:, 2].min():.0f}-{table[:, 2].max():.0f} MiB at its peak, measured)"
    if np.any(table[:, 1]):
        text += f", GPU {table[:, 1].min():.0f}-{table[:, 1].max():.0f} MiB"
    return text + f" ({grid.size} ranks)"
