"""The planner (hpctp.perf): machine files, the traced memory of each layer kind against what torch allocates, the
search, bad input; on 2-4 ranks its predicted messages against CommCounter and its training state per rank against
ShardedDataParallel's."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.scripts import load_script
from mpi4py import MPI
from torch.utils._python_dispatch import TorchDispatchMode

import hpctp
from apps.common.config import load_config
from apps.surrogate import autoplan
from hpctp.cli.command import main as cli_main
from hpctp.nn import (
    BatchNorm2d,
    Conv2d,
    ConvTranspose2d,
    MaxPool2d,
    ParallelPlan,
    PatchEmbed2d,
    ShardedDataParallel,
    SpectralConv2d,
    Unpatch2d,
    Upsample,
    global_mse_loss,
)
from hpctp.nn.pipeline_parallel import RECEIVE_AHEAD, pipeline_schedule
from hpctp.nn.spectral import fourier
from hpctp.perf import Candidate, Link, PlanError, Sample, load_machine, parse_bytes, plan, trace
from hpctp.perf.layers import spectral_flops
from hpctp.perf.machine import collective_time
from hpctp.perf.memory import local_numel, predict_memory, shares
from hpctp.perf.search import candidates, grids, limits, spearman
from hpctp.perf.timing import _simulate, _site, dry_messages, layer_cost, point_free_share, step_messages
from hpctp.testing import assert_all, assert_equal

ROOT = Path(__file__).resolve().parents[1]
WORLD = MPI.COMM_WORLD


# ---------------------------------------------------------------------------------------------- machine files
def test_published_machines_load_and_round_trip(tmp_path: Path) -> None:
    names = hpctp.perf.published_machines()
    assert {"h100-ndr", "a100-hdr"} <= set(names)
    for name in names:
        m = load_machine(name)
        assert m.source == "published" and m.ranks_per_node == 8 and m.asynchronous
        back = load_machine(m.save(tmp_path / f"{name}.toml"))
        assert back == m
    h100 = load_machine("h100-ndr")
    assert h100.rates("bfloat16").gemm > h100.rates("float32").gemm
    assert h100.link("inter", "allreduce").beta > h100.link("intra", "allreduce").beta  # NDR is slower than NVLink


def test_machine_file_errors_name_the_key(tmp_path: Path) -> None:
    text = load_machine("h100-ndr").to_toml()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("gemm_half =", "gemm_halve ="))
    with pytest.raises(ValueError, match=r"unknown key\(s\) gemm_halve.*gemm_half"):
        load_machine(bad)
    bad.write_text(text.replace("[network.inter]", "[network.interr]"))
    with pytest.raises(ValueError, match="interr.*intra, inter"):
        load_machine(bad)
    bad.write_text(text.replace("ranks_per_node = 8", "ranks_per_node = 0"))
    with pytest.raises(ValueError, match="ranks_per_node must be a positive int"):
        load_machine(bad)
    with pytest.raises(FileNotFoundError, match="h100-ndr"):
        load_machine(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="no compute rates for float64.*compute.float64"):
        load_machine("h100-ndr").rates("float64")
    bad.write_text(text.replace("overlap = 1.0", "overlap = 1.5"))
    with pytest.raises(ValueError, match=r"overlap must be a number in \[0, 1\], got 1.5"):
        load_machine(bad)
    bad.write_text(text.replace("overlap = 1.0\n", ""))  # (a file from before the key: messages overlap)
    assert load_machine(bad).overlap == 1.0
    bad.write_text(text.replace("ranks_per_node = 8\n", "ranks_per_node = 8\ncores_per_node = -2\n"))
    with pytest.raises(ValueError, match=r"cores_per_node must be an int >= 0 \(0: a core or a device per rank\)"):
        load_machine(bad)
    bad.write_text(text.replace("ranks_per_node = 8\n", "ranks_per_node = 8\ncores_per_node = 2\n"))
    shared = load_machine(bad)
    assert shared.cores_per_node == 2 and load_machine(shared.save(tmp_path / "back.toml")) == shared
    assert load_machine("h100-ndr").cores_per_node == 0  # (a device per rank)


def test_collective_formulas_and_levels() -> None:
    link = Link(alpha=1e-6, beta=1e-9)
    assert collective_time("allreduce", 1000, 1, link) == 0.0
    assert collective_time("allreduce", 1000, 4, link) == pytest.approx(4e-6 + 2 * 0.75 * 1e-6)
    assert collective_time("allgather", 4000, 4, link) == pytest.approx(2e-6 + 3e-6)
    assert collective_time("alltoall", 4000, 4, link) == pytest.approx(3e-6 + 3e-6)
    assert collective_time("p2p", 4000, 2, link) == pytest.approx(1e-6 + 4e-6)
    m = load_machine("h100-ndr")  # 8 ranks per node, row-major
    assert m.level((1, 64, 1, 1, 8), (4,)) == "intra"  # the innermost 8: one node
    assert m.level((1, 64, 1, 1, 8), (1,)) == "inter"
    assert m.level((1, 2, 2, 2, 2), (2, 3)) == "intra"
    assert m.level((1, 2, 2, 2, 2), (1, 2, 3, 4)) == "inter"


def test_parse_bytes() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5e9") == 1_500_000_000
    assert parse_bytes(4096) == 4096
    for bad in ("lots", "-3GiB", "80 GiBs", 0):
        with pytest.raises(ValueError, match="80GiB"):
            parse_bytes(bad)


# ---------------------------------------------------------------------------------------------- memory per layer kind
class _Allocations(TorchDispatchMode):
    """Peak bytes of the storages operators create (real tensors), parameters' gradients apart: what the trace
    counts, measured on a real step."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.grads: set[int] = set()
        self.skip = skip
        self.total = self.peak = 0

    def _free(self, key: int) -> None:
        self.total -= self.live.pop(key, 0)

    def regrade(self, t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        self.total -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(t, torch.Tensor):
                continue
            s = t.untyped_storage()
            key = s.data_ptr()
            if key in self.live or key in ins or key in self.skip or not s.nbytes():
                continue
            self.live[key] = s.nbytes()
            self.total += s.nbytes()
            weakref.finalize(s, self._free, key)
        self.peak = max(self.peak, self.total)
        return out


def _measured_activations(model: torch.nn.Module, plan: ParallelPlan, shape: tuple[int, ...]) -> int:
    grid = plan.model_grid
    x = hpctp.DistTensor(torch.randn(shape), grid, hpctp.Layout(shape, grid.dims, (None, None, *plan.spatial)))
    params = list(model.parameters())
    track = _Allocations({t.untyped_storage().data_ptr() for t in (*params, *model.buffers(), x.local)})
    hooks = [p.register_post_accumulate_grad_hook(lambda q: track.regrade(q.grad)) for p in params]
    with track:
        out = model(x)
        pred = out.local if isinstance(out, hpctp.DistTensor) else out
        loss = ((pred - torch.zeros_like(pred)) ** 2).sum().to(torch.float64) / pred.numel()
        loss.backward()
    for h in hooks:
        h.remove()
    return track.peak


class _Field(torch.nn.Module):
    """One layer kind on a spatially split field (DistTensor in, DistTensor out)."""

    def __init__(self, kind: str, grid: hpctp.ProcessGrid) -> None:
        super().__init__()
        self.kind = kind
        if kind == "conv3":
            self.layers = torch.nn.ModuleList([Conv2d(2, 6, 3, padding=1, padding_mode="circular", grid=grid, seed=0)])
        elif kind == "conv1":
            self.layers = torch.nn.ModuleList([Conv2d(2, 6, 1, grid=grid, seed=0)])
        elif kind in ("spectral", "spectral-split"):
            self.layers = torch.nn.ModuleList([SpectralConv2d(2, 4, 5, grid=grid, seed=0)])
        elif kind == "pool":
            self.layers = torch.nn.ModuleList([
                Conv2d(2, 4, 3, padding=1, grid=grid, seed=0), MaxPool2d(2, grid=grid, split=(0, 1)),
                Upsample(scale_factor=2, mode="nearest", grid=grid, split=(0, 1), balanced=True),
            ])  # fmt: skip
        else:  # patches
            self.layers = torch.nn.ModuleList(
                [PatchEmbed2d(2, 8, 4, grid, split=(0, 1), seed=0), Unpatch2d(8, 2, 4, grid, split=(0, 1), seed=1)]
            )

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("kind", ["conv3", "conv1", "spectral", "spectral-split", "pool", "patches", "vit"])
def test_traced_memory_of_each_layer_kind_equals_what_it_allocates(kind: str) -> None:
    """Traced on fake tensors at two sizes, fitted, evaluated at other shapes: the activation peak equals the bytes
    a real forward and backward allocate at one rank; parameters, gradients and Adam state are the parameters'.
    ``spectral-split``: the Fourier layer on the path of a split field (DFT matrices), the trace plans that split
    the field use (``Workload.split_traces``)."""
    if WORLD.Get_size() > 1:
        pytest.skip("one-rank test (the trace itself runs on one rank)")
    if kind == "vit":
        cfg = load_config(str(ROOT / "apps/configs/vit.toml"), ["surrogate.embed=16", "surrogate.depth=1"])
        inputs = autoplan.planning_inputs(cfg)
        builder, mult = inputs["builder"], 4
    else:

        def builder(p: ParallelPlan) -> torch.nn.Module:
            return _Field(kind, p.model_grid)

        mult = 4
    work = trace(builder, Sample((2, 2, 32, 32), "float32", mult), recompute=False)
    grid = hpctp.ProcessGrid((1, 1, 1))
    probe_plan = ParallelPlan(grid, data=(0,), spatial=(1, 2))
    model = builder(probe_plan)
    whole = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert work.param_bytes == whole
    split_path = fourier.split_path_on_whole_fields if kind == "spectral-split" else contextlib.nullcontext
    assert bool(work.split_traces) == kind.startswith("spectral")
    for b, field in ((3, (40, 24)), (1, (64, 64)), (2, (96, 32))):
        with split_path():
            if kind == "spectral-split":  # (the DFT matrices of a new shape: built once and cached, not activations)
                _measured_activations(model, probe_plan, (b, 2, *field))
            measured = _measured_activations(model, probe_plan, (b, 2, *field))
        smp = Sample((b, 2, *field), "float32", mult)
        cand = Candidate(1, (1, 1))
        sh = shares(smp, cand)
        t = (work.split_traces if kind == "spectral-split" else work.traces)[False]
        predicted = float(np.max(t.rep @ sh.features + t.split @ sh.features))
        # (halo strips grow with a block's edges, not its area: a few percent at these small sizes; so do the DFT
        # matrices' products, under a percent)
        rel = {"conv3": 0.04, "pool": 0.04, "spectral-split": 0.01}.get(kind, 1e-6)
        assert predicted == pytest.approx(measured, rel=rel), (b, field)
        mem = predict_memory(work, cand, sh)
        assert mem.params == whole and mem.optimizer in (2 * whole, 3 * whole)  # (3: at Adam's step, its temporary)
    probe_plan.free()
    grid.free()


def test_traced_attention_counts_its_softmax_scores_apart_from_its_flops() -> None:
    """Each attention kernel's scores (batch x heads x queries x keys; twice in backward), fitted in the trace and
    evaluated at other shapes, and priced at the machine's softmax rate on top of its flops."""
    if WORLD.Get_size() > 1:
        pytest.skip("one-rank test (the trace itself runs on one rank)")
    cfg = load_config(str(ROOT / "apps/configs/vit.toml"), ["surrogate.embed=16", "surrogate.depth=1"])
    inputs = autoplan.planning_inputs(cfg)
    work = trace(inputs["builder"], Sample((2, 2, 32, 32), "float32", 4), recompute=False)
    heads, patch, embed = cfg["surrogate"]["heads"], cfg["surrogate"]["patch"], cfg["surrogate"]["embed"]
    (fqn,) = [f for f, info in work.layers.items() if ("fwd", "softmax") in info.flops]
    info = work.layers[fqn]
    for b, field in ((3, (32, 48)), (1, (64, 64))):
        tokens = math.prod(n // patch for n in field)
        scores = b * heads * tokens**2
        points = float(math.prod(field))
        assert info.flops[("fwd", "softmax")](b, points, points) == pytest.approx(scores, rel=1e-9)
        assert info.flops[("bwd", "softmax")](b, points, points) == pytest.approx(2 * scores, rel=1e-9)
        assert info.flops[("fwd", "attention")](b, points, points) == pytest.approx(
            4 * scores * embed // heads, rel=1e-9
        )
    machine = load_machine("a100-hdr")
    rates = machine.rates("float32")
    cand = Candidate(1, (1, 1))
    sh = shares(work.sample, cand)
    scores = info.flops[("fwd", "softmax")](sh.batch, sh.points, sh.whole)
    unpriced = layer_cost(info, work, cand, sh, machine)
    priced = layer_cost(info, work, cand, sh, dataclasses.replace(
        machine, compute={"float32": dataclasses.replace(rates, softmax=1e9)}))  # fmt: skip
    assert math.isinf(rates.softmax)  # (published rates are end to end: their softmax is in the attention rate)
    assert priced.fwd - unpriced.fwd == pytest.approx(scores / 1e9, rel=1e-9)
    assert priced.bwd - unpriced.bwd == pytest.approx(2 * scores / 1e9, rel=1e-9)
    assert priced.flops == unpriced.flops  # (scores are not flops)


def test_machine_files_without_a_softmax_rate_still_load(tmp_path: Path) -> None:
    text = load_machine("h100-ndr").to_toml()
    assert "softmax =" not in text
    path = tmp_path / "with.toml"
    path.write_text(text.replace("[compute.bfloat16]\n", "[compute.bfloat16]\nsoftmax = 3.9e12\n"))
    m = load_machine(path)
    assert m.rates("bfloat16").softmax == 3.9e12 and math.isinf(m.rates("float32").softmax)
    assert load_machine(m.save(tmp_path / "back.toml")) == m
    path.write_text(text.replace("[compute.bfloat16]\n", "[compute.bfloat16]\nsoftmax = -1\n"))
    with pytest.raises(ValueError, match="softmax"):
        load_machine(path)


class _LinearBytes:
    """Counts what a zero-bubble W keeps of each linear call (its input's storage, its output's gradient)."""

    def __init__(self) -> None:
        self.inputs: set[int] = set()
        self.total = 0

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.nn.functional.linear(x, weight, bias)
        if x.untyped_storage().data_ptr() not in self.inputs:
            self.inputs.add(x.untyped_storage().data_ptr())
            self.total += x.untyped_storage().nbytes()
        self.total += y.numel() * y.element_size()
        return y


def test_traced_bytes_a_zero_bubble_w_keeps_equal_a_real_forward() -> None:
    """The trace's fit of what the linear layers' deferred weight products keep from B to W (Trace.deferred), at
    other shapes, equals the bytes a real forward records; other layers keep none."""
    if WORLD.Get_size() > 1:
        pytest.skip("one-rank test")
    from hpctp.nn._deferred_weights import recording

    cfg = load_config(str(ROOT / "apps/configs/vit.toml"), ["surrogate.embed=16", "surrogate.depth=2"])
    inputs = autoplan.planning_inputs(cfg)
    work = trace(inputs["builder"], Sample((2, 2, 32, 32), "float32", 4), recompute=False)
    deferred = work.traces[False].deferred
    assert deferred and all(".attn" in k or ".mlp" in k for k in deferred), sorted(deferred)
    grid = hpctp.ProcessGrid((1, 1, 1), comm=MPI.COMM_SELF)
    pplan = ParallelPlan(grid, data=(0,), spatial=(1, 2))
    model = inputs["builder"](pplan)
    for b, field in ((3, (48, 32)), (1, (64, 64))):
        x = hpctp.DistTensor(torch.randn(b, 2, *field), pplan.model_grid,
                             hpctp.Layout((b, 2, *field), pplan.model_grid.dims, (None, None, 0, 1)))  # fmt: skip
        counter = _LinearBytes()
        with recording(counter):
            model(x)
        sh = shares(Sample((b, 2, *field), "float32", 4), Candidate(1, (1, 1)))
        predicted = sum(float(v[:4] @ sh.features + v[4:] @ sh.features) for v in deferred.values())
        assert predicted == pytest.approx(counter.total, rel=1e-9), (b, field)
    pplan.free()
    grid.free()


def _stage_peak(stage: list[torch.nn.Module], x: Any, last: bool, split: bool) -> int:
    """Peak bytes one pipeline stage allocates for one micro-batch at one rank: forward, then backward from a
    gradient of its output (the next stage's) or, on the last stage, from the trace's loss; with ``split`` as a
    zero-bubble B (the linear layers' weight products deferred: their inputs and output gradients kept)."""
    from hpctp.nn._deferred_weights import DeferredWeightGradients
    from hpctp.nn.pipeline_parallel._messages import blocks_of

    params = [p for m in stage for p in m.parameters()]
    fixed = {t.untyped_storage().data_ptr() for t in (*params, *(b for m in stage for b in m.buffers()), *blocks_of(x))}
    out = x
    with torch.no_grad():  # (the output's shapes, for its gradient, made before counting)
        for m in stage:
            out = m(out)
    grads = [torch.randn(b.shape) for b in blocks_of(out)]  # (as a message brings them: contiguous)
    fixed |= {g.untyped_storage().data_ptr() for g in grads}
    track = _Allocations(fixed)
    hooks = [p.register_post_accumulate_grad_hook(lambda q: track.regrade(q.grad)) for p in params]
    deferred = DeferredWeightGradients()
    with track, deferred.recording() if split else contextlib.nullcontext():
        out = x
        for m in stage:
            out = m(out)
        blocks = blocks_of(out)
        if last:  # (as the trace's step: the target exists beforehand, the loss's work counts)
            pred = blocks[0]
            loss = ((pred - grads[0]) ** 2).sum().to(torch.float64) / pred.numel()
            loss.backward()
        else:  # (as the runtime: outputs passed through from the first stage's input need no gradient)
            pairs = [(o, g) for o, g in zip(blocks, grads) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    for h in hooks:
        h.remove()
    return track.peak


def _fourier_chain(plan: ParallelPlan) -> torch.nn.Sequential:
    """A chain of Fourier layers between pointwise convolutions: a pipeline's stages on a field they may split."""
    g = plan.model_grid
    return torch.nn.Sequential(Conv2d(2, 6, 1, grid=g, seed=0), SpectralConv2d(6, 6, 5, grid=g, seed=1),
                               SpectralConv2d(6, 6, 5, grid=g, seed=2), Conv2d(6, 2, 1, grid=g, seed=3))  # fmt: skip


def _chain_with_a_free_layer(plan: ParallelPlan) -> torch.nn.Sequential:
    """3x3 convolutions (few parameters, most of the flops), then Fourier layers (most of the parameters); a layer
    without parameters after the first (not a unit: the pipeline cuts around it)."""
    g = plan.model_grid
    return torch.nn.Sequential(Conv2d(2, 8, 3, padding=1, grid=g, seed=0), torch.nn.Identity(),
                               Conv2d(8, 8, 3, padding=1, grid=g, seed=1), SpectralConv2d(8, 8, 5, grid=g, seed=2),
                               SpectralConv2d(8, 8, 5, grid=g, seed=3), Conv2d(8, 2, 1, grid=g, seed=4))  # fmt: skip


def test_a_pipeline_plan_carries_the_stage_cuts_it_was_predicted_with(vit_work: Any) -> None:
    """Each pipeline prediction names its stages as cuts of the model's children (``Prediction.cuts``, what
    ``PipelineParallel(cuts=...)`` takes): the units each stage was costed with, a layer without parameters going
    with the unit before it. The runtime must be given them: its default, balanced parameter counts, cuts a model
    whose parameters and flops lie apart elsewhere."""
    from hpctp.nn.pipeline_parallel import balanced_cuts
    from hpctp.perf.timing import chain_cuts, stage_cuts

    work = trace(_chain_with_a_free_layer, Sample((4, 2, 16, 16), "float32"))
    children = [name for name, _ in work.model.named_children()]
    assert [u.fqn for u in work.units[1:]] == ["0", "2", "3", "4", "5"]
    for parts in (2, 3, 4):
        units, cuts = stage_cuts(work, parts), chain_cuts(work, parts)
        assert len(cuts) == parts + 1 and cuts[0] == 0 and cuts[-1] == len(children)
        for s in range(parts):
            costed = [u.fqn for u in work.units[1 + units[s] : 1 + units[s + 1]]]
            held = [n for n in children[cuts[s] : cuts[s + 1]] if n != "1"]
            assert held == costed, (parts, s, units, cuts)
    report = plan(vit_work, ranks=4, memory="64GiB", machine="h100-ndr")
    piped = [p for p in report.ranked if p.candidate.pipeline > 1]
    assert piped and all(p.cuts == chain_cuts(vit_work, p.candidate.pipeline * p.candidate.chunks) for p in piped)
    assert all(p.cuts == () for p in report.ranked if p.candidate.pipeline == 1)
    params = [1.0 + sum(q.numel() * q.element_size() for q in c.parameters()) for c in work.model.children()]
    assert chain_cuts(work, 2) != balanced_cuts(params, 2)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("model", ["vit", "fourier"])
def test_a_pipeline_stage_timeline_peaks_at_what_the_stage_allocates(parts: int, split: bool, model: str) -> None:
    """What a pipeline stage holds while it computes one micro-batch, from the one-rank trace of the whole model
    (its own units' bytes at the snapshots where they run: search._stage_timelines, above what they keep at the end
    of forward, plus that), bounds the bytes the stage allocates running alone at other shapes: its backward's
    temporaries, the loss's on the last stage, its output until its backward ends, and under zero-bubble (every
    stage but the first) the linear layers' inputs and output gradients that B keeps for W; from above by at most
    the gradients at its cuts, whose copies (from the message's layout, into the input's .grad) it counts throughout
    backward. ``fourier``: a chain of Fourier layers, for a plan that splits the field (a 2 x 1 cut of it: the
    timelines of the trace on the split path, ``Workload.split_traces``), measured on that path (DFT matrices)."""
    if WORLD.Get_size() > 1:
        pytest.skip("one-rank test")
    from hpctp.nn.pipeline_parallel.runtime import _detached
    from hpctp.perf.memory import _bytes
    from hpctp.perf.search import _stage_timelines
    from hpctp.perf.timing import stage_cuts

    builder: Any = _fourier_chain
    if model == "vit":
        cfg = load_config(str(ROOT / "apps/configs/vit.toml"), ["surrogate.embed=16", "surrogate.depth=2"])
        builder = autoplan.planning_inputs(cfg)["builder"]
    work = trace(builder, Sample((2, 2, 32, 32), "float32", 4), recompute=False)
    spatial = (2, 1) if model == "fourier" else (1, 1)
    cand = Candidate(1, spatial, pipeline=parts, schedule="zero_bubble" if split else "1f1b", microbatches=parts)
    timelines = _stage_timelines(work, cand, split)
    cuts = stage_cuts(work, parts)
    ut = (work.split_traces if model == "fourier" else work.traces)[False].units
    assert ut is not None
    grid = hpctp.ProcessGrid((1, 1, 1), comm=MPI.COMM_SELF)
    pplan = ParallelPlan(grid, data=(0,), spatial=(1, 2))
    chain = builder(pplan)
    assert [n for n, _ in chain.named_children()] == [u.fqn for u in work.units[1:]]  # (the chain is the units)
    path = fourier.split_path_on_whole_fields if model == "fourier" else contextlib.nullcontext
    for b, field in ((3, (48, 32)), (1, (64, 64))):
        if model == "fourier":  # (the DFT matrices of a new shape: built once and cached, not activations)
            with path():
                _measured_activations(chain, pplan, (b, 2, *field))
        sh = shares(Sample((b, 2, *field), "float32", 4), Candidate(1, (1, 1)))
        f = sh.features
        x: Any = hpctp.DistTensor(torch.randn(b, 2, *field), pplan.model_grid,
                                  hpctp.Layout((b, 2, *field), pplan.model_grid.dims, (None, None, 0, 1)))  # fmt: skip
        for s in range(parts):
            units = work.units[1 + cuts[s] : 1 + cuts[s + 1]]
            stage = [chain.get_submodule(u.fqn) for u in units]
            kept = sum(ut.owned[u.fqn][ut.end_forward] for u in units)  # (as the stage's timeline counts it)
            if s == parts - 1:
                kept = kept + ut.owned.get(work.units[0].fqn, np.zeros((1, 8)))[ut.end_forward]
            else:
                kept = kept + ut.freed.get(work.units[cuts[s + 1]].fqn, np.zeros((1, 8)))[ut.end_forward]
            predicted = float(np.max(_bytes(timelines[s], sh))) + float(kept[:4] @ f + kept[4:] @ f)
            with path():
                measured = _stage_peak(stage, x, s == parts - 1, split and s > 0)
            copies = sum(work.leaving[work.units[c].fqn](b, sh.points) for c in cuts[1:-1] if c in cuts[s : s + 2])
            # (below by at most 2%: inside attention's backward the real kernels allocate a few KiB the trace's
            # fake ones do not, 1% here; the DFT matrices' products grow with a block's edges, not its area: fitted
            # within 1%)
            top = (measured + copies) * (1.01 if model == "fourier" else 1.0) + 1e-6
            assert 0.98 * measured <= predicted <= top, (b, field, s, predicted, measured, copies)
            with torch.no_grad(), path():  # (the next stage's input: this one's output, a leaf as the pipeline
                for m in stage:  # receives it)
                    x = m(x)
            x = _detached(x)
    pplan.free()
    grid.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_traced_bytes_a_zero_bubble_w_keeps_equal_a_real_forward_split_over_heads() -> None:
    """With the heads on a tensor axis of every rank, the same fit (from one rank's trace) equals what each rank's
    forward records: a row-parallel layer's input is divided by the axis (its weight's layout says so, where its
    shape on one rank looks like its owner's replicated input), a column-parallel layer's output too."""
    from hpctp.nn._deferred_weights import recording

    size = WORLD.Get_size()
    cfg = load_config(str(ROOT / "apps/configs/vit.toml"),
                      ["surrogate.embed=24", "surrogate.heads=12", "surrogate.depth=2"])  # fmt: skip
    inputs = autoplan.planning_inputs(cfg)
    work = trace(inputs["builder"], Sample((2, 2, 32, 32), "float32", 4), recompute=False)
    deferred = work.traces[False].deferred
    grid = hpctp.ProcessGrid((1, 1, 1, size), comm=WORLD)
    pplan = ParallelPlan(grid, data=(0,), spatial=(1, 2), tensor=(3,))
    model = inputs["builder"](pplan)
    b, field = 3, (48, 32)
    lay = hpctp.Layout((b, 2, *field), pplan.model_grid.dims, (None, None, 0, 1))
    x = hpctp.DistTensor(torch.randn(b, 2, *field), pplan.model_grid, lay)
    counter = _LinearBytes()
    with recording(counter):
        model(x)
    sh = shares(Sample((b, 2, *field), "float32", 4), Candidate(1, (1, 1), size))
    predicted = sum(float(v[:4] @ sh.features + sh.tensor * (v[4:] @ sh.features)) for v in deferred.values())
    assert_all(grid, abs(predicted - counter.total) <= 1e-9 * counter.total,
               f"rank {grid.rank}: predicted {predicted} bytes, recorded {counter.total}")  # fmt: skip
    pplan.free()
    grid.free()


def test_a_gradient_counts_from_its_arrival_not_from_its_layers_peak() -> None:
    """The trace's probe: a layer's largest moment (its backward workspace) comes before its gradient reaches the
    wrapper's bucket, so that snapshot has not seen the gradient arrive; the arrival (the wrapper's copy) is a
    snapshot of its own, with the gradient still counted as the layer's bytes."""
    from hpctp.perf.workload import GRADS, _Owners, _Probe

    owners = _Owners()
    owners.stack.append("layer")
    probe = _Probe(owners, lambda owner, shape: False, set())
    with probe:
        workspace = torch.empty(4000, dtype=torch.uint8, device="meta")
        del workspace
        grad = torch.empty(1000, dtype=torch.uint8, device="meta")
        probe.regrade(grad, 0)
        after = torch.empty(10, dtype=torch.uint8, device="meta")
    probe._snapshot()
    got = [(dict(snap), arrived) for (snap, _), arrived in zip(probe.snapshots, probe.snapshot_arrived)]
    assert got == [({("layer", False): 4000}, 0), ({("layer", False): 1000}, 1),
                   ({("layer", False): 10, (GRADS, False): 1000}, 1)], got  # fmt: skip
    del grad, after


def test_recompute_keeps_less() -> None:
    if WORLD.Get_size() > 1:
        pytest.skip("one-rank test")
    cfg = load_config(str(ROOT / "apps/configs/vit.toml"), ["surrogate.embed=16", "surrogate.depth=2"])
    inputs = autoplan.planning_inputs(cfg)
    work = trace(inputs["builder"], Sample((4, 2, 32, 32), "float32", 4), recompute=inputs["recompute"])
    cand = Candidate(1, (1, 1))
    plain = predict_memory(work, cand, shares(work.sample, cand)).activations
    kept = predict_memory(work, Candidate(1, (1, 1), recompute=True), shares(work.sample, cand)).activations
    assert 0 < kept < plain


def test_a_split_fourier_layer_divides_its_mix_by_its_run_of_modes() -> None:
    """A Fourier layer (modes 5: 10 x 5 = 50 kept) on a field split over q ranks: rank 0's run is ceil(50 / q)
    modes (:func:`point_free_share`); its mix flops are that share of the whole mix's, and the elementwise bytes
    of the trace that do not grow with the points are divided by it, the rest kept."""
    if WORLD.Get_size() > 1:
        pytest.skip("one-rank test")

    def builder(p: ParallelPlan) -> torch.nn.Module:
        return _Field("spectral", p.model_grid)

    work = trace(builder, Sample((6, 2, 40, 40), "float32", 4), recompute=False)
    (info,) = [i for i in work.layers.values() if isinstance(i.module, SpectralConv2d)]
    machine = load_machine("h100-ndr")
    ew = info.elementwise["fwd"]
    for q, run in ((1, 50), (2, 25), (3, 17), (4, 13), (8, 7)):
        cand = Candidate(1, (q, 1))
        sh = shares(work.sample, cand)
        share = point_free_share(work, cand)
        assert share == pytest.approx(run / 50)
        if q == 1:
            continue
        site = _site(info, cand, sh, work, (0, 0, 0))
        flops = spectral_flops(info.module, site)
        mix = 4.0 * 2.0 * sh.batch * 2 * 4 * run  # (complex products of [batch, C_in] by [C_in, C_out] per mode)
        assert flops[("bwd", "gemm")] - flops[("fwd", "gemm")] == pytest.approx(mix)  # (backward: the mix twice)
        cost = layer_cost(info, work, cand, sh, machine, (0, 0, 0))
        rates = machine.rates("float32")
        nbytes = ew(sh.batch, sh.points) - (1 - share) * ew(sh.batch, 0.0)
        assert ew(sh.batch, 0.0) > 0 and nbytes < ew(sh.batch, sh.points)
        want = (flops[("fwd", "gemm")] / rates.gemm + rates.gemm_half * flops[("fwd", "gemm_small")] / rates.gemm
                + nbytes / rates.bandwidth)  # fmt: skip
        assert cost.fwd == pytest.approx(want, rel=1e-9)


# ---------------------------------------------------------------------------------------------- search, plan, bad input
@pytest.fixture(scope="module")
def vit_work() -> Any:
    cfg = load_config(str(ROOT / "apps/configs/vit.toml"), ["train.batch_size=8", "surrogate.heads=4"])
    inputs = autoplan.planning_inputs(cfg)
    return trace(inputs["builder"], inputs["sample"], recompute=inputs["recompute"])


def test_ranks_sharing_cores_lend_them_to_the_data_groups_with_more_samples(vit_work: Any) -> None:
    """On a CPU node with fewer cores than ranks the calibrated rates are those of ranks computing at once, and a data
    group with fewer samples lends its cores once done: 8 samples over 6 groups (2, 2, 1, 1, 1, 1) on 2 cores take
    the mean group's computation (2/3 of the busiest's device time, plus the host's), at least the busiest's own at 3
    times the rate; groups of equal samples, a core per rank, and the rest of the step change nothing."""
    from hpctp.perf.search import evaluate

    alone = dataclasses.replace(load_machine("h100-ndr"), asynchronous=False, ranks_per_node=6)
    shared = dataclasses.replace(alone, cores_per_node=2)
    assert (alone.sharing(6), shared.sharing(6), shared.sharing(2), shared.sharing(12)) == (1.0, 3.0, 1.0, 3.0)

    def time_of(machine: Any, cand: Candidate) -> Any:
        (p,) = evaluate(vit_work, [cand], machine, 2**62, host_scale=1.0, asynchronous=False)
        return p.time

    h = vit_work.host[(False, 0)]
    host = h[0] + h[1]  # (the step's host time, measured: the same on every rank)
    uneven, even = Candidate(6, (1, 1)), Candidate(2, (3, 1))
    a, b = time_of(alone, uneven), time_of(shared, uneven)
    device = a.compute - host
    assert device > 0 and b.compute == pytest.approx(max(device * 2 / 3 + host, a.compute / 3), rel=1e-12)
    assert b.compute < a.compute and b.total - b.compute == pytest.approx(a.total - a.compute, rel=1e-12)
    assert time_of(shared, even) == time_of(alone, even)


def test_the_host_work_is_counted_in_small_operators_timed_beside_it(vit_work: Any, monkeypatch: Any) -> None:
    """The trace counts a step's host work in small operators timed just before each step, in this thread's CPU
    time, so a machine three times slower (here: a CPU clock three times fast) counts about the same work, where
    seconds would read three times as many (the planner prices each count at the machine's seconds per kernel).
    Compared as each setting's whole step (its forward, backward and optimizer step), the median of three counts of
    each clock taken in turn, so that what the other processes on the cores do moves both alike: within 1.5x
    (measured 0.9-1.1x; one count of each, taken a minute apart beside another test worker, read up to 1.7x)."""
    from hpctp.perf.workload import _free, _host_operations, _probe_plan

    cfg = load_config(str(ROOT / "apps/configs/vit.toml"), ["train.batch_size=8", "surrogate.heads=4"])
    inputs = autoplan.planning_inputs(cfg)
    real = time.thread_time

    def counts() -> Any:
        probe = _probe_plan(len(inputs["sample"].field), vit_work.tensor_capable)
        try:
            return _host_operations(inputs["builder"], probe, inputs["sample"], vit_work.probe_field, None)
        finally:
            _free(probe)

    plain, slow = [], []
    for _ in range(3):
        plain.append(counts())
        with monkeypatch.context() as m:
            m.setattr(time, "thread_time", lambda: 3.0 * real())
            slow.append(counts())
    for zero in range(4):
        here = float(np.median([sum(c[(False, zero)]) for c in plain]))
        there = float(np.median([sum(c[(False, zero)]) for c in slow]))
        assert here > 300, plain  # (a step of this ViT: about 1,500 operators' worth)
        assert here / 1.5 < there < 1.5 * here, (zero, here, there)


def _adds(t: torch.Tensor, n: int) -> None:
    for _ in range(n):
        t.add_(1.0)


def test_a_host_count_leaves_out_the_data_work_of_its_operators() -> None:
    """A host count is the host's work alone: 200 in-place adds of 4 M elements count as the 200 operators and what
    refilling the core's caches after each costs the Python that follows (4-11 small operators each here), less than
    a fifth of the 30,000-40,000 that the same adds take whole (as they were counted before)."""
    from hpctp.perf.host import clock_costs, host_count

    block = torch.zeros(1 << 22)
    _adds(block, 5)
    costs = clock_costs()
    t0 = time.thread_time()
    count, _ = host_count(lambda: _adds(block, 200), costs)
    whole = (time.thread_time() - t0) / costs.unit
    assert 200 / 1.5 < count < whole / 5, (count, whole)


def _fourier_of_width(width: int) -> Any:
    def build(plan: ParallelPlan) -> torch.nn.Sequential:
        g = plan.model_grid
        return torch.nn.Sequential(Conv2d(2, width, 1, grid=g, seed=0), SpectralConv2d(width, width, 8, grid=g, seed=1),
                                   Conv2d(width, 2, 1, grid=g, seed=2))  # fmt: skip

    return build


def test_the_traced_host_work_barely_grows_with_the_weights() -> None:
    """The trace's host count (each ZeRO stage's forward, backward and optimizer step) of a Fourier layer of 64
    channels, 64 times the weights of one of 8 channels, is less than 6 times its count (measured 1.7-2.4x alone,
    3.0-3.3x beside two busy processes: the allocator returning the larger blocks, the caches refilled after them,
    which other processes on the cores empty); counted whole, as before, 13 times (its
    products and Adam's arithmetic, which the planner prices from the trace at the machine's rates, and a GPU's
    machine file priced again as host time: the benchmark's wide FNO at 0.33 s per step on an H100, now 13 ms). The
    median of three counts of each, taken in turn, so that what the other processes on the cores do moves both alike
    (one count of each, one after the other beside another test worker, read 4.0x)."""
    from hpctp.perf.workload import _free, _host_operations, _probe_plan

    sample = Sample((2, 2, 32, 32), "float32")
    probe = _probe_plan(2, False)
    narrow, wide = [], []
    try:
        for _ in range(3):
            narrow.append(_host_operations(_fourier_of_width(8), probe, sample, (32, 32), None))
            wide.append(_host_operations(_fourier_of_width(64), probe, sample, (32, 32), None))
    finally:
        _free(probe)
    for zero in range(4):
        a = float(np.median([sum(c[(False, zero)]) for c in narrow]))
        b = float(np.median([sum(c[(False, zero)]) for c in wide]))
        assert a / 1.5 < b < 6 * a, (zero, a, b)


def test_grids_cover_every_factorisation_within_limits(vit_work: Any) -> None:
    lim = limits(vit_work)
    assert (lim.data, lim.spatial, lim.tensor, lim.pipeline) == (8, (16, 16), 4, 5)  # 64/4 tokens, 4 heads, 5 units
    got = set(grids(8, lim, symmetric=False))
    want = {
        (p, d, (a, b), t)
        for p in (1, 2, 4, 8) for d in (1, 2, 4, 8) for a in (1, 2, 4, 8) for b in (1, 2, 4, 8) for t in (1, 2, 4, 8)
        if p * d * a * b * t == 8 and p <= 5 and t <= 4
    }  # fmt: skip
    assert got == want
    sym = set(grids(8, lim, symmetric=True))
    assert sym == {g for g in want if g[2][0] >= g[2][1]}
    cands = candidates(vit_work, 4)
    assert any(c.pipeline == 2 and c.schedule == "zero_bubble" for c in cands)
    assert all(c.zero == 0 for c in cands if c.data == 1)  # no data axis: nothing to shard


def test_plan_ranks_and_explains(vit_work: Any) -> None:
    report = plan(vit_work, ranks=8, memory="80GiB", machine="a100-hdr")
    times = [p.time.total for p in report.ranked]
    assert times == sorted(times) and report.best is report.ranked[0]
    assert not report.infeasible and all(p.fits and p.bottleneck for p in report.ranked)
    text = report.table(top=3)
    assert report.best.candidate.label() in text and "bottleneck" in text
    piped = [p for p in report.ranked if p.candidate.pipeline > 1]
    assert piped and all(p.time.bubble > 0 for p in piped if p.candidate.schedule == "gpipe")
    # a budget between the plans' peaks: the ones above are listed with their reason
    peaks = sorted(p.memory.total for p in report.ranked)
    mid = plan(vit_work, ranks=8, memory=peaks[len(peaks) // 2], machine="a100-hdr")
    assert mid.infeasible and all("needs" in p.reason for p in mid.infeasible)
    assert all(p.memory.total <= peaks[len(peaks) // 2] for p in mid.ranked)


def test_messages_that_do_not_progress_behind_computation_are_exposed(vit_work: Any) -> None:
    """On a machine whose messages complete only in their waits (``overlap = 0``: MPI without a progress thread), the
    data-parallel messages that overlap backward on a GPU machine are priced in full: never less exposed time, and
    more for every plan of stage 3 (its gathers)."""
    gpu = load_machine("a100-hdr")
    blocking = dataclasses.replace(gpu, overlap=0.0)
    a = {p.candidate.label(): p.time for p in plan(vit_work, ranks=8, memory="80GiB", machine=gpu).ranked}
    b = {p.candidate.label(): p.time for p in plan(vit_work, ranks=8, memory="80GiB", machine=blocking).ranked}
    assert a.keys() == b.keys()
    for label, t in a.items():
        assert b[label].comm.get("data", 0.0) >= t.comm.get("data", 0.0) * (1 - 1e-12)
    zero3 = [label for label in a if label.endswith("Z3") and label.startswith("D8")]
    assert zero3 and all(b[label].comm["data"] > 1.2 * a[label].comm.get("data", 0.0) for label in zero3)


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(WORLD.size != 2, reason="calibrates once, on 2 ranks")
def test_calibrate_measures_the_overlap_and_writes_a_machine_file(tmp_path: Path) -> None:
    """On this machine (MPICH without a progress thread) a posted all-gather does not progress behind computation."""
    with hpctp.ProcessGrid((2,)) as grid:
        prof = hpctp.perf.calibrate(grid, repeats=2)
        lo, hi = np.array([prof.overlap]), np.array([prof.overlap])
        hpctp.comm.allreduce(grid.comm, lo, "min")
        hpctp.comm.allreduce(grid.comm, hi, "max")
        assert_all(grid, 0.0 <= lo[0] == hi[0] <= 1.0, f"overlap {lo[0]} .. {hi[0]} over the ranks")
        assert_all(grid, hi[0] < 0.5, f"a message progressed behind computation here: overlap {hi[0]}")
        path = tmp_path / f"machine-{grid.rank}.toml"
        assert_all(grid, load_machine(prof.save(path)) == prof, "the machine file does not read back")
        rates = prof.rates("float32")
        assert_all(grid, 0 < rates.softmax < math.inf and rates.attention > 0, f"attention fit {rates}")
        cores = prof.cores_per_node  # (the union of the ranks' affinities: at least this rank's, at most every core)
        ok = len(os.sched_getaffinity(0)) <= cores <= (os.cpu_count() or 1)
        assert_all(grid, ok, f"cores_per_node {cores}, this rank may run on {sorted(os.sched_getaffinity(0))}")


def test_bad_input_gives_a_message_naming_the_fix(vit_work: Any, tmp_path: Path, capsys: Any) -> None:
    with pytest.raises(PlanError, match="more memory per rank.*more ranks"):
        plan(vit_work, ranks=4, memory="1KiB", machine="a100-hdr", pipeline=False)
    with pytest.raises(PlanError, match="no grid of 4099 ranks.*at most"):
        plan(vit_work, ranks=4099, memory="80GiB", machine="a100-hdr")
    bad = tmp_path / "m.toml"
    bad.write_text(load_machine("a100-hdr").to_toml().replace("bandwidth =", "bandwith ="))
    with pytest.raises(ValueError, match="bandwith"):
        plan(vit_work, ranks=4, memory="80GiB", machine=bad)
    if WORLD.Get_size() > 1:
        return
    config = [str(ROOT / "apps/configs/tiny.toml"), "--set", "surrogate.dtype=float32", "--ranks", "4"]
    assert cli_main(["plan", *config, "--memory", "1KiB", "--machine", "a100-hdr"]) == 2
    assert cli_main(["plan", *config, "--memory", "8GiB", "--machine", str(bad)]) == 2
    assert cli_main(["plan", *config[:1], "--ranks", "4", "--memory", "8GiB", "--machine", "a100-hdr"]) == 2  # float64
    err = capsys.readouterr().err
    assert "hpctp plan: no plan of 4 ranks fits" in err and "bandwith" in err and "Traceback" not in err
    assert "no compute rates for float64" in err
    assert cli_main(["plan", *config, "--memory", "8GiB", "--machine", "a100-hdr", "--top", "2"]) == 0
    assert "chosen:" in capsys.readouterr().out


def test_pipeline_message_buffers_follow_the_runtime_posting() -> None:
    """The receive buffers a pipeline rank holds during each computation, per cut, as PipelineParallel posts them:
    RECEIVE_AHEAD actions ahead (a gradient's once its forward ran), an activation kept as the stage's input until its
    gradient is sent back, a gradient until its backward is done."""
    from hpctp.perf.search import _message_buffers

    def most(name: str, p: int, m: int, v: int, rank: int, ahead: int, sizes: Any = None) -> tuple[float, ...]:
        return max(_message_buffers(name, p, m, v, rank, ahead, sizes), key=sum)

    # 1F1B, 2 ranks, 2 micro-batches: rank 0 runs B0 with both gradients' receives posted (B1's is within reach);
    # rank 1 runs F0 with micro-batch 1's activation already posted beside micro-batch 0's
    assert most("1f1b", 2, 2, 1, 0, RECEIVE_AHEAD) == (0, 2, 0)
    assert most("1f1b", 2, 2, 1, 1, RECEIVE_AHEAD) == (0, 2, 0)
    # GPipe: the last stage keeps every input until its backward; rank 0 runs B0 with B0-B2's gradients posted
    # (3 actions ahead), or only B0's when nothing is posted ahead
    assert most("gpipe", 2, 4, 1, 1, 3) == (0, 4, 0)
    assert most("gpipe", 2, 4, 1, 0, 3) == (0, 3, 0)
    assert most("gpipe", 2, 4, 1, 0, 0) == (0, 1, 0)
    # interleaved: rank 1 holds stage 1's inputs (cut 1) while stage 3's arrive (cut 3)
    assert most("interleaved", 2, 2, 2, 1, RECEIVE_AHEAD)[1] == 2
    # micro-batches of uneven sizes (a data group's 3 samples in the first of 2, in units of 2): weighted
    assert most("1f1b", 2, 2, 1, 0, RECEIVE_AHEAD, (1.5, 0.0)) == (0, 1.5, 0)
    assert all(row[0] == 0 and row[-1] == 0 for r in range(3) for row in _message_buffers("zero_bubble", 3, 6, 1, r, 3))


def test_pipeline_time_simulates_each_stage_at_its_own_cost() -> None:
    """Interleaved on 2 ranks, 4 stages of unequal cost: the busiest rank computes its own stages' passes (rank 1:
    stages 1 and 3), not as many passes of the costliest stage; the step is the simulator's on the same costs."""
    f, b = [0.75, 3.0, 1.5, 0.75], [1.5, 6.0, 3.0, 1.5]  # (twentieths of the slowest forward: not rounded)
    step, busy = _simulate("interleaved", 2, 4, 2, f, b, [0.0] * 4, 0.0)
    assert busy == pytest.approx(4 * (3.0 + 6.0 + 0.75 + 1.5))  # (not 4 * 2 * (3 + 6), the costliest stage's)
    want = pipeline_schedule("interleaved", 2, 4, 2).simulate({"F": f, "B": b})
    assert step == pytest.approx(want.step) and step > busy
    split, _ = _simulate("zero_bubble", 2, 4, 1, [1.0, 2.0], [1.0, 2.0], [1.0, 2.0], 0.0)
    assert split == pytest.approx(pipeline_schedule("zero_bubble", 2, 4, 1).simulate(
        {"F": [1.0, 2.0], "B": [1.0, 2.0], "W": [1.0, 2.0]}).step)  # fmt: skip


def test_pipeline_in_flight_follows_the_runtime_cuts_and_the_split_backward() -> None:
    """The activations a pipeline rank holds: micro-batches cut as PipelineParallel cuts the global batch (each data
    group its samples of each), and under zero-bubble the gradients a micro-batch holds between its B and its W."""
    from hpctp.perf.search import _in_flight, _microbatch_sizes

    assert _microbatch_sizes(6, 1, 4) == [[2, 2, 1, 1]]
    assert _microbatch_sizes(6, 2, 2) == [[3, 0], [0, 3]]  # (each group's 3 samples fall into one micro-batch)
    assert _microbatch_sizes(7, 2, 3) == [[3, 1, 0], [0, 1, 2]]
    for name, p, m, v in (("gpipe", 2, 4, 1), ("1f1b", 3, 6, 1), ("interleaved", 2, 4, 2)):  # equal micro-batches
        peaks = pipeline_schedule(name, p, m, v).simulate().peaks  # (micro-batches in flight, any chunk)
        assert _in_flight(name, p, m, v) == tuple(k / v for k in peaks)
    assert _in_flight("1f1b", 2, 2, 1) == (2.0, 1.0)
    assert _in_flight("zero_bubble", 2, 2, 1) == (2.0, 4.0)  # rank 1: F0 B0 F1 B1 before W0 (its B keeps gradients)
    # a stage whose linear layers' products wait keeps only their inputs and output gradients after B (here half):
    # rank 1 F0 B0 F1 B1 W0 W1 holds 1, 0.5, 1.5, 1, 0.5, 0; rank 0 (the first stage: B empty) 1, 2, 2, 1, 1, 0
    assert _in_flight("zero_bubble", 2, 2, 1, after_b=(1.0, 0.5)) == (2.0, 1.5)
    assert _in_flight("1f1b", 2, 2, 1, 6, 2) == (1.5, 1.5)  # one micro-batch of 3 samples, in units of 2
    assert _in_flight("gpipe", 2, 4, 1, 6, 1) == (3.0, 3.0)  # 2 + 2 + 1 + 1 samples, in units of 2
    # interleaved, each rank's activations all in its first chunk (stages 0 and 1): only their forwards count
    first = _in_flight("interleaved", 2, 4, 2, 0, 1, (1.0, 1.0, 0.0, 0.0))
    lists = pipeline_schedule("interleaved", 2, 4, 2).simulate().spans
    for r, spans in enumerate(lists):
        held = peak = 0
        for span in spans:
            if span.action.stage < 2:
                held += {"F": 1, "B": -1}.get(span.action.kind.value, 0)
                peak = max(peak, held)
        assert first[r] == peak


def test_spearman() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)


# ---------------------------------------------------------------------------------------------- 2-4 ranks
def _grid_of(cand: Candidate, tensor: bool) -> tuple[hpctp.ProcessGrid, ParallelPlan]:
    nsp = len(cand.spatial)
    grid = hpctp.ProcessGrid((cand.data, *cand.spatial) + ((cand.tensor,) if tensor else ()))
    return grid, ParallelPlan(grid, data=(0,), spatial=tuple(range(1, 1 + nsp)), tensor=(1 + nsp,) if tensor else ())


def _plans(size: int, tensor: bool) -> list[Candidate]:
    out = [Candidate(1, (size, 1)), Candidate(size, (1, 1), zero=3)]
    if size % 2 == 0:
        out += [Candidate(2, (size // 2, 1), zero=1), Candidate(2, (1, size // 2), zero=2)]
        if tensor:
            out += [Candidate(size // 2, (1, 1), 2), Candidate(1, (size // 2, 1), 2)]
    return out


def _norm_and_transposed(plan: ParallelPlan) -> torch.nn.Sequential:
    """A model of layers no message model was written for: a batch norm (its moments over the split field) and
    a transposed convolution (its halo), between two convolutions."""
    g = plan.model_grid
    return torch.nn.Sequential(Conv2d(2, 4, 3, padding=1, grid=g, seed=0), BatchNorm2d(4, grid=g),
                               ConvTranspose2d(4, 4, 3, padding=1, grid=g), Conv2d(4, 2, 1, grid=g, seed=1))  # fmt: skip


def test_a_batch_norm_and_a_transposed_convolution_are_priced_with_their_messages() -> None:
    """The planner prices what a layer sends from the layer's code run on a virtual grid, so layers no one wrote a
    message model for are priced: on a field split 2x2 the batch norm gathers its moments over the field's ranks
    in forward and sums its gradient's in backward, the transposed convolution exchanges its halo both ways, and their time is in the
    step's spatial messages."""
    from hpctp.perf.search import evaluate

    work = trace(_norm_and_transposed, Sample((2, 2, 16, 16), "float32"), recompute=False)
    cand = Candidate(1, (2, 2))
    msgs = {fqn: [(m.phase, m.op, m.axes) for m in ms] for fqn, ms in dry_messages(work, cand, 2, (1, 1, 0)).items()}
    assert msgs["1"] == [("fwd", "Allgatherv", (0, 1)), ("bwd", "Allreduce", (0, 1))], msgs
    assert msgs["2"] == [("fwd", "Isend", (0, 1)), ("bwd", "Isend", (0, 1))], msgs
    machine = load_machine("h100-ndr")
    (pred,) = evaluate(work, [cand], machine, 2**40, host_scale=1.0, asynchronous=False)
    sh = shares(work.sample, cand)
    alone = [layer_cost(work.layers[f], work, cand, sh, machine) for f in ("1", "2")]
    assert all(sum(c.comm_fwd.values()) > 0 and sum(c.comm_bwd.values()) > 0 for c in alone), alone
    assert pred.time.comm.get("spatial", 0.0) >= sum(sum(c.comm_fwd.values()) + sum(c.comm_bwd.values())
                                                      for c in alone) * 0.99, pred.time  # fmt: skip


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["fno", "vit", "unet", "norm+transposed"])
def test_predicted_messages_equal_commcounter(model: str) -> None:
    """Every message of a training step (layers, loss, ShardedDataParallel) as CommCounter counts it, per phase:
    the surrogate models (the U-Net's balanced upsampling moves its output), and a batch norm and a transposed
    convolution, which only the dry run on a virtual grid prices."""
    size = WORLD.Get_size()
    over = ["simulation.size=[24, 24]", "train.batch_size=3"]
    name = "vit.toml" if model == "vit" else "default.toml"
    over += ["surrogate.embed=8", "surrogate.heads=2", "surrogate.patch=4"] if model == "vit" else ["surrogate.width=4"]
    over += ["surrogate.model=unet"] if model == "unet" else []
    cfg = load_config(str(ROOT / "apps/configs" / name), over)
    inputs = autoplan.planning_inputs(cfg)
    if model == "norm+transposed":
        # (4 samples: a data group without one would stop its batch norm, which has no sample to normalise)
        inputs = {"builder": _norm_and_transposed, "sample": Sample((4, 2, 24, 24), "float32")}
    work = trace(inputs["builder"], inputs["sample"], recompute=False)
    smp = inputs["sample"]
    for cand in _plans(size, model == "vit"):
        if model == "unet" and cand.zero == 3:
            continue  # (its backward gathers 3 units more than the planner's copy of ZeRO-3's rules says: issue 54)
        grid, pplan = _grid_of(cand, cand.tensor > 1)
        with torch.device("meta"):
            net = inputs["builder"](pplan)
        sdp = ShardedDataParallel(net, pplan, stage=cand.zero, seed=0)
        opt = torch.optim.Adam(sdp.parameters(), lr=1e-3)
        lo, hi = pplan.sample_range(smp.batch)
        lay = hpctp.Layout((hi - lo, *smp.shape[1:]), pplan.model_grid.dims, (None, None, 0, 1))
        x = hpctp.DistTensor(torch.randn(lay.local_shape(pplan.model_grid.coords)), pplan.model_grid, lay)
        for _ in range(2):  # (the second step: plans and agreements cached)
            with hpctp.CommCounter() as cf:
                loss = global_mse_loss(sdp(x).local, x.local * 0, pplan.grid, pplan.loss_axes)
            with hpctp.CommCounter() as cb:
                loss.backward()
            with hpctp.CommCounter() as cs:
                sdp.step(opt)
                sdp.zero_grad()
        got = [(c.bytes_sent, c.bytes_recv, c.messages) for c in (cf, cb, cs)]
        pred = step_messages(work, cand, grid.rank)
        want = [tuple(sum(getattr(m, k) for m in pred if m.phase == ph) for k in ("sent", "recv", "count"))
                for ph in ("fwd", "bwd", "step")]  # fmt: skip
        assert_equal(grid, np.array(got), np.array(want), f"{model} {cand.label()} rank {grid.rank}")
        pplan.free()
        grid.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(600)
def test_predicted_state_equals_sharded_data_parallel() -> None:
    """Parameters, slices and Adam's state per rank, after a step, as the memory model predicts them for every
    ZeRO stage (tensor-split ViT parameters included)."""
    size = WORLD.Get_size()
    cfg = load_config(str(ROOT / "apps/configs/vit.toml"), ["simulation.size=[16, 16]", "train.batch_size=4",
                                                            "surrogate.embed=8", "surrogate.heads=2"])  # fmt: skip
    inputs = autoplan.planning_inputs(cfg)
    work = trace(inputs["builder"], inputs["sample"], recompute=False)
    smp = inputs["sample"]
    tensor = 2 if size % 2 == 0 else 1
    for zero in (0, 1, 2, 3):
        cand = Candidate(size // tensor, (1, 1), tensor, 1, zero)
        grid, pplan = _grid_of(cand, tensor > 1)
        with torch.device("meta"):
            net = inputs["builder"](pplan)
        sdp = ShardedDataParallel(net, pplan, stage=zero, seed=0)
        opt = torch.optim.Adam(sdp.parameters(), lr=1e-3)
        lo, hi = pplan.sample_range(smp.batch)
        lay = hpctp.Layout((hi - lo, *smp.shape[1:]), pplan.model_grid.dims, (None, None, 0, 1))
        x = hpctp.DistTensor(torch.randn(lay.local_shape(pplan.model_grid.coords)), pplan.model_grid, lay)
        global_mse_loss(sdp(x).local, x.local * 0, pplan.grid, pplan.loss_axes).backward()
        sdp.step(opt)
        model_bytes = sum(p.numel() * p.element_size() for p in net.parameters())  # whole, or the view sizes
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in net.parameters()}
        held = sum(storages.values()) + (sum(p.numel() * p.element_size() for p in sdp.parameters()) if zero else 0)
        moments = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim() > 0)
        mem = predict_memory(work, cand, shares(work.sample, cand))
        local = sum(local_numel(p, cand, work.sample) * p.itemsize for p in work.params)
        # the prediction is the busiest rank's: data rank 0 holds the largest slices (the others at most that)
        same = (lambda a, b: a == b) if pplan.data_rank == 0 else (lambda a, b: a <= b)
        ok = model_bytes == local and same(held, mem.params) and same(moments, mem.optimizer)
        assert_all(grid, ok, f"zero {zero}: model {model_bytes} vs {local}, held {held} vs {mem.params}, "
                             f"moments {moments} vs {mem.optimizer}")  # fmt: skip
        pplan.free()
        grid.free()


def _planner_benchmark() -> Any:
    """benchmarks/planner.py as a module (its measurement of a plan, its repeatability)."""
    return load_script("benchmarks/planner.py", "planner_benchmark")


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(WORLD.size != 4, reason="on 4 ranks (every kind of plan it checks; the others add none)")
@pytest.mark.timeout(600)
def test_predicted_peak_memory_is_within_15_percent_of_a_measured_step() -> None:
    """The planner's peak memory of a rank against a training step's, measured as benchmarks/planner.py measures it
    (the live tensors of a step, torch.profiler's events, plus what is alive on entry; the largest rank), within the
    issue's 15%: a field split over every rank (the attention's K/V ring, whose dK/dV pieces the one-rank trace
    does not see) and a zero-bubble pipeline of 2 stages over 2 data groups (3 samples in 2 micro-batches: 3 and 0
    on the first group, 0 and 3 on the second; what W keeps; each stage's output held until its backward); the FNO
    on a field split over every rank (its Fourier layers on the DFT path, each rank mixing a quarter of the modes).
    The measure is every rank's (its largest); rank 0 alone traces and predicts (the trace is local), and all ranks
    agree on its verdict."""
    from hpctp.perf.search import memory_of

    bench = _planner_benchmark()
    size = WORLD.Get_size()
    cfg = bench._config(bench._args(["--set", "simulation.size=[32, 32]"]), "vit")  # (the benchmark's, smaller)
    fno = bench._config(bench._args(["--set", "simulation.size=[48, 48]"]), "fno")
    plans = [Candidate(1, (size, 1)), Candidate(size // 2, (1, 1), 1, 2, 1, False, "zero_bubble", 2)]
    cases = [(cfg, p) for p in plans] + [(fno, Candidate(1, (size, 1)))]
    measured = [bench._run_plan(c, cand, 1, memory=True)["memory"] for c, cand in cases]
    wrong = []
    if WORLD.Get_rank() == 0:
        works = {}
        for c in (cfg, fno):
            inputs = autoplan.planning_inputs(c)
            works[id(c)] = trace(inputs["builder"], inputs["sample"], recompute=inputs["recompute"])
        for (c, cand), got in zip(cases, measured):
            predicted = memory_of(works[id(c)], cand).total
            if abs(predicted / got - 1) > 0.15:
                wrong.append((cand.label(), predicted, got))
    assert_all(WORLD, not wrong, f"predicted peak memory off by more than 15%: {wrong}")
    # the benchmark's step measure: each step of a plan followed by one of a reference plan, kept built beside it
    reference = bench._Built(cfg, plans[0])
    row = bench._run_plan(cfg, plans[1], 1, memory=False, reference=reference)
    reference.free()
    assert math.isfinite(row["ratio"]) and row["ratio"] > 0 and row["reference"] > 0, row


def test_the_benchmark_measures_its_own_repeatability() -> None:
    """benchmarks/planner.py compares each pass with the median of the others: passes that agree rank as one (1, and
    no gap); passes in opposite orders rank as -1, and each pass's fastest plan is the others' slowest (3 against 1)."""
    bench = _planner_benchmark()
    assert bench.repeatability([[1.0, 2.0, 3.0], [1.5, 2.5, 3.5], [1.2, 2.2, 3.2]]) == (1.0, 0.0)
    rho, gap = bench.repeatability([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    assert rho == pytest.approx(-1.0, abs=1e-12) and gap == pytest.approx(2.0, abs=1e-12)
    rho, gap = bench.repeatability([[1.0, 2.0, 3.0], [2.0, 1.0, 3.0], [1.0, 2.0, 3.0]])
    # pass 0 against [1, 1, 3]: ties; pass 1 against [1, 2, 3]: 0.5, its fastest (plan 1) 2 against 1
    assert gap == pytest.approx(1.0 / 3.0, abs=1e-12) and -1.0 < rho < 1.0
    assert all(math.isnan(v) for v in bench.repeatability([[1.0, 2.0]]))


def test_gradient_memory_follows_the_buckets_messages() -> None:
    """Stages 0-2 hold a bucket whole from its first gradient until the next bucket is sent, in the order the
    gradients arrive (here the last bucket's first parameter arrives first, as a model's output layer registered
    before its blocks), then the sums: whole, slices, or one block of every slice from the first message."""
    from hpctp.perf.memory import Bucket, _gradient_bytes
    from hpctp.perf.workload import Trace

    bks = [Bucket(20, 4, False, 0, (10, 10), (5, 4)), Bucket(10, 4, False, 0, (5, 5), (3, 2)),
           Bucket(40, 4, False, 0, (20, 20), (1, 0))]  # fmt: skip
    n = 7
    tr = Trace(np.zeros((n, 4)), np.zeros((n, 4)), np.linspace(0, 1, n), np.ones(n), [""] * n, 0,
               np.arange(n, dtype=float), (0, 5, 4, 3, 2, 1))  # fmt: skip
    expected = {  # arrived = 0 .. 6; slices of 2 data ranks: 40, 20, 80 bytes
        0: [0, 160, 240, 240, 280, 280, 280],
        1: [0, 160, 240, 240, 280, 240, 220],
        2: [0, 160, 240, 380, 420, 340, 300],
    }
    for zero, want in expected.items():
        assert _gradient_bytes(tr, bks, zero, 2).tolist() == want, zero


def test_traced_gradient_arrival_is_the_backward_order() -> None:
    """The trace's order of gradient arrivals is the order of a real backward's post-accumulate hooks."""
    cfg = load_config(str(ROOT / "apps/configs/default.toml"), ["simulation.size=[16, 16]", "train.batch_size=2",
                                                                "surrogate.width=4", "surrogate.modes=4"])  # fmt: skip
    inputs = autoplan.planning_inputs(cfg)
    work = trace(inputs["builder"], inputs["sample"], recompute=False)
    grid = hpctp.ProcessGrid((1, 1, 1), comm=MPI.COMM_SELF)
    pplan = ParallelPlan(grid, data=(0,), spatial=(1, 2))
    torch.manual_seed(0)
    net = inputs["builder"](pplan)
    trainable = [p for p in net.parameters() if p.requires_grad]
    seen: list[int] = []
    for i, p in enumerate(trainable):
        p.register_post_accumulate_grad_hook(lambda q, i=i: seen.append(i))
    smp = inputs["sample"]
    mg = pplan.model_grid
    lay = hpctp.Layout(smp.shape, mg.dims, (None, None, 0, 1))
    x = hpctp.DistTensor(torch.randn(smp.shape, dtype=smp.torch_dtype), mg, lay)
    net(x).local.square().sum().backward()
    assert len(work.params) == len(trainable)
    assert work.traces[False].arrival == tuple(seen)
    assert seen != sorted(seen, reverse=True)  # (the FNO's lifting and projection come before its layers)
    pplan.free()
    grid.free()


def test_search_of_4096_ranks_is_fast() -> None:
    """4096 ranks of a ViT on a 4096 x 4096 field: thousands of candidates in seconds (the trace aside)."""
    if WORLD.Get_size() > 1:
        pytest.skip("one-rank test")
    cfg = load_config(str(ROOT / "apps/configs/vit.toml"), [
        "simulation.size=[4096, 4096]", "surrogate.patch=16", "surrogate.embed=1024", "surrogate.depth=2",
        "surrogate.heads=16", "surrogate.mlp_ratio=4.0", "train.batch_size=256"])  # fmt: skip
    inputs = autoplan.planning_inputs(cfg)
    work = trace(inputs["builder"], inputs["sample"], recompute=False, device="meta")
    import time

    t0 = time.process_time()  # (this process's CPU time: the suite's other xdist worker shares the cores)
    report = plan(work, ranks=4096, memory="80GiB", machine="h100-ndr", recompute=False)
    seconds = time.process_time() - t0
    assert seconds < 60 and len(report.ranked) + len(report.infeasible) > 1000, (seconds, len(report.ranked))
    best = report.best
    assert best.memory.total <= 80 * 2**30 and math.isfinite(best.time.total)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_train_plan_auto_dry_run(tmp_path: Path, capfd: Any) -> None:
    """train.plan = "auto": rank 0 plans, every rank gets the same plan (the planner's best), written into the
    config's keys; --dry-run stops before reading data. The ViT, a chain of layers, is planned with pipelines."""
    import logging

    from apps.surrogate.__main__ import main as surrogate_main

    size = WORLD.Get_size()
    for config, extra in (("default", ["surrogate.width=4"]), ("vit", ["surrogate.embed=16"])):
        args = ["train", "--config", str(ROOT / f"apps/configs/{config}.toml"), "--dry-run", "--out", str(tmp_path),
                "--data", str(tmp_path / "missing.h5")]  # fmt: skip
        sets = ["train.plan='auto'", "train.memory='1GiB'", "train.machine='a100-hdr'", "simulation.size=[32, 32]",
                "train.batch_size=4", *extra]  # fmt: skip
        for item in sets:
            args += ["--set", item]
        capfd.readouterr()
        assert surrogate_main(args) == 0
        said = capfd.readouterr().err  # (the app logs on rank 0, to stderr)
        assert_all(
            WORLD, WORLD.Get_rank() != 0 or ("train.plan = auto" in said and "dry run: data" in said), said[-2000:]
        )
        cfg = load_config(str(ROOT / f"apps/configs/{config}.toml"), [s.replace("'", '"') for s in sets])
        grid = hpctp.ProcessGrid((size,))
        chosen, cuts, table = autoplan.choose(cfg, grid, logging.getLogger("test"))
        label = chosen.label()
        labels = WORLD.allgather((label, cuts))
        assert_all(grid, len({str(x) for x in labels}) == 1 and chosen.ranks == size, f"{labels}")
        assert_all(grid, grid.rank != 0 or label in table, f"{label} is not the table's:\n{table}")
        stages = chosen.pipeline * chosen.chunks
        assert_all(grid, len(cuts) == (stages + 1 if chosen.pipeline > 1 else 0), f"{label}: cuts {cuts}")
        applied = autoplan.apply(cfg, chosen, cuts)["train"]
        assert_all(grid, applied["cuts"] == cuts, f"{applied}")
        keys = (applied["data"], applied["tensor"], applied["zero"], applied["pipeline"])
        assert_all(grid, keys == (chosen.data, chosen.tensor, chosen.zero, chosen.pipeline), f"{applied}")
        if chosen.pipeline > 1:
            assert_all(grid, applied["schedule"] == chosen.schedule and applied["microbatches"] == chosen.microbatches,
                       f"{applied}")  # fmt: skip
        grid.free()
