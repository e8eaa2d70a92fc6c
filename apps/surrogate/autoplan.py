"""``train.plan = "auto"``: the parallel plan :func:`hpctp.perf.plan` predicts fastest for a surrogate config.

:func:`planning_inputs` turns a config into what the planner takes (the model builder, the global batch
of one step as a :class:`hpctp.perf.Sample`, how the layers are checkpointed); ``hpctp plan CONFIG`` reads
it from here. What each model sends on a plan's grid (the ViT's K/V ring and patch-aligned moves included) the
planner reads off the model's own code run on a virtual grid (:mod:`hpctp.perf.dryrun`).

:func:`choose` runs the planner for a training run (on rank 0, the choice broadcast) and :func:`apply`
writes the chosen plan into the config's keys (``train.data``, ``train.tensor``, ``train.zero``,
``train.checkpoint_activations``, ``simulation.grid``, and for the models built as chains of layers
(:data:`apps.surrogate.parallel.CHAINS`: the U-Net and the ViT) ``train.pipeline``, ``train.schedule``,
``train.microbatches`` and ``train.virtual``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import hpctp
from hpctp.nn.pipeline_parallel import SCHEDULES
from hpctp.perf import Sample

from .models import build_model
from .parallel import CHAINS, checkpoint_layers

__all__ = ["CHANNELS", "MODEL_KEYS", "check_keys", "planning_inputs", "sample_of", "choose", "apply", "PLAN_KEYS"]

CHANNELS = {"grayscott": 2, "navier_stokes": 1}
"""Fields of the state per simulation (``simulation.pde``)."""
PLAN_KEYS = ("manual", "auto")
"""Values of ``train.plan``."""


MODEL_KEYS = {"fno": ("width", "depth", "modes"), "cnn": ("width", "depth"), "unet": ("width", "levels"), "vit": ()}
"""The ``[surrogate]`` keys each model is built from without a default (:func:`apps.surrogate.models.build_model`)."""


def check_keys(cfg: dict[str, Any]) -> None:
    """Local. That ``cfg`` has what :func:`sample_of` and the model builder read.

    Raises
    ------
    ValueError
        Naming the first key missing (or the unknown ``simulation.pde``) and the file to copy it from.
    """
    like = "see apps/configs/default.toml"
    for section in ("simulation", "surrogate", "train"):
        if not isinstance(cfg.get(section), dict):
            raise ValueError(f"the config has no [{section}] section ({like})")
    model = cfg["surrogate"].get("model")
    if model not in MODEL_KEYS:
        raise ValueError(f"surrogate.model must be one of {tuple(MODEL_KEYS)}, got {model!r}")
    needed = [("simulation", "size"), ("train", "batch_size"), ("surrogate", "dtype"), ("surrogate", "seed")]
    for section, key in needed + [("surrogate", k) for k in MODEL_KEYS[model]]:
        if key not in cfg[section]:
            raise ValueError(f"the config has no {section}.{key} (the {model!r} model needs it; {like})")
    pde = cfg["simulation"].get("pde", "grayscott")
    if pde not in CHANNELS:
        raise ValueError(f"simulation.pde must be one of {tuple(CHANNELS)}, got {pde!r}")


def sample_of(cfg: dict[str, Any]) -> Sample:
    """Local. The global batch of one training step of ``cfg``: ``(batch_size, channels, *simulation.size)``.

    Raises
    ------
    ValueError
        On a config that lacks a key it reads (:func:`check_keys`).
    """
    check_keys(cfg)
    s, sim = cfg["surrogate"], cfg["simulation"]
    vit = s["model"] == "vit"
    return Sample(
        (int(cfg["train"]["batch_size"]), CHANNELS[sim.get("pde", "grayscott")], *(int(n) for n in sim["size"])),
        dtype=s["dtype"], spatial_multiple=int(s.get("patch", 4)) if vit else 1,
        tensor_units=int(s.get("heads", 4)) if vit else None,
    )  # fmt: skip


def planning_inputs(cfg: dict[str, Any]) -> dict[str, Any]:
    """Local. ``{"builder", "sample", "recompute"}`` for :func:`hpctp.perf.plan` from a surrogate config.

    Raises
    ------
    ValueError
        On a config that lacks a key the model is built from (:func:`check_keys`).
    """
    s = cfg["surrogate"]
    sample = sample_of(cfg)

    def builder(plan: hpctp.nn.ParallelPlan) -> torch.nn.Module:
        return build_model(s, sample.shape[1], plan.model_grid, tensor_axis=plan.tensor[0] if plan.tensor else None)

    return {"builder": builder, "sample": sample, "recompute": checkpoint_layers}


# ---------------------------------------------------------------------------------------------- train.plan = auto
def _budget(cfg: dict[str, Any], machine: hpctp.perf.MachineProfile) -> int:
    text = str(cfg["train"].get("memory", "") or "")
    if text:
        return hpctp.perf.parse_bytes(text)
    if machine.memory_bytes:
        return int(machine.memory_bytes)
    raise ValueError("train.plan = 'auto' needs a memory budget: set train.memory (e.g. '16GiB')")


def choose(
    cfg: dict[str, Any], grid: hpctp.ProcessGrid, log: Any
) -> tuple[hpctp.perf.Candidate, list[int], str]:  # fmt: skip
    """Collective over grid. The fastest plan of ``grid.size`` ranks that fits ``train.memory`` per rank on
    ``train.machine`` (a machine file or a published profile's name; empty: calibrated here, now), pipelines
    included for the models built as chains (:data:`~apps.surrogate.parallel.CHAINS`); computed on rank 0 and
    broadcast. Returns it, its pipeline's stage cuts (the ones the planner predicted; empty without a pipeline)
    and the planner's table.

    Raises
    ------
    ValueError
        On every rank, with the planner's message, when no plan fits or the keys are invalid.
    """
    name = str(cfg["train"].get("machine", "") or "")
    machine = hpctp.perf.load_machine(name) if name else None
    if machine is None:
        machine = hpctp.perf.calibrate(grid, dtype=cfg["surrogate"]["dtype"], repeats=3)
        log.info("machine calibrated on %d ranks: %s", grid.size, machine.name)
    nsp = len(cfg["simulation"]["size"])
    words = 8 + nsp
    choice = [0] * words
    cuts: list[int] = []
    table = ""
    error: Exception | None = None
    if grid.rank == 0:
        try:
            inputs = planning_inputs(cfg)
            report = hpctp.perf.plan(inputs["builder"], inputs["sample"], ranks=grid.size, memory=_budget(cfg, machine),
                                     machine=machine, recompute=inputs["recompute"],
                                     pipeline=cfg["surrogate"]["model"] in CHAINS)  # fmt: skip
            b = report.best.candidate
            which = SCHEDULES.index(b.schedule) + 1 if b.schedule else 0
            choice = [b.data, b.tensor, b.zero, int(b.recompute), b.pipeline, which, b.microbatches, b.chunks,
                      *b.spatial]  # fmt: skip
            cuts = list(report.best.cuts)
            table = report.table(top=5)
        except ValueError as e:
            error = e
    hpctp.comm.raise_if_any(grid.comm, error)
    got = [int(v) for v in hpctp.comm.bcast_ints(grid.comm, choice if grid.rank == 0 else None, words)]
    schedule = SCHEDULES[got[5] - 1] if got[5] else ""
    cand = hpctp.perf.Candidate(got[0], tuple(got[8:]), got[1], got[4], got[2], bool(got[3]), schedule, got[6], got[7])
    count = cand.pipeline * cand.chunks + 1 if cand.pipeline > 1 else 0  # (zeros: the planner named no cuts)
    got_cuts = hpctp.comm.bcast_ints(grid.comm, (cuts or [0] * count) if grid.rank == 0 else None, count)
    return cand, [int(v) for v in got_cuts] if got_cuts.any() else [], table


def apply(cfg: dict[str, Any], cand: hpctp.perf.Candidate, cuts: list[int] | None = None) -> dict[str, Any]:
    """Local. A copy of ``cfg`` whose parallelism keys are ``cand``'s, and ``train.cuts`` its pipeline's ``cuts``
    (empty or None: the runtime's default)."""
    out = copy.deepcopy(cfg)
    out["train"].update(data=cand.data, tensor=cand.tensor, zero=cand.zero, checkpoint_activations=cand.recompute,
                        pipeline=cand.pipeline, cuts=list(cuts or []) if cand.pipeline > 1 else [])  # fmt: skip
    if cand.pipeline > 1:
        out["train"].update(schedule=cand.schedule, microbatches=cand.microbatches, virtual=cand.chunks)
    out["simulation"]["grid"] = list(cand.spatial)
    return out
