"""``train.plan = "auto"``: the parallel plan :func:`hpctp.perf.plan` predicts fastest for a surrogate config.

:func:`planning_inputs` turns a config into what the planner takes (the model builder, the global batch
of one step as a :class:`hpctp.perf.Sample`, how the layers are checkpointed); ``hpctp plan CONFIG`` reads
it from here. The ViT's own modules get message models (:func:`hpctp.perf.register_layer`): its global
attention sends the K/V ring of :func:`hpctp.nn.functional.attention` (priced from the same ring plan,
:func:`hpctp.layout.ring.ring_plan`) beside the tensor axis's two all-reduces, and the model moves its
field onto patch-aligned blocks and back when a cut is not on a patch boundary.

:func:`choose` runs the planner for a training run (on rank 0, the choice broadcast) and :func:`apply`
writes the chosen plan into the config's keys (``train.data``, ``train.tensor``, ``train.zero``,
``train.checkpoint_activations``, ``simulation.grid``, and for the models built as chains of layers
(:data:`apps.surrogate.parallel.CHAINS`: the U-Net and the ViT) ``train.pipeline``, ``train.schedule``,
``train.microbatches`` and ``train.virtual``).
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import torch

import hpctp
from hpctp.layout import Layout, block_cuts, redistribution_plan
from hpctp.layout.ring import ring_plan
from hpctp.nn import context_parallel, patch_aligned_layout
from hpctp.nn.pipeline_parallel import SCHEDULES
from hpctp.perf import Message, Sample, Site, register_layer
from hpctp.perf.layers import tensor_messages

from .models import build_model
from .parallel import CHAINS, checkpoint_layers
from .vit import _Embed, _GlobalAttention

__all__ = ["CHANNELS", "MODEL_KEYS", "check_keys", "planning_inputs", "sample_of", "choose", "apply", "PLAN_KEYS"]

CHANNELS = {"grayscott": 2, "navier_stokes": 1}
"""Fields of the state per simulation (``simulation.pde``)."""
PLAN_KEYS = ("manual", "auto")
"""Values of ``train.plan``."""
RING_EXACT = 64
"""Rings of up to this many ranks are priced from their plan (:func:`hpctp.layout.ring.ring_plan`, exact); longer
ones from the blocks' sizes alone (the plan's cost grows with the ring)."""


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


# ---------------------------------------------------------------------------------------------- message models
def _pieces(tokens: int, most: int) -> int:
    """Pieces of a K/V block on the ring (:mod:`hpctp.nn.context_parallel`)."""
    if tokens <= 0:
        return 0
    return max(1, min(most, tokens // max(1, context_parallel.KEY_TILE_MIN)))


def attention_messages(module: _GlobalAttention, site: Site) -> list[Message]:
    """Local. The ViT's global attention: the K/V ring over the spatial axes (forward: each block but the
    successor's, in up to ``RING_PIECES`` pieces; backward: the blocks again and every block's dK/dV, in up to
    ``RING_PIECES_BACKWARD``, the dK/dV pieces in ``RING_GRAD_SLOTS`` buffers it holds), and the tensor axis's
    all-reduces."""
    out = tensor_messages(site)
    if site.inputs is None or not site.spatial_axes() or module.schedule == "all_to_all":
        return out
    n, rows, cols, e = site.inputs
    heads = module.heads
    d = e // heads
    tensor = site.tensor if site.tensor is not None and site.dims[site.tensor] > 1 else None
    cuts = None
    if tensor is not None:
        cuts = block_cuts(heads, site.dims[tensor])
    lay = Layout((n, heads, rows, cols, d), site.dims, (None, tensor, *site.spatial, None),
                 (None, cuts, None, None, None))  # fmt: skip
    ring = math.prod(site.dims[a] for a in site.spatial)
    if ring <= RING_EXACT:
        steps = [s.tokens for s in ring_plan(lay, lay, site.rank).steps]  # this rank's own block first
    else:  # a long ring: every block once, this rank's first, its successor's (the smallest, say) last
        heights = [b - a for a, b in itertools.pairwise(lay.dim_cuts[2])]
        widths = [b - a for a, b in itertools.pairwise(lay.dim_cuts[3])]
        mine = lay.local_shape(site.coords)[2] * lay.local_shape(site.coords)[3]
        others = sorted((h * w for h in heights for w in widths), reverse=True)
        others.remove(mine)
        steps = [mine, *others]
    if len(steps) < 2:
        return out
    bh = math.prod(lay.local_shape(site.coords)[:2])
    per_token = bh * 2 * d * site.itemsize
    fwd = steps[:-1]  # every block but the successor's travels on
    fp = [_pieces(t, context_parallel.RING_PIECES) for t in fwd]
    bp = [_pieces(t, context_parallel.RING_PIECES_BACKWARD) for t in fwd]
    gp = [_pieces(t, context_parallel.RING_PIECES_BACKWARD) for t in steps]
    recv = steps[1:]
    axes = site.spatial_axes()
    big = max(fwd) * per_token
    out.append(Message("fwd", "Isend", "p2p", axes, big, sum(fwd) * per_token, sum(recv) * per_token, sum(fp), True))
    grads = sum(steps) * per_token
    acc = max(site.itemsize, 4)  # (dK/dV accumulate in float32, float64 in float64)
    piece = max(-(-t // max(g, 1)) for t, g in zip(steps, gp))  # (tokens of the largest dK/dV piece)
    held = context_parallel.RING_GRAD_SLOTS * piece * per_token // site.itemsize * acc  # (its K/V pieces: pooled)
    out.append(Message("bwd", "Isend", "p2p", axes, big, sum(fwd) * per_token + grads,
                       sum(recv) * per_token + grads, sum(bp) + sum(gp), True, held=held))  # fmt: skip
    return out


def vit_messages(module: _Embed, site: Site) -> list[Message]:
    """Local. The ViT's field moved onto patch-aligned blocks (its embedding) and back (its head) in the forward,
    the output's gradient moved onto them again in the backward (the input needs none), when a cut is not on a
    patch boundary. All are counted at the embedding, whose input is the field; in a pipeline the head's share
    belongs to the last stage."""
    if site.inputs is None or not site.spatial_axes():
        return []
    lay = site.layout(site.inputs, site.input_dims)
    aligned = patch_aligned_layout(lay, module.patch)
    if aligned == lay:
        return []
    rank = site.rank
    there = redistribution_plan(lay, aligned, rank)
    back = redistribution_plan(aligned, lay, rank)
    out = []
    for phase, plans in (("fwd", (there, back)), ("bwd", (there,))):
        for p in plans:
            sent = sum(x.size for x in p.sends) * site.itemsize
            recv = sum(x.size for x in p.recvs) * site.itemsize
            count = sum(1 for x in p.sends if x.size)
            if sent or recv:
                total = math.prod(site.inputs) * site.itemsize
                out.append(Message(phase, "Alltoallv", "alltoall", site.spatial_axes(), total, sent, recv, count))
    return out


register_layer(_GlobalAttention, attention_messages)
register_layer(_Embed, vit_messages)


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
