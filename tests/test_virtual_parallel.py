"""The data-parallel and pipeline wrappers on a virtual grid: one training step's messages equal the real run's.

Each test builds its model on ``meta`` and the wrapper on the real grid (materialized on the CPU, float64) and on its
virtual twin playing this rank (left on ``meta``: :meth:`hpctp.ProcessGrid.virtual`), runs one full step on both
(forward, :func:`hpctp.nn.global_mse_loss`, backward, the wrapper's gradient messages, ``torch.optim.Adam``'s step,
``zero_grad``) and compares every communicator's calls, bytes and messages (:func:`helpers.virtual.same_messages`).
The data groups hold equal shares of the batch (the virtual grid's convention: the peers of the rank played hold as
much as it does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.sharded import local_batch, make_model
from helpers.virtual import same_messages
from mpi4py import MPI

import hpctp
from hpctp.nn import ParallelPlan, PipelineParallel, ShardedDataParallel, global_mse_loss
from hpctp.testing import assert_all

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
F64 = torch.float64
Step = Callable[[hpctp.ProcessGrid, torch.device, torch.dtype], Callable[[], Any]]


def _on(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Local. ``x`` on ``device`` (``meta``: its shape only)."""
    return torch.empty_like(x, device=device) if device.type == "meta" else x.to(device)


def _sent(counts: dict, name: str | None = None) -> int:
    """Local. Bytes this rank sent on communicator ``name`` (on all of them by default)."""
    return sum(c[0] for k, c in counts.items() if name is None or k == name)


def _adam(params: Any) -> torch.optim.Adam:
    """Local. The step's optimizer."""
    return torch.optim.Adam(params, lr=0.05)


# ---------------------------------------------------------------------- ShardedDataParallel

SEED = 2  # helpers.sharded's spatial model: its one torch.nn.Linear is drawn right after manual_seed(2)


def _sdp_step(stage: int) -> Step:
    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:  # noqa: ARG001
        plan = ParallelPlan(grid, data=(0,))
        with torch.device("meta"):
            model = make_model(plan, "spatial")  # Conv2d (rows over the spatial axis) -> Linear -> LayerNorm -> Conv2d
        sdp = ShardedDataParallel(model, plan, stage=stage, seed=SEED, bucket_mib=1e-4, device=device)
        opt = _adam(sdp.parameters())
        x, y = (_on(t, device) for t in local_batch(plan, "spatial", 0))

        def run() -> None:
            loss = global_mse_loss(sdp(x), y, plan.grid, plan.loss_axes)
            loss.backward()
            sdp.step(opt)
            sdp.zero_grad()

        return run

    return step


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sharded_data_parallel_step(grid2d: hpctp.ProcessGrid, stage: int) -> None:
    """ZeRO stage 0-3 over data axis 0 and spatial axis 1, several buckets: one Adam step (gradient all-reduces or
    reduce-scatters, the spatial sums, the slices' all-gathers, stage 3's gathers of each unit)."""
    counts = same_messages(grid2d, _sdp_step(stage), f"ShardedDataParallel(stage={stage})")
    data = "hpctp.grid" if grid2d.dims[1] == 1 else "hpctp.grid.axis0"  # (a 2 x 1 grid's axis 0 is the grid)
    if grid2d.dims[0] > 1 and stage > 0:
        assert_all(grid2d, _sent(counts, data) > 0, f"stage {stage} on {grid2d.dims}: no data-axis message {counts}")
    if grid2d.size > 1:
        assert_all(grid2d, _sent(counts) > 0, f"stage {stage} on {grid2d.dims} sent nothing: {counts}")


# ---------------------------------------------------------------------- PipelineParallel

N, M, E = 8, 4, 8  # 8 samples (even over 1, 2 and 4 data groups) in 4 micro-batches, 8 features
BLOCKS = 8  # Linear + Tanh blocks: every stage holds parameters, up to 8 stages (4 ranks interleaved twice)


def _chain() -> list[torch.nn.Module]:
    """Local. ``BLOCKS`` blocks of Linear and Tanh (on the device of the caller's ``torch.device`` context)."""
    return [torch.nn.Sequential(torch.nn.Linear(E, E, dtype=F64), torch.nn.Tanh()) for _ in range(BLOCKS)]


def _pipeline_step(schedule: str, zero: int | None) -> Step:
    virtual = 2 if schedule == "interleaved" else 1

    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:  # noqa: ARG001
        plan = ParallelPlan(grid, data=(1,), pipeline=0)
        with torch.device("meta"):
            layers = _chain()
        pipe = PipelineParallel(
            layers, plan, schedule=schedule, microbatches=M, virtual=virtual, zero=zero, seed=0, device=device
        )
        opt = _adam(pipe.parameters())
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(N, E, generator=g, dtype=F64), torch.randn(N, E, generator=g, dtype=F64)
        a, b = plan.sample_range(N)
        x, y = _on(x[a:b].contiguous(), device), _on(y[a:b].contiguous(), device)

        def loss_fn(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return global_mse_loss(pred, target, plan.grid, plan.loss_axes)

        def run() -> None:
            pipe.step(x, y, loss_fn, optimizer=opt)
            pipe.zero_grad()

        return run

    return step


def _pipeline_grids() -> list[tuple[int, int]]:
    """Local. The (pipeline, data) shapes of this job: 2 stages x the rest as data groups, and every rank a stage."""
    p = 2 if WORLD.size % 2 == 0 else WORLD.size
    return list(dict.fromkeys([(p, WORLD.size // p), (WORLD.size, 1)]))


@pytest.mark.parametrize("dims", _pipeline_grids(), ids=lambda d: "x".join(map(str, d)))
@pytest.mark.parametrize(
    ("schedule", "zero"), [("gpipe", None), ("1f1b", None), ("interleaved", None), ("zero_bubble", None), ("1f1b", 1)]
)
def test_pipeline_parallel_step(dims: tuple[int, int], schedule: str, zero: int | None) -> None:
    """Every schedule over pipeline axis 0 and data axis 1 (ZeRO 1 per stage once): one step, whose first messages
    at each boundary describe the activation (the virtual grid infers it from the layers' shapes)."""
    with hpctp.ProcessGrid(dims) as grid:
        counts = same_messages(grid, _pipeline_step(schedule, zero), f"PipelineParallel({schedule}, zero={zero})")
        pipe_comm = "hpctp.grid" if dims[1] == 1 else "hpctp.grid.axis0"
        if dims[0] > 1:
            assert_all(grid, _sent(counts, pipe_comm) > 0, f"{schedule} on {dims}: no pipeline message {counts}")


# ---------------------------------------------------------------------- sync_gradients


class _Unused(torch.nn.Module):
    """Local. A Linear and a parameter that no forward uses (its gradient stays None on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(E, E, dtype=F64)
        self.unused = torch.nn.Parameter(torch.zeros(3, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _sync_step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:  # noqa: ARG001
    torch.manual_seed(0)
    model = _Unused().to(device)
    opt = _adam(model.parameters())
    x, y = (_on(torch.randn(2, E, dtype=F64), device) for _ in range(2))

    def run() -> None:
        global_mse_loss(model(x), y, grid).backward()
        hpctp.nn.sync_gradients(model, grid)
        assert model.unused.grad is None
        opt.step()
        opt.zero_grad()

    return run


def test_sync_gradients_step(grid2d: hpctp.ProcessGrid) -> None:
    """Plain data parallelism (every axis a data axis), a parameter without a gradient: one all-reduce of the
    gradients and their flags, and an Adam step."""
    counts = same_messages(grid2d, _sync_step, "sync_gradients")
    if grid2d.size > 1:
        assert_all(grid2d, _sent(counts, "hpctp.grid") > 0, f"sync_gradients on {grid2d.dims} sent nothing: {counts}")


def _tensor_grids() -> list[tuple[int, int]]:
    """Local. The (data, tensor) shapes of this job with both axes split (4 ranks and more)."""
    return [(WORLD.size // 2, 2)] if WORLD.size >= 4 and WORLD.size % 2 == 0 else []


def _sdp_tensor_step(stage: int) -> Step:
    def step(grid: hpctp.ProcessGrid, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:  # noqa: ARG001
        plan = ParallelPlan(grid, data=(0,), tensor=(1,))
        with torch.device("meta"):
            model = make_model(plan, "tensor")  # Linear -> ParallelMLP (hidden units over the tensor axis) -> LayerNorm
        sdp = ShardedDataParallel(model, plan, stage=stage, seed=6, bucket_mib=1e-4, device=device)
        opt = _adam(sdp.parameters())
        x, y = (_on(t, device) for t in local_batch(plan, "tensor", 0))

        def run() -> None:
            global_mse_loss(sdp(x), y, plan.grid, plan.loss_axes).backward()
            sdp.step(opt)
            sdp.zero_grad()

        return run

    return step


@pytest.mark.parametrize("dims", _tensor_grids(), ids=lambda d: "x".join(map(str, d)))
@pytest.mark.parametrize("stage", [0, 3])
def test_sharded_data_parallel_tensor_step(dims: tuple[int, int], stage: int) -> None:
    """ZeRO 0 and 3 over data axis 0 with a ParallelMLP split over tensor axis 1: one Adam step."""
    with hpctp.ProcessGrid(dims) as grid:
        counts = same_messages(grid, _sdp_tensor_step(stage), f"ShardedDataParallel(stage={stage}), tensor axis")
        assert_all(grid, _sent(counts) > 0, f"stage {stage} on {dims} sent nothing: {counts}")
