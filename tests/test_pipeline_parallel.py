"""PipelineParallel against one process: every schedule on pipeline x data / tensor / spatial grids, activations that
are tuples of tensors (skips, the input carried to a residual), uneven layer counts and micro-batches, ZeRO 1-2 per
stage, activation checkpointing, models built on meta; the messages it sends; bad input refused on every rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.sharded import torch_step
from mpi4py import MPI

import hpctp
from hpctp.nn import ParallelMLP, ParallelPlan, PipelineParallel, global_mse_loss, global_state_dict
from hpctp.testing import assert_all, assert_allclose, assert_equal

WORLD = MPI.COMM_WORLD
ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64
N, M, STEPS = 7, 3, 5  # 7 samples in 3 micro-batches (3, 2, 2 on one data group)
E, H, C, FH, FW = 4, 5, 2, 7, 5  # features, hidden units (5 over 2), channels, field rows (7 over 3), columns


def _mlp(grid: hpctp.ProcessGrid | None) -> list[torch.nn.Module]:
    """9 layers: Linear, Tanh, ... (cut unevenly by most stage counts)."""
    torch.manual_seed(0)
    out: list[torch.nn.Module] = []
    for _ in range(5):
        out += [torch.nn.Linear(E, E, dtype=F64), torch.nn.Tanh()]
    return out[:-1]


def _tensor(grid: hpctp.ProcessGrid, axis: int = 0) -> list[torch.nn.Module]:
    """ParallelMLP blocks (hidden units over the tensor axis) with tanh between; on a 1-rank grid the reference."""
    out: list[torch.nn.Module] = []
    for k in range(3):
        out += [ParallelMLP(E, H, grid, axis=axis, seed=10 + k, dtype=F64), torch.nn.Tanh()]
    return out[:-1]


def _spatial(grid: hpctp.ProcessGrid, axis: int = 0) -> list[torch.nn.Module]:
    """3x3 convolutions (rows over the spatial axis: halo exchanges) with tanh between; DistTensor activations."""
    out: list[torch.nn.Module] = []
    for k in range(4):
        out += [hpctp.nn.Conv2d(C, C, 3, padding=1, grid=grid, split=(axis, None), seed=20 + k, dtype=F64)]
        out += [torch.nn.Tanh()]
    return out[:-1]


class _Carry(torch.nn.Module):
    """x -> (x, x): the input travels beside the features, to the residual at the end."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x, x)


class _Push(torch.nn.Module):
    """(x, *skips) -> (x, *skips, tanh(linear(skips[-1]))): a tuple that grows (a U-Net's way down)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(E, E, dtype=F64)

    def forward(self, t: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (*t, torch.tanh(self.linear(t[-1])))


class _Merge(torch.nn.Module):
    """(x, *skips, a, b) -> (x, *skips, linear([a, b])): the way up."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2 * E, E, dtype=F64)

    def forward(self, t: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (*t[:-2], self.linear(torch.cat([t[-2], t[-1]], dim=1)))


class _Residual(torch.nn.Module):
    """(x, h) -> x + linear(h)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(E, E, dtype=F64)

    def forward(self, t: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, h = t
        return x + self.linear(h)


def _skips(grid: hpctp.ProcessGrid | None) -> list[torch.nn.Module]:
    """8 layers whose activations are tuples of 2 to 4 tensors (the input carried to a residual, skips)."""
    torch.manual_seed(0)
    return [_Carry(), _Push(), _Push(), _Push(), _Merge(), _Merge(), _Merge(), _Residual()]


def _batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    shape = (N, C, FH, FW) if kind == "spatial" else (N, E)
    return torch.randn(shape, generator=g, dtype=F64), torch.randn(shape, generator=g, dtype=F64)


def _share(plan: ParallelPlan, kind: str, x: torch.Tensor) -> Any:
    """This data group's samples; a field split over the spatial axis as a DistTensor on the model grid."""
    a, b = plan.sample_range(N)
    part = x[a:b].contiguous()
    if kind != "spatial":
        return part
    return hpctp.distribute(part, plan.model_grid, (None, None, plan.spatial[0], None))


def _loss(plan: ParallelPlan, kind: str) -> Callable[[Any, Any], torch.Tensor]:
    def loss(pred: Any, target: Any) -> torch.Tensor:
        p = pred.local if kind == "spatial" else pred
        t = target.local if kind == "spatial" else target
        return global_mse_loss(p, t, plan.grid, plan.loss_axes)

    return loss


def _layers(kind: str, plan: ParallelPlan | None) -> list[torch.nn.Module]:
    if kind in ("mlp", "skips"):
        return _mlp(None) if kind == "mlp" else _skips(None)
    grid = plan.model_grid if plan is not None else hpctp.ProcessGrid((1,), comm=MPI.COMM_SELF)
    axis = (plan.tensor or plan.spatial or (0,))[0] if plan is not None else 0
    return (_tensor if kind == "tensor" else _spatial)(grid, axis)


def _reference(kind: str) -> tuple[torch.nn.Module, list[float]]:
    """One process on the whole batch: the trained model and its losses."""
    ref = torch.nn.Sequential(*_layers(kind, None))
    opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    losses = []
    for s in range(STEPS):
        losses.append(torch_step(ref, opt, *_batch(kind, s)))
    return ref, losses


# (grid dims, data axes, tensor axes, pipeline axis, model kind, [(schedule, virtual, zero, checkpointing, meta)])
ALL = [("gpipe", 1, None, False, False), ("1f1b", 1, None, False, False), ("interleaved", 2, None, False, False),
       ("zero_bubble", 1, None, False, False)]  # fmt: skip
_PLANS = {
    1: [((1,), (), (), 0, "mlp", ALL), ((1,), (), (), 0, "skips", [("zero_bubble", 1, None, False, False)])],
    2: [
        (
            (2,),
            (),
            (),
            0,
            "mlp",
            [
                *ALL,
                ("1f1b", 1, 1, False, False),
                ("zero_bubble", 1, 2, False, False),
                ("1f1b", 1, None, True, False),
                ("interleaved", 2, None, False, True),
            ],
        ),
        ((2,), (), (), 0, "skips", [*ALL, ("1f1b", 1, 2, False, False)]),
        # (hpctp's linear layers: zero-bubble's W computes their weight gradients; [Note: deferred weight gradients])
        ((2,), (), (), 0, "tensor", [("zero_bubble", 1, None, False, False), ("zero_bubble", 1, 2, False, False)]),
    ],  # fmt: skip
    3: [
        (
            (3,),
            (),
            (),
            0,
            "mlp",
            [
                ("1f1b", 1, None, False, False),
                ("zero_bubble", 1, None, False, False),
                ("interleaved", 2, None, False, False),
            ],
        ),
        ((3,), (), (), 0, "skips", [("zero_bubble", 1, None, False, False)]),
    ],  # fmt: skip
    4: [
        ((2, 2), (1,), (), 0, "mlp", [*ALL, ("1f1b", 1, 1, False, False), ("zero_bubble", 1, 2, True, False)]),
        ((2, 2), (1,), (), 0, "skips", [("interleaved", 2, 1, False, False)]),
        (
            (2, 2),
            (),
            (1,),
            0,
            "tensor",
            [
                ("1f1b", 1, None, False, False),
                ("zero_bubble", 1, None, False, False),
                ("interleaved", 2, 2, False, True),
            ],
        ),
    ],  # fmt: skip
    6: [
        ((3, 2), (1,), (), 0, "mlp", [("1f1b", 1, 2, False, False), ("zero_bubble", 1, None, False, True)]),
        ((2, 3), (), (), 0, "spatial", [*ALL, ("1f1b", 1, 1, True, False)]),
    ],  # fmt: skip
}
CASES = [
    pytest.param(dims, data, tensor, pipe, kind, *run,
                 id=f"{'x'.join(map(str, dims))}-{kind}-{run[0]}-zero{run[2]}{'-ckpt' if run[3] else ''}{'-meta' if run[4] else ''}")
    for dims, data, tensor, pipe, kind, runs in _PLANS.get(WORLD.size, [])
    for run in runs
]  # fmt: skip


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("dims", "data", "tensor", "pipe", "kind", "schedule", "virtual", "zero", "ckpt", "meta"), CASES
)
def test_pipeline_trains_as_one_process(dims: tuple[int, ...], data: tuple[int, ...], tensor: tuple[int, ...], pipe: int, kind: str, schedule: str, virtual: int, zero: int | None, ckpt: bool, meta: bool) -> None:  # fmt: skip
    """5 Adam steps: the losses and every stage's parameters equal one process's to 1e-10 (float64)."""
    with hpctp.ProcessGrid(dims) as grid:
        plan = ParallelPlan(grid, data=data, tensor=tensor, pipeline=pipe)
        if meta:
            with torch.device("meta"):
                layers = _layers(kind, plan)
        else:
            layers = _layers(kind, plan)
        if ckpt:
            for layer in layers:
                if any(True for _ in layer.parameters()):
                    hpctp.nn.checkpoint_forward(layer)
        model = PipelineParallel(layers, plan, schedule=schedule, microbatches=M, virtual=virtual, zero=zero, seed=0)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        losses = []
        for s in range(STEPS):
            x, y = _batch(kind, s)
            losses.append(model.step(_share(plan, kind, x), _share(plan, kind, y), _loss(plan, kind), optimizer=opt))
            model.zero_grad()
        ref, want = _reference(kind)
        assert_allclose(grid, np.array(losses), np.array(want), rtol=1e-10, what="losses")
        full = ref.state_dict()
        worst, where = 0.0, ""
        for stage, module in model.modules_of.items():  # (collective over each stage's ranks only)
            if zero is None:
                got = global_state_dict(module, grid=plan.model_grid)
            else:
                with module.gathered() as (inner, _):
                    got = {k: v.clone() for k, v in global_state_dict(inner, grid=plan.model_grid).items()}
            for name, value in got.items():
                err = float((value - full[name]).abs().max() / (full[name].abs().max() + 1e-300))
                if err > worst:
                    worst, where = err, f"stage {stage}: {name}"
        assert_all(grid, worst <= 1e-10, f"parameters: {where} off by {worst:.2e} (relative)")
        plan.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero_bubble"])
def test_messages_per_step_and_boundary(schedule: str) -> None:
    """After the first step (which also describes each boundary's activations once per micro-batch size), a step sends
    on the pipeline axis exactly m activations forward and m gradients back per stage boundary (v boundaries per rank
    pair interleaved), of the activations' bytes, and nothing else (the loss reaches every rank over the whole grid:
    a p x 1 grid, whose pipeline axis is a communicator of its own)."""
    virtual = 2 if schedule == "interleaved" else 1
    with hpctp.ProcessGrid((WORLD.size, 1)) as grid:
        plan = ParallelPlan(grid, pipeline=0)
        model = PipelineParallel(_mlp(None) + _mlp(None), plan, schedule=schedule, microbatches=M, virtual=virtual)
        x, y = _batch("mlp", 0)
        model.step(x, y, _loss(plan, "mlp"))
        model.zero_grad()
        with hpctp.CommCounter() as counter:
            model.step(x, y, _loss(plan, "mlp"))
        stats = counter.per_comm.get(plan.pipeline_comm.Get_name())
        p, n_stages, r = plan.pipeline_size, model.schedule.n_stages, plan.pipeline_rank
        sends = sum(1 for s in model.stages if s + 1 < n_stages) + sum(1 for s in model.stages if s > 0)
        sizes = [3, 2, 2]  # (7 samples over 3 micro-batches)
        want_messages = sends * M
        want_bytes = sends * sum(sizes) * E * 8
        got = (stats.messages, stats.bytes_sent) if stats is not None else (0, 0)
        assert_equal(
            grid, got, (want_messages, want_bytes), f"rank {r} of {p}: messages and bytes on the pipeline axis"
        )
        assert_equal(
            grid, sorted(stats.calls) if stats is not None else [], ["Irecv", "Isend"], "only sends and receives"
        )
        plan.free()


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a first stage that ends its step well after the last stage ends its own."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP)
        return g


class _Slow(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x)


SLEEP = 0.05


@pytest.mark.mpi(min_size=2)
def test_the_measured_bubble_counts_a_rank_done_early_as_idle() -> None:
    """idle_fraction() is 1 - busy / step with the slowest rank's step (step_seconds, the same on every rank): the
    last stage, done while the first still runs its backward (a sleep per micro-batch), idles until the step ends."""
    with hpctp.ProcessGrid((WORLD.size, 1)) as grid:
        plan = ParallelPlan(grid, pipeline=0)
        mlp = _mlp(None)
        layers = [mlp[0], _Slow(), *mlp[1:]]  # (the first stage: a linear layer and the sleep)
        p = WORLD.size
        cuts = [0, 2, *(2 + (len(layers) - 2) * k // (p - 1) for k in range(1, p))]
        model = PipelineParallel(layers, plan, schedule="gpipe", microbatches=M, cuts=cuts)
        x, y = _batch("mlp", 0)
        model.step(x, y, _loss(plan, "mlp"))
        (_, start, end), spans = model.timeline[0], model.timeline[1:]
        busy = sum(e - s for _, s, e in spans)
        every = WORLD.allgather(model.step_seconds)
        assert_all(grid, len(set(every)) == 1 and model.step_seconds >= end - start, f"step_seconds {every}")
        assert_allclose(grid, np.array([model.idle_fraction()]), np.array([1 - busy / model.step_seconds]), rtol=1e-12)
        if plan.pipeline_rank == p - 1:  # (the last stage's last backward ends before the first's M sleeps)
            early = model.step_seconds - (end - start)
        else:
            early = SLEEP
        assert_all(grid, early >= 0.5 * SLEEP, f"the last stage ended {early:.3f} s before the step (want >= sleep/2)")
        plan.free()


@pytest.mark.mpi(min_size=2)
def test_a_stage_lets_go_of_what_it_sent() -> None:
    """A stage's peak of live tensors (torch.profiler's memory events) does not grow with the micro-batch count under
    1F1B: the activations a stage sends on (once its backward is done with them) and the input gradients it sends
    back are let go once their messages complete, not kept until the step ends (one per micro-batch)."""
    width, rows = 256, 4
    dx = rows * width * 4  # (one micro-batch's activation or input gradient, float32)
    with hpctp.ProcessGrid((WORLD.size, 1)) as grid:
        plan = ParallelPlan(grid, pipeline=0)
        p = WORLD.size
        peaks = []
        for m in (2 * p, 6 * p):
            torch.manual_seed(0)
            model = PipelineParallel([torch.nn.Linear(width, width) for _ in range(p)], plan, schedule="1f1b",
                                     microbatches=m)  # fmt: skip
            x, y = torch.randn(m * rows, width), torch.randn(m * rows, width)

            def loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                return global_mse_loss(out, t, plan.grid, plan.loss_axes)

            model.step(x, y, loss)  # (descriptions exchanged, gradients allocated)
            with hpctp.PeakMemory(tensors=True) as mem:
                model.step(x, y, loss)
            peaks.append(mem.tensors)
        grown = peaks[1] - peaks[0]
        assert_all(grid, grown < dx,
                   f"stage {plan.pipeline_rank}: the peak grew by {grown} bytes from m = {2 * p} to {6 * p} "
                   f"(one micro-batch's activation or gradient: {dx})")  # fmt: skip
        plan.free()


@pytest.mark.mpi
def test_bad_pipelines_are_refused_on_every_rank() -> None:
    """Before any message: cuts that leave a stage empty, too few layers, zero=3 with zero-bubble, an axis with two
    roles, a batch smaller than the micro-batch count."""
    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, pipeline=0)
        p = plan.pipeline_size
        with pytest.raises(ValueError, match="cannot fill"):
            PipelineParallel(_mlp(None)[:1], plan, microbatches=2, virtual=2, schedule="interleaved")
        with pytest.raises(ValueError, match="leave stages .* empty"):
            PipelineParallel(
                _mlp(None) + _mlp(None),
                plan,
                microbatches=2,
                virtual=2,
                schedule="interleaved",
                cuts=[0] * 2 * p + [18],
            )
        with pytest.raises(ValueError, match="zero=3 .* zero-bubble"):
            PipelineParallel(_mlp(None), plan, microbatches=2, schedule="zero_bubble", zero=3)
        with pytest.raises(ValueError, match="name an axis twice"):
            ParallelPlan(grid, data=(0,), pipeline=0)
        model = PipelineParallel(_mlp(None), plan, microbatches=4)
        x = torch.zeros(3, E, dtype=F64)
        with pytest.raises(ValueError, match="a batch of 3 samples cannot fill 4 micro-batches"):
            model.step(x, x, _loss(plan, "mlp"))
        plan.free()


@pytest.mark.mpi
def test_stages_balanced_by_parameters_or_a_profiling_pass() -> None:
    """Without cuts the stages are balanced: by parameter count (the cuts balanced_cuts gives for them), or by one
    profiling pass over a sample (measured time, the same cuts on every rank), each stage's share reported."""
    from hpctp.nn.pipeline_parallel import balanced_cuts

    with hpctp.ProcessGrid((WORLD.size,)) as grid:
        plan = ParallelPlan(grid, pipeline=0)
        torch.manual_seed(0)
        widths = [E, 24, E, 12, E, 2, E]
        layers = [torch.nn.Linear(a, b, dtype=F64) for a, b in zip(widths, widths[1:])]
        model = PipelineParallel(layers, plan, microbatches=2)
        costs = [1.0 + sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
        assert_equal(grid, list(model.cuts), list(balanced_cuts(costs, plan.pipeline_size)), "cuts by parameters")
        assert_all(grid, abs(sum(share for _, _, _, share, _, _ in model.balance) - 1.0) < 1e-12, "shares sum to 1")
        x = torch.randn(3, E, dtype=F64)
        measured = PipelineParallel(layers, plan, microbatches=2, sample=x)
        cuts = hpctp.comm.allgather_ints(grid.comm, list(measured.cuts))
        assert_all(grid, bool((cuts == cuts[0]).all()), f"every rank cuts alike: {cuts.tolist()}")
        assert_all(
            grid, all(b > a for a, b in zip(measured.cuts, measured.cuts[1:])), f"no empty stage {measured.cuts}"
        )
        plan.free()


@pytest.mark.mpi(min_size=4)
def test_batches_of_every_size_down_to_the_microbatch_count() -> None:
    """Batches of 2, 3, 4 and 2 samples over 2 data groups and 2 micro-batches: one group's share changes while the
    other's stays (every rank still agrees on the cut), and a batch of 2 puts one sample in each micro-batch, not
    both in the first (no micro-batch empty on every group): the losses and parameters of one process."""
    if WORLD.size % 2:
        pytest.skip("needs an even rank count (a 2 x k grid)")
    with hpctp.ProcessGrid((2, WORLD.size // 2)) as grid:
        plan = ParallelPlan(grid, data=(1,), pipeline=0)
        model = PipelineParallel(_mlp(None), plan, schedule="1f1b", microbatches=2)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        ref = torch.nn.Sequential(*_mlp(None))
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
        got, want = [], []
        for k, n in enumerate((2, 3, 4, 2)):
            x, y = (t[:n] for t in _batch("mlp", k))
            a, b = plan.sample_range(n)
            got.append(model.step(x[a:b], y[a:b], _loss(plan, "mlp"), optimizer=opt))
            model.zero_grad()
            want.append(torch_step(ref, ref_opt, x, y))
        assert_allclose(grid, np.array(got), np.array(want), rtol=1e-10, what="losses")
        plan.free()


@pytest.mark.skipif(WORLD.size > 1, reason="launches its own mpiexec job; run from the 1-rank session")
def test_a_stage_failing_mid_step_ends_the_job(tmp_path: Path) -> None:
    """The second stage fails on the values the first sends (the shapes fit, so the check before the step passes):
    its rank reports the stage, the action and the schedule, and run_main ends the job (the first rank, waiting for
    a gradient, does not hang)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "HPCTP_"))}
    env.update(OMP_NUM_THREADS="1", MPIR_CVAR_ENABLE_HEAVY_YIELD="1", PYTHONPATH=str(ROOT))
    script = ROOT / "tests" / "scripts" / "pipeline_fault.py"
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)  # fmt: skip
    assert proc.returncode != 0
    assert "[rank 1/2] error" in proc.stderr, proc.stderr[-3000:]
    assert "PipelineParallel: pipeline rank 1 failed at step" in proc.stderr
    assert "1F0" in proc.stderr and "is out of bounds for dimension 0 with size 4" in proc.stderr


def _relayout_chain(grid: hpctp.ProcessGrid, reshaped: hpctp.ProcessGrid | None) -> list[torch.nn.Module]:
    """Rows split, then columns (a Redistribute), then rows again, or (``reshaped``) both dims on another shape of the
    same ranks: 3x3 convolutions with tanh between; the Redistribute layers start stages 1 and 2."""
    axis = 0
    out: list[torch.nn.Module] = [
        hpctp.nn.Conv2d(C, C, 3, padding=1, grid=grid, split=(axis, None), seed=30, dtype=F64), torch.nn.Tanh(),
        hpctp.nn.Redistribute((None, None, None, axis)),
        hpctp.nn.Conv2d(C, C, 3, padding=1, grid=grid, split=(None, axis), seed=31, dtype=F64), torch.nn.Tanh(),
    ]  # fmt: skip
    if reshaped is None:
        out += [hpctp.nn.Redistribute((None, None, axis, None)),
                hpctp.nn.Conv2d(C, C, 3, padding=1, grid=grid, split=(axis, None), seed=32, dtype=F64)]  # fmt: skip
    else:
        out += [hpctp.nn.Redistribute((None, None, 0, 1), grid=reshaped),
                hpctp.nn.Conv2d(C, C, 3, padding=1, grid=reshaped, split=(0, 1), seed=32, dtype=F64)]  # fmt: skip
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("reshaped", [False, True], ids=["splits", "grid-shape"])
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_layout_changes_between_stages_travel_in_the_pipeline_messages(schedule: str, reshaped: bool) -> None:
    """A field cut by rows, then by columns, then by rows again (or over both dims of another grid shape), with the
    stages starting at the Redistribute layers: 5 Adam steps equal one process; after the first step nothing goes
    to a rank's counterpart on the next stage as a whole: every piece goes straight to the rank that keeps it (one
    message each way per piece and micro-batch), and no stage redistributes again."""
    p = 3 if WORLD.size % 3 == 0 else (2 if WORLD.size % 2 == 0 else 1)
    with hpctp.ProcessGrid((p, WORLD.size // p)) as grid:
        plan = ParallelPlan(grid, pipeline=0)
        grid.comm.Set_name("test.pipeline.grid")  # (the model grid's halo messages are counted apart)
        mgrid = plan.model_grid
        other = hpctp.ProcessGrid((1, mgrid.size), comm=mgrid.comm) if reshaped else None
        cuts = {1: (0, 7), 2: (0, 2, 7), 3: (0, 2, 5, 7)}[p]
        model = PipelineParallel(_relayout_chain(mgrid, other), plan, schedule=schedule, microbatches=M, cuts=cuts)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        losses = []
        for s in range(STEPS):
            x, y = _batch("spatial", s)
            xs = hpctp.distribute(x, mgrid, (None, None, 0, None))
            out_split = (None, None, 0, 1) if reshaped else (None, None, 0, None)
            ys = hpctp.distribute(y, other if reshaped else mgrid, out_split)
            if s == 1:
                with hpctp.CommCounter() as counter:
                    losses.append(model.step(xs, ys, _loss(plan, "spatial"), optimizer=opt))
            else:
                losses.append(model.step(xs, ys, _loss(plan, "spatial"), optimizer=opt))
            model.zero_grad()
        one = hpctp.ProcessGrid((1,), comm=MPI.COMM_SELF)
        alone = hpctp.ProcessGrid((1, 1), comm=MPI.COMM_SELF) if reshaped else None
        ref = torch.nn.Sequential(*_relayout_chain(one, alone))
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
        want = []
        for s in range(STEPS):
            want.append(torch_step(ref, ref_opt, *_batch("spatial", s)))
        assert_allclose(grid, np.array(losses), np.array(want), rtol=1e-10, what="losses")
        pipe_stats = counter.per_comm.get(plan.pipeline_comm.Get_name())
        assert_equal(grid, pipe_stats.messages if pipe_stats is not None else 0, 0, "whole blocks to the counterpart")
        sizes = [3, 2, 2]
        pieces = 0
        r = plan.pipeline_rank
        ranks = [tuple(grid.rank_of((s, q)) for q in range(mgrid.size)) for s in range(p)]
        for s in range(1, p):  # boundary s-1 -> s: pieces sent forward (rank s-1) and back (rank s)
            if r not in (s - 1, s):
                continue
            for n in sizes:
                src = hpctp.Layout(
                    (n, C, FH, FW), mgrid.dims, (None, None, 0, None) if s == 1 else (None, None, None, 0)
                )
                dst = model._relayout[s].target(src)
                if r == s - 1:
                    pieces += len(hpctp.layout.group_transfer_plan(src, ranks[s - 1], dst, ranks[s], grid.rank).sends)
                else:
                    pieces += len(hpctp.layout.group_transfer_plan(dst, ranks[s], src, ranks[s - 1], grid.rank).sends)
        world = counter.per_comm.get(plan.grid.comm.Get_name())
        got = world.calls.get("Isend", 0) if world is not None else 0
        assert_equal(grid, got, pieces, f"pieces sent by pipeline rank {r}")
        plan.free()
